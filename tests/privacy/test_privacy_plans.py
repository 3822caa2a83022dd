"""The calibration of a client's whole plan, the embedding release's clip, and the ledger through a
checkpoint: each test written from a mutant that survived the suite (docs/testing.md, "Mutation testing").

`calibrate_multiplier` with several (sample_rate, steps) entries bisects its own way (one entry is Opacus'
`get_noise_multiplier`); these tests pin what a caller relies on: the result spends at most the target and
not much less (it is the smallest multiplier to the bisection's tolerance), entries of one rate merge, a
zero-step entry costs nothing, the pure-DP part is taken off the target, and the impossible cases are
refused with a message that says what to raise."""

from __future__ import annotations

import math

import pytest
import torch

from raysim.errors import ConfigError
from raysim.privacy.accountant import EPSILON_TOLERANCE, calibrate_multiplier, epsilon_spent, noise_multiplier
from raysim.privacy.ledger import PrivacyLedger, Release

DELTA = 1e-5
PLAN = [(1.0, 20), (0.1, 200)]  # a prototype release per round plus DP-SGD steps at q = 0.1: two rates


def spent(sigma: float, plan, delta: float = DELTA) -> float:
    merged: dict[float, int] = {}
    for q, n in plan:
        if n > 0:
            merged[q] = merged.get(q, 0) + n
    return epsilon_spent([(sigma, q, n) for q, n in merged.items()], delta=delta)


@pytest.mark.parametrize("eps", [0.5, 1.0, 8.0])
def test_a_two_rate_plan_spends_the_target_to_the_bisection_tolerance(eps):
    sigma = calibrate_multiplier(epsilon=eps, delta=DELTA, plan=PLAN)
    got = spent(sigma, PLAN)
    # the bisection stops once the spent epsilon is in [target - EPSILON_TOLERANCE, target]; 1e-9 for the
    # accountant's own float rounding when called again
    assert eps - EPSILON_TOLERANCE - 1e-9 <= got <= eps + 1e-9
    # smallest to that tolerance: 2% less noise spends more than the target (the curve is steep here:
    # at these settings 2% of sigma moves epsilon by well over the 0.01 tolerance)
    assert spent(0.98 * sigma, PLAN) > eps


def test_a_two_rate_plan_calibrates_below_multiplier_one_at_a_large_epsilon():
    sigma = calibrate_multiplier(epsilon=40.0, delta=DELTA, plan=PLAN)  # ~0.89: the bisection's bottom is 0, not 1
    assert sigma < 0.95
    assert 40.0 - EPSILON_TOLERANCE - 1e-9 <= spent(sigma, PLAN) <= 40.0 + 1e-9  # as above


def test_the_calibration_ends_when_the_accountants_epsilon_jumps_over_the_tolerance_band(monkeypatch):
    # a discretised accountant can step: here epsilon is 10 below sigma 1.234 and 0.5 from there on, so no sigma
    # spends within [1 - 0.01, 1]; the bisection still ends, on the smallest sigma found that meets the target
    import raysim.privacy.accountant as acc

    monkeypatch.setattr(acc, "epsilon_spent", lambda history, **_: 10.0 if history[0][0] < 1.234 else 0.5)
    sigma = calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=PLAN)
    assert sigma == pytest.approx(1.234, abs=1e-9)  # the bisection's 200 halvings pin the step to float resolution
    assert sigma >= 1.234  # and the answer is on the side that meets the target


def test_a_plan_that_needs_more_than_the_first_bracket_is_still_calibrated():
    """The bisection starts on [0, 10] and doubles the top: a tiny epsilon over many releases needs sigma > 10."""
    plan = [(1.0, 300), (0.5, 300)]
    sigma = calibrate_multiplier(epsilon=0.3, delta=DELTA, plan=plan)
    assert sigma > 10
    assert 0.3 - EPSILON_TOLERANCE - 1e-9 <= spent(sigma, plan) <= 0.3 + 1e-9


