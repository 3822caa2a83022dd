"""pFedMoAP (Luo et al., 2025), baseline of fedsept.txt (appendix B.2; SPEC 1.11): a shared CoOp context
plus a private attention gate over other clients' contexts, used as a mixture of prompt experts.

Client  starts from the FedAvg `ctx` of the last round and trains its own copy. Its experts are the
        latest uploaded contexts of the min(num_experts, K) - 1 other clients nearest to its own last
        context (L2 distance, `select_experts`); their text features are computed once per round and
        fixed. Logits: lambda * s <v, t_c(ctx)> + s <p(v), g_c(v)>, with p = pooling by keeping every
        (D/d)-th of the D feature dimensions (every 4th of 512 at d = 128; generalised to D // d, keeping
        the first d of them) and g_c(v) the output of the gating head (`Gating`: multi-head attention with
        scale `scaling` = 10 instead of 1/sqrt(d_k)) whose query is p(v) and whose keys/values are the
        pooled text features of class c under [own ctx, expert ctxs]. Before a client has its own last
        context (its first participation) or when there are no experts, the logits are the local ones.
        Loss CE. The gating head is private and not privatised; DP-SGD (when on) privatises ctx only.
Server  FedAvg of ctx over the round's uploads, and `bank`: the latest uploaded ctx of every client
        (`bank_seen` marks who has uploaded).
Evaluation  the client's own last ctx (the one it uploaded) with its nearest experts from the bank and
        its gating head.
Stacks  the step hooks below are the local round for one client or a client-batched stack
        (ClipPromptMethod.train_clients, execution.batch_clients); a client's expert text features are
        computed in its `step_start`, outside the stack's forward (fixed for the round).

How experts reach a client without anything undeclared crossing: the server already holds every
client's latest upload, which is public once released (under DP it is the privatised output), so
broadcasting the bank is post-processing of released tensors at no privacy cost; a client picks its
experts from the bank itself. Nothing new is uploaded. The broadcast grows with K: K x L x w floats
more per client per round (K = 10, L = 16, w = 512: 320 KiB), and `bytes_down` counts it.

Deviations (parallel simulation): every client of a round chooses its experts from the bank as it was
at the start of the round; the official code trains clients one after another, so a later client of a
round already sees the contexts earlier ones uploaded in that round. Like every method here the
optimiser state is fresh per round (SPEC 1.7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.prompt import ClipPromptMethod, PromptClient, StepLoss, seeded
from raysim.privacy.mechanisms import dpsgd


@dataclass
class PFedMoAPOptions:
    num_experts: int = 8  # experts including the client's own prompt: min(num_experts, K) (B.2)
    lmbda: float = 0.5  # weight of the local logits (lambda)
    gating_dim: int = 128  # d: width of the gating head; the D-wide features are pooled to it
    gating_heads: int = 4
    scaling: float = 10.0  # attention score scale (instead of 1/sqrt(d_k))

    def validate(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        check(self.num_experts >= 1, f"pfedmoap.num_experts must be >= 1, got {self.num_experts}")
        check(self.lmbda >= 0, f"pfedmoap.lmbda must be >= 0, got {self.lmbda}")
        check(self.gating_dim >= 1, f"pfedmoap.gating_dim must be >= 1, got {self.gating_dim}")
        check(self.gating_heads >= 1 and self.gating_dim % self.gating_heads == 0,
              f"pfedmoap.gating_heads={self.gating_heads} must divide pfedmoap.gating_dim={self.gating_dim}")
        check(self.scaling > 0, f"pfedmoap.scaling must be > 0, got {self.scaling}")


class Gating(nn.Module):
    """pFedMoAP's attention gate: W_q, W_k, W_v, W_o of width d, `heads` heads, scores Q K^T * scaling,
    softmax over the keys, no dropout. q (C, B, d) queries, kv (C, E, d) keys = values -> (C, B, d)."""

    def __init__(self, dim: int, heads: int, scaling: float) -> None:
        super().__init__()
        self.heads, self.scaling = heads, scaling
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(dim, dim) for _ in range(4))

    def _split(self, t: Tensor) -> Tensor:  # (C, N, d) -> (C, heads, N, d / heads)
        return t.view(*t.shape[:2], self.heads, -1).transpose(1, 2)

    def forward(self, q: Tensor, kv: Tensor) -> Tensor:
        Q, K, V = self._split(self.W_q(q)), self._split(self.W_k(kv)), self._split(self.W_v(kv))
        attn = F.softmax(Q @ K.transpose(-2, -1) * self.scaling, dim=-1)
        out = (attn @ V).transpose(1, 2).reshape(q.shape)
        return self.W_o(out)


def pool(t: Tensor, dim: int) -> Tensor:
    """Keep every (D // dim)-th of the last axis' D entries, the first `dim` of them (every 4th of 512 -> 128)."""
    stride = t.shape[-1] // dim
    return t[..., : dim * stride : stride]


def gated_logits(gating: Gating, scale: float, feats: Tensor, own_text: Tensor, expert_text: Tensor, dim: int) -> Tensor:
    """s <p(v_b), g_c(v_b)>, (B, C): per class c the query p(v_b) attends over the pooled text features of
    c under [own, experts]. feats (B, D); own_text (C, D); expert_text (E, C, D)."""
    q = pool(feats, dim)  # (B, d)
    kv = pool(torch.cat([own_text.unsqueeze(0), expert_text], dim=0), dim).transpose(0, 1)  # (C, 1 + E, d)
    out = gating(q.unsqueeze(0).expand(kv.shape[0], -1, -1), kv)  # (C, B, d)
    return scale * torch.einsum("bd,cbd->bc", q, out)


def select_experts(own: Tensor, bank: Tensor, seen: Tensor, me: int, num_experts: int) -> list[int]:
    """Ids of the min(num_experts, K) - 1 clients (other than `me`, with an upload in the bank) whose
    latest ctx is nearest to `own` in L2 distance, nearest first (ties: lower id first)."""
    others = [j for j in range(bank.shape[0]) if j != me and float(seen[j]) > 0]
    dist = [float((bank[j].float() - own.float()).norm()) for j in others]
    ranked = sorted(range(len(others)), key=lambda i: (dist[i], others[i]))
    return [others[i] for i in ranked[: max(0, num_experts - 1)]]


@register_method
class PFedMoAP(ClipPromptMethod):
    name = "pfedmoap"
    # evaluation: the client's own last ctx (not the FedAvg one); bank_seen is a 0/1 mask; a key bias adds
    # q . b to every score of a query, which the softmax cancels
    eval_ignores = ("shared:ctx", "bank_seen", "gating.W_k.bias")
    eval_options = ("lmbda",)
    averaged = ("ctx",)
    Options = PFedMoAPOptions
    releases = {"ctx": dpsgd()}
    supports_ctx_init = True  # like PromptFL: train.ctx_init (ctx_init="" is the paper's N(0, 0.02^2))
    batched_context = "ctx"  # local_train is the step hooks below, which stack clients

    def build_env(self, spec, *, role: str):
        env = super().build_env(spec, role=role)
        if env.feature_dim < self.opts.gating_dim:
            raise ConfigError(f"pfedmoap.gating_dim={self.opts.gating_dim} exceeds the image feature width "
                              f"{env.feature_dim} of {spec.model.model}; set pfedmoap.gating_dim <= {env.feature_dim}")
        return env

    # -- server half -------------------------------------------------------------------------
    def init_shared(self, env, rng):
        ctx = env.prompts.initial_context(rng)
        K = self.train.num_clients
        return {"ctx": ctx, "bank": torch.zeros(K, *ctx.shape), "bank_seen": torch.zeros(K)}

    def aggregate(self, env, shared, uploads, rng):
        bank, seen = shared["bank"].clone(), shared["bank_seen"].clone()
        for u in uploads:  # the released tensors themselves: post-processing, nothing new is learnt
            bank[u.client_id] = u.tensors["ctx"].float()
            seen[u.client_id] = 1.0
        return {"ctx": weighted_mean(uploads, "ctx"), "bank": bank, "bank_seen": seen}

    # -- client half -------------------------------------------------------------------------
    def init_private(self, env, data: ClientData, rng):
        o = self.opts
        with seeded(rng):  # nn.Linear's default initialisation, drawn from this client's stream
            gating = Gating(o.gating_dim, o.gating_heads, o.scaling)
        return {"client": data.client_id, "gating": gating.state_dict()}

    def _gating(self, env, private) -> Gating:
        o = self.opts
        gating = Gating(o.gating_dim, o.gating_heads, o.scaling)
        gating.load_state_dict(private["gating"])
        return gating.to(env.device)

    def experts(self, env, shared, private) -> Optional[Tensor]:
        """Fixed (E, C, D) text features of the client's experts, or None (no own last ctx, or nobody else)."""
        if "ctx" not in private:
            return None
        ids = select_experts(private["ctx"], shared["bank"], shared["bank_seen"], int(private["client"]), self.opts.num_experts)
        if not ids:
            return None
        with torch.no_grad():
            return env.prompts.text_features(shared["bank"][ids].to(env.device))

    def forward(self, env, gating: Optional[Gating], ctx: Tensor, feats: Tensor, expert_text: Optional[Tensor],
                text: Optional[Tensor] = None) -> Tensor:
        text = env.prompts.text_features(ctx) if text is None else text
        local = self.logits(env, feats, text)
        if expert_text is None or gating is None:
            return local
        return self.opts.lmbda * local + gated_logits(gating, env.logit_scale, feats, text, expert_text, self.opts.gating_dim)

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        return self.stacked_local_train(env, shared, private, data, rng=rng, privacy=privacy)  # the steps below

    # the local round (ClipPromptMethod.train_clients, one client or a stack): ctx from the broadcast, the private
    # gating head trained only when the client has experts (without them it is unused)
    def step_start(self, env, shared, private, rng: torch.Generator) -> PromptClient:
        ctx = shared["ctx"].clone().to(env.device).requires_grad_(True)
        expert_text = self.experts(env, shared, private)
        gating: dict[str, nn.Module] = {"gating": self._gating(env, private)} if expert_text is not None else {}
        return PromptClient({"ctx": ctx}, {}, gating, fixed={} if expert_text is None else {"experts": expert_text})

    def step_loss(self, env, c: PromptClient, text: Tensor, x: Tensor, y: Tensor, *, tokens: Optional[Tensor] = None) -> StepLoss:
        expert_text = c.fixed.get("experts")
        gating = cast(Optional[Gating], c.modules.get("gating"))  # None without experts
        loss = F.cross_entropy(self.forward(env, gating, c.dp["ctx"], x, expert_text, text[0]), y, reduction="none")
        return StepLoss(loss, None, {"loss": loss.detach().mean()})

    def step_private(self, c: PromptClient) -> dict:
        """The gating head (when it trained) and the context the client uploaded: its own last ctx."""
        return {**super().step_private(c), "ctx": c.dp["ctx"].detach().cpu()}

    def _own_ctx(self, env, shared, private) -> Tensor:
        return (private["ctx"] if "ctx" in private else shared["ctx"]).to(env.device)

    def predictor(self, env, shared, private, data=None):
        """The client's own last ctx, its nearest experts from the bank and its gating head."""
        ctx = self._own_ctx(env, shared, private)
        gating = self._gating(env, private).eval().requires_grad_(False)
        expert_text = self.experts(env, shared, private)
        with torch.no_grad():
            text = env.prompts.text_features(ctx)

        @torch.no_grad()
        def predict(feats):
            return self.forward(env, gating, ctx, feats.to(env.device), expert_text, text)

        return predict
