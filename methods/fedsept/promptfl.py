"""PromptFL (Guo et al.): every client learns the same CoOp context vectors; the server averages them.

Client: CE on s * cos(v(x), t_c(ctx)); DP-SGD (when on) privatises ctx, the only uploaded tensor.
Server: FedAvg of ctx weighted by the clients' sample counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.prompt import ClipPromptMethod, PromptLossParts, sgd
from raysim.privacy.mechanisms import dpsgd


@register_method
class PromptFL(ClipPromptMethod):
    name = "promptfl"
    averaged = ("ctx",)
    releases = {"ctx": dpsgd()}
    global_predictor = True  # every client predicts with the broadcast context
    supports_ctx_init = True
    batched_context = "ctx"  # local_train below is ClipPromptMethod's stackable step: the host may batch clients

    def init_shared(self, env, rng):
        return {"ctx": env.prompts.initial_context(rng)}

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        ctx = shared["ctx"].clone().to(env.device).requires_grad_(True)
        opt = sgd([ctx], self.train)
        y = data.y_train.to(env.device)
        losses = []
        for epoch in range(self.train.local_epochs):
            x = data.train_inputs(epoch)[0].to(env.device)  # this epoch's features (a drawn augmented view per image under data.augment)
            for idx in privacy.batches(data.num_train, self.train.batch_size, rng):
                text = env.prompts.text_features(ctx)
                loss = F.cross_entropy(self.logits(env, x[idx], text), y[idx], reduction="none")
                opt.zero_grad(set_to_none=True)
                privacy.backward(loss, dp_params={"ctx": ctx})
                opt.step()
                if len(idx):  # a Poisson batch may be empty (a noise-only step)
                    losses.append(loss.mean().item())
        return LocalResult(
            upload={"ctx": ctx.detach().cpu()},
            private=private,
            num_samples=data.num_train,
            metrics={"loss": sum(losses) / max(1, len(losses))},
        )

    def aggregate(self, env, shared, uploads, rng):
        return {"ctx": weighted_mean(uploads, "ctx")}

    def predictor(self, env, shared, private, data=None):
        with torch.no_grad():
            text = env.prompts.text_features(shared["ctx"].to(env.device))
        return lambda feats: self.logits(env, feats.to(env.device), text)

    def loss_parts(self, env, private) -> PromptLossParts:
        return PromptLossParts("ctx", env.prompts.text_features, lambda ctx, T, feats: self.logits(env, feats, T),
                               lambda ctx: ctx.sum() * 0, separable=True)
