"""Membership inference on released class prototypes (vpdr.txt section 5; SPEC 3.7).

The server sees a client's (noisy) class prototype p~_c. For a candidate sample with feature z and
label c, the attacker scores membership by the similarity of z to p~_c: training samples pulled the
prototype towards themselves, so members score higher than non-members. Metrics per class, then
macro-averaged: ROC-AUC, TPR at FPR 1% and 0.1%, the membership advantage max(TPR - FPR), and F1 at
the best threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.attacks.base import Release, ReleaseAttack, clients_then_rounds, features, register_attack


@dataclass
class MIAResult:
    auc: float
    tpr_at_1pct_fpr: float
    tpr_at_01pct_fpr: float
    advantage: float
    f1: float
    classes: int

    def as_dict(self) -> dict[str, float]:
        return {
            "auc": self.auc,
            "tpr@1%fpr": self.tpr_at_1pct_fpr,
            "tpr@0.1%fpr": self.tpr_at_01pct_fpr,
            "advantage": self.advantage,
            "f1": self.f1,
            "classes": float(self.classes),
        }


def membership_scores(features: Tensor, labels: Tensor, prototypes: dict[int, Tensor], metric: str = "cosine") -> Tensor:
    """Score of each (feature, label) pair against the released prototype of its class: a (d,) tensor,
    or (k, d) for a class released as k prototypes (FedPLVM's local cluster centres), where a sample
    scores its best match (the largest cosine, the smallest distance)."""
    if metric not in ("cosine", "l2"):
        raise ValueError(f"metric must be cosine or l2, got {metric!r}")
    out = torch.empty(len(labels), dtype=features.dtype)
    for c in torch.unique(labels).tolist():
        rows = labels == c
        p = prototypes[int(c)].to(features.dtype).reshape(-1, features.shape[-1])  # (k, d)
        f = features[rows]
        if metric == "cosine":
            s = F.normalize(f, dim=-1) @ F.normalize(p, dim=-1).t()
        else:
            s = -torch.cdist(f, p)
        out[rows] = s.max(dim=-1).values
    return out


def roc_metrics(member: np.ndarray, nonmember: np.ndarray) -> tuple[float, float, float, float, float]:
    """(AUC, TPR@1%FPR, TPR@0.1%FPR, advantage, best F1) of scores where members should score higher."""
    scores = np.concatenate([member, nonmember])
    truth = np.concatenate([np.ones(len(member)), np.zeros(len(nonmember))])
    order = np.argsort(-scores, kind="stable")
    s, t = scores[order], truth[order]
    distinct = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # last index of each tied score
    tp = np.cumsum(t)[distinct]
    fp = np.cumsum(1 - t)[distinct]
    P, N = max(1.0, truth.sum()), max(1.0, (1 - truth).sum())
    tpr = np.r_[0.0, tp / P]
    fpr = np.r_[0.0, fp / N]
    auc = float(np.trapezoid(tpr, fpr))

    def tpr_at(limit: float) -> float:
        ok = fpr <= limit
        return float(tpr[ok].max()) if ok.any() else 0.0

    precision = np.divide(tp, tp + fp, out=np.zeros_like(tp), where=(tp + fp) > 0)
    recall = tp / P
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=(precision + recall) > 0)
    return auc, tpr_at(0.01), tpr_at(0.001), float((tpr - fpr).max()), float(f1.max()) if len(f1) else 0.0


def prototype_mia(
    member_features: Tensor,
    member_labels: Tensor,
    nonmember_features: Tensor,
    nonmember_labels: Tensor,
    prototypes: dict[int, Tensor],
    *,
    metric: str = "cosine",
    max_per_class: int = 800,
) -> MIAResult:
    """Macro-averaged MIA metrics over the classes that have a prototype and both kinds of sample."""
    sm = membership_scores(member_features, member_labels, prototypes, metric).numpy()
    sn = membership_scores(nonmember_features, nonmember_labels, prototypes, metric).numpy()
    per_class = []
    for c in sorted(prototypes):
        a = sm[member_labels.numpy() == c][:max_per_class]
        b = sn[nonmember_labels.numpy() == c][:max_per_class]
        if len(a) and len(b):
            per_class.append(roc_metrics(a, b))
    if not per_class:
        raise ValueError("no class has a prototype, members and non-members")
    m = np.mean(np.array(per_class), axis=0)
    return MIAResult(float(m[0]), float(m[1]), float(m[2]), float(m[3]), float(m[4]), len(per_class))


# -- in the audit: each recorded prototype release, scored with the client's own features ------------------------

MIA_COLUMNS = ("auc", "tpr@1%fpr", "tpr@0.1%fpr", "advantage", "f1")


def _subsample(labels: Tensor, limit: int, gen: torch.Generator) -> Tensor:
    """Row indices: up to `limit` rows of each class, drawn at random (seeded)."""
    keep = []
    for c in torch.unique(labels).tolist():
        rows = torch.nonzero(labels == c).flatten()
        keep.append(rows[torch.randperm(len(rows), generator=gen)[:limit]])
    return torch.sort(torch.cat(keep)).values if keep else torch.zeros(0, dtype=torch.long)


@register_attack
class PrototypeMIA(ReleaseAttack):
    """Per client up to `options` (max_per_class, default 800) member (train) and as many non-member (its
    own test split) features per class from the client's own extractor, scored against its released
    prototype of their class: AUC, TPR@1%FPR, TPR@0.1%FPR, advantage, F1 (one row per round and client)."""

    name = "prototype_mia"
    order = 10  # scored before FSH on each release (its note comes first on the progress line)

    def score(self, release: Release, *, seed: int, options: Any) -> tuple[list[dict[str, Any]], str, list[str]]:
        limit = 800 if options is None else int(options)
        r, cid, cdata = release.round, release.client, release.data
        gen = torch.Generator().manual_seed(seed * 1_000_003 + r * 1009 + cid)
        mi, ni = _subsample(cdata.y_train, limit, gen), _subsample(cdata.y_test, limit, gen)
        test_f = features(release.extract, cdata.x_test, release.device)
        train_f = release.train_features
        try:
            res = prototype_mia(train_f[mi], cdata.y_train[mi], test_f[ni], cdata.y_test[ni], release.protos, max_per_class=limit)
        except ValueError:
            return [], "", [f"round {r}, client {cid}: MIA: no class with a prototype, members and non-members"]
        row = {"round": r, "client": cid, **res.as_dict(), "members": len(mi), "nonmembers": len(ni)}
        return [row], f": MIA AUC {res.auc:.3f}", []

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
        return clients_then_rounds(rows, MIA_COLUMNS)
