"""Noise calibration and privacy accounting.

Two families live here:

* Subsampled-Gaussian accounting for DP-SGD and client-level DP, delegated to Opacus
  (`get_noise_multiplier`, `RDPAccountant`, `PRVAccountant`) with every default pinned explicitly so
  an Opacus upgrade cannot silently change a calibration (SPEC 1.6).
* The non-subsampled Gaussian RDP calibration that the VPDR code uses for prototype releases
  (SPEC 3.2 item 8): classic Mironov conversion over a fixed grid of orders, bisection on sigma.

Opacus is imported lazily so that `import raysim.privacy` stays cheap.
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache
from typing import Iterable, Sequence

from raysim.errors import ConfigError

ACCOUNTANTS = ("rdp", "prv")
# How an RDP curve becomes (epsilon, delta) (dp.conversion): "tight" = Opacus' get_privacy_spent (Balle et al.
# 2020: rdp - (ln delta + ln alpha)/(alpha - 1) + ln((alpha - 1)/alpha), at Opacus' orders RDP_ALPHAS);
# "classic" = Mironov's rdp + ln(1/delta)/(alpha - 1) at the VPDR code's orders GAUSSIAN_ORDERS (SPEC 3.2
# item 8). Both are valid upper bounds; classic is looser, so it calibrates more noise at the same epsilon.
CONVERSIONS = ("tight", "classic")

# Opacus' RDP default orders, pinned: {1.1, 1.2, ..., 10.9} U {12, ..., 63}.
RDP_ALPHAS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])
EPSILON_TOLERANCE = 0.01  # bisection tolerance of get_noise_multiplier (Opacus default)
BISECTION_STEPS = 200  # halvings of [0, hi <= 1e6]: far past float resolution, so the bisection always ends
PRV_EPS_ERROR = 0.01  # PRV accountant's epsilon error (Opacus default); delta_error = delta / 1000

# Orders of the VPDR prototype-release calibration (SPEC 3.2 item 8).
GAUSSIAN_ORDERS: tuple[float, ...] = tuple(
    [round(1 + x / 10.0, 1) for x in range(1, 100)] + [float(a) for a in range(11, 64)] + [128.0, 256.0, 512.0]
)


# --------------------------------------------------------------------------------------------- checks
def _check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"unknown accountant {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")
    return accountant


def _check_conversion(conversion: str, accountant: str = "rdp") -> str:
    if conversion not in CONVERSIONS:
        raise ConfigError(f"unknown dp.conversion {conversion!r}; choose one of {', '.join(CONVERSIONS)}")
    if conversion == "classic" and accountant != "rdp":
        raise ConfigError("dp.conversion=classic converts an RDP curve; it needs dp.accountant=rdp (PRV has no RDP curve)")
    return conversion


def _check_delta(delta: float) -> float:
    try:
        delta = float(delta)
    except (TypeError, ValueError):
        raise ConfigError(f"delta must be a number in (0, 1), got {delta!r}") from None
    if not (0.0 < delta < 1.0):
        raise ConfigError(f"delta must lie in (0, 1), got {delta}")
    return delta


def _check_sample_rate(q: float) -> float:
    try:
        q = float(q)
    except (TypeError, ValueError):
        raise ConfigError(f"sample rate must be a number in (0, 1], got {q!r}") from None
    if not (0.0 < q <= 1.0):
        raise ConfigError(f"sample rate must lie in (0, 1] (batch size / dataset size), got {q}")
    return q


def _check_steps(steps: int, what: str = "steps") -> int:
    try:
        whole = not isinstance(steps, bool) and int(steps) == steps
    except (TypeError, ValueError, OverflowError):
        whole = False
    if not whole:
        raise ConfigError(f"{what} must be a whole number >= 1, got {steps!r}")
    steps = int(steps)
    if steps < 1:
        raise ConfigError(f"{what} must be >= 1, got {steps}")
    return steps


def _check_epsilon(epsilon: float) -> float:
    try:
        epsilon = float(epsilon)
    except (TypeError, ValueError):
        raise ConfigError(f"epsilon must be a positive number (or inf), got {epsilon!r}") from None
    if math.isnan(epsilon) or epsilon <= 0.0:
        raise ConfigError(f"epsilon must be > 0 (use inf to turn DP off), got {epsilon}")
    return epsilon


# ------------------------------------------------------------------------------- Opacus accountants
def _epsilon_kwargs(accountant: str) -> dict:
    if accountant == "rdp":
        return {"alphas": list(RDP_ALPHAS)}
    return {"eps_error": PRV_EPS_ERROR}


def _make_accountant(accountant: str):
    from opacus.accountants import PRVAccountant, RDPAccountant

    return RDPAccountant() if accountant == "rdp" else PRVAccountant()


def noise_multiplier(*, epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp") -> float:
    """Noise multiplier sigma such that `steps` compositions of the sampled Gaussian mechanism at
    rate `sample_rate` are (epsilon, delta)-DP (Opacus `get_noise_multiplier`, defaults pinned).
    `epsilon = inf` returns 0.0 (DP off)."""
    accountant = _check_accountant(accountant)
    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    sample_rate = _check_sample_rate(sample_rate)
    steps = _check_steps(steps)
    if math.isinf(epsilon):
        return 0.0
    return _noise_multiplier_cached(epsilon, delta, sample_rate, steps, accountant)


@lru_cache(maxsize=1024)
def _noise_multiplier_cached(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    from opacus.accountants.utils import get_noise_multiplier

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sigma = get_noise_multiplier(
                target_epsilon=epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=accountant,
                epsilon_tolerance=EPSILON_TOLERANCE,
                **_epsilon_kwargs(accountant),
            )
    except ValueError as exc:  # "The privacy budget is too low."
        raise ConfigError(
            f"cannot reach epsilon={epsilon} at delta={delta} with sample rate {sample_rate} over {steps} steps "
            f"(Opacus: {exc}); raise epsilon or delta, or take fewer steps"
        ) from None
    return float(sigma)


def epsilon_spent(history: Sequence[tuple[float, float, int]], *, delta: float, accountant: str = "rdp",
                  conversion: str = "tight") -> float:
    """Epsilon at `delta` of the composition of `history` = [(sigma, sample_rate, steps), ...], through
    `accountant` and (for rdp) the RDP-to-epsilon `conversion` (CONVERSIONS).

    Entries with 0 steps are ignored; an empty history spends 0; sigma 0 (no noise) spends inf."""
    accountant = _check_accountant(accountant)
    conversion = _check_conversion(conversion, accountant)
    delta = _check_delta(delta)
    hist: list[tuple[float, float, int]] = []
    for entry in history:
        try:
            sigma, q, steps = entry
        except (TypeError, ValueError):
            raise ConfigError(f"history entries are (sigma, sample_rate, steps), got {entry!r}") from None
        if int(steps) == 0:
            continue
        steps = _check_steps(steps)
        q = _check_sample_rate(q)
        sigma = float(sigma)
        if math.isnan(sigma) or sigma < 0:
            raise ConfigError(f"noise multiplier must be >= 0, got {sigma}")
        if sigma == 0.0:
            return math.inf
        hist.append((sigma, q, steps))
    if not hist:
        return 0.0
    if conversion == "classic":
        return classic_rdp_epsilon(hist, delta=delta)
    acc = _make_accountant(accountant)
    acc.history = list(hist)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = acc.get_epsilon(delta=delta, **_epsilon_kwargs(accountant))
    eps = float(eps)
    return math.inf if math.isnan(eps) else eps


# ------------------------------------------------------------- non-subsampled Gaussian (VPDR, SPEC 3.2)
@lru_cache(maxsize=4096)
def _rdp_curve(sigma: float, q: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    """RDP of one step at `orders`: alpha / (2 sigma^2) for q = 1 (the Gaussian mechanism), Opacus'
    compute_rdp for a sampled Gaussian."""
    if q >= 1.0:
        return tuple(a / (2.0 * sigma * sigma) for a in orders)
    from opacus.accountants.analysis import rdp as analysis

    return tuple(float(v) for v in analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders)))


def classic_rdp_epsilon(history: Sequence[tuple[float, float, int]], *, delta: float,
                        orders: Iterable[float] = GAUSSIAN_ORDERS) -> float:
    """Epsilon of the composition of `history` = [(sigma, q, steps), ...] (RDP summed over the entries)
    under the classic conversion min over orders of rdp(alpha) + ln(1/delta)/(alpha - 1) (Mironov 2017,
    Prop. 3; the VPDR code's conversion, SPEC 3.2 item 8). sigma 0 spends inf; no entry spends 0."""
    orders = tuple(float(a) for a in orders)
    if any(float(s) <= 0 for s, _, n in history if int(n) > 0):
        return math.inf
    total = [0.0] * len(orders)
    for s, q, n in history:
        if int(n) > 0:
            total = [t + int(n) * r for t, r in zip(total, _rdp_curve(float(s), float(q), orders))]
    if not any(int(n) > 0 for _, _, n in history):
        return 0.0
    log_inv_delta = math.log(1.0 / delta)
    return min(t + log_inv_delta / (a - 1.0) for t, a in zip(total, orders))


def classic_gaussian_multiplier(*, epsilon: float, delta: float) -> float:
    """The classical Gaussian mechanism's multiplier sigma / Delta = sqrt(2 ln(1.25/delta)) / epsilon
    (Dwork and Roth, Thm. A.1; fedtsp.txt Eq. 11 with Delta = 2C). Its proof covers epsilon < 1 only: use
    `analytic_gaussian_epsilon` for what a release at this multiplier really spends."""
    epsilon, delta = _check_epsilon(epsilon), _check_delta(delta)
    if math.isinf(epsilon):
        return 0.0
    return math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def analytic_gaussian_delta(multiplier: float, epsilon: float) -> float:
    """The exact delta(epsilon) of one Gaussian release with noise std `multiplier` x its L2 sensitivity
    (Balle and Wang 2018, Thm. 8): Phi(1/(2m) - eps m) - e^eps Phi(-1/(2m) - eps m). The second term is taken
    through log Phi (scipy's log_ndtr): e^eps alone overflows a float above eps ~ 709, where the product is
    still finite (it is below Phi(-1/(2m) - eps m) e^eps <= 1 / (2 sqrt(pi eps)))."""
    from scipy.special import log_ndtr

    m = float(multiplier)
    return _phi(0.5 / m - epsilon * m) - math.exp(epsilon + float(log_ndtr(-0.5 / m - epsilon * m)))


def analytic_gaussian_epsilon(multiplier: float, *, delta: float) -> float:
    """The smallest epsilon at which one Gaussian release with noise std `multiplier` x its sensitivity
    is (epsilon, delta)-DP (the analytic Gaussian mechanism, Balle and Wang 2018, Thm. 8; exact, so
    tighter than any RDP conversion for a single release). Bisection to 1e-9, rounded up. The bracket doubles from
    1 and gives up past 1e4, so an epsilon above 8,192 (its last doubling under 1e4) is reported as inf: an upper
    bound, and no run's budget is near it."""
    delta = _check_delta(delta)
    if not multiplier > 0:
        return math.inf
    if analytic_gaussian_delta(multiplier, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while analytic_gaussian_delta(multiplier, hi) > delta:
        hi *= 2.0
        if hi > 1e4:
            return math.inf
    while hi - lo > 1e-9:
        mid = 0.5 * (lo + hi)
        if analytic_gaussian_delta(multiplier, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def gaussian_rdp_epsilon(sigma: float, *, delta: float, releases: int, orders: Iterable[float] = GAUSSIAN_ORDERS) -> float:
    """Epsilon of `releases` compositions of the Gaussian mechanism with multiplier `sigma`
    (RDP alpha / (2 sigma^2) each), converted with the classic bound rdp + ln(1/delta)/(alpha-1)."""
    if sigma <= 0:
        return math.inf
    log_inv_delta = math.log(1.0 / delta)
    return min(releases * a / (2.0 * sigma * sigma) + log_inv_delta / (a - 1.0) for a in orders)


def gaussian_rdp_sigma(*, epsilon: float, delta: float, releases: int) -> float:
    """Smallest multiplier (to bisection tolerance 1e-3 on [1e-3, 1e4]) whose `releases`-fold
    Gaussian composition is (epsilon, delta)-DP under `gaussian_rdp_epsilon` (SPEC 3.2 item 8).
    `epsilon = inf` returns 0.0."""
    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    releases = _check_steps(releases, "releases")
    if math.isinf(epsilon):
        return 0.0
    lo, hi = 1e-3, 1e4
    if gaussian_rdp_epsilon(hi, delta=delta, releases=releases) > epsilon:
        raise ConfigError(
            f"epsilon={epsilon} at delta={delta} over {releases} releases needs a noise multiplier above {hi:g}; "
            "raise epsilon or delta"
        )
    while hi - lo > 1e-3:
        mid = 0.5 * (lo + hi)
        if gaussian_rdp_epsilon(mid, delta=delta, releases=releases) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def calibrate_multiplier(
    *, epsilon: float, delta: float, plan: Sequence[tuple[float, int]], pure: float = 0.0, accountant: str = "rdp",
    conversion: str = "tight",
) -> float:
    """One noise multiplier sigma (relative to each mechanism's sensitivity) for a client whose run costs
    the Gaussian compositions `plan` = [(sample_rate, steps), ...] plus a pure-DP part `pure`, so that the
    whole composes to (epsilon, delta) through `accountant`, the ledger's own (one conversion everywhere).
    A single (q, steps) entry is Opacus' `get_noise_multiplier` exactly; several are bisected the same way
    (the result's epsilon lies in [target - EPSILON_TOLERANCE, target])."""
    accountant = _check_accountant(accountant)
    conversion = _check_conversion(conversion, accountant)
    epsilon = _check_epsilon(epsilon)
    if math.isinf(epsilon):
        return 0.0
    merged: dict[float, int] = {}
    for q, steps in plan:
        if int(steps) > 0:
            merged[float(q)] = merged.get(float(q), 0) + int(steps)
    target = epsilon - float(pure)
    if target <= 0:
        raise ConfigError(f"the pure-DP part of the releases ({pure:g}) uses the whole epsilon={epsilon:g}; raise epsilon")
    if not merged:
        return 0.0
    if conversion == "classic":
        return _classic_multiplier(target, delta, merged)
    if len(merged) == 1:
        (q, steps), = merged.items()
        return noise_multiplier(epsilon=target, delta=delta, sample_rate=q, steps=steps, accountant=accountant)

    def eps_at(sigma: float) -> float:
        return epsilon_spent([(sigma, q, n) for q, n in merged.items()], delta=delta, accountant=accountant)

    lo, hi = 0.0, 10.0
    while eps_at(hi) > target:
        hi *= 2
        if hi > 1e6:
            raise ConfigError(f"cannot reach epsilon={epsilon} at delta={delta} with these releases; raise epsilon or delta")
    for _ in range(BISECTION_STEPS):  # eps_at(hi) <= target throughout: hi is always a valid answer
        mid = 0.5 * (lo + hi)
        eps = eps_at(mid)
        if eps > target:
            lo = mid
        else:
            hi = mid
            if eps >= target - EPSILON_TOLERANCE:
                return hi
    # the accountant's epsilon jumped over the tolerance band (a discretised one can step): the smallest multiplier
    # found that meets the target, which spends at most it
    return hi


def _classic_multiplier(target: float, delta: float, merged: dict[float, int]) -> float:
    """The smallest multiplier (bisection on [1e-3, 1e4] to 1e-4, the upper end kept, so the result spends
    at most `target`) at which `merged` = {q: steps} composes to `target` under the classic conversion.
    Finer than SPEC's 1e-3 so a run's sigma matches SPEC's two-decimal worked values."""
    delta = _check_delta(delta)

    def eps_at(sigma: float) -> float:
        return classic_rdp_epsilon([(sigma, q, n) for q, n in merged.items()], delta=delta)

    lo, hi = 1e-3, 1e4
    if eps_at(hi) > target:
        raise ConfigError(f"cannot reach epsilon={target:g} at delta={delta} with these releases (classic conversion); "
                          "raise epsilon or delta")
    while hi - lo > 1e-4:
        mid = 0.5 * (lo + hi)
        if eps_at(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi
