"""The shipped raysim-clip2 behaves like CLIP at a prompt learner's start (issue 24, item 5):
through the prompt learner's own text path, a zero context and N(0, 0.02^2) contexts (the official CoOp /
FedSEPT initialisation) score within 3 points of the phrase "a photo of a"; and the model has patch tokens.

The Gaussian row is the mean over the same 5 draws the model card reports (single draws spread by a few
points: `benchmarks/fedsept_offline_analysis.py`'s one draw scores 64.5 against the phrase's 68.0, and FedSEPT's
A B0 start 66.4). The weights and the generated data are fixed, so the accuracies are deterministic up to float round-off,
which differs by CPU (summation order in the matrix products): that can flip a prediction whose two best
classes tie to within ~1e-6, a few of the 3,000 test images at most (0.1 point). The assertion is the
property itself (a gap of at most 3 points); the measured gaps (MODEL_CARD.md) are well inside it, so the
round-off cannot decide it, while a model trained on captions only fails it by 10 to 20 points
(raysim-clip: 15.3 on synthetic-large, below)."""

from __future__ import annotations

import pytest

from raysim.data import synthetic as syn
from raysim.models import bundled
from raysim.models.clip import ModelSpec, load_clip, token_site
from raysim.tools.pretrain_prompts import context_zero_shot


@pytest.fixture(scope="module")
def large_test(cache_dir):
    return syn.generate(syn.LARGE, cache_dir)[1]


def _contexts(name: str, cache_dir: str, split) -> dict:
    model = load_clip(ModelSpec(name, "bundled", cache_dir=cache_dir))
    return context_zero_shot(model, name, split.images, split.labels, list(syn.LARGE.classes), split.domains,
                             list(syn.LARGE.domains), n_random=5)


def test_raysim_clip2_scores_a_near_zero_context_like_the_phrase(cache_dir, large_test):
    acc = _contexts(bundled.BUNDLED_NAME, cache_dir, large_test)
    phrase = acc["phrase"]["overall"]
    assert phrase > acc["chance"] + 30, acc  # a real zero-shot classifier
    for start in ("zero", "gauss"):
        assert abs(acc[start]["overall"] - phrase) <= 3.0, (start, acc)


def test_the_captions_only_model_does_not(cache_dir, large_test):
    """The check can fail: the earlier shipped model (captions only) loses far more than 3 points."""
    acc = _contexts(bundled.LEGACY_NAME, cache_dir, large_test)
    assert acc["phrase"]["overall"] - acc["zero"]["overall"] > 3.0, acc


def test_raysim_clip2_has_patch_tokens(cache_dir):
    visual = load_clip(ModelSpec(bundled.BUNDLED_NAME, "bundled", cache_dir=cache_dir)).visual
    _, _, width = token_site(visual)
    grid = visual.grid_size if hasattr(visual, "grid_size") else None
    assert width > 0 and grid is not None and grid[0] * grid[1] > 1  # 8 x 8 patches of 4 px at 32 px
