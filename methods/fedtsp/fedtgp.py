"""FedTGP (Zhang et al.): trainable global prototypes with an adaptive margin (SPEC 3.5).

Client   As FedProto: L = CE + lambda * MSE(f_i(x), P_g[y]); uploads class means of f_i(x) and counts.
Server   Keeps a prototype generator G: class embedding (C x d) -> Linear(d, h) -> ReLU -> Linear(h, d).
         Each round: the per-class average of the uploads gives gap_c = the distance from class c's
         average to the nearest other class's average; margin = min(max_c gap_c, threshold). Then
         `server_epochs` epochs of SGD over the uploaded (client, class) prototypes p with label y, in
         mini-batches of the run's batch size, of CE over classes c' of -(||p - G(c')|| + margin [c' = y]).
         G(c) for every class is broadcast as P_g.
protocol (see fedproto.py): head (default) and fedtsp (the code behind fedtsp.txt's tables) predict with
the client's own head; htfllib (upstream HtFLlib's clienttgp) by the nearest G(c) over every class (its
server exports G(c) for all classes once trained). Under every protocol the class means are taken after
training (eval mode), as clienttgp.py does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError
from raysim.methods.base import ServerResult, register_method
from raysim.methods.families.prototype import aggregate_prototypes, stack_uploads
from raysim.methods.families.zoo import ZooOptions, validate_common
from raysim.methods.fedtsp.fedproto import FedProto
from raysim.sampling import GLOBAL_RNG_LOCK


@dataclass
class Options(ZooOptions):
    server_epochs: int = 100
    server_lr: float = 0.01
    server_hidden: int = 512
    margin_threshold: float = 100.0

    def validate(self) -> None:
        validate_common(self, "fedtgp")
        if self.server_epochs < 0 or self.server_hidden < 1 or not self.server_lr > 0 or self.margin_threshold < 0:
            raise ConfigError("fedtgp: server_epochs >= 0, server_hidden >= 1, server_lr > 0, margin_threshold >= 0")


class PrototypeGenerator(nn.Module):
    def __init__(self, num_classes: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(num_classes, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self) -> Tensor:
        return self.mlp(self.emb.weight)


def adaptive_margin(avg: Tensor, has: Tensor, threshold: float) -> float:
    """min(max_c gap_c, threshold), gap_c = distance from class c's average to the nearest other class's."""
    a = avg[has]
    if a.shape[0] < 2:
        return 0.0
    d = torch.cdist(a, a)
    d.fill_diagonal_(float("inf"))
    return float(min(float(d.min(1).values.max()), threshold))


def margin_loss(feats: Tensor, labels: Tensor, protos: Tensor, margin: float) -> Tensor:
    dist = torch.cdist(feats, protos)
    dist = dist + margin * F.one_hot(labels, protos.shape[0]).to(dist.dtype)
    return F.cross_entropy(-dist, labels)


def train_generator(g: PrototypeGenerator, feats: Tensor, labels: Tensor, margin: float, *, epochs: int, lr: float,
                    batch_size: int, rng: torch.Generator) -> Tensor:
    """`epochs` epochs of plain SGD on margin_loss over the (prototype, class) pairs, in shuffled
    mini-batches (the last one partial); returns the last batch's loss (nan when nothing trained)."""
    g.train()
    opt = torch.optim.SGD(g.parameters(), lr=lr)
    loss = torch.tensor(math.nan)
    for _ in range(epochs):
        perm = torch.randperm(len(labels), generator=rng).to(feats.device)
        for i in range(0, len(labels), batch_size):
            idx = perm[i : i + batch_size]
            loss = margin_loss(feats[idx], labels[idx], g(), margin)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return loss.detach()


def seeded_generator(env, hidden: int, shared=None, rng=None) -> PrototypeGenerator:
    """The server's generator: fresh weights drawn from `rng` (torch's global stream untouched), or the
    `gen.*` entries of the server state when `shared` holds them."""
    with GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
        if rng is not None:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
        g = PrototypeGenerator(env.num_classes, env.feature_dim, hidden)
    if shared is not None:
        g.load_state_dict({k[4:]: v for k, v in shared.items() if k.startswith("gen.")})
    return g.to(env.device)


@register_method
class FedTGP(FedProto):
    name = "fedtgp"
    eval_ignores = ("protos", "has", "margin")  # train-time
    Options = Options
    server_only = ("gen",)  # the generator trains and stays on the server; clients get its prototypes
    server_metrics = ("loss",)
    htfllib_collects_during_training = False  # clienttgp.py collects its class means after training

    def prediction_classes(self, shared):
        """protocol=htfllib: every class's G(c), once the server has trained G (HtFLlib)."""
        trained = bool((shared["has"] > 0.5).any())
        return torch.full_like(shared["has"], float(trained)) > 0.5

    def _generator(self, env, shared=None, rng=None) -> PrototypeGenerator:
        return seeded_generator(env, self.opts.server_hidden, shared, rng)

    def init_shared(self, env, rng):
        g = self._generator(env, rng=rng)
        return {
            "protos": torch.zeros(env.num_classes, env.feature_dim),
            "has": torch.zeros(env.num_classes),
            "margin": torch.zeros(1),
            **{f"gen.{k}": v.detach().cpu() for k, v in g.state_dict().items()},
        }

    def aggregate(self, env, shared, uploads, rng):
        protos, counts = stack_uploads(uploads)
        avg, has = aggregate_prototypes(protos, counts, "uniform")
        margin = adaptive_margin(avg, has, self.opts.margin_threshold)
        held = counts > 0
        feats, labels = protos[held].float().to(env.device), held.nonzero()[:, 1].to(env.device)
        g = self._generator(env, shared)
        loss = train_generator(g, feats, labels, margin, epochs=self.opts.server_epochs, lr=self.opts.server_lr,
                               batch_size=self.train.batch_size, rng=rng)
        with torch.no_grad():
            out = g().cpu()
        return ServerResult({
            "protos": out,
            "has": ((shared["has"].cpu() > 0.5) | has).float(),
            "margin": torch.tensor([margin]),
            **{f"gen.{k}": v.detach().cpu() for k, v in g.state_dict().items()},
        }, {"loss": float(loss.detach())})
