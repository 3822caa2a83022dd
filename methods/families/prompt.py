"""What the CLIP prompt-tuning methods (FedSEPT and its baselines, zeroshot) share: the base that builds the
frozen CLIP env and computes s * <v(x), t_c>, the local round of a method described by step hooks (one client,
or a client-batched stack: PromptFL, DP-FPL, FedPGP, FedOTP, pFedMoAP, FedSEPT, FedPHA), the attack
hook's loss split, the prompt optimiser of SPEC 1.7, a seeded block for dropout and nn init, and a client's
own global-RNG state (`ClientRNG`: its dropout draws, the same alone or in a stack)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Iterator, Optional, Sequence, TypeVar, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.methods.base import ClientData, EnvSpec, LocalResult, Method, carried_optimizer

Contexts = Union[Tensor, tuple[Tensor, ...]]  # what step_contexts returns: (n, L, w) contexts, or several of other lengths
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
    # A method whose local step is "SGD on tensors started from the broadcast and private state, a loss on the
    # text features of some contexts built from them, batches drawn from rng" sets `batched_context` (the name of
    # its uploaded context) and describes its step with the hooks below; its `local_train` is then `train_clients`
    # for one client and the host may train the clients it holds in one stack with `batched_local_train`, the
    # same loop for a stack. The default hooks are PromptFL's step: one context, CE on s <v(x), t_c(ctx)>.
    batched_context: ClassVar[str] = ""
    # True: a stack's forward is CoOpPrompts.text_features over all its contexts, each client's rows computed as its
    # own forward computes them (bitwise client by client without DP), instead of the faster shared-prefix forward
    stack_full_forward: bool = False

    def shares_optimizer_state(self) -> bool:
        """train.optimizer_state=shared is honoured where the local round is `train_clients` (the step hooks): its one
        SGD starts from the carried state and leaves its own in it (`OptimizerCarry`)."""
        return not self.trains or ClipPromptMethod.supports_batching(self)

    def supports_batching(self) -> bool:
        """True when `batched_local_train` is this method's local_train, stacked: `batched_context` is set by the
        class that also defines `local_train` (a subclass that overrides local_train trains client by client)."""
        if not self.batched_context:
            return False
        owner = next(c for c in type(self).__mro__ if "batched_context" in vars(c))
        return type(self).local_train is vars(owner).get("local_train")

    def step_start(self, env, shared: dict[str, Tensor], private: dict[str, Any], rng: torch.Generator) -> "PromptClient":
        """A client's trained tensors at the start of its round: the uploaded ones (privatised by DP-SGD) from
        the broadcast, the private ones (plain gradient, SPEC 1.6) from its private state. Draws from `rng`
        (before any batch is drawn from it) as the client's round would at its start."""
        return PromptClient({self.batched_context: _leaf(shared[self.batched_context], env)}, {})

    def step_contexts(self, c: "PromptClient") -> "Contexts":
        """The (n, L, w) contexts whose text features a step of client c reads (one forward for a stack; n = 0:
        none, the method encodes its prompts inside step_loss), or a tuple of such tensors of different lengths
        L (FedPHA: one forward per length for a stack, with `step_prompts(env, L)`)."""
        return c.dp[self.batched_context][None]

    def step_prompts(self, env, length: int):
        """The CoOpPrompts that encode contexts of `length` tokens: env.prompts (a method whose contexts have
        lengths other than train.n_ctx says which prompts encode each: FedPHA)."""
        return env.prompts

    def step_unused(self, c: "PromptClient") -> Optional[Tensor]:
        """Contexts a reference code encodes at every step without reading them (their cost, no gradient)."""
        return None

    def step_loss(self, env, c: "PromptClient", text: Any, x: Tensor, y: Tensor, *, tokens: Optional[Tensor] = None) -> "StepLoss":
        """Client c's loss on its batch (x, y) given the (n, C, D) text features of `step_contexts(c)` (a tuple
        of them where it returns a tuple); `tokens`:
        the batch's image tokens when the method needs them (`needs().tokens`), else None. Runs under the
        client's own global RNG (`PromptClient.rng`) when it has one."""
        loss = F.cross_entropy(self.logits(env, x, text[0]), y, reduction="none")
        return StepLoss(loss, None, {"loss": loss.detach().mean()})

    def step_epoch_end(self, env, c: "PromptClient", rng: torch.Generator) -> None:
        """After the last batch of each local epoch (DP-FPL re-factorises its private prompt here)."""

    def step_private(self, c: "PromptClient") -> dict[str, Any]:
        """What client c's round writes into its private state: its private tensors, and the state_dict of each
        private module under the module's name (pFedMoAP adds the context it uploaded)."""
        return {**{n: t.detach().cpu() for n, t in c.local.items()},
                **{n: {k: v.detach().cpu() for k, v in m.state_dict().items()} for n, m in c.modules.items()}}

    def batched_local_train(self, env, shared: dict[str, Tensor], jobs: Sequence[ClientJob], *, privacy) -> list[LocalResult]:
        """`local_train` of several clients at once: `train_clients` with one text-tower forward per step (and
        context length) over the stacked contexts of the clients that still have batches (A x n contexts, the
        shared CoOp prefix computed once per context: raysim/models/shared_prefix.py; `stack_full_forward`
        takes the full forward instead),
        and one `privacy.backward` (raysim/engine/batched.py StackPrivacy) that gives every client the gradient
        (or DP-SGD step, with its own clipping and noise) of its own loss alone. Equal to `local_train` client
        by client up to float reassociation."""
        from raysim.models.shared_prefix import stacked_text_features  # the prefix shared by a context's C prompts, once

        forward = full_forward if self.stack_full_forward else stacked_text_features
        return self.train_clients(env, shared, jobs, privacy, forward)

    def train_clients(self, env, shared: dict[str, Tensor], jobs: Sequence[ClientJob], privacy,
                      forward: Callable[[Any, Tensor], Tensor]) -> list[LocalResult]:
        """The local round of the step the hooks describe, for the clients `jobs` side by side: each client k has
        its own tensors (from the broadcast and its private state), batches (drawn from its own rng an epoch at a
        time, as client by client, since `step_epoch_end` may draw from it too) and SGD state. Per step, one
        `forward` of the stacked contexts of the clients that still have batches, each client's `step_loss` on
        its own batch, one `privacy.backward`; clients with fewer batches drop out when they are done (contexts of
        several lengths: one `forward(prompts, contexts)` per length, `_encode`). `privacy` is a StackPrivacy, or
        `OneClient` around a client's own handle (`local_train`)."""
        cs = [self.step_start(env, shared, j.private, j.rng) for j in jobs]
        opt = sgd([g for c in cs for g in c.groups()], self.train)  # SGD is elementwise per tensor: per client in effect
        carry = carried_optimizer()  # train.optimizer_state=shared: the previous client's SGD state (the host's, one client a call)
        if carry is not None:
            assert len(jobs) == 1, "a carried SGD state goes from one client to the next: no stacks"
            carry.load_into(opt)
        ys = [j.data.y_train.to(env.device) for j in jobs]
        steps = [self._steps(privacy, k, j) for k, j in enumerate(jobs)]
        xs: list[dict[int, tuple[Tensor, Optional[Tensor]]]] = [{} for _ in jobs]  # an epoch's (features, tokens)
        terms: list[dict[str, list[float]]] = [{} for _ in jobs]
        now = [next(s, None) for s in steps]
        while any(n is not None for n in now):
            active = [k for k, n in enumerate(now) if n is not None]
            text = self._encode(env, [self.step_contexts(cs[k]) for k in active], forward)
            unused = [u for u in (self.step_unused(cs[k]) for k in active) if u is not None]
            if unused:
                with torch.no_grad():
                    self._encode(env, unused, forward)
            parts = []
            for a, k in enumerate(active):
                epoch, idx, _ = cast(tuple[int, Tensor, bool], now[k])  # active: not None
                if epoch not in xs[k]:  # this epoch's features (a drawn augmented view per image under data.augment)
                    x, tok = jobs[k].data.train_inputs(epoch)  # tok: None unless needs().tokens
                    xs[k] = {epoch: (x.to(env.device), tok)}
                x, tok = xs[k][epoch]
                with cs[k].own_rng():
                    parts.append(self.step_loss(env, cs[k], text[a], x[idx], ys[k][idx],
                                                tokens=None if tok is None else tok[idx].to(env.device)))
            opt.zero_grad(set_to_none=True)  # clients out of the stack keep grad None: SGD skips them
            privacy.backward(active, [p.loss for p in parts], [cs[k].dp for k in active],
                             [cs[k].others() for k in active], [p.public for p in parts])
            opt.step()
            for k, p in zip(active, parts):
                if len(p.loss):  # a Poisson batch may be empty (a noise-only step)
                    for name, v in p.terms.items():
                        terms[k].setdefault(name, []).append(float(v))
                if cast(tuple[int, Tensor, bool], now[k])[2]:  # the epoch's last batch
                    self.step_epoch_end(env, cs[k], jobs[k].rng)
                now[k] = next(steps[k], None)
        if carry is not None:
            carry.take_from(opt)
        names = self.client_metrics or ("loss",)
        new = [self.step_private(c) for c in cs]
        return [LocalResult(upload={n: t.detach().cpu() for n, t in c.dp.items()},
                            private={**j.private, **mine} if mine else j.private,
                            num_samples=j.data.num_train,
                            metrics={n: sum(ts.get(n, [])) / max(1, len(ts.get(n, []))) for n in names})
                for c, j, ts, mine in zip(cs, jobs, terms, new)]

    def _encode(self, env, ctxs: Sequence["Contexts"], forward: Callable[[Any, Tensor], Tensor]) -> list["Contexts"]:
        """The text features of the clients' contexts, each in the shape of its contexts (a tensor, or a tuple):
        one `forward` per context length over the stack (the contexts of that length concatenated in order,
        encoded with `step_prompts(env, length)` and split back). Contexts of one length (every method but
        FedPHA): one forward over all of them. No contexts (n = 0): returned as they are."""
        parts = [list(c) if isinstance(c, (tuple, list)) else [c] for c in ctxs]
        flat = [t for p in parts for t in p]
        out: list[Tensor] = list(flat)
        for length in dict.fromkeys(int(t.shape[-2]) for t in flat):  # the lengths in order of first appearance
            at = [i for i, t in enumerate(flat) if int(t.shape[-2]) == length]
            both = torch.cat([flat[i] for i in at])
            if len(both):
                for i, f in zip(at, forward(self.step_prompts(env, length), both).split([len(flat[i]) for i in at])):
                    out[i] = f
        it = iter(out)
        return [tuple(next(it) for _ in p) if isinstance(c, (tuple, list)) else next(it) for c, p in zip(ctxs, parts)]

    def _steps(self, privacy, k: int, job: ClientJob) -> Iterator[tuple[int, Tensor, bool]]:
        """Client k's steps (epoch, batch, last of its epoch), each epoch's batches drawn when it begins."""
        for epoch in range(self.train.local_epochs):
            batches = list(privacy.batches(k, job.data.num_train, self.train.batch_size, job.rng))
            for i, idx in enumerate(batches):
                yield epoch, idx, i == len(batches) - 1

    def stacked_local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        """`local_train` of a method whose step the hooks describe: `train_clients` for this client alone, with
        the full text-tower forward and its own privacy handle."""
        return self.train_clients(env, shared, [ClientJob(private, data, rng)], OneClient(privacy), full_forward)[0]


