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

`GlobalHead` is what the methods with a broadcast head share (lgfedavg, fedgen, fedgh).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch
from torch import Tensor, nn

from raysim.methods.base import ClientData, LocalResult, Upload, register_method
from raysim.methods.common import weighted_mean
from raysim.methods.families.zoo import HeteroMethod, HtEnv, snapshot
from raysim.methods.fedtsp.fedproto import validate_common
from raysim.models.zoo import HtModel
from raysim.privacy.mechanisms import update

HEAD_KEYS = ("head.weight", "head.bias")


@dataclass
class Options:
    model_family: str = "HtFE2"  # HtFE2 | HtFE3 | HtFE4 | HtFE9 | tiny
    feature_dim: int = 512
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)

    def validate(self) -> None:
        validate_common(self, "lgfedavg")


class GlobalHead:
    """A global Linear(d, C) head the server broadcasts and every client puts on its own extractor."""

    opts: Any
    model: Callable[[HtEnv, dict[str, Any]], HtModel]  # HeteroMethod's (an annotation: nothing shadowed)

    def init_head(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        """A freshly initialised Linear(d, C) (PyTorch's default init), a function of `rng` only."""
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = nn.Linear(env.feature_dim, env.num_classes)
        return head_of(head)

    def with_global_head(self, model: HtModel, shared: dict[str, Tensor]) -> HtModel:
        """`model` with its head replaced by the broadcast one (HtFLlib's set_parameters)."""
        with torch.no_grad():
            model.head.weight.copy_(shared["head.weight"])
            model.head.bias.copy_(shared["head.bias"])
        return model

    def predictor(self, env: HtEnv, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None):
        """The client's own extractor with the global head."""
        model = self.with_global_head(self.model(env, private), shared).eval()
        return lambda x: model(x.to(env.device))[1]


def head_of(module: nn.Module) -> dict[str, Tensor]:
    """{"head.weight", "head.bias"} of a Linear head (or of an HtModel's head), detached on the CPU."""
    lin = module.head if isinstance(module, HtModel) else module
    assert isinstance(lin, nn.Linear)
    return {"head.weight": lin.weight.detach().cpu().clone(), "head.bias": lin.bias.detach().cpu().clone()}


def average_heads(uploads: list[Upload]) -> dict[str, Tensor]:
    """sum_k n_k head_k / sum_k n_k, per tensor."""
    return {k: weighted_mean(uploads, k) for k in HEAD_KEYS}


@register_method
class LGFedAvg(GlobalHead, HeteroMethod):
    name = "lgfedavg"
    Options: ClassVar[type] = Options
    releases = {"head.weight": update(), "head.bias": update()}  # the head only; the extractor stays local

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
