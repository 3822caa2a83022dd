"""FedMRL (Yi et al. 2024, "Federated Model Heterogeneous Matryoshka Representation Learning") on the
heterogeneous client zoo (SPEC 2.9: sub-feature dim 128).

Client   Two feature extractors see every image: the global small homogeneous model g (one architecture for
         every client, pooled to the sub-feature dim d1 = `sub_dim`, with its head Linear(d1, C)) and the
         client's own zoo model f (pooled to d, head Linear(d, C)). A per-client lightweight representation
         projector P = Linear(d1 + d, d) fuses them, and the fused representation is read Matryoshka-style:
             r       = P([g(x), f(x)])                      (N, d)
             z_homo  = h_g(r[:, :d1])                       the shared head on the first d1 coordinates
             z_hetero = h_f(r)                              the client's head on all d
             L = CE(z_hetero, y) + CE(z_homo, y)
         g, f, P and both heads train together (plain SGD at the client lr, fresh each round). Uploads g
         (extractor and head).
Server   g <- the average of the uploaded g (uniform 1/K as HtFLlib, or sample-weighted).
Eval     h_f(P([g(x), f(x)])) with the current global g, as HtFLlib's clientMRL.test_metrics.
Private  f and its head, and P. Only g leaves the client, as an update() release (dp.level=client;
         dp.level=sample is refused: g is trained through the fused private representation).

HtFLlib quirk (`persist_projector=false`): clientMRL never saves its trained projector, so every round
(and every evaluation) starts again from the projector's initial weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.homogeneous import SharedOptions, SharedSmallModel, flatten_state, load_flat, mean_metrics, validate_shared
from raysim.methods.families.zoo import HtEnv, snapshot
from raysim.models.zoo import HtModel
from raysim.privacy.mechanisms import update
from raysim.sampling import seeded_global_rng


@dataclass
class Options(SharedOptions):
    sub_dim: int = 128  # d1, the shared model's feature width and the nested representation's
    persist_projector: bool = True  # False reproduces HtFLlib: the projector restarts from its init every round

    def validate(self) -> None:
        validate_shared(self, "fedmrl")
        if not 1 <= self.sub_dim <= self.feature_dim:
            raise ConfigError(f"fedmrl.sub_dim must be in [1, feature_dim={self.feature_dim}] (the nested "
                              f"representation is the first sub_dim of the fused d), got {self.sub_dim}")


def fuse(g: HtModel, f: HtModel, proj: nn.Module, x: Tensor, sub_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """(fused representation r (N, d), z_homo (N, C) from r[:, :sub_dim], z_hetero (N, C) from r)."""
    r = proj(torch.cat([g.features(x), f.features(x)], dim=1))
    return r, g.head(r[:, :sub_dim]), f.head(r)


@register_method
class FedMRL(SharedSmallModel):
    name = "fedmrl"
    eval_ignores = ("proj_init",)  # read only without persist_projector
    Options = Options
    releases = {"weights": update()}  # the shared small model only (dp.level=client)
    client_metrics = ("loss", "ce_hetero", "ce_homo")

    def shared_dim(self, env: HtEnv) -> int:
        return int(self.opts.sub_dim)

    def new_projector(self, env: HtEnv, seed: int = 0) -> nn.Linear:
        with seeded_global_rng(seed):
            return nn.Linear(self.opts.sub_dim + env.feature_dim, env.feature_dim)

    def projector(self, env: HtEnv, private: dict) -> nn.Linear:
        p = self.new_projector(env)
        p.load_state_dict(private["proj"] if self.opts.persist_projector else private["proj_init"])
        return p.to(env.device)

    def init_private(self, env, data: ClientData, rng):
        private = super().init_private(env, data, rng)
        state = snapshot(self.new_projector(env, int(torch.randint(0, 2**31 - 1, (1,), generator=rng))))
        return {**private, "proj": state, "proj_init": state}

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        f = self.model(env, private)
        g = self.shared_module(env, shared["weights"])
        proj = self.projector(env, private)
        mods = (f, g, proj)
        for m in mods:
            m.train()
        opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=self.client_lr)
        parts: dict[str, list[float]] = {k: [] for k in self.client_metrics}
        for x, y in self.batches(env, data, rng):
            _, z_homo, z_hetero = fuse(g, f, proj, x, self.opts.sub_dim)
            ce_hetero, ce_homo = F.cross_entropy(z_hetero, y), F.cross_entropy(z_homo, y)
            loss = ce_hetero + ce_homo
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            parts["loss"].append(float(loss.detach()))
            parts["ce_hetero"].append(float(ce_hetero.detach()))
            parts["ce_homo"].append(float(ce_homo.detach()))
        return LocalResult(
            upload={"weights": flatten_state(g.state_dict())},
            private={**private, "model": snapshot(f), "proj": snapshot(proj)},
            num_samples=data.num_train,
            metrics=mean_metrics(parts),
        )

    def predictor(self, env, shared, private, data=None):
        f = self.model(env, private).eval()
        proj = self.projector(env, private).eval()
        g = env.extra.get("shared_eval")  # its own module: the cached training one is reloaded by each client's round
        if g is None:
            g = env.extra["shared_eval"] = self.new_shared(env)
        g = load_flat(g, shared["weights"]).to(env.device).eval()  # the same broadcast for every client evaluated
        return lambda x: fuse(g, f, proj, x.to(env.device), self.opts.sub_dim)[2]
