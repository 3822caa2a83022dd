"""`client_update` at dp.level=client: the whole update (upload - broadcast) clipped and noised once per
participation (user-level LDP), for `update` releases and for `dpsgd` ones at this level.

Options: dp.clip (C).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import Mechanism, Planned, register_mechanism


@register_mechanism
class ClientUpdate(Mechanism):
    name = "client_update"
    applied = "update"
    clipped = "the whole update (upload - broadcast), jointly over the uploaded tensors, to dp.clip = C"
    sensitivity = "2C (any two datasets of the client give updates in the same C-ball)"
    relation = "replace the client's whole dataset (user-level; the server, who samples, is the adversary)"
    accountant = "Gaussian, q = 1 (no amplification by participation), one release per participation"
    serves = ("dpsgd", "update")
    levels = ("client",)
    options = ("dp.clip",)
    joint = True
    refusal = ("{what} is trained without per-example DP-SGD, so dp.level=sample cannot privatise it; "
               "use dp.level=client (the whole update is clipped and noised) or dp.epsilon=inf")

    def plan(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=1.0, steps=1)

    def apply(self, delta: dict[str, Tensor], *, multiplier: float, generator: torch.Generator) -> dict[str, Tensor]:
        from ..client_level import noise_update

        # noise_update adds N(0, (sigma C)^2) with sigma relative to C; the sensitivity is 2C
        return noise_update(delta, clip=self.dp.clip, sigma=2.0 * multiplier, generator=generator)

    def verify(self, rp: Any, name: str, tensor: Any, kind: str) -> None:
        return None  # the host applies this release itself after the check (RoundPrivacy._update_release)
