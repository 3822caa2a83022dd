"""Zero-shot CLIP: no training and no communication; each class is scored against the frozen text
feature of a hand-written prompt ("a photo of a {class}."). The reference every prompt-tuning
method must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.prompt import ClipPromptMethod


@dataclass
class ZeroShotOptions:
    template: str = "a photo of a {}."


@register_method
class ZeroShot(ClipPromptMethod):
    name = "zeroshot"
    Options = ZeroShotOptions
    releases = {}  # nothing leaves a client
    trains = False  # nothing is learnt
    global_predictor = True  # the frozen CLIP, the same for every client
    client_metrics = ()

    def init_shared(self, env, rng):
        return {}

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        return LocalResult(upload={}, private=private, num_samples=data.num_train)

    def aggregate(self, env, shared, uploads, rng):
        return {}

    def predictor(self, env, shared, private, data=None):
        with torch.no_grad():
            text = env.tower.encode_texts([self.opts.template.format(c.replace("_", " ")) for c in env.classnames])
        return lambda feats: self.logits(env, feats.to(env.device), text)
