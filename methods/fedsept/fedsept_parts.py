"""Building blocks of FedSEPT (fedsept.txt Sec. 4; SPEC 1.2-1.5): the public basis B0, the
subspace-decomposed expert prompts (SEM), the client router of Eq. 7, the two regularisers
(Eq. 6 and Eq. 8) and the two ways of fusing experts (logit level, Eq. 9, and prompt level)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError
from raysim.methods.families.prompt import seeded

# -- SEM: P_m = A_m B0 + R (Eq. 5) --------------------------------------------------------------

def public_basis(seed: int, rank: int, width: int, kind: str = "gaussian") -> Tensor:
    """B0, shape (r, w), from a public seed only: every host that calls this with the same arguments gets
    the bit-identical basis (drawn on the CPU). "gaussian": N(0, 0.02^2), never orthonormalised (SPEC 1.2,
    the official code); then a step on A moves P = A B0 by lr * g B0^T B0, whose nonzero eigenvalues are
    about w * 0.02^2 (0.15 at w = 384), inside a 16-dim subspace. "orthonormal": the same draw with its rows
    orthonormalised (QR; identical on hosts with the same torch build), so the step is g's projection on
    that subspace (an analysis option: benchmarks/fedsept_offline_analysis.py)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    B0 = torch.randn(rank, width, generator=g, dtype=torch.float32) * 0.02
    if kind == "orthonormal":
        Q, _ = torch.linalg.qr(B0.t())  # (w, r), orthonormal columns spanning B0's row space
        B0 = Q.t().contiguous()
    return B0


def expert_prompts(A: Tensor, experts: int, B0: Optional[Tensor], R: Optional[Tensor]) -> Tensor:
    """(M, L, w) expert prompts from the stacked factors A ((M*L, r) with a basis, (M*L, w) without)."""
    P = A.view(experts, -1, A.shape[-1])
    if B0 is not None:
        P = P @ B0
    if R is not None:
        P = P + R
    return P


# -- regularisers ----------------------------------------------------------------------------

def diversity_loss(A: Tensor, experts: int, reduction: str = "sum") -> Tensor:
    """Eq. 6: off-diagonal entries of the Gram matrix of the row-normalised H = [vec(A_m)]_m, squared.
    "sum" is the paper's squared Frobenius norm; "mean" divides by the M(M-1) entries (official code)."""
    H = F.normalize(A.reshape(experts, -1), dim=-1)
    G = H @ H.t()
    off = G.pow(2) * (1 - torch.eye(experts, dtype=G.dtype, device=G.device))
    if experts < 2:
        return off.sum() * 0
    return off.sum() if reduction == "sum" else off.sum() / (experts * (experts - 1))


def gate_loss(pi: Tensor) -> Tensor:
    """Eq. 8: sum_m pibar_m log(M pibar_m) with pibar the batch-mean routing vector (KL to uniform)."""
    pibar = pi.mean(dim=0)
    return (pibar * torch.log(pi.shape[-1] * pibar.clamp_min(1e-12))).sum()


# -- IEF: router (Eq. 7) and fusion (Eq. 9) --------------------------------------------------

class Router(nn.Module):
    """pi(x) = softmax(W_gate LN(MHA(u, v(x), v(x)))) (SPEC 1.3).

    mode "pooled" (official code): the key/value is the single pooled image feature (B, D), so the
    attention weight is 1 and the probe u is inert. mode "patch": keys/values are patch tokens
    (B, K, D_tok) and u selects among them."""

    def __init__(self, dim: int, experts: int, heads: int = 4, dropout: float = 0.1, mode: str = "pooled") -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"fedsept.router_heads={heads} must divide the router width {dim}")
        self.mode = mode
        self.probe = nn.Parameter(torch.randn(1, dim) * 0.02)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, experts)
        nn.init.normal_(self.gate.weight, std=0.01)
        nn.init.zeros_(self.gate.bias)

    def forward(self, feats: Tensor) -> Tensor:
        if self.mode == "pooled":
            if feats.dim() != 2:
                raise ValueError(f"pooled router expects (B, D) features, got {tuple(feats.shape)}")
            kv = feats.detach().unsqueeze(1)  # one token per image
        else:
            if feats.dim() != 3:
                raise ConfigError(
                    "fedsept.router=patch needs patch-token features of shape (B, K, D); "
                    f"got {tuple(feats.shape)} (pooled features only)"
                )
            kv = feats.detach()
        q = self.probe.unsqueeze(0).expand(kv.shape[0], -1, -1)
        h, _ = self.attn(q, kv, kv, need_weights=False)
        return F.softmax(self.gate(self.norm(h.mean(dim=1))), dim=-1)


def make_router(dim: int, experts: int, heads: int, dropout: float, mode: str, rng: torch.Generator) -> Router:
    """A router whose initial weights are a function of `rng` only (not of the global RNG)."""
    with seeded(rng):
        return Router(dim, experts, heads, dropout, mode)


def hard_top1(pi: Tensor) -> Tensor:
    """One-hot arg-max routing; in training the gradient passes to the soft weights (straight-through)."""
    hard = F.one_hot(pi.argmax(dim=-1), pi.shape[-1]).to(pi.dtype)
    return hard + pi - pi.detach() if pi.requires_grad else hard


def logit_fusion(scale: float, feats: Tensor, text: Tensor, pi: Tensor) -> Tensor:
    """Eq. 9: z_c(x) = sum_m pi_m(x) s <v(x), t_{m,c}>; text (M, C, D), feats (B, D), pi (B, M)."""
    z = scale * torch.einsum("bd,mcd->bmc", feats, text)
    return torch.einsum("bm,bmc->bc", pi, z)


def prompt_fusion(prompts, scale: float, feats: Tensor, P: Tensor, pi: Tensor, chunk: int = 64) -> Tensor:
    """Prompt-level fusion (FedSEPT-PF): P(x) = sum_m pi_m(x) P_m, so the text is re-encoded per input.
    P (M, L, w); returns (B, C) logits. Inputs go through the text tower `chunk` at a time."""
    out = []
    for i in range(0, feats.shape[0], chunk):
        Px = torch.einsum("bm,mlw->blw", pi[i : i + chunk], P)
        text = prompts.text_features(Px)  # (b, C, D)
        out.append(scale * torch.einsum("bd,bcd->bc", feats[i : i + chunk], text))
    return torch.cat(out, dim=0)


# -- gradients outside the DP handle ---------------------------------------------------------

def grads_of(loss: Optional[Tensor], params: list[Tensor]) -> Optional[list[Optional[Tensor]]]:
    """Gradients of an extra loss w.r.t. `params`, keeping the graph for the main backward."""
    if loss is None or not params:
        return None
    return list(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))


def add_grads(params: list[Tensor], grads: Optional[list[Optional[Tensor]]]) -> None:
    """p.grad += g for every pair (after the DP handle has written its gradients)."""
    for p, g in zip(params, grads or []):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g
