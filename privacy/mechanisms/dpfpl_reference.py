"""`dpfpl_reference` (a `reference` release at dp.level=sample): the DP-FPL code's privacy, reproduced on
request and recorded as not a valid local-DP guarantee. Options: dp.epsilon, dp.delta; the clipping
threshold is the method's (`dpfpl.norm_thresh`, the code's NORM_THRESH = 10)."""

from __future__ import annotations

import math
from typing import Any

import torch

from raysim.errors import UploadViolation

from .base import Mechanism, Training, register_mechanism


def reference_sigma(rounds: int, epsilon: float, delta: float) -> float:
    """The DP-FPL code's noise multiplier (trainers/DP_FPL.py build_model): q sqrt(T ln(1/delta)) / epsilon
    with q = 1 and T = the communication rounds (cfg.OPTIM.ROUND)."""
    return math.sqrt(max(1, int(rounds)) * math.log(1.0 / delta)) / epsilon


def server_noise_std(rounds: int, epsilon: float, delta: float, clip: float, batch_size: int, clients: int) -> float:
    """Std of the noise the DP-FPL code's server adds to the mean of the K clients' clipped global-prompt
    gradients at every lock-step: sigma * C / B / K (federated_main.py `std = local_trainer.std / USERS`)."""
    return reference_sigma(rounds, epsilon, delta) * clip / max(1, int(batch_size)) / max(1, int(clients))


def local_noise_std(rounds: int, epsilon: float, delta: float, clip: float, batch_size: int) -> float:
    """Std of the noise the DP-FPL code adds on the client to the clipped gradients of the local U and V:
    sigma * C / B (`self.std`)."""
    return reference_sigma(rounds, epsilon, delta) * clip / max(1, int(batch_size))


@register_mechanism
class DPFPLReference(Mechanism):
    """The DP-FPL code's privacy (linhhtran/DP-FPL, federated_main.py and trainers/DP_FPL.py, `dpfpl`
    factorisation). Rounds run in lock-step (Method.lockstep_steps): at every local step each client clips
    the batch-mean gradient of the global prompt to NORM_THRESH = C as a whole and uploads it *without
    noise*; the server averages the K uploads and adds N(0, (sigma C / (B K))^2), sigma = sqrt(T ln(1/delta))
    / epsilon (q = 1, T = rounds); the local U and V gradients are clipped to C and noised on the client
    (std sigma C / B), which protects nothing that leaves it. What leaves the client is an un-noised
    gradient, so there is no local-DP guarantee at all: each step is recorded with valid=False, sigma 0
    (the ledger's epsilon is inf) and claimed_epsilon = dp.epsilon, the epsilon the code was run for."""

    name = "dpfpl_reference"
    applied = "train"
    clipped = "the batch-mean gradient of the global prompt, as a whole, to dpfpl.norm_thresh = C (not each example's)"
    sensitivity = "none locally (the upload is the un-noised clipped gradient); the server's noise is sigma C/(B K)"
    relation = "add/remove one training example (sample-level), as claimed"
    accountant = ("NOT a valid local-DP guarantee: the client uploads its clipped gradient without noise (the server adds "
                  "std sigma C/(B K), sigma = sqrt(T ln(1/delta))/epsilon); ledger: valid=False, epsilon inf, "
                  "claimed_epsilon = dp.epsilon")
    warning = ("dpfpl.dp_mode=reference reproduces the DP-FPL code: clients upload their clipped global-prompt gradient "
               "WITHOUT noise and the server noises the K-client mean at every lock-step: this is NOT a valid local-DP "
               "guarantee; the ledger marks it valid=False with epsilon inf beside the claimed dp.epsilon")
    serves = ("reference",)
    levels = ("sample",)
    options = ("dp.epsilon", "dp.delta")
    refusal = "{what} reproduces a reference code's sample-level noise; use dp.level=sample"

    def clip_of(self, method: Any) -> float:
        """The reference code's clipping threshold: the method's (`dpfpl.norm_thresh`), else dp.clip."""
        return float(getattr(getattr(method, "opts", None), "norm_thresh", self.dp.clip))

    def train(self, rp: Any) -> Training:
        from raysim.sampling import generator

        from ..dpsgd import BatchClipSGD
        from ..ledger import Release

        host = rp.host
        release = Release(self.name, 0.0, 1.0, 0, rp.round, sampling="shuffle", valid=False,
                          claimed_epsilon=float(self.dp.epsilon))
        sgd = BatchClipSGD(std=0.0, clip=self.clip_of(host.method), generator=generator(host.seed, "dp-noise", rp.round, rp.cid))
        return Training(sgd, release, poisson=False, record_without_steps=False)

    def verify(self, rp: Any, name: str, tensor: Any, kind: str) -> None:
        """The upload is the clipped gradient the round's step computed for `name` (passed as dp_params)."""
        sgd = rp.stepper
        got = getattr(sgd, "grads", {}).get(name)
        if not rp.enabled or sgd.steps == 0 or got is None:
            raise UploadViolation(f"client {rp.cid}: {name!r} is declared {kind} but no clipped step computed it (fail closed)")
        if not torch.equal(got, tensor.detach().cpu()):
            raise UploadViolation(f"client {rp.cid}: the uploaded {name!r} is not the gradient the clipped step computed (fail closed)")
