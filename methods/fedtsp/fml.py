"""FML, Federated Mutual Learning (Shen et al. 2020), on the heterogeneous client zoo (SPEC 2.9: alpha = beta = 0.5).

Client   Its own zoo model ("local", private) and a copy of the global "meme" model (one small architecture
         for every client, `SharedSmallModel` of methods/families/homogeneous.py) learn from each other, deep-mutual-learning style,
         on every mini-batch:
             L_local = alpha * CE(z_local, y) + (1 - alpha) * KL(p_meme || p_local)
             L_meme  = beta  * CE(z_meme, y)  + (1 - beta)  * KL(p_local || p_meme)
         p = softmax(z); in each KL the other model's distribution is the (fixed) target, and KL is the
         batch mean of sum_c p_c log(p_c / q_c). Plain SGD at the client lr for both, fresh each round, the
         gradient of each model clipped to norm `clip_grad` (HtFLlib's 10). Uploads the trained meme model.
Server   meme <- the average of the uploaded meme models (uniform 1/K as HtFLlib, or sample-weighted).
Eval     Each client's own model (its private head), as HtFLlib's clientFML.test_metrics.
Uploads  only the meme model, as an update() release (dp.level=client; dp.level=sample is refused: the
         meme model distils from the private model, so DP-SGD on it would not be sample-level DP).

HtFLlib quirk (`htfllib_kl=true`): nn.KLDivLoss() with its default reduction averages over batch *and*
classes (the KL is divided by C), and the target softmax is not detached, so each model also receives the
gradient of the other's KL term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.homogeneous import SharedOptions, SharedSmallModel, clip_grads, flatten_state, mean_metrics, validate_shared
from raysim.methods.families.zoo import snapshot
from raysim.privacy.mechanisms import update


@dataclass
class Options(SharedOptions):
    alpha: float = 0.5  # weight of the local model's CE (1 - alpha: its KL to the meme model)
    beta: float = 0.5  # weight of the meme model's CE (1 - beta: its KL to the local model)
    clip_grad: float = 10.0  # per-model gradient-norm clip (HtFLlib); 0 = off
    htfllib_kl: bool = False  # reproduce HtFLlib's KL: mean over batch x classes, gradient through the target

    def validate(self) -> None:
        validate_shared(self, "fml")
        if not (0.0 <= self.alpha <= 1.0 and 0.0 <= self.beta <= 1.0):
            raise ConfigError("fml.alpha and fml.beta are mixing weights: each must be in [0, 1]")
        if self.clip_grad < 0:
            raise ConfigError("fml.clip_grad must be >= 0 (0 = no clipping)")


def kl_to(logits: Tensor, target_logits: Tensor, *, detach: bool = True, reduction: str = "batchmean") -> Tensor:
    """KL(softmax(target) || softmax(logits)): how far this model's distribution is from the target's."""
    target = F.softmax(target_logits.detach() if detach else target_logits, dim=1)
    if reduction == "mean":  # nn.KLDivLoss()'s default: the sum over batch and classes / (N C)
        return F.kl_div(F.log_softmax(logits, dim=1), target, reduction="sum") / logits.numel()
    return F.kl_div(F.log_softmax(logits, dim=1), target, reduction=reduction)


def mutual_losses(z_local: Tensor, z_meme: Tensor, y: Tensor, alpha: float, beta: float, *, htfllib: bool = False) -> dict[str, Tensor]:
    """The two deep-mutual-learning objectives and their parts."""
    detach, reduction = not htfllib, "mean" if htfllib else "batchmean"
    ce, ce_meme = F.cross_entropy(z_local, y), F.cross_entropy(z_meme, y)
    kl = kl_to(z_local, z_meme, detach=detach, reduction=reduction)
    kl_meme = kl_to(z_meme, z_local, detach=detach, reduction=reduction)
    return {
        "local": alpha * ce + (1 - alpha) * kl,
        "meme": beta * ce_meme + (1 - beta) * kl_meme,
        "ce": ce, "kl": kl, "ce_meme": ce_meme, "kl_meme": kl_meme,
    }


@register_method
class FML(SharedSmallModel):
    name = "fml"
    loss_weights = {"local CE": "alpha", "meme CE": "beta"}
    eval_ignores = ("weights",)  # the local model predicts; the meme model only teaches
    Options = Options
    releases = {"weights": update()}  # the meme model only: private only as a user-level update (dp.level=client)
    client_metrics = ("loss", "ce", "kl", "ce_meme", "kl_meme")

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.model(env, private)
        meme = self.shared_module(env, shared["weights"])
        model.train()
        meme.train()
        opt = torch.optim.SGD(model.parameters(), lr=self.client_lr)
        opt_meme = torch.optim.SGD(meme.parameters(), lr=self.client_lr)
        parts: dict[str, list[float]] = {k: [] for k in self.client_metrics}
        for x, y in self.batches(env, data, rng):
            out = mutual_losses(model(x)[1], meme(x)[1], y, self.opts.alpha, self.opts.beta, htfllib=self.opts.htfllib_kl)
            opt.zero_grad(set_to_none=True)
            opt_meme.zero_grad(set_to_none=True)
            # each model's parameters get the gradient of its own objective (the targets are detached);
            # under htfllib_kl the targets are not, and both objectives reach both models, as in HtFLlib
            (out["local"] + out["meme"]).backward()
            clip_grads((model, meme), self.opts.clip_grad)
            opt.step()
            opt_meme.step()
            parts["loss"].append(float(out["local"].detach()))
            for k in ("ce", "kl", "ce_meme", "kl_meme"):
                parts[k].append(float(out[k].detach()))
        return LocalResult(
            upload={"weights": flatten_state(meme.state_dict())},
            private={**private, "model": snapshot(model)},
            num_samples=data.num_train,
            metrics=mean_metrics(parts),
        )
