import math

import pytest
import torch

from raysim.errors import ConfigError
from raysim.privacy import (
    clip_update,
    discriminativeness_scores,
    group_clip,
    igpp_release,
    noise_update,
    private_topk_partition,
    vpp_release,
    vpp_sigmas,
)
from raysim.privacy.prototypes import l2_clip, laplace_noise, topk_laplace_scale


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_vpp_sigmas_budget_and_discriminative_group():
    rng = _gen(3)
    d = 512
    for rho in torch.rand(50, generator=rng).clamp_min(1e-3) * 0.5:
        d_A = math.ceil(float(rho) * d)
        sigma_ref = 24.30
        sA, sB = vpp_sigmas(sigma_ref, d, d_A)
        assert 1 / sA**2 + 1 / sB**2 <= 1 / sigma_ref**2 * (1 + 1e-9)
        # per-coordinate noise on I_A, sigma_A * Delta_A = sigma_A * kappa_A * Delta, is no more than
        # the isotropic sigma_ref * Delta (vpdr.txt section 4.2, rho <= 0.5)
        kA = math.sqrt(d_A / d)
        assert sA * kA <= sigma_ref * (1 + 1e-9)
        assert sB >= sigma_ref
    sA, sB = vpp_sigmas(1.0, 512, 154)  # SPEC 3.2 step 7: 0.706 on A, 1.329 on B
    assert sA * math.sqrt(154 / 512) == pytest.approx(0.706, abs=1e-3)
    assert sB * math.sqrt(358 / 512) == pytest.approx(1.329, abs=1e-3)


def test_laplace_scale_empirical():
    lam = topk_laplace_scale(k=154, H=0.1, epsilon1=0.1, rounds=20)
    assert lam == pytest.approx(2 * 154 * 0.1 * 20 / 0.1)
    x = laplace_noise(200_000, 3.0, _gen(1), torch.device("cpu"))
    assert x.abs().mean().item() == pytest.approx(3.0, rel=0.02)  # E|X| = scale
    assert x.var().item() == pytest.approx(2 * 9.0, rel=0.03)  # Var = 2 scale^2
    assert abs(x.mean().item()) < 0.05


def test_topk_partition():
    s = torch.linspace(0, 1, 20)
    a, b = private_topk_partition(s, k=5, H=2.0, epsilon1=math.inf, rounds=1, generator=_gen())
    assert a.tolist() == [15, 16, 17, 18, 19] and b.tolist() == list(range(15))
    a1, _ = private_topk_partition(s, k=5, H=0.1, epsilon1=0.1, rounds=20, generator=_gen(4))
    a2, _ = private_topk_partition(s, k=5, H=0.1, epsilon1=0.1, rounds=20, generator=_gen(4))
    assert a1.tolist() == a2.tolist() and len(a1) == 5
    with pytest.raises(ConfigError):
        private_topk_partition(s, k=0, H=0.1, epsilon1=1.0, rounds=1, generator=_gen())


def test_scores_and_degenerate():
    g = _gen(2)
    y = torch.arange(4).repeat_interleave(25)
    z = torch.randn(100, 6, generator=g)
    z[:, 0] += 5 * y  # dimension 0 separates the classes
    s = discriminativeness_scores(z, y, 4)
    assert s.shape == (6,) and int(s.argmax()) == 0 and (s >= 0).all()
    assert discriminativeness_scores(z, torch.zeros(100, dtype=torch.long), 4).abs().sum() == 0
    assert discriminativeness_scores(z[:3], y[:3] * 0 + torch.tensor([0, 1, 2]), 4).abs().sum() == 0  # n <= C


def test_group_clip_bounds():
    z = torch.randn(30, 16, generator=_gen(5)) * 10
    idx_A, idx_B = torch.tensor([1, 4, 7, 9]), torch.tensor([i for i in range(16) if i not in (1, 4, 7, 9)])
    out = group_clip(z, idx_A, idx_B, 2.0)
    assert (out[:, idx_A].norm(dim=1) <= 2.0 * math.sqrt(4 / 16) + 1e-5).all()
    assert (out[:, idx_B].norm(dim=1) <= 2.0 * math.sqrt(12 / 16) + 1e-5).all()
    assert (out.norm(dim=1) <= 2.0 + 1e-5).all()


