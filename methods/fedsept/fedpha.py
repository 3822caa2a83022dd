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

EOT quirk (`eot_quirk=true`, off by default): the official code tokenises every prompt with
Lmax = max(L, max_k l_k) placeholders, concatenates a shorter prompt with that suffix and pads with zero
vectors, so a prompt of l < Lmax tokens is pooled Lmax - l positions after its real end-of-text token.
With the flag the same happens here (Lmax from every client's derivable length); without it each
prompt is encoded with its own number of placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.prompt import ClipPromptMethod, sgd
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


@register_method
class FedPHA(ClipPromptMethod):
    name = "fedpha"
    eval_ignores = ("ctx_global",)  # the client predicts with its local prompt; G only shapes its training
    averaged = ("ctx_global",)
    Options = FedPHAOptions
    releases = {"ctx_global": dpsgd()}
    client_metrics = ("loss", "ce_local", "ce_global", "pull", "push")

    def __init__(self, train, options, dp=None) -> None:
        super().__init__(train, options, dp)
        self._prompts: dict[int, Any] = {}  # placeholders -> CoOpPrompts of self._env
        self._env: Any = None
        self._lmax: int | None = None

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

    def text(self, env, ctx: Tensor) -> Tensor:
        """(C, D) normalised text features of a context of any length."""
        if not self.opts.eot_quirk:
            return self.prompts(env, int(ctx.shape[0])).text_features(ctx)
        long = self.prompts(env, self.quirk_length())  # tokenised with Lmax placeholders: its suffix and pooling position
        C = long.num_classes
        short = torch.cat([long.prefix, ctx.to(long.prefix.dtype).unsqueeze(0).expand(C, -1, -1), long.suffix], dim=1)
        T = long.prefix.shape[1] + long.n_ctx + long.suffix.shape[1]
        padded = torch.cat([short, short.new_zeros(C, T - short.shape[1], short.shape[2])], dim=1)  # zero vectors to T
        return F.normalize(long.tower(padded, long.meta), dim=-1)  # pooled where Lmax placeholders would end

    # -- server half -------------------------------------------------------------------------
    def init_shared(self, env, rng):
        return {"ctx_global": torch.randn(self.train.n_ctx, env.ctx_width, generator=rng) * 0.02}

    def aggregate(self, env, shared, uploads, rng):
        return {"ctx_global": weighted_mean(uploads, "ctx_global")}

    # -- client half -------------------------------------------------------------------------
    def init_private(self, env, data: ClientData, rng):
        return {"ctx_local": torch.randn(self.local_length(data.client_id), env.ctx_width, generator=rng) * 0.02}

    def losses(self, env, G: Tensor, P: Tensor, feats: Tensor, y: Tensor) -> dict[str, Tensor]:
        """The four terms: per-sample CE of the local and of the global prompt, and the pull and push terms."""
        t_local, t_global = self.text(env, P), self.text(env, G)
        V2 = projection_basis(G, self.opts.ratio)
        t_proj = self.text(env, P @ V2 @ V2.t())  # the local prompt projected onto G's trailing singular directions
        pull, push = pull_push(t_local, t_proj, t_global, self.opts.alpha)
        return {
            "ce_local": F.cross_entropy(self.logits(env, feats, t_local), y, reduction="none"),
            "ce_global": F.cross_entropy(self.logits(env, feats, t_global), y, reduction="none"),
            "pull": pull,
            "push": push,
        }

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        G = shared["ctx_global"].clone().to(env.device).requires_grad_(True)
        P = private["ctx_local"].clone().to(env.device).requires_grad_(True)
        opt = sgd([G, P], self.train)
        y = data.y_train.to(env.device)
        terms: dict[str, list[float]] = {k: [] for k in self.client_metrics}
        for epoch in range(self.train.local_epochs):
            x = data.train_inputs(epoch)[0].to(env.device)  # this epoch's features (a drawn augmented view per image under data.augment)
            for idx in privacy.batches(data.num_train, self.train.batch_size, rng):
                parts = self.losses(env, G, P, x[idx], y[idx])
                loss = parts["ce_local"] + parts["ce_global"] + parts["pull"] + parts["push"]  # per example, all weights 1
                opt.zero_grad(set_to_none=True)
                privacy.backward(loss, dp_params={"ctx_global": G}, other_params=[P])
                opt.step()
                if len(idx):  # a Poisson batch may be empty (a noise-only step)
                    terms["loss"].append(loss.mean().item())
                    for k, v in parts.items():
                        terms[k].append(float(v.detach().mean()))
        return LocalResult(
            upload={"ctx_global": G.detach().cpu()},
            private={"ctx_local": P.detach().cpu()},
            num_samples=data.num_train,
            metrics={k: sum(v) / max(1, len(v)) for k, v in terms.items()},
        )

    def predictor(self, env, shared, private, data=None):
        """The client's local prompt (the official test path); the global anchor only shapes its training."""
        with torch.no_grad():
            text = self.text(env, private["ctx_local"].to(env.device))
        return lambda feats: self.logits(env, feats.to(env.device), text)
