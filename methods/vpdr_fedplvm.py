"""FedPLVM (Wang et al., "prototype learning with variance mitigation") as the VPDR code runs it (SPEC 3.5).

Client   Uploads local FINCH centres: per class, FINCH (cosine, coarsest partition) over the client's
         (clipped) features; each centre is the mean of its members and carries its member count
         (its release sensitivity is 2R / n_k, SPEC 3.2 step 6).
         L = CE + 0.5 * (L_contra + L_corr), with f the (soft-clipped, under DCR) feature and, for every
         global centre m, s_alpha(f, m) = sign(cos) |cos|^alpha (alpha = 0.25, cos clamped to
         +-(1 - 1e-6)):
           L_contra = batch mean of -(1 / #pos) sum_{m of class y} log softmax_m(s_alpha / tau), tau = 0.07,
           L_corr   = batch mean of | sum_{m of class y} s_alpha - #pos |.
Server   FINCH again, per class, over all uploaded centres of that class (FPL's server step; the
         cluster_rate rule applies the same way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.methods.finch import finch_coarsest
from raysim.methods.vpdr_fpl import CLUSTER_RATE, cluster_per_class

ALPHA = 0.25
TAU = 0.07
WEIGHT = 0.5
SIM_EPS = 1e-6


def local_assignments(feats: Tensor, labels: Tensor, *, early_exit: bool = True) -> Tensor:
    """(N,) cluster id of each example within its class: the coarsest FINCH partition of that class's
    features (a class with one example is its own centre)."""
    out = torch.zeros(labels.shape[0], dtype=torch.long, device=labels.device)
    for c in labels.unique().tolist():
        m = labels == c
        out[m] = finch_coarsest(feats[m], early_exit=early_exit).to(out.device)
    return out


def fedplvm_aggregate(centres: Tensor, labels: Tensor, num_classes: int, *,
                      cluster_rate: float = CLUSTER_RATE) -> tuple[Tensor, Tensor]:
    """centres (M, d) uploaded by all clients, labels (M,) -> (global centres (M', d), their labels (M',))."""
    g, gy, _ = cluster_per_class(centres, labels, num_classes, cluster_rate=cluster_rate)
    return g, gy


def alpha_sparse_similarity(feats: Tensor, centres: Tensor, alpha: float = ALPHA) -> Tensor:
    """(B, M) sign(cos) |cos|^alpha with cos clamped to +-(1 - 1e-6)."""
    cos = F.cosine_similarity(feats[:, None, :], centres[None].to(feats), dim=2).clamp(-1 + SIM_EPS, 1 - SIM_EPS)
    return torch.sign(cos) * cos.abs().pow(alpha)


def fedplvm_losses(feats: Tensor, y: Tensor, centres: Tensor, centre_labels: Tensor, *, alpha: float = ALPHA,
                   tau: float = TAU) -> tuple[Tensor, Tensor]:
    """(L_contra, L_corr) for a batch against the global centres; a sample with no centre of its class
    contributes 0 to both (and still counts in the batch mean, as coded)."""
    if centres.shape[0] == 0:
        zero = feats.sum() * 0.0
        return zero, zero
    s = alpha_sparse_similarity(feats, centres, alpha)
    pos = (centre_labels.to(y.device)[None, :] == y[:, None]).to(s.dtype)
    log_probs = torch.log_softmax(s / tau, dim=1)
    n_pos = pos.sum(1)
    contra = (-(log_probs * pos).sum(1) / n_pos.clamp_min(1)).mean()
    corr = ((s * pos).sum(1) - n_pos).abs().mean()
    return contra, corr
