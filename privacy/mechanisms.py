"""How each uploaded tensor leaves a client: declared releases and the registry of mechanisms.

A method declares, for every tensor it may upload, a `ReleaseSpec` naming the *kind* of release:

    dpsgd       trained by DP-SGD (per-example clipping and noise) on the client's data
    update      an update of a broadcast tensor, trained without per-example DP
    prototype   class prototypes computed from the client's features (the host computes and noises them)
    embedding   a one-shot release of a tensor the client computes once (FedTSP's description embeddings)
    public      not private (sample counts, and only where the papers treat them as public)
    reference   a reference code's own noise, reproduced on request (DP-FPL's batch-gradient clipping):
                recorded in the ledger as not valid (`Release.valid = False`), never a DP guarantee

The host resolves each kind against the run's `dp` section to one registered `Mechanism`
(`resolve`); a combination that cannot be made private is refused at config time (`check_method`).
A mechanism says what it clips, its sensitivity, its neighbouring relation and its accountant
(`MECHANISMS` is the table in README "Privacy"), how many Gaussian compositions one participation
costs (`planned`, used to calibrate the noise multiplier before training) and, for mechanisms the host
applies itself, `apply`. Multipliers are always relative to the mechanism's L2 sensitivity, so every
ledger entry composes through the same accountant (one epsilon conversion everywhere).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Protocol

import torch
from torch import Tensor

from raysim.errors import ConfigError
from raysim.registry import Registry

KINDS = ("dpsgd", "update", "prototype", "embedding", "public", "reference")


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


class Mechanism:
    """A registered release mechanism. The class attributes are the README's mechanism table."""

    name: ClassVar[str] = ""
    applied: ClassVar[str] = ""  # "train" (inside local training), "release" (on the method's request), "update", "none"
    clipped: ClassVar[str] = ""
    sensitivity: ClassVar[str] = ""
    relation: ClassVar[str] = ""
    accountant: ClassVar[str] = ""
    warning: ClassVar[str] = ""  # a line the run logs once when this mechanism is in use (e.g. not a valid guarantee)

    def __init__(self, dp: Any) -> None:
        self.dp = dp

    def planned(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned()


class PrototypeRelease(Protocol):
    """What the host needs of the mechanism `dp.prototypes` names (IGPP, VPP, or one registered with
    applied = "release"): the noised (num_classes, d) class means, or with `assignments` (per-example cluster
    ids within the class) the noised (M, d) cluster centres, class by class; and extra ledger facts ("pure_epsilon")."""

    @property
    def name(self) -> str: ...

    def apply(self, features: Tensor, labels: Tensor, num_classes: int, *, multiplier: float,
              generator: torch.Generator, rounds: int, assignments: Optional[Tensor] = None) -> tuple[Tensor, dict[str, float]]: ...


MECHANISMS: Registry[type[Mechanism]] = Registry("privacy mechanism")


register_mechanism = MECHANISMS.add


@register_mechanism
class Public(Mechanism):
    name = "public"
    applied = "none"
    clipped = "nothing"
    sensitivity = "n/a (not private)"
    relation = "n/a: declared public by the method (its docstring says why)"
    accountant = "none (costs nothing, protects nothing)"


@register_mechanism
class DPSGDMechanism(Mechanism):
    name = "dpsgd"
    applied = "train"
    clipped = "each example's gradient of the uploaded tensors, jointly, to dp.clip = C"
    sensitivity = "C per step (one example added or removed changes the clipped gradient sum by <= C)"
    relation = "add/remove one training example (sample-level)"
    accountant = "subsampled Gaussian, q = B/n, one step per batch (Opacus RDP or PRV)"

    def sample_rate(self, num_train: int, batch_size: int) -> float:
        return min(1.0, batch_size / max(1, num_train))

    def planned(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=self.sample_rate(num_train, batch_size), steps=steps_per_round)


@register_mechanism
class ClientUpdate(Mechanism):
    name = "client_update"
    applied = "update"
    clipped = "the whole update (upload - broadcast), jointly over the uploaded tensors, to dp.clip = C"
    sensitivity = "2C (any two datasets of the client give updates in the same C-ball)"
    relation = "replace the client's whole dataset (user-level; the server, who samples, is the adversary)"
    accountant = "Gaussian, q = 1 (no amplification by participation), one release per participation"

    def planned(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=1.0, steps=1)

    def apply(self, delta: dict[str, Tensor], *, multiplier: float, generator: torch.Generator) -> dict[str, Tensor]:
        from .client_level import noise_update

        # noise_update adds N(0, (sigma C)^2) with sigma relative to C; the sensitivity is 2C
        return noise_update(delta, clip=self.dp.clip, sigma=2.0 * multiplier, generator=generator)


@register_mechanism
class IGPP(Mechanism):
    name = "igpp"
    applied = "release"
    clipped = "each example's feature to dp.proto_clip = R (L2)"
    sensitivity = "2R / n_c per class mean (n_c = the client's examples of class c)"
    relation = "replace one example by another of the same class (per-class counts are public)"
    accountant = "Gaussian, q = 1, one release per participation"

    def planned(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=1.0, steps=1)

    def apply(self, features: Tensor, labels: Tensor, num_classes: int, *, multiplier: float,
              generator: torch.Generator, rounds: int, assignments: Optional[Tensor] = None) -> tuple[Tensor, dict[str, float]]:
        from .prototypes import igpp_release, stack_centres

        out = igpp_release(features, labels, clip=self.dp.proto_clip, sigma=multiplier, generator=generator, assignments=assignments)
        return (_dense(out, num_classes, features) if assignments is None else stack_centres(out)), {}


@register_mechanism
class VPP(Mechanism):
    name = "vpp"
    applied = "release"
    clipped = "each feature's top-k and rest groups to R sqrt(d_A/d) and R sqrt(d_B/d) (R = dp.proto_clip)"
    sensitivity = "2R / n_c per class mean, split 2R kappa_A / n_c on I_A and 2R kappa_B / n_c on I_B"
    relation = "replace one example by another of the same class (per-class counts are public)"
    accountant = ("Laplace top-k partition, pure (dp.vpp.split x epsilon over the run), plus Gaussian with the "
                  "group noise reallocated at equal RDP (q = 1, one release per participation)")

    def planned(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=1.0, steps=1, pure_share=self.dp.vpp.split)

    def apply(self, features: Tensor, labels: Tensor, num_classes: int, *, multiplier: float,
              generator: torch.Generator, rounds: int, assignments: Optional[Tensor] = None) -> tuple[Tensor, dict[str, float]]:
        from .prototypes import stack_centres, vpp_release

        out = vpp_release(features, labels, R=self.dp.proto_clip, rho=self.dp.vpp.rho, H=self.dp.vpp.H,
                          epsilon=self.dp.epsilon, rounds=rounds, delta=self.dp.delta, r_split=self.dp.vpp.split,
                          generator=generator, num_classes=num_classes, sigma_ref=multiplier,
                          centres="mean" if assignments is None else "cluster", assignments=assignments)
        protos = _dense(out["prototypes"], num_classes, features) if assignments is None else stack_centres(out["prototypes"])
        return protos, {"pure_epsilon": out["epsilon1"] / rounds}


@register_mechanism
class EmbeddingRelease(Mechanism):
    name = "embedding"
    applied = "release"
    clipped = "the flattened tensor, as a whole, to C (the method's clip radius, e.g. fedtsp.dp_clip)"
    sensitivity = "2C (fedtsp.txt Eq. 10)"
    relation = "replace the released content (e.g. the selected client's class descriptions) entirely"
    accountant = "Gaussian, q = 1, once per run"

    def planned(self, *, num_train: int, steps_per_round: int, batch_size: int) -> Planned:
        return Planned(q=1.0, steps=1)

    def apply(self, tensor: Tensor, *, clip: float, multiplier: float, generator: torch.Generator) -> Tensor:
        v = tensor.detach().reshape(-1).double()
        v = v * min(1.0, clip / max(float(v.norm()), 1e-12))
        dev = generator.device if generator is not None else torch.device("cpu")
        noise = torch.randn(v.shape, generator=generator, device=dev, dtype=torch.float64).to(v.device)
        return (v + multiplier * 2.0 * clip * noise).reshape(tensor.shape).to(tensor.dtype)


@register_mechanism
class DPFPLReference(Mechanism):
    """The DP-FPL code's noise (linhhtran/DP-FPL, trainers/DP_FPL.py): the batch-mean gradient is clipped
    to C as a whole and N(0, (sigma C / B)^2) is added, with sigma = q sqrt(T ln(1/delta)) / epsilon at
    q = 1 and T = the rounds, i.e. the per-example sensitivity C / B is claimed for a clipped *batch*
    gradient. One example moves that clipped mean anywhere in a C-ball, so the true sensitivity is 2C and
    the claimed epsilon does not hold. The ledger records the steps with `valid=False` at the multiplier
    relative to 2C, sigma / (2B), q = 1, every step counted: the epsilon it prints is an honest (loose)
    bound for this noise, far above the target, and the budget is not enforced."""

    name = "dpfpl_reference"
    applied = "train"
    clipped = "the batch-mean gradient of the uploaded tensors, jointly, to dp.clip = C (not each example's)"
    sensitivity = "claimed C/B by the reference code; true 2C per step (two clipped batch means lie in one C-ball)"
    relation = "add/remove one training example (sample-level), as claimed"
    accountant = ("NOT a valid DP guarantee: sigma = sqrt(T ln(1/delta)) / epsilon (T = rounds, q = 1), noise std "
                  "sigma C/B; the ledger marks it valid=False and composes it at sigma/(2B), q = 1, every step")
    warning = ("dpfpl.dp_mode=reference reproduces the DP-FPL code's batch-gradient clipping and sigma = sqrt(T ln(1/delta))"
               "/epsilon: this is NOT a valid (epsilon, delta) guarantee; the ledger marks it valid=False and its printed "
               "epsilon is the honest bound at sensitivity 2C, far above dp.epsilon")

    def reference_sigma(self, rounds: int) -> float:
        """The reference code's sigma: q sqrt(T ln(1/delta)) / epsilon with q = 1 and T = `rounds`."""
        return math.sqrt(max(1, int(rounds)) * math.log(1.0 / self.dp.delta)) / self.dp.epsilon

    def noise_std(self, rounds: int, batch_size: int) -> float:
        """Std of the noise added to the clipped batch-mean gradient: sigma C / B (B = the batch size)."""
        return self.reference_sigma(rounds) * self.dp.clip / max(1, int(batch_size))

    def honest_multiplier(self, rounds: int, batch_size: int) -> float:
        """The noise relative to the true per-step sensitivity 2C: sigma / (2B)."""
        return self.noise_std(rounds, batch_size) / (2.0 * self.dp.clip)


def _dense(protos: dict[int, Tensor], num_classes: int, like: Tensor) -> Tensor:
    out = torch.zeros(num_classes, like.shape[1], dtype=torch.float32)
    for c, p in protos.items():
        out[c] = p.detach().float().cpu()
    return out


# ------------------------------------------------------------------------------------- resolution
def resolve(spec: ReleaseSpec, dp: Any, *, what: str) -> Optional[Mechanism]:
    """The mechanism that releases `what` under `dp` (None when DP is off: nothing is privatised).
    Raises ConfigError when this kind of release cannot be made private at `dp.level`."""
    if spec.kind == "public":
        return Public(dp)
    if not dp.enabled:
        return None
    level = dp.level
    if spec.kind == "dpsgd":
        return DPSGDMechanism(dp) if level == "sample" else ClientUpdate(dp)
    if spec.kind == "update":
        if level != "client":
            raise ConfigError(
                f"{what} is trained without per-example DP-SGD, so dp.level=sample cannot privatise it; "
                "use dp.level=client (the whole update is clipped and noised) or dp.epsilon=inf"
            )
        return ClientUpdate(dp)
    if spec.kind == "prototype":
        if level != "sample":
            raise ConfigError(f"{what} is a prototype release, not an update of the broadcast state; use dp.level=sample")
        return MECHANISMS.get(dp.prototypes)(dp)
    if spec.kind == "embedding":
        return EmbeddingRelease(dp)
    if spec.kind == "reference":
        if level != "sample":
            raise ConfigError(f"{what} reproduces a reference code's sample-level noise; use dp.level=sample")
        return DPFPLReference(dp)
    raise ConfigError(f"{what}: unknown release kind {spec.kind!r}")


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
    resolve_all(method.releases, dp, method=method.name)


def warnings_for(method: Any, dp: Any) -> list[str]:
    """The lines a run logs once for the mechanisms `method`'s uploads resolve to under `dp`."""
    lines = []
    for mech in resolve_all(method.releases, dp, method=method.name).values():
        if mech is not None and mech.warning and mech.warning not in lines:
            lines.append(mech.warning)
    return lines


def mechanism_table() -> list[dict[str, str]]:
    """One row per registered mechanism (README "Privacy")."""
    return [
        {"mechanism": n, "clipped": c.clipped, "sensitivity": c.sensitivity, "relation": c.relation, "accountant": c.accountant}
        for n, c in ((n, MECHANISMS.get(n)) for n in MECHANISMS.names())
    ]

