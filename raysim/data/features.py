"""Frozen image features, computed once per (model, weights, dataset, transform) and cached on disk.

Pooled features (N, D) float32 are what every CLIP prompt-tuning method sees. Token sequences (N, K, width)
float16 (the ViT's CLS and patch tokens, or a CNN's last feature map) are opt-in: only methods that attend
over them (FedSEPT's patch router) ask for them, and they live in a separate file, because they are large
(ViT-B/16: 197 x 768 x 2 bytes = 296 KiB per image)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Optional

import torch

from raysim.data.base import DatasetBundle

log = logging.getLogger(__name__)


def feature_cache_path(cache_dir: str, model_key: str, bundle: DatasetBundle, image_size: int, kind: str = "clip-eval") -> Path:
    key = hashlib.sha256(f"{model_key}|{bundle.signature or bundle.name}|{image_size}|{kind}".encode()).hexdigest()[:20]
    suffix = "" if kind == "clip-eval" else f"-{kind}"
    return Path(cache_dir).expanduser() / "features" / f"{bundle.name}-{key}{suffix}.pt"


def _load(path: Path, bundle: DatasetBundle) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        from raysim.safeio import read_regular, safe_load

        blob = safe_load(read_regular(path, root=path.parent))  # a regular file, size-capped; plain data only
        if blob["train"].shape[0] == len(bundle.train) and blob["test"].shape[0] == len(bundle.test):
            return blob
    except Exception as e:  # a truncated file from an interrupted run: recompute
        log.warning("ignoring unreadable feature cache %s (%s)", path, e)
    return None


def _save(path: Path, blob: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(blob, tmp)
    os.replace(tmp, path)  # atomic: a concurrent reader never sees a partial file


def cached_image_features(
    bundle: DatasetBundle,
    *,
    model_spec,
    image_size: int,
    cache_dir: str,
    device: str | torch.device = "cpu",
    progress: bool = False,
    tokens: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(train_features, test_features), L2-normalised, loaded from the cache or computed and stored.

    With `tokens=True`: (train_features, test_features, train_tokens, test_tokens), the tokens (N, K, width)
    in float16 from the same forward pass (`raysim.models.clip.image_tokens`)."""
    from raysim.models.clip import encode_images, load_clip

    key = model_spec.key()
    path = feature_cache_path(cache_dir, key, bundle, image_size)
    tok_path = feature_cache_path(cache_dir, key, bundle, image_size, kind="tokens")
    feats = _load(path, bundle)
    toks = _load(tok_path, bundle) if tokens else None
    if feats is not None and (not tokens or toks is not None):
        return (feats["train"], feats["test"]) + ((toks["train"], toks["test"]) if toks is not None else ())
    model = load_clip(model_spec, device=device)
    blob, tok_blob = {}, {}
    for split, images in (("train", bundle.train.images), ("test", bundle.test.images)):
        out = encode_images(model, images, device=str(device), progress=progress, desc=f"{split} features", tokens=tokens)
        if tokens:
            blob[split], tok_blob[split] = out
        else:
            blob[split] = out
    _save(path, blob)
    if tokens:
        _save(tok_path, tok_blob)
        log.info("cached image tokens %s (%s per image)", tok_path, tuple(tok_blob["train"].shape[1:]))
        return blob["train"], blob["test"], tok_blob["train"], tok_blob["test"]
    return blob["train"], blob["test"]
