"""Frozen image features, computed once per (model, weights, dataset, transform) and cached on disk."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from raysim.data.base import DatasetBundle

log = logging.getLogger(__name__)


def feature_cache_path(cache_dir: str, model_key: str, bundle: DatasetBundle, image_size: int) -> Path:
    key = hashlib.sha256(f"{model_key}|{bundle.signature or bundle.name}|{image_size}|clip-eval".encode()).hexdigest()[:20]
    return Path(cache_dir).expanduser() / "features" / f"{bundle.name}-{key}.pt"


def cached_image_features(
    bundle: DatasetBundle,
    *,
    model_spec,
    image_size: int,
    cache_dir: str,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train_features, test_features), L2-normalised, loaded from the cache or computed and stored."""
    from raysim.models.clip import encode_images, load_clip

    path = feature_cache_path(cache_dir, model_spec.key(), bundle, image_size)
    if path.is_file():
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            if blob["train"].shape[0] == len(bundle.train) and blob["test"].shape[0] == len(bundle.test):
                return blob["train"], blob["test"]
        except Exception as e:  # a truncated file from an interrupted run: recompute
            log.warning("ignoring unreadable feature cache %s (%s)", path, e)
    model = load_clip(model_spec, device=device)
    train = encode_images(model, bundle.train.images, device=str(device), progress=progress, desc="train features")
    test = encode_images(model, bundle.test.images, device=str(device), progress=progress, desc="test features")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"train": train, "test": test}, tmp)
    os.replace(tmp, path)
    return train, test
