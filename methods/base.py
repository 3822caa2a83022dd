"""The method protocol: a federated method is its client half and its server half, nothing else.

The engine owns orchestration, sampling, DP accounting, evaluation and I/O. A method receives:

- `env`: the frozen parts built once per host (a CLIP text tower and prompt builder, a PLM, ...),
- `shared`: the global state the server broadcasts (tensors only),
- `private`: the client's private state (anything torch.save can store); it never leaves the client,
- `data`: the client's `ClientData`,
- `rng`: a `torch.Generator` seeded for this (round, client) stream,
- `privacy`: a `PrivacyHandle` (privacy/host.py): the epoch's batches, DP-SGD on the named upload tensors,
  and the prototype / embedding releases the host computes; the host checks and accounts every upload.

`releases` declares, by name, every tensor a client may send and how it is released
(privacy/mechanisms.py: dpsgd, update, prototype, embedding, public); `uploads` is its tuple of names.
The engine refuses anything undeclared, and under DP anything not privatised by its declared release.
`needs()` declares what the method needs from the engine (input kind and size, image tokens, class
names on the server); it is checked at config time.

A round is one `local_train` per participant, then one `aggregate` of their uploads. A method whose
clients must upload *before* they train on the round's aggregate (VPDR's prototype frameworks, SPEC 3.4)
sets `release_first = True`: per round each participant's `local_release` makes the upload from its
current state, the server aggregates those, and only then does each participant's `local_train` run on
the fresh broadcast, uploading nothing. Each half gets its own rng stream ("release" / "train").

A method with a Step 0 (a release made once, before any training: FedTSP's description embedding) lists the
clients that make it in `setup_clients()`: before round 0's training each of them runs `local_setup` (rng
stream "setup"; its upload checked, privatised and accounted as any upload, in round 0's ledger), the server
turns those uploads into round 0's broadcast with `aggregate_setup`, and round 0 then trains on it. It is part
of round 0: a run resumed before round 0 completed makes it again, from the same streams (the same release);
one resumed after it does not.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Optional, Protocol, Sequence

import torch
from torch import Tensor

from raysim.config.schema import DPConfig, TrainConfig
from raysim.data.client import ClientData
from raysim.privacy.mechanisms import BudgetShare, ReleaseSpec
from raysim.registry import Registry
from raysim.sampling import generator


@dataclass
class NoOptions:
    """A method without knobs of its own."""


@dataclass
class EnvSpec:
    """What a host knows when it builds a method's frozen parts."""

    model: Any  # raysim.models.clip.ModelSpec
    classnames: list[str]
    device: str = "cpu"
    dataset: str = ""


@dataclass(frozen=True)
class Needs:
    """What a method needs from the engine, declared (not probed) and checked at config time."""

    input: str = "features"  # "features" (frozen CLIP image features) or "images" (pixels, for own models)
    image_size: int = 0  # images: the input size the method's models take (0 = the CLIP model's)
    tokens: bool = False  # also the frozen image tower's token sequences (predict(features, tokens))
    server_classnames: bool = True  # False: the server sees "class i" only (e.g. FedTSP's private variant)
    # images: the training augmentation the method's official code applies to them (Method.image_augment), which
    # data.augment=official turns on; "" = none
    image_augment: str = ""


@dataclass
class LocalResult:
    """What `local_train` returns: the upload (declared tensors only), the new private state, and
    metrics (logged by the engine on the driver; never handed to the server)."""

    upload: dict[str, Tensor]
    private: dict[str, Any]
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Upload:
    """An upload as the server receives it (the engine builds it from a LocalResult): the checked,
    privatised arrays and the sample count (public in all three papers: FedAvg weights). No metrics."""

    client_id: int
    tensors: dict[str, Tensor]
    num_samples: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def weighted_mean(uploads: Sequence[Upload], key: str) -> Tensor:
    """sum_k n_k x_k / sum_k n_k over the uploads (in the order given: client-id order)."""
    total = float(sum(u.num_samples for u in uploads))
    out = torch.zeros_like(uploads[0].tensors[key], dtype=torch.float32)
    for u in uploads:
        out += u.tensors[key].float() * (u.num_samples / total)
    return out


