"""Every privacy parameter is refused outside its domain and accepted on its edge, with a message that names the
parameter, its range and the value given (so a user knows what to change). Written against the survivors of the
mutation run (docs/testing.md, "Mutation testing"): a relaxed or tightened bound, or a message lost, fails here."""

from __future__ import annotations

import math

import pytest
import torch

from raysim.errors import ConfigError
from raysim.privacy import accountant as acc
from raysim.privacy.dcr import EMATeacher, kd_loss, soft_clip
from raysim.privacy.prototypes import vpp_release


def _vpp(**over):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 4, generator=g)
    y = torch.tensor([0, 1, 2] * 4)
    kw = dict(R=1.0, rho=0.25, H=1.0, epsilon=1.0, rounds=2, delta=1e-5, r_split=0.1, generator=g)
    kw.update(over)
    return vpp_release(kw.pop("x", x), kw.pop("y", y), **kw)


# (call that must be refused, words the message must hold)
REFUSED = {
    "accountant name": (lambda: acc.noise_multiplier(epsilon=1, delta=1e-5, sample_rate=0.1, steps=1, accountant="gdp"),
                        ["unknown accountant 'gdp'", "rdp, prv"]),
    "delta 0": (lambda: acc.noise_multiplier(epsilon=1, delta=0.0, sample_rate=0.1, steps=1), ["delta must lie in (0, 1)", "0.0"]),
    "delta 1": (lambda: acc.noise_multiplier(epsilon=1, delta=1.0, sample_rate=0.1, steps=1), ["delta must lie in (0, 1)", "1.0"]),
    "delta text": (lambda: acc.noise_multiplier(epsilon=1, delta="x", sample_rate=0.1, steps=1), ["delta must be a number", "'x'"]),
    "sample rate 0": (lambda: acc.noise_multiplier(epsilon=1, delta=1e-5, sample_rate=0.0, steps=1),
                      ["sample rate must lie in (0, 1]", "batch size / dataset size", "0.0"]),
    "sample rate above 1": (lambda: acc.noise_multiplier(epsilon=1, delta=1e-5, sample_rate=1.5, steps=1),
                            ["sample rate must lie in (0, 1]", "1.5"]),
    "sample rate text": (lambda: acc.noise_multiplier(epsilon=1, delta=1e-5, sample_rate=None, steps=1),
                         ["sample rate must be a number", "None"]),
    "steps 0": (lambda: acc.noise_multiplier(epsilon=1, delta=1e-5, sample_rate=0.1, steps=0), ["steps must be >= 1", "0"]),
    "steps fractional": (lambda: acc.noise_multiplier(epsilon=1, delta=1e-5, sample_rate=0.1, steps=1.5),
                         ["steps must be a whole number >= 1", "1.5"]),
    "steps bool": (lambda: acc.noise_multiplier(epsilon=1, delta=1e-5, sample_rate=0.1, steps=True),
                   ["steps must be a whole number >= 1", "True"]),
    "steps none": (lambda: acc.noise_multiplier(epsilon=1, delta=1e-5, sample_rate=0.1, steps=None),
                   ["steps must be a whole number >= 1", "None"]),
    "steps text": (lambda: acc.noise_multiplier(epsilon=1, delta=1e-5, sample_rate=0.1, steps="many"),
                   ["steps must be a whole number >= 1", "'many'"]),
    "epsilon 0": (lambda: acc.noise_multiplier(epsilon=0.0, delta=1e-5, sample_rate=0.1, steps=1),
                  ["epsilon must be > 0", "use inf to turn DP off", "0.0"]),
    "epsilon nan": (lambda: acc.noise_multiplier(epsilon=math.nan, delta=1e-5, sample_rate=0.1, steps=1), ["epsilon must be > 0", "nan"]),
    "epsilon text": (lambda: acc.noise_multiplier(epsilon="a", delta=1e-5, sample_rate=0.1, steps=1),
                     ["epsilon must be a positive number (or inf)", "'a'"]),
    "releases 0": (lambda: acc.gaussian_rdp_sigma(epsilon=1.0, delta=1e-5, releases=0), ["releases must be >= 1"]),
    "releases fractional": (lambda: acc.gaussian_rdp_sigma(epsilon=1.0, delta=1e-5, releases=2.5), ["releases must be a whole number"]),
    "unreachable gaussian epsilon": (lambda: acc.gaussian_rdp_sigma(epsilon=1e-9, delta=1e-5, releases=10),
                                     ["needs a noise multiplier above 10000", "raise epsilon or delta"]),
    "history entry": (lambda: acc.epsilon_spent([(1.0, 0.1)], delta=1e-5), ["history entries are (sigma, sample_rate, steps)"]),
    "negative multiplier": (lambda: acc.epsilon_spent([(-1.0, 0.1, 3)], delta=1e-5), ["noise multiplier must be >= 0", "-1.0"]),
    "soft clip R 0": (lambda: soft_clip(torch.ones(2, 3), R=0.0, gamma=0.1), ["R must be > 0", "0.0"]),
    "soft clip gamma": (lambda: soft_clip(torch.ones(2, 3), R=1.0, gamma=-0.1), ["gamma must be >= 0", "-0.1"]),
    "EMA beta 1": (lambda: EMATeacher(torch.nn.Linear(2, 2), beta=1.0), ["EMA momentum beta must lie in [0, 1)", "1.0"]),
    "EMA beta negative": (lambda: EMATeacher(torch.nn.Linear(2, 2), beta=-0.5), ["beta must lie in [0, 1)", "-0.5"]),
    "kd temperature": (lambda: kd_loss(torch.zeros(2, 3), torch.zeros(2, 3), T=0.0), ["temperature must be > 0", "0.0"]),
    "vpp centres": (lambda: _vpp(centres="medoid"), ["centres must be 'mean' or 'cluster'", "'medoid'"]),
    "vpp cluster without ids": (lambda: _vpp(centres="cluster"), ["centres='cluster' needs per-example cluster assignments"]),
    "vpp ids with means": (lambda: _vpp(assignments=torch.zeros(12, dtype=torch.long)),
                           ["cluster assignments were given with centres='mean'", "pass centres='cluster'"]),
    "vpp rho 0": (lambda: _vpp(rho=0.0), ["rho must lie in (0, 0.5]", "0.0"]),
    "vpp split 0": (lambda: _vpp(r_split=0.0), ["r_split must lie in (0, 1)", "0.0"]),
    "vpp split 1": (lambda: _vpp(r_split=1.0), ["r_split must lie in (0, 1)", "1.0"]),
    "vpp R 0": (lambda: _vpp(R=0.0), ["R must be > 0", "0.0"]),
    "vpp epsilon 0": (lambda: _vpp(epsilon=0.0), ["epsilon must be > 0", "0.0"]),
    "vpp one feature": (lambda: _vpp(x=torch.ones(12, 1)), ["VPP needs feature dimension >= 2"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_value_outside_its_domain_is_refused_with_a_message_that_says_what_to_change(case):
    call, words = REFUSED[case]
    with pytest.raises(ConfigError) as err:
        call()
    for w in words:
        assert w in str(err.value), f"{case}: {w!r} missing from {err.value}"


def test_each_domain_edge_is_accepted():
    # the closed ends of each range: q = 1, steps 1, gamma 0, beta 0, r_split and rho just inside, d = 2
    assert acc.noise_multiplier(epsilon=1, delta=1e-5, sample_rate=1.0, steps=1) > 0
    assert acc.noise_multiplier(epsilon=math.inf, delta=1e-5, sample_rate=0.1, steps=1) == 0.0
    assert acc.gaussian_rdp_sigma(epsilon=math.inf, delta=1e-5, releases=1) == 0.0
    assert soft_clip(torch.ones(2, 3), R=1.0, gamma=0.0).shape == (2, 3)
    EMATeacher(torch.nn.Linear(2, 2), beta=0.0)
    assert _vpp(r_split=1e-6)["epsilon1"] == pytest.approx(1e-6)
    assert _vpp(rho=1e-6)["idx_A"].numel() == 1
    assert _vpp(x=torch.randn(12, 2, generator=torch.Generator().manual_seed(1)))["idx_A"].numel() == 1
    # sigma 0 is no noise: infinite epsilon, and an all-zero-step history spends nothing
    assert acc.epsilon_spent([(0.0, 0.1, 3)], delta=1e-5) == math.inf
    assert acc.epsilon_spent([(1.0, 0.1, 0)], delta=1e-5) == 0.0


@pytest.mark.parametrize("epsilon,releases", [(1.0, 20), (8.0, 20), (40.0, 1)])
def test_gaussian_rdp_sigma_is_the_smallest_multiplier_that_meets_the_target(epsilon, releases):
    # (40, 1) needs sigma < 1: the bisection's lower end (1e-3) must lie below it. Tolerance: the bisection stops
    # at width 1e-3, so sigma - 2e-3 must already exceed the target (tightness) while sigma meets it
    sigma = acc.gaussian_rdp_sigma(epsilon=epsilon, delta=1e-5, releases=releases)
    assert acc.gaussian_rdp_epsilon(sigma, delta=1e-5, releases=releases) <= epsilon
    assert acc.gaussian_rdp_epsilon(sigma - 2e-3, delta=1e-5, releases=releases) > epsilon
    if epsilon == 40.0:
        assert sigma < 1.0


def test_gaussian_rdp_epsilon_of_no_noise_is_infinite_and_of_small_noise_finite():
    assert acc.gaussian_rdp_epsilon(0.0, delta=1e-5, releases=1) == math.inf
    assert math.isfinite(acc.gaussian_rdp_epsilon(0.5, delta=1e-5, releases=1))


def test_vpp_group_sizes_follow_rho_clamped_to_one_half():
    # k = min(max(1, ceil(min(rho, 0.5) d)), d - 1): rho 0.9 on d = 10 is clamped to 5 coordinates, rho 0.5 on d = 3
    # gives ceil(1.5) = 2, rho tiny gives 1
    x10 = torch.randn(12, 10, generator=torch.Generator().manual_seed(2))
    assert _vpp(x=x10, rho=0.9)["idx_A"].numel() == 5
    assert _vpp(x=x10, rho=0.3)["idx_A"].numel() == 3
    x3 = torch.randn(12, 3, generator=torch.Generator().manual_seed(3))
    assert _vpp(x=x3, rho=0.5)["idx_A"].numel() == 2


def test_vpp_infers_the_class_count_from_the_labels():
    # labels 0..2 present: inferring num_classes must give the same release as passing 3 (same seed, same draws);
    # tolerance: one computation repeated on one machine, 0 in exact arithmetic, allowed 1e-12 for reordering
    a = _vpp(generator=torch.Generator().manual_seed(5))
    b = _vpp(generator=torch.Generator().manual_seed(5), num_classes=3)
    assert a["scores"].shape == b["scores"].shape
    torch.testing.assert_close(a["scores"], b["scores"], rtol=0, atol=1e-12)
    for c in a["prototypes"]:
        torch.testing.assert_close(a["prototypes"][c], b["prototypes"][c], rtol=0, atol=1e-12)


@pytest.mark.parametrize("clustered", [False, True])
def test_the_vpp_mechanism_is_vpp_release_at_the_configured_values(clustered):
    # the registry's VPP must pass every configured value (R, rho, H, split, delta, the class count, the cluster
    # ids and the caller's generator) to vpp_release: a dropped or defaulted one changes the release. Labels lack
    # class 3 (num_classes matters), split 0.3 is not vpp_release's default 0.1. Tolerance: the same computation
    # twice in one process, 0 in exact arithmetic; 1e-6 on float32 values of order 1 allows reordering
    from raysim.config import DPConfig
    from raysim.privacy.mechanisms.vpp import VPP
    from raysim.privacy.prototypes import stack_centres

    dp = DPConfig(epsilon=2.0, delta=1e-6, prototypes="vpp", proto_clip=3.0)
    dp.vpp.rho, dp.vpp.H, dp.vpp.split = 0.4, 2.0, 0.3
    x = torch.randn(18, 6, generator=torch.Generator().manual_seed(7))
    y = torch.tensor([0, 1, 2] * 6)
    ids = torch.tensor([0, 0, 0, 1, 1, 1] * 3) if clustered else None
    got, facts = VPP(dp).apply(x, y, 4, multiplier=1.7, generator=torch.Generator().manual_seed(11), rounds=5, assignments=ids)
    ref = vpp_release(x, y, R=3.0, rho=0.4, H=2.0, epsilon=2.0, rounds=5, delta=1e-6, r_split=0.3,
                      generator=torch.Generator().manual_seed(11), num_classes=4, sigma_ref=1.7,
                      centres="cluster" if clustered else "mean", assignments=ids)
    if clustered:
        want = stack_centres(ref["prototypes"]).float()
        assert got.shape == (6, 6)  # 3 classes x 2 clusters, class by class
    else:
        want = torch.zeros(4, 6)
        for c, p in ref["prototypes"].items():
            want[c] = p.float()
        assert torch.equal(got[3], torch.zeros(6))  # the absent class is not released
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert facts == {"pure_epsilon": pytest.approx(0.3 * 2.0 / 5)}
    # a different generator gives a different release (the caller's stream is the one used)
    other, _ = VPP(dp).apply(x, y, 4, multiplier=1.7, generator=torch.Generator().manual_seed(12), rounds=5, assignments=ids)
    assert not torch.allclose(other, got)


def test_the_igpp_mechanism_releases_cluster_centres_class_by_class():
    from raysim.config import DPConfig
    from raysim.privacy.mechanisms.igpp import IGPP
    from raysim.privacy.prototypes import igpp_release, stack_centres

    dp = DPConfig(epsilon=1.0, proto_clip=2.0)
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1] * 6)
    ids = torch.tensor([0, 0, 1, 1] * 3)
    got, facts = IGPP(dp).apply(x, y, 2, multiplier=0.5, generator=torch.Generator().manual_seed(2), rounds=3, assignments=ids)
    want = stack_centres(igpp_release(x, y, clip=2.0, sigma=0.5, generator=torch.Generator().manual_seed(2), assignments=ids))
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6)  # same computation twice: see above
    assert got.shape == (4, 5) and facts == {}


