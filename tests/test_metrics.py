"""Metrics on hand-built cases: the summary (last-5 mean, HM of the means), In-Client / Cross-Client
semantics (SPEC 1.10), the Markdown tables and curves.png."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import tiny_config
from raysim.engine import resume_config, run
from raysim.metrics import ROUND_COLUMNS, CsvTable, harmonic_mean, markdown_table, summary_table, write_curves

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
    out = run(tiny_config(tmp_path, cache_dir, rounds=2)).out_dir
    png = out / "curves.png"
    assert png.is_file() and png.read_bytes()[:8] == PNG_MAGIC
    first = png.read_bytes()
    run(resume_config(out, {"rounds": 3}))
    assert png.read_bytes()[:8] == PNG_MAGIC and png.read_bytes() != first  # one more round on the curves
    assert not list(out.glob(".*tmp*"))  # written through a temporary name
