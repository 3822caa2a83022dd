"""FedPCL (Tan et al., NeurIPS 2022) as PFLlib runs it: prototype-wise contrastive learning, no model sharing.

Every client trains its own model (of architecture `model`, or of the zoo family `model_family`, client i
getting model i mod X); only class prototypes travel. Features are L2-normalised, z = f(x) / ||f(x)||.

Round    The server broadcasts the global prototypes P_g (C x d) and every client's latest prototypes
         P_k (K x C x d), each padded with P_g for the classes client k does not hold (PFLlib's
         prototype_padding).
Client   At its first participation it only computes and uploads its prototypes (PFLlib trains once its
         prototypes exist). Afterwards, for E epochs of plain SGD with gradients clipped to norm
         `grad_clip` (PFLlib's "prevent divergency"):
             L = CE(z P_g^T / tau, y) + (1/K) sum_k CE(z P_k^T / tau, y)
         (classes without any prototype are left out of the softmax, and samples of such a class out of
         the loss). Then uploads its prototypes: the class means of z over its training set (a prototype
         release the host computes: noised under local DP by dp.prototypes) and their counts (public).
Server   P_g[c] = the plain mean over the uploads holding class c (PFLlib's proto_aggregation); client k's
         stored row is replaced by its upload, and every row is padded with the new P_g.
Eval     Each client's nearest-prototype score z . p_c over its own prototypes (kept privately, exact),
         padded with P_g for the classes it lacks (PFLlib pads the very dictionary its test uses); 0
         where no prototype exists.

The FedPCL paper trains light projection heads on frozen pre-trained backbones; PFLlib (and so fedtsp.txt
Table 3) trains the whole model from scratch, as here. PFLlib stacks its prototype dictionaries in the
order classes were first seen, so its logit columns need not line up with the labels; here column c is
class c. That may be part of why fedtsp.txt reports low FedPCL accuracies at alpha = 0.5 and 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.prototype import COUNTS_NOTE, aggregate_prototypes, stack_uploads
from raysim.methods.families.zoo import ARCHS, HeteroMethod, HtEnv, snapshot
from raysim.models.zoo import FAMILIES, arch_of, make_client_model
from raysim.privacy.mechanisms import prototype, public
from raysim.sampling import epoch_batches


@dataclass
class Options:
    model: str = "fedavgcnn"  # every client's architecture (the model-homogeneous rows of fedtsp.txt Table 3)
    model_family: str = ""  # "" = `model` for all; HtFE2 | HtFE3 | HtFE4 | HtFE9 | tiny = the heterogeneous zoo
    feature_dim: int = 512  # d
    tau: float = 1.0  # temperature of the contrastive logits (PFLlib's default)
    grad_clip: float = 10.0  # clip_grad_norm_ of each step (PFLlib); 0 = off
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)

    def validate(self) -> None:
        if self.model_family and self.model_family.lower() not in {f.lower() for f in FAMILIES}:
            raise ConfigError(f"fedpcl.model_family must be empty or one of {', '.join(FAMILIES)}, got {self.model_family!r}")
        if not self.model_family and self.model.lower() not in ARCHS:
            raise ConfigError(f"fedpcl.model must be one of {', '.join(ARCHS)}, got {self.model!r}")
        if self.feature_dim < 1:
            raise ConfigError("fedpcl.feature_dim must be >= 1")
        if not self.tau > 0:
            raise ConfigError("fedpcl.tau must be > 0")
        if self.grad_clip < 0 or self.client_lr < 0:
            raise ConfigError("fedpcl.grad_clip and fedpcl.client_lr must be >= 0 (0 = off / the run's lr)")


def contrastive_loss(z: Tensor, y: Tensor, protos: Tensor, has: Tensor, tau: float) -> Tensor:
    """CE(z P^T / tau, y) over the classes that have a prototype (`has`); z normalised features."""
    logits = (z @ protos.t()) / tau
    logits = logits.masked_fill(~has[None, :], float("-inf"))
    return F.cross_entropy(logits, y)


def pcl_loss(z: Tensor, y: Tensor, global_protos: Tensor, client_protos: Tensor, has: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    """(L_g, L_p): the global-prototype term and the mean over the K clients' prototype sets."""
    lg = contrastive_loss(z, y, global_protos, has, tau)
    lp = torch.stack([contrastive_loss(z, y, p, has, tau) for p in client_protos]).mean()
    return lg, lp


