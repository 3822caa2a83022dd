"""What the CLIP prompt-tuning methods (FedSEPT and its baselines, zeroshot) share: the base that builds the
frozen CLIP env and computes s * <v(x), t_c>, the client-batched round of a one-context method, the attack
hook's loss split, the prompt optimiser of SPEC 1.7 and a seeded block for dropout and nn init."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Iterator, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.methods.base import ClientData, EnvSpec, LocalResult, Method

ParamOrGroup = TypeVar("ParamOrGroup", Tensor, dict[str, Any])  # what torch.optim takes: tensors, or param groups


def sgd(params: Iterable[ParamOrGroup], train, **overrides) -> torch.optim.Optimizer:
    """The prompt-tuning optimiser of SPEC 1.7: SGD with momentum and weight decay, fresh per round."""
    kw = dict(lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    kw.update(overrides)
    return torch.optim.SGD(list(params), **kw)


@dataclass
class ClientJob:
    """One client of a client-batched round (`ClipPromptMethod.batched_local_train`): what its `local_train`
    would receive besides env, shared and privacy."""

    private: dict[str, Any]
    data: ClientData
    rng: torch.Generator


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

    # -- client-batched local training (execution.batch_clients; the host's side is raysim/engine/batched.py) ------
    # A method whose `local_train` is exactly "SGD from the broadcast value of its one uploaded context by CE on
    # s <v(x), t_c(ctx)>, the batches drawn from rng and nothing else, private state untouched" (PromptFL) names
    # that upload here; the host may then train the clients it holds in one stack with `batched_local_train`.
    batched_context: ClassVar[str] = ""

    def supports_batching(self) -> bool:
        """True when `batched_local_train` is this method's local_train, stacked: `batched_context` is set by the
        class that also defines `local_train` (a subclass that overrides local_train trains client by client)."""
        if not self.batched_context:
            return False
        owner = next(c for c in type(self).__mro__ if "batched_context" in vars(c))
        return type(self).local_train is vars(owner).get("local_train")

    def batched_local_train(self, env, shared: dict[str, Tensor], jobs: Sequence[ClientJob], *, privacy) -> list[LocalResult]:
        """`local_train` of several clients at once. Each client k has its own context ctx_k (from the broadcast
        value), batches (from its own rng) and SGD state; per step, one text-tower forward over the stacked
        contexts of the clients that still have batches (A x C prompts), each client's CE on its own batch, and
        one `privacy.backward` (raysim/engine/batched.py StackPrivacy) that gives every client the gradient (or DP-SGD
        step, with its own clipping and noise) of its own loss alone. Clients with fewer batches drop out of
        the stack when they are done. The forward computes each context's prompt prefix once for its C classes
        (raysim/models/shared_prefix.py). Equal to `local_train` client by client up to float reassociation."""
        from raysim.models.shared_prefix import stacked_text_features  # the prefix shared by a context's C prompts, once

        name = self.batched_context
        ctxs = [shared[name].clone().to(env.device).requires_grad_(True) for _ in jobs]
        opt = sgd(ctxs, self.train)  # SGD is elementwise per tensor (momentum, weight decay): one per client in effect
        E = self.train.local_epochs
        xs = [[j.data.train_inputs(e)[0].to(env.device) for e in range(E)] for j in jobs]  # each epoch's features (data.augment)
        ys = [j.data.y_train.to(env.device) for j in jobs]
        plans = [[(e, idx) for e in range(E) for idx in privacy.batches(k, j.data.num_train, self.train.batch_size, j.rng)]
                 for k, j in enumerate(jobs)]  # the rng draws only batches, so drawing them first changes nothing
        losses: list[list[float]] = [[] for _ in jobs]
        for step in range(max((len(p) for p in plans), default=0)):
            active = [k for k, p in enumerate(plans) if step < len(p)]
            text = stacked_text_features(env.prompts, torch.stack([ctxs[k] for k in active]))  # (A, C, D), one forward
            per_client = [F.cross_entropy(self.logits(env, xs[k][plans[k][step][0]][plans[k][step][1]], text[a]),
                                          ys[k][plans[k][step][1]], reduction="none") for a, k in enumerate(active)]
            opt.zero_grad(set_to_none=True)  # clients out of the stack keep grad None: SGD skips them
            privacy.backward(active, per_client, [{name: ctxs[k]} for k in active])
            opt.step()
            for k, loss in zip(active, per_client):
                if len(loss):  # a Poisson batch may be empty (a noise-only step)
                    losses[k].append(loss.mean().item())
        return [LocalResult(upload={name: ctx.detach().cpu()}, private=j.private, num_samples=j.data.num_train,
                            metrics={"loss": sum(ls) / max(1, len(ls))}) for ctx, j, ls in zip(ctxs, jobs, losses)]


# -- reproducibility -------------------------------------------------------------------------

@contextlib.contextmanager
def seeded(rng: torch.Generator) -> Iterator[None]:
    """Run a block (dropout, nn init) on a global RNG seeded from `rng`, restoring the global state after."""
    seed = int(torch.randint(0, 2**62, (1,), generator=rng).item())
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
