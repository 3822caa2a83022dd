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
