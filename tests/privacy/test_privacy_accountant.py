import math
import subprocess
import sys
import warnings

import pytest

from raysim.errors import ConfigError, PrivacyBudgetExceeded
from raysim.privacy import PrivacyLedger, Release, epsilon_spent, gaussian_rdp_sigma, noise_multiplier
from raysim.tools import privacy_cli as cli


@pytest.mark.parametrize(
    "eps,q,steps,acc",
    [(1.0, 0.167, 300, "rdp"), (2.0, 1.0, 50, "rdp"), (1.0, 0.2, 100, "prv")],
)
def test_noise_multiplier_matches_opacus(eps, q, steps, acc):
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = get_noise_multiplier(target_epsilon=eps, target_delta=1e-5, sample_rate=q, steps=steps, accountant=acc)
    assert noise_multiplier(epsilon=eps, delta=1e-5, sample_rate=q, steps=steps, accountant=acc) == pytest.approx(ref, rel=1e-12)


def test_noise_multiplier_spec_table():
    # SPEC 1.6: Food-101 client n=160, q=0.2, 250 steps -> 13.0
    assert noise_multiplier(epsilon=1.0, delta=1e-5, sample_rate=0.2, steps=250) == pytest.approx(13.0, abs=0.05)


def test_noise_multiplier_inf_and_bad_inputs():
    assert noise_multiplier(epsilon=math.inf, delta=1e-5, sample_rate=0.5, steps=10) == 0.0
    for kw in (
        dict(sample_rate=0.0, steps=10, delta=1e-5),
        dict(sample_rate=1.5, steps=10, delta=1e-5),
        dict(sample_rate=0.5, steps=0, delta=1e-5),
        dict(sample_rate=0.5, steps=10, delta=0.0),
        dict(sample_rate=0.5, steps=10, delta=1.0),
    ):
        with pytest.raises(ConfigError):
            noise_multiplier(epsilon=1.0, **kw)
    with pytest.raises(ConfigError):
        noise_multiplier(epsilon=1.0, delta=1e-5, sample_rate=0.5, steps=10, accountant="gdp")


def test_epsilon_spent_roundtrip_and_edges():
    sigma = noise_multiplier(epsilon=1.0, delta=1e-5, sample_rate=0.2, steps=250)
    eps = epsilon_spent([(sigma, 0.2, 250)], delta=1e-5)
    assert 0.98 <= eps <= 1.0
    assert epsilon_spent([], delta=1e-5) == 0.0
    assert epsilon_spent([(0.0, 0.2, 3)], delta=1e-5) == math.inf
    # composition is additive in the accountant: split history equals merged history
    assert epsilon_spent([(sigma, 0.2, 100), (sigma, 0.2, 150)], delta=1e-5) == pytest.approx(eps, rel=1e-9)
    # the ledger's cached RDP path gives the same number as the Opacus accountant
    led = PrivacyLedger(10.0, 1e-5)
    led.record(Release("dpsgd", sigma, 0.2, 100, 0))
    led.record(Release("dpsgd", sigma, 0.2, 150, 1))
    assert led.epsilon() == pytest.approx(eps, rel=1e-9)


@pytest.mark.parametrize(
    "T,eps,vpp,igpp", [(20, 1.0, 24.30, 21.92), (20, 2.0, 12.37, 11.18), (50, 1.0, 38.42, 34.66)]
)
def test_gaussian_rdp_sigma_spec_values(T, eps, vpp, igpp):
    assert round(gaussian_rdp_sigma(epsilon=0.9 * eps, delta=1e-5, releases=T), 2) == vpp
    assert round(gaussian_rdp_sigma(epsilon=eps, delta=1e-5, releases=T), 2) == igpp


def test_ledger_budget_and_monotone():
    sigma = noise_multiplier(epsilon=1.0, delta=1e-5, sample_rate=0.2, steps=100)
    led = PrivacyLedger(1.0, 1e-5)
    assert led.epsilon() == 0.0
    last = 0.0
    for r in range(10):
        rel = Release("dpsgd", sigma, 0.2, 10, r)
        led.check(rel)
        led.record(rel)
        e = led.epsilon()
        assert e > last
        last = e
    assert last <= 1.0
    extra = Release("dpsgd", sigma, 0.2, 10, 10)
    with pytest.raises(PrivacyBudgetExceeded) as info:
        led.check(extra)
    msg = str(info.value)
    assert "dpsgd" in msg and "round 10" in msg and "1" in msg
    assert led.epsilon_if(extra) > led.epsilon()
    # an infinite budget never refuses
    PrivacyLedger(math.inf, 1e-5).check(Release("dpsgd", 0.0, 0.5, 1, 0))


