"""What the prototype methods share (FedProto, FedTGP, FedTSP, FedDistill, FedGH, FedPAC, FedPCL and the
VPDR frameworks): the server's holders-only average of the clients' class means, the stacking of their
uploads, the per-example means some clients release, the prototype-regularised MSE and the nearest-prototype
classifier. Functions of tensors only: the methods' bases (methods/families/zoo.py, vpdr.py) build on them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.methods.base import Upload

COUNTS_NOTE = (
    "per-class sample counts: public in the papers (the server's prototype weights use them), and held fixed "
    "by the prototype mechanisms' neighbouring relation (replace one example by another of its class)"
)


def aggregate_prototypes(protos: Tensor, counts: Tensor, weighting: str = "samples") -> tuple[Tensor, Tensor]:
    """protos: (K, C, d) client class means; counts: (K, C) samples behind each -> (P (C, d), has (C,)).

    Only the clients holding class c enter P_c: "samples" weights them by n_{k,c} / sum_j n_{j,c}
    (fedtsp.txt Eq. 6), "uniform" takes their plain mean (the official code). Classes nobody holds are 0."""
    holders = counts > 0
    w = counts.float() if weighting == "samples" else holders.float()
    w = w * holders
    total = w.sum(0)
    w = w / total.clamp_min(1e-12)
    return torch.einsum("kc,kcd->cd", w, protos.float()), total > 0


def stack_uploads(uploads: list[Upload], key: str = "protos") -> tuple[Tensor, Tensor]:
    return torch.stack([u.tensors[key] for u in uploads]), torch.stack([u.tensors["counts"] for u in uploads])


def proto_mse(feats: Tensor, y: Tensor, protos: Tensor, has: Tensor) -> Tensor:
    """MSE(f, P[y]) where the sample's class has a prototype; other rows compare f with itself (0)."""
    target = torch.where(has[y][:, None], protos[y], feats.detach())
    return F.mse_loss(feats, target)


def nearest_prototype_logits(feats: Tensor, protos: Tensor, has: Tensor) -> Tensor:
    """HtFLlib's prototype classifier as logits: -MSE(f, P[c]) = -mean_d (f_d - P[c]_d)^2 for the classes
    with a prototype, -inf for the others (never predicted); argmax = the nearest prototype."""
    d = (feats[:, None, :].float() - protos[None].float()).pow(2).mean(-1)
    return torch.where(has[None, :], -d, torch.full_like(d, float("-inf")))


class PerExampleMeans:
    """Each training example's mean of a per-example vector (its feature or its logits) over the batches
    that visited it during local training. `rows(labels)` gives one row per visited example, so a
    prototype release of them sees one row per example (the n_c its sensitivity 2R/n_c counts); their
    class means equal the class means of all rows collected (HtFLlib's agg_func) whenever every visited
    example was visited equally often (the fixed data order: the same drop_last batches each epoch)."""

    def __init__(self, n: int, width: int) -> None:
        self.sums = torch.zeros(n, width)
        self.hits = torch.zeros(n)

    def add(self, idx: Tensor, rows: Tensor) -> None:
        idx = idx.cpu().long()
        self.sums.index_add_(0, idx, rows.detach().float().cpu())
        self.hits.index_add_(0, idx, torch.ones(len(idx)))

    def rows(self, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(means (m, width), labels (m,)) of the m examples visited at least once."""
        seen = self.hits > 0
        return self.sums[seen] / self.hits[seen, None], labels.cpu()[seen]


def release_class_means(privacy: Any, name: str, means: PerExampleMeans, labels: Tensor, num_classes: int) -> dict[str, Tensor]:
    """{name: the prototype release of the per-example means, counts: the examples behind each class mean}.
    The counts are those of the visited examples: which positions drop_last leaves out is fixed by n and
    B (or by the rng), so under the release's relation (replace an example by one of its class) they are
    as public as the class counts."""
    rows, y = means.rows(labels)
    return {name: privacy.release(name, features=rows, labels=y, num_classes=num_classes),
            "counts": torch.bincount(y, minlength=num_classes).float()}