def test_entries_of_one_rate_merge_and_zero_step_entries_cost_nothing():
    one = calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=[(0.1, 200)])
    # one rate in pieces is that rate's total; a zero-step entry at another rate is no release at all,
    # so both are the single-entry case, i.e. Opacus' get_noise_multiplier (same code path: tolerance 1e-12)
    assert calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=[(0.1, 120), (0.1, 80)]) == pytest.approx(one, rel=1e-12)
    assert calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=[(0.1, 200), (1.0, 0)]) == pytest.approx(one, rel=1e-12)
    assert one == pytest.approx(noise_multiplier(epsilon=1.0, delta=DELTA, sample_rate=0.1, steps=200), rel=1e-12)
    # and a second rate with steps does cost: more noise for the same target
    assert calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=[(0.1, 200), (1.0, 5)]) > one * 1.05


def test_the_prv_accountant_calibrates_the_plan_under_prv_not_rdp():
    """`accountant=` reaches both the bisection (two rates) and the single-rate path: PRV's tighter bound
    gives less noise than RDP for the same target (measured here: 17.81 vs 19.06 on PLAN at eps 1)."""
    sigma = calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=PLAN, accountant="prv")
    history = [(sigma, q, n) for q, n in PLAN]
    got = epsilon_spent(history, delta=DELTA, accountant="prv")
    # the bisection's stopping band, plus PRV's own discretisation error when called again (1e-3: its
    # eps_error is 0.01 relative, and the same grid is rebuilt for the same history, so far smaller)
    assert 1.0 - EPSILON_TOLERANCE - 1e-3 <= got <= 1.0 + 1e-3
    # calibrated under RDP, the same sigma would be too little noise: RDP's bound at it is over the target
    # (1.07 measured: far outside both tolerances)
    assert epsilon_spent(history, delta=DELTA, accountant="rdp") > 1.0 + 0.03
    assert sigma < calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=PLAN) * 0.97
    # a single rate is Opacus' get_noise_multiplier with the PRV accountant (the same call: rel 1e-12)
    one = calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=[(0.1, 200)], accountant="prv")
    assert one == pytest.approx(noise_multiplier(epsilon=1.0, delta=DELTA, sample_rate=0.1, steps=200,
                                                 accountant="prv"), rel=1e-12)
    assert one < noise_multiplier(epsilon=1.0, delta=DELTA, sample_rate=0.1, steps=200) * 0.97


def test_the_pure_part_is_taken_off_the_target():
    both = calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=PLAN, pure=0.25)
    rest = calibrate_multiplier(epsilon=0.75, delta=DELTA, plan=PLAN)
    assert both == pytest.approx(rest, rel=1e-12)  # the same bisection on the same target
    assert both > calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=PLAN)


def test_no_gaussian_release_or_no_budget_needs_no_noise():
    assert calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=[]) == 0.0
    assert calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=[(0.1, 0), (1.0, 0)]) == 0.0
    assert calibrate_multiplier(epsilon=math.inf, delta=DELTA, plan=PLAN) == 0.0


def test_impossible_plans_are_refused_with_what_to_raise():
    with pytest.raises(ConfigError, match=r"pure-DP part of the releases \(1\) uses the whole epsilon=1; raise epsilon"):
        calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=PLAN, pure=1.0)
    with pytest.raises(ConfigError, match="pure-DP part"):
        calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=PLAN, pure=1.5)
    # delta so small that even sigma 1e6 cannot bring a two-rate plan under a tiny epsilon (at q = 1 alone,
    # eps(1e6) >= 2 sqrt(log(1/delta) / (2 sigma^2)) = 3.7e-5 > 1e-6)
    with pytest.raises(ConfigError, match=r"cannot reach epsilon=1e-06 .* raise epsilon or delta"):
        calibrate_multiplier(epsilon=1e-6, delta=1e-300, plan=[(1.0, 1), (0.9, 1)])


# ------------------------------------------------------------------ the embedding release's clip
def embedding():
    from raysim.config.schema import DPConfig
    from raysim.privacy.mechanisms import EmbeddingRelease

    return EmbeddingRelease(DPConfig(epsilon=1.0))


