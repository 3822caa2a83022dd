"""FedETF (Li et al., ICCV 2023): a fixed simplex-ETF classifier with a learnable projection and temperature.

The model is the zoo model whose head is a projection g: Linear(d, p) (p = `proj_dim`, the class count C
in the official code), followed by L2 normalisation; the classifier is a fixed simplex equiangular tight
frame M in R^{p x C},

    M = sqrt(C / (C - 1)) * U (I_C - 1 1^T / C),   U in R^{p x C} with orthonormal columns (p >= C),

whose columns have unit norm and pairwise cosine -1/(C-1). Logits are beta * normalise(g(f(x))) @ M with a
learnable temperature beta (the official `scaling_train`, initially 1).

Round    The server broadcasts the model w (extractor and projection, flattened), beta and M (drawn once).
Client   Trains w and beta for E epochs with the balanced softmax loss of the official code,
             CE(beta * z @ M + log n_c, y),   z = normalise(g(f(x))),  n_c the client's class-c count
         (plain SGD, fresh each round), and uploads w and beta. M never changes during training.
Server   w, beta <- sample-weighted FedAvg.
Eval     GFL (`finetune_epochs=0`): the global model with M.
         PFL ("FedETF-Per", `finetune_epochs=F>0`): the official personalisation, on the client's own data
         with the extractor frozen: F alternations of `finetune_inner` epochs of CE on M alone (lr
         `finetune_lr`, the official 0.1) and `finetune_inner` epochs on the projection g alone (lr
         `finetune_proj_lr`, the official 0.05); the official code runs 20 alternations of 3 epochs each,
         with momentum and weight decay on the projection step and after one more round of local training,
         here it is plain SGD from the global model, as every "-FT" row of this package. The personalised
         M and g are the client's private state (`private["per"]`), never uploaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.homogeneous import Homogeneous, class_counts, flatten_state, validate_homogeneous
from raysim.methods.families.zoo import HeteroMethod, HtEnv
from raysim.models.zoo import HtModel, make_client_model
from raysim.privacy.mechanisms import update
from raysim.sampling import epoch_batches


@dataclass
class Options:
    model: str = "fedavgcnn"  # the one architecture every client trains (any zoo model, e.g. resnet8, cnn_tiny)
    feature_dim: int = 512  # d, the pooled feature width before the projection
    proj_dim: int = 0  # p, the projection's width (the ETF lives in R^p); 0 = the class count C (the official code)
    beta_init: float = 1.0  # the learnable temperature's initial value (official scaling_train)
    balanced: bool = True  # train with the balanced softmax loss (the official code); False = plain CE
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)
    finetune_epochs: int = 0  # > 0: "FedETF-Per", F alternations of fine-tuning M and the projection per client
    finetune_inner: int = 3  # epochs of each half of one alternation (official 3)
    finetune_lr: float = 0.1  # lr of the ETF fine-tuning (official 0.1)
    finetune_proj_lr: float = 0.05  # lr of the projection fine-tuning (official 0.05)

    def validate(self) -> None:
        if self.proj_dim < 0:
            raise ConfigError("fedetf.proj_dim must be >= 0 (0 = the class count)")
        if not self.beta_init > 0:
            raise ConfigError("fedetf.beta_init must be > 0")
        if self.finetune_inner < 1 or self.finetune_proj_lr < 0:
            raise ConfigError("fedetf.finetune_inner must be >= 1 and fedetf.finetune_proj_lr >= 0")
        validate_homogeneous(self, "fedetf")


def simplex_etf(dim: int, num_classes: int, rng: torch.Generator) -> Tensor:
    """(dim, C): a random simplex ETF, M = sqrt(C/(C-1)) U (I - 11^T/C) with U^T U = I (U from the QR
    decomposition of a Gaussian matrix drawn from `rng`). Columns: unit norm, pairwise cosine -1/(C-1)."""
    C = int(num_classes)
    if C < 2:
        raise ConfigError("fedetf needs at least 2 classes for a simplex ETF")
    if dim < C:
        raise ConfigError(f"fedetf.proj_dim={dim} is smaller than the {C} classes: a simplex ETF needs proj_dim >= C (0 = C)")
    a = torch.randn(dim, C, generator=rng, dtype=torch.float64)
    u, _ = torch.linalg.qr(a)  # (dim, C), orthonormal columns
    centred = torch.eye(C, dtype=torch.float64) - torch.full((C, C), 1.0 / C, dtype=torch.float64)
    return (math.sqrt(C / (C - 1)) * u @ centred).float()


def etf_logits(z: Tensor, etf: Tensor, beta: Tensor) -> Tensor:
    """beta * normalise(z) @ M."""
    return beta * F.normalize(z, dim=1) @ etf


def balanced_softmax_ce(logits: Tensor, y: Tensor, counts: Tensor) -> Tensor:
    """CE(logits + log n_c, y) (Ren et al.'s balanced softmax, the official FedETF training loss); classes
    the client lacks get -inf, so they drop out of the softmax."""
    log_prior = torch.where(counts > 0, counts.clamp_min(1e-12).log(), torch.full_like(counts, -math.inf))
    return F.cross_entropy(logits + log_prior.to(logits.device), y)


@register_method
class FedETF(Homogeneous, HeteroMethod):
    name = "fedetf"
    Options = Options
    releases = {"weights": update(), "beta": update()}  # the trained model and temperature (dp.level=client)
    global_predictor = True  # every client evaluates the global model (unless finetune_epochs > 0: FedETF-Per)

    def proj_dim(self, env: HtEnv) -> int:
        return int(self.opts.proj_dim or env.num_classes)

    def new_model(self, env: HtEnv, seed: int = 0) -> HtModel:
        """The zoo model with its head replaced by the projection Linear(d, p)."""
        return make_client_model(self.opts.model.lower(), env.feature_dim, self.proj_dim(env), image_size=self.image_size, seed=seed)

    # -- server half ----------------------------------------------------------------------------
    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        return {
            "weights": self.init_weights(env, rng),
            "beta": torch.tensor([float(self.opts.beta_init)]),
            "etf": simplex_etf(self.proj_dim(env), env.num_classes, rng),
        }

    def aggregate(self, env: HtEnv, shared, uploads, rng):
        return {"weights": weighted_mean(uploads, "weights"), "beta": weighted_mean(uploads, "beta"),
                "etf": shared["etf"].detach().cpu().clone()}

    # -- client half ----------------------------------------------------------------------------
    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.global_model(env, shared["weights"]).train()
        beta = nn.Parameter(shared["beta"].detach().clone().float().to(env.device))
        etf = shared["etf"].to(env.device).float()
        counts = class_counts(data.y_train, env.num_classes).to(env.device)
        opt = torch.optim.SGD([*model.parameters(), beta], lr=self.client_lr)
        losses = []
        for _ in range(self.train.local_epochs):
            for idx in epoch_batches(data.num_train, self.train.batch_size, rng, shuffle=self.opts.shuffle):
                if len(idx) < 2:  # BatchNorm cannot train on one sample
                    continue
                x, y = data.x_train[idx].to(env.device), data.y_train[idx].to(env.device)
                logits = etf_logits(model.head(model.features(x)), etf, beta)
                loss = balanced_softmax_ce(logits, y, counts) if self.opts.balanced else F.cross_entropy(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        return LocalResult(
            upload={"weights": flatten_state(model.state_dict()), "beta": beta.detach().cpu().reshape(1)},
            private={**private, "rounds": int(private.get("rounds", 0)) + 1},
            num_samples=data.num_train,
            metrics={"loss": sum(losses) / max(1, len(losses))},
        )

    # -- evaluation -----------------------------------------------------------------------------
    def predictor(self, env: HtEnv, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None):
        model = self.global_model(env, shared["weights"]).eval()
        beta = shared["beta"].to(env.device).float()
        proj: nn.Module = model.head
        etf = shared["etf"].to(env.device).float()
        if self.opts.finetune_epochs > 0:
            if data is None:
                raise ValueError("fedetf with finetune_epochs > 0 (FedETF-Per) needs the client's data to evaluate")
            proj, etf = self.personalise(env, model, beta, etf, data)
            private["per"] = {"proj": {k: v.detach().cpu().clone() for k, v in proj.state_dict().items()},
                              "etf": etf.detach().cpu().clone()}
        return lambda x: etf_logits(proj(model.features(x.to(env.device))), etf, beta)

    def personalise(self, env: HtEnv, model: HtModel, beta: Tensor, etf: Tensor, data: ClientData) -> tuple[nn.Module, Tensor]:
        """FedETF-Per: alternate CE fine-tuning of the ETF and of the projection on frozen features."""
        import copy

        with torch.no_grad():
            feats = torch.cat([model.features(data.x_train[i : i + 256].to(env.device))
                               for i in range(0, data.num_train, 256)]).float()
        y = data.y_train.to(env.device)
        proj = copy.deepcopy(model.head).train()
        for p in proj.parameters():
            p.requires_grad_(True)
        etf = nn.Parameter(etf.detach().clone())
        g = torch.Generator().manual_seed(self.train.seed * 1_000_003 + data.client_id)
        with torch.enable_grad():  # the engine evaluates under no_grad
            for _ in range(self.opts.finetune_epochs):
                for params, lr in (([etf], self.opts.finetune_lr), (list(proj.parameters()), self.opts.finetune_proj_lr)):
                    opt = torch.optim.SGD(params, lr=lr)
                    for _ in range(self.opts.finetune_inner):
                        for idx in epoch_batches(data.num_train, self.train.batch_size, g, shuffle=self.opts.shuffle):
                            idx = idx.to(env.device)
                            loss = F.cross_entropy(etf_logits(proj(feats[idx]), etf, beta), y[idx])
                            opt.zero_grad(set_to_none=True)
                            loss.backward()
                            opt.step()
        proj.eval()
        return proj, etf.detach()
