"""The pieces every mechanism shares: the release kinds methods declare (ReleaseSpec), the Mechanism base
class and its hooks, the MECHANISMS registry and `resolve`. Each mechanism is a module of its own beside this one."""


from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol, TypeVar

from raysim.errors import ConfigError, UploadViolation
from raysim.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

    from ..ledger import Release

KINDS = ("dpsgd", "update", "prototype", "embedding", "public", "reference")
LEVELS = ("sample", "client")


@dataclass(frozen=True)
class ReleaseSpec:
    """What a method declares about one upload: the kind of release, and why it is public (for `public`)."""

    kind: str
    note: str = ""
    once: bool = False  # one release per run (embedding), not one per participation

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"release kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "public" and not self.note:
            raise ValueError("a public upload needs a note saying why the paper treats it as public")


CALIBRATIONS = ("accountant", "classic_gaussian")


@dataclass(frozen=True)
class BudgetShare:
    """A method's own split of a client's budget (`Method.budget_shares`): the release it names gets
    `share` x dp.epsilon (at the run's delta), calibrated on that release's compositions alone, so no
    other release pays for them. `calibration`: "accountant" (the ledger's accountant and conversion,
    as a joint calibration would) or "classic_gaussian" (one release: the classical Gaussian mechanism's
    sigma = Delta sqrt(2 ln(1.25/delta)) / epsilon, fedtsp.txt Eq. 11; the ledger then records the exact
    epsilon of that noise, the analytic Gaussian mechanism's, so what it prints is true). `note`: what
    the resulting epsilon covers, when not everything the client sends (recorded with the release)."""

    share: float
    calibration: str = "accountant"
    note: str = ""

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"a budget share must lie in (0, 1], got {self.share}")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {', '.join(CALIBRATIONS)}, got {self.calibration!r}")


def dpsgd() -> ReleaseSpec:
    return ReleaseSpec("dpsgd")


def update() -> ReleaseSpec:
    return ReleaseSpec("update")


def prototype() -> ReleaseSpec:
    return ReleaseSpec("prototype")


def embedding() -> ReleaseSpec:
    return ReleaseSpec("embedding", once=True)


def public(note: str) -> ReleaseSpec:
    return ReleaseSpec("public", note=note)


def reference() -> ReleaseSpec:
    """A release noised the way a reference code does it, which is not a valid DP guarantee (README "Privacy")."""
    return ReleaseSpec("reference")


# ------------------------------------------------------------------------------------- mechanisms
@dataclass(frozen=True)
class Planned:
    """Gaussian compositions one participation costs: `steps` releases at sampling rate `q` (all at the
    client's common multiplier); `pure` is an epsilon spent by a pure-DP part, as a share of the target."""

    q: float = 1.0
    steps: int = 0
    pure_share: float = 0.0


class RoundView(Protocol):
    """What a mechanism's hooks (`train`, `verify`) read of one (round, client)'s privacy handle. privacy/host.py
    RoundPrivacy implements it; the type lives here, the module both use, so the mechanisms never import the host."""

    host: Any  # the client's HostPrivacy (its calibrated multipliers, its dp section)
    cid: int
    round: int
    num_train: int
    shared: dict[str, "Tensor"]
    released: dict[str, "Tensor"]

    @property
    def enabled(self) -> bool:
        """True when a training mechanism noises the round's DP parameters."""

    @property
    def stepper(self) -> Any:
        """The step object behind `backward` (DPSGD, BatchClipSGD or NoDP)."""


@dataclass
class Training:
    """What a `train` mechanism gives a round: the step object behind `privacy.backward` (DPSGD or
    BatchClipSGD), the ledger entry of the round's steps (its `steps` filled in at close), whether the
    batches are Poisson-sampled, and whether the entry is recorded when no step ran."""

    stepper: Any
    release: "Release"
    poisson: bool = False
    record_without_steps: bool = True

    def done(self) -> Optional["Release"]:
        from dataclasses import replace

        steps = int(self.stepper.steps)
        return replace(self.release, steps=steps) if steps or self.record_without_steps else None