def test_the_embedding_is_clipped_to_C_as_a_whole_and_left_alone_inside():
    mech = embedding()
    g = torch.Generator().manual_seed(0)
    far = torch.full((3, 4), 1.0)  # norm sqrt(12) = 3.46 > C = 2
    out = mech.apply(far, clip=2.0, multiplier=0.0, generator=g)
    # float32 in and out: relative 1e-6
    assert float(out.norm()) == pytest.approx(2.0, rel=1e-6)
    assert torch.allclose(out, far * (2.0 / math.sqrt(12.0)), rtol=1e-6, atol=0)
    near = torch.full((3, 4), 0.1)  # norm 0.35 < C: min(1, C/||v||) = 1
    assert torch.allclose(mech.apply(near, clip=2.0, multiplier=0.0, generator=g), near, rtol=1e-6, atol=0)
    small = torch.full((4,), 0.2)  # norm 0.4, C = 0.1: both under 1, clipped all the same
    assert torch.allclose(mech.apply(small, clip=0.1, multiplier=0.0, generator=g), small / 4, rtol=1e-6, atol=0)
    zero = torch.zeros(5)  # the 1e-12 guard: no division by zero, nothing made up
    assert torch.equal(mech.apply(zero, clip=2.0, multiplier=0.0, generator=g), zero)


