"""The privacy side of a client host: per client, the mechanisms its uploads resolve to, one calibrated
noise multiplier, the one ledger, and the check that nothing leaves the client un-privatised.

Per (round, client) the host opens a `RoundPrivacy`, the handle the method's `local_train` receives:

- `batches(n, B, rng)`: the mini-batches of one epoch (Poisson-sampled when DP-SGD runs with
  dp.sampling=poisson, else shuffled fixed-size batches, the papers' code);
- `backward(per_sample_loss, dp_params={name: tensor}, other_params=[...], public_loss=None)`: DP-SGD on
  the named upload tensors (a plain backward when DP is off);
- `release(name, ...)`: the host computes and privatises a prototype or embedding release;

then `close(upload)` checks every uploaded tensor against its declared release (fail closed), applies the
user-level update release (dp.level=client), and records what was spent in the client's ledger. A
method says *what* it releases; this module does the *how*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union, cast

import torch
from torch import Tensor

from raysim.errors import UploadViolation
from raysim.sampling import generator

from .accountant import calibrate_multiplier
from .dpsgd import DPSGD, BatchClipSGD, NoDP, check_class_labels
from .ledger import PrivacyLedger, Release
from .mechanisms import BudgetShare, Mechanism, Training, resolve_all


@dataclass
class ClientPrivacyState:
    """What the host keeps per client (checkpointed with its private state)."""

    multiplier: Optional[float] = None  # calibrated once, at the first participation
    ledger: Optional[PrivacyLedger] = None
    once: dict[str, Tensor] = field(default_factory=dict)  # one-shot releases already made (re-sending is free)
    # under a method's budget shares: each release's own multiplier, calibrated once
    multipliers: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"multiplier": self.multiplier, "ledger": self.ledger.to_dict() if self.ledger else None,
                "once": dict(self.once), "multipliers": dict(self.multipliers)}

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "ClientPrivacyState":
        if not d:
            return cls()
        ledger = PrivacyLedger.from_dict(d["ledger"]) if d.get("ledger") else None
        return cls(d.get("multiplier"), ledger, dict(d.get("once") or {}), dict(d.get("multipliers") or {}))


class HostPrivacy:
    """Privacy state of the clients one host holds (`dp` is the run's DPConfig)."""

    def __init__(self, *, dp: Any, method: Any, seed: int, batch_size: int, releases_per_client: Callable[[int], int]) -> None:
        self.dp = dp
        self.method = method
        self.seed = seed
        self.batch_size = batch_size
        self.releases_per_client = releases_per_client  # participations used to calibrate (SPEC: participated or all)
        self.mechanisms: dict[str, Optional[Mechanism]] = resolve_all(method.releases, dp, method=method.name)
        self.states: dict[int, ClientPrivacyState] = {}

    # -- state ---------------------------------------------------------------------------------
    def state(self, cid: int) -> ClientPrivacyState:
        return self.states.setdefault(cid, ClientPrivacyState())

    def load(self, cid: int, saved: Optional[dict[str, Any]]) -> None:
        self.states[cid] = ClientPrivacyState.from_dict(saved)

    def snapshot(self, cid: int) -> Optional[dict[str, Any]]:
        """A copy of the client's privacy state (calibration, ledger, one-shot releases), to `restore`
        when its round is abandoned before anything left it (raysim/engine/hosts.py, on_client_error=drop)."""
        st = self.states.get(cid)
        return None if st is None else st.to_dict()

    def restore(self, cid: int, snap: Optional[dict[str, Any]]) -> None:
        if snap is None:
            self.states.pop(cid, None)
        else:
            self.states[cid] = ClientPrivacyState.from_dict(snap)

    def epsilon(self, cid: int) -> float:
        if not self.dp.enabled:
            return math.inf
        ledger = self.state(cid).ledger
        return float(ledger.epsilon()) if ledger is not None else 0.0

    def ledger(self, cid: int) -> PrivacyLedger:
        st = self.state(cid)
        if st.ledger is None:
            st.ledger = PrivacyLedger(self.dp.epsilon, self.dp.delta, self.dp.accountant, self._conversion())
        return st.ledger

    # -- calibration ---------------------------------------------------------------------------
    def _conversion(self) -> str:
        return str(getattr(self.dp, "conversion", "tight"))

    def _private_names(self, cid: int) -> list[str]:
        names = self.method.releases_of(cid)
        return [n for n in names if (m := self.mechanisms.get(n)) is not None and m.private]

    def shares(self) -> Optional[dict[str, BudgetShare]]:
        """The method's own split of each client's budget over its releases (None: one multiplier for the
        whole run, calibrated jointly over every release)."""
        shares = getattr(self.method, "budget_shares", None)
        return shares() if self.dp.enabled and shares is not None else None

    def plan(self, cid: int, num_train: int, names: Optional[list[str]] = None,
             epsilon: Optional[float] = None) -> tuple[list[tuple[float, int]], float, int]:
        """The Gaussian compositions of the client's whole run [(q, steps)], its pure-DP epsilon, and the
        number of participations it is calibrated for; of the releases `names` only (default: every private
        one), with pure-DP parts taken from `epsilon` (default dp.epsilon)."""
        rounds = max(1, self.releases_per_client(cid))
        entries: list[tuple[float, int]] = []
        pure = 0.0
        seen: set[str] = set()
        specs = self.method.releases
        budget = self.dp.epsilon if epsilon is None else epsilon
        for name in self._private_names(cid):
            if names is not None and name not in names:
                continue
            mech = self.mechanisms[name]
            assert mech is not None  # _private_names holds only uploads that resolved to a mechanism
            if mech.joint and mech.name in seen:
                continue  # one DP-SGD step / one update release covers every tensor it privatises
            seen.add(mech.name)
            p = mech.plan(num_train=num_train, steps_per_round=self.method.dp_steps_per_round(num_train),
                             batch_size=self.batch_size)
            times = 1 if specs[name].once else rounds
            if p.steps:
                entries.append((p.q, p.steps * times))
            pure += p.pure_share * budget
        return entries, pure, rounds

    def multiplier(self, cid: int, num_train: int, name: Optional[str] = None) -> float:
        """The client's noise multiplier: one for its whole run, or, under the method's budget shares, the
        one of release `name` (calibrated on that release's compositions at its share of dp.epsilon)."""
        shares = self.shares()
        if shares:
            return self._share_multiplier(cid, num_train, shares, name)
        st = self.state(cid)
        if st.multiplier is None:
            entries, pure, _ = self.plan(cid, num_train)
            st.multiplier = calibrate_multiplier(epsilon=self.dp.epsilon, delta=self.dp.delta, plan=entries,
                                                 pure=pure, accountant=self.dp.accountant, conversion=self._conversion())
        return st.multiplier

    def _share_multiplier(self, cid: int, num_train: int, shares: dict[str, BudgetShare], name: Optional[str]) -> float:
        from raysim.errors import ConfigError

        from .accountant import classic_gaussian_multiplier

        private = self._private_names(cid)
        if name is None or name not in shares:
            raise ConfigError(f"{self.method.name} splits its budget over {sorted(shares)}, but {name or 'a training step'!r} "
                              f"has no share; every private release ({', '.join(private)}) needs one")
        st = self.state(cid)
        if name not in st.multipliers:
            share = shares[name]
            eps = share.share / self._shares_held(cid, shares) * self.dp.epsilon
            entries, pure, _ = self.plan(cid, num_train, names=[name], epsilon=eps)
            if pure:
                raise ConfigError(f"{self.method.name}'s budget shares calibrate Gaussian releases; {name!r} has a pure-DP "
                                  f"part ({cast(Mechanism, self.mechanisms[name]).name}: it spends dp.epsilon itself); "
                                  "use dp.prototypes=igpp")
            if share.calibration == "classic_gaussian":
                if entries != [(1.0, 1)] or len(private) != 1:
                    raise ConfigError(f"{name!r}: the classical Gaussian calibration covers one release that is the "
                                      f"client's only private one (it spends the whole delta); the client releases {private}")
                st.multipliers[name] = classic_gaussian_multiplier(epsilon=eps, delta=self.dp.delta)
            else:
                st.multipliers[name] = calibrate_multiplier(epsilon=eps, delta=self.dp.delta, plan=entries, pure=0.0,
                                                            accountant=self.dp.accountant, conversion=self._conversion())
        return st.multipliers[name]

    def _shares_held(self, cid: int, shares: dict[str, BudgetShare]) -> float:
        """The sum of the shares of the private releases client `cid` makes over its run: the shares are
        renormalised over them, so a client that makes only some (FedTSP's clients other than the dp client
        release no embedding) spends its whole dp.epsilon on those, in the shares' proportions. A
        classical-Gaussian share is the client's only private release (checked), so it stays whole."""
        held = sum(shares[n].share for n in self._private_names(cid) if n in shares)
        return held if held > 0 else 1.0

    def gaussian_release(self, cid: int, name: str, mechanism: str, multiplier: float, round_idx: int) -> Release:
        """The ledger entry of one Gaussian release of `name` (q = 1, one step) at `multiplier`: composed
        through the ledger's accountant, or, for a classical-Gaussian share, the exact epsilon of that noise at
        the run's delta (the analytic Gaussian mechanism), with the share's note on what it covers."""
        from .accountant import analytic_gaussian_epsilon

        share = (self.shares() or {}).get(name)
        if share is not None and share.calibration == "classic_gaussian":
            eps = analytic_gaussian_epsilon(multiplier, delta=self.dp.delta)
            return Release(mechanism, multiplier, 1.0, 1, round_idx, epsilon=eps, delta=float(self.dp.delta), note=share.note)
        return Release(mechanism, multiplier, 1.0, 1, round_idx, note=share.note if share is not None else "")

    # -- one round -------------------------------------------------------------------------------
    def open(self, cid: int, round_idx: int, num_train: int, shared: dict[str, Tensor]) -> "RoundPrivacy":
        return RoundPrivacy(self, cid, round_idx, num_train, shared)


class RoundPrivacy:
    """The privacy handle of one (round, client): what `local_train` may ask, and the host's check after."""

    def __init__(self, host: HostPrivacy, cid: int, round_idx: int, num_train: int, shared: dict[str, Tensor]) -> None:
        self.host, self.cid, self.round, self.num_train = host, cid, round_idx, num_train
        self.shared = shared
        self.released: dict[str, Tensor] = {}
        self.pending: list[Release] = []
        names = host._private_names(cid)
        # the uploads a training mechanism privatises (DP-SGD, or a reference code's noise reproduced)
        self.trained_by = [n for n in names if cast(Mechanism, host.mechanisms[n]).applied == "train"]
        self._training: Optional[Training] = None
        if self.trained_by:
            mechs = {cast(Mechanism, host.mechanisms[n]).name for n in self.trained_by}
            assert len(mechs) == 1, f"a method's uploads train under one training mechanism, not {sorted(mechs)}"
            self._training = cast(Mechanism, host.mechanisms[self.trained_by[0]]).train(self)
        self.poisson = self._training is not None and self._training.poisson
        self._sgd: Union[DPSGD, BatchClipSGD, NoDP] = self._training.stepper if self._training is not None else NoDP()

    @property
    def enabled(self) -> bool:
        """True when DP-SGD (or a reproduced reference noise) noises the tensors passed as `dp_params`."""
        return self._training is not None

    @property
    def stepper(self) -> Union[DPSGD, BatchClipSGD, NoDP]:
        """The step object behind `backward` (read by the client-batched path, raysim/engine/batched.py)."""
        return self._sgd

    # -- what the method calls -------------------------------------------------------------------
    def batches(self, n: int, batch_size: int, rng: torch.Generator) -> Iterator[Tensor]:
        from raysim.sampling import batch_indices, batches_per_epoch, poisson_batches

        if self.poisson:
            return poisson_batches(n, batch_size, rng, batches_per_epoch(n, batch_size))
        return batch_indices(n, batch_size, rng)

    def backward(self, per_sample_loss: Tensor, dp_params, other_params=(), public_loss: Optional[Tensor] = None) -> None:
        self._sgd.backward(per_sample_loss, dp_params, other_params, public_loss=public_loss)

    def release(self, name: str, value: Union[Tensor, Callable[[], Tensor], None] = None, *, features: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, num_classes: int = 0, clip: float = 0.0,
                assignments: Optional[Tensor] = None, unclipped: bool = False) -> Tensor:
        """A release the host makes: `prototype` uploads from (features, labels) -> (num_classes, d) class
        means (noised by the run's prototype mechanism under DP; classes the client lacks are 0), or with
        `assignments` (per-example cluster ids within the class) the (M, d) cluster centres, class by class;
        `embedding` uploads from `value` (a tensor or a function computing it, called only if this one-shot
        release was not made before), clipped to `clip` as a whole and noised (std 2 `clip` x the multiplier);
        `unclipped=True` adds that noise to the tensor as it is (a reference code's noise: no bounded
        sensitivity, so the ledger records it as not valid, epsilon inf, never as a guarantee)."""
        spec = self.host.method.releases.get(name)
        if spec is None or spec.kind not in ("prototype", "embedding"):
            raise UploadViolation(f"{self.host.method.name} does not declare {name!r} as a prototype or embedding release")
        mech = self.host.mechanisms.get(name)
        if mech is not None and mech.private and name not in self.host.method.releases_of(self.cid):
            # _mechanism() would find no mechanism for it and the release would leave un-noised
            raise UploadViolation(f"client {self.cid} does not release {name!r} ({self.host.method.name}.releases_of("
                                  f"{self.cid}) = {self.host.method.releases_of(self.cid)}): a private release is made "
                                  "only by the clients that declare it")
        st = self.host.state(self.cid)
        if spec.once and name in st.once:
            out = st.once[name]  # already released: sending it again is post-processing
        elif spec.kind == "prototype":
            assert features is not None and labels is not None, f"the prototype release {name!r} needs features and labels"
            check_class_labels(name, labels, num_classes)
            out = self._prototypes(name, features, labels, num_classes, assignments)
        else:
            tensor = value() if callable(value) else value
            assert tensor is not None, f"the embedding release {name!r} needs a value"
            out = self._embedding(name, tensor, clip, unclipped)
        if spec.once:
            st.once[name] = out
        self.released[name] = out
        return out.clone()

    def _mechanism(self, name: str) -> Optional[Mechanism]:
        """The mechanism of a release this client makes (None: DP off). Only private mechanisms serve prototype and
        embedding releases, and `release` has refused those the client does not declare (releases_of)."""
        return self.host.mechanisms.get(name)

    def _record(self, release: Release) -> None:
        ledger = self.host.ledger(self.cid)
        ledger.check(release)
        self.pending.append(release)

    def _prototypes(self, name: str, features: Tensor, labels: Tensor, num_classes: int,
                    assignments: Optional[Tensor] = None) -> Tensor:
        mech = self._mechanism(name)
        features, labels = features.detach().float().cpu(), labels.detach().long().cpu()
        if assignments is not None:
            assignments = assignments.detach().long().cpu()
        if mech is None:  # DP off: the clean class means (or cluster centres)
            return NoDP().release(name, features=features, labels=labels, num_classes=num_classes, assignments=assignments)
        z = self.host.multiplier(self.cid, self.num_train, name)
        rounds = max(1, self.host.releases_per_client(self.cid))  # the releases it was calibrated for
        gen = generator(self.host.seed, "dp-release", name, self.round, self.cid)
        # a prototype upload resolves to the mechanism dp.prototypes names (a registered release mechanism)
        out, extra = mech.apply(features, labels, num_classes, multiplier=z, generator=gen, rounds=rounds,  # type: ignore[attr-defined]
                                assignments=assignments)
        if extra.get("pure_epsilon"):
            self._record(Release(f"{mech.name}_topk", 0.0, 1.0, 1, self.round, epsilon=extra["pure_epsilon"]))
        self._record(self.host.gaussian_release(self.cid, name, mech.name, z, self.round))
        return out

    def _embedding(self, name: str, value: Tensor, clip: float, unclipped: bool = False) -> Tensor:
        mech = self._mechanism(name)
        if mech is None:
            return NoDP().release(name, value)
        if not (clip > 0 and math.isfinite(clip)):
            raise ValueError(f"the embedding release {name!r} needs a clip radius C > 0 (its sensitivity is 2C; e.g. "
                             f"fedtsp.dp_clip), got clip={clip}")
        z = self.host.multiplier(self.cid, self.num_train, name)
        gen = generator(self.host.seed, "dp-release", name, self.round, self.cid)
        release = self.host.gaussian_release(self.cid, name, mech.name, z, self.round)
        if unclipped:  # no bounded sensitivity: no epsilon can be claimed, so none is recorded as spent
            release = Release(f"{mech.name}_unclipped", 0.0, 1.0, 1, self.round, epsilon=math.inf, valid=False,
                              claimed_epsilon=float(self.host.dp.epsilon), note=release.note)
        self._record(release)
        return mech.apply(value.detach().float().cpu(), clip=clip, multiplier=z, generator=gen,  # type: ignore[attr-defined]
                          unclipped=unclipped)

    def hand_on_optimizer(self) -> None:
        """train.optimizer_state=shared (methods/base.py OptimizerCarry): this client's SGD momentum, a running sum of its
        gradients (un-noised for its private tensors), goes on into the next client's training and so into uploads no
        noise of this client's covers. Under DP that is recorded, not hidden: an invalid release (sigma 0, so the
        ledger's epsilon is inf) that claims dp.epsilon, the epsilon the official code reports."""
        if not self.host.dp.enabled:
            return
        self.pending.append(Release("shared_optimizer_state", 0.0, 1.0, 1, self.round, valid=False,
                                    claimed_epsilon=float(self.host.dp.epsilon),
                                    note="does not hold: train.optimizer_state=shared hands each client's SGD momentum "
                                         "(un-noised for its private tensors) to the next client's training"))

    # -- what the host does after local training ---------------------------------------------------
    def close(self, upload: dict[str, Any]) -> dict[str, Tensor]:
        """Check every uploaded tensor against its declared release, apply the update release, and record
        the round's releases in the ledger. Raises UploadViolation (fail closed)."""
        method = self.host.method
        declared = method.releases
        clean: dict[str, Tensor] = {}
        for k, v in upload.items():
            if k not in declared:
                raise UploadViolation(
                    f"client {self.cid} tried to upload {k!r}, which {method.name} does not declare as shared "
                    f"(declared: {sorted(declared)})"
                )
            if not isinstance(v, Tensor):
                raise UploadViolation(f"client {self.cid}: upload {k!r} must be a tensor, got {type(v).__name__}")
            clean[k] = v.detach().to("cpu", copy=True)
        if self.host.dp.enabled:
            self._verify(clean, declared)
            clean = self._update_release(clean)
        done = self._training.done() if self._training is not None else None
        if done is not None:
            self.pending.insert(0, done)
        if self.pending:
            ledger = self.host.ledger(self.cid)
            for r in self.pending:
                ledger.record(r)
        return clean

    def _verify(self, clean: dict[str, Tensor], declared: dict[str, Any]) -> None:
        """Each upload's mechanism checks it was privatised as declared (fail closed)."""
        for k, v in clean.items():
            mech = self.host.mechanisms.get(k)
            if mech is not None:
                mech.verify(self, k, v, declared[k].kind)

    def _update_release(self, clean: dict[str, Tensor]) -> dict[str, Tensor]:
        """dp.level=client: clip the whole update (upload - broadcast) of every update-released tensor to C
        and add Gaussian noise of std 2C sigma (replace-one sensitivity 2C); one release per participation."""
        names = [k for k in clean if (m := self.host.mechanisms.get(k)) is not None and m.applied == "update"]
        if not names:
            return clean
        for k in names:
            if k not in self.shared or self.shared[k].shape != clean[k].shape:
                raise UploadViolation(f"client {self.cid}: {k!r} is released as an update but is not an update of a broadcast tensor")
        mech = cast(Mechanism, self.host.mechanisms[names[0]])
        z = self.host.multiplier(self.cid, self.num_train)
        self._record(Release(mech.name, z, 1.0, 1, self.round))
        base = {k: self.shared[k].detach().cpu() for k in names}
        noisy = mech.apply({k: clean[k] - base[k] for k in names}, multiplier=z,  # type: ignore[attr-defined]
                           generator=generator(self.host.seed, "dp-update", self.round, self.cid))
        return {**clean, **{k: base[k] + noisy[k] for k in names}}
