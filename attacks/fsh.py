"""Feature-space hijacking (FSH) of a released prototype (vpdr.txt section 5.4 and E.6.1, SPEC 3.7).

Threat model (white box): the server knows the client's feature extractor f (backbone + adapter, or the
whole zoo model's feature path) and head, and sees the client's (noisy) prototype p~_c of class c. For up
to 3 classes of a client it optimises a batch of 16 dummy images x_1..x_16 (Gaussian start in the
normalised input space, clamped to the valid pixel range after every step) so that each dummy's pooled
feature f(x_i) matches p~_c:

    loss = mean_i MSE(f(x_i), p~_c)  (or mean_i 1 - cos(f(x_i), p~_c))  +  tv_weight * TV(x),

Adam at lr 0.01, TV weight 1e-3, up to `max_steps` (SPEC: 100k) steps, stopped early once `patience` (500)
steps brought no improvement of the best loss by more than `tol` (1e-6), never before `min_steps` (100).

Metrics of one attack (class c), as the paper's table (SPEC 3.7 [decide]):
  Cos Sim    mean_i cos(f(x_i), p_c), p_c the client's *clean* prototype (the class mean of its raw features)
  cFFD       Frechet distance between the Gaussian fits of {f(x_i)} and of the client's real class-c
             features (higher: the reconstructions look less like the class)
  Top-1 Hit  % of the dummies the client's own classifier labels c

In a run (`raysim audit`) the model is the one behind the release: most prototype methods release after
their local training, so the client's state saved at the end of round r is the extractor behind its
round-r release; the VPDR frameworks release first (SPEC 3.4), so theirs is the state the client entered
round r with (`RunFolder.releasing_state`). Pure functions of tensors, a model and a seeded generator here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.attacks.base import Release, ReleaseAttack, clients_then_rounds, register_attack
from raysim.attacks.gradient_inversion import pixel_range, total_variation

Extractor = Callable[[Tensor], Tensor]  # images (B, 3, S, S), normalised -> pooled features (B, d)


@dataclass(frozen=True)
class FSHConfig:
    """The attack's knobs (SPEC 3.7 defaults)."""

    dummies: int = 16
    classes: int = 3
    lr: float = 0.01
    tv_weight: float = 1e-3
    objective: str = "mse"  # mse | cos
    max_steps: int = 100_000
    patience: int = 500
    min_steps: int = 100
    tol: float = 1e-6

    def __post_init__(self) -> None:
        from raysim.errors import ConfigError

        if self.objective not in ("mse", "cos"):
            raise ConfigError(f"fsh objective must be mse or cos, got {self.objective!r}")
        if self.dummies < 2 or self.classes < 1 or not self.lr > 0 or self.tv_weight < 0:
            raise ConfigError("fsh: dummies >= 2 (cFFD needs a covariance), classes >= 1, lr > 0, tv_weight >= 0")
        if self.max_steps < 1 or self.patience < 1 or self.min_steps < 0 or self.tol < 0:
            raise ConfigError("fsh: max_steps >= 1, patience >= 1, min_steps >= 0, tol >= 0")


@dataclass
class Hijack:
    images: Tensor  # (B, 3, S, S), normalised: the best dummies seen
    features: Tensor  # (B, d) their features
    loss: float
    steps: int
    start_features: Tensor  # (B, d) the features of the starting (random, clamped) dummies: the no-leak reference


def _objective(feats: Tensor, target: Tensor, images: Tensor, cfg: FSHConfig) -> Tensor:
    t = target.to(feats.dtype).expand_as(feats)
    match = F.mse_loss(feats, t) if cfg.objective == "mse" else (1 - F.cosine_similarity(feats, t, dim=-1)).mean()
    return match + cfg.tv_weight * total_variation(images)


