"""LG-FedAvg (Liang et al. 2020, "Think locally, act globally") on the heterogeneous client zoo, as
HtFLlib runs it for fedtsp.txt Table 1: the feature extractors stay local, only the heads are shared.

Every zoo model ends in the same Linear(d, C) head whatever its extractor (raysim/models/zoo.py), so the
heads of different architectures can be averaged.

Round    The server broadcasts the global head (W, b) = ("head.weight" (C, d), "head.bias" (C,)).
Client   Replaces its head with the global head (HtFLlib's set_parameters), trains its whole model for E
         epochs with CE (plain SGD, fresh each round) and uploads its head; the extractor never leaves.
Server   (W, b) <- sum_k n_k (W_k, b_k) / sum_k n_k over the round's clients (HtFLlib's uploaded_weights).
Eval     Each client's own extractor with the global head (HtFLlib evaluates after set_parameters).
Uploads  the head is an update of the broadcast head: private as a user-level update (dp.level=client).

Round 0: the server draws the first global head (LG-FedAvg's Algorithm 1 initialises the global part on
the server); HtFLlib's clients start round 0 from their own random heads. From round 1 on they agree.

The broadcast head (`GlobalHead`, head_of, average_heads) is the zoo family's (methods/families/zoo.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.zoo import GlobalHead, HeteroMethod, HtEnv, ZooModelOptions, average_heads, head_of, snapshot, validate_common
from raysim.privacy.mechanisms import update


@dataclass
class Options(ZooModelOptions):
    def validate(self) -> None:
        validate_common(self, "lgfedavg")


@register_method
class LGFedAvg(GlobalHead, HeteroMethod):
    name = "lgfedavg"
    Options: ClassVar[type] = Options
    releases = {"head.weight": update(), "head.bias": update()}  # the head only; the extractor stays local
    averaged = ("head.weight", "head.bias")

    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        return self.init_head(env, rng)

    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.with_global_head(self.model(env, private), shared)
        loss = self.train_model(env, model, data, rng, privacy=privacy)
        return LocalResult(
            upload=head_of(model),
            private={**private, "model": snapshot(model)},
            num_samples=data.num_train,
            metrics={"loss": loss},
        )

    def aggregate(self, env: HtEnv, shared, uploads, rng):
        return average_heads(uploads)
