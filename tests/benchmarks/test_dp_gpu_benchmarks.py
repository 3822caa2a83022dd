"""benchmarks/dp_cost.py and benchmarks/gpu_paths.py run on CPU at tiny sizes and print their tables with
the deterministic columns right (the FLOP bound of a step); their timings are reported, not asserted."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines() if ln.startswith("| ") and "---" not in ln][1:]


def test_dp_cost_prints_ratio_beside_the_flop_bound(capsys):
    sys.path.insert(0, str(BENCH))
    import dp_cost

    assert dp_cost.main(["--methods", "promptfl", "--model", "raysim-tiny", "--pretrained", "", "--classes", "4",
                         "--batch", "5", "--steps", "1", "--repeats", "1"]) == 0
    (row,) = _rows(capsys.readouterr().out)
    assert row[0] == "promptfl" and row[1] == "4"  # 4 class prompts through the tower
    bound, ratio, counted = float(row[5]), float(row[6]), float(row[7])
    # a frozen tower's input-gradient backward costs about its forward (no weight gradients): Bw / F ~ 1,
    # so the bound (F + B Bw) / (F + Bw) ~ (1 + B) / 2 = 3 for B = 5 (attention's backward costs 2x its forward)
    assert 0.9 < ratio < 1.2 and 2.8 < bound < 3.2
    # as implemented, the DP step does the bound's work (the matrix products of F + B Bw) and little more
    assert bound * 0.95 < counted < bound * 1.1


def test_gpu_paths_runs_every_cpu_variant(capsys):
    sys.path.insert(0, str(BENCH))
    import gpu_paths

    assert gpu_paths.main(["--device", "cpu", "--model", "raysim-tiny", "--methods", "promptfl", "--classes", "3", "--batch", "4",
                           "--n-ctx", "2", "--steps", "1", "--repeats", "1", "--compile-backend", "eager",
                           "--variants", "fp32;bf16 autocast;compile;DP-SGD, microbatch 8"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [r[1] for r in rows] == ["fp32", "bf16 autocast", "compile", "DP-SGD, microbatch 8"]  # fp16: CUDA only
    assert float(rows[0][5]) == 0.0  # fp32 against itself
    assert 0 < float(rows[1][5]) < 0.05  # bf16 moves the upload, by well under 5% (8-bit mantissa, a few layers)
    assert float(rows[2][5]) < 1e-5  # compile (eager backend): the same ops
