"""raysim.engine.cluster: one plan of client hosts for every backend and for Tune, and a quiet `init_ray`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raysim.build import build_config
from raysim.engine import cluster
from raysim.engine.cluster import AUTH_LOGGER, _quiet_auth_notice, init_ray, plan_hosts
from raysim.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def cfg(**execution):
    """Ten clients; the keyword arguments are the execution section's keys."""
    return build_config({"train": {"num_clients": 10}, "execution": execution})


def test_plan_hosts():
    # pooled, num_actors=0: as many client actors as the cluster holds next to the server
    assert plan_hosts(cfg(backend="ray"), 4, 0) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert len(plan_hosts(cfg(backend="ray", server_cpus=1), 4, 0)) == 3
    assert len(plan_hosts(cfg(backend="ray", client_cpus=0.5), 4, 0)) == 8
    assert len(plan_hosts(cfg(backend="ray", client_gpus=0.5), 16, 1)) == 2  # GPUs bound it
    assert len(plan_hosts(cfg(backend="ray", client_gpus=0.5), 4, 0)) == 4  # no GPU: CPUs only
    assert len(plan_hosts(cfg(backend="ray", client_cpus=0), 4, 0)) == 10
    assert len(plan_hosts(cfg(backend="ray", server_cpus=4), 4, 0)) == 1  # never fewer than one
    # the inline backend runs every host in this process: one, unless num_actors says otherwise
    assert plan_hosts(cfg(backend="inline"), 64, 8) == [list(range(10))]
    assert len(plan_hosts(cfg(backend="inline", num_actors=3), 1, 0)) == 3
    # fixed counts ignore the cluster, and never exceed the clients
    assert len(plan_hosts(cfg(backend="ray", num_actors=3), 64, 0)) == 3
    assert len(plan_hosts(cfg(backend="ray", num_actors=30), 1, 0)) == 10
    assert plan_hosts(cfg(backend="ray", placement="actor_per_client"), 1, 0) == [[c] for c in range(10)]


def test_tune_reserves_the_hosts_the_backend_plans():
    from raysim.tools.sweep import trial_bundles

    for values in ({"num_actors": 3}, {"num_actors": 30}, {"placement": "actor_per_client"}):
        plan = plan_hosts(cfg(backend="ray", **values), 8, 0)
        bundles = trial_bundles({"train": {"num_clients": 10}, "execution": values}, cluster={"CPU": 8.0})
        assert len(bundles) == 1 + len(plan)  # the trial driver, then one per client host


def test_both_backends_implement_the_protocol():
    from raysim.engine.backends import BACKENDS, Backend

    members = ("setup", "train_round", "evaluate", "commit", "shutdown")
    assert all(callable(getattr(Backend, m)) for m in members)
    for name, cls in BACKENDS.items():
        assert cls.name == name and all(callable(getattr(cls, m, None)) for m in members)
        assert "info" in cls.__init__.__code__.co_names  # set by every constructor


def test_the_token_auth_notice_is_dropped_and_nothing_else():
    from ray._private.authentication import authentication_token_setup as auth

    seen: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(AUTH_LOGGER)  # Ray's loggers do not propagate to the root
    logger.addHandler(catch)
    try:
        auth._warn_token_auth_enabled()  # what Ray 2.60 says on every start
        assert seen and seen.pop().startswith("Token authentication is enabled")  # as this Ray words it
        with _quiet_auth_notice():
            auth._warn_token_auth_enabled()
            auth._warn_token_auth_disabled()  # a real warning: it still shows
        auth._warn_token_auth_enabled()
    finally:
        logger.removeHandler(catch)
    assert [m[:35] for m in seen] == ["Token authentication is disabled fo", "Token authentication is enabled for"]


def test_a_cluster_that_cannot_be_reached_ends_in_one_message(monkeypatch):
    import ray

    def refuse(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.9:6379")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(cluster, "probe_head", lambda address, **kw: None)  # never a packet to a non-loopback host
    with pytest.raises(ConfigError, match="address=10.0.0.9:6379.*RAY_AUTH_MODE=token"):
        init_ray("10.0.0.9:6379")


def test_a_local_ray_starts_quietly(tmp_path):
    """A fresh process (RAY_AUTH_MODE unset, Ray 2.60 turns token auth on) prints no token notice."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    code = ("import ray; from raysim.engine.cluster import init_ray\n"
            "assert init_ray(num_cpus=1) and not init_ray()\n"
            "print('sum', ray.get(ray.remote(lambda: 1 + 1).remote())); ray.shutdown()\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "sum 2" in out.stdout
    assert "Token authentication" not in out.stdout + out.stderr, out.stderr
    assert (tmp_path / ".ray" / "auth_token").is_file()  # token auth was on all the same