def test_a_clients_privacy_state_survives_a_checkpoint_and_an_abandoned_round_is_undone():
    # resume (load of to_dict) and on_client_error=drop (snapshot / restore) must keep the calibration, the ledger and
    # the one-shot releases, or a resumed client would be recalibrated or spend its budget twice
    from raysim.config import DPConfig
    from raysim.methods import TrainConfig, get_method
    from raysim.privacy.host import ClientPrivacyState, HostPrivacy

    dp = DPConfig(epsilon=1.0, prototypes="igpp", proto_clip=5.0)
    cls = get_method("fedproto")
    method = cls(TrainConfig(batch_size=8, local_epochs=1, num_clients=2), cls.Options(), dp)
    host = HostPrivacy(dp=dp, method=method, seed=3, batch_size=8, releases_per_client=lambda cid: 4)
    feats, labels = torch.randn(20, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1] * 10)

    def one_round(r):
        h = host.open(0, r, 20, {})
        protos = h.release("protos", features=feats, labels=labels, num_classes=2)
        h.close({"protos": protos, "counts": torch.tensor([10.0, 10.0])})

    assert host.snapshot(0) is None  # nothing yet: restoring it forgets the client
    one_round(0)
    z, eps1 = host.multiplier(0, 20), host.epsilon(0)
    assert eps1 > 0
    snap = host.snapshot(0)
    one_round(1)
    assert host.epsilon(0) > eps1
    host.restore(0, snap)
    assert host.epsilon(0) == pytest.approx(eps1, rel=1e-12)  # the abandoned round's release is not on record
    assert host.multiplier(0, 20) == z
    one_round(1)
    saved = host.snapshot(0)
    fresh = HostPrivacy(dp=dp, method=method, seed=3, batch_size=8, releases_per_client=lambda cid: 4)
    fresh.load(0, saved)
    assert fresh.epsilon(0) == pytest.approx(host.epsilon(0), rel=1e-12) and fresh.multiplier(0, 20) == z
    assert len(fresh.ledger(0).releases) == len(host.ledger(0).releases) == 2
    host.restore(0, None)
    assert host.snapshot(0) is None and host.epsilon(0) == 0.0
    fresh.load(1, None)
    assert fresh.epsilon(1) == 0.0
    once = {"desc": torch.ones(3)}
    back = ClientPrivacyState.from_dict(ClientPrivacyState(2.5, None, once).to_dict())
    assert back.multiplier == 2.5 and back.ledger is None and torch.equal(back.once["desc"], torch.ones(3))