def test_the_embedding_noise_is_the_generators_normal_times_2C_sigma_in_the_input_dtype():
    mech = embedding()
    x = torch.full((2, 3), 0.1, dtype=torch.float32)
    out = mech.apply(x, clip=1.5, multiplier=0.7, generator=torch.Generator().manual_seed(4))
    normal = torch.randn(6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want = (x.reshape(-1).double() + 0.7 * 2.0 * 1.5 * normal).reshape(2, 3)  # inside the radius: no clip
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.allclose(out.double(), want, rtol=0, atol=1e-6)  # float32 rounding of values of size ~5
    # without a generator of its own: torch's default stream, on the CPU
    assert mech.apply(x, clip=1.5, multiplier=0.7, generator=None).shape == x.shape


# ------------------------------------------------------------------ the ledger through a checkpoint
def test_a_ledger_comes_back_from_its_checkpoint_with_every_field():
    led = PrivacyLedger(2.0, 1e-5, accountant="rdp", conversion="classic")
    led.record(Release("igpp", 3.5, 1.0, 4, 0))
    led.record(Release("dpsgd", 1.2, 0.1, 30, 1, sampling="shuffle"))
    led.record(Release("vpp_laplace", 0.0, 1.0, 1, 1, epsilon=0.05, delta=0.0, note="covers the prototypes"))
    led.record(Release("dpfpl_reference", 0.8, 0.2, 10, 2, valid=False, claimed_epsilon=1.0))
    d = led.to_dict()
    assert d["target_epsilon"] == 2.0 and d["delta"] == 1e-5 and d["accountant"] == "rdp" and d["conversion"] == "classic"
    assert [type(r["steps"]) for r in d["releases"]] == [int] * 4 and [type(r["sigma"]) for r in d["releases"]] == [float] * 4
    back = PrivacyLedger.from_dict(d)
    assert back.releases == led.releases  # dataclass equality: every field, in order
    assert (back.target_epsilon, back.delta, back.accountant, back.conversion) == (2.0, 1e-5, "rdp", "classic")
    assert not back.valid and back.claimed_epsilon() == 1.0 and back.scope() == ["covers the prototypes"]
    # same releases, same conversion: the same epsilon (same code on the same floats)
    assert back.epsilon() == pytest.approx(led.epsilon(), rel=1e-12)
    # an older checkpoint without accountant / conversion reads as what runs used then
    old = PrivacyLedger.from_dict({"target_epsilon": 1.0, "delta": 1e-5})
    assert (old.accountant, old.conversion, old.releases) == ("rdp", "tight", [])


def test_a_prv_ledger_keeps_its_accountant_through_a_checkpoint():
    # a resumed PRV run must go on composing under PRV, not fall back to the RDP default (PRV's bound is the
    # smaller one here, so RDP would print a different, larger epsilon)
    led = PrivacyLedger(10.0, DELTA, accountant="prv")
    led.record(Release("igpp", 2.0, 1.0, 5, 0))
    back = PrivacyLedger.from_dict(led.to_dict())
    assert back.accountant == "prv" and back.conversion == "tight"
    # same releases, same accountant: PRV rebuilds the same grid (its eps_error is 0.01; 1e-6 is far below it)
    assert back.epsilon() == pytest.approx(led.epsilon(), rel=1e-6)
    assert back.epsilon() < epsilon_spent([(2.0, 1.0, 5)], delta=DELTA, accountant="rdp") - 0.2  # 4.99 vs 5.38


def test_a_checkpointed_release_holds_plain_python_numbers():
    # a release built from numpy / torch scalars (a step count or a round index read off a tensor) is written
    # as int (steps, round) and float (the rest), so the checkpoint is JSON and reads back the same numbers
    import json

    import numpy as np

    led = PrivacyLedger(2.0, DELTA)
    led.record(Release("dpsgd", np.float32(1.5), torch.tensor(0.25), np.int64(30), torch.tensor(3), epsilon=np.float64(0.1)))
    rel = led.to_dict()["releases"][0]
    assert [type(rel[k]) for k in ("sigma", "sample_rate", "steps", "round", "epsilon")] == [float, float, int, int, float]
    assert (rel["sigma"], rel["sample_rate"], rel["steps"], rel["round"]) == (1.5, 0.25, 30, 3)  # exact in binary
    assert rel["epsilon"] == pytest.approx(0.1, rel=1e-15)  # float64 to float: the same double
    json.dumps(led.to_dict())
    back = PrivacyLedger.from_dict(json.loads(json.dumps(led.to_dict())))
    assert type(back.releases[0].round) is int and back.releases[0].round == 3


# ------------------------------------------------------------------ VPP's reported values, worked by hand
def test_vpp_release_reports_the_papers_quantities_at_worked_values():
    from raysim.privacy.prototypes import discriminativeness_scores, gaussian_rdp_sigma, group_clip, vpp_release, vpp_sigmas

    d = 10
    x = torch.randn(30, d, generator=torch.Generator().manual_seed(3)) * 4
    y = torch.tensor([0, 1, 2] * 10)
    out = vpp_release(x, y, R=2.0, rho=0.3, H=0.5, epsilon=2.0, rounds=5, delta=1e-5, r_split=0.25,
                      generator=torch.Generator().manual_seed(1))
    k = 3  # ceil(0.3 * 10)
    assert len(out["idx_A"]) == k and len(out["idx_B"]) == d - k
    assert sorted(out["idx_A"].tolist() + out["idx_B"].tolist()) == list(range(d))  # a partition of the coordinates
    assert out["epsilon1"] == pytest.approx(0.5) and out["epsilon2"] == pytest.approx(1.5)  # 0.25 / 0.75 of 2
    assert out["lambda"] == pytest.approx(2 * k * 0.5 * 5 / 0.5)  # Eq. 9: 2 k H T / epsilon1
    # sigma_ref as VPDR's code calibrates epsilon2 over T releases; the group sigmas from it (Eq. 12-13)
    assert out["sigma_ref"] == pytest.approx(gaussian_rdp_sigma(epsilon=1.5, delta=1e-5, releases=5), rel=1e-12)
    assert (out["sigma_A"], out["sigma_B"]) == pytest.approx(vpp_sigmas(out["sigma_ref"], d, k), rel=1e-12)
    torch.testing.assert_close(out["scores"], discriminativeness_scores(x, y, 3))
    assert sorted(out["prototypes"]) == [0, 1, 2] and [int(out["counts"][c].sum()) for c in range(3)] == [10, 10, 10]

    # rho above 0.5 is clamped to 0.5 (the code's cap); k never reaches d (group B keeps a coordinate)
    assert len(vpp_release(x, y, R=2.0, rho=0.9, H=0.5, epsilon=2.0, rounds=5, delta=1e-5,
                           generator=torch.Generator().manual_seed(1))["idx_A"]) == 5
    assert len(vpp_release(x[:, :2], y, R=2.0, rho=0.5, H=0.5, epsilon=2.0, rounds=5, delta=1e-5,
                           generator=torch.Generator().manual_seed(1))["idx_A"]) == 1

    # without a budget: no noise at all, the prototypes are the class means of the group-clipped features
    free = vpp_release(x, y, R=2.0, rho=0.3, H=0.5, epsilon=math.inf, rounds=5, delta=1e-5,
                       generator=torch.Generator().manual_seed(1))
    assert (free["sigma_ref"], free["sigma_A"], free["sigma_B"], free["lambda"]) == (0.0, 0.0, 0.0, 0.0)
    clipped = group_clip(x, free["idx_A"], free["idx_B"], 2.0)
    for c in range(3):  # a mean of ten float32 rows: 1e-6
        torch.testing.assert_close(free["prototypes"][c], clipped[y == c].mean(0), rtol=0, atol=1e-6)
    # a class that is absent from this client is not released, and num_classes is read from the labels
    two = vpp_release(x[y < 2], y[y < 2], R=2.0, rho=0.3, H=0.5, epsilon=2.0, rounds=5, delta=1e-5,
                      generator=torch.Generator().manual_seed(1))
    assert sorted(two["prototypes"]) == [0, 1]


# ------------------------------------------------------------------ the training mechanisms' round plans
def _host(method_name, dp, *, batch_size, options=None):
    from raysim.methods import get_method
    from raysim.methods.base import TrainConfig
    from raysim.privacy.host import HostPrivacy

    cls = get_method(method_name)
    method = cls(TrainConfig(batch_size=batch_size, num_clients=4), options or cls.Options(), dp)
    return HostPrivacy(dp=dp, method=method, seed=5, batch_size=batch_size, releases_per_client=lambda cid: 3)


def _same_stream(a: torch.Generator, b: torch.Generator) -> bool:
    return torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))