@register_method
class FedPCL(HeteroMethod):
    name = "fedpcl"
    eval_ignores = ("client_protos", "client_has", "model.head")  # train-time; the own head is not the predictor
    Options = Options
    releases = {"protos": prototype(), "counts": public(COUNTS_NOTE)}
    client_metrics = ("loss", "global", "clients")

    # -- the client's own model -----------------------------------------------------------------
    def init_private(self, env: HtEnv, data: ClientData, rng: torch.Generator) -> dict[str, Any]:
        arch = arch_of(self.opts.model_family, data.client_id) if self.opts.model_family else self.opts.model.lower()
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
        model = make_client_model(arch, env.feature_dim, data.num_classes, image_size=self.image_size, seed=seed)
        return {"client": data.client_id, "arch": arch, "model": snapshot(model)}

    # -- server half ----------------------------------------------------------------------------
    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        C, d, K = env.num_classes, env.feature_dim, self.train.num_clients
        return {"protos": torch.zeros(C, d), "has": torch.zeros(C), "client_protos": torch.zeros(K, C, d),
                "client_has": torch.zeros(K, C)}

    def aggregate(self, env: HtEnv, shared, uploads, rng):
        protos, counts = stack_uploads(uploads)
        glob, has = aggregate_prototypes(protos, counts, "uniform")
        own = shared["client_protos"].detach().cpu().clone()
        own_has = shared["client_has"].detach().cpu().clone() > 0.5
        for u in uploads:
            own[u.client_id] = u.tensors["protos"].float()
            own_has[u.client_id] = u.tensors["counts"] > 0
        padded = torch.where(own_has[:, :, None], own, glob[None])  # PFLlib's prototype_padding
        return {"protos": glob, "has": has.float(), "client_protos": padded, "client_has": own_has.float()}

    # -- client half ----------------------------------------------------------------------------
    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.model(env, private)
        has = shared["has"].to(env.device) > 0.5
        logs: dict[str, list[float]] = {k: [] for k in self.client_metrics}
        if private.get("own_protos") is not None and bool(has.any()):  # PFLlib trains once its prototypes exist
            glob = shared["protos"].to(env.device).float()
            others = shared["client_protos"].to(env.device).float()
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=self.client_lr)
            for _ in range(self.train.local_epochs):
                for idx in epoch_batches(data.num_train, self.train.batch_size, rng, shuffle=self.opts.shuffle):
                    y = data.y_train[idx].to(env.device)
                    keep = has[y]  # a class nobody has a prototype for cannot be contrasted yet
                    if int(keep.sum()) < 2:  # BatchNorm cannot train on one sample
                        continue
                    x, y = data.x_train[idx].to(env.device)[keep], y[keep]
                    z = F.normalize(model.features(x), dim=1)
                    lg, lp = pcl_loss(z, y, glob, others, has, self.opts.tau)
                    loss = lg + lp
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if self.opts.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), self.opts.grad_clip)
                    opt.step()
                    for k, v in (("loss", loss), ("global", lg), ("clients", lp)):
                        logs[k].append(float(v.detach()))
        z = F.normalize(self.train_features(env, model, data), dim=1)
        counts = torch.bincount(data.y_train, minlength=data.num_classes).float()
        exact = torch.zeros(data.num_classes, z.shape[1]).index_add_(0, data.y_train.long(), z) / counts.clamp_min(1)[:, None]
        upload = {"protos": privacy.release("protos", features=z, labels=data.y_train, num_classes=data.num_classes),
                  "counts": counts}
        return LocalResult(
            upload=upload,
            private={**private, "model": snapshot(model), "own_protos": exact, "own": counts > 0},
            num_samples=data.num_train,
            metrics={k: (sum(v) / len(v) if v else float("nan")) for k, v in logs.items()},
        )

    # -- evaluation -----------------------------------------------------------------------------
    def predictor(self, env: HtEnv, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None):
        model = self.model(env, private).eval()
        C = env.num_classes
        glob, has = shared["protos"].to(env.device).float(), shared["has"].to(env.device) > 0.5
        if private.get("own_protos") is not None:
            own, own_has = private["own_protos"].to(env.device).float(), private["own"].to(env.device)
        else:
            own, own_has = torch.zeros(C, env.feature_dim, device=env.device), torch.zeros(C, dtype=torch.bool, device=env.device)
        protos = torch.where(own_has[:, None], own, torch.where(has[:, None], glob, torch.zeros_like(glob)))
        return lambda x: F.normalize(model.features(x.to(env.device)), dim=1) @ protos.t()
