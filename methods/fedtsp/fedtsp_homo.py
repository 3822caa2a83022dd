"""FedTSP in the model-homogeneous settings (fedtsp.txt section 3.6, Table 3): "fedtsp_gfl".

All clients train one global model (`model`, any zoo architecture; d = the PLM's feature width). Each
round is FedTSP's (methods/fedtsp/fedtsp.py) with FedAvg of the model added:

Round    The server broadcasts the global model w (flattened "weights"), the text prototypes P^T and s.
Client   FedTSP's client half, run on w instead of a client-owned model:
             L = CE(h(f(x)), y) + lambda * CE(e^s cos(f(x), P^T_c) over c, y)     (s frozen here)
         uploads the trained weights, and its class means of f(x) with their counts.
Server   w <- sample-weighted FedAvg of the weights (feature extractor and head);
         FedTSP's server half, unchanged: P^I from the class means, E_s prompt steps through the frozen
         PLM, new P^T (the private variant of section 3.5 works as in fedtsp).
Eval     GFL: the global model w. PFL ("Ours-*-FT", `finetune_epochs` > 0): w with its head fine-tuned on
         each client's data, kept in the client's private state and never uploaded (`Homogeneous`, methods/families/homogeneous.py).

Why a method of its own rather than an option of fedtsp: the homogeneous variant changes what is
uploaded and broadcast (the model weights), what the client keeps (no model of its own, a fine-tuned
head) and how a client is evaluated; `fedtsp` keeps its declared uploads and its zoo. Everything of
FedTSP itself is inherited, not copied: the options (`model_family` is unused here), the PLM env, the
server's prompt training and the client loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.homogeneous import Homogeneous, flatten_state, validate_global_model
from raysim.methods.fedtsp import fedtsp
from raysim.methods.fedtsp.fedtsp import FedTSP, TSPEnv
from raysim.privacy.mechanisms import update


@dataclass
class Options(fedtsp.Options):
    model: str = "fedavgcnn"  # the one architecture every client trains (any zoo model, e.g. resnet8, cnn_tiny)
    finetune_epochs: int = 0  # > 0: "-FT", each client evaluates the global model with its head fine-tuned
    finetune_lr: float = 0.0  # 0 = client_lr

    def validate(self) -> None:
        super().validate()
        validate_global_model(self, "fedtsp_gfl")


@register_method
class FedTSPGFL(Homogeneous, FedTSP):
    name = "fedtsp_gfl"
    Options = Options
    releases = {**FedTSP.releases, "weights": update()}
    global_predictor = True  # GFL: every client evaluates w (unless finetune_epochs > 0)

    # -- server half: FedTSP's, plus FedAvg of the model -----------------------------------------
    def init_shared(self, env: TSPEnv, rng: torch.Generator) -> dict[str, Tensor]:
        shared = super().init_shared(env, rng)
        return {**shared, "weights": self.init_weights(env, rng)}

    def aggregate(self, env: TSPEnv, shared, uploads, rng):
        new = super().aggregate(env, shared, uploads, rng)
        new.state["weights"] = self.aggregate_weights(uploads)
        return new

    # -- client half: FedTSP's, on the global model --------------------------------------------
    def local_train(self, env: TSPEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        res = super().local_train(env, shared, {**private, "model": shared["weights"]}, data, rng=rng, privacy=privacy)
        trained = res.private.pop("model")  # the trained global model goes up, not into the private state
        res.upload["weights"] = flatten_state(trained)
        return res
