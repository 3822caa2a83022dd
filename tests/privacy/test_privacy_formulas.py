"""Each mechanism's formula against an independent computation: VPP's discriminativeness score against scipy's
one-way ANOVA, its top-k partition against clip-noise-rank done by hand, client-level noise and clipping
against worked values. Written against the survivors of the mutation run (docs/testing.md, "Mutation testing")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import f_oneway

from raysim.errors import ConfigError
from raysim.privacy import accountant as acc
from raysim.privacy.client_level import clip_update, noise_update
from raysim.privacy.dcr import kd_loss, soft_clip
from raysim.privacy.prototypes import discriminativeness_scores, laplace_noise, private_topk_partition, topk_laplace_scale


def _classes(sizes, d, seed, spread=1.0):
    g = np.random.default_rng(seed)
    xs, ys = [], []
    for c, n in enumerate(sizes):
        xs.append(g.normal(loc=0.3 * c * np.arange(d) / d, scale=spread, size=(n, d)))
        ys.append(np.full(n, c))
    return np.concatenate(xs), np.concatenate(ys)


@pytest.mark.parametrize("sizes", [(9, 11), (7, 10, 13), (6, 1, 8, 12)])
def test_the_vpp_score_is_the_one_way_anova_f_statistic(sizes):
    # S_j = [SSB_j / (C - 1)] / [SSW_j / (n - C) + zeta] (vpdr.txt Eq. 7-8) is scipy's F statistic up to zeta =
    # 1e-3 median(SSB) + 1e-15, which is below 1e-2 of SSW/(n - C) here (unit within-class spread, asserted), so
    # S / F lies in (1 - 1e-2, 1]. Two classes, three, and a class of one example (it still counts in C and n)
    x, y = _classes(sizes, d=8, seed=len(sizes))
    s = discriminativeness_scores(torch.tensor(x), torch.tensor(y), num_classes=len(sizes) + 1).numpy()
    groups = [x[y == c] for c in range(len(sizes))]
    F = np.array([f_oneway(*[g[:, j] for g in groups]).statistic for j in range(x.shape[1])])
    n, C = len(y), len(sizes)
    ssw = sum(((g - g.mean(0)) ** 2).sum(0) for g in groups)
    ssb = sum(len(g) * (g.mean(0) - x.mean(0)) ** 2 for g in groups)
    zeta = 1e-3 * np.sort(ssb)[(len(ssb) - 1) // 2] + 1e-15  # torch.median: the lower middle value for even d
    assert np.all(zeta < 1e-2 * ssw / (n - C))
    np.testing.assert_allclose(s, F * (ssw / (n - C)) / (ssw / (n - C) + zeta), rtol=1e-9)  # float64 both sides
    assert np.all(s <= F * (1 + 1e-12)) and np.all(s > F * (1 - 1e-2))


def test_the_vpp_score_is_zero_without_two_classes_or_enough_examples():
    x, y = _classes((5,), d=4, seed=0)
    assert torch.equal(discriminativeness_scores(torch.tensor(x), torch.tensor(y), 3), torch.zeros(4, dtype=torch.float64))
    x2, y2 = _classes((1, 1), d=4, seed=0)  # n = C: no within-class degrees of freedom
    assert torch.equal(discriminativeness_scores(torch.tensor(x2), torch.tensor(y2), 2), torch.zeros(4, dtype=torch.float64))
    assert discriminativeness_scores(torch.tensor(x2).float(), torch.tensor(y2), 2).dtype == torch.float32


def test_the_private_partition_ranks_the_capped_scores_plus_laplace_noise():
    # I_A = top-k of clamp(S, 0, H) + Laplace(2 k H T / eps1), drawn from the caller's generator: redone by hand
    # from the same seed. Scores above H and below 0 exercise the cap; the noise is of the order of the scores
    scores = torch.tensor([9.0, 0.2, -4.0, 0.9, 0.5, 3.0, 0.1, 0.7], dtype=torch.float64)
    k, H, eps1, T = 3, 1.0, 48.0, 2
    lam = topk_laplace_scale(k=k, H=H, epsilon1=eps1, rounds=T)
    assert lam == pytest.approx(2 * k * H * T / eps1)
    for seed in range(20):
        a, b = private_topk_partition(scores, k=k, H=H, epsilon1=eps1, rounds=T, generator=torch.Generator().manual_seed(seed))
        noisy = scores.clamp(0.0, H) + laplace_noise(8, lam, torch.Generator().manual_seed(seed), scores.device)
        want = torch.sort(torch.topk(noisy, k).indices).values
        assert torch.equal(a, want)
        assert torch.equal(torch.sort(torch.cat([a, b])).values, torch.arange(8))
    # no noise (eps1 = inf): the k largest capped scores; ties at the cap H go to any of them
    a, _ = private_topk_partition(scores, k=2, H=10.0, epsilon1=math.inf, rounds=1, generator=None)
    assert a.tolist() == [0, 5]


@pytest.mark.parametrize("bad,words", [
    (dict(k=0), "k must lie in [1, 4], got 0"),
    (dict(k=5), "k must lie in [1, 4], got 5"),
    (dict(H=0.0), "score cap H must be > 0"),
    (dict(epsilon1=0.0), "epsilon1 must be > 0"),
    (dict(rounds=0), "rounds must be >= 1"),
])
def test_the_private_partition_refuses_arguments_outside_their_domain(bad, words):
    ok = dict(k=2, H=1.0, epsilon1=1.0, rounds=1, generator=None)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        private_topk_partition(torch.zeros(4), **{**ok, **bad})
    assert private_topk_partition(torch.zeros(4), **{**ok, "k": 4})[0].numel() == 4  # k = d: the closed end
    assert private_topk_partition(torch.zeros(4), **{**ok, "k": 1})[0].numel() == 1  # k = 1: the other


def test_client_level_noise_worked_values():
    # the update (3, 4) has norm 5: clipped to C = 2.5 it is (1.5, 2); sigma = 1 adds N(0, (sigma C)^2) per
    # coordinate from the caller's generator in sorted key order (redone by hand); sigma = 0 adds nothing
    up = {"b": torch.tensor([4.0]), "a": torch.tensor([3.0])}
    clipped = clip_update(up, 2.5)
    torch.testing.assert_close(clipped["a"], torch.tensor([1.5]))  # exact in binary: 3 x 0.5
    torch.testing.assert_close(clipped["b"], torch.tensor([2.0]))
    assert clip_update(up, 10.0)["a"].item() == pytest.approx(3.0)  # inside the ball: unchanged
    assert noise_update(up, clip=2.5, sigma=0.0, generator=None)["a"].item() == pytest.approx(1.5)
    g = torch.Generator().manual_seed(4)
    za = torch.randn((1,), generator=g, dtype=torch.float32)
    zb = torch.randn((1,), generator=g, dtype=torch.float32)
    out = noise_update(up, clip=2.5, sigma=1.0, generator=torch.Generator().manual_seed(4))
    assert list(out) == ["b", "a"]  # the caller's key order is kept
    # tolerance: float32 sums of values of order 1
    assert out["a"].item() == pytest.approx(1.5 + 2.5 * za.item(), abs=1e-6)
    assert out["b"].item() == pytest.approx(2.0 + 2.5 * zb.item(), abs=1e-6)
    assert out["a"].dtype == torch.float32
    with pytest.raises(ConfigError, match="sigma must be >= 0"):
        noise_update(up, clip=2.5, sigma=-1.0, generator=None)
    with pytest.raises(ConfigError, match="clip must be > 0"):
        clip_update(up, 0.0)


def test_clustered_centres_are_noised_by_their_own_member_counts():
    # FPL / FedPLVM: centre k of class c has sensitivity 2R / n_k, so its noise std is sigma 2R / n_k. Features of
    # zero norm leave each clean centre at 0: the release is the noise. Centres of 2 and 8 members, 4000
    # coordinates each: 5 standard errors of a sample std is 5 / sqrt(8000) = 5.6%
    from raysim.privacy.prototypes import igpp_release

    d, R, sigma = 4000, 3.0, 1.5
    labels = torch.zeros(10, dtype=torch.long)
    ids = torch.tensor([0, 0] + [1] * 8)
    out = igpp_release(torch.zeros(10, d), labels, clip=R, sigma=sigma, generator=torch.Generator().manual_seed(0),
                       assignments=ids)[0]
    assert out.shape == (2, d)
    for k, members in ((0, 2), (1, 8)):
        assert float(out[k].std()) == pytest.approx(sigma * 2 * R / members, rel=5 / math.sqrt(2 * d))
    means = igpp_release(torch.zeros(10, d), labels, clip=R, sigma=sigma, generator=torch.Generator().manual_seed(0))[0]
    assert float(means.std()) == pytest.approx(sigma * 2 * R / 10, rel=5 / math.sqrt(2 * d))  # one mean of 10


# ------------------------------------------------------------- the survivors of the 2026-12-06 run (functions
# smaller than the groups above; docs/testing.md, "Mutation testing", the third table)
def _hockey_stick(m: float, eps: float) -> float:
    """delta(eps) of N(0, m^2) against N(1, m^2) from its definition, int (p - e^eps q)_+ dx, by quadrature
    (independent of the closed form the accountant uses)."""
    from scipy import integrate
    from scipy.stats import norm

    def f(x):
        return max(0.0, norm.pdf(x, 0.0, m) - math.exp(eps) * norm.pdf(x, 1.0, m))

    # the integrand is 0 right of the crossing point x* = 1/2 - eps m^2; below it, p dominates
    cross = 0.5 - eps * m * m
    value, _ = integrate.quad(f, cross - 40.0 * m, cross, epsabs=1e-14, epsrel=1e-10, limit=400)
    return value


@pytest.mark.parametrize("m, eps", [(0.5, 0.0), (0.5, 3.0), (1.0, 0.5), (2.0, 0.1), (0.8, 1.7)])
def test_the_analytic_gaussian_delta_is_the_hockey_stick_divergence(m, eps):
    # Balle and Wang's closed form against the divergence's definition; tolerance: quad's 1e-10 relative error
    # plus the erfc rounding of the closed form (1e-12 absolute covers both at these deltas, 1e-4 to 0.4)
    got = acc.analytic_gaussian_delta(m, eps)
    assert got == pytest.approx(_hockey_stick(m, eps), rel=1e-8, abs=1e-12)
    assert 0.0 < got < 1.0


@pytest.mark.parametrize("m", [5.0, 1.0, 0.05, 0.024])
def test_the_analytic_gaussian_epsilon_is_the_smallest_that_meets_delta(m):
    # the bisection stops at width 1e-9 and returns its upper end: epsilon meets delta, and epsilon - 1e-8 no
    # longer does (so the result is exact to 1e-8). m = 5 needs epsilon < 1 (below the first bracket), m = 1 one
    # past two doublings of it; m = 0.024 (the classical multiplier at epsilon 200) one above 709, where e^eps
    # alone overflows a float (it raised OverflowError before 2026-12-06)
    delta = 1e-5
    eps = acc.analytic_gaussian_epsilon(m, delta=delta)
    assert math.isfinite(eps) and eps > 1e-8
    assert acc.analytic_gaussian_delta(m, eps) <= delta < acc.analytic_gaussian_delta(m, eps - 1e-8)
    assert {5.0: eps < 1.0, 1.0: 2.0 < eps < 8.0, 0.05: 8.0 < eps < 709.0, 0.024: eps > 709.0}[m]


def test_the_analytic_gaussian_epsilon_edges():
    # no noise (m <= 0), or so little that epsilon would pass 8,192 (the bracket's last doubling under 1e4):
    # infinite; so much that delta(0) already meets the target (m > 1 / (sqrt(2 pi) delta) ~ 4e4 at delta 1e-5): zero
    assert acc.analytic_gaussian_epsilon(0.0, delta=1e-5) == math.inf
    assert acc.analytic_gaussian_epsilon(-1.0, delta=1e-5) == math.inf
    assert acc.analytic_gaussian_epsilon(1e-3, delta=1e-5) == math.inf
    assert math.isfinite(acc.analytic_gaussian_epsilon(acc.classic_gaussian_multiplier(epsilon=200.0, delta=1e-5),
                                                       delta=1e-5))  # a classical-Gaussian share at epsilon 200
    assert acc.analytic_gaussian_epsilon(1e6, delta=1e-5) == 0.0
    with pytest.raises(ConfigError, match="delta must lie in"):
        acc.analytic_gaussian_epsilon(1.0, delta=0.0)


@pytest.mark.parametrize("eps, delta", [(0.5, 1e-5), (0.9, 1e-3), (0.2, 1e-6)])
def test_the_classic_gaussian_multiplier_is_dwork_roths_and_meets_its_guarantee(eps, delta):
    # sqrt(2 ln(1.25 / delta)) / epsilon (Dwork and Roth, Thm. A.1); its proof covers epsilon < 1, where the
    # exact (analytic) epsilon of that noise is at most the epsilon asked for
    m = acc.classic_gaussian_multiplier(epsilon=eps, delta=delta)
    assert m == pytest.approx(math.sqrt(2.0 * math.log(1.25 / delta)) / eps, rel=1e-12)
    assert acc.analytic_gaussian_epsilon(m, delta=delta) <= eps
    assert acc.classic_gaussian_multiplier(epsilon=math.inf, delta=delta) == 0.0
    with pytest.raises(ConfigError, match="epsilon must be > 0"):
        acc.classic_gaussian_multiplier(epsilon=0.0, delta=delta)
    with pytest.raises(ConfigError, match="delta must lie in"):
        acc.classic_gaussian_multiplier(epsilon=eps, delta=1.0)


def test_clipping_an_update_below_norm_one_scales_it_to_C():
    # ||u|| = 0.5 and C = 0.2: the factor is C / ||u|| = 0.4 (a floor on the norm is only there for u = 0)
    up = {"a": torch.tensor([0.3]), "b": torch.tensor([0.4])}
    out = clip_update(up, 0.2)
    assert out["a"].item() == pytest.approx(0.12, rel=1e-6) and out["b"].item() == pytest.approx(0.16, rel=1e-6)
    assert clip_update({"z": torch.zeros(3)}, 0.2)["z"].abs().sum() == 0  # zero update: no division by zero


def test_client_level_noise_without_a_generator_is_drawn_on_the_cpu_at_sigma_C():
    # generator=None (the signature allows it): the global CPU stream; 40000 coordinates give the sample std to
    # within 5 / sqrt(2 * 40000) = 1.8% (5 standard errors)
    n, clip, sigma = 40000, 0.5, 1.5
    up = {"w": torch.zeros(n)}
    out = noise_update(up, clip=clip, sigma=sigma, generator=None)
    assert out["w"].device.type == "cpu"
    assert float(out["w"].std()) == pytest.approx(sigma * clip, rel=5 / math.sqrt(2 * n))


def test_soft_clip_worked_values_below_and_above_the_radius():
    # z * min(1, R / (||z|| + gamma R)) row by row; R = 2 and gamma = 0.5 so that gamma R differs from gamma / R,
    # and rows whose denominator is below 1 (a floor on it is only there for z = 0). float64: exact to 1e-12
    R, gamma = 2.0, 0.5
    z = torch.tensor([[0.03, 0.04], [3.0, 4.0], [0.0, 0.0], [0.6, 0.8]], dtype=torch.float64)
    norms = torch.tensor([0.05, 5.0, 0.0, 1.0], dtype=torch.float64)
    scale = R / (norms + gamma * R)
    torch.testing.assert_close(soft_clip(z, R=R, gamma=gamma, expand=True), z * scale[:, None], rtol=1e-12, atol=0)
    torch.testing.assert_close(soft_clip(z, R=R, gamma=gamma), z * scale.clamp(max=1.0)[:, None], rtol=1e-12, atol=0)
    assert soft_clip(z, R=R, gamma=gamma)[0].tolist() == z[0].tolist()  # inside: unchanged (shrink only)
    small = torch.tensor([[0.03, 0.04]], dtype=torch.float64)  # ||z|| + gamma R = 0.05 + 0.05 < 1
    assert float(soft_clip(small, R=0.5, gamma=0.1, expand=True).norm()) == pytest.approx(0.05 * 0.5 / 0.1, rel=1e-12)


def test_the_distillation_loss_below_temperature_one_is_t_squared_times_the_kl():
    # KL(softmax(t / T) || softmax(s / T)) T^2, averaged over the batch, at T = 0.5 (temperatures below 1 are
    # valid: they sharpen); numpy in float64 against torch in float64
    s = np.array([[1.0, -0.5, 2.0], [0.3, 0.1, -1.0]])
    t = np.array([[0.5, 0.5, 1.0], [2.0, -1.0, 0.0]])
    T = 0.5

    def log_softmax(a):
        a = a / T
        return a - np.log(np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True)) - a.max(-1, keepdims=True)

    ls, lt = log_softmax(s), log_softmax(t)
    want = float((np.exp(lt) * (lt - ls)).sum(-1).mean() * T * T)
    got = kd_loss(torch.tensor(s), torch.tensor(t), T=T)
    assert float(got) == pytest.approx(want, rel=1e-10)


def test_the_analytic_gaussian_epsilon_is_finite_up_to_the_last_doubling_of_its_bracket():
    # the bracket doubles from 1 while delta(hi) is above the target and gives up past 1e4 (at 16384), so an epsilon
    # of ~7400 (m = 0.0085) is still found, to the bisection's 1e-9 (checked as above, with 1e-8)
    eps = acc.analytic_gaussian_epsilon(0.0085, delta=1e-5)
    assert 6561.0 < eps < 8192.0
    assert acc.analytic_gaussian_delta(0.0085, eps) <= 1e-5 < acc.analytic_gaussian_delta(0.0085, eps - 1e-8)
