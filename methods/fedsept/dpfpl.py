"""DP-FPL (Tran et al., 2025), baseline of fedsept.txt (appendix B.2; SPEC 1.11): a global prompt plus a
private low-rank-plus-residual prompt, with DP on the global part only.

Prompt  P_k = G + U_k V_k + S_k: G (L x w) is the shared `global_ctx`; U_k (L x r), V_k (r x w) and the
        residual S_k (L x w) stay on client k. They come from the one-pass randomised power-iteration
        factorisation of a matrix X (`factorize`): V0 ~ N(0, 1) (w x r), U = GS(X V0), V = GS(X^T U)^T,
        S = X - U V (GS = Gram-Schmidt on the columns), so U V + S = X exactly. At the start X is a fresh
        N(0, 0.02^2) matrix; after the last batch of every local epoch X = U V + S is re-factorised with
        fresh randomness (the "QR-based re-factorisation" of B.2; dp_mode=reference: in every forward,
        as the DP-FPL code does, see DP below). The rank is capped at min(r, L, w):
        Gram-Schmidt cannot give U more orthonormal columns than it has rows.
Client  CE on s * cos(v(x), t_c(P_k)); G, U, V and S all train (dp_mode=reference: G and X); only G is uploaded.
Server  FedAvg of G; the evaluated model is the latest global G with the client's own U, V, S (SPEC 1.8).
DP      dp_mode=per_example (default): DP-SGD on G through `privacy.backward`, accounted by the host like
        every dpsgd release; U, V, S take the plain gradient. dp_mode=reference: the DP-FPL code
        (linhhtran/DP-FPL federated_main.py, trainers/DP_FPL.py), a lock-step round (`lockstep_steps`):
        at every local step each client clips the batch-mean gradient of G to NORM_THRESH C as a whole
        (no noise; `privacy.backward` with the `dpfpl_reference` mechanism) and uploads it as `global_grad`.
        The local prompt is the code's one matrix X (`local_ctx`; stored here as U V + residual): every
        forward re-factorises it afresh at rank r (`factorize`, the code's PromptLearner.forward), the
        residual S = X - U V is a constant of that forward (no gradient of its own), only U and V take
        gradients; under DP each is clipped to C and gets N(0, (sigma C/B)^2); X steps with the code's
        rank-projected gradient of those two, each divided by 10 (`code_local_update`). The server
        averages the K gradients, adds N(0, (sigma C/(B K))^2) and steps G (SGD with momentum and weight
        decay, its state in the server-only `momentum`), sigma = sqrt(T ln(1/delta)) / epsilon (q = 1,
        T = train.rounds). The upload carries no noise, so this is NOT a local-DP guarantee: the ledger
        marks each step valid=False (epsilon inf) with claimed_epsilon = dp.epsilon. Not reproduced: the
        code's one optimiser shared by all clients (its momentum on G is stepped K times per step, and
        on X across clients) and its stepping every client's X with the last client's gradient (one model
        object is shared: load_state_dict keeps the last forward's .grad). The code also steps U and V,
        which the next forward overwrites (no effect; not done here). Optimiser state is fresh each round
        here, as for every method (SPEC 1.7 [decide]).
Stacks  dp_mode=per_example trains client-batched stacks (execution.batch_clients): the step hooks below are
        its local round for one client or a stack (ClipPromptMethod.train_clients); reference goes client by client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.prompt import ClipPromptMethod, PromptClient, PromptLossParts, StepLoss
from raysim.privacy.mechanisms import dpsgd, reference
from raysim.privacy.mechanisms.dpfpl_reference import local_noise_std, server_noise_std
from raysim.sampling import batches_per_epoch, generator

DP_MODES = ("per_example", "reference")


@dataclass
class DPFPLOptions:
    rank: int = 16  # r of U V (B.2); capped at min(r, n_ctx, width)
    dp_mode: str = "per_example"  # per_example (DP-SGD, accounted) | reference (the DP-FPL code, lock-step: NOT local DP)
    norm_thresh: float = 10.0  # dp_mode=reference: the code's NORM_THRESH, the clip of the G, U and V gradients

    def validate(self) -> None:
        if not (self.norm_thresh > 0 and math.isfinite(self.norm_thresh)):
            raise ConfigError(f"dpfpl.norm_thresh must be a finite number > 0, got {self.norm_thresh}")
        if self.rank < 1:
            raise ConfigError(f"dpfpl.rank must be >= 1, got {self.rank}")
        if self.dp_mode not in DP_MODES:
            raise ConfigError(f"dpfpl.dp_mode must be one of {', '.join(DP_MODES)}, got {self.dp_mode!r}")


def gram_schmidt(M: Tensor, eps: float = 1e-12) -> Tensor:
    """Modified Gram-Schmidt on the columns of M (m x k, k <= m): a copy with orthonormal columns spanning
    the same nested subspaces (column j is normalised, then removed from every later column)."""
    Q = M.clone()
    for j in range(Q.shape[1]):
        col = Q[:, j : j + 1] / (Q[:, j : j + 1].pow(2).sum() + eps).sqrt()
        Q[:, j : j + 1] = col
        if j + 1 < Q.shape[1]:
            rest = Q[:, j + 1 :]
            Q[:, j + 1 :] = rest - (col * rest).sum(dim=0, keepdim=True) * col
    return Q


def factorize(X: Tensor, rank: int, rng: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """One-pass randomised power iteration (SPEC 1.11 steps 1-4): (U (L x r), V (r x w), S = X - U V)."""
    with torch.no_grad():
        X = X.detach().float()
        V0 = torch.randn(X.shape[1], rank, generator=rng).to(X.device)
        U = gram_schmidt(X @ V0)
        V = gram_schmidt(X.t() @ U).t()
        return U, V, X - U @ V


def code_full_grad(U: Tensor, V: Tensor, gU: Tensor, gV: Tensor) -> Tensor:
    """The DP-FPL code's gradient of the local prompt X = U V + S (trainers/DP_FPL.py `compute_full_grad`,
    applied to local_ctx after the U, V gradients are clipped and noised): with gU, gV each divided by 10,
    gU V + U gV + U U^T gU V. Unclipped, gU = g V^T and gV = U^T g for the prompt's gradient g, so it is
    (g P_V + P_U g + P_U g P_V) / 10 with the projections P_U = U U^T, P_V = V^T V: a rank-projected g / 10."""
    gU, gV = gU / 10.0, gV / 10.0
    gU_V = gU @ V
    return gU_V + U @ gV + U @ (U.t() @ gU_V)


def code_local_update(X: Tensor, U: Tensor, V: Tensor, gU: Tensor, gV: Tensor, *, clip: Optional[float], noise_std: float,
                      rng: Optional[torch.Generator], buf: Any, train) -> tuple[Tensor, Tensor]:
    """dp_mode=reference, the client's step of its local prompt X as the DP-FPL code takes it (trainers/DP_FPL.py
    forward_pass, then the optimiser step): U, V are this forward's factorisation of X and gU, gV their
    gradients; under DP (`clip` not None) each is clipped to `clip` as a whole and gets N(0, noise_std^2);
    X steps (SGD, `sgd_step`) with `code_full_grad`. The residual has no gradient: the code computes it under
    no_grad from X in each forward. Returns (X', momentum buffer)."""
    if clip is not None:
        gU, gV = (_clip_noise(g, clip, noise_std, rng) for g in (gU, gV))
    return sgd_step(X, code_full_grad(U, V, gU, gV), buf, train)


def _clip_noise(g: Tensor, clip: float, std: float, rng: Optional[torch.Generator]) -> Tensor:
    """The code's clip of a gradient as a whole to `clip`, then N(0, std^2) added (std 0: none)."""
    g = g * min(1.0, clip / max(float(g.norm()), 1e-12))
    if std > 0:
        g = g + torch.randn(g.shape, generator=rng).to(g.device) * std
    return g


@register_method
class DPFPL(ClipPromptMethod):
    name = "dpfpl"
    averaged = ("global_ctx",)
    Options = DPFPLOptions
    releases = {"global_ctx": dpsgd()}
    server_only = ("momentum", "lockstep")  # dp_mode=reference: the server's optimiser state and step counter
    batched_context = "global_ctx"  # dp_mode=per_example: local_train is the step hooks below, which stack clients

    def __init__(self, train, options, dp=None) -> None:
        super().__init__(train, options, dp)
        if options.dp_mode == "reference":  # lock-step: the clipped gradient of G is uploaded, each step
            self.releases = {"global_grad": reference()}  # type: ignore[misc]  # per instance: it depends on dp_mode
            self.uploads = ("global_grad",)  # type: ignore[misc]

    @property
    def lockstep(self) -> bool:
        return self.opts.dp_mode == "reference"

    def lockstep_steps(self, num_train: Sequence[int]) -> int:
        """dp_mode=reference: every client steps local_epochs times through its batches, in lock-step with
        the others (the code loops over the batch count of the loaders)."""
        if not self.lockstep:
            return 0
        return self.train.local_epochs * max(batches_per_epoch(int(n), self.train.batch_size) for n in num_train)

    def rank(self, env) -> int:
        return max(1, min(self.opts.rank, self.train.n_ctx, env.ctx_width))

    # -- server half -------------------------------------------------------------------------
    def init_shared(self, env, rng):
        G = torch.randn(self.train.n_ctx, env.ctx_width, generator=rng) * 0.02
        if self.lockstep:
            return {"global_ctx": G, "momentum": torch.zeros_like(G), "lockstep": torch.tensor([-1, 0], dtype=torch.long)}
        return {"global_ctx": G}

    def aggregate(self, env, shared, uploads, rng):
        if self.lockstep:
            return self._lockstep_aggregate(shared, uploads, rng)
        return {"global_ctx": weighted_mean(uploads, "global_ctx")}

    def server_noise_std(self, clients: int) -> float:
        """dp_mode=reference: std of the server's noise on the mean of `clients` clipped gradients (0 without DP)."""
        if not self.dp.enabled:
            return 0.0
        return server_noise_std(self.train.rounds, self.dp.epsilon, self.dp.delta, self.opts.norm_thresh,
                                self.train.batch_size, clients)

    def _lockstep_aggregate(self, shared, uploads, rng):
        """One lock-step on the server: the plain mean of the K clipped gradients (the code divides by K),
        plus N(0, server_noise_std(K)^2), then an SGD step of G. The round's stream is the same at each of
        its steps, so the step counter in `lockstep` (round tag, step) forks it."""
        tag = _round_tag(rng)
        G = shared["global_ctx"].float()
        new_round = int(shared["lockstep"][0]) != tag
        step = 0 if new_round else int(shared["lockstep"][1])
        grad = sum(u.tensors["global_grad"].float() for u in uploads) / len(uploads)
        std = self.server_noise_std(len(uploads))
        if std > 0:
            grad = grad + torch.randn(grad.shape, generator=generator(tag, "server-noise", step)) * std
        G, buf = sgd_step(G, grad, None if new_round else shared["momentum"].float(), self.train)
        return {"global_ctx": G, "momentum": buf, "lockstep": torch.tensor([tag, step + 1], dtype=torch.long)}

    # -- client half -------------------------------------------------------------------------
    def init_private(self, env, data: ClientData, rng):
        X = torch.randn(self.train.n_ctx, env.ctx_width, generator=rng) * 0.02
        U, V, S = factorize(X, self.rank(env), rng)
        return {"U": U, "V": V, "residual": S}

    def prompt(self, G: Tensor, U: Tensor, V: Tensor, S: Tensor) -> Tensor:
        return G + U @ V + S

    def supports_batching(self) -> bool:
        """dp_mode=per_example stacks clients (plain or DP-SGD steps); the lock-step reference round does not."""
        return not self.lockstep and super().supports_batching()

    def shares_optimizer_state(self) -> bool:
        """dp_mode=per_example steps one SGD (train_clients); the lock-step reference round keeps its own per client."""
        return not self.lockstep and super().shares_optimizer_state()

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        if self.lockstep:
            return self._lockstep_train(env, shared, private, data, rng=rng, privacy=privacy)
        return self.stacked_local_train(env, shared, private, data, rng=rng, privacy=privacy)  # the steps below

    # the local round of dp_mode=per_example (ClipPromptMethod.train_clients, one client or a stack): G, U, V, S
    # from the broadcast and the private state; per step CE on s cos(v(x), t_c(G + U V + S)), DP-SGD on G only
    def step_start(self, env, shared, private, rng: torch.Generator) -> PromptClient:
        G = shared["global_ctx"].clone().to(env.device).requires_grad_(True)
        U, V, S = (private[k].clone().to(env.device).requires_grad_(True) for k in ("U", "V", "residual"))
        return PromptClient({"global_ctx": G}, {"U": U, "V": V, "residual": S})

    def step_contexts(self, c: PromptClient) -> Tensor:
        return self.prompt(c.dp["global_ctx"], *c.local.values())[None]

    def step_loss(self, env, c: PromptClient, text: Tensor, x: Tensor, y: Tensor, *, tokens: Optional[Tensor] = None) -> StepLoss:
        loss = F.cross_entropy(self.logits(env, x, text[0]), y, reduction="none")
        return StepLoss(loss, None, {"loss": loss.detach().mean()})

    def step_epoch_end(self, env, c: PromptClient, rng: torch.Generator) -> None:
        """After the last batch of the epoch: re-factorise U V + S afresh."""
        U, V, S = c.local.values()
        with torch.no_grad():
            for p, new in zip((U, V, S), factorize(U @ V + S, self.rank(env), rng)):
                p.copy_(new)  # in place: the optimiser keeps its state, as the reference code does

    def _lockstep_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        """One lock-step of client k (dp_mode=reference), as the DP-FPL code's forward_pass: one batch of its
        current epoch; the local prompt X re-factorised afresh (U, V, S = factorize(X)); the clipped gradient
        of G uploaded; X stepped by `code_local_update`. Its epoch's batch order, step counter and optimiser
        state (X's momentum) live in private["lockstep"], reset at each new round."""
        tag = _round_tag(rng)
        st: dict[str, Any] = private.get("lockstep") or {}
        if st.get("tag") != tag:  # a new round: fresh optimiser state (SPEC 1.7 [decide]), a fresh epoch
            st = {"tag": tag, "step": 0, "order": [], "momentum": None, "epoch": -1}
        step_rng = generator(tag, "client-step", st["step"])
        if not st["order"]:  # the epoch's batches (fixed-size, shuffled: the code's loaders)
            st["order"] = list(privacy.batches(data.num_train, self.train.batch_size, step_rng))
            st["epoch"] = int(st.get("epoch", -1)) + 1
        idx = st["order"].pop(0)
        X = self._local(env, private)  # the code's local_ctx
        U, V, S = factorize(X, self.rank(env), generator(tag, "refactorize", st["step"]))  # every forward
        G = shared["global_ctx"].clone().to(env.device).requires_grad_(True)
        U, V = U.requires_grad_(True), V.requires_grad_(True)
        # the epoch's inputs: under data.augment each image's drawn view of this epoch, as the other modes read them
        x, y = data.train_batch(idx, st["epoch"], device=env.device), data.y_train[idx].to(env.device)
        text = env.prompts.text_features(self.prompt(G, U, V, S))
        loss = F.cross_entropy(self.logits(env, x, text), y, reduction="none")
        privacy.backward(loss, dp_params={"global_grad": G}, other_params=[U, V])
        gU, gV = (p.grad if p.grad is not None else torch.zeros_like(p) for p in (U, V))
        clip, std = None, 0.0
        if privacy.enabled:  # the code clips and noises the U and V gradients too
            clip = self.opts.norm_thresh
            std = local_noise_std(self.train.rounds, self.dp.epsilon, self.dp.delta, clip, self.train.batch_size)
        U, V = U.detach(), V.detach()
        X, st["momentum"] = code_local_update(X, U, V, gU.detach(), gV.detach(), clip=clip, noise_std=std,
                                              rng=step_rng, buf=st["momentum"], train=self.train)
        st["step"] += 1
        upload = G.grad if G.grad is not None else torch.zeros_like(G)
        return LocalResult(
            upload={"global_grad": upload.detach().cpu()},
            private={"U": U.cpu(), "V": V.cpu(), "residual": (X - U @ V).cpu(), "lockstep": st},  # U V + residual = X
            num_samples=data.num_train,
            metrics={"loss": float(loss.mean().item()) if len(idx) else math.nan},
        )

    def _local(self, env, private) -> Tensor:
        return (private["U"].to(env.device) @ private["V"].to(env.device) + private["residual"].to(env.device)).detach()

    def predictor(self, env, shared, private, data=None):
        with torch.no_grad():
            text = env.prompts.text_features(shared["global_ctx"].to(env.device) + self._local(env, private))
        return lambda feats: self.logits(env, feats.to(env.device), text)

    def loss_parts(self, env, private) -> PromptLossParts:
        local = self._local(env, private)
        return PromptLossParts("global_ctx", lambda G: env.prompts.text_features(G + local),
                               lambda G, T, feats: self.logits(env, feats, T), lambda G: G.sum() * 0,
                               separable=True, text_state=(local,))


def _round_tag(rng: torch.Generator) -> int:
    """A number drawn from the (round, client) or (round) stream: the same at every lock-step of a round,
    different between rounds, so it marks a new round and seeds the per-step streams."""
    return int(torch.randint(0, 2**62, (1,), generator=rng))


def sgd_step(p: Tensor, g: Tensor, buf: Any, train) -> tuple[Tensor, Tensor]:
    """One step of torch.optim.SGD (momentum, weight decay, no dampening or Nesterov) on p with gradient g
    and momentum buffer `buf` (None: the first step, the buffer starts at the step's gradient)."""
    d = g + train.weight_decay * p
    buf = d.clone() if buf is None or train.momentum == 0 else train.momentum * buf.to(d.device) + d
    return (p - train.lr * buf).detach(), buf.detach()
