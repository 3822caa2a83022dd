"""A per-client record of every privacy-consuming release, and the budget check before each one.

Two kinds of release are composed:

* Gaussian releases `(sigma, sample_rate, steps)`: DP-SGD steps (q = B/n), client-level DP rounds
  (q = participation) and prototype/embedding releases (q = 1, sigma relative to the sensitivity).
  All of them are composed together through the ledger's Opacus accountant (RDP or PRV) at the
  ledger's delta.
* Releases carrying an explicit `epsilon` (e.g. the pure-DP Laplace top-k partition of VPP, whose
  sigma is irrelevant), and with it the `delta` they spend (0 for pure DP; an analytic Gaussian
  release's own delta): they add to the total by basic sequential composition,
  (eps1, delta1) + (eps2, delta2) = (eps1 + eps2, delta1 + delta2), the Gaussian part being converted
  at the ledger's delta less what those releases spend.

The ledger's `conversion` (dp.conversion: tight | classic, privacy/accountant.py CONVERSIONS) says how the
RDP curve becomes epsilon; a release's `note` says what its epsilon covers when that is not everything
the client sends (`scope()`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from raysim.errors import ConfigError, PrivacyBudgetExceeded

from .accountant import RDP_ALPHAS, _check_accountant, _check_conversion, _check_delta, classic_rdp_epsilon, epsilon_spent


@lru_cache(maxsize=4096)
def _rdp_per_step(sigma: float, q: float) -> tuple[float, ...]:
    """RDP of one sampled-Gaussian step at Opacus' (pinned) orders; RDP composes additively, so the
    ledger scales this by the step count instead of recomputing it (same numbers as RDPAccountant)."""
    from opacus.accountants.analysis import rdp as analysis

    return tuple(float(v) for v in analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(RDP_ALPHAS)))


def _rdp_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    import warnings

    import numpy as np
    from opacus.accountants.analysis import rdp as analysis

    if any(s == 0.0 for s, _, _ in history):
        return math.inf
    total = np.zeros(len(RDP_ALPHAS))
    for s, q, n in history:
        total += n * np.asarray(_rdp_per_step(s, q))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps, _ = analysis.get_privacy_spent(orders=list(RDP_ALPHAS), rdp=total, delta=delta)
    eps = float(eps)
    return math.inf if math.isnan(eps) else eps


@dataclass
class Release:
    """One privacy-consuming event. `steps` compositions of a Gaussian mechanism with multiplier
    `sigma` at sampling rate `sample_rate`; or, when `epsilon` is set, a separately analysed release
    (pure-DP Laplace, ...) costing that epsilon, composed by basic composition."""

    mechanism: str
    sigma: float
    sample_rate: float
    steps: int
    round: int
    epsilon: float | None = None
    # how the DP-SGD batches were drawn: "poisson" (what the accountant assumes) or "shuffle" (the papers'
    # code: fixed-size shuffled batches, accounted as if Poisson); "" for releases without sampling
    sampling: str = ""
    valid: bool = True  # False: a reference code's noise, not a valid guarantee at the claimed epsilon
    # what the reference code would report for this release (its target epsilon), kept beside the ledger's
    # own epsilon; None for a valid release
    claimed_epsilon: float | None = None
    delta: float = 0.0  # with `epsilon`: the delta this release spends (0 = pure DP)
    note: str = ""  # what this release's epsilon covers, when not everything the client sends


class PrivacyLedger:
    """Releases of one client, with the epsilon they spend at `delta` and a budget `target_epsilon`."""

    def __init__(self, target_epsilon: float, delta: float, accountant: str = "rdp", conversion: str = "tight") -> None:
        target_epsilon = float(target_epsilon)
        if math.isnan(target_epsilon) or target_epsilon <= 0:
            raise ConfigError(f"target epsilon must be > 0 (inf for no budget), got {target_epsilon}")
        self.target_epsilon = target_epsilon
        self.delta = _check_delta(delta)
        self.accountant = _check_accountant(accountant)
        self.conversion = _check_conversion(conversion, self.accountant)
        self.releases: list[Release] = []
        self._cache: float | None = None

    # -- composition ------------------------------------------------------------------------
    def _compose(self, releases: list[Release]) -> float:
        pure, pure_delta = 0.0, 0.0
        merged: dict[tuple[float, float], int] = {}  # (sigma, q) -> steps; the mechanism name does not change the math
        for r in releases:
            if r.epsilon is not None:
                pure += float(r.epsilon)
                pure_delta += float(r.delta)
                continue
            if int(r.steps) <= 0:
                continue
            key = (float(r.sigma), float(r.sample_rate))
            merged[key] = merged.get(key, 0) + int(r.steps)
        if math.isinf(pure):
            return math.inf
        history = [(s, q, n) for (s, q), n in merged.items()]
        if pure_delta > self.delta * (1 + 1e-9):
            return math.inf  # the separately analysed releases alone spend more than the ledger's delta
        rest = self.delta - pure_delta  # what is left of delta for the Gaussian compositions
        if not history:
            gauss = 0.0
        elif rest <= self.delta * 1e-9:  # nothing left of delta (up to float rounding of the sum)
            return math.inf
        elif self.conversion == "classic":
            gauss = classic_rdp_epsilon(history, delta=rest)
        elif self.accountant == "rdp":  # fast path, identical to epsilon_spent(..., accountant="rdp")
            gauss = _rdp_epsilon(history, rest)
        else:
            gauss = epsilon_spent(history, delta=rest, accountant=self.accountant)
        return pure + gauss

    def epsilon(self) -> float:
        """Epsilon spent so far at the ledger's delta (0 when nothing was released)."""
        if self._cache is None:
            self._cache = self._compose(self.releases)
        return self._cache

    def epsilon_if(self, release: Release) -> float:
        """Epsilon that would be spent after also making `release`."""
        return self._compose(self.releases + [release])

    def check(self, release: Release) -> None:
        """Raise `PrivacyBudgetExceeded` if `release` would take the client past its budget (not enforced for
        an invalid release, or once the ledger holds one: there is no guarantee left to protect)."""
        if math.isinf(self.target_epsilon) or not release.valid or not self.valid:
            return
        eps = self.epsilon_if(release)
        if eps > self.target_epsilon * (1 + 1e-6):
            raise PrivacyBudgetExceeded(
                f"{release.mechanism} release in round {release.round} would spend epsilon={eps:.4g} "
                f"(delta={self.delta:g}), past the target epsilon={self.target_epsilon:g}"
            )

    def record(self, release: Release) -> None:
        """Add `release` to the ledger (call `check` first to enforce the budget)."""
        if not isinstance(release, Release):
            raise TypeError(f"expected a Release, got {type(release).__name__}")
        self.releases.append(release)
        self._cache = None

    @property
    def valid(self) -> bool:
        """False when a release was made with a reference code's noise that is not a valid guarantee."""
        return all(r.valid for r in self.releases)

    def claimed_epsilon(self) -> float | None:
        """The epsilon a reference code would print for these releases (the largest one its invalid releases
        claim), beside `epsilon()`, the ledger's own; None when no release claims one."""
        claims = [float(r.claimed_epsilon) for r in self.releases if r.claimed_epsilon is not None]
        return max(claims) if claims else None

    def scope(self) -> list[str]:
        """What the ledger's epsilon covers, where a release says it is not everything the client sends
        (e.g. FedTSP's paper mode: the description embedding only); empty when it covers every upload."""
        return list(dict.fromkeys(r.note for r in self.releases if r.note))

    def remaining(self) -> float:
        return self.target_epsilon - self.epsilon()

    # -- checkpoints ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "target_epsilon": float(self.target_epsilon),
            "delta": float(self.delta),
            "accountant": self.accountant,
            "conversion": self.conversion,
            "releases": [
                {k: (v if v is None or isinstance(v, (str, bool)) else (int(v) if k in ("steps", "round") else float(v)))
                 for k, v in asdict(r).items()}
                for r in self.releases
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PrivacyLedger":
        ledger = cls(d["target_epsilon"], d["delta"], d.get("accountant", "rdp"), d.get("conversion", "tight"))
        for r in d.get("releases", []):
            ledger.releases.append(Release(**r))
        return ledger

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(target_epsilon={self.target_epsilon}, delta={self.delta}, accountant={self.accountant!r}, "
            f"conversion={self.conversion!r}, "
            f"releases={len(self.releases)})"
        )
