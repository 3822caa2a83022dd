"""`embedding`: a one-shot release of a tensor the client computes once (FedTSP's description
embeddings), clipped as a whole to the method's clip radius and noised (fedtsp.txt Eq. 9-10), at any dp.level.

With `unclipped=True` (FedTSP's `fedtsp.dp_budget=code`, the authors' code `clip_base_v2_dp.py`) the same
noise is added to the tensor as it is, without clipping. Two inputs can then differ by any amount, so the
release has no bounded L2 sensitivity and no (epsilon, delta) at all: the host records it as not valid
(`Release.valid = False`, epsilon inf, the claimed dp.epsilon beside it), never as a guarantee."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Mechanism, Planned, register_mechanism


@register_mechanism
class EmbeddingRelease(Mechanism):
    name = "embedding"
    applied = "release"
    clipped = ("the flattened tensor, as a whole, to C (the method's clip radius, e.g. fedtsp.dp_clip); "
               "not at all under fedtsp.dp_budget=code (the authors' code)")
    sensitivity = "2C (fedtsp.txt Eq. 10); unbounded when unclipped (fedtsp.dp_budget=code: no epsilon, ledger valid=False)"
    relation = "replace the released content (e.g. the selected client's class descriptions) entirely"
    accountant = "Gaussian, q = 1, once per run (unclipped: none, the ledger records epsilon inf)"
    serves = ("embedding",)

    def plan(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=1.0, steps=1)

    def apply(self, tensor: Tensor, *, clip: float, multiplier: float, generator: torch.Generator,
              unclipped: bool = False) -> Tensor:
        """Clip_C(vec(tensor)) + N(0, (2 C multiplier)^2 I); with `unclipped`, vec(tensor) + the same noise."""
        v = tensor.detach().reshape(-1).double()
        if not unclipped:
            v = v * min(1.0, clip / max(float(v.norm()), 1e-12))
        dev = generator.device if generator is not None else torch.device("cpu")
        noise = torch.randn(v.shape, generator=generator, device=dev, dtype=torch.float64).to(v.device)
        return (v + multiplier * 2.0 * clip * noise).reshape(tensor.shape).to(tensor.dtype)
