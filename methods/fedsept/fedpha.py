"""FedPHA (Fang et al., 2025) as the FedSEPT repository runs it (SPEC 1.11, fedsept.txt B.2).

Prompts  a shared global anchor G (L x w, `ctx_global`, the only upload) and a private local prompt
         P of length l_k (l_k x w), both ~ N(0, 0.02^2). l_k is drawn uniformly from
         [local_min, local_max] = [4, 16] by a generator seeded by (train.seed, client id) alone, so
         every host derives the same length for a client (the official code draws all lengths with
         Python's random.seed(1); the numbers differ, the distribution does not).
Project  SVD G = U S V^T; V_2 = the right singular vectors from floor(n (1 - ratio)) on (n = rank of
         the SVD, ratio 0.8: 3 of 16 dropped), and the projected local prompt P V_2 V_2^T. The SVD is
         differentiated through, as in the official code.
Loss     per sample CE(s <v, t_P>) + CE(s <v, t_G>) + MSE(t_P, t_proj) + mean_c relu(alpha - ||t_P,c - t_G,c||)
         (alpha 1; normalised text features; every weight 1, lambda_orth is never a factor). The last two
         are data-independent and, as in the official code, are added to every per-example loss.
DP       DP-SGD on G only; P takes the plain gradient.
Server   FedAvg of G. The client predicts with its local prompt t_P.
Stacks   the step hooks below are the local round for one client or a client-batched stack
         (ClipPromptMethod.train_clients, execution.batch_clients): a step's contexts are G (L tokens) and
         P, P V_2 V_2^T (l_k tokens), and a stack encodes them with one text-tower forward per distinct length
         (`step_prompts(env, length)`: the CoOp prompts of that many placeholders, or the quirk's below).

EOT quirk (`eot_quirk=true`, off by default): the official code tokenises every prompt with
Lmax = max(L, max_k l_k) placeholders, concatenates a shorter prompt with that suffix and pads with zero
vectors, so a prompt of l < Lmax tokens is pooled Lmax - l positions after its real end-of-text token.
With the flag the same happens here (Lmax from every client's derivable length): a context of l tokens
goes through `quirk_prompts(l)`, CoOp prompts of l placeholders whose suffix is Lmax's padded with the
zero vectors and whose pooling position is Lmax's, so the quirk stacks by length like the plain path;
without it each prompt is encoded with its own number of placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.prompt import ClipPromptMethod, PromptClient, StepLoss
from raysim.privacy.mechanisms import dpsgd


@dataclass
class FedPHAOptions:
    local_min: int = 4  # the local prompt length is drawn uniformly from [local_min, local_max] per client
    local_max: int = 16
    ratio: float = 0.8  # keep the right singular vectors of G from floor(n (1 - ratio)) on
    alpha: float = 1.0  # margin of the push term
    eot_quirk: bool = False  # True: pool short prompts past their end-of-text token, as the official code does

    def validate(self) -> None:
        if not 1 <= self.local_min <= self.local_max:
            raise ConfigError(f"fedpha: need 1 <= local_min <= local_max, got local_min={self.local_min}, local_max={self.local_max}")
        if not 0 <= self.ratio <= 1:
            raise ConfigError(f"fedpha.ratio must be in [0, 1], got {self.ratio}")
        if self.alpha < 0:
            raise ConfigError(f"fedpha.alpha must be >= 0, got {self.alpha}")


def projection_basis(G: Tensor, ratio: float) -> Tensor:
    """V_2 (w, n - floor(n (1 - ratio))): G's right singular vectors (descending singular values) from
    floor(n (1 - ratio)) on, n = min(G.shape). Differentiable in G."""
    _, S, Vh = torch.linalg.svd(G, full_matrices=False)
    cutoff = int(S.shape[0] * (1 - ratio))
    return Vh[cutoff:].transpose(0, 1)


def pull_push(t_local: Tensor, t_proj: Tensor, t_global: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    """The two data-independent terms on (C, D) normalised text features: MSE(t_local, t_proj) over
    every entry, and mean_c relu(alpha - ||t_local_c - t_global_c||)."""
    pull = F.mse_loss(t_local, t_proj)
    push = F.relu(alpha - (t_local - t_global).norm(dim=-1)).mean()
    return pull, push


def quirk_prompts(long, classnames, length: int):
    """The official code's encoding of a context of `length` <= Lmax tokens as CoOp prompts of `length`
    placeholders: after its context, the suffix of the Lmax-placeholder tokenisation `long` (class tokens, ".",
    EOT), then Lmax - length zero vectors, so its total length is long's and it is pooled where long's EOT is,
    Lmax - length positions after its own."""
    from raysim.models.clip import CoOpPrompts

    q = CoOpPrompts(long.tower, classnames, length).to(long.suffix.device)
    C, _, w = long.suffix.shape
    q.prefix = long.prefix
    q.suffix = torch.cat([long.suffix, long.suffix.new_zeros(C, long.n_ctx - length, w)], dim=1)  # zero vectors to T
    q.meta = long.meta  # pooled where Lmax placeholders would end
    return q


@register_method
class FedPHA(ClipPromptMethod):
    name = "fedpha"
    eval_ignores = ("ctx_global",)  # the client predicts with its local prompt; G only shapes its training
    averaged = ("ctx_global",)
    Options = FedPHAOptions
    releases = {"ctx_global": dpsgd()}
    client_metrics = ("loss", "ce_local", "ce_global", "pull", "push")
    batched_context = "ctx_global"  # local_train is the step hooks below, which stack clients (of any local lengths)

    def __init__(self, train, options, dp=None) -> None:
        super().__init__(train, options, dp)
        self._prompts: dict[int, Any] = {}  # placeholders -> CoOpPrompts of self._env
        self._env: Any = None
        self._lmax: int | None = None

    def shares_optimizer_state(self) -> bool:
        """No: its local prompts differ in length from client to client (the code keeps one momentum per client's
        prompt in its one optimiser, which train.optimizer_state=shared does not reproduce)."""
        return False

    # -- prompt lengths and encodings -------------------------------------------------------
    def local_length(self, client_id: int) -> int:
        """l_k, a function of (train.seed, client id) only: every host derives the same value."""
        from raysim.sampling import generator

        o = self.opts
        g = generator(self.train.seed, "fedpha-local-length", int(client_id))
        return int(torch.randint(o.local_min, o.local_max + 1, (1,), generator=g).item())

    def quirk_length(self) -> int:
        """Lmax = max(L, max_k l_k): the placeholders every prompt is tokenised with in the official code."""
        if self._lmax is None:
            self._lmax = max([self.train.n_ctx] + [self.local_length(k) for k in range(self.train.num_clients)])
        return self._lmax

    def prompts(self, env, length: int):
        """CoOp prompts with `length` placeholders (built once per host and length)."""
        from raysim.models.clip import CoOpPrompts

        if self._env is not env:
            self._env, self._prompts = env, {}
        if length == env.prompts.n_ctx:
            return env.prompts
        if length not in self._prompts:
            self._prompts[length] = CoOpPrompts(env.tower, env.classnames, length).to(env.device)
        return self._prompts[length]

    def step_prompts(self, env, length: int):
        """The prompts that encode a context of `length` tokens (a step's and the predictor's): CoOp prompts of
        `length` placeholders, or under the EOT quirk `quirk_prompts` of Lmax's tokenisation."""
        if not self.opts.eot_quirk:
            return self.prompts(env, length)
        long = self.prompts(env, self.quirk_length())  # (a new env empties the cache)
        if -length not in self._prompts:  # the quirk's prompts of a length, cached beside the plain ones
            self._prompts[-length] = quirk_prompts(long, env.classnames, length)
        return self._prompts[-length]

    def text(self, env, ctx: Tensor) -> Tensor:
        """(C, D) normalised text features of a context of any length."""
        return self.step_prompts(env, int(ctx.shape[0])).text_features(ctx)

    # -- server half -------------------------------------------------------------------------
    def init_shared(self, env, rng):
        return {"ctx_global": torch.randn(self.train.n_ctx, env.ctx_width, generator=rng) * 0.02}

    def aggregate(self, env, shared, uploads, rng):
        return {"ctx_global": weighted_mean(uploads, "ctx_global")}

    # -- client half -------------------------------------------------------------------------
    def init_private(self, env, data: ClientData, rng):
        return {"ctx_local": torch.randn(self.local_length(data.client_id), env.ctx_width, generator=rng) * 0.02}

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        return self.stacked_local_train(env, shared, private, data, rng=rng, privacy=privacy)  # the steps below

    # the local round (ClipPromptMethod.train_clients, one client or a stack): G from the broadcast, P private
    def step_start(self, env, shared, private, rng: torch.Generator) -> PromptClient:
        G = shared["ctx_global"].clone().to(env.device).requires_grad_(True)
        P = private["ctx_local"].clone().to(env.device).requires_grad_(True)
        return PromptClient({"ctx_global": G}, {"ctx_local": P})

    def step_contexts(self, c: PromptClient) -> tuple[Tensor, Tensor]:
        """The global G (L tokens), and the local P with its projection P V_2 V_2^T (l_k tokens): t_G, t_P, t_proj."""
        G, P = c.dp["ctx_global"], c.local["ctx_local"]
        V2 = projection_basis(G, self.opts.ratio)  # differentiated through
        return G[None], torch.stack([P, P @ V2 @ V2.t()])  # the local prompt projected onto G's trailing singular directions

    def step_loss(self, env, c: PromptClient, text: tuple[Tensor, Tensor], x: Tensor, y: Tensor, *,
                  tokens: Optional[Tensor] = None) -> StepLoss:
        """The four terms, per example: the CE of the local and of the global prompt, plus the pull and push
        terms (data-independent, added to every example's loss as in the official code; all weights 1)."""
        (t_global,), (t_local, t_proj) = text[0], text[1]
        pull, push = pull_push(t_local, t_proj, t_global, self.opts.alpha)
        ce_local = F.cross_entropy(self.logits(env, x, t_local), y, reduction="none")
        ce_global = F.cross_entropy(self.logits(env, x, t_global), y, reduction="none")
        loss = ce_local + ce_global + pull + push
        terms = {"loss": loss.detach().mean(), "ce_local": ce_local.detach().mean(), "ce_global": ce_global.detach().mean(),
                 "pull": pull.detach(), "push": push.detach()}
        return StepLoss(loss, None, terms)

    def predictor(self, env, shared, private, data=None):
        """The client's local prompt (the official test path); the global anchor only shapes its training."""
        with torch.no_grad():
            text = self.text(env, private["ctx_local"].to(env.device))
        return lambda feats: self.logits(env, feats.to(env.device), text)
