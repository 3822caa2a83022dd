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
from raysim.privacy.client_level import clip_update, noise_update
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
