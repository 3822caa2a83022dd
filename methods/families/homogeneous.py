"""The homogeneous family: one global model of a single zoo architecture, broadcast and uploaded flattened
into one tensor "weights" (parameters and BatchNorm buffers, in state_dict order).

`Homogeneous` (FedAvg, FedBABU, FedETF, FedFA, FedPAC, FedTSP-GFL; fedtsp.txt section 3.6 / Table 3): all
clients train the global model alone; evaluation is GFL (the global model) or, with `finetune_epochs` > 0,
PFL "-FT" (its head fine-tuned on the client's own data, a linear probe on the frozen features f(x), kept in
the client's private state and never uploaded). The flat vector is the body (feature extractor, BatchNorm
buffers included) followed by the head (a zoo model registers its extractor first and its head last):
`split_weights` cuts it there, `join_weights` glues the two back (FedBABU, FedPAC).

`SharedSmallModel` (FML's meme model, FedKD's mentee, FedMRL's shared model): every client keeps its own zoo
model (methods/families/zoo.py) and, next to it, a copy of one global model of a single small architecture,
which is the only thing it uploads and the server averages. Its upload is an `update()` release: the model is
trained on the client's data next to a private model that depends on all of it (mutual distillation,
fused features), so per-example DP-SGD cannot bound one example's influence on it; under local DP the
host clips and noises the whole update (dp.level=client), and dp.level=sample is refused at config time.
Architecture of the shared model (`shared_model`): any zoo architecture; the default `cnn_tiny` is the
zoo's smallest (FedAvgCNN with widths 8/16 and a 64-wide hidden layer, ~29k parameters at 32x32).
`first` takes the first architecture of the run's model family instead, which is what HtFLlib's scripts
(and so the FedTSP tables) use (`args.models[0]`: FedAvgCNN for HtFE2/HtFE4, ResNet-10 for HtFE3,
ResNet-4 for HtFE9).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, TrainConfig, Upload, weighted_mean
from raysim.methods.families.zoo import ARCHS, HeteroMethod, HtEnv, ZooModelOptions, validate_common
from raysim.models.zoo import HtModel, family, make_client_model
from raysim.sampling import epoch_batches


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
    """Checks of the options every homogeneous method has: feature_dim, client_lr, then those of the global
    model (`validate_global_model`)."""
    if o.feature_dim < 1:
        raise ConfigError(f"{name}.feature_dim must be >= 1")
    if o.client_lr < 0:
        raise ConfigError(f"{name}.client_lr must be >= 0 (0 = the run's lr)")
    validate_global_model(o, name)


def validate_global_model(o: Any, name: str) -> None:
    """Checks of the global model's options: model, finetune_epochs, finetune_lr (fedtsp_gfl checks its
    feature_dim and client_lr as fedtsp does, so it calls this one alone)."""
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

    def independent_clients(self) -> bool:
        """False: every client's step loads its weights into the host's one global module (env.extra)."""
        return False

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


# ------------------------------------------------------------------------------------ body and head
def head_size(model: HtModel) -> int:
    """How many values of the flat state are the head's (they are its last entries)."""
    keys = list(model.state_dict())
    head = [k for k in keys if k.startswith("head.")]
    if keys[-len(head):] != head:  # pragma: no cover - HtModel registers the head last
        raise AssertionError("the head's entries must come last in the model's state_dict")
    return sum(model.state_dict()[k].numel() for k in head)


def split_weights(weights: Tensor, n_head: int) -> tuple[Tensor, Tensor]:
    """(body, head) of a flat model vector whose last `n_head` values are the head's."""
    return weights[:-n_head].clone(), weights[-n_head:].clone()


def join_weights(body: Tensor, head: Tensor) -> Tensor:
    return torch.cat([body.reshape(-1).float(), head.reshape(-1).float()])


def flat_head(model: nn.Module) -> Tensor:
    return torch.cat([v.detach().reshape(-1).float().cpu() for k, v in model.state_dict().items() if k.startswith("head.")])


def flat_body(model: nn.Module) -> Tensor:
    return torch.cat([v.detach().reshape(-1).float().cpu() for k, v in model.state_dict().items() if not k.startswith("head.")])