@dataclass
class ServerResult:
    """What `aggregate` may return instead of the bare new state: the state and server-side metrics
    (e.g. a server loss), which land in results.csv and TensorBoard and are never broadcast."""

    state: dict[str, Tensor]
    metrics: dict[str, float] = field(default_factory=dict)


class PrivacyHandle(Protocol):
    """What a method may ask of the privacy layer during local training (privacy/host.py RoundPrivacy)."""

    enabled: bool

    def batches(self, n: int, batch_size: int, rng: torch.Generator) -> Iterator[Tensor]:
        """One epoch's mini-batch indices (Poisson-sampled under DP-SGD with dp.sampling=poisson)."""
        ...

    def backward(self, per_sample_loss: Tensor, dp_params: dict[str, Tensor], other_params: Sequence[Tensor] = (),
                 public_loss: Optional[Tensor] = None) -> None:
        """Set `.grad` of `dp_params` ({upload name: tensor}) to the clipped, noised per-example mean
        (DP-SGD) plus the plain gradient of `public_loss` (a data-independent term), and of
        `other_params` to the plain gradient of the mean loss plus `public_loss`; records one DP-SGD step."""
        ...

    def release(self, name: str, value: Any = None, *, features: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                num_classes: int = 0, clip: float = 0.0, assignments: Optional[Tensor] = None,
                unclipped: bool = False) -> Tensor:
        """A prototype release (class means of `features`, or with `assignments` the (M, d) cluster centres)
        or an embedding release of `value` (clipped to `clip`, or with `unclipped` noised as it is: a
        reference code's noise, recorded as no guarantee), computed and privatised by the host; the method
        uploads what it returns under `name`."""
        ...


Predictor = Callable[..., Tensor]  # predict(features) -> logits, or predict(features, tokens)


_CARRY: ContextVar[Optional["OptimizerCarry"]] = ContextVar("raysim_optimizer_carry", default=None)


@dataclass
class OptimizerCarry:
    """train.optimizer_state=shared: one SGD state that every client's local round continues, in the order the
    host trains them (client id order, round after round), as the FedSEPT code's one trainer and optimiser for all
    clients leave SGD's momentum buffers from one client to the next (SPEC 1.7).

    A simulation artifact of the official code, not something a deployment could do: a client's momentum is a
    running sum of its (private, un-noised for R and the router) gradients, and no real client receives another's.
    The host holds it (one host for all clients), hands it to each client's round (`carrying`) and checkpoints it;
    under DP each client's ledger records that its guarantee does not hold (privacy/host.py `hand_on_optimizer`).
    `buffers`: SGD's momentum buffer of each trained tensor, in the order of the optimiser's parameters (None:
    never stepped)."""

    buffers: Optional[list[Optional[Tensor]]] = None

    def load_into(self, opt: torch.optim.Optimizer) -> None:
        """Start `opt` (fresh, built over a client's tensors) from the carried momentum, tensor by tensor."""
        params = [p for g in opt.param_groups for p in g["params"]]
        if self.buffers is None:
            return
        if len(self.buffers) != len(params) or any(b is not None and b.shape != p.shape for b, p in zip(self.buffers, params)):
            from raysim.errors import ConfigError

            raise ConfigError("train.optimizer_state=shared: this client's trained tensors differ in number or shape from the "
                              "previous client's, so there is no one SGD state to continue; set train.optimizer_state=fresh")
        for b, p in zip(self.buffers, params):
            if b is not None:
                opt.state[p]["momentum_buffer"] = b.to(p.device, copy=True)

    def take_from(self, opt: torch.optim.Optimizer) -> None:
        """Keep `opt`'s momentum buffers (after the client's last step) for the next client."""
        params = [p for g in opt.param_groups for p in g["params"]]
        got = [opt.state.get(p, {}).get("momentum_buffer") for p in params]
        self.buffers = [None if b is None else b.detach().to("cpu", copy=True) for b in got]

    def to_dict(self) -> dict[str, Any]:
        return {"buffers": self.buffers}

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "OptimizerCarry":
        return cls(buffers=None if not d else d.get("buffers"))


@contextmanager
def carrying(carry: Optional[OptimizerCarry]) -> Iterator[None]:
    """Run a client's local round with `carry` as its SGD state (None: a fresh one, the default)."""
    token = _CARRY.set(carry)
    try:
        yield
    finally:
        _CARRY.reset(token)