def hijack(extractor: Extractor, target: Tensor, *, shape: tuple[int, ...], generator: torch.Generator,
           cfg: FSHConfig = FSHConfig(), low: Optional[Tensor] = None, high: Optional[Tensor] = None) -> Hijack:
    """Dummy images (cfg.dummies of `shape` = (3, S, S)) whose features match `target` (d,); the batch
    with the lowest loss seen is returned. `low` / `high`: the valid normalised pixel range (default the
    CLIP normalisation's, that of raysim's image inputs), broadcastable to (B, 3, S, S)."""
    if low is None or high is None:
        low, high = pixel_range()
    device = target.device
    low, high = low.to(device), high.to(device)
    x = torch.randn((cfg.dummies, *shape), generator=generator).to(device)
    x = torch.max(torch.min(x, high), low).requires_grad_(True)
    with torch.no_grad():
        start = extractor(x).detach()
    opt = torch.optim.Adam([x], lr=cfg.lr)
    best, best_x = math.inf, x.detach().clone()  # the lowest loss seen and its images
    ref, since, step = math.inf, 0, 0  # the early-stopping reference: improved by more than tol
    for step in range(1, cfg.max_steps + 1):
        loss = _objective(extractor(x), target, x, cfg)
        value = float(loss.detach())
        if value < best:
            best, best_x = value, x.detach().clone()
        if value < ref - cfg.tol:
            ref, since = value, 0
        else:
            since += 1
        if step >= cfg.min_steps and since >= cfg.patience:
            break
        (x.grad,) = torch.autograd.grad(loss, [x])
        opt.step()
        with torch.no_grad():
            x.copy_(torch.max(torch.min(x, high), low))
    with torch.no_grad():
        feats = extractor(best_x)
        final = float(_objective(feats, target, best_x, cfg))
    return Hijack(best_x, feats.detach(), final, step, start)


# -- metrics ------------------------------------------------------------------------------------

def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^{1/2}) of the Gaussian fits of the rows of a and b
    (unbiased covariances).

    With U = (a - mean) / sqrt(n_a - 1) and V likewise (rows), S_a = U^T U and S_b = V^T V; the non-zero
    eigenvalues of S_a S_b are those of (U V^T)(U V^T)^T, so Tr (S_a S_b)^{1/2} is the sum of the singular
    values of U V^T (taken through the QR factors of U and V, at most d x d): exact, cheap for 16 dummies
    in 512 dimensions, and fine with singular covariances (fewer rows than columns)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or len(a) < 2 or len(b) < 2:
        raise ValueError(f"need two sets of >= 2 rows of the same width, got {a.shape} and {b.shape}")
    mu = a.mean(0) - b.mean(0)
    U, V = (a - a.mean(0)) / math.sqrt(len(a) - 1), (b - b.mean(0)) / math.sqrt(len(b) - 1)
    # U V^T = Q_u R_u R_v^T Q_v^T: the same singular values as R_u R_v^T, at most min(n, d) square
    ru, rv = np.asarray(np.linalg.qr(U, mode="r")), np.asarray(np.linalg.qr(V, mode="r"))
    cross = float(np.linalg.svd(ru @ rv.T, compute_uv=False).sum())
    return float(mu @ mu + (U * U).sum() + (V * V).sum() - 2 * cross)


@dataclass
class FSHMetrics:
    cos_sim: float
    cffd: float
    top1_hit: float  # percent
    # the same of the random starting dummies: what the metrics read when nothing leaks (features of any
    # images share a direction, e.g. after a ReLU, and a head biased to the client's largest classes hits them)
    start_cos_sim: float = math.nan
    start_top1_hit: float = math.nan

    def as_dict(self) -> dict[str, float]:
        return {"Cos Sim": self.cos_sim, "cFFD": self.cffd, "Top-1 Hit (%)": self.top1_hit,
                "start Cos Sim": self.start_cos_sim, "start Top-1 Hit (%)": self.start_top1_hit}


def fsh_metrics(features: Tensor, logits: Tensor, cls: int, clean: Tensor, real: Tensor) -> FSHMetrics:
    """Metrics of the reconstructions' features (B, d) and the client's classifier's logits on them
    (B, C), against class `cls`'s clean prototype (d,) and real class features (n, d)."""
    cos = F.cosine_similarity(features.double(), clean.double().expand_as(features), dim=-1).mean()
    hit = (logits.argmax(-1) == cls).double().mean() * 100
    return FSHMetrics(float(cos), frechet_distance(features.double().numpy(), real.double().numpy()), float(hit))


