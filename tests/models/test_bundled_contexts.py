"""The shipped raysim-clip3 behaves like CLIP at a prompt learner's start (issue 24, item 5): through the
prompt learner's own text path, a zero context and N(0, 0.02^2) contexts (the official CoOp / FedSEPT
initialisation) score within 3 points of the phrase "a photo of a"; and the model has patch tokens.

The Gaussian row is the mean over 5 fresh draws (`context_zero_shot(seed=FRESH_DRAWS)`, as the model cards
report them). With seed 0, the default, the first draws are exactly the 4-vector Gaussian contexts of the
pretraining prompt pool (`context_pool` draws from the same generator sequence), so on a model trained with
that pool seed 0 measures contexts it was fitted to: raysim-clip2 scores 67.1 there against the phrase's
68.0, but 61.0 and 59.8 on fresh draws (seeds 101 and 102). Its Gaussian property does not hold on fresh
draws (asserted below); raysim-clip3 (a pool of 256 draws per length, and the zero / Gaussian contexts distilled
onto the phrase without labels) keeps it on fresh draws.

The weights and the generated data are fixed, so the accuracies are deterministic up to float round-off,
which differs by CPU (summation order in the matrix products): that can flip a prediction whose two best
classes tie to within ~1e-6, a few of the 3,000 test images at most (0.1 point). The assertion is the
property itself (a gap of at most 3 points), while a model trained on captions only fails it by 10 to 20
points (raysim-clip: 15.3 on synthetic-large, below)."""

from __future__ import annotations

import pytest

from raysim.data import synthetic as syn
from raysim.models import bundled
from raysim.models.clip import ModelSpec, load_clip, token_site
from raysim.tools.pretrain_prompts import FRESH_DRAWS, context_zero_shot


@pytest.fixture(scope="module")
def large_test(cache_dir):
    return syn.generate(syn.LARGE, cache_dir)[1]


def _contexts(name: str, cache_dir: str, split, seed: int = FRESH_DRAWS) -> dict:
    model = load_clip(ModelSpec(name, "bundled", cache_dir=cache_dir))
    return context_zero_shot(model, name, split.images, split.labels, list(syn.LARGE.classes), split.domains,
                             list(syn.LARGE.domains), n_random=5, seed=seed)


def _near_phrase(acc: dict) -> None:
    phrase = acc["phrase"]["overall"]
    assert phrase > acc["chance"] + 30, acc  # a real zero-shot classifier
    for start in ("zero", "gauss"):
        assert abs(acc[start]["overall"] - phrase) <= 3.0, (start, acc)


def test_the_default_model_scores_a_near_zero_context_like_the_phrase(cache_dir, large_test):
    assert bundled.DEFAULT_NAME == bundled.CLIP3_NAME
    _near_phrase(_contexts(bundled.DEFAULT_NAME, cache_dir, large_test))


def test_raysim_clip2_only_on_its_training_pools_draws(cache_dir, large_test):
    """What raysim-clip2's card first reported (zero 67.0, N 67.1, phrase 68.0) holds on seed 0's Gaussian draws,
    which are its prompt pool's own; fresh draws lose 7-8 points (61.0 / 59.8 against 68.0 at seeds 101 / 102):
    the gap asserted (> 3) is the property's failure, with room for the round-off described above."""
    _near_phrase(_contexts(bundled.BUNDLED_NAME, cache_dir, large_test, seed=0))
    fresh = _contexts(bundled.BUNDLED_NAME, cache_dir, large_test)
    assert fresh["phrase"]["overall"] - fresh["gauss"]["overall"] > 3.0, fresh


def test_the_captions_only_model_does_not(cache_dir, large_test):
    """The check can fail: the earlier shipped model (captions only) loses far more than 3 points."""
    acc = _contexts(bundled.LEGACY_NAME, cache_dir, large_test)
    assert acc["phrase"]["overall"] - acc["zero"]["overall"] > 3.0, acc


@pytest.mark.parametrize("name", [bundled.BUNDLED_NAME, bundled.CLIP3_NAME])
def test_has_patch_tokens(cache_dir, name):
    visual = load_clip(ModelSpec(name, "bundled", cache_dir=cache_dir)).visual
    _, _, width = token_site(visual)
    grid = visual.grid_size if hasattr(visual, "grid_size") else None
    assert width > 0 and grid is not None and grid[0] * grid[1] > 1  # 8 x 8 patches of 4 px at 32 px
