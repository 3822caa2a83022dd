"""What the heterogeneous-model methods that share one small homogeneous model have in common (FML's meme
model, FedKD's mentee, FedMRL's shared model): every client keeps its own zoo model (methods/families/zoo.py)
and, next to it, a copy of one global model of a single small architecture, which is the only thing it
uploads and the server averages.

The global model travels flattened into one tensor "weights" (parameters and BatchNorm buffers, in
state_dict order; methods/fedtsp/fedavg.py `flatten_state`). Its upload is an `update()` release: the model is
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

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, Upload
from raysim.methods.common import weighted_mean
from raysim.methods.families.zoo import HeteroMethod, HtEnv
from raysim.methods.fedtsp.fedavg import ARCHS, flatten_state, load_flat
from raysim.methods.fedtsp.fedproto import validate_common
from raysim.models.zoo import HtModel, family, make_client_model
from raysim.sampling import epoch_batches


@dataclass
class SharedOptions:
    """Knobs of the zoo methods with a shared small model."""

    model_family: str = "HtFE2"  # the clients' own models: HtFE2 | HtFE3 | HtFE4 | HtFE9 | tiny
    feature_dim: int = 512  # d, the clients' common feature width
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)
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
