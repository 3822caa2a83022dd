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
  fedtsp   as the code behind fedtsp.txt's tables (XinghaoWu/FedTSP_CVPR26, an HtFLlib fork) runs them:
           HtFLlib's class means (below) and each client predicts with its own head, argmax h_i(f_i(x))
           (the fork's nearest-prototype test is commented out). The FedTSP table specs set this.
  htfllib  as upstream HtFLlib runs them: once global prototypes exist a client predicts the class of the
           nearest global prototype (logits -MSE(f_i(x), P_g[c]); classes without one are never predicted).
  Under fedtsp and htfllib FedProto's class means are those of the features its training batches produced
  (train mode, every epoch: clientproto.py), FedTGP's those of a pass after training (clienttgp.py).
  Both codes' FedProto servers average uniformly: add proto_weighting=uniform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch import Tensor

from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.prototype import (
    COUNTS_NOTE,
    PerExampleMeans,
    aggregate_prototypes,
    nearest_prototype_logits,
    proto_mse,
    release_class_means,
    stack_uploads,
)
from raysim.methods.families.zoo import HeteroMethod, HtEnv, ZooOptions, snapshot, validate_common
from raysim.privacy.mechanisms import prototype, public

# the protocols that collect the class means as HtFLlib's clients do (the FedTSP fork keeps them)
HTFLLIB_COLLECTION = ("fedtsp", "htfllib")


@dataclass
class Options(ZooOptions):
    proto_weighting: str = "samples"  # samples | uniform

    def validate(self) -> None:
        validate_common(self, "fedproto")


@register_method
class FedProto(HeteroMethod):
    name = "fedproto"
    loss_weights = {"prototype MSE": "lam"}
    eval_ignores: ClassVar[tuple[str, ...]] = ("protos", "has")  # train-time
    Options: ClassVar[type[ZooOptions]] = Options  # subclasses (FedTGP) bring their own ZooOptions
    releases = {"protos": prototype(), "counts": public(COUNTS_NOTE)}
    # protocol=fedtsp|htfllib: the class means are collected from the training batches (HtFLlib's clientproto);
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
        during = self.opts.protocol in HTFLLIB_COLLECTION and self.htfllib_collects_during_training
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
            return super().predictor(env, shared, private, data)  # head / fedtsp: the client's own head
        model = self.model(env, private).eval()
        protos, has = shared["protos"].to(env.device), has.to(env.device)
        return lambda x: nearest_prototype_logits(model.features(x.to(env.device)), protos, has)
