"""Shared test fixtures: offline, one local Ray cluster per test session, one feature cache."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# the repository's own tests and files use sectioned keys: an old flat key (`rounds`, `dp.vpp_rho`) raises
# ConfigError rather than being moved; the tests of the shim itself take `flat_keys_allowed` (below). The check
# runs where user input enters, in this process; the local cluster's workers inherit the variable as well
os.environ.setdefault("RAYSIM_FLAT_KEYS", "error")

import inspect  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402

# a test that starts, joins or needs a Ray cluster: by its fixtures, its source (decorators included), the
# module functions and fixtures it calls, or a "ray" parameter
_RAY = re.compile(r"ray_session|import ray\b|init_ray|ray start|[\"']ray[\"']|backend=ray|execution\.address|\bray\.")


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _needs_ray(item) -> bool:
    if "ray_session" in getattr(item, "fixturenames", ()):
        return True
    fn = getattr(item, "function", None)
    if fn is None:
        return False
    if _RAY.search(_source(fn)):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    if any(v == "ray" for v in params.values() if isinstance(v, str)):
        return True
    module = getattr(item, "module", None)
    called = [getattr(module, name, None) for name in getattr(fn, "__code__", None).co_names] if module else []
    if any(inspect.isfunction(f) and f.__module__ == module.__name__ and _RAY.search(_source(f)) for f in called):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        for d in defs:
            if getattr(d.func, "__module__", None) == getattr(module, "__name__", "") and _RAY.search(_source(d.func)):
                return True
    return False


def pytest_collection_modifyitems(config, items):
    """`make mutation` (RAYSIM_TESTS_WITHOUT_RAY=1) leaves out the tests that start or join Ray: mutmut forks a
    process per mutant, which Ray does not survive.

    Under pytest-xdist (`make test`: `-n 2 --dist load`) each worker process runs its share of the Ray tests on one
    local cluster of its own (the session's `ray_session`), shut down at its end. They are not gathered into one
    worker: run one after another they take about 35 of CI's 30 minutes on 2 cores (2026-12-06: 2,204 s of the
    suite's 3,268 s of test time need Ray)."""
    if os.environ.get("RAYSIM_TESTS_WITHOUT_RAY") == "1":
        keep = [item for item in items if not _needs_ray(item)]
        config.hook.pytest_deselected(items=[item for item in items if _needs_ray(item)])
        items[:] = keep


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)  # one core per worker: two workers on two cores do not oversubscribe


@pytest.fixture(autouse=True)
def _seeded_global_rngs():
    """Every test starts from the same global RNG state (torch, numpy, random), so a test that draws
    without its own generator sees the same numbers on every machine and in any test order."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module", autouse=True)
def _freed_memory_back_to_the_os():
    """After each test module, hand the heap this worker freed back to the OS (glibc keeps freed blocks of a
    long-lived process mapped: a test worker that ran a few hundred torch tests held 13.5 GB, and a CI run on
    the 24 GB machine lost a worker to the OOM killer). Nothing a test checks depends on it."""
    yield
    import ctypes
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One frozen-feature / generated-data cache for the whole session."""
    return str(tmp_path_factory.mktemp("raysim-cache"))


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster shared by every test that needs one; shut down at the end of the session."""
    import ray

    from raysim.engine.cluster import init_ray

    # Ray workers inherit this environment: tests/ on their path lets actors import test-only modules
    # (tests/flaky_method.py) the way this process does; restored for the rest of the session
    here, before = os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, before) if p)
    try:
        init_ray(num_cpus=2, log_to_driver=False)  # as the runs start it (quiet), on 2 CPUs
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
    yield ray
    ray.shutdown()


@pytest.fixture
def flat_keys_allowed(monkeypatch):
    """For the tests of the flat-key shim itself: old keys are moved with their message, as for users."""
    monkeypatch.setenv("RAYSIM_FLAT_KEYS", "warn")


def tiny_config(tmp_path, cache_dir: str, **overrides):
    """A small, fast PromptFL federation on digits (the engine's default path). Overrides are sections,
    merged deep (`train={"rounds": 2}`); the previous release's flat keys (`rounds=2`) raise here."""
    from raysim.build import build_config
    from raysim.config import merge_config
    values = {
        "method": "promptfl",
        "data": {"dataset": "digits", "shots": 8},
        "model": {"name": "raysim-tiny", "pretrained": ""},  # random weights: fast; the bundled model: test_offline_benchmark
        "train": {"n_ctx": 16, "ctx_init": "", "num_clients": 4, "rounds": 3, "batch_size": 16, "lr": 0.05},
        "eval": {"every": 1, "last": 1},
        "execution": {"backend": "inline"},
        "output": {"progress": False, "tensorboard": False, "cache_dir": cache_dir, "out_dir": str(tmp_path / "run")},
    }
    return build_config(merge_config(values, overrides))


def run_on_digits(tmp_path, method, section, *, tag=None, rounds=2, clients=4):
    """A short inline run of an image-input method on digits (Dirichlet skew, tiny random CLIP for the
    text side); returns the RunResult and the rows of client_results.csv."""
    import csv

    from raysim.build import build_config
    from raysim.engine.loop import run

    cfg = build_config({
        "method": method,
        "data": {"dataset": "digits", "partition": "dirichlet", "beta": 0.5, "shots": 0},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": clients, "rounds": rounds, "batch_size": 32},
        "eval": {"every": 1},
        "execution": {"backend": "inline"},
        "output": {"progress": False, "tensorboard": False, "cache_dir": str(tmp_path / "c"), "out_dir": str(tmp_path / (tag or method))},
        method: section,
    })
    res = run(cfg)
    with open(res.out_dir / "client_results.csv") as f:
        return res, list(csv.DictReader(f))
