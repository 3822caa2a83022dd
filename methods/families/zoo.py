"""What the heterogeneous-model methods (FedTSP, FedProto, FedTGP, local and the other zoo baselines) share:
the client's own model from the zoo (client i gets model i mod X, SPEC 2.5), its options and their checks,
its training loop (plain SGD, fresh each round, SPEC 2.4), its per-class feature means, and the global
Linear(d, C) head that LG-FedAvg, FedGen and FedGH broadcast onto the clients' own extractors (every zoo
model ends in the same head whatever its extractor, so heads of different architectures can be averaged).
The prototype arithmetic is methods/families/prototype.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, EnvSpec, Method, Needs, Upload, weighted_mean
from raysim.models.zoo import FAMILIES, HtModel, arch_of, make_client_model, uses_global_rng
from raysim.sampling import epoch_batches, seeded_global_rng

# every architecture of the zoo (all ResNet-n are in HtFE9)
ARCHS: tuple[str, ...] = tuple(dict.fromkeys(a for fam in FAMILIES.values() for a in fam))


@dataclass
class HtEnv:
    """Per host: the device, the class count, d, and a cache of built client models (weights live in
    each client's private state; the cache only saves rebuilding modules every round)."""

    device: torch.device
    num_classes: int
    feature_dim: int
    models: dict[int, HtModel] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ZooOptions:
    """Knobs shared by the prototype methods on the heterogeneous client zoo."""

    lam: float = 1.0
    model_family: str = "HtFE2"  # HtFE2 | HtFE3 | HtFE4 | HtFE9 | tiny
    feature_dim: int = 512
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)
    protocol: str = "head"  # head | fedtsp (FedTSP's code: head) | htfllib (nearest global prototype); see fedproto.py


@dataclass
class ZooModelOptions:
    """The knobs of the client's own zoo model every zoo method without prototype knobs has."""

    model_family: str = "HtFE2"  # HtFE2 | HtFE3 | HtFE4 | HtFE9 | tiny
    feature_dim: int = 512
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)


def validate_common(o: Any, name: str) -> None:
    """Checks of the zoo options (model_family, feature_dim, client_lr) and, where the options have them, of
    the prototype knobs (lam, proto_weighting, protocol)."""
    if o.model_family.lower() not in {f.lower() for f in FAMILIES}:
        raise ConfigError(f"{name}.model_family must be one of {', '.join(FAMILIES)}, got {o.model_family!r}")
    if o.feature_dim < 1:
        raise ConfigError(f"{name}.feature_dim must be >= 1")
    if o.client_lr < 0:
        raise ConfigError(f"{name}.client_lr must be >= 0 (0 = the run's lr)")
    if getattr(o, "lam", 0.0) < 0:
        raise ConfigError(f"{name}.lam must be >= 0")
    if getattr(o, "proto_weighting", "samples") not in ("samples", "uniform"):
        raise ConfigError(f"{name}.proto_weighting must be samples or uniform")
    if getattr(o, "protocol", "head") not in ("head", "fedtsp", "htfllib"):
        raise ConfigError(f"{name}.protocol must be head (predict with the client's head), fedtsp (as the code "
                          f"behind fedtsp.txt's tables: HtFLlib's prototype collection, predict with the head) or "
                          f"htfllib (predict by the nearest global prototype, as upstream HtFLlib), got {o.protocol!r}")