@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_a_dpsgd_round_steps_with_the_clients_multiplier_rate_clip_and_stream(sampling):
    from raysim.config import DPConfig
    from raysim.privacy.dpsgd import DPSGD
    from raysim.sampling import generator

    dp = DPConfig(epsilon=1.0, clip=0.7, sampling=sampling, microbatch=3)
    host = _host("promptfl", dp, batch_size=8)
    n = 40  # q = 8 / 40
    h = host.open(2, 1, n, {"ctx": torch.zeros(2, 3)})
    sgd = h.stepper
    assert isinstance(sgd, DPSGD)
    assert sgd.sigma == pytest.approx(host.multiplier(2, n), rel=1e-12) and sgd.sigma > 0
    assert (sgd.clip, sgd.sample_rate, sgd.microbatch) == (0.7, pytest.approx(0.2), 3)
    assert sgd.expected_batch == (pytest.approx(8.0) if sampling == "poisson" else None)  # q n under Poisson only
    assert h.poisson is (sampling == "poisson")
    assert _same_stream(sgd.generator, generator(5, "dp-noise", 1, 2))  # the (round, client) noise stream
    rel = h._training.release
    assert (rel.mechanism, rel.round, rel.sampling, rel.sample_rate) == ("dpsgd", 1, sampling, pytest.approx(0.2))
    assert rel.sigma == sgd.sigma and rel.valid  # the one float, passed through: exact and rel.claimed_epsilon is None
    # the round is on the client's record even when no step ran (with 0 steps, which compose to nothing)
    assert h._training.record_without_steps
    # a client with fewer examples than the batch: q capped at 1
    assert host.open(3, 1, 5, {"ctx": torch.zeros(2, 3)}).stepper.sample_rate == 1.0


def test_a_dpsgd_round_without_steps_uploads_the_broadcast_and_is_on_record_spending_nothing():
    # e.g. a client whose Poisson batches all came out empty: what it uploads is the untouched broadcast tensor
    # (accepted), the round is recorded with 0 steps, and that costs nothing
    from raysim.config import DPConfig

    host = _host("promptfl", DPConfig(epsilon=1.0), batch_size=8)
    shared = {"ctx": torch.randn(2, 3, generator=torch.Generator().manual_seed(0))}
    h = host.open(2, 0, 40, shared)
    h.close({"ctx": shared["ctx"].clone()})
    [rel] = host.ledger(2).releases
    assert (rel.mechanism, rel.steps, rel.round) == ("dpsgd", 0, 0)
    assert host.ledger(2).epsilon() == 0.0


