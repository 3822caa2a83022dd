"""Metrics on hand-built cases: the summary (last-5 mean, HM of the means), In-Client / Cross-Client
semantics (SPEC 1.10), the Markdown tables and curves.png."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import tiny_config

from raysim.engine.hosts import ClientHost
from raysim.engine.loop import mean_of_defined, resume_config, run
from raysim.metrics import ROUND_COLUMNS, CsvTable, harmonic_mean, markdown_table, summarize, summary_table, write_curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# accuracies below are short decimal fractions; sums of a few of them are exact to ~1e-15, so a
# tolerance of 1e-12 only absorbs float round-off, never a wrong average
EXACT = 1e-12


def write_results(path: Path, evaluated: dict[int, tuple[float, float]], rounds: int, eps=math.nan) -> Path:
    """results.csv as the engine writes it: every round has a row, accuracies only on evaluated rounds."""
    table = CsvTable(path, ROUND_COLUMNS)
    rows = []
    for r in range(rounds):
        a, b = evaluated.get(r, (math.nan, math.nan))
        rows.append({"round": r, "in_client": a, "cross_client": b, "hm": harmonic_mean(a, b), "train_loss": 2.0 / (r + 1),
                     "bytes_up": 10, "bytes_down": 10, "epsilon_max": eps if math.isnan(eps) else eps * (r + 1) / rounds,
                     "participants": 4, "seconds": 0.1})
    table.append(rows)
    return path


# -- summarize -------------------------------------------------------------------------------


def test_summary_is_the_mean_of_the_last_5_evaluated_rounds_and_hm_of_the_means(tmp_path):
    # evaluated every 5 rounds plus the last 5 (rounds 4, 9, 14, 15..19 of 20): the last 5 are 15..19
    ev = {4: (0.1, 0.1), 9: (0.2, 0.2), 14: (0.3, 0.9), 15: (0.5, 0.1), 16: (0.6, 0.2), 17: (0.7, 0.3), 18: (0.8, 0.4), 19: (0.9, 0.5)}
    s = summarize(write_results(tmp_path / "results.csv", ev, 20))
    assert s["rounds_averaged"] == 5
    assert s["in_client"] == pytest.approx(0.7, abs=EXACT)  # mean of 0.5..0.9; round 14's 0.3 is left out
    assert s["cross_client"] == pytest.approx(0.3, abs=EXACT)
    # HM of the two means (SPEC 1.10), not the mean of the per-round HMs (which would be 0.3725...)
    assert s["hm"] == pytest.approx(2 * 0.7 * 0.3 / (0.7 + 0.3), abs=EXACT)
    per_round = np.mean([harmonic_mean(*ev[r]) for r in range(15, 20)])
    assert abs(per_round - s["hm"]) > 1e-3


def test_summary_with_fewer_evaluated_rounds_or_none(tmp_path):
    s = summarize(write_results(tmp_path / "a.csv", {1: (0.2, 0.4), 2: (0.4, 0.8)}, 3))
    assert s["rounds_averaged"] == 2
    assert (s["in_client"], s["cross_client"]) == (pytest.approx(0.3, abs=EXACT), pytest.approx(0.6, abs=EXACT))
    s = summarize(write_results(tmp_path / "b.csv", {0: (0.2, 0.4), 1: (0.4, 0.8), 2: (0.6, 0.6)}, 3), last=1)
    assert s["rounds_averaged"] == 1 and s["in_client"] == pytest.approx(0.6, abs=EXACT)
    s = summarize(write_results(tmp_path / "c.csv", {}, 3))
    assert all(math.isnan(s[k]) for k in ("in_client", "cross_client", "hm"))


def test_harmonic_mean_edge_cases():
    assert harmonic_mean(0.5, 0.5) == pytest.approx(0.5, abs=EXACT)
    assert harmonic_mean(1.0, 0.0) == 0.0 and harmonic_mean(0.0, 0.0) == 0.0  # defined: no accuracy on one side
    assert math.isnan(harmonic_mean(0.5, math.nan))  # one client: no Cross-Client, so no HM


# -- In-Client / Cross-Client ----------------------------------------------------------------


def hand_built_host(owner: list[int], labels: list[int], predictions: dict[int, list[int]], classes: int = 3) -> ClientHost:
    """A ClientHost on a hand-built test set: row i belongs to client owner[i] (-1: to no client) with
    label labels[i]; client c's model predicts predictions[c][i] on row i. Only evaluate() is real."""
    host = object.__new__(ClientHost)
    x = torch.arange(len(owner), dtype=torch.float32)[:, None]  # the "input" is the row number
    y = torch.tensor(labels)

    class Method:
        def predictor(self, env, shared, private, data):
            pred = torch.tensor(private["pred"])
            return lambda xb: torch.nn.functional.one_hot(pred[xb[:, 0].long()], classes).float()

    from raysim.data.federation import FederationData
    from raysim.engine.evaluation import InCross

    n_clients = max(max(owner), max(predictions)) + 1
    fed = FederationData(
        x_train=np.zeros((0, 1), np.float32), y_train=np.zeros(0, np.int64), x_test=x.numpy(), y_test=y.numpy(),
        train_idx=[np.zeros(0, np.int64)] * n_clients,
        test_idx=[np.flatnonzero(np.array(owner) == c) for c in range(n_clients)], classnames=[str(i) for i in range(classes)],
    )
    host.method, host.env, host.device = Method(), None, torch.device("cpu")
    host.protocol = InCross(fed, batch_size=2)  # batches of 2: tests the concatenation
    host.clients = sorted(predictions)
    host.data = {c: None for c in host.clients}
    host.private = {c: {"pred": p} for c, p in predictions.items()}
    host.privacy = SimpleNamespace(epsilon=lambda cid: math.inf)
    return host


