"""Bounded configs, checked before anything is written: clients per split, the Dirichlet redraws, counts
capped at documented maxima, a lazy evaluation schedule, and a failed start that leaves nothing."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config

from raysim.build import build_config
from raysim.config.limits import MAX_CLIENTS, MAX_ROUNDS
from raysim.engine.loop import eval_rounds, run
from raysim.errors import ConfigError

P = importlib.import_module("raysim.data.partition")  # raysim.data re-exports the function under the same name
ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def spec(n_train: int, n_test: int, clients: int, classes: int = 4, **kw) -> P.PartitionSpec:
    rng = np.random.default_rng(0)
    return P.PartitionSpec(rng.integers(0, classes, n_train), rng.integers(0, classes, n_test), clients, seed=0, **kw)


def test_more_clients_than_a_split_can_serve_is_refused_with_the_largest_valid_value():
    with pytest.raises(ConfigError, match=r"train.num_clients=400 .*largest valid value is train.num_clients=192"):
        P.partition("iid", spec(384, 192, 400))
    splits = P.partition("iid", spec(384, 192, 192))  # the value the message gives works: every client has both splits
    assert len(splits) == 192 and min(len(s.train) for s in splits) >= 1 and min(len(s.test) for s in splits) >= 1


def test_dirichlet_counts_its_minimum_per_client():
    with pytest.raises(ConfigError, match=r"10 samples .*largest valid value is train.num_clients=19"):
        P.partition("dirichlet", spec(384, 192, 5000))
    with pytest.raises(ConfigError, match="largest valid value is train.num_clients=96"):
        P.partition("dirichlet", spec(384, 192, 100, min_samples=2))


def test_the_dirichlet_redraws_are_bounded_in_time_and_their_failure_explained(monkeypatch):
    monkeypatch.setattr(P, "DIRICHLET_MAX_SECONDS", 0.5)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"Dirichlet draws .*best draw left a client \d+ sample.*Raise data.beta"):
        P.partition("dirichlet", spec(4000, 2000, 19, beta=1e-4, min_samples=100))  # feasible by count, not by skew
    assert time.monotonic() - t0 < 15  # 0.5 s of draws plus one draw's overrun; a loaded 2-core machine is slow


@pytest.mark.parametrize("key,value,limit", [("rounds", 99999999999999999999, MAX_ROUNDS), ("num_clients", MAX_CLIENTS + 1, MAX_CLIENTS),
                                             ("local_epochs", 10**9, None), ("batch_size", 10**12, None)])
def test_counts_past_their_documented_maximum_are_refused(key, value, limit):
    with pytest.raises(ConfigError, match=rf"train.{key} is at most [\d,]+ \(raysim's documented maximum"):
        build_config({"train": {key: value}})
    if limit is not None:
        assert f"{limit:,}" in str(pytest.raises(ConfigError, build_config, {"train": {key: value}}).value)


def test_the_evaluation_schedule_is_computed_per_round_not_built_up_front():
    t0 = time.perf_counter()
    sched = eval_rounds(10**15, 5, 5)  # a set of 2 * 10^14 rounds would never finish
    assert 4 in sched and 3 not in sched and 10**15 - 1 in sched and 10**15 not in sched
    assert time.perf_counter() - t0 < 1.0
    assert eval_rounds(50, 5, 5) == {4, 9, 14, 19, 24, 29, 34, 39, 44, 45, 46, 47, 48, 49}


def test_a_start_that_fails_after_config_yaml_would_be_written_leaves_nothing(tmp_path, cache_dir):
    out = tmp_path / "deep" / "run"
    # a ctx_init whose token count is not n_ctx fails only when the clients' text towers are built
    cfg = tiny_config(tmp_path, cache_dir, train={"ctx_init": "a photo of a", "n_ctx": 16},
                      output={"out_dir": str(out), "tensorboard": True})
    with pytest.raises(ConfigError, match="exactly n_ctx"):
        run(cfg)
    assert not (tmp_path / "deep").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    cfg = tiny_config(tmp_path, cache_dir, train={"ctx_init": "a photo of a", "n_ctx": 16},
                      output={"out_dir": str(kept), "tensorboard": True})
    with pytest.raises(ConfigError):
        run(cfg)
    assert kept.is_dir() and list(kept.iterdir()) == []  # a folder that was there stays, empty
    run(tiny_config(tmp_path, cache_dir, train={"rounds": 1}, output={"out_dir": str(kept)}))  # and can be used


def test_a_100000_character_ctx_init_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, str(ROOT / "raysim" / "run.py"), f"train.ctx_init={'a' * 100_000}",
                        f"output.out_dir={out}", "execution.backend=inline"], env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "train.ctx_init" in p.stderr, p.stderr[-2000:]
    assert len(p.stderr) < 1000  # one line, not the phrase echoed back
    assert not out.exists()
