"""eval.protocol=fedtsp (fedtsp.txt section 4, SPEC 2.6): sample-weighted local accuracy over all clients'
own test splits at the best evaluated round, and the "global accuracy" of each client model on the union
of the test splits, averaged over clients; checked against a hand computation and on a short run."""

from __future__ import annotations

import math

import pytest

from raysim.engine.evaluation import PROTOCOLS, fedtsp_round_metrics
from raysim.metrics import CLIENT_COLUMNS, ROUND_COLUMNS, CsvTable

# (round, client): (in, cross, in_top5, cross_top5, n_in, n_cross)
ROWS = {
    (0, 0): (0.5, 0.2, 0.9, 0.5, 10, 30),
    (0, 1): (1.0, 0.1, 1.0, 0.4, 30, 10),
    (1, 0): (0.8, 0.5, 0.9, 0.6, 10, 30),
    (1, 1): (0.6, 0.6, 0.8, 0.8, 30, 10),
    (2, 0): (0.9, 0.4, 1.0, 0.6, 10, 30),
    (2, 1): (0.7, 0.3, 0.9, 0.5, 30, 10),
}
TOL = 1e-12  # short decimal fractions: only float round-off


def write_run(run_dir):
    run_dir.mkdir(parents=True, exist_ok=True)
    CsvTable(run_dir / "client_results.csv", CLIENT_COLUMNS).append(
        {"round": r, "client": c, "in_client": a, "cross_client": b, "in_top5": a5, "cross_top5": b5, "n_in": ni,
         "n_cross": nc, "epsilon": math.inf} for (r, c), (a, b, a5, b5, ni, nc) in ROWS.items())
    CsvTable(run_dir / "results.csv", ROUND_COLUMNS).append(
        {"round": r, "in_client": (ROWS[(r, 0)][0] + ROWS[(r, 1)][0]) / 2, "cross_client": (ROWS[(r, 0)][1] + ROWS[(r, 1)][1]) / 2,
         "hm": math.nan, "train_loss": 1.0, "bytes_up": 1, "bytes_down": 1, "epsilon_max": math.nan, "participants": 2,
         "dropped": 0, "seconds": 0.1} for r in range(3))
    return run_dir


def test_round_metrics_by_hand(tmp_path):
    m = fedtsp_round_metrics(write_run(tmp_path / "run") / "client_results.csv")
    # round 0: local = (0.5*10 + 1.0*30) / 40 = 0.875 (the unweighted client mean would be 0.75);
    # global: client 0 (5 + 0.2*30) / 40 = 0.275, client 1 (30 + 0.1*10) / 40 = 0.775, mean 0.525
    assert m[0]["local"] == pytest.approx(0.875, abs=TOL) and m[0]["global"] == pytest.approx(0.525, abs=TOL)
    # round 1: local (8 + 18) / 40 = 0.65; global ((8 + 15) / 40 + (18 + 6) / 40) / 2 = 0.5875
    assert m[1]["local"] == pytest.approx(0.65, abs=TOL) and m[1]["global"] == pytest.approx(0.5875, abs=TOL)
    # round 2: local (9 + 21) / 40 = 0.75; global ((9 + 12) / 40 + (21 + 3) / 40) / 2 = 0.5625
    assert m[2]["local"] == pytest.approx(0.75, abs=TOL) and m[2]["global"] == pytest.approx(0.5625, abs=TOL)
    # top-5 at round 0: local (9 + 30) / 40; global ((9 + 15) / 40 + (30 + 4) / 40) / 2
    assert m[0]["local_top5"] == pytest.approx(0.975, abs=TOL) and m[0]["global_top5"] == pytest.approx(0.725, abs=TOL)


def test_summary_is_the_best_round_with_its_global_accuracy(tmp_path):
    run = write_run(tmp_path / "run")
    s = PROTOCOLS.get("fedtsp").summarize(run, last=1)
    assert s["local"] == pytest.approx(0.875, abs=TOL) and s["best_round"] == 0  # best over rounds, not the last
    assert s["global"] == pytest.approx(0.525, abs=TOL)  # at the best round
    assert s["global_best"] == pytest.approx(0.5875, abs=TOL)  # its own best (round 1)
    assert s["local_last"] == pytest.approx(0.75, abs=TOL)
    assert s["local_top5"] == pytest.approx(0.975, abs=TOL)
    # the In / Cross means of the last evaluated rounds are kept (what in_cross reports)
    assert s["in_client"] == pytest.approx(PROTOCOLS.get("in_cross").summarize(run, last=1)["in_client"], abs=TOL)
    text = PROTOCOLS.get("fedtsp").markdown("fedavg", s, title="t")
    assert "| fedavg | 87.50 | 52.50 | 58.75 | 97.50 | 1 |" in text


def test_a_run_with_the_fedtsp_protocol_reports_it(tmp_path, cache_dir):
    import csv

    from raysim.build import build_config
    from raysim.engine.loop import run

    cfg = build_config({
        "method": "fedavg", "fedavg": {"model": "cnn_tiny", "feature_dim": 32},
        "data": {"dataset": "digits", "partition": "pfllib", "beta": 0.5, "shots": 0},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": 3, "rounds": 3, "batch_size": 32},
        "eval": {"protocol": "fedtsp", "every": 1, "last": 1},
        "execution": {"backend": "inline"},
        "output": {"progress": False, "tensorboard": False, "cache_dir": cache_dir, "out_dir": str(tmp_path / "run")},
    })
    res = run(cfg)
    per_round = fedtsp_round_metrics(res.out_dir / "client_results.csv")
    assert set(per_round) == {0, 1, 2}
    best = max(per_round, key=lambda r: per_round[r]["local"])
    assert res.summary["local"] == pytest.approx(per_round[best]["local"], abs=TOL)
    assert res.summary["local"] >= max(m["local"] for m in per_round.values()) - TOL
    # FedAvg (GFL): every client evaluates the same global model, so on the union of all test splits
    # (the pool's test rows) each client has the same accuracy
    with open(res.out_dir / "client_results.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["round"] == str(best)]
    union = {round((float(r["in_client"]) * int(r["n_in"]) + float(r["cross_client"]) * int(r["n_cross"]))
                   / (int(r["n_in"]) + int(r["n_cross"])), 9) for r in rows}
    assert len(union) == 1 and res.summary["global"] == pytest.approx(union.pop(), abs=1e-9)
    assert "Local (best)" in (res.out_dir / "summary.md").read_text()


def test_unknown_protocol_is_refused_with_the_choices():
    from raysim.build import build_config
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="fedtsp"):
        build_config({"eval": {"protocol": "fedtps"}})
