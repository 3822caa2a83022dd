"""FedDistill (federated distillation, Jeong et al. 2018; HtFLlib's FedDistill) on the client zoo: the
clients share per-class average logits instead of weights (fedtsp.txt Table 1).

Client   L = CE(h_i(f_i(x)), y) + lam * MSE(h_i(f_i(x)), Z_g[y]); a sample whose class has no global
         logits yet contributes no MSE (its own logits stand in, as in HtFLlib). While training it
         collects the logits its batches produce (train mode, every epoch: HtFLlib's clientdistill) and
         uploads their per-class mean Z_i[c] with the per-class counts.
Server   Z_g[c] = plain mean of the uploaded Z_i[c] over the clients that hold c (HtFLlib's
         logit_aggregation); broadcast with the classes that have one.
Eval     Each client's own model (its head).
Uploads  Z_i is a class mean of a per-example vector (the logits), i.e. a prototype release: under local
         DP the host clips each example's row to dp.proto_clip and noises the class means with
         dp.prototypes (IGPP's relation: replace one example by another of its class; counts public).
         The rows are each example's mean logits over the epochs that visited it (methods/families/zoo.py
         PerExampleMeans), so the release sees one row per example; their class means are exactly
         HtFLlib's with the fixed data order. Logits are not features: pick dp.proto_clip for their scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.prototype import (
    COUNTS_NOTE,
    PerExampleMeans,
    aggregate_prototypes,
    proto_mse,
    release_class_means,
    stack_uploads,
)
from raysim.methods.families.zoo import HeteroMethod, HtEnv, ZooModelOptions, snapshot, validate_common
from raysim.privacy.mechanisms import prototype, public


@dataclass
class Options(ZooModelOptions):
    lam: float = 1.0  # HtFLlib's lamda default (the FedTSP scripts do not set it for FedDistill)

    def validate(self) -> None:
        validate_common(self, "feddistill")
        if self.lam < 0:
            raise ConfigError("feddistill.lam must be >= 0")


@register_method
class FedDistill(HeteroMethod):
    name = "feddistill"
    loss_weights = {"distillation": "lam"}
    eval_ignores = ("logits", "has")  # the global class logits only teach
    Options = Options
    releases = {"logits": prototype(), "counts": public(COUNTS_NOTE)}
    client_metrics = ("loss", "ce", "mse")

    def init_shared(self, env: HtEnv, rng: torch.Generator):
        return {"logits": torch.zeros(env.num_classes, env.num_classes), "has": torch.zeros(env.num_classes)}

    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.model(env, private)
        global_logits, has = shared["logits"].to(env.device).float(), shared["has"].to(env.device) > 0.5
        mse_terms: list[float] = []
        extra = None
        if bool(has.any()) and self.opts.lam > 0:
            def extra(feats, y):
                term = self.opts.lam * proto_mse(model.head(feats), y, global_logits, has)
                mse_terms.append(float(term.detach()))
                return term
        means = PerExampleMeans(data.num_train, data.num_classes)
        loss = self.train_model(env, model, data, rng, extra, privacy, on_batch=lambda idx, feats, logits: means.add(idx, logits))
        mse = sum(mse_terms) / len(mse_terms) if mse_terms else 0.0
        return LocalResult(
            upload=release_class_means(privacy, "logits", means, data.y_train, data.num_classes),
            private={**private, "model": snapshot(model)},
            num_samples=data.num_train,
            metrics={"loss": loss, "ce": loss - mse, "mse": mse},
        )

    def aggregate(self, env: HtEnv, shared, uploads, rng):
        logits, has = aggregate_prototypes(*stack_uploads(uploads, "logits"), "uniform")
        return {"logits": logits, "has": has.float()}  # the round's holders only (HtFLlib replaces Z_g each round)
