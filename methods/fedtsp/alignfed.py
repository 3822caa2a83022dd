"""AlignFed on the heterogeneous client zoo, as the code behind FedTSP's tables runs it (the authors'
HtFLlib-based repository XinghaoWu/FedTSP_CVPR26: clientalign.py, serveralign.py, SOTA_AlignFed.sh;
SPEC 2.9: lambda 20, final lambda 2): the server fixes class anchors spread uniformly on the unit
hypersphere, and the clients pull their features towards them, so that differently built extractors map a
class to the same place; the clients share and average the head.

Server   Once, at init: C anchors a_c on the unit sphere of R^d (`anchors=uniformity`, the code's
         generate_target): v ~ U[-1, 1]^(C x d), then `anchor_iters` (100000) plain-SGD steps at
         `anchor_lr` (0.1) on the uniformity loss (1/C) sum_i log sum_j exp(<u_i, u_j> / `anchor_tau`)
         (0.5), u = v / |v| row-wise; the anchors are u of the last step. They never change and cost no
         privacy (no client data enters them). Each round the server takes the sample-weighted mean of the
         uploaded heads.
Client   Its own zoo extractor f (private) and the shared head h = Linear(d, C), loaded from the broadcast
         each round; plain SGD at the client lr on
             L = CE(h(f(x)), y) + lambda_t * L_align,
         L_align (`align=center`, the code's Contrastive_Loss_Center at temperature `tau` = 1): with
         s_ic = cos(f(x_i), a_c) / tau over the batch B, each centre c takes a softmax over the batch,
             L_align = -(1/C) sum_c (1/|B_c|) sum_{i in B_c} [s_ic - log sum_{j in B} exp(s_jc)],
         B_c the batch's samples of class c (a class absent from the batch adds 0, and still counts in
         the 1/C). lambda_t decays exponentially (`schedule=exp`, the code's get_transfer_lambda):
             lambda_t = lam * exp(t ln(lam_final / lam) / R),   t = 0 .. R-1 the round, R = train.rounds,
         so lambda_0 = lam and lambda_R would be lam_final (the code runs R + 1 rounds, 0 .. R).
         Uploads its trained head.
Eval     f with the current global head.
Uploads  the head only, as an update() release (dp.level=client; dp.level=sample is refused: the head is
         trained by plain SGD). The anchors and f never leave the client.

The project's earlier variant, kept by name (written before the authors' code was found):
- `align=ce`: CE over the classes of cos(f(x), a_c) / tau, i.e. f(x) nearer its own anchor than the
  others (the softmax over classes, not over the batch), which the project ran at tau = 0.1;
  `align=cos`: mean over the batch of 1 - cos(f(x), a_y) (f(x) on its anchor).
- `schedule=linear`: lambda from `lam` (round 0) to `lam_final` (the last round), linear in between.
- `anchors=etf`: a seeded simplex equiangular tight frame, a_c = sqrt(C / (C - 1)) U (e_c - 1/C), U a
  random d x C matrix with orthonormal columns: |a_c| = 1 and cos(a_c, a_c') = -1 / (C - 1), the largest
  possible minimum angle (FedETF's fixed classifier, which fedtsp.txt's related work cites beside
  AlignFed; needs feature_dim >= C); the uniformity optimisation tends towards a spread of that kind.
  Together (`align=ce tau=0.1 schedule=linear anchors=etf`) they are the earlier default. Its measure
  (digits, tiny family, 3 clients, Dirichlet 0.5, 3 rounds, inline): round-3 in_client 0.72 at tau 0.1,
  0.65 at 0.5, 0.54 with align=cos; tau 0.01 with lambda 20 diverges.
Differences that remain: round 0 starts every client from one head the server draws (the code's clients
start from their own random heads and first load a global head after round 0's aggregation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.zoo import HeteroMethod, HtEnv, snapshot, validate_common
from raysim.privacy.mechanisms import update
from raysim.sampling import seeded_global_rng


@dataclass
class Options:
    lam: float = 20.0  # alignment weight at round 0 (SOTA_AlignFed.sh --lamda)
    lam_final: float = 2.0  # ... the end point of the schedule (--final_lamda)
    model_family: str = "HtFE2"  # HtFE2 | HtFE3 | HtFE4 | HtFE9 | tiny
    feature_dim: int = 512
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)
    weighting: str = "samples"  # head average: samples (n_k / n) | uniform
    align: str = "center"  # center: the code's centre-wise contrastive loss | ce: CE over classes | cos: 1 - cos(f, a_y)
    tau: float = 1.0  # temperature of align=center / ce (the code: 1; the earlier ce default: 0.1)
    schedule: str = "exp"  # exp: the code's exponential decay | linear: lam -> lam_final over the rounds
    anchors: str = "uniformity"  # uniformity: the code's generate_target | etf: a seeded simplex ETF
    anchor_iters: int = 100000  # SGD steps of the uniformity optimisation (the code: 100000)
    anchor_lr: float = 0.1  # ... its lr
    anchor_tau: float = 0.5  # ... its temperature

    def validate(self) -> None:
        validate_common(self, "alignfed")
        if self.lam < 0 or self.lam_final < 0:
            raise ConfigError("alignfed.lam and alignfed.lam_final must be >= 0")
        if self.align not in ALIGNS or not self.tau > 0:
            raise ConfigError(f"alignfed.align must be one of {', '.join(ALIGNS)} and alignfed.tau > 0, got {self.align!r}, {self.tau}")
        if self.schedule not in ("exp", "linear"):
            raise ConfigError(f"alignfed.schedule must be exp or linear, got {self.schedule!r}")
        if self.schedule == "exp" and self.lam > 0 and self.lam_final <= 0:
            raise ConfigError("alignfed.schedule=exp decays lam towards lam_final geometrically and needs lam_final > 0; "
                              "set alignfed.lam_final > 0 or alignfed.schedule=linear")
        if self.anchors not in ("uniformity", "etf"):
            raise ConfigError(f"alignfed.anchors must be uniformity or etf, got {self.anchors!r}")
        if self.anchor_iters < 0 or not self.anchor_lr > 0 or not self.anchor_tau > 0:
            raise ConfigError("alignfed.anchor_iters must be >= 0 and alignfed.anchor_lr, alignfed.anchor_tau > 0")
        if self.weighting not in ("samples", "uniform"):
            raise ConfigError(f"alignfed.weighting must be samples or uniform, got {self.weighting!r}")


ALIGNS = ("center", "ce", "cos")


def uniformity_anchors(num_classes: int, dim: int, generator: torch.Generator, *, iters: int = 100000,
                       lr: float = 0.1, tau: float = 0.5) -> Tensor:
    """(C, d) unit vectors spread on the sphere as the code's generate_target does: v ~ U[-1, 1], then
    `iters` plain-SGD steps on (1/C) sum_i log sum_j exp(<u_i, u_j> / tau), u = v / |v|; returns the u of
    the last step (taken before that step's update, as the code returns it)."""
    if num_classes < 2:
        raise ConfigError("alignfed needs at least 2 classes")
    v = torch.empty(num_classes, dim).uniform_(-1.0, 1.0, generator=generator).requires_grad_(True)
    u = F.normalize(v.detach(), dim=1)
    for _ in range(iters):
        un = F.normalize(v, dim=1)
        u = un.detach()
        loss = torch.logsumexp(un @ un.T / tau, dim=0).sum() / num_classes
        (grad,) = torch.autograd.grad(loss, v)
        with torch.no_grad():
            v -= lr * grad
    return u.contiguous()


def center_contrastive_loss(feats: Tensor, y: Tensor, centres: Tensor, tau: float = 1.0) -> Tensor:
    """The code's Contrastive_Loss_Center (cosine): s_ic = cos(f_i, a_c) / tau; per centre a softmax over the
    batch; -(1/C) sum_c mean_{i: y_i = c} log softmax_i(s_.c) (a class absent from the batch adds 0)."""
    s = F.normalize(feats, dim=1) @ F.normalize(centres, dim=1).T / tau
    log_p = s - torch.logsumexp(s, dim=0, keepdim=True)
    mask = F.one_hot(y, centres.shape[0]).to(s.dtype)
    per_centre = (mask * log_p).sum(0) / (mask.sum(0) + 1e-6)  # the code's eps
    return -per_centre.mean()


def simplex_etf(num_classes: int, dim: int, generator: torch.Generator) -> Tensor:
    """(C, d) unit vectors with pairwise cosine -1/(C-1): a simplex ETF under a random rotation."""
    if num_classes < 2:
        raise ConfigError("alignfed needs at least 2 classes")
    if dim < num_classes:
        raise ConfigError(f"alignfed places {num_classes} equidistant anchors in R^d and needs feature_dim >= "
                          f"{num_classes} (the number of classes), got {dim}; raise alignfed.feature_dim")
    g = torch.randn(dim, num_classes, generator=generator, dtype=torch.float64)
    u, _ = torch.linalg.qr(g)  # d x C, orthonormal columns
    centred = torch.eye(num_classes, dtype=torch.float64) - 1.0 / num_classes
    m = math.sqrt(num_classes / (num_classes - 1)) * (u @ centred)
    return m.T.contiguous().float()


def align_loss(feats: Tensor, y: Tensor, anchors: Tensor, kind: str = "center", tau: float = 1.0) -> Tensor:
    """"center": the code's centre-wise contrastive loss (center_contrastive_loss); "ce": CE over classes of
    cos(f(x), a_c) / tau (f(x) nearer its own anchor than the others'); "cos": mean over the batch of
    1 - cos(f(x), a_y) (f(x) on its anchor)."""
    if kind == "center":
        return center_contrastive_loss(feats, y, anchors, tau)
    if kind == "cos":
        return (1.0 - F.cosine_similarity(feats, anchors[y], dim=1)).mean()
    cos = F.normalize(feats, dim=1) @ F.normalize(anchors, dim=1).T
    return F.cross_entropy(cos / tau, y)


@register_method
class AlignFed(HeteroMethod):
    name = "alignfed"
    loss_weights = {"alignment": "lam"}
    eval_ignores = ("anchors", "round", "model.head")  # train-time; the global head replaces the own one
    Options = Options
    releases = {"head_weight": update(), "head_bias": update()}  # the shared head (dp.level=client)
    client_metrics = ("loss", "ce", "align", "lam")

    def lam(self, round_idx: int) -> float:
        """lambda_t: exp (the code): lam * exp(t ln(lam_final / lam) / R); linear: lam -> lam_final at R - 1."""
        o = self.opts
        if o.schedule == "exp":
            if o.lam == 0:
                return 0.0
            return o.lam * math.exp(round_idx * math.log(o.lam_final / o.lam) / max(1, self.train.rounds))
        last = max(1, self.train.rounds - 1)
        return o.lam + (o.lam_final - o.lam) * min(1.0, round_idx / last)

    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        o = self.opts
        if o.anchors == "etf":
            anchors = simplex_etf(env.num_classes, env.feature_dim, rng)
        else:
            anchors = uniformity_anchors(env.num_classes, env.feature_dim, rng, iters=o.anchor_iters, lr=o.anchor_lr, tau=o.anchor_tau)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
        with seeded_global_rng(seed):
            head = torch.nn.Linear(env.feature_dim, env.num_classes)
        return {"anchors": anchors, "head_weight": head.weight.detach().clone(), "head_bias": head.bias.detach().clone(),
                "round": torch.zeros(1)}

    def _with_global_head(self, env: HtEnv, private, shared):
        model = self.model(env, private)
        with torch.no_grad():
            model.head.weight.copy_(shared["head_weight"].to(env.device))
            model.head.bias.copy_(shared["head_bias"].to(env.device))
        return model

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self._with_global_head(env, private, shared)
        anchors = shared["anchors"].to(env.device).float()
        lam = self.lam(int(shared["round"].item()))
        aligns: list[float] = []

        def extra(feats, y):
            a = align_loss(feats, y, anchors, self.opts.align, self.opts.tau)
            aligns.append(float(a.detach()))
            return lam * a

        loss = self.train_model(env, model, data, rng, extra if lam > 0 else None, privacy)
        align = sum(aligns) / max(1, len(aligns))
        return LocalResult(
            upload={"head_weight": model.head.weight.detach().cpu().clone(), "head_bias": model.head.bias.detach().cpu().clone()},
            private={**private, "model": snapshot(model)},
            num_samples=data.num_train,
            metrics={"loss": loss, "ce": loss - lam * align, "align": align, "lam": lam},
        )

    def aggregate(self, env, shared, uploads, rng):
        if self.opts.weighting == "samples":
            w, b = weighted_mean(uploads, "head_weight"), weighted_mean(uploads, "head_bias")
        else:
            w = torch.stack([u.tensors["head_weight"].float() for u in uploads]).mean(0)
            b = torch.stack([u.tensors["head_bias"].float() for u in uploads]).mean(0)
        return {**shared, "head_weight": w, "head_bias": b, "round": shared["round"] + 1}

    def predictor(self, env, shared, private, data=None):
        model = self._with_global_head(env, private, shared).eval()
        return lambda x: model(x.to(env.device))[1]
