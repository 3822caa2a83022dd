"""Private prototype release: IGPP (vpdr.txt Eq. 4-6) and VPP (vpdr.txt Eq. 7-14, SPEC 3.2).

Pure functions of tensors and a seeded `torch.Generator`; no Ray, no module state. Noise is drawn on
the generator's device (CPU by default) and moved to the features' device.

Adjacency is replace-one on the client's dataset, so a centre with n members has L2 sensitivity
2R/n. Clustered centres (FPL/FedPLVM) pass `assignments`, a per-example cluster id within its class;
each centre's sensitivity then uses its own member count (SPEC 3.2 step 6).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from raysim.errors import ConfigError

from .accountant import gaussian_rdp_sigma

# ---------------------------------------------------------------------------------------- helpers


def _randn(shape: tuple[int, ...], generator: torch.Generator | None, like: Tensor) -> Tensor:
    dev = generator.device if generator is not None else torch.device("cpu")
    return torch.randn(shape, generator=generator, device=dev, dtype=torch.float64).to(device=like.device)


def laplace_noise(n: int, scale: float, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """Laplace(0, scale) as scale * (E1 - E2) with E ~ Exp(1) from uniforms in [0, 1)."""
    dev = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand((2, n), generator=generator, device=dev, dtype=torch.float64)
    e = -torch.log1p(-u)  # 1 - u in (0, 1]: finite
    return (scale * (e[0] - e[1])).to(device)


def l2_clip(features: Tensor, R: float) -> Tensor:
    """Per-row z * min(1, R / ||z||)."""
    norms = features.norm(dim=-1, keepdim=True)
    return features * (R / norms.clamp_min(1e-12)).clamp(max=1.0)


def _check_xy(features: Tensor, labels: Tensor) -> None:
    if features.dim() != 2:
        raise ValueError(f"features must have shape (n, d), got {tuple(features.shape)}")
    if labels.dim() != 1 or labels.shape[0] != features.shape[0]:
        raise ValueError(f"labels must have shape ({features.shape[0]},), got {tuple(labels.shape)}")


def _centres(
    clipped: Tensor, labels: Tensor, assignments: Tensor | None
) -> dict[int, tuple[Tensor, Tensor]]:
    """class -> (centres (K_c, d), member counts (K_c,)); K_c = 1 without assignments."""
    out: dict[int, tuple[Tensor, Tensor]] = {}
    for c in sorted(int(v) for v in torch.unique(labels).tolist()):
        mask = labels == c
        zc = clipped[mask]
        if assignments is None:
            out[c] = (zc.mean(dim=0, keepdim=True), torch.tensor([zc.shape[0]]))
            continue
        ac = assignments[mask]
        ids = sorted(int(v) for v in torch.unique(ac).tolist())
        cents, counts = [], []
        for k in ids:
            m = ac == k
            cents.append(zc[m].mean(dim=0))
            counts.append(int(m.sum()))
        out[c] = (torch.stack(cents), torch.tensor(counts))
    return out


def _pack(c_centres: Tensor, clustered: bool) -> Tensor:
    return c_centres if clustered else c_centres[0]


def stack_centres(protos: dict[int, Tensor]) -> Tensor:
    """(M, d) the (K_c, d) centres of a clustered release, class by class in increasing order and within a
    class by cluster id (the order `assignments` numbers them)."""
    return torch.cat([protos[c].reshape(-1, protos[c].shape[-1]).detach().float().cpu() for c in sorted(protos)])


def clean_centres(features: Tensor, labels: Tensor, assignments: Tensor) -> Tensor:
    """(M, d) un-noised, un-clipped cluster centres (DP off), in stack_centres' order."""
    _check_xy(features, labels)
    return stack_centres({c: cents for c, (cents, _) in _centres(features, labels, assignments).items()})


# ------------------------------------------------------------------------------------------- IGPP


