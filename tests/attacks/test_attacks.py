"""Membership inference on released prototypes: works without DP, is blunted by LDP."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.attacks import prototype_mia, roc_metrics
from raysim.privacy import calibrate_multiplier, igpp_release


def test_roc_metrics_agree_with_sklearn():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    a, b = rng.normal(1.0, 1.0, 300), rng.normal(0.0, 1.0, 400)
    auc, tpr1, tpr01, adv, f1 = roc_metrics(a, b)
    ref = roc_auc_score(np.r_[np.ones(300), np.zeros(400)], np.r_[a, b])
    assert abs(auc - ref) < 1e-9
    assert 0 <= tpr01 <= tpr1 <= 1 and 0 < adv < 1 and 0 < f1 <= 1
    # members all score above non-members: a perfect attack, AUC 1 (up to the trapezoid sum's round-off)
    assert roc_metrics(np.array([2.0, 3.0]), np.array([0.0, 1.0]))[0] == pytest.approx(1.0, abs=1e-12)


def _client(seed=0, n=8, d=64, classes=3):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=g)
    def draw(k):
        y = torch.arange(classes).repeat_interleave(k)
        return centres[y] + 3.0 * torch.randn(len(y), d, generator=g), y
    return draw(n), draw(200)


def test_clean_prototypes_leak_membership_and_ldp_blunts_it():
    (xm, ym), (xn, yn) = _client()
    clean = igpp_release(xm, ym, clip=1e6, sigma=0.0, generator=torch.Generator().manual_seed(1))
    leak = prototype_mia(xm, ym, xn, yn, clean)
    assert leak.auc > 0.9 and leak.advantage > 0.5
    sigma = calibrate_multiplier(epsilon=1.0, delta=1e-5, plan=[(1.0, 20)])  # IGPP over 20 rounds
    aucs = []
    for s in range(5):
        noisy = igpp_release(xm, ym, clip=5.0, sigma=sigma, generator=torch.Generator().manual_seed(s))
        aucs.append(prototype_mia(xm, ym, xn, yn, noisy).auc)
    assert abs(float(np.mean(aucs)) - 0.5) < 0.15
