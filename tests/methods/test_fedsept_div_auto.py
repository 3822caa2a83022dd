"""fedsept.div_reduction=auto (the default): the paper's sum of L_div without DP, the official code's mean
under DP, where the sum's data-independent gradient inside every clipped per-example loss drowns the
data (docs/papers/fedsept.md "L_div under DP")."""

from __future__ import annotations

import math

import torch

from raysim.config import DPConfig
from raysim.methods import TrainConfig, get_method
from raysim.methods.fedsept.fedsept_parts import diversity_loss


def _method(epsilon: float, reduction: str = "auto"):
    cls = get_method("fedsept")
    return cls(TrainConfig(), cls.Options(div_reduction=reduction), DPConfig(epsilon=epsilon))


def test_auto_picks_mean_under_dp_and_sum_without():
    assert _method(math.inf).div_reduction == "sum"
    assert _method(1.0).div_reduction == "mean"
    assert _method(1.0, "sum").div_reduction == "sum" and _method(math.inf, "mean").div_reduction == "mean"
    assert get_method("fedsept").Options().div_reduction == "auto"


def test_the_reduction_in_use_is_what_the_loss_computes():
    """M = 4 experts: the sum is M (M - 1) = 12 times the mean, on any A with correlated experts."""
    A = torch.randn(4 * 3, 5, generator=torch.Generator().manual_seed(0)) + 1.0
    total, mean = diversity_loss(A, 4, "sum"), diversity_loss(A, 4, "mean")
    assert float(total) > 0 and abs(float(total) / float(mean) - 12) < 1e-4  # float32 sums of 12 terms
    for eps, want in ((math.inf, total), (1.0, mean)):
        m = _method(eps)
        got = diversity_loss(A, m.M, m.div_reduction)
        assert abs(float(got) - float(want)) < 1e-6
