"""FedProto as VPDR runs it (vpdr.txt Table 1, SPEC 3.5), on the ViT-adapter model of methods/families/vpdr.py.

Client   L = CE(head(feat), y) + lam * MSE(feat, P_g[y]), lam = 0.1; the MSE term applies only when every
         label of the batch has a global prototype (the VPDR code), feat = the soft-clipped feature under DCR.
         Uploads its class means of z (un-clipped, eval mode) through the host's prototype release
         (none / IGPP / VPP by dp.epsilon and dp.prototypes) and its class counts (public).
Server   P_g[c] = the class-c means of the clients holding c, weighted by their class-c counts and
         renormalised over those holders (SPEC 3.5 [decide], `proto_weighting=samples`, the code shared with
         the zoo FedProto); `proto_weighting=all_clients` is the VPDR code's rule, weights n_k / n_total over
         all clients' sizes, which shrinks the prototypes of classes not every client holds.

The zoo FedProto of FedTSP (`fedproto`: heterogeneous CNN zoo, plain SGD, lam = 1, per-sample masking)
is the same algorithm under the other paper's settings; the two share `aggregate_prototypes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import register_method
from raysim.methods.families.prototype import aggregate_prototypes, stack_uploads
from raysim.methods.families.vpdr import VPDRMethod, VPDROptions


@dataclass
class Options(VPDROptions):
    lam: float = 0.1  # weight of the prototype MSE (VPDR's FedProto; the zoo fedproto uses 1.0)
    proto_weighting: str = "samples"  # samples (holders, renormalised) | all_clients (the VPDR code)

    def validate(self) -> None:
        if self.lam < 0:
            raise ConfigError("vpdr_fedproto.lam must be >= 0")
        if self.proto_weighting not in ("samples", "all_clients"):
            raise ConfigError(f"vpdr_fedproto.proto_weighting must be samples or all_clients, got {self.proto_weighting!r}")


def batch_proto_mse(feat: Tensor, y: Tensor, protos: Tensor, has: Tensor) -> Tensor:
    """MSE(feat, P[y]) when every label of the batch has a prototype, else 0 (the VPDR code)."""
    if not bool(has[y].all()):
        return feat.sum() * 0.0
    return F.mse_loss(feat, protos[y])


def aggregate_all_clients(protos: Tensor, counts: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
    """The VPDR code's rule: P_c = sum over holders k of (n_k / n_total) p_{k,c}, n_k = client k's size."""
    holders = (counts > 0).float()
    w = sizes.float() / sizes.float().sum().clamp_min(1e-12)
    return torch.einsum("k,kc,kcd->cd", w, holders, protos.float()), holders.sum(0) > 0


@register_method
class VPDRFedProto(VPDRMethod):
    name = "vpdr_fedproto"
    loss_weights = {"prototype MSE": "lam"}
    eval_ignores = ("opt", "has", "protos")
    Options = Options
    loss_names = ("ce", "proto")

    def init_shared(self, env, rng):
        return {"protos": torch.zeros(env.num_classes, env.feature_dim), "has": torch.zeros(env.num_classes)}

    def loss_terms(self, env, ctx, *, feat, logits, y, x, model):
        terms = {"ce": F.cross_entropy(logits, y)}
        has = ctx["has"] > 0.5
        terms["proto"] = self.opts.lam * batch_proto_mse(feat, y, ctx["protos"].float(), has) if self.opts.lam > 0 else feat.sum() * 0.0
        return terms

    def aggregate(self, env, shared, uploads, rng):
        protos, counts = stack_uploads(uploads)
        if self.opts.proto_weighting == "all_clients":
            sizes = torch.tensor([u.num_samples for u in uploads])
            P, has = aggregate_all_clients(protos, counts, sizes)
        else:
            P, has = aggregate_prototypes(protos, counts, "samples")
        return {"protos": P, "has": has.float()}
