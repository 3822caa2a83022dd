"""DP-FPL (Tran et al., 2025), baseline of fedsept.txt (appendix B.2; SPEC 1.11): a global prompt plus a
private low-rank-plus-residual prompt, with DP on the global part only.

Prompt  P_k = G + U_k V_k + S_k: G (L x w) is the shared `global_ctx`; U_k (L x r), V_k (r x w) and the
        residual S_k (L x w) stay on client k. They come from the one-pass randomised power-iteration
        factorisation of a matrix X (`factorize`): V0 ~ N(0, 1) (w x r), U = GS(X V0), V = GS(X^T U)^T,
        S = X - U V (GS = Gram-Schmidt on the columns), so U V + S = X exactly. At the start X is a fresh
        N(0, 0.02^2) matrix; after the last batch of every local epoch X = U V + S is re-factorised with
        fresh randomness (the "QR-based re-factorisation" of B.2). The rank is capped at min(r, L, w):
        Gram-Schmidt cannot give U more orthonormal columns than it has rows.
Client  CE on s * cos(v(x), t_c(P_k)); G, U, V and S all train; only G is uploaded.
Server  FedAvg of G; the evaluated model is the latest global G with the client's own U, V, S (SPEC 1.8).
DP      dp_mode=per_example (default): DP-SGD on G through `privacy.backward`, accounted by the host like
        every dpsgd release; U, V, S take the plain gradient. dp_mode=reference: the DP-FPL code's noise,
        declared as a `reference` release (privacy/mechanisms.py DPFPLReference): the batch-mean gradient
        of G is clipped to dp.clip as a whole and N(0, (sigma C/B)^2) added with sigma = sqrt(T ln(1/delta))
        / epsilon. That is NOT a valid DP guarantee (one example moves the clipped batch gradient by up to
        2C, not C/B); the ledger marks it valid=False and the run logs a warning. The method code is the
        same in both modes: only the declared release differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.prompt import ClipPromptMethod, PromptLossParts, sgd
from raysim.privacy.mechanisms import dpsgd, reference

DP_MODES = ("per_example", "reference")


@dataclass
class DPFPLOptions:
    rank: int = 16  # r of U V (B.2); capped at min(r, n_ctx, width)
    dp_mode: str = "per_example"  # per_example (DP-SGD, accounted) | reference (the DP-FPL code's noise: NOT valid DP)

    def validate(self) -> None:
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


@register_method
class DPFPL(ClipPromptMethod):
    name = "dpfpl"
    averaged = ("global_ctx",)
    Options = DPFPLOptions
    releases = {"global_ctx": dpsgd()}

    def __init__(self, train, options, dp=None) -> None:
        super().__init__(train, options, dp)
        if options.dp_mode == "reference":  # the same tensor, released with the reference code's noise
            self.releases = {"global_ctx": reference()}  # type: ignore[misc]  # per instance: it depends on dp_mode

    def rank(self, env) -> int:
        return max(1, min(self.opts.rank, self.train.n_ctx, env.ctx_width))

    # -- server half -------------------------------------------------------------------------
    def init_shared(self, env, rng):
        return {"global_ctx": torch.randn(self.train.n_ctx, env.ctx_width, generator=rng) * 0.02}

    def aggregate(self, env, shared, uploads, rng):
        return {"global_ctx": weighted_mean(uploads, "global_ctx")}

    # -- client half -------------------------------------------------------------------------
    def init_private(self, env, data: ClientData, rng):
        X = torch.randn(self.train.n_ctx, env.ctx_width, generator=rng) * 0.02
        U, V, S = factorize(X, self.rank(env), rng)
        return {"U": U, "V": V, "residual": S}

    def prompt(self, G: Tensor, U: Tensor, V: Tensor, S: Tensor) -> Tensor:
        return G + U @ V + S

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        G = shared["global_ctx"].clone().to(env.device).requires_grad_(True)
        U, V, S = (private[k].clone().to(env.device).requires_grad_(True) for k in ("U", "V", "residual"))
        opt = sgd([G, U, V, S], self.train)
        x, y = data.x_train.to(env.device), data.y_train.to(env.device)
        losses = []
        for _ in range(self.train.local_epochs):
            batches = list(privacy.batches(data.num_train, self.train.batch_size, rng))
            for i, idx in enumerate(batches):
                text = env.prompts.text_features(self.prompt(G, U, V, S))
                loss = F.cross_entropy(self.logits(env, x[idx], text), y[idx], reduction="none")
                opt.zero_grad(set_to_none=True)
                privacy.backward(loss, dp_params={"global_ctx": G}, other_params=[U, V, S])
                opt.step()
                if len(idx):  # a Poisson batch may be empty (a noise-only step)
                    losses.append(loss.mean().item())
                if i == len(batches) - 1:  # the last batch of the epoch: re-factorise U V + S afresh
                    with torch.no_grad():
                        for p, new in zip((U, V, S), factorize(U @ V + S, self.rank(env), rng)):
                            p.copy_(new)  # in place: the optimiser keeps its state, as the reference code does
        return LocalResult(
            upload={"global_ctx": G.detach().cpu()},
            private={"U": U.detach().cpu(), "V": V.detach().cpu(), "residual": S.detach().cpu()},
            num_samples=data.num_train,
            metrics={"loss": sum(losses) / max(1, len(losses))},
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
