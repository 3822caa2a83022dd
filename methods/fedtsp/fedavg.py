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

`Homogeneous` is the mixin the homogeneous methods share (fedavg here, fedtsp_gfl in fedtsp_homo.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, TrainConfig, Upload, register_method
from raysim.methods.common import weighted_mean
from raysim.methods.families.zoo import HeteroMethod, HtEnv
from raysim.models.zoo import FAMILIES, HtModel, make_client_model
from raysim.privacy.mechanisms import update
from raysim.sampling import epoch_batches

# every architecture of the zoo (all ResNet-n are in HtFE9)
ARCHS: tuple[str, ...] = tuple(dict.fromkeys(a for fam in FAMILIES.values() for a in fam))


# ------------------------------------------------------------------------------------ flat weights
def flatten_state(state: dict[str, Tensor]) -> Tensor:
    """A state_dict (parameters and buffers, its own order) as one float32 vector."""
    return torch.cat([v.detach().reshape(-1).float().cpu() for v in state.values()])


M = TypeVar("M", bound=nn.Module)


def load_flat(model: M, flat: Tensor) -> M:
    """Copy a vector made by `flatten_state` of a model of the same architecture into `model`; integer
    buffers (BatchNorm's num_batches_tracked, averaged as floats) are rounded back."""
    state = model.state_dict()
    total = sum(v.numel() for v in state.values())
    if flat.numel() != total:
        raise ConfigError(f"global weights hold {flat.numel()} values, the {getattr(model, 'arch', '')} model {total}")
    flat = flat.detach().to("cpu").float()
    i = 0
    with torch.no_grad():
        for v in state.values():
            chunk = flat[i : i + v.numel()].view(v.shape)
            i += v.numel()
            v.copy_(chunk.round() if not v.is_floating_point() else chunk)
    return model


def validate_homogeneous(o: Any, name: str) -> None:
    """Checks of the options every homogeneous method has: model, finetune_epochs, finetune_lr."""
    if o.model.lower() not in ARCHS:
        raise ConfigError(f"{name}.model must be one of {', '.join(ARCHS)}, got {o.model!r}")
    if o.finetune_epochs < 0:
        raise ConfigError(f"{name}.finetune_epochs must be >= 0 (0 = no fine-tuning)")
    if o.finetune_lr < 0:
        raise ConfigError(f"{name}.finetune_lr must be >= 0 (0 = client_lr)")


# ------------------------------------------------------------------------------------ the mixin
class Homogeneous:
    """All clients train one global model of architecture `opts.model` (the options need `model`,
    `client_lr`, `shuffle`, `finetune_epochs`, `finetune_lr`). Put it before the HeteroMethod subclass in
    the bases: it replaces the per-client model of the zoo by the broadcast one."""

    # supplied by the HeteroMethod the mixin is combined with (annotations only: nothing here shadows them)
    name: ClassVar[str]
    opts: Any
    train: TrainConfig
    image_size: int
    client_lr: float  # HeteroMethod's property: the method's client_lr, or the run's lr when it is 0

    def model(self, env: HtEnv, private: dict[str, Any]) -> HtModel:
        """HeteroMethod's "the client's model", for code written for the zoo (FedTSP's client half): here
        `private["model"]` holds flat global weights, loaded into the host's one module."""
        return self.global_model(env, private["model"])

    # -- the global model ---------------------------------------------------------------------
    def new_model(self, env: HtEnv, seed: int = 0) -> HtModel:
        return make_client_model(self.opts.model.lower(), env.feature_dim, env.num_classes,
                                 image_size=self.image_size, seed=seed)

    def init_weights(self, env: HtEnv, rng: torch.Generator) -> Tensor:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
        return flatten_state(self.new_model(env, seed).state_dict())

    def global_model(self, env: HtEnv, weights: Tensor) -> HtModel:
        """The host's one cached module of the architecture, loaded with `weights` (every client's local
        training and every predictor reload it, so nothing a client does to it survives)."""
        m = env.extra.get("global_model")
        if m is None:
            m = env.extra["global_model"] = self.new_model(env)
        return load_flat(m, weights).to(env.device)

    def aggregate_weights(self, uploads: list[Upload]) -> Tensor:
        return weighted_mean(uploads, "weights")

    # -- the client -----------------------------------------------------------------------------
    def init_private(self, env: HtEnv, data: ClientData, rng: torch.Generator) -> dict[str, Any]:
        return {"client": data.client_id, "arch": self.opts.model.lower(), "rounds": 0}

    # -- evaluation -----------------------------------------------------------------------------
    global_predictor: ClassVar[bool]  # the method's declaration (methods/base.py); -FT makes it personal

    def predicts_globally(self) -> bool:
        return self.global_predictor and self.opts.finetune_epochs == 0

    def predictor(self, env: HtEnv, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None):
        model = self.global_model(env, shared["weights"]).eval()
        head: nn.Module = model.head
        if self.opts.finetune_epochs > 0:
            head = self.personal_head(env, model, private, data)
        return lambda x: head(model.features(x.to(env.device)))

    def personal_head(self, env: HtEnv, model: HtModel, private: dict[str, Any], data: Optional[ClientData]) -> nn.Module:
        """The global head fine-tuned on this client's data (stored in its private state as head_ft)."""
        head = copy.deepcopy(model.head)
        if data is None:
            raise ValueError(f"{self.name} with finetune_epochs > 0 needs the client's data to evaluate")
        self.finetune_head(env, model, head, data)
        private["head_ft"] = {k: v.detach().cpu().clone() for k, v in head.state_dict().items()}
        return head

    def finetune_head(self, env: HtEnv, model: HtModel, head: nn.Module, data: ClientData, batch: int = 256) -> float:
        """`finetune_epochs` epochs of plain SGD on CE(head(f(x)), y) with the extractor frozen (eval
        mode); same batching as local training (fixed order, or shuffled by a per-client stream)."""
        model.eval()
        with torch.no_grad():
            feats = torch.cat([model.features(data.x_train[i : i + batch].to(env.device))
                               for i in range(0, data.num_train, batch)]).float()
        y = data.y_train.to(env.device)
        with torch.enable_grad():  # the engine evaluates under no_grad
            return self._train_head(env, head, feats, y, data)

    def _train_head(self, env: HtEnv, head: nn.Module, feats: Tensor, y: Tensor, data: ClientData) -> float:
        head.train()
        opt = torch.optim.SGD(head.parameters(), lr=self.opts.finetune_lr or self.client_lr)
        g = torch.Generator().manual_seed(self.train.seed * 1_000_003 + data.client_id)
        n, bs = data.num_train, self.train.batch_size
        losses = []
        for _ in range(self.opts.finetune_epochs):
            for idx in epoch_batches(n, bs, g, shuffle=self.opts.shuffle):
                idx = idx.to(env.device)
                loss = F.cross_entropy(head(feats[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        head.eval()
        return sum(losses) / max(1, len(losses))


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
        if self.feature_dim < 1:
            raise ConfigError("fedavg.feature_dim must be >= 1")
        if self.client_lr < 0:
            raise ConfigError("fedavg.client_lr must be >= 0 (0 = the run's lr)")
        validate_homogeneous(self, "fedavg")


@register_method
class FedAvg(Homogeneous, HeteroMethod):
    name = "fedavg"
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
