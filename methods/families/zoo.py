"""What the heterogeneous-model methods (FedTSP, FedProto, FedTGP, local) share: the client's own model
from the zoo (client i gets model i mod X, SPEC 2.5), its training loop (plain SGD, fresh each round,
SPEC 2.4), per-class feature means, and the server's holders-only prototype average."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, EnvSpec, Method, Needs, Upload
from raysim.models.zoo import HtModel, arch_of, make_client_model
from raysim.sampling import epoch_batches


@dataclass
class HtEnv:
    """Per host: the device, the class count, d, and a cache of built client models (weights live in
    each client's private state; the cache only saves rebuilding modules every round)."""

    device: torch.device
    num_classes: int
    feature_dim: int
    models: dict[int, HtModel] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


COUNTS_NOTE = (
    "per-class sample counts: public in the papers (the server's prototype weights use them), and held fixed "
    "by the prototype mechanisms' neighbouring relation (replace one example by another of its class)"
)


def aggregate_prototypes(protos: Tensor, counts: Tensor, weighting: str = "samples") -> tuple[Tensor, Tensor]:
    """protos: (K, C, d) client class means; counts: (K, C) samples behind each -> (P (C, d), has (C,)).

    Only the clients holding class c enter P_c: "samples" weights them by n_{k,c} / sum_j n_{j,c}
    (fedtsp.txt Eq. 6), "uniform" takes their plain mean (the official code). Classes nobody holds are 0."""
    holders = counts > 0
    w = counts.float() if weighting == "samples" else holders.float()
    w = w * holders
    total = w.sum(0)
    w = w / total.clamp_min(1e-12)
    return torch.einsum("kc,kcd->cd", w, protos.float()), total > 0


def stack_uploads(uploads: list[Upload], key: str = "protos") -> tuple[Tensor, Tensor]:
    return torch.stack([u.tensors[key] for u in uploads]), torch.stack([u.tensors["counts"] for u in uploads])


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


class PerExampleMeans:
    """Each training example's mean of a per-example vector (its feature or its logits) over the batches
    that visited it during local training. `rows(labels)` gives one row per visited example, so a
    prototype release of them sees one row per example (the n_c its sensitivity 2R/n_c counts); their
    class means equal the class means of all rows collected (HtFLlib's agg_func) whenever every visited
    example was visited equally often (the fixed data order: the same drop_last batches each epoch)."""

    def __init__(self, n: int, width: int) -> None:
        self.sums = torch.zeros(n, width)
        self.hits = torch.zeros(n)

    def add(self, idx: Tensor, rows: Tensor) -> None:
        idx = idx.cpu().long()
        self.sums.index_add_(0, idx, rows.detach().float().cpu())
        self.hits.index_add_(0, idx, torch.ones(len(idx)))

    def rows(self, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(means (m, width), labels (m,)) of the m examples visited at least once."""
        seen = self.hits > 0
        return self.sums[seen] / self.hits[seen, None], labels.cpu()[seen]


def release_class_means(privacy: Any, name: str, means: PerExampleMeans, labels: Tensor, num_classes: int) -> dict[str, Tensor]:
    """{name: the prototype release of the per-example means, counts: the examples behind each class mean}.
    The counts are those of the visited examples: which positions drop_last leaves out is fixed by n and
    B (or by the rng), so under the release's relation (replace an example by one of its class) they are
    as public as the class counts."""
    rows, y = means.rows(labels)
    return {name: privacy.release(name, features=rows, labels=y, num_classes=num_classes),
            "counts": torch.bincount(y, minlength=num_classes).float()}


def _snapshot(model: torch.nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


snapshot = _snapshot
