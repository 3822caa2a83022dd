"""`embedding`: a one-shot release of a tensor the client computes once (FedTSP's description
embeddings), clipped as a whole to the method's clip radius and noised (fedtsp.txt Eq. 10), at any dp.level."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Mechanism, Planned, register_mechanism


@register_mechanism
class EmbeddingRelease(Mechanism):
    name = "embedding"
    applied = "release"
    clipped = "the flattened tensor, as a whole, to C (the method's clip radius, e.g. fedtsp.dp_clip)"
    sensitivity = "2C (fedtsp.txt Eq. 10)"
    relation = "replace the released content (e.g. the selected client's class descriptions) entirely"
    accountant = "Gaussian, q = 1, once per run"
    serves = ("embedding",)

    def plan(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=1.0, steps=1)

    def apply(self, tensor: Tensor, *, clip: float, multiplier: float, generator: torch.Generator) -> Tensor:
        v = tensor.detach().reshape(-1).double()
        v = v * min(1.0, clip / max(float(v.norm()), 1e-12))
        dev = generator.device if generator is not None else torch.device("cpu")
        noise = torch.randn(v.shape, generator=generator, device=dev, dtype=torch.float64).to(v.device)
        return (v + multiplier * 2.0 * clip * noise).reshape(tensor.shape).to(tensor.dtype)