def test_igpp_noise_scale_and_clip():
    d, n = 4000, 50
    z = torch.randn(n, d, generator=_gen(6))
    y = torch.zeros(n, dtype=torch.long)
    clean = igpp_release(z, y, clip=1.0, sigma=0.0, generator=_gen())
    assert clean[0].norm() <= 1.0 + 1e-6
    noisy = igpp_release(z, y, clip=1.0, sigma=3.0, generator=_gen(7))
    assert (noisy[0] - clean[0]).std().item() == pytest.approx(3.0 * 2 / n, rel=0.05)
    # clustered centres: each centre's noise uses its own member count
    assign = torch.tensor([0] * 10 + [1] * 40)
    out = igpp_release(z, y, clip=1.0, sigma=3.0, generator=_gen(7), assignments=assign)
    assert out[0].shape == (2, d)


def test_vpp_release_noise_per_group():
    d, n = 512, 40
    z = torch.randn(n, d, generator=_gen(8))
    y = torch.tensor([0] * 20 + [1] * 20)
    out = vpp_release(z, y, R=5.0, rho=0.3, H=0.1, epsilon=1.0, rounds=20, delta=1e-5, generator=_gen(9))
    assert out["sigma_ref"] == pytest.approx(24.30, abs=0.005)  # SPEC 3.2 item 8: VPP at T=20, epsilon=1 (bisection tol 1e-3)
    idx_A, idx_B = out["idx_A"], out["idx_B"]
    assert len(idx_A) == 154 and len(idx_B) == 358
    clean = group_clip(z, idx_A, idx_B, 5.0)[y == 0].mean(0)
    noise = out["prototypes"][0] - clean
    delta_s = 2 * 5.0 / 20
    sA = out["sigma_A"] * math.sqrt(154 / 512) * delta_s
    sB = out["sigma_B"] * math.sqrt(358 / 512) * delta_s
    assert noise[idx_A].std().item() == pytest.approx(sA, rel=0.2)
    assert noise[idx_B].std().item() == pytest.approx(sB, rel=0.15)
    # reproducible; epsilon=inf gives the clean group-clipped prototypes
    again = vpp_release(z, y, R=5.0, rho=0.3, H=0.1, epsilon=1.0, rounds=20, delta=1e-5, generator=_gen(9))
    torch.testing.assert_close(again["prototypes"][1], out["prototypes"][1])
    free = vpp_release(z, y, R=5.0, rho=0.3, H=0.1, epsilon=math.inf, rounds=20, delta=1e-5, generator=_gen(9))
    assert free["sigma_A"] == 0.0
    # clustered centres
    assign = torch.tensor(([0] * 5 + [1] * 15) * 2)
    cl = vpp_release(z, y, R=5.0, rho=0.3, H=0.1, epsilon=1.0, rounds=20, delta=1e-5, generator=_gen(9),
                     centres="cluster", assignments=assign)
    assert cl["prototypes"][0].shape == (2, d) and cl["counts"][0].tolist() == [5, 15]


def test_client_level_update():
    g = _gen(12)
    upd = {"a": torch.randn(100, 10, generator=g) * 5, "b": torch.randn(300, generator=g)}
    c = clip_update(upd, 2.0)
    norm = math.sqrt(sum(float(t.pow(2).sum()) for t in c.values()))
    assert norm == pytest.approx(2.0, rel=1e-5)
    n1 = noise_update(upd, clip=2.0, sigma=0.5, generator=_gen(13))
    n2 = noise_update(upd, clip=2.0, sigma=0.5, generator=_gen(13))
    torch.testing.assert_close(n1["a"], n2["a"])
    resid = torch.cat([(n1[k] - c[k]).reshape(-1) for k in upd])
    assert resid.std().item() == pytest.approx(1.0, rel=0.08)


def test_clean_centres_are_the_unclipped_cluster_means_class_by_class():
    # DP off with clustered prototypes: each (class, cluster) mean of the raw features (norms of 10 to 50: no
    # clipping), classes in increasing order and clusters by id within a class; exact means of small integers
    from raysim.privacy.prototypes import clean_centres

    x = torch.tensor([[10.0, 0.0], [0.0, 20.0], [0.0, 40.0], [30.0, 0.0], [50.0, 0.0], [0.0, 30.0]])
    labels = torch.tensor([1, 1, 1, 0, 0, 0])
    ids = torch.tensor([0, 1, 1, 0, 0, 1])
    want = torch.tensor([[40.0, 0.0], [0.0, 30.0], [10.0, 0.0], [0.0, 30.0]])
    assert torch.equal(clean_centres(x, labels, ids), want)
    with pytest.raises(ValueError, match=r"labels must have shape \(6,\)"):
        clean_centres(x, labels[:4], ids)  # one label per feature row


