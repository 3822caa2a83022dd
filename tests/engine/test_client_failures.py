"""Client failures and stragglers as policy (on_client_error=fail|drop, client_timeout, min_clients): a
client whose local training raises, uploads a non-finite tensor or runs past client_timeout stops the run
naming it (fail), or is left out of its round with its private state and privacy ledger as before the
round (drop), identically inline and on Ray."""

from __future__ import annotations

import csv
import math

import pytest
from conftest import tiny_config

from raysim.errors import ClientFailure, ConfigError
from raysim.metrics import TIMING_COLUMNS

FAILING, ROUND = 2, 1  # the flaky client and the round it fails in (4 clients, 3 rounds)
TIMEOUT, SLEEP = 2.5, 3.5  # client_timeout and the straggler's sleep: normal clients take well under 1 s
ERRORS = {
    "raise": r"RuntimeError: flaky client 2 broke \(at .*flaky_method\.py:\d+ in local_train\)",
    "nan": r"upload 'ctx' is not finite \(1 of \d+ values",
    "sleep": r"local training took \d+\.\d+ s, more than client_timeout=2\.5 s",
}


@pytest.fixture(scope="module", autouse=True)
def flaky():
    """Registers the test-only `flaky` method (imported here, not at collection, so the registry-driven
    conformance tests do not see it)."""
    import flaky_method

    return flaky_method


def config(tmp_path, cache_dir, mode, **extra):
    from raysim.config import merge_config

    values = dict(method="flaky", flaky={"client": FAILING, "round": ROUND, "mode": mode, "sleep": SLEEP})
    if mode == "sleep":
        values["execution"] = {"client_timeout": TIMEOUT}
    return tiny_config(tmp_path, cache_dir, **merge_config(values, extra))


def rows(path):
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in csv.DictReader(f)]


def run_dir(cfg):
    from pathlib import Path

    return Path(cfg.output.out_dir)


@pytest.mark.parametrize("backend", ["inline", "ray"])
@pytest.mark.parametrize("mode", ["raise", "nan", "sleep"])
def test_fail_stops_the_run_naming_the_client(tmp_path, cache_dir, mode, backend, request):
    from raysim.engine.loop import run
    from raysim.storage.store import StateStore

    extra = dict(execution={"backend": "ray", "num_actors": 2}) if backend == "ray" else {}
    if backend == "ray":
        request.getfixturevalue("ray_session")
    cfg = config(tmp_path, cache_dir, mode, **extra)
    assert cfg.execution.on_client_error == "fail"  # the default
    with pytest.raises(ClientFailure, match=rf"client {FAILING} failed in round {ROUND}: {ERRORS[mode]}") as info:
        run(cfg)
    assert info.value.client_id == FAILING and info.value.round_idx == ROUND
    assert "on_client_error=drop" in str(info.value) and f"resume={cfg.output.out_dir}" in str(info.value)
    out = run_dir(cfg)
    assert [int(r["round"]) for r in rows(out / "results.csv")] == [0]  # the failed round is not written
    assert StateStore(out).completed_round() == 0


