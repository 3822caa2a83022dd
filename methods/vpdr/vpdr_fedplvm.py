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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import register_method
from raysim.methods.families.vpdr import VPDRMethod, VPDROptions
from raysim.methods.vpdr.finch import finch_coarsest
from raysim.methods.vpdr.vpdr_fpl import CLUSTER_RATE, cluster_per_class
from raysim.privacy.mechanisms import prototype, public
from raysim.privacy.prototypes import l2_clip

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


# --------------------------------------------------------------------------------- the method

CENTRES_NOTE = (
    "the class of each uploaded FINCH centre: the number of centres per class comes from clustering the "
    "client's features and is released as is (the code, whose accounting treats the clusters as fixed)"
)


@dataclass
class Options(VPDROptions):
    alpha: float = ALPHA
    tau: float = TAU
    weight: float = WEIGHT  # lambda on (L_contra + L_corr)
    cluster_rate: float = CLUSTER_RATE  # the server's FINCH runs when int(cluster_rate * #centres) > 1

    def validate(self) -> None:
        if not (self.alpha > 0 and self.tau > 0 and self.weight >= 0 and self.cluster_rate >= 0):
            raise ConfigError("vpdr_fedplvm: alpha > 0, tau > 0, weight >= 0, cluster_rate >= 0")


@register_method
class VPDRFedPLVM(VPDRMethod):
    name = "vpdr_fedplvm"
    loss_weights = {"L_contra + L_corr": "weight"}
    eval_ignores = ("opt", "centres")
    Options = Options
    releases = {"centres": prototype(), "centre_labels": public(CENTRES_NOTE)}
    loss_names = ("ce", "contra", "corr")

    def init_shared(self, env, rng):
        return {"centres": torch.zeros(0, env.feature_dim), "centre_labels": torch.zeros(0, dtype=torch.long)}

    def loss_terms(self, env, ctx, *, feat, logits, y, x, model):
        contra, corr = fedplvm_losses(feat, y, ctx["centres"].float(), ctx["centre_labels"].long(), alpha=self.opts.alpha,
                                      tau=self.opts.tau)
        w = self.opts.weight
        return {"ce": F.cross_entropy(logits, y), "contra": w * contra, "corr": w * corr}

    def release(self, env, model, data, privacy, ctx):
        """Local FINCH centres through the host: FINCH on the features clipped to R (what the code clusters
        under IGPP; under VPP it clusters the group-clipped features, which only the release sees)."""
        feats = self.release_features(env, model, data)
        y = data.y_train
        assign = local_assignments(l2_clip(feats, float(self.dp.proto_clip)), y)
        centres = privacy.release("centres", features=feats, labels=y, num_classes=data.num_classes, assignments=assign)
        k = torch.stack([assign[y == c].max() + 1 if bool((y == c).any()) else torch.tensor(0) for c in range(data.num_classes)])
        labels = torch.repeat_interleave(torch.arange(data.num_classes), k.cpu())
        return {"centres": centres, "centre_labels": labels}

    def aggregate(self, env, shared, uploads, rng):
        centres = torch.cat([u.tensors["centres"].float() for u in uploads])
        labels = torch.cat([u.tensors["centre_labels"].long() for u in uploads])
        g, gy = fedplvm_aggregate(centres, labels, env.num_classes, cluster_rate=self.opts.cluster_rate)
        return {"centres": g, "centre_labels": gy}
