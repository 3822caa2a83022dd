"""The efficiency benchmark runs (in-process and in Ray actors) and its deterministic columns hold the
paper's direction; its timings are reported by the benchmark itself, not asserted here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from raysim.build import make_method
from raysim.methods.base import broadcast_state
from raysim.models.clip import ModelSpec, build_clip_env

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench():
    sys.path.insert(0, str(BENCH))
    import fedsept_efficiency

    return fedsept_efficiency


def _columns(out: str) -> tuple[list[str], dict[str, list[str]]]:
    """The first table of the output: (header, {row label: cells after the label})."""
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    rows = {}
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if cells[0] == "Method":  # the second table (what crosses) starts here
            break
        rows[cells[0]] = cells[1:]
    return header, rows


def _num(cell: str) -> float:
    return float(re.match(r"[\d.e+-]+", cell).group())


def test_efficiency_table_every_method_bytes_and_flops(capsys):
    """Every row of the seven methods (and FedSEPT's variants) is produced on the tiny model, and its
    communication is the bytes of the declared uploads plus the broadcast: worked by hand from the shapes
    (raysim-tiny: width w = 128, L = 16; FedSEPT: A is M x L x r = 4 x 16 x 16; pFedMoAP's broadcast adds
    its bank, K x L x w, and K seen flags), and again from each method's own `releases` and `init_shared`."""
    bench = _bench()
    K = 3
    argv = ["--model", "raysim-tiny", "--classes", "4", "--batch", "2", "--repeats", "1", "--threads", "1", "--no-warmup",
            "--clients", str(K)]
    bench.main(argv)
    out = capsys.readouterr().out
    header, rows = _columns(out)
    assert list(rows) == [label for label, _ in bench.ROWS]  # every method row, FedOTP in both token modes
    col = {name: header.index(name) for name in ("Comm. (KiB)", "Up (KiB)", "Down (KiB)", "FLOPs (G)", "1st-pass FLOPs (G)")}
    cell = lambda row, name: _num(rows[row][col[name]])  # noqa: E731
    prompt = 16 * 128 * 4 / 1024  # one L x w fp32 context: 8 KiB
    fedsept = 4 * 16 * 16 * 4 / 1024  # A: 4 KiB
    expected = {label: (prompt, prompt) for label in ("PromptFL", "FedPGP", "FedOTP-pooled", "FedOTP-patch", "FedPHA", "DP-FPL")}
    expected["pFedMoAP"] = (prompt, prompt + K * prompt + K * 4 / 1024)  # ctx, bank, bank_seen
    expected.update({label: (fedsept, fedsept) for label in ("FedSEPT-NC", "FedSEPT-PF", "FedSEPT", "FedSEPT-patch")})
    env = build_clip_env(ModelSpec("raysim-tiny"), [f"c{i}" for i in range(4)], 16)  # what init_shared reads: widths, prompts
    for label, entry in bench.ROWS:
        up, down = expected[label]
        # the table prints 2 decimals: 0.005 KiB of rounding
        assert abs(cell(label, "Up (KiB)") - up) < 0.006 and abs(cell(label, "Down (KiB)") - down) < 0.006, label
        assert abs(cell(label, "Comm. (KiB)") - (up + down)) < 0.006, label
        # the same from the method's declaration: its declared uploads as initialised, and its broadcast
        method = make_method(bench.row_config(entry, bench.parse_args(argv)))
        state = method.init_shared(env, torch.Generator().manual_seed(0))
        declared = sum(state[k].numel() * state[k].element_size() for k in method.uploads) / 1024
        broadcast = sum(t.numel() * t.element_size() for t in broadcast_state(method, state).values()) / 1024
        assert (declared, broadcast) == (up, down), label  # exact: byte counts
    flops = {r: cell(r, "FLOPs (G)") for r in ("FedSEPT", "FedSEPT-NC", "FedSEPT-patch")}
    assert flops["FedSEPT-NC"] > 100 * flops["FedSEPT"]  # the cache removes the M x C prompt encodings
    assert flops["FedSEPT"] < flops["FedSEPT-patch"] < flops["FedSEPT-NC"]  # attention over 17 tokens, not the text tower
    # pFedMoAP's first pass encodes its own ctx and its min(8, K) - 1 = 2 experts: 3 PromptFL encodings, plus
    # the small gating head (a few % of one encoding on this model)
    ratio = cell("pFedMoAP", "1st-pass FLOPs (G)") / cell("PromptFL", "1st-pass FLOPs (G)")
    assert 3 <= ratio < 3.3
    assert "pFedMoAP | ctx 16x128 | ctx 16x128, bank 3x16x128, bank_seen 3 |" in out


def test_efficiency_methods_option_picks_rows_and_entries(capsys):
    """`--methods` takes row labels and compare-style entries; ratios go to the first row without FedSEPT."""
    _bench().main(["--model", "raysim-tiny", "--classes", "3", "--batch", "2", "--repeats", "1", "--threads", "1", "--no-warmup",
                   "--methods", "DP-FPL,dpfpl:rank=2"])
    out = capsys.readouterr().out
    _, rows = _columns(out)
    assert list(rows) == ["DP-FPL", "dpfpl:rank=2"] and "Ratios are to DP-FPL." in out
    assert rows["DP-FPL"][0].endswith("(1.00x)")


def test_efficiency_benchmark_in_ray_actors(ray_session, capsys):
    _bench().main(["--model", "raysim-tiny", "--batch", "4", "--repeats", "1", "--threads", "1", "--no-warmup",
                   "--only", "FedSEPT,FedSEPT-patch", "--actors", "2"])
    out = capsys.readouterr().out
    assert "2 Ray actors at once, 0 GPU each" in out and "| FedSEPT-patch |" in out