def test_fail_on_the_command_line_is_one_message_and_exit_2(tmp_path, cache_dir, capsys):
    from raysim.run import main

    out = tmp_path / "cli"
    args = ["method=flaky", f"flaky.client={FAILING}", f"flaky.round={ROUND}", "data.dataset=digits", "model.name=raysim-tiny",
            "model.pretrained=", "train.ctx_init=", "train.num_clients=4", "train.rounds=3", "data.shots=8", "train.batch_size=16",
            "execution.backend=inline", "output.progress=false", "output.tensorboard=false", f"output.cache_dir={cache_dir}",
            f"output.out_dir={out}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"error: client {FAILING} failed in round {ROUND}: RuntimeError: flaky client {FAILING} broke" in err
    assert "Traceback" not in err


def _drop_run(tmp_path, cache_dir, mode, **extra):
    from raysim.config import merge_config
    from raysim.engine.loop import run

    cfg = config(tmp_path, cache_dir, mode, **merge_config({"execution": {"on_client_error": "drop"}, "dp": {"epsilon": 8.0}}, extra))
    result = run(cfg)
    return cfg, result, rows(result.out_dir / "results.csv"), rows(result.out_dir / "client_results.csv")


@pytest.mark.parametrize("mode", ["raise", "nan", "sleep"])
def test_drop_leaves_the_client_out_of_its_round_identically_inline_and_on_ray(tmp_path, cache_dir, mode, ray_session):
    from raysim.storage.store import StateStore

    cfg, result, results, clients = _drop_run(tmp_path / "inline", cache_dir, mode, output={"tensorboard": True})
    assert [int(r["dropped"]) for r in results] == [0, 1, 0]
    assert [int(r["participants"]) for r in results] == [4, 4, 4]
    assert [row["dropped"] for row in result.rounds] == [0, 1, 0]
    # its upload never left: a quarter less traffic up in that round
    up = [int(r["bytes_up"]) for r in results]
    assert up[ROUND] * 4 == up[0] * 3 and up[2] == up[0]
    assert all(math.isfinite(float(r["hm"])) for r in results)
    # its budget is not charged for the round it was dropped from; the others' is
    eps = {(int(c["round"]), int(c["client"])): float(c["epsilon"]) for c in clients}
    assert eps[(ROUND, FAILING)] == eps[(ROUND - 1, FAILING)] > 0
    assert all(eps[(ROUND, c)] > eps[(ROUND - 1, c)] for c in range(4) if c != FAILING)
    assert eps[(2, FAILING)] > eps[(ROUND, FAILING)]
    # private state and ledger as before the round: one round fewer trained and released
    store = StateStore(result.out_dir)
    for c in range(4):
        saved = store.load_client(c, cfg.train.rounds)
        n = 2 if c == FAILING else 3
        assert int(saved["private"]["trained"]) == n, c
        assert sorted({r["round"] for r in saved["privacy"]["ledger"]["releases"]}) == ([0, 2] if c == FAILING else [0, 1, 2])
    # TensorBoard has the count too
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(result.out_dir / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("clients/dropped")] == [(0, 0.0), (1, 1.0), (2, 0.0)]
    # the same seed drops the same client on Ray, with the same numbers
    _, _, ray_results, ray_clients = _drop_run(tmp_path / "ray", cache_dir, mode, execution={"backend": "ray", "num_actors": 2})
    assert ray_results == results
    assert ray_clients == clients


def test_drop_stops_below_min_clients(tmp_path, cache_dir):
    from raysim.engine.loop import run

    cfg = config(tmp_path, cache_dir, "raise", execution={"on_client_error": "drop", "min_clients": 4})
    with pytest.raises(ClientFailure, match=rf"round {ROUND}: 1 of 4 clients failed and were dropped, leaving 3, "
                                            rf"fewer than min_clients=4 \(client {FAILING}: RuntimeError"):
        run(cfg)
    assert [int(r["round"]) for r in rows(run_dir(cfg) / "results.csv")] == [0]
    # every client failing leaves none, fewer than the default min_clients=1
    cfg = config(tmp_path / "all", cache_dir, "raise", execution={"on_client_error": "drop"},
                 train={"num_clients": 1, "participation": 1.0}, flaky={"client": 0, "round": 0})
    with pytest.raises(ClientFailure, match="leaving 0, fewer than min_clients=1"):
        run(cfg)


def test_a_run_stopped_under_fail_resumes_under_drop_as_a_fresh_drop_run(tmp_path, cache_dir):
    from raysim.engine.loop import resume_config, run

    cfg = config(tmp_path / "cut", cache_dir, "raise")
    with pytest.raises(ClientFailure):
        run(cfg)
    resumed = run(resume_config(cfg.output.out_dir, {"execution": {"on_client_error": "drop"}}))
    fresh = run(config(tmp_path / "fresh", cache_dir, "raise", execution={"on_client_error": "drop"}))
    assert rows(resumed.out_dir / "results.csv") == rows(fresh.out_dir / "results.csv")
    assert rows(resumed.out_dir / "client_results.csv") == rows(fresh.out_dir / "client_results.csv")


@pytest.mark.parametrize("bad, message", [
    ({"execution": {"on_client_error": "retry"}}, "on_client_error must be one of fail, drop, got 'retry'"),
    ({"execution": {"client_timeout": -1}}, "client_timeout is in seconds and must be >= 0"),
    ({"execution": {"min_clients": 0}}, "min_clients must be between 1 and the 4 clients sampled per round"),
    ({"execution": {"min_clients": 3}, "train": {"participation": 0.5}},
     r"between 1 and the 2 clients sampled per round \(num_clients=4 x participation=0.5\)"),
])
def test_policy_keys_are_validated(tmp_path, cache_dir, bad, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, cache_dir, **bad)
