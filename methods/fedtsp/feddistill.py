"""FedDistill (federated distillation, Jeong et al. 2018) on the client zoo, as the code behind FedTSP's
tables runs it (XinghaoWu/FedTSP_CVPR26 clientdistill.py / serverdistill.py, SOTA_FedDistill.sh
--lamda=1): the clients share per-class average logits instead of weights (fedtsp.txt Table 1).

Client   `distill=ce` (the code): L = CE(z, y) + lam * CE(z, softmax(Z_g[y])), z = h_i(f_i(x)), the second a
         cross-entropy against the soft target softmax(Z_g[y]), averaged over the batch:
             -(1/B) sum_i sum_c softmax(Z_g[y_i])_c log softmax(z_i)_c.
         A sample whose class has no global logits yet takes softmax(z_i) (detached) as its target, as in
         the code: it adds its entropy to the loss's value and nothing to the gradient, and still counts
         in the 1/B. `distill=mse` (upstream HtFLlib's clientdistill, the project's earlier default):
         lam * MSE(z, Z_g[y]), the mean over batch x classes, a sample without global logits comparing z
         with itself (0). While training it
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
import torch.nn.functional as F
from torch import Tensor

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
    lam: float = 1.0  # the distillation weight (SOTA_FedDistill.sh --lamda=1)
    distill: str = "ce"  # ce: CE(z, softmax(Z_g[y])) (the FedTSP code) | mse: MSE(z, Z_g[y]) (upstream HtFLlib)

    def validate(self) -> None:
        validate_common(self, "feddistill")
        if self.lam < 0:
            raise ConfigError("feddistill.lam must be >= 0")
        if self.distill not in ("ce", "mse"):
            raise ConfigError(f"feddistill.distill must be ce (the FedTSP code) or mse (upstream HtFLlib), got {self.distill!r}")


def soft_target_ce(logits: Tensor, y: Tensor, global_logits: Tensor, has: Tensor) -> Tensor:
    """The code's CE(z, softmax(Z_g[y])): the batch mean of -sum_c softmax(Z_g[y_i])_c log softmax(z_i)_c; a
    row whose class has no global logits takes softmax(z_i) (detached) as its target (value, no gradient)."""
    target = torch.where(has[y][:, None], global_logits[y], logits.detach()).softmax(dim=1)
    return -(target * F.log_softmax(logits, dim=1)).sum(1).mean()


def distill_loss(logits: Tensor, y: Tensor, global_logits: Tensor, has: Tensor, kind: str = "ce") -> Tensor:
    """`ce`: soft_target_ce; `mse`: MSE(z, Z_g[y]) over the rows with global logits (the others compare z with itself)."""
    return soft_target_ce(logits, y, global_logits, has) if kind == "ce" else proto_mse(logits, y, global_logits, has)


@register_method
class FedDistill(HeteroMethod):
    name = "feddistill"
    loss_weights = {"distillation": "lam"}
    eval_ignores = ("logits", "has")  # the global class logits only teach
    Options = Options
    releases = {"logits": prototype(), "counts": public(COUNTS_NOTE)}
    client_metrics = ("loss", "ce", "distill")

    def init_shared(self, env: HtEnv, rng: torch.Generator):
        return {"logits": torch.zeros(env.num_classes, env.num_classes), "has": torch.zeros(env.num_classes)}

    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.model(env, private)
        global_logits, has = shared["logits"].to(env.device).float(), shared["has"].to(env.device) > 0.5
        terms: list[float] = []
        extra = None
        if bool(has.any()) and self.opts.lam > 0:
            def extra(feats, y):
                term = self.opts.lam * distill_loss(model.head(feats), y, global_logits, has, self.opts.distill)
                terms.append(float(term.detach()))
                return term
        means = PerExampleMeans(data.num_train, data.num_classes)
        loss = self.train_model(env, model, data, rng, extra, privacy, on_batch=lambda idx, feats, logits: means.add(idx, logits))
        distill = sum(terms) / len(terms) if terms else 0.0
        return LocalResult(
            upload=release_class_means(privacy, "logits", means, data.y_train, data.num_classes),
            private={**private, "model": snapshot(model)},
            num_samples=data.num_train,
            metrics={"loss": loss, "ce": loss - distill, "distill": distill},
        )

    def aggregate(self, env: HtEnv, shared, uploads, rng):
        logits, has = aggregate_prototypes(*stack_uploads(uploads, "logits"), "uniform")
        return {"logits": logits, "has": has.float()}  # the round's holders only (HtFLlib replaces Z_g each round)
