"""FedOTP (Li et al., 2024) as the FedSEPT repository runs it (SPEC 1.11, fedsept.txt B.2).

Prompts  two CoOp contexts of L tokens: prompt 0 is shared (`ctx`, the only upload), prompt 1 is the
         client's own (`ctx_local`); both ~ N(0, 0.02^2).
OT       an image is a set of M local features f_m (normalised), a class c the set of its N = 2 prompts'
         text features t_nc. The plan T_c between them is entropic OT (Sinkhorn, eps 0.1, stop when the
         mean change of the row scaling is below 1e-3, at most 100 iterations) with uniform marginals
         1/M and 1/N and cost 1 - <f_m, t_nc>; it is computed without gradient. The logit is
         s * sum_mn T_c,mn <f_m, t_nc>, and the loss the CE of these logits.
Tokens   `tokens=patch` (default): the M local features are the image tower's patch tokens mapped into
         the embedding space (ln_post and proj for a ViT: 196 for ViT-B/16), read from the token cache
         FedSEPT's patch router uses. `tokens=pooled` reproduces the official code: its trainer never
         builds the patch encoder (a name-case mismatch, SPEC 1.11), so the only local feature is the
         pooled one, M = 1, the plan is exactly uniform (1/N) and the OT logit is the average of the two
         prompts' cosine logits: a degenerate transport, kept only to match the paper's numbers.
DP       DP-SGD on prompt 0 only; prompt 1 takes the plain gradient.
Server   FedAvg of prompt 0; the client's model is the latest prompt 0 with its own prompt 1.
Stacks   the step hooks below are the local round for one client or a client-batched stack
         (ClipPromptMethod.train_clients, execution.batch_clients): both modes stack; each client's Sinkhorn
         (its own number of iterations) runs inside its own step loss.

The FedOTP paper's unbalanced variant (COT: a partial-mass plan) is not implemented; B.2 runs Sinkhorn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, Needs, register_method, weighted_mean
from raysim.methods.families.prompt import ClipPromptMethod, PromptClient, StepLoss
from raysim.privacy.mechanisms import dpsgd


@dataclass
class FedOTPOptions:
    tokens: str = "patch"  # patch (the image tower's patch tokens) | pooled (official code: one point, uniform plan)
    eps: float = 0.1  # entropic regularisation
    thresh: float = 1e-3  # stop when the mean absolute change of the row scaling is below this
    max_iter: int = 100

    def validate(self) -> None:
        if self.tokens not in ("patch", "pooled"):
            raise ConfigError(f"fedotp.tokens must be patch or pooled, got {self.tokens!r}")
        if not self.eps > 0:
            raise ConfigError(f"fedotp.eps must be > 0, got {self.eps}")
        if not self.thresh >= 0:
            raise ConfigError(f"fedotp.thresh must be >= 0, got {self.thresh}")
        if self.max_iter < 1:
            raise ConfigError(f"fedotp.max_iter must be >= 1, got {self.max_iter}")


@torch.no_grad()
def sinkhorn(K: Tensor, a: Tensor, b: Tensor, *, max_iter: int = 100, thresh: float = 1e-3) -> Tensor:
    """Entropic OT plans diag(r) K diag(c), batched over the leading dims: K (..., M, N) = exp(-cost/eps),
    a (..., M) and b (..., N) the marginals. Alternates r = a / (K c) and c = b / (K^T r) from ones, and stops
    after `max_iter` rounds or when mean |r - r_prev| < thresh. Columns then match b exactly, rows approximately."""
    if K.numel() == 0:  # an empty (Poisson) batch
        return K.clone()
    r = torch.ones_like(a)
    c = torch.ones_like(b)
    for _ in range(max_iter):
        prev = r
        r = a / torch.einsum("...mn,...n->...m", K, c)
        c = b / torch.einsum("...mn,...m->...n", K, r)
        if float((r - prev).abs().mean()) < thresh:
            break
    return r.unsqueeze(-1) * K * c.unsqueeze(-2)


def ot_logits(scale: float, local: Tensor, text: Tensor, *, eps: float, thresh: float, max_iter: int) -> Tensor:
    """(B, C) logits s * <T_c, S_c>: local (B, M, D) normalised image features, text (N, C, D) normalised
    prompt features, S_c = [<f_m, t_nc>] (B, C, M, N) and T_c its Sinkhorn plan (no gradient through T)."""
    sim = torch.einsum("bmd,ncd->bcmn", local, text)
    B, C, M, N = sim.shape
    a = sim.new_full((B, C, M), 1.0 / M)
    b = sim.new_full((B, C, N), 1.0 / N)
    T = sinkhorn(torch.exp(-(1.0 - sim.detach()) / eps), a, b, max_iter=max_iter, thresh=thresh)
    return scale * (T * sim).sum(dim=(-2, -1))


@register_method
class FedOTP(ClipPromptMethod):
    name = "fedotp"
    averaged = ("ctx",)
    Options = FedOTPOptions
    releases = {"ctx": dpsgd()}
    client_metrics = ("loss",)
    batched_context = "ctx"  # local_train is the step hooks below, which stack clients

    @property
    def patch(self) -> bool:
        return self.opts.tokens == "patch"

    def needs(self) -> Needs:
        return Needs(input="features", tokens=self.patch)

    def build_env(self, spec, *, role: str):
        from raysim.models.clip import build_clip_env

        # the patch features need the image tower's per-token map (ln_post, proj), kept next to the text side
        return build_clip_env(spec.model, spec.classnames, self.train.n_ctx, device=spec.device, token_head=self.patch)

    def init_shared(self, env, rng):
        return {"ctx": env.prompts.initial_context(rng)}

    def init_private(self, env, data: ClientData, rng):
        return {"ctx_local": torch.randn(self.train.n_ctx, env.ctx_width, generator=rng) * 0.02}

    def aggregate(self, env, shared, uploads, rng):
        return {"ctx": weighted_mean(uploads, "ctx")}

    def local_features(self, env, feats: Tensor, tokens: Tensor | None) -> Tensor:
        """(B, M, D) normalised local image features: the mapped patch tokens, or the pooled feature (M = 1)."""
        if not self.patch:
            return F.normalize(feats, dim=-1).unsqueeze(1)
        assert tokens is not None and env.token_head is not None  # needs() asks for tokens, build_env for the head
        with torch.no_grad():
            return F.normalize(env.token_head(tokens.to(env.device)), dim=-1)

    def forward(self, env, text: Tensor, feats: Tensor, tokens: Tensor | None) -> Tensor:
        o = self.opts
        local = self.local_features(env, feats, tokens)
        return ot_logits(env.logit_scale, local, text, eps=o.eps, thresh=o.thresh, max_iter=o.max_iter)

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        return self.stacked_local_train(env, shared, private, data, rng=rng, privacy=privacy)  # the steps below

    # the local round (ClipPromptMethod.train_clients, one client or a stack): prompt 0 from the broadcast, 1 private
    def step_start(self, env, shared, private, rng: torch.Generator) -> PromptClient:
        ctx = shared["ctx"].clone().to(env.device).requires_grad_(True)
        ctx_local = private["ctx_local"].clone().to(env.device).requires_grad_(True)
        return PromptClient({"ctx": ctx}, {"ctx_local": ctx_local})

    def step_contexts(self, c: PromptClient) -> Tensor:
        """Both prompts: their (2, C, D) text features are the N = 2 points of each class."""
        return torch.stack([c.dp["ctx"], c.local["ctx_local"]])

    def step_loss(self, env, c: PromptClient, text: Tensor, x: Tensor, y: Tensor, *, tokens: Optional[Tensor] = None) -> StepLoss:
        loss = F.cross_entropy(self.forward(env, text, x, tokens), y, reduction="none")
        return StepLoss(loss, None, {"loss": loss.detach().mean()})

    def predictor(self, env, shared, private, data=None):
        """The latest shared prompt with the client's own (SPEC 1.8); text features computed once."""
        with torch.no_grad():
            text = env.prompts.text_features(torch.stack([shared["ctx"].to(env.device), private["ctx_local"].to(env.device)]))

        @torch.no_grad()
        def predict(feats, tokens=None):
            return self.forward(env, text, feats.to(env.device), tokens)

        return predict
