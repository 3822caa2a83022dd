"""`dpfpl_reference` (a `reference` release at dp.level=sample): the DP-FPL code's noise, reproduced on
request and recorded as not valid. Options: dp.clip (C), dp.epsilon, dp.delta."""

from __future__ import annotations

import math
from typing import Any

from .base import Mechanism, Training, register_mechanism
from .dp_sgd import verify_trained


@register_mechanism
class DPFPLReference(Mechanism):
    """The DP-FPL code's noise (linhhtran/DP-FPL, trainers/DP_FPL.py): the batch-mean gradient is clipped
    to C as a whole and N(0, (sigma C / B)^2) is added, with sigma = q sqrt(T ln(1/delta)) / epsilon at
    q = 1 and T = the rounds, i.e. the per-example sensitivity C / B is claimed for a clipped *batch*
    gradient. One example moves that clipped mean anywhere in a C-ball, so the true sensitivity is 2C and
    the claimed epsilon does not hold. The ledger records the steps with `valid=False` at the multiplier
    relative to 2C, sigma / (2B), q = 1, every step counted: the epsilon it prints is an honest (loose)
    bound for this noise, far above the target, and the budget is not enforced."""

    name = "dpfpl_reference"
    applied = "train"
    clipped = "the batch-mean gradient of the uploaded tensors, jointly, to dp.clip = C (not each example's)"
    sensitivity = "claimed C/B by the reference code; true 2C per step (two clipped batch means lie in one C-ball)"
    relation = "add/remove one training example (sample-level), as claimed"
    accountant = ("NOT a valid DP guarantee: sigma = sqrt(T ln(1/delta)) / epsilon (T = rounds, q = 1), noise std "
                  "sigma C/B; the ledger marks it valid=False and composes it at sigma/(2B), q = 1, every step")
    warning = ("dpfpl.dp_mode=reference reproduces the DP-FPL code's batch-gradient clipping and sigma = sqrt(T ln(1/delta))"
               "/epsilon: this is NOT a valid (epsilon, delta) guarantee; the ledger marks it valid=False and its printed "
               "epsilon is the honest bound at sensitivity 2C, far above dp.epsilon")
    serves = ("reference",)
    levels = ("sample",)
    options = ("dp.clip", "dp.epsilon", "dp.delta")
    refusal = "{what} reproduces a reference code's sample-level noise; use dp.level=sample"

    def reference_sigma(self, rounds: int) -> float:
        """The reference code's sigma: q sqrt(T ln(1/delta)) / epsilon with q = 1 and T = `rounds`."""
        return math.sqrt(max(1, int(rounds)) * math.log(1.0 / self.dp.delta)) / self.dp.epsilon

    def noise_std(self, rounds: int, batch_size: int) -> float:
        """Std of the noise added to the clipped batch-mean gradient: sigma C / B (B = the batch size)."""
        return self.reference_sigma(rounds) * self.dp.clip / max(1, int(batch_size))

    def honest_multiplier(self, rounds: int, batch_size: int) -> float:
        """The noise relative to the true per-step sensitivity 2C: sigma / (2B)."""
        return self.noise_std(rounds, batch_size) / (2.0 * self.dp.clip)

    def train(self, rp: Any) -> Training:
        from raysim.sampling import generator

        from ..dpsgd import BatchClipSGD
        from ..ledger import Release

        host = rp.host
        rounds = host.releases_per_client(rp.cid)
        release = Release(self.name, self.honest_multiplier(rounds, host.batch_size), 1.0, 0, rp.round,
                          sampling="shuffle", valid=False)
        sgd = BatchClipSGD(std=self.noise_std(rounds, host.batch_size), clip=self.dp.clip,
                           generator=generator(host.seed, "dp-noise", rp.round, rp.cid))
        return Training(sgd, release, poisson=False, record_without_steps=False)

    def verify(self, rp: Any, name: str, tensor: Any, kind: str) -> None:
        verify_trained(rp, name, tensor, kind)
