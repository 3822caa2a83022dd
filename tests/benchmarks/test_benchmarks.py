"""The efficiency benchmark runs (in-process and in Ray actors) and its deterministic columns hold the
paper's direction; its timings are reported by the benchmark itself, not asserted here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench():
    sys.path.insert(0, str(BENCH))
    import fedsept_efficiency

    return fedsept_efficiency


def _cells(out: str, row: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if ln.startswith(f"| {row} |"))
    return [c.strip() for c in line.strip("|").split("|")][1:]


def test_efficiency_table_flops_and_bytes(capsys):
    _bench().main(["--model", "raysim-tiny", "--batch", "4", "--repeats", "1", "--threads", "1", "--no-warmup",
                   "--only", "PromptFL,FedSEPT,FedSEPT-NC,FedSEPT-patch"])
    out = capsys.readouterr().out
    num = lambda cell: float(re.match(r"[\d.e+-]+", cell).group())  # noqa: E731
    comm = {r: num(_cells(out, r)[0]) for r in ("PromptFL", "FedSEPT")}
    assert comm == {"PromptFL": 2 * 16 * 128 * 4 / 1024, "FedSEPT": 2 * 4 * 16 * 16 * 4 / 1024}
    flops = {r: num(_cells(out, r)[2]) for r in ("FedSEPT", "FedSEPT-NC", "FedSEPT-patch")}
    assert flops["FedSEPT-NC"] > 100 * flops["FedSEPT"]  # the cache removes the M x C prompt encodings
    assert flops["FedSEPT"] < flops["FedSEPT-patch"] < flops["FedSEPT-NC"]  # attention over 17 tokens, not the text tower


def test_efficiency_benchmark_in_ray_actors(ray_session, capsys):
    _bench().main(["--model", "raysim-tiny", "--batch", "4", "--repeats", "1", "--threads", "1", "--no-warmup",
                   "--only", "FedSEPT,FedSEPT-patch", "--actors", "2"])
    out = capsys.readouterr().out
    assert "2 Ray actors at once, 0 GPU each" in out and "| FedSEPT-patch |" in out
