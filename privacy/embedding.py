"""FedTSP's single-shot local DP release of text embeddings (fedtsp.txt section 3.5, SPEC 2.8 [decide]):
flatten, clip to L2 radius C, add isotropic Gaussian noise with the classic calibration
sigma = 2C sqrt(2 ln(1.25/delta)) / epsilon (sensitivity 2C under replace-one)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from raysim.errors import ConfigError

from .ledger import Release


def gaussian_sigma(*, epsilon: float, delta: float, clip: float) -> float:
    """Noise std (not a multiplier) of the classic Gaussian mechanism with sensitivity 2C; 0 for epsilon=inf.
    (The classic bound is proved for epsilon < 1; the paper also uses it for epsilon up to 8.)"""
    if not epsilon > 0:
        raise ConfigError(f"epsilon must be > 0 (inf turns DP off), got {epsilon}")
    if not (0 < delta < 1):
        raise ConfigError(f"delta must lie in (0, 1), got {delta}")
    if not clip > 0:
        raise ConfigError(f"clip must be > 0, got {clip}")
    if math.isinf(epsilon):
        return 0.0
    return 2.0 * clip * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def release_embeddings(emb: Tensor, *, clip: float, epsilon: float, delta: float, generator: torch.Generator | None) -> Tensor:
    """Clip_C(vec(emb)) + N(0, sigma^2 I), reshaped to emb's shape. epsilon=inf returns emb unchanged."""
    sigma = gaussian_sigma(epsilon=epsilon, delta=delta, clip=clip)
    if sigma == 0.0:
        return emb.clone()
    v = emb.detach().reshape(-1).double()
    v = v * min(1.0, clip / max(float(v.norm()), 1e-12))
    dev = generator.device if generator is not None else torch.device("cpu")
    noise = torch.randn(v.shape, generator=generator, device=dev, dtype=torch.float64).to(v.device)
    return (v + sigma * noise).reshape(emb.shape).to(emb.dtype)


def embedding_ledger_release(*, epsilon: float, round: int = 0) -> Release:
    """Ledger entry of the single-shot release: analysed classically, so it carries its epsilon."""
    return Release("embedding", 0.0, 1.0, 1, round, epsilon=float(epsilon))
