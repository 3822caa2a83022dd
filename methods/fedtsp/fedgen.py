"""FedGen (Zhu et al. 2021, "Data-free knowledge distillation for heterogeneous FL") on the client zoo,
with the settings of fedtsp.txt Table 1 (SPEC 2.9: noise dim 32, hidden 512, generator lr 0.1); HtFLlib's
code, and the FedTSP authors' fork behind that table, never keep the trained generator (`generator=initial`).

On top of LG-FedAvg's shared head, the server learns a conditional generator G(noise, y) -> R^d of
features that the clients' heads classify as y, and clients use it as a regulariser of their head.

Generator  G: [noise (noise_dim); onehot(y) (C)] -> Linear(., hidden) -> BatchNorm1d -> ReLU ->
           Linear(hidden, d). The official code (and HtFLlib's copy) draws the noise with torch.rand, i.e.
           U[0, 1), though its comment says Gaussian: `noise=uniform` (default) reproduces it,
           `noise=gaussian` draws N(0, 1).
Client     Replaces its head with the global head, then E epochs of plain SGD on
               L = CE(h(f(x)), y) + CE(h(G(noise, y~)), y~)
           with a fresh batch (run's batch size) of labels y~ ~ the label distribution and noise per step;
           G stays fixed on the client (training mode, batch statistics, as HtFLlib's loaded generator).
           Uploads its head and its per-class counts.
Server     `server_epochs` steps of Adam(lr = gen_lr, fresh each round) on G: labels y~ ~ the uploaded
           counts, CE(sum_k w_k h_k(G(noise, y~)), y~) with w_k = n_k / sum n; then the heads' weighted
           average is the new global head (LG-FedAvg).
Broadcast  the global head, G's weights (with its BatchNorm buffers) and the summed label counts. G is
           broadcast as in FedGen's algorithm (clients sample from it); it is a function of the uploaded,
           already privatised heads and the public counts only, so broadcasting it is post-processing and
           costs no privacy. Nothing is kept server-only: the optimiser is recreated every round (HtFLlib).
Uploads    the head: an update of the broadcast head (dp.level=client); the counts are public.

`generator=initial` (HtFLlib's servergen.py, the same in XinghaoWu/FedTSP_CVPR26): its server loads the saved
G, trains that copy for server_epochs steps and never saves it back, so every client of every round samples from
the untrained initial G (in training mode: BatchNorm on batch statistics). The server's steps change nothing
there, so raysim skips them (the server's loss is logged as nan) and broadcasts the initial G each round: FedGen
reduces to LG-FedAvg plus the fixed regulariser CE(h(G_0(noise, y~)), y~). `generator=trained` (default) is
FedGen's algorithm.

Round 0: the clients have no label distribution yet (the server learns it from the first uploads), so
they train without the generator term; HtFLlib's clients already apply its untrained generator in round 0.
The label distribution is that of the round's uploads (HtFLlib: all clients', fixed at start; the same
with full participation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, ServerResult, register_method
from raysim.methods.families.prototype import COUNTS_NOTE
from raysim.methods.families.zoo import HtEnv, ZooModelOptions, average_heads, head_of, snapshot, validate_common
from raysim.methods.fedtsp.lgfedavg import LGFedAvg
from raysim.privacy.mechanisms import public, update
from raysim.sampling import seeded_global_rng


@dataclass
class Options(ZooModelOptions):
    noise_dim: int = 32
    hidden_dim: int = 512
    gen_lr: float = 0.1  # the generator's Adam learning rate
    server_epochs: int = 100  # generator steps per round, one batch of the run's batch size each (HtFLlib)
    noise: str = "uniform"  # uniform: U[0, 1) (the official code's torch.rand) | gaussian: N(0, 1)
    generator: str = "trained"  # trained: the server trains G (FedGen) | initial: clients always sample the initial G (HtFLlib)

    def validate(self) -> None:
        validate_common(self, "fedgen")
        if self.noise_dim < 1 or self.hidden_dim < 1:
            raise ConfigError("fedgen.noise_dim and fedgen.hidden_dim must be >= 1")
        if not self.gen_lr > 0 or self.server_epochs < 0:
            raise ConfigError("fedgen: gen_lr > 0 and server_epochs >= 0 (0 = the generator is never trained)")
        if self.noise not in ("uniform", "gaussian"):
            raise ConfigError(f"fedgen.noise must be uniform (the official code's torch.rand) or gaussian, got {self.noise!r}")
        if self.generator not in ("trained", "initial"):
            raise ConfigError(f"fedgen.generator must be trained (the server trains G, FedGen's algorithm) or initial (the "
                              f"clients sample the untrained initial G, as HtFLlib's server discards its trained copy), "
                              f"got {self.generator!r}")


class Generator(nn.Module):
    """G(noise, y) = Linear(BN-ReLU(Linear([noise; onehot(y)])))."""

    def __init__(self, noise_dim: int, num_classes: int, hidden: int, feature_dim: int) -> None:
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.fc1 = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
        self.fc = nn.Linear(hidden, feature_dim)

    def forward(self, labels: Tensor, noise: Tensor) -> Tensor:
        y = F.one_hot(labels, self.num_classes).to(noise.dtype)
        return self.fc(self.fc1(torch.cat([noise, y], dim=1)))


def draw(gen: Generator, label_counts: Tensor, batch: int, kind: str, rng: torch.Generator, device) -> tuple[Tensor, Tensor]:
    """A batch of (labels ~ label_counts, noise) from `rng` (labels with replacement, as np.random.choice)."""
    labels = torch.multinomial(label_counts.float().cpu(), batch, replacement=True, generator=rng)
    shape = (batch, gen.noise_dim)
    noise = torch.rand(shape, generator=rng) if kind == "uniform" else torch.randn(shape, generator=rng)
    return labels.to(device), noise.to(device)


def ensemble_logits(z: Tensor, heads: Sequence[tuple[Tensor, Tensor]], weights: Tensor) -> Tensor:
    """sum_k w_k (z W_k^T + b_k): the sample-weighted ensemble of the uploaded heads."""
    out = torch.zeros(z.shape[0], heads[0][0].shape[0], device=z.device, dtype=z.dtype)
    for w, (W, b) in zip(weights, heads):
        out = out + float(w) * F.linear(z, W, b)
    return out


def train_generator(gen: Generator, heads: Sequence[tuple[Tensor, Tensor]], weights: Tensor, label_counts: Tensor, *,
                    steps: int, batch: int, lr: float, noise: str, rng: torch.Generator) -> list[float]:
    """The server step: `steps` Adam steps on CE(ensemble(G(noise, y)), y); the loss of each step."""
    dev = next(gen.parameters()).device
    heads = [(W.to(dev).float(), b.to(dev).float()) for W, b in heads]
    opt = torch.optim.Adam(gen.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    gen.train()
    losses = []
    for _ in range(steps):
        y, eps = draw(gen, label_counts, batch, noise, rng, dev)
        loss = F.cross_entropy(ensemble_logits(gen(y, eps), heads, weights), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@register_method
class FedGen(LGFedAvg):
    name = "fedgen"
    eval_ignores = ("model.head", "gen", "label_counts")  # the generator and counts only shape training
    Options = Options
    releases = {"head.weight": update(), "head.bias": update(), "counts": public(COUNTS_NOTE)}
    server_only = ()  # G is broadcast (the clients' regulariser samples from it); see the module docstring
    client_metrics = ("loss", "ce", "gen")
    server_metrics = ("loss",)

    def new_generator(self, env: HtEnv, rng: torch.Generator) -> Generator:
        """A freshly initialised G, a function of `rng` only."""
        with seeded_global_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=rng))):
            return Generator(self.opts.noise_dim, env.num_classes, self.opts.hidden_dim, env.feature_dim)

    def independent_clients(self) -> bool:
        """False: every client's step samples from the host's one generator module (env.extra)."""
        return False

    def generator(self, env: HtEnv, shared: dict[str, Tensor]) -> Generator:
        """The host's one generator module, loaded with the broadcast G."""
        g = env.extra.get("generator")
        if g is None:
            g = env.extra["generator"] = Generator(self.opts.noise_dim, env.num_classes, self.opts.hidden_dim, env.feature_dim)
        g.load_state_dict({k[4:]: v for k, v in shared.items() if k.startswith("gen.")})
        return g.to(env.device)

    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        head = self.init_head(env, rng)
        g = self.new_generator(env, rng)
        return {**head, **gen_state(g), "label_counts": torch.zeros(env.num_classes)}

    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.with_global_head(self.model(env, private), shared)
        counts = shared["label_counts"]
        gen_terms: list[float] = []
        extra = None
        if float(counts.sum()) > 0:
            g = self.generator(env, shared).train()  # batch statistics, as HtFLlib's loaded generator

            def extra(feats, y):
                with torch.no_grad():  # G is not trained on the client
                    yg, eps = draw(g, counts, self.train.batch_size, self.opts.noise, rng, env.device)
                    z = g(yg, eps)
                term = F.cross_entropy(model.head(z), yg)
                gen_terms.append(float(term.detach()))
                return term
        loss = self.train_model(env, model, data, rng, extra, privacy)
        gen = sum(gen_terms) / len(gen_terms) if gen_terms else 0.0
        return LocalResult(
            upload={**head_of(model), "counts": torch.bincount(data.y_train, minlength=data.num_classes).float()},
            private={**private, "model": snapshot(model)},
            num_samples=data.num_train,
            metrics={"loss": loss, "ce": loss - gen, "gen": gen},
        )

    def aggregate(self, env: HtEnv, shared, uploads, rng):
        total = float(sum(u.num_samples for u in uploads))
        weights = torch.tensor([u.num_samples / total for u in uploads])
        heads = [(u.tensors["head.weight"], u.tensors["head.bias"]) for u in uploads]
        counts = torch.stack([u.tensors["counts"].float() for u in uploads]).sum(0)
        g = self.generator(env, shared)
        losses = [float("nan")]
        if float(counts.sum()) > 0 and self.opts.server_epochs > 0 and self.opts.generator == "trained":
            losses = train_generator(g, heads, weights, counts, steps=self.opts.server_epochs, batch=self.train.batch_size,
                                     lr=self.opts.gen_lr, noise=self.opts.noise, rng=rng)
        return ServerResult({**average_heads(uploads), **gen_state(g), "label_counts": counts}, {"loss": losses[-1]})


def gen_state(g: Generator) -> dict[str, Tensor]:
    return {f"gen.{k}": v.detach().cpu().clone() for k, v in g.state_dict().items()}