@dataclass
class PromptClient:
    """One client's trained tensors in a local round (`ClipPromptMethod.train_clients`): `dp`, the uploaded ones
    (DP-SGD's dp_params); `local`, its private ones, and `modules`, its private nn.Modules (pFedMoAP's gating
    head, FedSEPT's router), which take the plain gradient (other_params) and return updated in its private
    state (`step_private`: a module's state_dict under its name). `no_decay`: the modules whose parameters
    train without weight decay (their own SGD param group). `rng`: the client's own global-RNG state (its
    dropout draws), active around its `step_loss`; None: the step draws nothing from the global RNG.
    `fixed`: what else its steps read, fixed for the round (pFedMoAP's expert text features)."""

    dp: dict[str, Tensor]
    local: dict[str, Tensor]
    modules: dict[str, nn.Module] = field(default_factory=dict)
    no_decay: tuple[str, ...] = ()
    rng: Optional["ClientRNG"] = None
    fixed: dict[str, Any] = field(default_factory=dict)

    def others(self) -> list[Tensor]:
        """The tensors that take the plain gradient (privacy.backward's other_params)."""
        return [*self.local.values(), *(p for m in self.modules.values() for p in m.parameters())]

    def groups(self) -> list[dict[str, Any]]:
        """The client's SGD param groups: its tensors, then each private module (weight decay 0 if in no_decay)."""
        out: list[dict[str, Any]] = [{"params": [*self.dp.values(), *self.local.values()]}]
        for name, m in self.modules.items():
            out.append({"params": list(m.parameters()), **({"weight_decay": 0.0} if name in self.no_decay else {})})
        return out

    def own_rng(self) -> contextlib.AbstractContextManager:
        return self.rng.active() if self.rng is not None else contextlib.nullcontext()