def attacked_classes(counts: Tensor, k: int) -> list[int]:
    """The (up to) k classes with the most samples behind the client's release (ties: lower id first)."""
    held = [(-float(n), c) for c, n in enumerate(counts.tolist()) if n > 0]
    return [c for _, c in sorted(held)[:k]]


def attack_client(extractor: Extractor, classify: Callable[[Tensor], Tensor], released: Tensor, counts: Tensor,
                  real_features: Tensor, real_labels: Tensor, *, shape: tuple[int, ...], cfg: FSHConfig = FSHConfig(),
                  seed: int = 0) -> dict[int, FSHMetrics]:
    """FSH on one client's release: class -> metrics, for its up to cfg.classes largest classes.
    `released` (C, d): the uploaded prototypes; `real_features` / `real_labels`: the client's own training
    features from the same extractor (the clean prototype is their class mean). `classify`: features ->
    logits of the client's own head. Each class draws its dummies from its own seeded stream."""
    out: dict[int, FSHMetrics] = {}
    for c in attacked_classes(counts, cfg.classes):
        real = real_features[real_labels == c]
        if len(real) < 2:
            continue
        h = hijack(extractor, released[c].float(), shape=shape, cfg=cfg,
                   generator=torch.Generator().manual_seed(seed * 100_003 + c))
        with torch.no_grad():
            logits, start_logits = classify(h.features).float().cpu(), classify(h.start_features).float().cpu()
        m = fsh_metrics(h.features.float().cpu(), logits, c, real.mean(0), real)
        ref = fsh_metrics(h.start_features.float().cpu(), start_logits, c, real.mean(0), real)
        m.start_cos_sim, m.start_top1_hit = ref.cos_sim, ref.top1_hit
        out[c] = m
    return out


# -- in the audit: each recorded prototype release, hijacked with the model behind it ---------------------------

FSH_COLUMNS = ("Cos Sim", "cFFD", "Top-1 Hit (%)")
FSH_REFERENCE = ("start Cos Sim", "start Top-1 Hit (%)")  # the random starting dummies (no leak)


@register_attack
class FeatureSpaceHijacking(ReleaseAttack):
    """FSH of every attacked client's release (options: an FSHConfig; SPEC 3.7 by default): Cos Sim, cFFD,
    Top-1 Hit and their no-leak reference (one row per round, client and class)."""

    name = "fsh"
    order = 20  # after the prototype MIA on each release
    summary_order = 5  # its columns first in audit_summary.csv (vpdr.txt's table order)

    def score(self, release: Release, *, seed: int, options: Any) -> tuple[list[dict[str, Any]], str, list[str]]:
        cfg = FSHConfig() if options is None else options
        r, cid, cdata, device = release.round, release.client, release.data, release.device
        with torch.enable_grad():
            per_class = attack_client(
                _on(release.extract, device), _on(release.classify, device), release.released.to(device), release.counts,
                release.train_features, cdata.y_train, shape=tuple(cdata.x_train.shape[1:]), cfg=cfg,
                seed=seed * 1_000_003 + r * 1009 + cid)
        rows = [{"round": r, "client": cid, "class": c, **m.as_dict()} for c, m in per_class.items()]
        note = ""
        if per_class:
            note = (f"; FSH {len(per_class)} classes: Cos Sim {np.mean([m.cos_sim for m in per_class.values()]):.3f}, "
                    f"Top-1 Hit {np.mean([m.top1_hit for m in per_class.values()]):.0f}%")
        return rows, note, []

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
        return clients_then_rounds(rows, FSH_COLUMNS + FSH_REFERENCE)


def _on(fn: Callable, device: Any) -> Callable[[Tensor], Tensor]:
    return lambda x: fn(x.to(device)).float()