def igpp_release(
    features: Tensor,
    labels: Tensor,
    *,
    clip: float,
    sigma: float,
    generator: torch.Generator | None,
    assignments: Tensor | None = None,
) -> dict[int, Tensor]:
    """Isotropic Gaussian prototype perturbation: per-example L2 clip to `clip` (= R), per-class mean
    (or per-cluster centres when `assignments` is given), noise N(0, (sigma * 2R/n)^2 I) per centre.

    Returns class -> noisy prototype (d,), or (K_c, d) centres when `assignments` is given. Calibrate
    `sigma` through the ledger's accountant (privacy/host.py does it for runs)."""
    _check_xy(features, labels)
    if not clip > 0:
        raise ConfigError(f"clip must be > 0, got {clip}")
    if not sigma >= 0:
        raise ConfigError(f"sigma must be >= 0, got {sigma}")
    clipped = l2_clip(features, clip)
    out: dict[int, Tensor] = {}
    for c, (cents, counts) in _centres(clipped, labels, assignments).items():
        if sigma > 0:
            std = (sigma * 2.0 * clip / counts.double()).to(cents.device).unsqueeze(1)
            cents = cents + (_randn(tuple(cents.shape), generator, cents) * std).to(cents.dtype)
        out[c] = _pack(cents, assignments is not None)
    return out


# -------------------------------------------------------------------------------------------- VPP


