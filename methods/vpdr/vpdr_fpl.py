"""FPL (Huang et al., "federated prototype learning") as the VPDR code runs it (SPEC 3.5).

Server   Per class c, FINCH (cosine, coarsest partition) over the uploaded class-c prototypes of all
         clients; the cluster centres (means of their member prototypes) are c's centres, and the
         "unbiased" prototype u_c is the mean of c's centres.
Client   L = CE + 0.5 * InfoNCE + 0.5 * MSE(f, u[y]), with f the (soft-clipped, under DCR) feature:
           InfoNCE = mean over the batch of -log( sum_{centres m of y} exp(cos(f, m) / tau)
                                                 / sum_{all centres m}  exp(cos(f, m) / tau) ),
           tau = 0.07 (the code reads an argument it never defines: SPEC 3.5 [decide], the paper's
           table); the MSE term applies only when every label in the batch has an unbiased prototype.

FINCH runs only when int(cluster_rate * #uploaded prototypes) > 1 (cluster_rate 0.1, the code's
`n_clusters == 1 -> mean` branch); otherwise a class's centre is the mean of its uploads.
A sample whose class has no centre (nobody uploaded it) adds no InfoNCE term (the code would crash).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import register_method
from raysim.methods.families.prototype import stack_uploads
from raysim.methods.families.vpdr import VPDRMethod, VPDROptions
from raysim.methods.vpdr.finch import finch_coarsest

TAU = 0.07
CONTRA_WEIGHT = 0.5
MSE_WEIGHT = 0.5
CLUSTER_RATE = 0.1


def finch_active(num_uploaded: int, cluster_rate: float = CLUSTER_RATE) -> bool:
    """The code clusters only when max(1, int(cluster_rate * total prototypes)) > 1."""
    return max(1, int(cluster_rate * num_uploaded)) > 1


def cluster_per_class(points: Tensor, labels: Tensor, num_classes: int, *, cluster_rate: float = CLUSTER_RATE,
                      early_exit: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Server step shared by FPL and FedPLVM: points (M, d) uploaded prototypes / centres with their
    classes labels (M,) -> (centres (M', d), centre labels (M',), member counts (M',)), classes in
    order; per class the FINCH coarsest-partition means, or the plain mean when FINCH is off."""
    use_finch = finch_active(int(points.shape[0]), cluster_rate)
    out, out_y, out_n = [], [], []
    for c in range(num_classes):
        pc = points[labels == c].float()
        if pc.shape[0] == 0:
            continue
        if use_finch:
            part = finch_coarsest(pc, early_exit=early_exit)
            k = int(part.max()) + 1
            cents = torch.stack([pc[part == j].mean(0) for j in range(k)])
            sizes = torch.bincount(part, minlength=k)
        else:
            cents, sizes = pc.mean(0, keepdim=True), torch.tensor([pc.shape[0]])
        out.append(cents)
        out_y.append(torch.full((cents.shape[0],), c, dtype=torch.long))
        out_n.append(sizes)
    if not out:
        d = points.shape[1]
        return torch.zeros(0, d), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(out), torch.cat(out_y), torch.cat(out_n)


def fpl_aggregate(protos: Tensor, counts: Tensor, *, cluster_rate: float = CLUSTER_RATE) -> dict[str, Tensor]:
    """protos (K, C, d) uploaded class prototypes, counts (K, C) -> {centres (M, d), centre_labels (M,),
    unbiased (C, d) = mean of each class's centres, has (C,) bool}."""
    K, C, d = protos.shape
    held = counts > 0
    points, labels = protos[held].float(), held.nonzero()[:, 1]
    centres, centre_labels, _ = cluster_per_class(points, labels, C, cluster_rate=cluster_rate)
    unbiased = torch.zeros(C, d)
    has = torch.zeros(C, dtype=torch.bool)
    for c in centre_labels.unique().tolist():
        unbiased[c] = centres[centre_labels == c].mean(0)
        has[c] = True
    return {"centres": centres, "centre_labels": centre_labels, "unbiased": unbiased, "has": has}


def multi_positive_infonce(feats: Tensor, y: Tensor, centres: Tensor, centre_labels: Tensor, tau: float = TAU) -> Tensor:
    """Mean over the samples whose class has a centre of -log(sum_pos exp(s) / sum_all exp(s)),
    s = cos(f, centre) / tau (0 when no sample has one)."""
    if centres.shape[0] == 0:
        return feats.sum() * 0.0
    s = F.cosine_similarity(feats[:, None, :], centres[None].to(feats), dim=2) / tau  # (B, M)
    pos = centre_labels.to(y.device)[None, :] == y[:, None]
    rows = pos.any(1)
    if not bool(rows.any()):
        return feats.sum() * 0.0
    s, pos = s[rows], pos[rows]
    lse_all = torch.logsumexp(s, dim=1)
    lse_pos = torch.logsumexp(s.masked_fill(~pos, float("-inf")), dim=1)
    return (lse_all - lse_pos).mean()


def fpl_losses(feats: Tensor, y: Tensor, centres: Tensor, centre_labels: Tensor, unbiased: Tensor, has: Tensor,
               tau: float = TAU) -> tuple[Tensor, Tensor]:
    """(InfoNCE, MSE) for a batch; MSE(f, u[y]) only when every label of the batch has u (else 0)."""
    contra = multi_positive_infonce(feats, y, centres, centre_labels, tau)
    if bool(has.to(y.device)[y].all()):
        mse = F.mse_loss(feats, unbiased.to(feats)[y])
    else:
        mse = feats.sum() * 0.0
    return contra, mse


# --------------------------------------------------------------------------------- the method


@dataclass
class Options(VPDROptions):
    tau: float = TAU
    contra_weight: float = CONTRA_WEIGHT
    mse_weight: float = MSE_WEIGHT
    cluster_rate: float = CLUSTER_RATE  # FINCH runs when int(cluster_rate * #uploads) > 1 (the code)

    def validate(self) -> None:
        if not self.tau > 0 or self.contra_weight < 0 or self.mse_weight < 0 or self.cluster_rate < 0:
            raise ConfigError("vpdr_fpl: tau > 0, contra_weight >= 0, mse_weight >= 0, cluster_rate >= 0")


@register_method
class VPDRFPL(VPDRMethod):
    name = "vpdr_fpl"
    loss_weights = {"contrast": "contra_weight", "MSE": "mse_weight"}
    eval_ignores = ("opt", "centres", "has", "unbiased")
    Options = Options
    loss_names = ("ce", "contra", "mse")

    def init_shared(self, env, rng):
        C, d = env.num_classes, env.feature_dim
        return {"centres": torch.zeros(0, d), "centre_labels": torch.zeros(0, dtype=torch.long),
                "unbiased": torch.zeros(C, d), "has": torch.zeros(C)}

    def loss_terms(self, env, ctx, *, feat, logits, y, x, model):
        contra, mse = fpl_losses(feat, y, ctx["centres"].float(), ctx["centre_labels"].long(), ctx["unbiased"].float(),
                                 ctx["has"] > 0.5, self.opts.tau)
        return {"ce": F.cross_entropy(logits, y), "contra": self.opts.contra_weight * contra, "mse": self.opts.mse_weight * mse}

    def aggregate(self, env, shared, uploads, rng):
        out = fpl_aggregate(*stack_uploads(uploads), cluster_rate=self.opts.cluster_rate)
        return {**out, "has": out["has"].float()}
