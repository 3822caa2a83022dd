"""The offline benchmark means something: on the bundled default model (raysim-clip3) and the generated `synthetic` data,
prompt tuning beats zero-shot CLIP, with margin, for every seed tried (issue 7's ordering test)."""

from __future__ import annotations

import pytest

from raysim.build import build_config
from raysim.config import merge_config
from raysim.engine.loop import run


def in_client(tmp_path, cache_dir, name, **overrides) -> float:
    values = dict(execution={"backend": "inline"},
                  output={"progress": False, "tensorboard": False, "cache_dir": cache_dir, "out_dir": str(tmp_path / name)})
    cfg = build_config(merge_config(values, overrides))
    assert (cfg.model.name, cfg.model.pretrained, cfg.data.dataset) == ("raysim-clip3", "bundled", "synthetic")  # the defaults
    return run(cfg).summary["in_client"]


@pytest.fixture(scope="module")
def zero_shot(tmp_path_factory, cache_dir) -> float:
    acc = in_client(tmp_path_factory.mktemp("zs"), cache_dir, "zs", method="zeroshot", train={"rounds": 1})
    assert 0.4 < acc < 0.8  # well above chance (10%), with room left for prompt tuning
    return acc


@pytest.mark.parametrize("seed", [1, 2])
def test_prompt_tuning_beats_zero_shot(tmp_path, cache_dir, zero_shot, seed):
    # centralised CoOp: one client holding a 64-shot training set, 8 local epochs
    coop = in_client(tmp_path, cache_dir, "coop", method="promptfl",
                     train={"num_clients": 1, "rounds": 1, "local_epochs": 8, "lr": 0.02, "seed": seed},
                     data={"partition": "iid", "shots": 64})
    assert coop > zero_shot + 0.03
    # FedSEPT on the default federation (10 clients, pathological skew): personalised In-Client accuracy
    fedsept = in_client(tmp_path, cache_dir, "fedsept", method="fedsept", train={"rounds": 3, "seed": seed})
    assert fedsept > zero_shot + 0.10
