"""Test-only methods: PromptFL whose local training fails for one chosen client in one chosen round
(tests/engine/test_client_failures.py), and vpdr_fedproto (a release_first method) whose release or
training fails so. Importing this module registers them as `flaky` and `flaky_vpdr`.

It is imported lazily by the tests (not at collection time), so the registry-driven conformance tests do
not pick it up. Ray workers import it when they unpickle the run config (its `flaky` section is an
instance of `FlakyPromptFL.Options`); tests/conftest.py puts tests/ on the workers' PYTHONPATH."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from raysim.methods.base import register_method
from raysim.methods.fedsept.promptfl import PromptFL
from raysim.methods.vpdr.vpdr_fedproto import Options as VPDRFedProtoOptions
from raysim.methods.vpdr.vpdr_fedproto import VPDRFedProto


@register_method
class FlakyPromptFL(PromptFL):
    name = "flaky"

    @dataclass
    class Options:
        client: int = -1  # the client that fails (-1 = none)
        round: int = -1  # in this round (-1 = every round)
        mode: str = "raise"  # raise | nan | sleep
        sleep: float = 0.0  # mode=sleep: seconds to sleep before training

        def validate(self) -> None:
            from raysim.errors import ConfigError

            if self.mode not in ("raise", "nan", "sleep"):
                raise ConfigError(f"flaky.mode must be raise, nan or sleep, got {self.mode!r}")

    def init_private(self, env, data, rng):
        return {"trained": torch.zeros((), dtype=torch.long)}  # rounds trained, counted in place

    def local_train(self, env, shared, private, data, *, rng, privacy):
        o = self.opts
        private["trained"] += 1  # in place, before any failure: a dropped round must not keep it
        hit = data.client_id == o.client and (o.round < 0 or privacy.round == o.round)
        if hit and o.mode == "raise":
            raise RuntimeError(f"flaky client {data.client_id} broke")
        if hit and o.mode == "sleep":
            time.sleep(o.sleep)
        result = super().local_train(env, shared, private, data, rng=rng, privacy=privacy)
        if hit and o.mode == "nan":
            ctx = result.upload["ctx"].clone()
            ctx[0, 0] = float("nan")
            result.upload["ctx"] = ctx
        return result



@dataclass
class FlakyVPDROptions(VPDRFedProtoOptions):
    client: int = -1  # the client that fails (-1 = none)
    round: int = -1  # in this round
    phase: str = "release"  # release | train: which half of the round raises


@register_method
class FlakyVPDR(VPDRFedProto):
    name = "flaky_vpdr"
    Options = FlakyVPDROptions

    def _hit(self, data, privacy, phase: str) -> None:
        o = self.opts
        if o.phase == phase and data.client_id == o.client and privacy.round == o.round:
            raise RuntimeError(f"flaky client {data.client_id} broke in its {phase}")

    def local_release(self, env, shared, private, data, *, rng, privacy):
        self._hit(data, privacy, "release")
        return super().local_release(env, shared, private, data, rng=rng, privacy=privacy)

    def local_train(self, env, shared, private, data, *, rng, privacy):
        result = super().local_train(env, shared, private, data, rng=rng, privacy=privacy)
        self._hit(data, privacy, "train")  # after training: its work must be discarded
        return result
