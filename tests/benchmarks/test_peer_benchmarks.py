"""The pieces of benchmarks/vs_flower.py and benchmarks/scale.py that are not timings: the width-64 model,
raysim imported from the source tree, the plain loop and the inline engine training identically, the
check that says so, and the generated feature-level dataset. The timings are the benchmarks' to print."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import benchlib  # noqa: E402


def test_bench_model_is_a_width_64_clip():
    from raysim.models.clip import ModelSpec, build_clip_env

    env = build_clip_env(ModelSpec(benchlib.register_bench_model()), ["zero", "one"], n_ctx=4)
    assert env.ctx_width == 64 and env.feature_dim == 64
    assert env.prompts.text_features(env.prompts.initial_context(__import__("torch").Generator().manual_seed(0))).shape == (2, 64)


def test_source_tree_finder_maps_the_installed_layout():
    """methods/, privacy/, attacks/ are raysim.methods, ... as pyproject's package-dir says."""
    finder = benchlib._SourceTreeFinder(benchlib.ROOT)
    for name, folder in benchlib.PACKAGE_DIRS.items():
        spec = finder.find_spec(name)
        assert Path(spec.origin) == benchlib.ROOT / folder / "__init__.py"
    assert finder.find_spec("raysim.engine.loop") is None  # submodules: through the package's __path__
    assert finder.find_spec("numpy") is None


def _worker(kind: str, tmp_path, cache_dir: str, **workload):
    import vs_flower

    args = SimpleNamespace(clients=workload.get("clients", 12), participation=0.25, rounds=3)
    spec = {"config": vs_flower.workload(args, cache_dir), "actors": 1, "threads": 1, "out_dir": str(tmp_path / kind)}
    msgs = []
    waits = []
    report = msgs.append
    if kind == "plain":
        vs_flower.worker_plain(spec, report, lambda: waits.append(1))
    else:
        vs_flower.worker_engine(spec, report, lambda: waits.append(1), kind)
    w = SimpleNamespace(rounds=[m for m in msgs if "round" in m], final=msgs[-1]["final"])
    assert len(w.rounds) == 3 and len(waits) == 2  # a wait before each round after the first
    return w


def test_plain_loop_and_inline_engine_train_identically(tmp_path, cache_dir):
    """The benchmark's claim on a small federation: the same clients and losses every round, the same
    final prompt (to vs_flower.TOL), and check_same finds nothing to report."""
    import vs_flower

    benchlib.register_bench_model()
    plain = _worker("plain", tmp_path, cache_dir)
    inline = _worker("inline", tmp_path, cache_dir)
    assert [len(r["clients"]) for r in plain.rounds] == [3, 3, 3]  # 12 clients x 0.25
    assert vs_flower.check_same({"plain": plain, "inline": inline}) == []


def test_check_same_names_each_difference():
    """Worked example: one loop with another client in round 1, one with a loss off by 1e-3 in round 0,
    one with a final prompt off by 1e-3; differences of 1e-7 (float noise) pass."""
    import vs_flower

    ref = SimpleNamespace(rounds=[{"round": 0, "clients": [1, 2], "losses": [2.0, 2.2]},
                                  {"round": 1, "clients": [0, 3], "losses": [1.5, 1.7]}], final={"ctx": [[0.1, 0.2]]})
    same = SimpleNamespace(rounds=[{"round": 0, "participants": 2, "loss": 2.1 + 1e-7}, {"round": 1, "participants": 2, "loss": 1.6}],
                           final={"ctx": [[0.1 + 1e-7, 0.2]]})
    other_clients = SimpleNamespace(rounds=[ref.rounds[0], {"round": 1, "clients": [0, 4], "losses": [1.5, 1.7]}], final=ref.final)
    other_loss = SimpleNamespace(rounds=[{"round": 0, "clients": [1, 2], "losses": [2.0, 2.201]}, ref.rounds[1]], final=ref.final)
    other_final = SimpleNamespace(rounds=ref.rounds, final={"ctx": [[0.1, 0.201]]})
    problems = vs_flower.check_same({"plain": ref, "inline": same, "a": other_clients, "b": other_loss, "c": other_final})
    assert problems[0].startswith("a round 1: clients [0, 4]")
    assert problems[1].startswith("b round 0: losses differ") and "1.00e-03" in problems[1]
    assert problems[2].startswith("c: final ctx differs")
    assert len(problems) == 3


def test_scale_dataset_is_generated_features_per_client(tmp_path):
    """bench-scale-N: N clients with the asked sizes, unit-norm features read from the cache (no image is
    ever drawn), the same for the same seed."""
    import scale

    from raysim.build import build_config, make_method
    from raysim.engine.loop import prepare_data

    benchlib.register_bench_model()
    spec = {"clients": 30, "per_round": 5, "rounds": 1, "actors": 1, "train_per_client": 4, "test_per_client": 2, "seed": 1,
            "dim": 64, "image_size": 32, "model": benchlib.BENCH_MODEL, "cache_dir": str(tmp_path / "cache"), "set": [], "eval": True}
    scale.register_dataset(spec)
    cfg = build_config(scale.config(spec, "inline", str(tmp_path / "run")))
    assert cfg.train.rounds == 3 and cfg.eval.last == 1  # warm-up, one timed, one evaluated
    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    assert data.num_clients == 30 and {len(t) for t in data.train_idx} == {4} and {len(t) for t in data.test_idx} == {2}
    assert data.x_train.shape == (120, 64)
    assert np.allclose(np.linalg.norm(data.x_train, axis=1), 1.0, atol=1e-5)  # float32 normalisation
    again = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    assert np.array_equal(again.x_train, data.x_train)
    with pytest.raises(RuntimeError, match="no images"):
        scale._NoImages(3)[0]


def test_tree_memory_counts_this_process():
    m = benchlib.tree_memory()
    assert m["processes"] >= 1 and m["pss"] > 0 and m["rss"] >= m["driver_pss"] > 0