class HeteroMethod(Method):
    """Base of methods that train a client-owned model of the zoo on raw images."""

    image_size = 32  # the zoo's input size

    def __init__(self, train: Any, options: Any, dp: Any = None) -> None:
        super().__init__(train, options, dp)
        from raysim.methods.base import TrainConfig

        plain = TrainConfig()
        if (train.momentum, train.weight_decay) != (plain.momentum, plain.weight_decay):
            raise ConfigError(
                f"{self.name} trains its client models with plain SGD (SPEC 2.4): momentum and weight_decay do not "
                f"apply; leave them at their defaults ({plain.momentum}, {plain.weight_decay}) and set lr or {self.name}.client_lr"
            )

    @property
    def client_lr(self) -> float:
        """The clients' plain-SGD learning rate: the method's client_lr, or the run's lr when it is 0."""
        return float(self.opts.client_lr or self.train.lr)

    def needs(self) -> Needs:
        return Needs(input="images", image_size=self.image_size)

    def independent_clients(self) -> bool:
        """A zoo client's step touches only its own model (env.models holds one per client) and its `rng`;
        not where the family has a model with dropout (GoogLeNet, HtFLlib's MobileNetV2), whose masks come
        from torch's global RNG: those train client by client. Subclasses that keep one module per host in
        env.extra, reloaded by every client's step, say False."""
        return not uses_global_rng(self.opts.model_family, getattr(self.opts, "model", ""))  # FedPCL: one `model` for all

    # -- env -------------------------------------------------------------------------------
    def feature_dim(self, spec: EnvSpec) -> int:
        return int(self.opts.feature_dim)

    def build_env(self, spec: EnvSpec, *, role: str) -> HtEnv:
        return HtEnv(torch.device(spec.device), len(spec.classnames), self.feature_dim(spec))

    # -- the client's model ------------------------------------------------------------------
    def init_private(self, env: HtEnv, data: ClientData, rng: torch.Generator) -> dict[str, Any]:
        arch = arch_of(self.opts.model_family, data.client_id)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
        model = make_client_model(arch, env.feature_dim, data.num_classes, image_size=self.image_size, seed=seed)
        return {"client": data.client_id, "arch": arch, "model": _snapshot(model)}

    def model(self, env: HtEnv, private: dict[str, Any]) -> HtModel:
        cid = int(private["client"])
        m = env.models.get(cid)
        if m is None or m.arch != private["arch"]:
            m = make_client_model(private["arch"], env.feature_dim, env.num_classes, image_size=self.image_size)
            env.models[cid] = m
        m.load_state_dict(private["model"])
        return m.to(env.device)

    def train_model(
        self,
        env: HtEnv,
        model: HtModel,
        data: ClientData,
        rng: torch.Generator,
        extra_loss: Optional[Callable[[Tensor, Tensor], Tensor]] = None,
        privacy: Any = None,
        on_batch: Optional[Callable[[Tensor, Tensor, Tensor], None]] = None,
    ) -> float:
        """E local epochs of CE(h(f(x)), y) + extra_loss(f(x), y); plain SGD at the client lr, fresh each
        round; drop_last batches, in the data's order (the official loaders) or shuffled (`shuffle`).
        `on_batch(idx, f(x), logits)` (detached, before the step) sees what the batch's forward pass gave,
        for methods that collect their upload during training (HtFLlib's FedProto and FedDistill)."""
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=self.client_lr)
        n, bs = data.num_train, self.train.batch_size
        losses = []
        for _ in range(self.train.local_epochs):
            for idx in epoch_batches(n, bs, rng, shuffle=self.opts.shuffle):
                if len(idx) < 2:  # BatchNorm cannot train on one sample
                    continue
                x, y = data.x_train[idx].to(env.device), data.y_train[idx].to(env.device)
                feats, logits = model(x)
                if on_batch is not None:
                    on_batch(idx, feats.detach(), logits.detach())
                loss = F.cross_entropy(logits, y)
                if extra_loss is not None:
                    loss = loss + extra_loss(feats, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        return sum(losses) / max(1, len(losses))

    @torch.no_grad()
    def train_features(self, env: HtEnv, model: HtModel, data: ClientData, batch: int = 256) -> Tensor:
        """(N, d) features f(x) of the client's training set (eval mode)."""
        model.eval()
        return torch.cat([model.features(data.x_train[i : i + batch].to(env.device)).float().cpu()
                          for i in range(0, data.num_train, batch)])

    def release_prototypes(self, env: HtEnv, model: HtModel, data: ClientData, privacy: Any) -> dict[str, Tensor]:
        """The upload {protos: (C, d) class means of f(x), counts: (C,)}: the means are a prototype release
        the host makes (noised under local DP by dp.prototypes), the counts are public."""
        feats = self.train_features(env, model, data)
        protos = privacy.release("protos", features=feats, labels=data.y_train, num_classes=data.num_classes)
        return {"protos": protos, "counts": torch.bincount(data.y_train, minlength=data.num_classes).float()}

    def predictor(self, env: HtEnv, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None):
        """Logits of the client's own head (the cache holds one module per client, so it is not shared)."""
        model = self.model(env, private).eval()
        return lambda x: model(x.to(env.device))[1]


class GlobalHead:
    """A global Linear(d, C) head the server broadcasts and every client puts on its own extractor."""

    opts: Any
    model: Callable[[HtEnv, dict[str, Any]], HtModel]  # HeteroMethod's (an annotation: nothing shadowed)
    eval_ignores: ClassVar[tuple[str, ...]] = ("model.head",)  # the global head replaces the own one

    def init_head(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        """A freshly initialised Linear(d, C) (PyTorch's default init), a function of `rng` only."""
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
        with seeded_global_rng(seed):
            head = nn.Linear(env.feature_dim, env.num_classes)
        return head_of(head)

    def with_global_head(self, model: HtModel, shared: dict[str, Tensor]) -> HtModel:
        """`model` with its head replaced by the broadcast one (HtFLlib's set_parameters)."""
        with torch.no_grad():
            model.head.weight.copy_(shared["head.weight"])
            model.head.bias.copy_(shared["head.bias"])
        return model

    def predictor(self, env: HtEnv, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None):
        """The client's own extractor with the global head."""
        model = self.with_global_head(self.model(env, private), shared).eval()
        return lambda x: model(x.to(env.device))[1]


HEAD_KEYS = ("head.weight", "head.bias")


def head_of(module: nn.Module) -> dict[str, Tensor]:
    """{"head.weight", "head.bias"} of a Linear head (or of an HtModel's head), detached on the CPU."""
    lin = module.head if isinstance(module, HtModel) else module
    assert isinstance(lin, nn.Linear)
    return {"head.weight": lin.weight.detach().cpu().clone(), "head.bias": lin.bias.detach().cpu().clone()}


def average_heads(uploads: list[Upload]) -> dict[str, Tensor]:
    """sum_k n_k head_k / sum_k n_k, per tensor."""
    return {k: weighted_mean(uploads, k) for k in HEAD_KEYS}


def _snapshot(model: torch.nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


snapshot = _snapshot