def test_in_client_is_own_test_split_and_cross_client_is_all_other_clients_splits():
    # rows:            0  1  2  3  4  5
    owner = [0, 0, 1, 1, 1, 2]
    labels = [0, 1, 2, 0, 1, 2]
    predictions = {
        0: [0, 1, 0, 0, 0, 0],  # own rows 0,1: 2/2; other rows 2..5: row 3 right -> 1/4
        1: [0, 0, 2, 0, 0, 2],  # own rows 2,3,4: 2/3; other rows 0,1,5: rows 0 and 5 -> 2/3
        2: [1, 1, 1, 1, 1, 1],  # own row 5: 0/1; other rows 0..4: rows 1 and 4 -> 2/5
    }
    rows = {r["client"]: r for r in hand_built_host(owner, labels, predictions).evaluate({})}
    expect = {0: (1.0, 0.25, 2, 4), 1: (2 / 3, 2 / 3, 3, 3), 2: (0.0, 0.4, 1, 5)}
    for c, (inn, cross, n_in, n_cross) in expect.items():
        assert rows[c]["in_client"] == pytest.approx(inn, abs=EXACT), c
        assert rows[c]["cross_client"] == pytest.approx(cross, abs=EXACT), c
        assert (rows[c]["n_in"], rows[c]["n_cross"]) == (n_in, n_cross)
        assert rows[c]["in_top5"] == 1.0 and rows[c]["cross_top5"] == 1.0  # 3 classes: the top 5 hold every class
    # the round's numbers: per-client accuracies averaged with equal weight (not by test size), HM of the means
    acc_in = mean_of_defined([rows[c]["in_client"] for c in rows])
    acc_cross = mean_of_defined([rows[c]["cross_client"] for c in rows])
    assert acc_in == pytest.approx((1 + 2 / 3 + 0) / 3, abs=EXACT)
    assert acc_cross == pytest.approx((0.25 + 2 / 3 + 0.4) / 3, abs=EXACT)
    pooled_in = (2 + 2 + 0) / 6  # what weighting by test size would give instead
    assert abs(acc_in - pooled_in) > 1e-3


def test_rows_of_no_client_are_not_scored_and_a_lone_client_has_no_cross_client():
    # row 1 belongs to no client (a class nobody owns): it is in neither split
    rows = hand_built_host([0, -1, 0], [0, 1, 2], {0: [0, 1, 2]}).evaluate({})
    assert rows[0]["n_in"] == 2 and rows[0]["n_cross"] == 0
    assert rows[0]["in_client"] == pytest.approx(1.0, abs=EXACT)
    assert math.isnan(rows[0]["cross_client"])
    assert math.isnan(mean_of_defined([rows[0]["cross_client"]]))  # nan, not 0, at round level
    assert mean_of_defined([0.5, math.nan, 0.7]) == pytest.approx(0.6, abs=EXACT)  # clients without a split are left out


# -- tables and curves -----------------------------------------------------------------------


def test_markdown_table_one_writer_for_every_table():
    text = markdown_table(["Method", "a", "b"], [["x", "1.00", 2], ["y", "3.00", 4]], title="T")
    assert text == "### T\n\n| Method | a | b |\n|---|---:|---:|\n| x | 1.00 | 2 |\n| y | 3.00 | 4 |\n"
    assert markdown_table(["k", "v"], [], align="ll").splitlines()[1] == "|---|---|"
    with pytest.raises(ValueError, match="cells"):
        markdown_table(["a", "b"], [["only one"]])
    with pytest.raises(ValueError, match="align"):
        markdown_table(["a", "b"], [], align="l")
    table = summary_table([("promptfl", {"in_client": 0.6298, "cross_client": 0.6298, "hm": 0.6298})])
    assert table == "| Method | In-Client | Cross-Client | HM |\n|---|---:|---:|---:|\n| promptfl | 62.98 | 62.98 | 62.98 |\n"


def test_curves_png_has_an_epsilon_panel_only_with_dp(tmp_path):
    from PIL import Image

    ev = {r: (0.1 * r, 0.05 * r) for r in range(5)}
    plain = write_curves(write_results(tmp_path / "plain.csv", ev, 5), tmp_path / "plain.png")
    dp = write_curves(write_results(tmp_path / "dp.csv", ev, 5, eps=1.0), tmp_path / "dp.png")
    assert plain.read_bytes()[:8] == PNG_MAGIC and dp.read_bytes()[:8] == PNG_MAGIC
    w_plain, w_dp = Image.open(plain).size[0], Image.open(dp).size[0]
    assert w_dp == pytest.approx(1.5 * w_plain, rel=0.02)  # three panels instead of two


def test_every_run_writes_curves_png_and_a_resume_redraws_it(tmp_path, cache_dir):
    out = run(tiny_config(tmp_path, cache_dir, train={"rounds": 2})).out_dir
    png = out / "curves.png"
    assert png.is_file() and png.read_bytes()[:8] == PNG_MAGIC
    first = png.read_bytes()
    run(resume_config(out, {"train": {"rounds": 3}}))
    assert png.read_bytes()[:8] == PNG_MAGIC and png.read_bytes() != first  # one more round on the curves
    assert not list(out.glob(".*tmp*"))  # written through a temporary name
