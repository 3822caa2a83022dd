"""Pieces several methods share: FedAvg-style weighted means, the CLIP prompt-tuning base, optimisers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch
from torch import Tensor

from raysim.methods.base import EnvSpec, Method, Upload

ParamOrGroup = TypeVar("ParamOrGroup", Tensor, dict[str, Any])  # what torch.optim takes: tensors, or param groups


def weighted_mean(uploads: Sequence[Upload], key: str) -> Tensor:
    """sum_k n_k x_k / sum_k n_k over the uploads (in the order given: client-id order)."""
    total = float(sum(u.num_samples for u in uploads))
    out = torch.zeros_like(uploads[0].tensors[key], dtype=torch.float32)
    for u in uploads:
        out += u.tensors[key].float() * (u.num_samples / total)
    return out


def sgd(params: Iterable[ParamOrGroup], train, **overrides) -> torch.optim.Optimizer:
    """The prompt-tuning optimiser of SPEC 1.7: SGD with momentum and weight decay, fresh per round."""
    kw = dict(lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    kw.update(overrides)
    return torch.optim.SGD(list(params), **kw)


@dataclass
class PromptLossParts:
    """A prompt method's loss split at its text features, the hook the gradient-inversion attack calls:
    text(theta) -> T (no image in it), then head(theta, T, features) -> logits; `separable` when head
    reads theta only through T. `name`: the uploaded tensor theta is; `text_state`: the client's private
    tensors `text` reads besides theta (FedSEPT's R); `regulariser`: the data-independent loss on theta."""

    name: str
    text: Callable[[Tensor], Tensor]
    head: Callable[[Tensor, Tensor, Tensor], Tensor]
    regulariser: Callable[[Tensor], Tensor]
    separable: bool
    text_state: tuple[Tensor, ...] = ()


class ClipPromptMethod(Method):
    """Base of the CLIP prompt-tuning methods: clients see frozen image features, the env holds the
    frozen text tower and the CoOp prompts, and logits are s * <v(x), t_c> (SPEC 1.1)."""

    supports_ctx_init = False  # True for methods that learn one CoOp context (they start it from ctx_init)

    def build_env(self, spec: EnvSpec, *, role: str):
        from raysim.models.clip import build_clip_env

        ctx_init = self.train.ctx_init if self.supports_ctx_init else ""
        return build_clip_env(spec.model, spec.classnames, self.train.n_ctx, device=spec.device, ctx_init=ctx_init)

    @staticmethod
    def logits(env, image_features: Tensor, text_features: Tensor) -> Tensor:
        return env.logit_scale * image_features @ text_features.t()

    def loss_parts(self, env, private) -> PromptLossParts:
        """The attack hook (attacks/gradient_inversion.py); methods that upload a prompt declare it."""
        from raysim.errors import ConfigError

        raise ConfigError(f"{self.name} does not declare loss_parts, so gradient inversion cannot attack it")