def test_ledger_pure_epsilon_and_roundtrip():
    led = PrivacyLedger(1.0, 1e-5, accountant="rdp")
    led.record(Release("vpp_topk", 0.0, 1.0, 1, 0, epsilon=0.005))
    led.record(Release("vpp", 24.30, 1.0, 1, 0))
    g = epsilon_spent([(24.30, 1.0, 1)], delta=1e-5)
    assert led.epsilon() == pytest.approx(0.005 + g)
    d = led.to_dict()
    import json

    json.dumps(d)  # plain Python types only
    led2 = PrivacyLedger.from_dict(d)
    assert led2.releases == led.releases
    assert led2.epsilon() == pytest.approx(led.epsilon())
    assert led2.target_epsilon == 1.0 and led2.delta == 1e-5 and led2.accountant == "rdp"


def test_cli_noise_and_bad_input(capsys):
    assert cli.main(["noise", "--epsilon", "1", "--delta", "1e-5", "--sample-rate", "0.2", "--steps", "250"]) == 0
    out = capsys.readouterr().out.strip()
    assert float(out) == pytest.approx(13.0, abs=0.05)
    assert cli.main(["noise", "--epsilon", "1", "--delta", "1e-5", "--sample-rate", "1.5", "--steps", "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err
    assert cli.main(["noise", "--epsilon", "1", "--delta", "1e-5"]) == 2
    assert cli.main(["epsilon", "--sigma", "13", "--delta", "1e-5", "--sample-rate", "0.2", "--steps", "250"]) == 0
    assert float(capsys.readouterr().out) == pytest.approx(
        epsilon_spent([(13.0, 0.2, 250)], delta=1e-5), rel=1e-5)


def test_cli_module_entrypoint():
    r = subprocess.run(
        [sys.executable, "-m", "raysim.tools.privacy_cli", "noise", "--epsilon", "2", "--delta", "1e-5",
         "--sample-rate", "1", "--steps", "5"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0 and float(r.stdout) > 0


# ------------------------------------------------------------- the survivors of the mutation run (docs/testing.md)
def test_a_zero_step_entry_anywhere_in_the_history_is_skipped_not_the_end_of_it():
    sigma = 1.3
    alone = epsilon_spent([(sigma, 0.2, 250)], delta=1e-5)
    # a round without steps (dpsgd records it with 0 steps) before the others: the others still count
    # (same accountant on the same history: rel 1e-12)
    assert epsilon_spent([(1.0, 0.1, 0), (sigma, 0.2, 250)], delta=1e-5) == pytest.approx(alone, rel=1e-12)
    assert epsilon_spent([(sigma, 0.2, 100), (1.0, 0.1, 0), (sigma, 0.2, 150)], delta=1e-5) == pytest.approx(alone, rel=1e-9)


def test_epsilon_spent_pins_the_accountants_defaults(monkeypatch):
    # SPEC 1.6: the RDP orders and PRV's eps_error are passed explicitly, so an Opacus release that changed its
    # defaults would not change what a run spends. Simulated here by changing them under the accountant
    from opacus.accountants import PRVAccountant, RDPAccountant

    history = [(2.0, 1.0, 5)]
    rdp, prv = (epsilon_spent(history, delta=1e-5, accountant=a) for a in ("rdp", "prv"))
    monkeypatch.setattr(RDPAccountant, "DEFAULT_ALPHAS", [2.0])  # one poor order: a far larger epsilon
    monkeypatch.setattr(PRVAccountant.get_epsilon, "__kwdefaults__",
                        {**PRVAccountant.get_epsilon.__kwdefaults__, "eps_error": 0.5})  # adds ~0.5 to the bound
    # same computation on the same history: rel 1e-12 for RDP; PRV rebuilds the same grid (its eps_error is 0.01,
    # so 1e-6 is far below what a change of default moves)
    assert epsilon_spent(history, delta=1e-5, accountant="rdp") == pytest.approx(rdp, rel=1e-12)
    assert epsilon_spent(history, delta=1e-5, accountant="prv") == pytest.approx(prv, rel=1e-6)


def test_an_accountant_answer_that_is_not_a_number_spends_everything(monkeypatch):
    # nan compares False with every budget, so a nan epsilon would pass the ledger's check: it reads as inf.
    # Opacus 1.6 returns inf itself where it cannot bound epsilon; a stand-in accountant returns nan
    import raysim.privacy.accountant as acc

    class NaNAccountant:
        history: list = []

        def get_epsilon(self, delta, **kwargs):
            return math.nan

    monkeypatch.setattr(acc, "_make_accountant", lambda accountant: NaNAccountant())
    for accountant in ("rdp", "prv"):
        assert epsilon_spent([(1.0, 0.2, 10)], delta=1e-5, accountant=accountant) == math.inf


@pytest.mark.parametrize("target", [0.0, -1.0, math.nan])
def test_a_ledger_refuses_a_target_epsilon_that_is_not_positive(target):
    with pytest.raises(ConfigError, match=r"target epsilon must be > 0 \(inf for no budget\), got"):
        PrivacyLedger(target, 1e-5)


def test_zero_step_records_cost_nothing_wherever_they_are_on_the_ledger():
    # DP-SGD records a round in which no step ran, with 0 steps: alone it spends 0, before or between other
    # records it changes nothing (the same RDP sum on the same floats: rel 1e-12)
    only = PrivacyLedger(1.0, 1e-5)
    only.record(Release("dpsgd", 1.3, 0.2, 0, 0))
    assert only.epsilon() == 0.0
    alone = PrivacyLedger(10.0, 1e-5)
    alone.record(Release("dpsgd", 1.3, 0.2, 40, 1))
    for order in ([0, 1], [1, 0]):
        led = PrivacyLedger(10.0, 1e-5)
        for i in order:
            led.record([Release("dpsgd", 1.3, 0.2, 0, 0), Release("dpsgd", 1.3, 0.2, 40, 1)][i])
        assert led.epsilon() == pytest.approx(alone.epsilon(), rel=1e-12) and led.epsilon() > 0


def test_separately_analysed_releases_may_spend_the_whole_delta_and_no_more():
    # basic composition: a release spending exactly the ledger's delta is within it (its epsilon is the total);
    # a Gaussian release beside it has no delta left (inf); spending 1.5 x delta is past it (inf)
    led = PrivacyLedger(10.0, 1e-5)
    led.record(Release("embedding", 1.0, 1.0, 1, 0, epsilon=0.5, delta=1e-5))
    assert led.epsilon() == pytest.approx(0.5)
    assert led.epsilon_if(Release("igpp", 5.0, 1.0, 3, 0)) == math.inf
    # two shares of the delta whose float sum rounds above it (0.2 x 1e-5 + 0.8 x 1e-5 = 1e-5 + 3e-21): within it
    split = PrivacyLedger(10.0, 1e-5)
    split.record(Release("embedding", 1.0, 1.0, 1, 0, epsilon=0.2, delta=0.2 * 1e-5))
    split.record(Release("embedding", 1.0, 1.0, 1, 1, epsilon=0.3, delta=0.8 * 1e-5))
    assert split.epsilon() == pytest.approx(0.5)
    over = PrivacyLedger(10.0, 1e-5)
    over.record(Release("embedding", 1.0, 1.0, 1, 0, epsilon=0.5, delta=1.5e-5))
    assert over.epsilon() == math.inf


def test_the_budget_check_lets_invalid_releases_through_and_allows_spending_exactly_the_target():
    # an invalid release (a reference code's noise) has no guarantee to protect: it is recorded, not refused,
    # although its epsilon is inf; once the ledger holds one, neither is anything after it
    led = PrivacyLedger(1.0, 1e-5)
    invalid = Release("dpfpl_reference", 0.0, 1.0, 5, 0, valid=False, claimed_epsilon=1.0)
    assert led.epsilon_if(invalid) == math.inf
    led.check(invalid)
    led.record(invalid)
    led.check(Release("dpsgd", 0.5, 1.0, 500, 1))  # far past the target on a valid ledger
    # spending exactly the target is within it, and so is 1e-7 (relative) above, the float rounding the
    # check allows; 1e-5 above is past it
    exact = PrivacyLedger(1.0, 1e-5)
    exact.check(Release("vpp_topk", 0.0, 1.0, 1, 0, epsilon=1.0))
    exact.check(Release("vpp_topk", 0.0, 1.0, 1, 0, epsilon=1.0 + 1e-7))
    with pytest.raises(PrivacyBudgetExceeded, match="past the target epsilon=1"):
        exact.check(Release("vpp_topk", 0.0, 1.0, 1, 0, epsilon=1.0 + 1e-5))


def test_a_ledger_whose_accountant_answers_nan_refuses_the_next_release(monkeypatch):
    # the ledger's own RDP path: a nan from the conversion reads as inf (nan would pass every budget check).
    # Opacus 1.6 returns inf itself when every order is nan; a stand-in conversion returns nan
    from opacus.accountants.analysis import rdp as analysis

    monkeypatch.setattr(analysis, "get_privacy_spent", lambda **kw: (math.nan, math.nan))
    led = PrivacyLedger(1.0, 1e-5)
    rel = Release("dpsgd", 1.3, 0.2, 10, 0)
    assert led.epsilon_if(rel) == math.inf
    with pytest.raises(PrivacyBudgetExceeded):
        led.check(rel)
