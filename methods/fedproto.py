"""FedProto (Tan et al.) on the heterogeneous client zoo (SPEC 3.5, with the FedTSP scripts' lambda = 1).

Client   L = CE(h_i(f_i(x)), y) + lambda * MSE(f_i(x), P_g[y]); a sample whose class has no global
         prototype yet contributes no MSE (its own feature stands in, as in HtFLlib). Uploads its class
         means of f_i(x) and their counts.
Server   P_g[c] = average of the uploaded class-c means over the clients that hold c, weighted by their
         class-c counts (SPEC 3.5 [decide]: renormalised over the holders) or uniformly.
Uploads  the class means are a prototype release (the host noises them under local DP with
         dp.prototypes, IGPP by default); the counts are public (the papers weight by them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.hetero import COUNTS_NOTE, HeteroMethod, aggregate_prototypes, snapshot, stack_uploads
from raysim.models.zoo import FAMILIES
from raysim.privacy.mechanisms import prototype, public


@dataclass
class ZooOptions:
    """Knobs shared by the prototype methods on the heterogeneous client zoo."""

    lam: float = 1.0
    model_family: str = "HtFE2"  # HtFE2 | HtFE3 | HtFE4 | HtFE9 | tiny
    feature_dim: int = 512
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)


@dataclass
class Options(ZooOptions):
    proto_weighting: str = "samples"  # samples | uniform

    def validate(self) -> None:
        validate_common(self, "fedproto")


def validate_common(o, name: str) -> None:
    if o.model_family.lower() not in {f.lower() for f in FAMILIES}:
        raise ConfigError(f"{name}.model_family must be one of {', '.join(FAMILIES)}, got {o.model_family!r}")
    if o.feature_dim < 1:
        raise ConfigError(f"{name}.feature_dim must be >= 1")
    if o.client_lr < 0:
        raise ConfigError(f"{name}.client_lr must be >= 0 (0 = the run's lr)")
    if getattr(o, "lam", 0.0) < 0:
        raise ConfigError(f"{name}.lam must be >= 0")
    if getattr(o, "proto_weighting", "samples") not in ("samples", "uniform"):
        raise ConfigError(f"{name}.proto_weighting must be samples or uniform")


def proto_mse(feats: Tensor, y: Tensor, protos: Tensor, has: Tensor) -> Tensor:
    """MSE(f, P[y]) where the sample's class has a prototype; other rows compare f with itself (0)."""
    target = torch.where(has[y][:, None], protos[y], feats.detach())
    return F.mse_loss(feats, target)


@register_method
class FedProto(HeteroMethod):
    name = "fedproto"
    Options: ClassVar[type[ZooOptions]] = Options  # subclasses (FedTGP) bring their own ZooOptions
    releases = {"protos": prototype(), "counts": public(COUNTS_NOTE)}

    def init_shared(self, env, rng):
        return {"protos": torch.zeros(env.num_classes, env.feature_dim), "has": torch.zeros(env.num_classes)}

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.model(env, private)
        protos, has = shared["protos"].to(env.device).float(), shared["has"].to(env.device) > 0.5
        extra = None
        if bool(has.any()) and self.opts.lam > 0:
            def extra(feats, y):
                return self.opts.lam * proto_mse(feats, y, protos, has)
        loss = self.train_model(env, model, data, rng, extra, privacy)
        return LocalResult(
            upload=self.release_prototypes(env, model, data, privacy),
            private={**private, "model": snapshot(model)},
            num_samples=data.num_train,
            metrics={"loss": loss},
        )

    def aggregate(self, env, shared, uploads, rng):
        protos, has = aggregate_prototypes(*stack_uploads(uploads), self.opts.proto_weighting)
        return {"protos": protos, "has": has.float()}