def discriminativeness_scores(features: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """ANOVA-style score per dimension, S_j = [V_ter_j / (C-1)] / [V_tra_j / (n-C) + zeta]
    (vpdr.txt Eq. 7-8, SPEC 3.2 step 2), with C the number of classes present and
    zeta = 1e-3 * median_j(V_ter_j) + 1e-15. Zero when C <= 1 or n <= C. Uses raw features."""
    _check_xy(features, labels)
    n, d = features.shape
    z = features.detach().double()
    counts = torch.bincount(labels.long().cpu(), minlength=int(num_classes))
    present = [c for c in range(counts.shape[0]) if counts[c] > 0]
    C = len(present)
    if C <= 1 or n <= C:
        return torch.zeros(d, dtype=features.dtype, device=features.device)
    mus, ns = [], []
    v_tra = torch.zeros(d, dtype=torch.float64, device=z.device)
    for c in present:
        zc = z[labels == c]
        mu_c = zc.mean(dim=0)
        v_tra = v_tra + (zc - mu_c).pow(2).sum(dim=0)  # = (n_c - 1) s^2_c (unbiased s^2)
        mus.append(mu_c)
        ns.append(zc.shape[0])
    mus_t = torch.stack(mus)
    ns_t = torch.tensor(ns, dtype=torch.float64, device=z.device)
    mu = (ns_t.unsqueeze(1) * mus_t).sum(dim=0) / n
    v_ter = (ns_t.unsqueeze(1) * (mus_t - mu).pow(2)).sum(dim=0)
    zeta = 1e-3 * torch.median(v_ter) + 1e-15
    s = (v_ter / (C - 1)) / (v_tra / (n - C) + zeta)
    return s.to(features.dtype)


def topk_laplace_scale(*, k: int, H: float, epsilon1: float, rounds: int) -> float:
    """lambda = 2 k H T / epsilon1 (vpdr.txt Eq. 9); 0 when epsilon1 is inf."""
    if math.isinf(epsilon1):
        return 0.0
    return 2.0 * k * H * rounds / epsilon1


def private_topk_partition(
    scores: Tensor, *, k: int, H: float, epsilon1: float, rounds: int, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """One-shot Laplace top-k (SPEC 3.2 step 3): clip scores to [0, H], add i.i.d. Laplace(lambda)
    with lambda = 2 k H T / epsilon1, return (I_A = the k largest, I_B = the rest), both sorted."""
    if scores.dim() != 1:
        raise ValueError(f"scores must have shape (d,), got {tuple(scores.shape)}")
    d = scores.shape[0]
    if not (1 <= int(k) <= d):
        raise ConfigError(f"k must lie in [1, {d}], got {k}")
    if not H > 0:
        raise ConfigError(f"score cap H must be > 0, got {H}")
    if not epsilon1 > 0:
        raise ConfigError(f"epsilon1 must be > 0, got {epsilon1}")
    if int(rounds) < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    lam = topk_laplace_scale(k=int(k), H=H, epsilon1=epsilon1, rounds=int(rounds))
    noisy = scores.detach().double().clamp(0.0, H)
    if lam > 0:
        noisy = noisy + laplace_noise(d, lam, generator, noisy.device)
    top = torch.topk(noisy, int(k)).indices
    mask = torch.zeros(d, dtype=torch.bool, device=scores.device)
    mask[top.to(scores.device)] = True
    idx = torch.arange(d, device=scores.device)
    return idx[mask], idx[~mask]


def group_kappas(d: int, d_A: int) -> tuple[float, float]:
    return math.sqrt(d_A / d), math.sqrt((d - d_A) / d)


def group_clip(features: Tensor, idx_A: Tensor, idx_B: Tensor, R: float) -> Tensor:
    """Clip z_A to R_A = R sqrt(d_A/d) and z_B to R_B = R sqrt(d_B/d) independently (SPEC 3.2 step 4)."""
    d = features.shape[-1]
    kA, kB = group_kappas(d, int(idx_A.numel()))
    out = features.clone()
    if idx_A.numel():
        out[..., idx_A] = l2_clip(features[..., idx_A], R * kA)
    if idx_B.numel():
        out[..., idx_B] = l2_clip(features[..., idx_B], R * kB)
    return out


def vpp_sigmas(sigma_ref: float, d: int, d_A: int) -> tuple[float, float]:
    """(sigma_A, sigma_B) = (sigma_ref / sqrt(w_A), sigma_ref / sqrt(w_B)) with
    w_A = kappa_B / (kappa_A + kappa_B) (vpdr.txt Eq. 12-13). These multiply the group
    sensitivities Delta_A = Delta kappa_A and Delta_B = Delta kappa_B."""
    if not (0 < d_A < d):
        raise ConfigError(f"d_A must lie in (0, {d}), got {d_A}")
    kA, kB = group_kappas(d, d_A)
    wA = kB / (kA + kB)
    wB = 1.0 - wA
    return sigma_ref / math.sqrt(wA), sigma_ref / math.sqrt(wB)


def _check_vpp_args(features: Tensor, labels: Tensor, *, centres: str, assignments: Tensor | None, rho: float,
                    r_split: float, R: float, epsilon: float) -> None:
    _check_xy(features, labels)
    if centres not in ("mean", "cluster"):
        raise ConfigError(f"centres must be 'mean' or 'cluster', got {centres!r}")
    if centres == "cluster" and assignments is None:
        raise ConfigError("centres='cluster' needs per-example cluster assignments")
    if centres == "mean" and assignments is not None:
        raise ConfigError("cluster assignments were given with centres='mean' (the class means ignore them): "
                          "pass centres='cluster' for the cluster centres, or no assignments")
    if not rho > 0:
        raise ConfigError(f"rho must lie in (0, 0.5], got {rho}")
    if not (0 < r_split < 1):
        raise ConfigError(f"r_split must lie in (0, 1), got {r_split}")
    if not R > 0:
        raise ConfigError(f"R must be > 0, got {R}")
    if not epsilon > 0:
        raise ConfigError(f"epsilon must be > 0, got {epsilon}")
    if features.shape[1] < 2:
        raise ConfigError("VPP needs feature dimension >= 2")


def _vpp_coordinate_multipliers(d: int, idx_A: Tensor, idx_B: Tensor, sigma_A: float, sigma_B: float) -> Tensor:
    """Per-coordinate noise multiplier: sigma_A kappa_A on I_A, sigma_B kappa_B on I_B (times Delta = 2R/n_k)."""
    kA, kB = group_kappas(d, int(idx_A.numel()))
    coord = torch.empty(d, dtype=torch.float64)
    coord[idx_A.cpu()] = sigma_A * kA
    coord[idx_B.cpu()] = sigma_B * kB
    return coord


def _noisy_centres(clipped: Tensor, labels: Tensor, assignments: Tensor | None, *, R: float, coord: Tensor | None,
                   generator: torch.Generator | None) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """Class means (or cluster centres) of the group-clipped features, each noised with std
    (2R / n_k) * coord per coordinate (no noise when coord is None)."""
    protos: dict[int, Tensor] = {}
    counts_out: dict[int, Tensor] = {}
    for c, (cents, counts) in _centres(clipped, labels, assignments).items():
        if coord is not None:
            delta_k = (2.0 * R / counts.double()).unsqueeze(1)  # (K_c, 1)
            std = (delta_k * coord.unsqueeze(0)).to(cents.device)
            cents = cents + (_randn(tuple(cents.shape), generator, cents) * std).to(cents.dtype)
        protos[c] = _pack(cents, assignments is not None)
        counts_out[c] = counts
    return protos, counts_out


def vpp_release(
    features: Tensor,
    labels: Tensor,
    *,
    R: float,
    rho: float,
    H: float,
    epsilon: float,
    rounds: int,
    delta: float,
    r_split: float = 0.1,
    generator: torch.Generator | None,
    centres: str = "mean",
    assignments: Tensor | None = None,
    num_classes: int | None = None,
    sigma_ref: float | None = None,
) -> dict[str, Any]:
    """One round of VPP for one client (SPEC 3.2 steps 2-7).

    epsilon is the client's total budget over `rounds` rounds: epsilon1 = r_split * epsilon goes to
    the Laplace top-k partition, epsilon2 = (1 - r_split) * epsilon to the Gaussian release (sigma_ref
    by `gaussian_rdp_sigma`, the VPDR code's calibration, unless the host passes `sigma_ref` calibrated by
    the ledger's accountant). rho is clamped to at most 0.5 as in the code. `centres` is "mean" (class
    means) or "cluster" (centres from `assignments`, per-example cluster ids within the class).

    Returns a dict: prototypes (class -> (d,) or (K_c, d)), counts (class -> (K_c,) member counts),
    idx_A, idx_B, sigma_ref, sigma_A, sigma_B, lambda, epsilon1, epsilon2, scores."""
    _check_vpp_args(features, labels, centres=centres, assignments=assignments, rho=rho, r_split=r_split, R=R, epsilon=epsilon)
    n, d = features.shape
    k = min(max(1, math.ceil(min(float(rho), 0.5) * d)), d - 1)  # rho clamped to 0.5 as in the code
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if n else 0
    eps1 = r_split * epsilon
    eps2 = (1.0 - r_split) * epsilon

    scores = discriminativeness_scores(features, labels, num_classes)
    idx_A, idx_B = private_topk_partition(scores, k=k, H=H, epsilon1=eps1, rounds=rounds, generator=generator)
    clipped = group_clip(features, idx_A, idx_B, R)
    if sigma_ref is None:
        sigma_ref = gaussian_rdp_sigma(epsilon=eps2, delta=delta, releases=rounds)
    sigma_A, sigma_B = vpp_sigmas(sigma_ref, d, k) if sigma_ref > 0 else (0.0, 0.0)
    coord = _vpp_coordinate_multipliers(d, idx_A, idx_B, sigma_A, sigma_B)
    protos, counts_out = _noisy_centres(clipped, labels, assignments, R=R, coord=coord if sigma_ref > 0 else None,
                                        generator=generator)
    return {
        "prototypes": protos,
        "counts": counts_out,
        "idx_A": idx_A,
        "idx_B": idx_B,
        "sigma_ref": sigma_ref,
        "sigma_A": sigma_A,
        "sigma_B": sigma_B,
        "lambda": topk_laplace_scale(k=k, H=H, epsilon1=eps1, rounds=rounds),
        "epsilon1": eps1,
        "epsilon2": eps2,
        "scores": scores,
    }
