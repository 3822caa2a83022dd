"""Local-only training: every client trains its own zoo model with CE on its own data; nothing is shared
(the upload is an empty dict, the server state is empty)."""

from __future__ import annotations

from dataclasses import dataclass

from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.zoo import HeteroMethod, snapshot, validate_common


@dataclass
class Options:
    model_family: str = "HtFE2"  # HtFE2 | HtFE3 | HtFE4 | HtFE9 | tiny
    feature_dim: int = 512
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False

    def validate(self) -> None:
        validate_common(self, "local")


@register_method
class Local(HeteroMethod):
    name = "local"
    Options = Options
    releases = {}  # nothing leaves a client

    def init_shared(self, env, rng):
        return {}

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.model(env, private)
        loss = self.train_model(env, model, data, rng, privacy=privacy)
        return LocalResult(upload={}, private={**private, "model": snapshot(model)}, num_samples=data.num_train,
                           metrics={"loss": loss})

    def aggregate(self, env, shared, uploads, rng):
        return {}
