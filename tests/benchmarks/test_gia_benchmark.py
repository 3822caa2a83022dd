"""The gradient-inversion benchmark (benchmarks/gia_fedsept.py) runs end to end and prints its table; the
attack's strength is tested in test_attacks_fedsept.py, not here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_gia_benchmark_table_and_png(tmp_path, cache_dir, capsys):
    sys.path.insert(0, str(BENCH))
    import gia_fedsept

    png = tmp_path / "gia.png"
    assert gia_fedsept.main([
        "--model", "raysim-tiny", "--pretrained", "", "--cache-dir", cache_dir, "--clients", "2", "--samples", "2",
        "--iterations", "30", "--restarts", "1", "--threads", "1", "--save-png", str(png),
    ]) == 0
    out, err = capsys.readouterr()
    # the clients share theta_pre and R = 0: the text Jacobian is computed for the first and reused
    assert re.search(r"client 0: .*text Jacobian at theta_pre computed", err)
    assert re.search(r"client 1: .*text Jacobian at theta_pre reused", err)
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:5] == ["Client", "GradCos", "PSNR (dB)", "CLIPCos", "Top-1"] and "GradCos (rand)" in header
    rows = {ln.strip("|").split("|")[0].strip(): [c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]}
    assert list(rows) == ["0", "1", "mean"]
    for cells in rows.values():
        cell = dict(zip(header, cells))
        for col in ("GradCos", "GradCos (rand)", "CLIPCos", "CLIPCos (rand)"):
            assert re.fullmatch(r"-?\d+\.\d+", cell[col]) and -1 <= float(cell[col]) <= 1, (col, cell[col])
        assert 0 <= float(cell["Top-1"]) <= 1 and float(cell["PSNR (dB)"]) > 0
    assert png.stat().st_size > 0
