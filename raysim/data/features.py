"""Frozen image features, computed once per (model, weights, dataset, transform) and cached on disk.

Pooled features (N, D) float32 are what every CLIP prompt-tuning method sees. Token sequences (N, K, width)
float16 (the ViT's CLS and patch tokens, or a CNN's last feature map) are opt-in: only methods that attend
over them (FedSEPT's patch router) ask for them, and they live in a separate file, because they are large
(ViT-B/16: 197 x 768 x 2 bytes = 296 KiB per image).

Training augmentation (data.augment=official, raysim/data/augment.py): `cached_view_features` encodes V views
of every training image once, (N, V, D) (and (N, V, K, width) tokens when asked for), in files of their own whose
key holds the view count, the transform's tag and the seed the views are drawn from, so a changed setting never
reads a stale cache. The test split is never augmented."""

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


def views_kind(views: int, seed: int, *, tokens: bool = False) -> str:
    """The cache `kind` of the augmented views: their count, the transform's tag and the seed they come from."""
    from raysim.data.augment import TAG

    return f"{'tokens-' if tokens else ''}views{int(views)}-seed{int(seed)}-{TAG}"


def _load(path: Path, bundle: DatasetBundle, shapes: Optional[dict[str, tuple[int, ...]]] = None) -> Optional[dict]:
    if not path.is_file():
        return None
    want = shapes if shapes is not None else {"train": (len(bundle.train),), "test": (len(bundle.test),)}
    try:
        from raysim.safeio import read_regular, safe_load

        blob = safe_load(read_regular(path, root=path.parent))  # a regular file, size-capped; plain data only
        if all(tuple(blob[k].shape[: len(s)]) == s for k, s in want.items()):
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


def cached_view_features(
    bundle: DatasetBundle,
    *,
    views: int,
    seed: int,
    model_spec,
    image_size: int,
    cache_dir: str,
    device: str | torch.device = "cpu",
    progress: bool = False,
    tokens: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(train_views,) of shape (N, views, D), L2-normalised: the features of `views` augmented views of every
    training image (raysim/data/augment.py AugmentedViews, the transform in raysim/data/crop.py), loaded from the cache or computed
    once and stored.

    With `tokens=True`: (train_views, train_view_tokens), the tokens (N, views, K, width) in float16."""
    from raysim.data.augment import AugmentedViews
    from raysim.models.clip import encode_images, load_clip

    n, key = len(bundle.train), model_spec.key()
    path = feature_cache_path(cache_dir, key, bundle, image_size, kind=views_kind(views, seed))
    tok_path = feature_cache_path(cache_dir, key, bundle, image_size, kind=views_kind(views, seed, tokens=True))
    shape: dict[str, tuple[int, ...]] = {"train": (n, int(views))}
    feats = _load(path, bundle, shape)
    toks = _load(tok_path, bundle, shape) if tokens else None
    if feats is not None and (not tokens or toks is not None):
        return (feats["train"],) + ((toks["train"],) if toks is not None else ())
    data = AugmentedViews(bundle.train.images, views, seed)  # raises the helpful ConfigError before loading the model
    model = load_clip(model_spec, device=device)
    out = encode_images(model, data, device=str(device), progress=progress, desc=f"train features, {views} views", tokens=tokens)
    x = out[0] if tokens else out
    blob = {"train": x.reshape(n, int(views), *x.shape[1:])}
    _save(path, blob)
    log.info("cached %d augmented views of %d training images: %s", views, n, path)
    if not tokens:
        return (blob["train"],)
    t = out[1]
    tok_blob = {"train": t.reshape(n, int(views), *t.shape[1:])}
    _save(tok_path, tok_blob)
    return blob["train"], tok_blob["train"]