# ---- from the mutation run's survivors (docs/testing.md, "Mutation testing"): each test below fails on a named mutant


def test_l2_clip_scales_each_row_on_its_own_norm_and_never_scales_up():
    z = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.06, 0.08]])  # norms 5, 0.5 (below 1) and 0.1 (inside R)
    out = l2_clip(z, 0.2)
    # float32 products of short decimals: 1e-6 is a few ulps at these magnitudes
    torch.testing.assert_close(out, torch.tensor([[0.12, 0.16], [0.12, 0.16], [0.06, 0.08]]), rtol=0, atol=1e-6)


def test_igpp_noises_a_multiplier_below_one_and_refuses_a_zero_clip():
    d, n = 4000, 50
    z = torch.randn(n, d, generator=_gen(6))
    y = torch.zeros(n, dtype=torch.long)
    clean = igpp_release(z, y, clip=1.0, sigma=0.0, generator=_gen())
    noisy = igpp_release(z, y, clip=1.0, sigma=0.5, generator=_gen(7))
    # 4,000 coordinates: the sample std of N(0, s^2) is within 5 % of s with overwhelming probability
    assert (noisy[0] - clean[0]).std().item() == pytest.approx(0.5 * 2 / n, rel=0.05)
    with pytest.raises(ConfigError, match="clip must be > 0, got 0"):
        igpp_release(z, y, clip=0.0, sigma=1.0, generator=_gen())


def test_releases_without_a_generator_draw_from_torchs_global_generator():
    d, n = 2000, 20
    z = torch.randn(n, d, generator=_gen(21))
    y = torch.tensor([0] * 10 + [1] * 10)
    clean = igpp_release(z, y, clip=1.0, sigma=0.0, generator=None)
    torch.manual_seed(5)
    first = igpp_release(z, y, clip=1.0, sigma=2.0, generator=None)
    torch.manual_seed(5)
    again = igpp_release(z, y, clip=1.0, sigma=2.0, generator=None)
    torch.testing.assert_close(first[1], again[1])  # same global seed, same draws
    assert (first[1] - clean[1]).std().item() == pytest.approx(2.0 * 2 / 10, rel=0.08)  # 2,000 coordinates
    out = vpp_release(z, y, R=5.0, rho=0.3, H=0.1, epsilon=1.0, rounds=20, delta=1e-5, generator=None)
    assert torch.isfinite(out["prototypes"][0]).all() and len(out["idx_A"]) == 600


def test_a_discriminative_dimension_scores_highest_when_most_dimensions_carry_no_class_signal():
    # dimensions 0 and 1 are constant (between- and within-class variance 0: the median V_ter is 0, so zeta is its
    # 1e-15 floor); dimension 2 is the label itself (within-class variance 0): its score is V_ter / zeta, the largest
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    z = torch.stack([torch.ones(6), torch.ones(6), y.double()], dim=1)
    s = discriminativeness_scores(z, y, 2)
    assert int(s.argmax()) == 2 and s[2] > 1e10 and (s >= 0).all()


def test_topk_counts_a_negative_score_as_zero():
    # the scores are capped to [0, H] before the Laplace noise (the sensitivity H assumes it): a score far below 0
    # is a score of 0, which wins a 2-way top-1 against another 0 half of the time
    g = _gen(22)
    scores = torch.tensor([-1e6, 0.0])
    wins = sum(int(private_topk_partition(scores, k=1, H=1.0, epsilon1=2.0, rounds=1, generator=g)[0]) == 0
               for _ in range(400))
    assert 0.35 < wins / 400 < 0.65  # Binomial(400, 1/2): 6 standard deviations either side


def test_vpp_sigmas_refuse_an_empty_or_a_full_discriminative_group():
    for d_A in (0, 8):
        with pytest.raises(ConfigError, match=r"d_A must lie in \(0, 8\)"):
            vpp_sigmas(1.0, 8, d_A)
