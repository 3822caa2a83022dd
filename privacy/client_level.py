"""User-level DP for FedAvg-style updates: clip the whole model delta to C jointly over all tensors and
add N(0, (sigma C)^2) to every coordinate. The `client_update` mechanism (privacy/mechanisms/client_update.py) calls
this with sigma = 2 x its multiplier, because the replace-one sensitivity of a clipped update is 2C."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from raysim.errors import ConfigError


def update_norm(update: dict[str, Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in update.values()))


def clip_update(update: dict[str, Tensor], clip: float) -> dict[str, Tensor]:
    """Scale the whole update by min(1, C / ||update||) (joint L2 norm over all tensors)."""
    if not clip > 0:
        raise ConfigError(f"clip must be > 0, got {clip}")
    factor = min(1.0, clip / max(update_norm(update), 1e-12))
    return {k: t * factor for k, t in update.items()}


def noise_update(update: dict[str, Tensor], *, clip: float, sigma: float, generator: torch.Generator | None) -> dict[str, Tensor]:
    """Clip the update to C and add N(0, (sigma C)^2) noise to every coordinate. Noise is drawn in
    sorted key order from `generator` (reproducible), on its device, then moved."""
    if not sigma >= 0:
        raise ConfigError(f"sigma must be >= 0, got {sigma}")
    clipped = clip_update(update, clip)
    if sigma == 0:
        return clipped
    dev = generator.device if generator is not None else torch.device("cpu")
    out = dict(clipped)
    for k in sorted(clipped):
        t = clipped[k]
        z = torch.randn(t.shape, generator=generator, device=dev, dtype=torch.float32)
        out[k] = t + (sigma * clip * z).to(device=t.device, dtype=t.dtype)
    return {k: out[k] for k in update}