class Mechanism:
    """A registered release mechanism. The class attributes are the README's mechanism table, and what
    the host and `resolve` ask of it; the methods are its hooks."""

    name: ClassVar[str] = ""
    applied: ClassVar[str] = ""  # "train" (inside local training), "release" (on the method's request), "update", "none"
    clipped: ClassVar[str] = ""
    sensitivity: ClassVar[str] = ""
    relation: ClassVar[str] = ""
    accountant: ClassVar[str] = ""
    warning: ClassVar[str] = ""  # a line the run logs once when this mechanism is in use (e.g. not a valid guarantee)
    serves: ClassVar[tuple[str, ...]] = ()  # the release kinds it privatises
    levels: ClassVar[tuple[str, ...]] = LEVELS  # the dp.level values it serves them at
    choice: ClassVar[str] = ""  # the dp.prototypes value that selects it ("" = not chosen by dp.prototypes)
    options: ClassVar[tuple[str, ...]] = ()  # the dp fields (dotted) it reads
    joint: ClassVar[bool] = False  # one release privatises every tensor it covers at once (one step, one update)
    trains_with_dpsgd: ClassVar[bool] = False  # per-example DP-SGD inside local training
    refusal: ClassVar[str] = ""  # why {what} cannot be released at another dp.level, and what to do

    def __init__(self, dp: Any) -> None:
        self.dp = dp

    @property
    def private(self) -> bool:
        """False for a release that costs and protects nothing (declared public)."""
        return self.applied != "none"

    @classmethod
    def selected(cls, kind: str, dp: Any) -> bool:
        """Whether this mechanism releases a `kind` upload under `dp` (DP on, or any dp for a public one)."""
        return kind in cls.serves and dp.level in cls.levels and (not cls.choice or dp.prototypes == cls.choice)

    # -- hooks -----------------------------------------------------------------------------------
    def plan(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        """The Gaussian compositions one participation costs (used to calibrate the multiplier)."""
        return Planned()

    planned = plan  # the previous name

    def train(self, rp: RoundView) -> Optional[Training]:
        """For `applied = "train"`: the round's step object and ledger entry (None: not a training mechanism)."""
        return None

    def verify(self, rp: RoundView, name: str, tensor: "Tensor", kind: str) -> None:
        """Raise UploadViolation unless the upload `name` is what this mechanism privatised this round.
        Default (host-made releases): it must be the tensor `privacy.release(name, ...)` returned."""
        import torch

        if name not in rp.released or not torch.equal(rp.released[name], tensor):
            raise UploadViolation(
                f"client {rp.cid}: {name!r} is a {kind} release and must be the tensor "
                f"privacy.release({name!r}, ...) returned this round (fail closed)"
            )


MECHANISMS: Registry[type[Mechanism]] = Registry("privacy mechanism")


M = TypeVar("M", bound=type[Mechanism])


def register_mechanism(cls: M) -> M:
    """Register a mechanism class under its `name` (a class decorator, in the mechanism's own module)."""
    MECHANISMS.add(cls)
    return cls


def mechanisms() -> list[type[Mechanism]]:
    """Every registered mechanism class, by name."""
    return [MECHANISMS.get(n) for n in MECHANISMS.names()]


def prototype_choices() -> list[str]:
    """The values dp.prototypes may take: the `choice` of every mechanism serving prototype releases."""
    return sorted({c.choice for c in mechanisms() if "prototype" in c.serves and c.choice})


# ------------------------------------------------------------------------------------- resolution
def resolve(spec: ReleaseSpec | str, dp: Any, *, what: str = "") -> Optional[Mechanism]:
    """The mechanism that releases `what` (a `spec`, or a kind's name) under `dp`: the one registered
    mechanism that serves its kind there (None when DP is off and the release is private: nothing is
    privatised). Raises ConfigError when this kind of release cannot be made private at `dp.level`."""
    kind = spec if isinstance(spec, str) else spec.kind
    what = what or f"a {kind} upload"
    if kind not in KINDS:
        raise ConfigError(f"{what}: unknown release kind {kind!r}")
    serving = [c for c in mechanisms() if kind in c.serves]
    if not dp.enabled:
        serving = [c for c in serving if c.applied == "none"]
        return serving[0](dp) if serving else None
    found = [c for c in serving if c.selected(kind, dp)]
    if len(found) > 1:
        raise ConfigError(f"{what}: mechanisms {', '.join(c.name for c in found)} all serve {kind} releases under this dp section; "
                          "give them distinct dp.level or dp.prototypes choices")
    if found:
        return found[0](dp)
    chosen = [c for c in serving if not c.choice or c.choice == dp.prototypes]
    for c in chosen:
        raise ConfigError(c.refusal.format(what=what) if c.refusal else
                          f"{what} is a {kind} release, which {c.name} makes only at dp.level={'|'.join(c.levels)}; "
                          f"use dp.level={c.levels[0]} or dp.epsilon=inf")
    raise ConfigError(f"{what}: no registered mechanism serves {kind} releases at dp.level={dp.level}"
                      f" with dp.prototypes={dp.prototypes}; choose dp.prototypes from {', '.join(prototype_choices())}"
                      " or dp.epsilon=inf")


def resolve_all(releases: dict[str, ReleaseSpec], dp: Any, *, method: str) -> dict[str, Optional[Mechanism]]:
    return {name: resolve(spec, dp, what=f"{method}'s upload {name!r}") for name, spec in releases.items()}


def check_method(method: Any, dp: Any) -> None:
    """Config-time check: every upload `method` declares can be released privately under `dp`, and a
    prototype mechanism other than the default is only chosen for a method that releases prototypes."""
    from raysim.config.schema import DPConfig

    if dp.enabled and dp.prototypes != DPConfig.prototypes and not any(s.kind == "prototype" for s in method.releases.values()):
        raise ConfigError(
            f"dp.prototypes={dp.prototypes} chooses how prototypes are released, but {method.name} releases no prototypes; "
            "use a prototype method (fedproto, fedtgp, vpdr_fedproto, ...) or leave dp.prototypes at its default"
        )
    found = resolve_all(method.releases, dp, method=method.name)
    shares = getattr(method, "budget_shares", None)
    for name in (shares() or {}) if dp.enabled and shares is not None else ():
        mech = found.get(name)
        if mech is not None and mech.plan(num_train=1, steps_per_round=1, batch_size=1).pure_share:
            raise ConfigError(f"{method.name}'s budget shares calibrate Gaussian releases; {name!r} has a pure-DP part "
                              f"({mech.name}: it spends dp.epsilon itself); use dp.prototypes=igpp, or a budget mode of "
                              f"{method.name} without shares (e.g. fedtsp.dp_budget=joint)")


def warnings_for(method: Any, dp: Any) -> list[str]:
    """The lines a run logs once for the mechanisms `method`'s uploads resolve to under `dp`."""
    lines = []
    for mech in resolve_all(method.releases, dp, method=method.name).values():
        if mech is not None and mech.warning and mech.warning not in lines:
            lines.append(mech.warning)
    return lines


def mechanism_table() -> list[dict[str, str]]:
    """One row per registered mechanism (README "Privacy")."""
    return [{"mechanism": c.name, "clipped": c.clipped, "sensitivity": c.sensitivity, "relation": c.relation,
             "accountant": c.accountant} for c in mechanisms()]