@contextmanager
def frozen(*modules: nn.Module) -> Iterator[None]:
    """The parameters of `modules` get no gradient inside the block (plain SGD then leaves them as they
    are); their requires_grad flags are put back afterwards (the host's cached module is reused)."""
    params = [p for m in modules for p in m.parameters()]
    before = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, before):
            p.requires_grad_(flag)


def class_counts(y: Tensor, num_classes: int) -> Tensor:
    return torch.bincount(y.long().cpu(), minlength=num_classes).float()


# ------------------------------------------------------------------------------------ a shared small model
@dataclass
class SharedOptions(ZooModelOptions):
    """Knobs of the zoo methods with a shared small model: the clients' own models (ZooModelOptions), then
    the shared one."""

    shared_model: str = "cnn_tiny"  # the shared model's architecture; "first" = the family's first (HtFLlib)
    weighting: str = "uniform"  # server average of the shared model: uniform (HtFLlib, 1/K) | samples (n_k / n)


def validate_shared(o: SharedOptions, name: str) -> None:
    validate_common(o, name)
    if o.shared_model.lower() not in ARCHS + ("first",):
        raise ConfigError(f"{name}.shared_model must be one of first, {', '.join(ARCHS)}, got {o.shared_model!r}")
    if o.weighting not in ("uniform", "samples"):
        raise ConfigError(f"{name}.weighting must be uniform or samples, got {o.weighting!r}")


class SharedSmallModel(HeteroMethod):
    """A HeteroMethod whose clients also train a copy of one global small model (broadcast and uploaded
    as "weights")."""

    def independent_clients(self) -> bool:
        """False: every client's step loads the broadcast into the host's one shared module (env.extra)."""
        return False

    def shared_arch(self) -> str:
        arch = self.opts.shared_model.lower()
        return family(self.opts.model_family)[0] if arch == "first" else arch

    def shared_dim(self, env: HtEnv) -> int:
        """The shared model's feature width (FedMRL: its sub-feature dim)."""
        return env.feature_dim

    def new_shared(self, env: HtEnv, seed: int = 0) -> HtModel:
        return make_client_model(self.shared_arch(), self.shared_dim(env), env.num_classes, image_size=self.image_size, seed=seed)

    def init_shared_weights(self, env: HtEnv, rng: torch.Generator) -> Tensor:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
        return flatten_state(self.new_shared(env, seed).state_dict())

    def shared_module(self, env: HtEnv, weights: Tensor) -> HtModel:
        """The host's one cached shared module, loaded with `weights` (every use reloads it)."""
        m = env.extra.get("shared_model")
        if m is None:
            m = env.extra["shared_model"] = self.new_shared(env)
        return load_flat(m, weights).to(env.device)

    def average_shared(self, uploads: list[Upload], key: str = "weights") -> Tensor:
        if self.opts.weighting == "samples":
            return weighted_mean(uploads, key)
        return torch.stack([u.tensors[key].float() for u in uploads]).mean(0)

    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        return {"weights": self.init_shared_weights(env, rng)}

    def aggregate(self, env: HtEnv, shared: dict[str, Tensor], uploads: list[Upload], rng: torch.Generator):
        return {**shared, "weights": self.average_shared(uploads)}

    # -- the client's loop ------------------------------------------------------------------------
    def batches(self, env: HtEnv, data: ClientData, rng: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
        """E local epochs of (x, y) mini-batches: drop_last, fixed order or shuffled (as train_model)."""
        for _ in range(self.train.local_epochs):
            for idx in epoch_batches(data.num_train, self.train.batch_size, rng, shuffle=self.opts.shuffle):
                if len(idx) < 2:  # BatchNorm cannot train on one sample
                    continue
                yield data.x_train[idx].to(env.device), data.y_train[idx].to(env.device)


def clip_grads(modules: Any, max_norm: float) -> None:
    """HtFLlib's `clip_grad_norm_(..., 10)` per model ("prevent divergency"); 0 = off."""
    if max_norm > 0:
        for m in modules:
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)


def mean_metrics(parts: dict[str, list[float]]) -> dict[str, float]:
    return {k: sum(v) / max(1, len(v)) for k, v in parts.items()}
