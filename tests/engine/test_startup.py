"""Start-up (issue 17 item 5): `init_ray` joins the local cluster `ray start --head` runs when one is up
(RAY_ADDRESS's when set), else starts a new one without Ray's prestarted task workers, which raysim's
actors never use. Ray itself is replaced by a recorder here: no cluster is started."""

from __future__ import annotations

import pytest

from raysim.engine import cluster
from raysim.errors import ConfigError


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.init recorded (each call's kwargs); `fail` makes the next calls raise ConnectionError."""
    import ray

    calls: list[dict] = []
    state = {"fail": 0}

    def init(**kwargs):
        calls.append(kwargs)
        if state["fail"]:
            state["fail"] -= 1
            raise ConnectionError("Failed to connect to Ray cluster")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls, state


def test_a_running_local_cluster_is_joined(fake_ray, monkeypatch):
    calls, _ = fake_ray
    monkeypatch.setattr(cluster, "running_local_cluster", lambda: "10.0.0.5:6379")
    assert cluster.init_ray("") is True
    (kw,) = calls
    # joined as Ray finds it (no address: Ray reads its record and uses the cluster's token); nothing a new cluster takes
    assert "address" not in kw and "num_cpus" not in kw and "_system_config" not in kw
    assert kw["include_dashboard"] is False


def test_without_a_running_cluster_a_new_one_starts_without_prestarted_workers(fake_ray, monkeypatch):
    calls, _ = fake_ray
    monkeypatch.setattr(cluster, "running_local_cluster", lambda: "")
    assert cluster.init_ray("") is True
    (kw,) = calls
    assert kw["address"] == "local" and kw["num_cpus"] >= 1
    assert kw["_system_config"] == {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
    kw["_system_config"]["object_spilling_config"] = "x"  # Ray writes into the dict it gets: a copy each time
    assert "object_spilling_config" not in cluster.LOCAL_SYSTEM_CONFIG


@pytest.mark.parametrize("how", [dict(address="local"), dict(num_cpus=2)])
def test_local_or_an_explicit_size_always_starts_a_new_cluster(fake_ray, monkeypatch, how):
    calls, _ = fake_ray
    monkeypatch.setattr(cluster, "running_local_cluster", lambda: "10.0.0.5:6379")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.6:6379")
    cluster.init_ray(**how)
    (kw,) = calls
    assert kw["address"] == "local" and "_system_config" in kw  # "local" ignores RAY_ADDRESS (Ray's rule too)


def test_a_recorded_cluster_that_does_not_answer_falls_back_to_a_new_one(fake_ray, monkeypatch, caplog):
    calls, state = fake_ray
    monkeypatch.setattr(cluster, "running_local_cluster", lambda: "10.0.0.5:6379")
    state["fail"] = 1
    assert cluster.init_ray("") is True
    assert len(calls) == 2 and calls[1]["address"] == "local"
    assert "starting a new one" in caplog.text


def test_a_ray_address_that_does_not_answer_is_one_message(fake_ray, monkeypatch):
    calls, state = fake_ray
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.6:6379")
    state["fail"] = 1
    with pytest.raises(ConfigError, match="RAY_ADDRESS=10.0.0.6:6379.*RAY_AUTH_MODE=token"):
        cluster.init_ray("")


def test_running_local_cluster_needs_a_live_gcs_at_the_recorded_address(monkeypatch):
    from ray._private import services

    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: "10.0.0.5:6379")
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset({"10.0.0.5:6379", "10.0.0.7:1"}))
    assert cluster.running_local_cluster() == "10.0.0.5:6379"
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset({"10.0.0.7:1"}))  # a stale record
    assert cluster.running_local_cluster() == ""
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    assert cluster.running_local_cluster() == ""
