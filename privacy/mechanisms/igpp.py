"""`igpp` (dp.prototypes=igpp, the default): per-example L2 clip to R, class mean, isotropic Gaussian
(vpdr.txt Eq. 4-6). Options: dp.proto_clip (R)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .base import Mechanism, Planned, register_mechanism


class PrototypeMechanism(Mechanism):
    """What a prototype mechanism shares: it serves `prototype` releases at dp.level=sample, chosen by
    dp.prototypes = its `choice`, one Gaussian release per participation; `apply` gives the noised
    (num_classes, d) class means, or with `assignments` (per-example cluster ids within the class) the
    noised (M, d) cluster centres, class by class, and extra ledger facts ("pure_epsilon")."""

    applied = "release"
    serves = ("prototype",)
    levels = ("sample",)
    refusal = "{what} is a prototype release, not an update of the broadcast state; use dp.level=sample"

    def plan(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=1.0, steps=1)

    def apply(self, features: Tensor, labels: Tensor, num_classes: int, *, multiplier: float,
              generator: torch.Generator, rounds: int, assignments: Optional[Tensor] = None) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError


@register_mechanism
class IGPP(PrototypeMechanism):
    name = "igpp"
    choice = "igpp"
    clipped = "each example's feature to dp.proto_clip = R (L2)"
    sensitivity = "2R / n_c per class mean (n_c = the client's examples of class c)"
    relation = "replace one example by another of the same class (per-class counts are public)"
    accountant = "Gaussian, q = 1, one release per participation"
    options = ("dp.proto_clip",)

    def apply(self, features: Tensor, labels: Tensor, num_classes: int, *, multiplier: float,
              generator: torch.Generator, rounds: int, assignments: Optional[Tensor] = None) -> tuple[Tensor, dict[str, float]]:
        from ..prototypes import igpp_release, stack_centres

        out = igpp_release(features, labels, clip=self.dp.proto_clip, sigma=multiplier, generator=generator, assignments=assignments)
        return (dense(out, num_classes, features) if assignments is None else stack_centres(out)), {}


def dense(protos: dict[int, Tensor], num_classes: int, like: Tensor) -> Tensor:
    """{class: prototype} as a (num_classes, d) float32 tensor (classes the client lacks are 0)."""
    out = torch.zeros(num_classes, like.shape[1], dtype=torch.float32)
    for c, p in protos.items():
        out[c] = p.detach().float().cpu()
    return out
