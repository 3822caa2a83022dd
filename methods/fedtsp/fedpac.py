"""FedPAC (Xu et al., ICLR 2023): feature alignment to global prototypes and classifier collaboration.

One global body (feature extractor) and one personalised head per client.

Round    The server broadcasts the global body b, the global prototypes P_g (with which classes have one)
         and every client's combined head (PFLlib's set_head; the broadcast carries all K heads, a
         simulation shortcut: each client reads only its own row).
Client   1. Statistics of the received body b on its training set (eval mode), as PFLlib's
            statistics_extraction: class means mu_c of f(x) (a prototype release: noised under local DP),
            and the scalar
                V = (1/n) sum_c [ p_c E_{x in c} ||f(x)||^2 - p_c^2 ||mu_c||^2 ],   p_c = n_c / n.
         2. `head_epochs` epochs (PFLlib: one pass) of CE on the head alone, the body frozen.
         3. E epochs of CE + lambda * MSE(f(x), P_g[y]) on the body alone, the head frozen (a sample whose
            class has no global prototype yet contributes no MSE, as fedproto).
         4. Uploads the body, the head, its class means of f(x) after training with their counts.
Server   b <- sample-weighted FedAvg of the bodies; P_g[c] <- plain mean of the class-c means over the
         clients that hold c (PFLlib's proto_aggregation). Classifier collaboration: with h_j = p^j_c mu^j_c
         (C x d) of every uploading client j, client i's combination weights solve the quadratic programme
             min_alpha  alpha^T (diag(V) + D_i) alpha   s.t.  alpha >= 0, sum_j alpha_j = 1,
             D_i[j, j'] = sum_c <h_i[c] - h_j[c], h_i[c] - h_j'[c]>
         (`simplex_qp`; PFLlib calls cvxpy), weights below `min_weight` are zeroed (PFLlib) and the rest
         renormalised to sum to 1 (PFLlib leaves the sum slightly below 1), and client i's new head is
         sum_j alpha_j head_j.
Eval     Each client: the global body with its combined head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, Upload, register_method, weighted_mean
from raysim.methods.families.homogeneous import (
    Homogeneous,
    flat_body,
    flat_head,
    frozen,
    head_size,
    join_weights,
    split_weights,
    validate_homogeneous,
)
from raysim.methods.families.prototype import COUNTS_NOTE, aggregate_prototypes, proto_mse
from raysim.methods.families.zoo import HeteroMethod, HtEnv
from raysim.privacy.mechanisms import prototype, public, update
from raysim.sampling import epoch_batches


@dataclass
class Options:
    model: str = "fedavgcnn"  # the one architecture every client trains (any zoo model, e.g. resnet8, cnn_tiny)
    feature_dim: int = 512  # d
    lam: float = 1.0  # lambda, weight of the feature alignment to the global prototypes
    head_epochs: int = 1  # epochs of head-only training before the body's (PFLlib: one pass)
    min_weight: float = 1e-3  # combination weights below this are zeroed (PFLlib's eps)
    qp_iters: int = 2000  # projected-gradient iterations of the simplex QP
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)

    # the Homogeneous mixin reads these; FedPAC personalises through its combined heads instead
    finetune_epochs: int = 0
    finetune_lr: float = 0.0

    def validate(self) -> None:
        if self.lam < 0 or self.head_epochs < 0 or self.client_lr < 0:
            raise ConfigError("fedpac.lam, fedpac.head_epochs and fedpac.client_lr must be >= 0")
        if not 0 <= self.min_weight < 1 or self.qp_iters < 1:
            raise ConfigError("fedpac.min_weight must be in [0, 1) and fedpac.qp_iters >= 1")
        if self.finetune_epochs != 0:
            raise ConfigError("fedpac personalises its heads by classifier collaboration: leave fedpac.finetune_epochs at 0")
        validate_homogeneous(self, "fedpac")


# ------------------------------------------------------------------------------------ the QP
def project_simplex(v: Tensor) -> Tensor:
    """Euclidean projection of v onto {a >= 0, sum a = 1} (sort-based, Duchi et al. 2008)."""
    u, _ = torch.sort(v, descending=True)
    css = u.cumsum(0) - 1
    k = torch.arange(1, len(v) + 1, dtype=v.dtype, device=v.device)
    rho = int((u - css / k > 0).nonzero().max())
    theta = css[rho] / (rho + 1)
    return (v - theta).clamp_min(0)


def simplex_qp(P: Tensor, iters: int = 2000) -> Tensor:
    """argmin_a a^T P a over the probability simplex, P symmetric positive semi-definite (K x K).

    The solver: P is symmetrised and its negative eigenvalues (round-off) are set to 0; then `iters`
    steps of accelerated projected gradient descent (FISTA) with step 1/L, L = 2 lambda_max(P) the
    gradient's Lipschitz constant, from the uniform weights. The objective is convex, so this converges to
    the minimum (at rate O(1/t^2)); for K <= a few dozen clients each step is one K x K product."""
    P = P.double()
    P = (P + P.t()) / 2
    evals, evecs = torch.linalg.eigh(P)
    evals = evals.clamp_min(0)
    P = (evecs * evals) @ evecs.t()
    n = P.shape[0]
    a = torch.full((n,), 1.0 / n, dtype=torch.float64)
    top = float(evals.max()) if n else 0.0
    if n <= 1 or top <= 0:
        return a
    step = 1.0 / (2 * top)
    z, t = a.clone(), 1.0
    for _ in range(iters):
        nxt = project_simplex(z - step * 2 * (P @ z))
        t_next = (1 + (1 + 4 * t * t) ** 0.5) / 2
        z = nxt + ((t - 1) / t_next) * (nxt - a)
        a, t = nxt, t_next
    return a


def pac_statistics(feats: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """(V, mu): PFLlib's statistics_extraction. mu (C, d) the class means of the features (0 where the
    client has no example); V = (1/n) sum_c [p_c E_c||f||^2 - p_c^2 ||mu_c||^2], p_c = n_c / n."""
    feats, y = feats.double(), y.long()
    n = feats.shape[0]
    counts = torch.bincount(y, minlength=num_classes).double()
    mu = torch.zeros(num_classes, feats.shape[1], dtype=torch.float64).index_add_(0, y, feats) / counts.clamp_min(1)[:, None]
    sq = torch.zeros(num_classes, dtype=torch.float64).index_add_(0, y, (feats ** 2).sum(1)) / counts.clamp_min(1)
    p = counts / max(1, n)
    v = (p * sq - p ** 2 * (mu ** 2).sum(1)).sum() / max(1, n)
    return v.float(), mu.float()


def combination_weights(V: Tensor, H: Tensor, iters: int = 2000, min_weight: float = 1e-3) -> Tensor:
    """(K, K): row i = client i's weights over the K uploaded heads (non-negative, summing to 1).

    V (K,) the clients' variance terms, H (K, C, d) their h_j = p^j_c mu^j_c; row i solves
    min a^T (diag(V) + D_i) a on the simplex, D_i[j, j'] = <h_i - h_j, h_i - h_j'> (flattened over c)."""
    K = H.shape[0]
    flat = H.reshape(K, -1).double()
    out = torch.zeros(K, K, dtype=torch.float64)
    for i in range(K):
        delta = flat[i][None] - flat  # (K, C*d)
        a = simplex_qp(torch.diag(V.double()) + delta @ delta.t(), iters)
        a = torch.where(a >= min_weight, a, torch.zeros_like(a))
        out[i] = a / a.sum() if float(a.sum()) > 0 else torch.full((K,), 1.0 / K, dtype=torch.float64)
    return out.float()


# ------------------------------------------------------------------------------------ the method
@register_method
class FedPAC(Homogeneous, HeteroMethod):
    name = "fedpac"
    loss_weights = {"feature alignment": "lam"}
    eval_ignores = ("protos", "has")  # train-time
    averaged = ("body",)
    Options = Options
    releases = {
        "body": update(),  # the trained body (a user-level update at dp.level=client)
        "head": update(),  # the trained head
        "protos": prototype(),  # class means of f(x) after training (the alignment targets)
        "counts": public(COUNTS_NOTE),
        "stat_protos": prototype(),  # class means of f(x) under the received body (the statistics' mu)
        # V, a scalar statistic of the features: no raysim mechanism privatises it, so FedPAC under local
        # DP is refused at config time anyway (its body and prototypes need different dp.levels)
        "v": update(),
    }
    client_metrics = ("loss", "head_ce")

    # -- server half ----------------------------------------------------------------------------
    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        body, head = split_weights(self.init_weights(env, rng), head_size(self.new_model(env)))
        C, d, K = env.num_classes, env.feature_dim, self.train.num_clients
        return {"body": body, "heads": head[None].repeat(K, 1), "protos": torch.zeros(C, d), "has": torch.zeros(C)}

    def aggregate(self, env: HtEnv, shared, uploads: list[Upload], rng):
        protos = torch.stack([u.tensors["protos"] for u in uploads]).float()
        counts = torch.stack([u.tensors["counts"] for u in uploads]).float()
        glob, has = aggregate_prototypes(protos, counts, "uniform")
        n = counts.sum(1, keepdim=True).clamp_min(1)
        H = (counts / n)[:, :, None] * torch.stack([u.tensors["stat_protos"] for u in uploads]).float()
        V = torch.stack([u.tensors["v"].reshape(()) for u in uploads]).float()
        W = combination_weights(V, H, self.opts.qp_iters, self.opts.min_weight)
        uploaded_heads = torch.stack([u.tensors["head"] for u in uploads]).float()
        heads = shared["heads"].detach().cpu().clone()
        for i, u in enumerate(uploads):
            heads[u.client_id] = W[i] @ uploaded_heads
        return {"body": weighted_mean(uploads, "body"), "heads": heads, "protos": glob,
                "has": ((shared["has"].cpu() > 0.5) | has).float()}

    # -- client half ----------------------------------------------------------------------------
    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        cid = data.client_id
        model = self.global_model(env, join_weights(shared["body"], shared["heads"][cid]))
        # 1. statistics of the received body
        feats0 = self.train_features(env, model, data)
        v, _ = pac_statistics(feats0, data.y_train, data.num_classes)
        stat_protos = privacy.release("stat_protos", features=feats0, labels=data.y_train, num_classes=data.num_classes)
        # 2. the head alone
        model.train()
        head_losses = []
        with frozen(model.base):
            opt = torch.optim.SGD(model.head.parameters(), lr=self.client_lr)
            for _ in range(self.opts.head_epochs):
                for idx in epoch_batches(data.num_train, self.train.batch_size, rng, shuffle=self.opts.shuffle):
                    if len(idx) < 2:
                        continue
                    x, y = data.x_train[idx].to(env.device), data.y_train[idx].to(env.device)
                    head_loss = F.cross_entropy(model(x)[1], y)
                    opt.zero_grad(set_to_none=True)
                    head_loss.backward()
                    opt.step()
                    head_losses.append(float(head_loss.detach()))
        # 3. the body alone, aligned to the global prototypes
        protos, has = shared["protos"].to(env.device).float(), shared["has"].to(env.device) > 0.5
        extra = None
        if bool(has.any()) and self.opts.lam > 0:
            def extra(f, y):
                return self.opts.lam * proto_mse(f, y, protos, has)
        with frozen(model.head):
            loss = self.train_model(env, model, data, rng, extra, privacy)
        # 4. the upload
        upload = {"body": flat_body(model), "head": flat_head(model), **self.release_prototypes(env, model, data, privacy),
                  "stat_protos": stat_protos, "v": v.reshape(1)}
        return LocalResult(
            upload=upload,
            private={**private, "rounds": int(private.get("rounds", 0)) + 1},
            num_samples=data.num_train,
            metrics={"loss": loss, "head_ce": sum(head_losses) / len(head_losses) if head_losses else float("nan")},
        )

    # -- evaluation -----------------------------------------------------------------------------
    def predictor(self, env: HtEnv, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None):
        cid = int(private["client"])
        model = self.global_model(env, join_weights(shared["body"], shared["heads"][cid])).eval()
        return lambda x: model(x.to(env.device))[1]
