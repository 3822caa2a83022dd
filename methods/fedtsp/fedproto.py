"""FedProto (Tan et al.) on the heterogeneous client zoo (SPEC 3.5, with the FedTSP scripts' lambda = 1).

Client   L = CE(h_i(f_i(x)), y) + lambda * MSE(f_i(x), P_g[y]); a sample whose class has no global
         prototype yet contributes no MSE (its own feature stands in, as in HtFLlib). Uploads its class
         means of f_i(x) and their counts.
Server   P_g[c] = average of the uploaded class-c means over the clients that hold c, weighted by their
         class-c counts (SPEC 3.5 [decide]: renormalised over the holders) or uniformly.
Uploads  the class means are a prototype release (the host noises them under local DP with
         dp.prototypes, IGPP by default); the counts are public (the papers weight by them).

`protocol` (FedProto and FedTGP) says how a baseline is run:
  head     (default) class means of f_i(x) over the training set after training (eval mode); each client
           predicts with its own head h_i, as FedTSP and local do.
  htfllib  as HtFLlib runs them for fedtsp.txt's tables: once global prototypes exist a client predicts
           the class of the nearest global prototype (logits -MSE(f_i(x), P_g[c]); classes without one are
           never predicted), and FedProto's class means are those of the features its training batches
           produced (train mode, every epoch: clientproto.py), FedTGP's those of a pass after training
           (clienttgp.py). HtFLlib's FedProto server averages uniformly: add proto_weighting=uniform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.zoo import (
    COUNTS_NOTE,
    HeteroMethod,
    HtEnv,
    PerExampleMeans,
    aggregate_prototypes,
    release_class_means,
    snapshot,
    stack_uploads,
)
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
    protocol: str = "head"  # head | htfllib (predict by the nearest global prototype; see the module docstring)


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
    if getattr(o, "protocol", "head") not in ("head", "htfllib"):
        raise ConfigError(f"{name}.protocol must be head (predict with the client's head) or htfllib "
                          f"(predict by the nearest global prototype, as HtFLlib), got {o.protocol!r}")


def proto_mse(feats: Tensor, y: Tensor, protos: Tensor, has: Tensor) -> Tensor:
    """MSE(f, P[y]) where the sample's class has a prototype; other rows compare f with itself (0)."""
    target = torch.where(has[y][:, None], protos[y], feats.detach())
    return F.mse_loss(feats, target)


def nearest_prototype_logits(feats: Tensor, protos: Tensor, has: Tensor) -> Tensor:
    """HtFLlib's prototype classifier as logits: -MSE(f, P[c]) = -mean_d (f_d - P[c]_d)^2 for the classes
    with a prototype, -inf for the others (never predicted); argmax = the nearest prototype."""
    d = (feats[:, None, :].float() - protos[None].float()).pow(2).mean(-1)
    return torch.where(has[None, :], -d, torch.full_like(d, float("-inf")))


@register_method
class FedProto(HeteroMethod):
    name = "fedproto"
    Options: ClassVar[type[ZooOptions]] = Options  # subclasses (FedTGP) bring their own ZooOptions
    releases = {"protos": prototype(), "counts": public(COUNTS_NOTE)}
    # protocol=htfllib: the class means are collected from the training batches (HtFLlib's clientproto);
    # FedTGP's client collects them after training (clienttgp) and sets this False
    htfllib_collects_during_training: ClassVar[bool] = True

    def init_shared(self, env, rng):
        return {"protos": torch.zeros(env.num_classes, env.feature_dim), "has": torch.zeros(env.num_classes)}

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.model(env, private)
        protos, has = shared["protos"].to(env.device).float(), shared["has"].to(env.device) > 0.5
        extra = None
        if bool(has.any()) and self.opts.lam > 0:
            def extra(feats, y):
                return self.opts.lam * proto_mse(feats, y, protos, has)
        during = self.opts.protocol == "htfllib" and self.htfllib_collects_during_training
        means = PerExampleMeans(data.num_train, env.feature_dim) if during else None
        hook = (lambda idx, feats, logits: means.add(idx, feats)) if means is not None else None
        loss = self.train_model(env, model, data, rng, extra, privacy, on_batch=hook)
        if means is not None:
            upload = release_class_means(privacy, "protos", means, data.y_train, data.num_classes)
        else:
            upload = self.release_prototypes(env, model, data, privacy)
        return LocalResult(
            upload=upload,
            private={**private, "model": snapshot(model)},
            num_samples=data.num_train,
            metrics={"loss": loss},
        )

    def aggregate(self, env, shared, uploads, rng):
        protos, has = aggregate_prototypes(*stack_uploads(uploads), self.opts.proto_weighting)
        return {"protos": protos, "has": has.float()}

    def prediction_classes(self, shared: dict[str, Tensor]) -> Tensor:
        """protocol=htfllib: the classes a client may predict (those with a global prototype)."""
        return shared["has"] > 0.5

    def predictor(self, env: HtEnv, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None):
        has = self.prediction_classes(shared)
        if self.opts.protocol != "htfllib" or not bool(has.any()):
            return super().predictor(env, shared, private, data)  # the client's own head
        model = self.model(env, private).eval()
        protos, has = shared["protos"].to(env.device), has.to(env.device)
        return lambda x: nearest_prototype_logits(model.features(x.to(env.device)), protos, has)
