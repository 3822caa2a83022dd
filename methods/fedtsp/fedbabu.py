"""FedBABU (Oh et al., ICLR 2022): federated training of the body only, with a frozen random head.

Round    The server broadcasts the global body b (feature extractor and pooling, flattened with its
         BatchNorm buffers) and the head h, a random Linear(d, C) drawn once at initialisation.
Client   Loads (b, h), trains the body for E local epochs with CE(h(f(x)), y) while h stays frozen
         (plain SGD, fresh each round, as FedAvg here) and uploads the trained body only.
Server   b <- sum_k n_k b_k / sum_k n_k; h is never updated (it is the same random head all run).
Eval     GFL (`finetune_epochs=0`): every client evaluates (b, h).
         PFL ("FedBABU-FT", `finetune_epochs=F>0`): the head is fine-tuned for F epochs on the client's
         own data before testing, the body frozen: the same head fine-tuning as FedAvg-FT (`Homogeneous.finetune_head`), which
         fedtsp.txt section 4.5 uses for every "-FT" row ("fine-tuning the classifier always outperforms full
         fine-tuning"; the FedBABU paper and PFLlib fine-tune body and head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.homogeneous import Homogeneous, flat_body, frozen, head_size, join_weights, split_weights, validate_homogeneous
from raysim.methods.families.zoo import HeteroMethod, HtEnv
from raysim.privacy.mechanisms import update


@dataclass
class Options:
    model: str = "fedavgcnn"  # the one architecture every client trains (any zoo model, e.g. resnet8, cnn_tiny)
    feature_dim: int = 512  # d, the pooled feature width before the head
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)
    finetune_epochs: int = 0  # > 0: "FedBABU-FT", each client evaluates with its head fine-tuned on its data
    finetune_lr: float = 0.0  # 0 = client_lr

    def validate(self) -> None:
        validate_homogeneous(self, "fedbabu")


@register_method
class FedBABU(Homogeneous, HeteroMethod):
    name = "fedbabu"
    averaged = ("body",)
    Options = Options
    releases = {"body": update()}  # the trained body: private only as a user-level update (dp.level=client)
    global_predictor = True  # every client evaluates the global body and head (unless finetune_epochs > 0)

    # -- server half ----------------------------------------------------------------------------
    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        body, head = split_weights(self.init_weights(env, rng), self.head_size(env))
        return {"body": body, "head": head}

    def aggregate(self, env: HtEnv, shared, uploads, rng):
        return {"body": weighted_mean(uploads, "body"), "head": shared["head"].detach().cpu().clone()}

    # -- client half ----------------------------------------------------------------------------
    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.global_model(env, join_weights(shared["body"], shared["head"]))
        with frozen(model.head):  # the random head gets no gradient: only the body learns
            loss = self.train_model(env, model, data, rng, privacy=privacy)
        return LocalResult(
            upload={"body": flat_body(model)},
            private={**private, "rounds": int(private.get("rounds", 0)) + 1},
            num_samples=data.num_train,
            metrics={"loss": loss},
        )

    def predictor(self, env: HtEnv, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None):
        return super().predictor(env, {"weights": join_weights(shared["body"], shared["head"])}, private, data)

    def head_size(self, env: HtEnv) -> int:
        return head_size(self.new_model(env))
