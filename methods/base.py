"""The method protocol: a federated method is its client half and its server half, nothing else.

The engine owns orchestration, sampling, DP accounting, evaluation and I/O. A method receives:

- `env`: the frozen parts built once per host (a CLIP text tower and prompt builder, a PLM, ...),
- `shared`: the global state the server broadcasts (tensors only),
- `private`: the client's private state (anything torch.save can store); it never leaves the client,
- `data`: the client's `ClientData`,
- `rng`: a `torch.Generator` seeded for this (round, client) stream,
- `privacy`: a `PrivacyHandle` that applies DP-SGD to the tensors the client uploads and records
  every step in the client's ledger.

`uploads` declares, by name, every tensor a client may send; the engine refuses anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Protocol, Sequence

import torch
from torch import Tensor

from raysim.registry import Registry


@dataclass
class NoOptions:
    """A method without knobs of its own."""


@dataclass
class TrainConfig:
    """The run-level knobs every method's local training sees (copied from RunConfig)."""

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.002
    momentum: float = 0.9
    weight_decay: float = 5e-4
    n_ctx: int = 16
    ctx_init: str = ""
    rounds: int = 10
    num_clients: int = 10
    seed: int = 1


@dataclass
class EnvSpec:
    """What a host knows when it builds a method's frozen parts."""

    model: Any  # raysim.models.clip.ModelSpec
    classnames: list[str]
    device: str = "cpu"
    dataset: str = ""


@dataclass
class ClientData:
    """One client's data as the method sees it (features of a frozen encoder, or images).

    `tokens_*` (N, K, width), float16, are the frozen image tower's token sequences, present only for
    methods whose `input` is "features+tokens"."""

    client_id: int
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    tokens_train: Optional[Tensor] = None
    tokens_test: Optional[Tensor] = None

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    def classes(self) -> list[int]:
        return sorted(int(c) for c in torch.unique(self.y_train))


@dataclass
class LocalResult:
    """What `local_train` returns: the upload (declared tensors only) and the new private state."""

    upload: dict[str, Tensor]
    private: dict[str, Any]
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Upload:
    """An upload as the server receives it (the engine builds it from a LocalResult)."""

    client_id: int
    tensors: dict[str, Tensor]
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class PrivacyHandle(Protocol):
    """What a method may ask of the privacy layer during local training."""

    enabled: bool

    def backward(self, per_sample_loss: Tensor, dp_params: Sequence[Tensor], other_params: Sequence[Tensor] = ()) -> None:
        """Set `.grad` of `dp_params` to the clipped, noised per-example mean (DP-SGD) and of
        `other_params` to the plain gradient of the mean loss; records one DP-SGD step."""
        ...


Predictor = Callable[..., Tensor]  # predict(features) -> logits, or predict(features, tokens)


class Method:
    """Base class of every federated method. Subclasses fill in the halves of their algorithm box."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    uploads: ClassVar[tuple[str, ...]] = ()  # every tensor a client may send to the server
    server_only: ClassVar[tuple[str, ...]] = ()  # keys (or "prefix" for prefix.*) kept on the server, never broadcast
    # "features" (frozen CLIP image features), "features+tokens" (also the image tower's tokens: the
    # predictor is then called as predict(features, tokens)) or "images"
    input: ClassVar[str] = "features"

    def __init__(self, train: TrainConfig, options: Any) -> None:
        self.train = train
        self.opts = options

    # -- shared frozen parts, built once per host (client actor or server actor) --------------
    def build_env(self, spec: EnvSpec, *, role: str) -> Any:  # role: "client" | "server"
        raise NotImplementedError

    # -- server half -------------------------------------------------------------------------
    def init_shared(self, env: Any, rng: torch.Generator) -> dict[str, Tensor]:
        raise NotImplementedError

    def aggregate(self, env: Any, shared: dict[str, Tensor], uploads: list[Upload], rng: torch.Generator) -> dict[str, Tensor]:
        raise NotImplementedError

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

    def predictor(self, env: Any, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None) -> Predictor:
        """A function from inputs to logits over all classes, with whatever can be cached prepared.
        `data` is the client's own data (evaluation runs in the client's host), for methods that adapt
        the model to it before testing (e.g. -FT head fine-tuning)."""
        raise NotImplementedError

    # -- accounting --------------------------------------------------------------------------
    def dp_steps_per_round(self, num_train: int) -> int:
        """DP-SGD steps one participation costs (used to calibrate sigma before training)."""
        from raysim.sampling import batches_per_epoch

        return self.train.local_epochs * batches_per_epoch(num_train, self.train.batch_size)


METHODS: Registry[type[Method]] = Registry("method")


def register_method(cls: type[Method]) -> type[Method]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name")
    METHODS.register(cls.name)(cls)
    return cls
