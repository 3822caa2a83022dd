"""The paper presets (benchmarks/tables/paper/): every published FedSEPT table has a spec at paper scale
with the official flags; `raysim compare --dry-run` validates each from its config alone (no datasets,
no weights here) and prints a GPU-hours estimate; the flag table of docs/papers/fedsept.md and the
presets agree."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "benchmarks" / "tables" / "paper").glob("fedsept_*.yaml"))  # FedTSP / VPDR: test_paper_presets_htfl.py
TABLES = ("table1", "table2", "table3_pacs", "table3_office31", "table3_officehome", "table3_domainnet",
          "table4_ablation", "table5_efficiency")


def doc_flags() -> dict[str, object]:
    """{flag: preset value} from the docs' "Paper presets" flag table (the last column, a YAML scalar)."""
    text = (ROOT / "docs" / "papers" / "fedsept.md").read_text()
    section = text.split("## Paper presets", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([a-z_.]+)`\s*\|.*\|\s*`([^`]*)`\s*\|\s*$", line)
        if m:
            out[m.group(1)] = yaml.safe_load(m.group(2)) if m.group(2) != '""' else ""
    return out


def test_every_published_table_has_a_preset():
    assert {p.stem for p in PRESETS} == {f"fedsept_{t}" for t in TABLES}


def test_docs_flag_table_lists_the_official_flags():
    flags = doc_flags()
    assert {"dp.calibration", "fedsept.div_reduction", "fedsept.lambda_gate", "fedotp.tokens", "fedpha.eot_quirk",
            "train.n_ctx", "train.lr", "model.name"} <= set(flags)
    assert flags["dp.calibration"] == "all_rounds" and flags["fedpha.eot_quirk"] is True


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_sets_every_flag_as_the_docs_say(path):
    spec = yaml.safe_load(path.read_text())
    setting = spec["setting"]
    for flag, want in doc_flags().items():
        section, key = flag.split(".", 1)
        if section in ("dp", "train", "model", "data", "eval"):
            got = spec["rounds"] if flag == "train.rounds" and "rounds" in spec else setting[section][key]
            assert got == want, f"{path.name}: {flag}={got!r}, the docs say {want!r}"
        else:  # a method's flag: on each of that method's rows
            rows = [m for m in spec["methods"] if isinstance(m, dict) and m["method"] == section]
            bare = [m for m in spec["methods"] if m == section]
            assert not bare, f"{path.name}: {section} runs without its official flags"
            for row in rows:
                assert row[section][key] == want, f"{path.name}: {row['label']}: {flag}={row[section][key]!r}, docs {want!r}"
    assert setting["model"]["name"] == "ViT-B-16" and setting["data"]["data_root"]


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_dry_run_validates_without_data_or_weights_and_estimates_gpu_hours(path, tmp_path, capsys, monkeypatch):
    from raysim.tools.compare import main

    monkeypatch.chdir(tmp_path)  # ./data (the presets' data_root) does not exist here, nor do the ViT-B/16 weights
    assert main([str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    hours = float(re.search(r"estimated GPU-hours: ([0-9.e+-]+)", out).group(1))
    assert math.isfinite(hours) and hours > 0
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_gpu_hours_estimate_scales_with_the_work():
    """Twice the rounds is twice the training steps; DP's per-example backward costs more than a plain one."""
    from raysim.config.checks import build_config
    from raysim.tools.estimate import estimate

    base = {"method": "promptfl", "model": {"name": "ViT-B-16", "pretrained": "openai"},
            "data": {"dataset": "oxford_pets", "shots": 16}, "train": {"rounds": 50, "num_clients": 10}}
    a = estimate(build_config(base))
    b = estimate(build_config({**base, "train": {"rounds": 100, "num_clients": 10}}))
    c = estimate(build_config({**base, "dp": {"epsilon": 1.0}}))
    # the step FLOPs double; the image features are paid once, so the total grows by less than 2x
    assert b["steps"] == 2 * a["steps"] and a["flops"] < b["flops"] < 2 * a["flops"]
    assert c["flops"] > a["flops"]
