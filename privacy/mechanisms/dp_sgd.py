"""`dpsgd` at dp.level=sample: per-example DP-SGD on the uploaded tensors inside local training.

Options: dp.clip (C), dp.sampling (poisson | shuffle batches), dp.microbatch, dp.accountant.
"""

from __future__ import annotations

from typing import Any

import torch

from raysim.errors import UploadViolation

from .base import Mechanism, Planned, Training, register_mechanism


@register_mechanism
class DPSGDMechanism(Mechanism):
    name = "dpsgd"
    applied = "train"
    clipped = "each example's gradient of the uploaded tensors, jointly, to dp.clip = C"
    sensitivity = "C per step (one example added or removed changes the clipped gradient sum by <= C)"
    relation = "add/remove one training example (sample-level)"
    accountant = "subsampled Gaussian, q = B/n, one step per batch (Opacus RDP or PRV)"
    serves = ("dpsgd",)
    levels = ("sample",)
    options = ("dp.clip", "dp.sampling", "dp.microbatch", "dp.accountant")
    joint = True
    trains_with_dpsgd = True

    def sample_rate(self, num_train: int, batch_size: int) -> float:
        return min(1.0, batch_size / max(1, num_train))

    def plan(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=self.sample_rate(num_train, batch_size), steps=steps_per_round)

    def train(self, rp: Any) -> Training:
        from raysim.sampling import generator

        from ..dpsgd import DPSGD
        from ..ledger import Release

        host, dp = rp.host, self.dp
        z = host.multiplier(rp.cid, rp.num_train)
        q = self.sample_rate(rp.num_train, host.batch_size)
        steps = host.method.dp_steps_per_round(rp.num_train)
        release = Release("dpsgd", z, q, steps, rp.round, sampling=dp.sampling)
        host.ledger(rp.cid).check(release)
        poisson = dp.sampling == "poisson"
        sgd = DPSGD(sigma=z, clip=dp.clip, sample_rate=q, generator=generator(host.seed, "dp-noise", rp.round, rp.cid),
                    microbatch=dp.microbatch, expected_batch=q * rp.num_train if poisson else None)
        return Training(sgd, release, poisson=poisson, record_without_steps=True)

    def verify(self, rp: Any, name: str, tensor: Any, kind: str) -> None:
        verify_trained(rp, name, tensor, kind)


def verify_trained(rp: Any, name: str, tensor: Any, kind: str) -> None:
    """The upload `name` is the tensor the round's noisy steps trained, passed as dp_params to every step
    (or the untouched broadcast tensor, which holds nothing of the client's data)."""
    sgd = rp.stepper
    if not rp.enabled or sgd.steps == 0:
        shared = rp.shared.get(name)
        if shared is not None and shared.shape == tensor.shape and torch.equal(shared.detach().cpu(), tensor):
            return  # untouched broadcast tensor: nothing of the client's data in it
        raise UploadViolation(f"client {rp.cid}: {name!r} is declared {kind} but no DP-SGD step trained it (fail closed)")
    if any(name not in names for names in sgd.names_each_step) or name not in sgd.trained:
        raise UploadViolation(
            f"client {rp.cid}: {name!r} is declared {kind} but was not passed as dp_params={{{name!r}: tensor}} "
            "to every privacy.backward step (fail closed)"
        )
    if not torch.equal(sgd.trained[name].detach().cpu(), tensor):
        raise UploadViolation(f"client {rp.cid}: the uploaded {name!r} is not the tensor DP-SGD trained (fail closed)")
