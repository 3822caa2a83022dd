"""FedSEPT (fedsept.txt, Algorithm 1): subspace-decomposed expert prompts with instance-aware fusion.

SEM   P_m = A_m B0 + R (Eq. 5). B0 is a public basis drawn from a public seed (never sent each round:
      every host derives the bit-identical B0 in `build_env`); A = [A_1..A_M] is the only upload;
      R stays on the client.
IEF   a private router pi(x) = softmax(W_gate MHA(u, v(x), v(x))) (Eq. 7) weights the experts'
      logits (Eq. 9); per-expert text features are cached at inference. router="pooled" (official code)
      attends over the one pooled feature v(x); router="patch" over the image tower's tokens (SPEC 1.3).
Loss  l_i = CE_i + lambda_div L_div (Eq. 6) per sample; lambda_gate L_gate (Eq. 8) on the router only.
DP    DP-SGD on A alone (Eq. 11); R and the router take the plain gradient. L_div depends on A only,
      which is public after each release; `div_outside_dp=true` adds its gradient after clipping and
      noising (no privacy cost) instead of inside every clipped per-example gradient (the paper's Eq. 11).
Server  expert-wise weighted average of A (Eq. 12).
SGD   a fresh state per client per round; train.optimizer_state=shared continues one SGD state from client to client
      as the official code's one optimiser does (a simulation artifact, not a deployable protocol: another client's
      momentum reaches this one). The host carries it (methods/base.py OptimizerCarry); nothing here changes.
Stacks  the step hooks below are the local round for one client or a client-batched stack
        (ClipPromptMethod.train_clients, execution.batch_clients): the M expert prompts of every client in one
        text-tower forward; the router is a private module (no weight decay), its dropout draws from the
        client's own global-RNG state (`ClientRNG`), and L_gate (and L_div under div_outside_dp) is the step's
        public term. FedSEPT-PF (fusion=prompt) encodes a fused prompt per image inside its loss, so it
        trains client by client (`supports_batching`).

Variants (Table 4, Table 5): single (one full-dimensional shared prompt, no R, no router),
full_meps (A_m is L x w, no basis), wo_r (no residual), top1 (arg-max expert only), uniform
(pi = 1/M); fusion="prompt" is FedSEPT-PF, cache_text=False is FedSEPT-NC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, Needs, register_method, weighted_mean
from raysim.methods.families.prompt import ClientRNG, ClipPromptMethod, PromptClient, PromptLossParts, StepLoss
from raysim.methods.fedsept.fedsept_parts import (
    diversity_loss,
    expert_prompts,
    gate_loss,
    hard_top1,
    logit_fusion,
    make_router,
    prompt_fusion,
    public_basis,
)
from raysim.privacy.mechanisms import dpsgd

VARIANTS = ("full", "single", "full_meps", "wo_r", "top1", "uniform")


@dataclass
class FedSEPTOptions:
    experts: int = 4  # M
    rank: int = 16  # r
    lambda_div: float = 10.0
    # auto: sum without DP, mean under DP (docs/papers/fedsept.md "L_div under DP") | sum (paper Eq. 6,
    # Frobenius) | mean (official code)
    div_reduction: str = "auto"
    lambda_gate: float = 10.0  # 0 reproduces the official code (no L_gate)
    router: str = "pooled"  # pooled (official code: u is inert) | patch (attends over the image tokens)
    router_heads: int = 4
    router_dropout: float = 0.1
    variant: str = "full"  # full | single | full_meps | wo_r | top1 | uniform
    fusion: str = "logit"  # logit (Eq. 9) | prompt (FedSEPT-PF)
    cache_text: bool = True  # False = FedSEPT-NC: expert text features recomputed for every batch
    basis_seed: int = 1  # public seed of B0
    r_init: str = "zeros"  # zeros: R starts at 0 (SPEC 1.13.1, official) | phrase: at train.ctx_init's embeddings (like PromptFL)
    basis: str = "gaussian"  # gaussian: B0 ~ N(0, 0.02^2) (SPEC 1.2, the official code) | orthonormal: orthonormal rows (analysis)
    div_outside_dp: bool = False  # True: L_div's gradient added after DP-SGD's clipping and noise (it is data-independent)

    def validate(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        check(self.experts >= 1, f"fedsept.experts must be >= 1, got {self.experts}")
        check(self.rank >= 1, f"fedsept.rank must be >= 1, got {self.rank}")
        check(self.lambda_div >= 0, f"fedsept.lambda_div must be >= 0, got {self.lambda_div}")
        check(self.lambda_gate >= 0, f"fedsept.lambda_gate must be >= 0 (0 = the official code), got {self.lambda_gate}")
        check(self.div_reduction in ("auto", "sum", "mean"),
              f"fedsept.div_reduction must be auto, sum or mean, got {self.div_reduction!r}")
        check(self.router in ("pooled", "patch"), f"fedsept.router must be pooled or patch, got {self.router!r}")
        check(self.router_heads >= 1, f"fedsept.router_heads must be >= 1, got {self.router_heads}")
        check(0 <= self.router_dropout < 1, f"fedsept.router_dropout must be in [0, 1), got {self.router_dropout}")
        check(self.variant in VARIANTS, f"fedsept.variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        check(self.fusion in ("logit", "prompt"), f"fedsept.fusion must be logit or prompt, got {self.fusion!r}")
        check(self.r_init in ("zeros", "phrase"), f"fedsept.r_init must be zeros or phrase, got {self.r_init!r}")
        check(self.basis in ("gaussian", "orthonormal"), f"fedsept.basis must be gaussian or orthonormal, got {self.basis!r}")


@register_method
class FedSEPT(ClipPromptMethod):
    name = "fedsept"
    loss_weights = {"L_div": "lambda_div", "L_gate": "lambda_gate"}
    eval_ignores = ("router.probe",)  # inert in the official pooled router (one key per image: attention weight 1)
    averaged = ("A",)
    Options = FedSEPTOptions
    releases = {"A": dpsgd()}
    client_metrics = ("loss", "ce", "div", "gate")
    batched_context = "A"  # local_train is the step hooks below, which stack clients (but FedSEPT-PF)

    # -- the variant as structure ----------------------------------------------------------
    @property
    def div_reduction(self) -> str:
        """L_div's reduction in use: auto = the paper's sum without DP, the official code's mean under DP,
        where the sum's data-independent gradient (inside every clipped per-example loss) drowns the data."""
        if self.opts.div_reduction != "auto":
            return self.opts.div_reduction
        return "mean" if self.dp.enabled else "sum"

    @property
    def M(self) -> int:
        return 1 if self.opts.variant == "single" else self.opts.experts

    @property
    def low_rank(self) -> bool:  # SEM's basis; single and full_meps use full-dimensional experts
        return self.opts.variant not in ("single", "full_meps")

    @property
    def has_residual(self) -> bool:
        return self.opts.variant not in ("single", "wo_r")

    @property
    def has_router(self) -> bool:
        return self.M > 1 and self.opts.variant != "uniform"

    @property
    def patch_router(self) -> bool:
        return self.has_router and self.opts.router == "patch"

    def needs(self) -> Needs:  # the patch router reads the frozen image tower's tokens as well
        return Needs(input="features", tokens=self.patch_router)

    @property
    def supports_ctx_init(self) -> bool:  # type: ignore[override]
        """r_init=phrase starts the private residual from train.ctx_init (a public phrase: no privacy cost),
        so FedSEPT's first prompt A B0 + R is PromptFL's default first prompt plus A B0 (~1e-3)."""
        return self.has_residual and self.opts.r_init == "phrase"

    # -- frozen parts: the CLIP text side and the public basis -------------------------------
    def build_env(self, spec, *, role: str):
        env = super().build_env(spec, role=role)
        if self.patch_router and not env.token_dim:
            raise ConfigError(f"fedsept.router=patch: raysim cannot read image tokens from {spec.model.model}; use router=pooled")
        self.B0 = self.basis(env)
        return env

    def basis(self, env):
        """B0 (r, w) from the public seed (None for full-dimensional experts). Identical on every host."""
        if not self.low_rank:
            return None
        B0 = getattr(self, "B0", None)
        if B0 is None or B0.shape != (self.opts.rank, env.ctx_width) or B0.device != env.device:
            self.B0 = B0 = public_basis(self.opts.basis_seed, self.opts.rank, env.ctx_width, kind=self.opts.basis).to(env.device)
        return B0

    # -- server half -------------------------------------------------------------------------
    def init_shared(self, env, rng):
        cols = self.opts.rank if self.low_rank else env.ctx_width
        A = torch.randn(self.M * self.train.n_ctx, cols, generator=rng) * 0.02
        return {"A": A}

    def aggregate(self, env, shared, uploads, rng):
        # Eq. 12: A^m = sum_k n_k / sum_j n_j A_k^m for every expert m (the same weights for each m)
        return {"A": weighted_mean(uploads, "A")}

    # -- client half -------------------------------------------------------------------------
    def init_private(self, env, data: ClientData, rng):
        private = {}
        if self.has_residual:
            private["R"] = env.prompts.initial_context(rng) if self.supports_ctx_init else torch.zeros(self.train.n_ctx, env.ctx_width)
        if self.has_router:
            private["router"] = self._router(env, rng).state_dict()
        return private

    def _router(self, env, rng, state=None):
        o = self.opts
        dim = env.token_dim if self.patch_router else env.feature_dim  # SPEC 1.3: 768 for ViT-B/16 tokens
        router = make_router(dim, self.M, o.router_heads, o.router_dropout, o.router, rng)
        if state is not None:
            router.load_state_dict(state)
        return router.to(env.device)

    def route(self, router, feats):
        """Soft expert weights pi(x), (B, M): the router's (Eq. 7), or 1/M for the uniform variant."""
        if router is None:
            return torch.full((feats.shape[0], self.M), 1.0 / self.M, device=feats.device)
        return router(feats)

    def forward(self, env, A, R, router, feats, text=None, tokens=None):
        """Fused logits (B, C) and the soft routing weights. `text`: cached (M, C, D) expert text features;
        `tokens`: the images' (B, K, width) tokens, which the patch router reads instead of `feats`."""
        pi_soft = self.route(router, tokens.float() if self.patch_router else feats)
        pi = hard_top1(pi_soft) if self.opts.variant == "top1" else pi_soft
        P = expert_prompts(A, self.M, self.basis(env), R)  # Eq. 5
        if self.opts.fusion == "prompt":
            return prompt_fusion(env.prompts, env.logit_scale, feats, P, pi), pi_soft
        if text is None:
            text = env.prompts.text_features(P)  # (M, C, D) in one batched pass
        return logit_fusion(env.logit_scale, feats, text, pi), pi_soft  # Eq. 9

    def supports_batching(self) -> bool:
        """Every variant stacks but FedSEPT-PF (fusion=prompt): it encodes a fused prompt per image inside its
        loss, so a stack would share no text-tower forward; it trains client by client."""
        return self.opts.fusion != "prompt" and super().supports_batching()

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        return self.stacked_local_train(env, shared, private, data, rng=rng, privacy=privacy)  # the steps below

    # the local round (ClipPromptMethod.train_clients, one client or a stack): A from the broadcast, R and the
    # router private; the router's dropout draws from the client's own global RNG, seeded after the router is
    # built and before any batch is drawn
    def step_start(self, env, shared, private, rng: torch.Generator) -> PromptClient:
        A = shared["A"].clone().to(env.device).requires_grad_(True)
        R = {"R": private["R"].clone().to(env.device).requires_grad_(True)} if self.has_residual else {}
        router = {"router": self._router(env, rng, private["router"]).train()} if self.has_router else {}
        return PromptClient({"A": A}, R, router, no_decay=("router",), rng=ClientRNG(rng), fixed={"B0": self.basis(env)})

    def step_contexts(self, c: PromptClient) -> Tensor:
        """The M expert prompts A_m B0 + R (Eq. 5); none under prompt fusion, which encodes them per image."""
        P = expert_prompts(c.dp["A"], self.M, c.fixed["B0"], c.local.get("R"))
        return P[:0] if self.opts.fusion == "prompt" else P

    def step_loss(self, env, c: PromptClient, text: Tensor, x: Tensor, y: Tensor, *, tokens: Optional[Tensor] = None) -> StepLoss:
        o = self.opts
        A, router = c.dp["A"], c.modules.get("router")
        assert tokens is not None or not self.patch_router  # needs() asks for the image tokens with the patch router
        logits, pi = self.forward(env, A, c.local.get("R"), router, x, text if o.fusion == "logit" else None, tokens)
        ce = F.cross_entropy(logits, y, reduction="none")
        div = o.lambda_div * diversity_loss(A, self.M, self.div_reduction)
        # L_gate: the router's own loss (not privatised), its gradient added after clipping
        gate = o.lambda_gate * gate_loss(pi) if router is not None and o.lambda_gate > 0 and len(y) else None
        terms = {"ce": float(ce.detach().mean()), "div": float(div.detach()), "gate": float(gate.detach()) if gate is not None else 0.0}
        terms["loss"] = terms["ce"] + terms["div"]
        if o.div_outside_dp:  # L_div is a function of A only: added after clipping and noise
            return StepLoss(ce, div if gate is None else div + gate, terms)
        return StepLoss(ce + div, gate, terms)  # L_div per sample, before clipping (Eq. 11)

    def predictor(self, env, shared, private, data=None):
        """The evaluated model: global A with the client's own R and router (SPEC 1.8)."""
        A = shared["A"].to(env.device)
        R = private["R"].to(env.device) if self.has_residual else None
        router = None
        if self.has_router:
            router = self._router(env, torch.Generator(), private["router"]).eval().requires_grad_(False)
        text = None
        if self.opts.fusion == "logit" and self.opts.cache_text:  # computed once, reused for every batch
            with torch.no_grad():
                text = env.prompts.text_features(expert_prompts(A, self.M, self.basis(env), R))

        @torch.no_grad()
        def predict(feats, tokens=None):
            tokens = None if tokens is None else tokens.to(env.device)
            return self.forward(env, A, R, router, feats.to(env.device), text, tokens)[0]

        return predict

    def loss_parts(self, env, private) -> PromptLossParts:
        """The loss split at the expert text features, for the gradient-inversion attack (pooled router)."""
        if self.patch_router:
            raise ConfigError("gradient inversion reads pooled image features only; attack a run with fedsept.router=pooled")
        o = self.opts
        R = private["R"].to(env.device) if self.has_residual else None
        router = self._router(env, torch.Generator(), private["router"]).eval().requires_grad_(False) if self.has_router else None
        return PromptLossParts(
            "A",
            lambda A: env.prompts.text_features(expert_prompts(A, self.M, self.basis(env), R)),
            lambda A, T, feats: self.forward(env, A, R, router, feats, T)[0],
            lambda A: o.lambda_div * diversity_loss(A, self.M, self.div_reduction),
            separable=o.fusion == "logit",  # FedSEPT-PF fuses prompts per image: no image-free text features
            text_state=() if R is None else (R,),
        )
