"""FedAvg (McMahan et al.) of one homogeneous zoo model, and its classifier fine-tuned variant ("-FT").

The model-homogeneous settings of fedtsp.txt section 3.6 / Table 3:

Round    The server broadcasts the global model w (feature extractor, pooling to d, and head, flattened
         into one tensor "weights": parameters and BatchNorm buffers, in state_dict order).
Client   Loads w, trains all of it for E local epochs with CE (plain SGD, fresh each round, the zoo's
         training loop of methods/families/zoo.py) and uploads the trained weights.
Server   w <- sum_k n_k w_k / sum_k n_k over the clients of the round (sample-weighted FedAvg).
Eval     GFL (`finetune_epochs=0`): every client evaluates the global model w.
         PFL ("-FT", `finetune_epochs=F>0`): every client evaluates w with its head fine-tuned for F
         epochs on the client's own training data, starting from w's head; the extractor is frozen
         (eval mode, so BatchNorm statistics do not move), i.e. a linear probe on the features f(x).
         The fine-tuned head is the client's private state (`private["head_ft"]`); local training always
         starts from the broadcast w, so the fine-tuning never reaches an upload.

The global model, its flat weights and the -FT head are the homogeneous family's (`Homogeneous`,
methods/families/homogeneous.py), shared with fedbabu, fedetf, fedfa, fedpac and fedtsp_gfl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.homogeneous import Homogeneous, flatten_state, validate_homogeneous
from raysim.methods.families.zoo import HeteroMethod, HtEnv
from raysim.privacy.mechanisms import update


# ------------------------------------------------------------------------------------ FedAvg
@dataclass
class Options:
    model: str = "fedavgcnn"  # the one architecture every client trains (any zoo model, e.g. resnet8, cnn_tiny)
    feature_dim: int = 512  # d, the pooled feature width before the head
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)
    finetune_epochs: int = 0  # > 0: "-FT", each client evaluates the global model with its head fine-tuned
    finetune_lr: float = 0.0  # 0 = client_lr

    def validate(self) -> None:
        validate_homogeneous(self, "fedavg")


@register_method
class FedAvg(Homogeneous, HeteroMethod):
    name = "fedavg"
    averaged = ("weights",)
    Options = Options
    releases = {"weights": update()}  # the whole trained model: private only as a user-level update (dp.level=client)
    global_predictor = True  # every client evaluates the global model w (unless finetune_epochs > 0)

    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        return {"weights": self.init_weights(env, rng)}

    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.global_model(env, shared["weights"])
        loss = self.train_model(env, model, data, rng, privacy=privacy)
        return LocalResult(
            upload={"weights": flatten_state(model.state_dict())},
            private={**private, "rounds": int(private.get("rounds", 0)) + 1},
            num_samples=data.num_train,
            metrics={"loss": loss},
        )

    def aggregate(self, env: HtEnv, shared, uploads, rng):
        return {"weights": self.aggregate_weights(uploads)}
