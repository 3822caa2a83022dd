"""FedGH (Yi et al. 2023, "Federated generalised head") on the client zoo, as HtFLlib runs it for
fedtsp.txt Table 1 (SPEC 2.9: server lr 0.01).

Round    The server broadcasts the global head (W, b) (a Linear(d, C) on the common feature width d).
Client   Replaces its head with the global head (HtFLlib's set_parameters), trains its whole model for E
         epochs with CE (plain SGD, fresh each round), then uploads the class means of f_i(x) over its
         training set (eval mode, after training: HtFLlib's collect_protos) and their counts.
Server   Trains the global head on the uploaded (prototype, class) pairs: `server_epochs` epochs of plain
         SGD at `server_lr` over shuffled mini-batches of the run's batch size (drop_last=False) of
         CE(W p + b, c); the head persists across rounds (it is the state).
Eval     Each client's own extractor with the global head.
Uploads  the class means are a prototype release (noised by dp.prototypes under local DP); the counts
         are public. The head is never uploaded.

Round 0: the server draws the first global head from its own stream (HtFLlib copies client 0's initial
head, a random init as well).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, ServerResult, register_method
from raysim.methods.families.prototype import COUNTS_NOTE, stack_uploads
from raysim.methods.families.zoo import GlobalHead, HeteroMethod, HtEnv, ZooModelOptions, snapshot, validate_common
from raysim.privacy.mechanisms import prototype, public


@dataclass
class Options(ZooModelOptions):
    server_lr: float = 0.01
    server_epochs: int = 100  # epochs over the uploaded prototypes per round (HtFLlib's default)

    def validate(self) -> None:
        validate_common(self, "fedgh")
        if not self.server_lr > 0 or self.server_epochs < 0:
            raise ConfigError("fedgh: server_lr > 0 and server_epochs >= 0")


def train_head(W: Tensor, b: Tensor, protos: Tensor, labels: Tensor, *, epochs: int, batch: int, lr: float,
               rng: torch.Generator) -> tuple[Tensor, Tensor, float]:
    """The server step: `epochs` epochs of SGD(lr) on CE(W p + b, y) over shuffled mini-batches of the
    (prototype, label) pairs; returns the new (W, b) and the last batch's loss."""
    W, b = W.clone().float().requires_grad_(True), b.clone().float().requires_grad_(True)
    opt = torch.optim.SGD([W, b], lr=lr)
    protos = protos.float()
    loss = torch.tensor(float("nan"))
    for _ in range(epochs):
        perm = torch.randperm(len(labels), generator=rng).to(protos.device)
        for i in range(0, len(labels), batch):
            idx = perm[i : i + batch]
            loss = F.cross_entropy(F.linear(protos[idx], W, b), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return W.detach(), b.detach(), float(loss.detach())


@register_method
class FedGH(GlobalHead, HeteroMethod):
    name = "fedgh"
    Options = Options
    releases = {"protos": prototype(), "counts": public(COUNTS_NOTE)}
    server_metrics = ("loss",)

    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        return self.init_head(env, rng)

    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.with_global_head(self.model(env, private), shared)
        loss = self.train_model(env, model, data, rng, privacy=privacy)
        return LocalResult(
            upload=self.release_prototypes(env, model, data, privacy),
            private={**private, "model": snapshot(model)},
            num_samples=data.num_train,
            metrics={"loss": loss},
        )

    def aggregate(self, env: HtEnv, shared, uploads, rng):
        protos, counts = stack_uploads(uploads)
        held = counts > 0  # every (client, class) pair the client holds is one training example
        feats, labels = protos[held].to(env.device), held.nonzero()[:, 1].to(env.device)
        W, b, loss = train_head(shared["head.weight"].to(env.device), shared["head.bias"].to(env.device), feats, labels,
                                epochs=self.opts.server_epochs, batch=self.train.batch_size, lr=self.opts.server_lr, rng=rng)
        return ServerResult({"head.weight": W.cpu(), "head.bias": b.cpu()}, {"loss": loss})