@dataclass
class StepLoss:
    """One client's loss at one step: per example (`loss`, what DP-SGD clips), a data-independent `public` term
    (its gradient joins after clipping and noise; None: none) and the metrics to log (means over the steps)."""

    loss: Tensor
    public: Optional[Tensor]
    terms: dict[str, Any]  # floats or 0-d tensors


class OneClient:
    """A client's own privacy handle in StackPrivacy's shape, for `train_clients` of one client."""

    def __init__(self, privacy) -> None:
        self.privacy = privacy

    def batches(self, k: int, n: int, batch_size: int, rng: torch.Generator):
        return self.privacy.batches(n, batch_size, rng)

    def backward(self, clients, losses, dp_params, other_params, public_loss) -> None:
        self.privacy.backward(losses[0], dp_params=dp_params[0], other_params=other_params[0], public_loss=public_loss[0])


def full_forward(prompts, ctx: Tensor) -> Tensor:
    """The full text-tower forward of contexts ctx (A, L, w) through CoOp prompts of L placeholders: (A, C, D)."""
    return prompts.text_features(ctx)


def _leaf(t: Tensor, env) -> Tensor:
    return t.clone().to(env.device).requires_grad_(True)


# -- reproducibility -------------------------------------------------------------------------

@contextlib.contextmanager
def seeded(rng: torch.Generator) -> Iterator[None]:
    """Run a block (dropout, nn init) on a global RNG seeded from `rng`, restoring the global state after."""
    seed = int(torch.randint(0, 2**62, (1,), generator=rng).item())
    with torch.random.fork_rng(devices=_devices()):
        torch.manual_seed(seed)
        yield


class ClientRNG:
    """A client's own global-RNG state, for what torch draws from the global RNG (dropout): seeded from `rng`
    as `seeded` seeds it (one draw from `rng`, now), then swapped in around each of the client's blocks
    (`active`) and saved after, so the client's draws are the same as one `seeded` block around its whole
    round, whichever other clients' blocks run in between (client-batched stacks)."""

    def __init__(self, rng: torch.Generator) -> None:
        with seeded(rng):
            self.state = _rng_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=_devices()):
            torch.set_rng_state(self.state[0])
            if self.state[1] is not None:
                torch.cuda.set_rng_state(self.state[1])
            yield
            self.state = _rng_state()


def _devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


def _rng_state() -> tuple[Tensor, Optional[Tensor]]:
    """The global CPU RNG state and the current CUDA device's (None without CUDA)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
