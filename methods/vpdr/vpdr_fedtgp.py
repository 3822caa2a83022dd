"""FedTGP (Zhang et al., trainable global prototypes) with the VPDR paper's settings (SPEC 3.5).

The algorithm is the FedTSP scripts' FedTGP (methods/fedtsp/fedtgp.py: the generator, the adaptive margin,
the margin loss and its SGD loop are shared); the settings differ and stay here:

                        VPDR (this file)               FedTSP scripts (fedtgp.py)
  server SGD lr         the client lr, 1e-3            0.01
  client lambda         1.0                            1.0
  server epochs         100                            100
  margin threshold      100                            100
  one class uploaded    margin = threshold (as coded)  margin = 0

Server   A persistent generator G: class embedding (C x 512) -> Linear(512, 512) + ReLU -> Linear(512, 512).
         The uploads are averaged per class over the clients holding it; gap_c = the distance to the
         nearest other class's average and margin = min(max_c gap_c, 100). Then 100 epochs of SGD
         (batch = the client batch size) over the uploaded (prototype, class) pairs of
         CE over c' of -(||p - G(c')|| + margin [c' = y]). G(c) for every class is broadcast.
Client   L = CE + 1.0 * MSE(f, P_g[y]) (every class has a generated prototype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ServerResult, register_method
from raysim.methods.families.prototype import aggregate_prototypes, proto_mse, stack_uploads
from raysim.methods.families.vpdr import VPDRMethod, VPDROptions
from raysim.methods.fedtsp.fedtgp import PrototypeGenerator, adaptive_margin, seeded_generator, train_generator

LAMBDA = 1.0
SERVER_EPOCHS = 100
MARGIN_THRESHOLD = 100.0


def vpdr_margin(avg: Tensor, has: Tensor, threshold: float = MARGIN_THRESHOLD) -> float:
    """min(max_c gap_c, threshold); with fewer than two classes every gap is the code's 1e9 sentinel,
    so the margin is the threshold."""
    if int(has.sum()) < 2:
        return float(threshold)
    return adaptive_margin(avg, has, threshold)


def tgp_aggregate(g: PrototypeGenerator, protos: Tensor, counts: Tensor, *, epochs: int = SERVER_EPOCHS, lr: float,
                  batch_size: int, margin_threshold: float = MARGIN_THRESHOLD,
                  rng: torch.Generator) -> tuple[Tensor, float, Tensor]:
    """One FedTGP server step: protos (K, C, d) uploads, counts (K, C) -> (G(c) for all classes (C, d),
    margin, last server loss); trains `g` in place."""
    avg, has = aggregate_prototypes(protos, counts, "uniform")
    margin = vpdr_margin(avg, has, margin_threshold)
    held = counts > 0
    dev = next(g.parameters()).device
    feats, labels = protos[held].float().to(dev), held.nonzero()[:, 1].to(dev)
    loss = train_generator(g, feats, labels, margin, epochs=epochs, lr=lr, batch_size=batch_size, rng=rng)
    g.eval()
    with torch.no_grad():
        out = g().cpu()
    return out, margin, loss


# --------------------------------------------------------------------------------- the method


@dataclass
class Options(VPDROptions):
    lam: float = LAMBDA
    server_epochs: int = SERVER_EPOCHS
    server_lr: float = 0.0  # 0 = the clients' lr (vpdr_fedtgp.lr, 1e-3), as the code
    server_hidden: int = 512
    margin_threshold: float = MARGIN_THRESHOLD

    def validate(self) -> None:
        if self.lam < 0 or self.server_epochs < 0 or self.server_lr < 0 or self.server_hidden < 1 or self.margin_threshold < 0:
            raise ConfigError("vpdr_fedtgp: lam >= 0, server_epochs >= 0, server_lr >= 0 (0 = the client lr), server_hidden >= 1, "
                              "margin_threshold >= 0")


@register_method
class VPDRFedTGP(VPDRMethod):
    name = "vpdr_fedtgp"
    loss_weights = {"prototype margin": "lam"}
    eval_ignores = ("opt", "has", "protos")
    Options = Options
    loss_names = ("ce", "proto")
    server_only = ("gen",)  # the generator trains and stays on the server; clients get G(c)
    server_metrics = ("loss", "margin")

    def _generator(self, env, shared=None, rng=None) -> PrototypeGenerator:
        return seeded_generator(env, self.opts.server_hidden, shared, rng)

    def init_shared(self, env, rng):
        g = self._generator(env, rng=rng)
        return {"protos": torch.zeros(env.num_classes, env.feature_dim), "has": torch.zeros(env.num_classes),
                **{f"gen.{k}": v.detach().cpu() for k, v in g.state_dict().items()}}

    def loss_terms(self, env, ctx, *, feat, logits, y, x, model):
        has = ctx["has"] > 0.5
        proto = proto_mse(feat, y, ctx["protos"].float(), has) if bool(has.any()) else feat.sum() * 0.0
        return {"ce": F.cross_entropy(logits, y), "proto": self.opts.lam * proto}

    def aggregate(self, env, shared, uploads, rng):
        g = self._generator(env, shared)
        protos, counts = stack_uploads(uploads)
        out, margin, loss = tgp_aggregate(g, protos, counts, epochs=self.opts.server_epochs, lr=self.opts.server_lr or self.opts.lr,
                                          batch_size=self.train.batch_size, margin_threshold=self.opts.margin_threshold, rng=rng)
        state = {"protos": out, "has": torch.ones(env.num_classes),  # G(c) exists for every class
                 **{f"gen.{k}": v.detach().cpu() for k, v in g.state_dict().items()}}
        return ServerResult(state, {"loss": float(loss), "margin": margin})