def test_a_budget_share_lies_in_zero_to_one_and_names_a_known_calibration():
    # (0, 1]: a share of 0 would calibrate on no budget, above 1 on more than the client has; the message names
    # the range and the value. ValueError: a method's declaration is wrong, not a user's config
    from raysim.privacy.mechanisms.base import BudgetShare

    assert BudgetShare(1.0).share == 1.0 and BudgetShare(1e-9).share == 1e-9
    assert BudgetShare(0.5, "classic_gaussian").calibration == "classic_gaussian"
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError) as err:
            BudgetShare(bad)
        assert str(err.value) == f"a budget share must lie in (0, 1], got {bad}"
    with pytest.raises(ValueError) as err:
        BudgetShare(0.5, "laplace")
    assert str(err.value) == "calibration must be one of accountant, classic_gaussian, got 'laplace'"


def test_each_release_constructor_declares_its_kind():
    # what a method writes in `releases`: the kind `resolve` picks a mechanism by, `once` only for the embedding
    # (one release per run), and a public upload only with its note
    from raysim.privacy.mechanisms import base

    specs = {"dpsgd": base.dpsgd(), "update": base.update(), "prototype": base.prototype(),
             "embedding": base.embedding(), "public": base.public("counts are public in the paper"),
             "reference": base.reference()}
    for kind, spec in specs.items():
        assert spec.kind == kind and spec.once == (kind == "embedding")
    assert specs["public"].note == "counts are public in the paper"
    with pytest.raises(ValueError, match="a public upload needs a note"):
        base.ReleaseSpec("public")
    with pytest.raises(ValueError, match="a public upload needs a note"):
        base.public("")
    with pytest.raises(ValueError, match="release kind must be one of"):
        base.ReleaseSpec("gradient")


def test_the_ema_teacher_defaults_and_stays_in_eval_mode():
    # SPEC 3.3's defaults (beta 0.999, warm-up 5); train() puts the wrapper in training mode but never the teacher
    t = EMATeacher(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)))
    assert t.beta == 0.999 and t.warmup == 5
    assert t.train() is t and t.training and not t.teacher.training
    t.train(False)
    assert not t.training and not t.teacher.training
    t.train(True)
    assert t.training and not t.teacher.training


def test_an_unreachable_gaussian_target_says_what_to_raise_at_the_end_of_its_message():
    with pytest.raises(ConfigError) as err:
        acc.gaussian_rdp_sigma(epsilon=1e-9, delta=1e-5, releases=10)
    assert str(err.value).endswith("needs a noise multiplier above 10000; raise epsilon or delta")
