"""`vpp` (dp.prototypes=vpp): VPDR's private top-k partition (Laplace, pure DP) + group clipping +
reallocated Gaussian noise (vpdr.txt Eq. 7-14, SPEC 3.2). Options: dp.proto_clip (R) and the dp.vpp
subsection: dp.vpp.rho (top-k share of dimensions), dp.vpp.H (score cap), dp.vpp.split (share of epsilon
spent on the partition)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .base import Planned, register_mechanism
from .igpp import PrototypeMechanism, dense


@register_mechanism
class VPP(PrototypeMechanism):
    name = "vpp"
    choice = "vpp"
    clipped = "each feature's top-k and rest groups to R sqrt(d_A/d) and R sqrt(d_B/d) (R = dp.proto_clip)"
    sensitivity = "2R / n_c per class mean, split 2R kappa_A / n_c on I_A and 2R kappa_B / n_c on I_B"
    relation = "replace one example by another of the same class (per-class counts are public)"
    accountant = ("Laplace top-k partition, pure (dp.vpp.split x epsilon over the run), plus Gaussian with the "
                  "group noise reallocated at equal RDP (q = 1, one release per participation)")
    options = ("dp.proto_clip", "dp.vpp.rho", "dp.vpp.H", "dp.vpp.split")

    def plan(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=1.0, steps=1, pure_share=self.dp.vpp.split)

    def apply(self, features: Tensor, labels: Tensor, num_classes: int, *, multiplier: float,
              generator: torch.Generator, rounds: int, assignments: Optional[Tensor] = None) -> tuple[Tensor, dict[str, float]]:
        from ..prototypes import stack_centres, vpp_release

        v = self.dp.vpp
        out = vpp_release(features, labels, R=self.dp.proto_clip, rho=v.rho, H=v.H,
                          epsilon=self.dp.epsilon, rounds=rounds, delta=self.dp.delta, r_split=v.split,
                          generator=generator, num_classes=num_classes, sigma_ref=multiplier,
                          centres="mean" if assignments is None else "cluster", assignments=assignments)
        protos = dense(out["prototypes"], num_classes, features) if assignments is None else stack_centres(out["prototypes"])
        return protos, {"pure_epsilon": out["epsilon1"] / rounds}