def test_a_dpsgd_round_is_checked_against_its_own_clients_ledger():
    """A client whose ledger has spent the budget is refused its next round; another client is not."""
    from raysim.config import DPConfig
    from raysim.errors import PrivacyBudgetExceeded

    dp = DPConfig(epsilon=1.0, clip=0.7)
    host = _host("promptfl", dp, batch_size=8)
    n = 40
    # client 2 already released 500 full-batch steps at sigma 0.5: far past epsilon 1 on any accountant
    host.ledger(2).record(Release("dpsgd", 0.5, 1.0, 500, 0))
    assert host.ledger(2).epsilon() > 10
    with pytest.raises(PrivacyBudgetExceeded, match="past the target epsilon=1"):
        host.open(2, 1, n, {"ctx": torch.zeros(2, 3)})
    h = host.open(3, 1, n, {"ctx": torch.zeros(2, 3)})  # a fresh client's round is within its budget
    assert h._training.release.round == 1


def test_a_dpfpl_reference_round_clips_at_the_codes_threshold_without_noise_and_records_no_guarantee():
    from raysim.config import DPConfig
    from raysim.methods import get_method
    from raysim.privacy.dpsgd import BatchClipSGD
    from raysim.sampling import generator

    dp = DPConfig(epsilon=2.0)
    opts = get_method("dpfpl").Options(dp_mode="reference", norm_thresh=4.5)
    host = _host("dpfpl", dp, batch_size=8, options=opts)
    h = host.open(1, 2, 40, {})
    sgd = h.stepper
    assert isinstance(sgd, BatchClipSGD)
    assert (sgd.std, sgd.clip) == (0.0, 4.5)  # the client adds no noise to what it uploads; C = NORM_THRESH
    assert _same_stream(sgd.generator, generator(5, "dp-noise", 2, 1))
    assert h.poisson is False and h._training.poisson is False  # fixed-size shuffled batches, as the code draws them
    rel = h._training.release
    assert (rel.mechanism, rel.sigma, rel.sample_rate, rel.round, rel.sampling) == ("dpfpl_reference", 0.0, 1.0, 2, "shuffle")
    assert rel.valid is False and rel.claimed_epsilon == 2.0  # what the code would print, beside the ledger's inf
    assert h._training.record_without_steps is False  # no step, no upload, nothing to record


def test_vpp_noises_the_prototypes_whenever_its_multiplier_is_positive_also_below_one():
    from raysim.privacy.prototypes import group_clip, vpp_release

    x = torch.randn(30, 10, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 1, 2] * 10)
    out = vpp_release(x, y, R=2.0, rho=0.3, H=0.5, epsilon=50.0, rounds=5, delta=1e-5, sigma_ref=0.5,
                      generator=torch.Generator().manual_seed(1))
    assert out["sigma_A"] > 0 and out["sigma_B"] > 0
    clean = group_clip(x, out["idx_A"], out["idx_B"], 2.0)[y == 0].mean(0)
    # noise of std >= 0.5 * 2R / 10 = 0.1 per coordinate: far above float rounding
    assert float((out["prototypes"][0] - clean).abs().max()) > 1e-3


def test_a_ledger_at_sigma_one_is_finite_and_what_remains_is_target_minus_spent():
    # a multiplier of exactly 1 is an ordinary Gaussian release (only sigma 0, no noise, is infinite): the
    # ledger's epsilon equals the accountant's for the same history (the ledger's fast path is Opacus' RDP
    # analysis; tolerance: the same computation up to float summation order)
    led = PrivacyLedger(target_epsilon=8.0, delta=DELTA)
    assert led.claimed_epsilon() is None and led.remaining() == 8.0  # nothing released, nothing claimed
    led.record(Release("dpsgd", 1.0, 0.1, 50, 0))
    eps = led.epsilon()
    assert math.isfinite(eps) and eps == pytest.approx(epsilon_spent([(1.0, 0.1, 50)], delta=DELTA), rel=1e-9)
    assert led.remaining() == pytest.approx(8.0 - eps, rel=1e-12) and led.remaining() < 8.0
    assert led.claimed_epsilon() is None  # a valid release claims nothing
    zero = PrivacyLedger(target_epsilon=math.inf, delta=DELTA)
    zero.record(Release("dpsgd", 0.0, 0.1, 5, 0))
    assert zero.epsilon() == math.inf
