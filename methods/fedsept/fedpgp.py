"""FedPGP (Cui et al., 2024) as the FedSEPT repository runs it (SPEC 1.11, fedsept.txt B.2).

Prompt  P = U V + G: a shared global context G (L x w, the only upload) plus a private low-rank
        part U (L x r) V (r x w), r = 4; G, U, V ~ N(0, 0.02^2).
Text    four feature sets per step: "embedding" t0 (the plain "X X ... X <class>." prompts, no learned
        context), global-only t_G, UV-only t_UV (computed as the official code does, never used by the
        loss: `uv_features=false` skips it), and the full prompt t_P.
Loss    l_i = CE(s <v(x_i), t_P>, y_i) + mu * L_con, with the prompt-wise contrast
        L_con = mean_c CE([cos(t0_c, t_G,c), cos(t_G,c, t_P,c)] / tau, target 0), mu = 100, tau = 0.5:
        it pulls the global prompt towards the hand-made prompt and away from the personalised one.
DP      DP-SGD on G alone; U and V take the plain gradient. L_con does not depend on the batch, yet
        in the official placement (`contrast_outside_dp=false`) it is added to every per-example loss
        before clipping, so mu * grad L_con dominates every clipped per-example gradient: with mu = 100
        most of the clipping budget carries the same data-independent direction and the data's CE
        signal is scaled down with it (a likely cause of FedPGP's weak DP numbers, SPEC 1.11).
        `contrast_outside_dp=true` passes it as `public_loss` instead: its gradient is added after
        clipping and noising. Caveat: L_con reads the private U, V, which train on the client's data
        without noise, so it is data-independent only given them; the same caveat holds for every
        per-example gradient of a method that keeps non-private local tensors (the papers' threat model).
Server  FedAvg of G; the client's model is the latest G with its own U, V.

Stacks  the step hooks below are the local round for one client or a client-batched stack
        (ClipPromptMethod.train_clients, execution.batch_clients).

`train.ctx_init` is not used: G starts random and t0 uses the placeholder prompts, as in FedSEPT's runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.prompt import ClipPromptMethod, PromptClient, StepLoss
from raysim.privacy.mechanisms import dpsgd


@dataclass
class FedPGPOptions:
    rank: int = 4  # r of U (L x r) and V (r x w)
    weight: float = 100.0  # mu, the weight of the prompt-wise contrast
    temperature: float = 0.5  # tau
    contrast_outside_dp: bool = False  # True: mu * L_con as DP-SGD's public_loss (after clipping) instead of per example
    uv_features: bool = True  # encode the UV-only prompts every step as the official code does (unused by the loss)

    def validate(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"fedpgp.rank must be >= 1, got {self.rank}")
        if self.weight < 0:
            raise ConfigError(f"fedpgp.weight must be >= 0 (0 drops the contrast), got {self.weight}")
        if not self.temperature > 0:
            raise ConfigError(f"fedpgp.temperature must be > 0, got {self.temperature}")


def prompt_contrast(t0: Tensor, t_global: Tensor, t_full: Tensor, temperature: float) -> Tensor:
    """FedPGP's prompt-wise contrast on normalised (C, D) text features: per class a 2-way CE with
    logits [cos(t0_c, t_global_c), cos(t_global_c, t_full_c)] / temperature and target 0, averaged."""
    pos = (t0 * t_global).sum(-1)
    neg = (t_global * t_full).sum(-1)
    logits = torch.stack([pos, neg], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))


@register_method
class FedPGP(ClipPromptMethod):
    name = "fedpgp"
    loss_weights = {"prompt-wise contrast": "weight"}
    averaged = ("global_ctx",)
    Options = FedPGPOptions
    releases = {"global_ctx": dpsgd()}
    client_metrics = ("loss", "ce", "contrast")
    batched_context = "global_ctx"  # local_train is the step hooks below, which stack clients

    def init_shared(self, env, rng):
        return {"global_ctx": torch.randn(self.train.n_ctx, env.ctx_width, generator=rng) * 0.02}

    def init_private(self, env, data: ClientData, rng):
        U = torch.randn(self.train.n_ctx, self.opts.rank, generator=rng) * 0.02
        V = torch.randn(self.opts.rank, env.ctx_width, generator=rng) * 0.02
        return {"U": U, "V": V}

    def aggregate(self, env, shared, uploads, rng):
        return {"global_ctx": weighted_mean(uploads, "global_ctx")}

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        return self.stacked_local_train(env, shared, private, data, rng=rng, privacy=privacy)  # the steps below

    # the local round (ClipPromptMethod.train_clients, one client or a stack): G from the broadcast, U, V private
    def step_start(self, env, shared, private, rng: torch.Generator) -> PromptClient:
        G = shared["global_ctx"].clone().to(env.device).requires_grad_(True)
        U = private["U"].clone().to(env.device).requires_grad_(True)
        V = private["V"].clone().to(env.device).requires_grad_(True)
        return PromptClient({"global_ctx": G}, {"U": U, "V": V})

    def step_contexts(self, c: PromptClient) -> Tensor:
        """The full prompt G + U V and the global-only G: t_P and t_G."""
        G, (U, V) = c.dp["global_ctx"], c.local.values()
        return torch.stack([G + U @ V, G])

    def step_unused(self, c: PromptClient) -> Optional[Tensor]:
        """The UV-only prompt: the official code encodes it every step and never uses it."""
        U, V = c.local.values()
        return (U @ V)[None] if self.opts.uv_features else None

    def step_loss(self, env, c: PromptClient, text: Tensor, x: Tensor, y: Tensor, *, tokens: Optional[Tensor] = None) -> StepLoss:
        o = self.opts
        t_full, t_global = text.unbind(0)
        ce = F.cross_entropy(self.logits(env, x, t_full), y, reduction="none")
        raw = prompt_contrast(self.plain_features(env), t_global, t_full, o.temperature)
        contrast = o.weight * raw
        terms = {"ce": float(ce.detach().mean()), "contrast": float(raw.detach())}  # L_con itself; "loss" has mu * L_con
        terms["loss"] = terms["ce"] + float(contrast.detach())
        if o.contrast_outside_dp:
            return StepLoss(ce, contrast, terms)  # its gradient joins after clipping and noise
        return StepLoss(ce + contrast, None, terms)  # per example, before clipping (official placement)

    @staticmethod
    def plain_features(env) -> Tensor:
        """t0: the text features of "X X ... X <class>." (no learned context), constant: computed once per env."""
        return env.plain_text

    def predictor(self, env, shared, private, data=None):
        """The latest global context with the client's own U V (SPEC 1.8)."""
        with torch.no_grad():
            P = shared["global_ctx"].to(env.device) + private["U"].to(env.device) @ private["V"].to(env.device)
            text = env.prompts.text_features(P)
        return lambda feats: self.logits(env, feats.to(env.device), text)