def carried_optimizer() -> Optional[OptimizerCarry]:
    """The SGD state the running local round continues (train.optimizer_state=shared), or None: start fresh."""
    return _CARRY.get()


class Method:
    """Base class of every federated method. Subclasses fill in the halves of their algorithm box."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    releases: ClassVar[dict[str, ReleaseSpec]] = {}  # every tensor a client may send, and how it is released
    uploads: ClassVar[tuple[str, ...]] = ()  # the names of `releases` (set for each subclass)
    server_only: ClassVar[tuple[str, ...]] = ()  # keys (or "prefix" for prefix.*) kept on the server, never broadcast
    client_metrics: ClassVar[tuple[str, ...]] = ("loss",)  # what local_train reports (results.csv train_* columns)
    server_metrics: ClassVar[tuple[str, ...]] = ()  # what aggregate reports in a ServerResult (server_* columns)
    release_first: ClassVar[bool] = False  # True: local_release uploads, the server aggregates, then local_train (uploads nothing)
    # True when `predictor` reads only `env` and `shared`, never the client's private state or data: every
    # client predicts with the one global model, so evaluation scores that model once per test row instead
    # of once per client (the numbers are the same). tests/engine/test_eval_scale.py checks it against behaviour.
    global_predictor: ClassVar[bool] = False
    # What the behaviour tests check (tests/methods/test_behaviour.py), declared here and read by no engine code:
    loss_weights: ClassVar[dict[str, str]] = {}  # each loss term besides the data term -> the option that weighs it (0 drops it)
    eval_ignores: ClassVar[tuple[str, ...]] = ()  # broadcast / private tensors (dotted paths, or a prefix) the predictor does not read
    eval_options: ClassVar[tuple[str, ...]] = ()  # numeric options the predictor reads (changing one changes the logits)
    averaged: ClassVar[tuple[str, ...]] = ()  # uploads the server replaces by their sample-weighted mean (FedAvg)
    trains: ClassVar[bool] = True  # False: nothing is learnt (zero-shot)
    # methods training on images: the training augmentation their official code applies ("pad-crop-flip": the VPDR
    # code's RandomCrop(size, padding 4) + horizontal flip, raysim/data/padcrop.py), turned on by data.augment; "" = none.
    # A class attribute, so that the config check reads it without building the method's models (`needs` may)
    image_augment: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.uploads = tuple(cls.releases)

    def __init__(self, train: TrainConfig, options: Any, dp: Any = None) -> None:
        self.train = train
        self.opts = options
        self.dp = dp if dp is not None else DPConfig()  # the run's local-DP target (read-only, public)

    # -- what the method needs and releases ----------------------------------------------------
    def needs(self) -> Needs:
        return Needs()

    def releases_of(self, client_id: int) -> list[str]:
        """The declared uploads this client makes over the run (used to calibrate its noise)."""
        return list(self.releases)

    def budget_shares(self) -> Optional[dict[str, BudgetShare]]:
        """The method's own split of each client's dp.epsilon over its private releases (privacy/host.py):
        None (the default) calibrates one multiplier jointly over every release of the client's run."""
        return None

    # -- shared frozen parts, built once per host (client actor or server actor) --------------
    def build_env(self, spec: EnvSpec, *, role: str) -> Any:  # role: "client" | "server"
        raise NotImplementedError

    # -- server half -------------------------------------------------------------------------
    def init_shared(self, env: Any, rng: torch.Generator) -> dict[str, Tensor]:
        raise NotImplementedError

    def aggregate(
        self, env: Any, shared: dict[str, Tensor], uploads: list[Upload], rng: torch.Generator
    ) -> "dict[str, Tensor] | ServerResult":
        raise NotImplementedError

    def aggregate_setup(self, env: Any, shared: dict[str, Tensor], uploads: list[Upload], rng: torch.Generator) -> dict[str, Tensor]:
        """Step 0's server half: the state round 0 starts from, given the `local_setup` uploads (client-id order)."""
        raise NotImplementedError(f"{self.name} has no Step 0 (setup_clients() is empty)")

    def setup_clients(self) -> tuple[int, ...]:
        """The clients that make a Step 0 release (`local_setup`) before round 0's training; () (the default): none."""
        return ()

    # -- client half -------------------------------------------------------------------------
    def init_private(self, env: Any, data: ClientData, rng: torch.Generator) -> dict[str, Any]:
        return {}

    def local_train(
        self,
        env: Any,
        shared: dict[str, Tensor],
        private: dict[str, Any],
        data: ClientData,
        *,
        rng: torch.Generator,
        privacy: PrivacyHandle,
    ) -> LocalResult:
        raise NotImplementedError

    def local_release(
        self,
        env: Any,
        shared: dict[str, Tensor],
        private: dict[str, Any],
        data: ClientData,
        *,
        rng: torch.Generator,
        privacy: PrivacyHandle,
    ) -> LocalResult:
        """A `release_first` method's upload for this round, made from the client's current state before
        it trains (its `upload` is what the server aggregates; `local_train` then returns an empty one)."""
        raise NotImplementedError(f"{self.name} does not release first (release_first is False)")

    def local_setup(
        self,
        env: Any,
        shared: dict[str, Tensor],
        private: dict[str, Any],
        data: ClientData,
        *,
        rng: torch.Generator,
        privacy: PrivacyHandle,
    ) -> LocalResult:
        """Step 0's client half, once, before round 0 trains (a client of `setup_clients()`): its upload is what
        `aggregate_setup` receives."""
        raise NotImplementedError(f"{self.name} has no Step 0 (setup_clients() is empty)")

    def predictor(self, env: Any, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None) -> Predictor:
        """A function from inputs to logits over all classes, with whatever can be cached prepared.
        `data` is the client's own data (evaluation runs in the client's host), for methods that adapt
        the model to it before testing (e.g. -FT head fine-tuning)."""
        raise NotImplementedError

    def independent_clients(self) -> bool:
        """True when each client's step (init_private, local_train, local_release) is a function of its
        arguments alone: it reads env's frozen parts, writes nothing of env but entries of its own client,
        and draws randomness only from its `rng` (or from torch's global RNG under a seed, through
        raysim.sampling.seeded_global_rng). A host may then run several clients' steps at once
        (execution.client_threads); each client's computation is the same as client by client, so the
        results are bitwise the same. False (the default): client by client."""
        return False

    def shares_optimizer_state(self) -> bool:
        """Whether train.optimizer_state=shared can be honoured: the local round steps one torch SGD whose state the
        host can hand from client to client (`OptimizerCarry`). False (the default): refused at config time."""
        return not self.trains

    def predicts_globally(self) -> bool:
        """Whether this instance's predictor is the same for every client (`global_predictor`, unless an
        option makes it personal, e.g. the -FT methods' head fine-tuning)."""
        return self.global_predictor

    # -- lock-step rounds ----------------------------------------------------------------------
    def lockstep_steps(self, num_train: Sequence[int]) -> int:
        """0 (the default): a round is one `local_train` per participant, then one `aggregate`. S > 0: the
        round runs in lock-step, S times over (`num_train`: every client's training-set size): every
        participant makes one local step (`local_train`, uploading e.g. its clipped gradient), the server
        aggregates those and broadcasts, and so on; evaluation and the checkpoint follow the S-th step.
        Each call of a round gets the same (round, client) / (round) streams: a method that uses it tells
        its steps apart by a counter in its own state (DP-FPL's reference mode, methods/fedsept/dpfpl.py)."""
        return 0

    # -- accounting --------------------------------------------------------------------------
    def dp_steps_per_round(self, num_train: int) -> int:
        """DP-SGD steps one participation costs (used to calibrate sigma before training)."""
        from raysim.sampling import batches_per_epoch

        return self.train.local_epochs * batches_per_epoch(num_train, self.train.batch_size)


METHODS: Registry[type[Method]] = Registry("method")


register_method = METHODS.add  # class decorator: registers a Method subclass under its `name`


def initial_private(method: Method, env: Any, data: ClientData, seed: int) -> dict[str, Any]:
    """A client's private state before its first participation (from its own seeded stream)."""
    return method.init_private(env, data, generator(seed, "init", data.client_id))


def broadcast_state(method: Method, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The part of the server state that is broadcast (without the method's `server_only` keys)."""
    hidden = tuple(method.server_only)
    return {k: v for k, v in state.items() if not any(k == h or k.startswith(h + ".") for h in hidden)}
