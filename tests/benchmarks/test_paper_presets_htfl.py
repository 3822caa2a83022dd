"""The FedTSP and VPDR paper presets (benchmarks/tables/paper/fedtsp_*.yaml, vpdr_*.yaml): each is its offline
miniature at paper scale with every flag the miniature sets, passes `raysim compare --dry-run` with a finite
positive GPU-hours estimate, and agrees with the flag table of its docs page; the whole-network FLOP model
scales with the work."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "benchmarks" / "tables" / "paper"
NAMES = ("fedtsp_table1", "fedtsp_table3", "fedtsp_table4", "vpdr_table1", "vpdr_ablation", "vpdr_alpha")


def doc_flags(paper: str) -> dict[str, object]:
    text = (ROOT / "docs" / "papers" / f"{paper}.md").read_text()
    section = text.split("## Paper presets", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([a-z_.]+)`\s*\|.*\|\s*`([^`]*)`\s*\|\s*$", line)
        if m:
            out[m.group(1)] = yaml.safe_load(m.group(2))
    return out


def flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("name", NAMES)
def test_preset_keeps_every_flag_of_its_miniature(name):
    """Every method row and every setting flag of the miniature is in the preset; only scale may differ."""
    mini = yaml.safe_load((ROOT / "benchmarks" / "tables" / f"{name}.yaml").read_text())
    preset = yaml.safe_load((PAPER / f"{name}.yaml").read_text())
    assert preset["methods"] == mini["methods"] and preset.get("grid") == mini.get("grid")
    scale = ("model_family", "model", "backbone", "dataset", "num_clients", "local_epochs", "data_root")
    got = flat(preset["setting"])
    for flag, value in flat(mini["setting"]).items():
        assert flag in got, f"{name}: the preset drops {flag}"
        if flag.rsplit(".", 1)[1] not in scale:
            assert got[flag] == value, f"{name}: {flag}={got[flag]!r}, the miniature {value!r}"


@pytest.mark.parametrize("name", NAMES)
def test_preset_sets_the_docs_flag_table(name):
    paper = name.split("_")[0]
    flags = doc_flags(paper)
    assert flags, f"docs/papers/{paper}.md has no flag table"
    spec = yaml.safe_load((PAPER / f"{name}.yaml").read_text())
    for flag, want in flags.items():
        section, key = flag.split(".", 1)
        got = spec["rounds"] if flag == "train.rounds" else spec["setting"][section][key]
        assert got == want, f"{name}: {flag}={got!r}, the docs say {want!r}"


@pytest.mark.parametrize("name", NAMES)
def test_dry_run_estimates_finite_positive_gpu_hours(name, tmp_path, capsys, monkeypatch):
    from raysim.tools.compare import main

    monkeypatch.chdir(tmp_path)  # no ./data, no ViT-S/16 weights here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([str(PAPER / f"{name}.yaml"), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    hours = float(re.search(r"estimated GPU-hours: ([0-9.e+-]+)", capsys.readouterr().out).group(1))
    assert math.isfinite(hours) and hours > 0
    assert not (tmp_path / "out").exists()


def test_whole_network_estimate_scales_with_rounds_and_model_size():
    from raysim.config.checks import build_config
    from raysim.tools.estimate import estimate

    def cfg(rounds, family):
        return build_config({"method": "fedproto", "fedproto": {"model_family": family, "feature_dim": 512},
                             "data": {"dataset": "cifar10", "partition": "dirichlet", "shots": 0},
                             "train": {"rounds": rounds, "num_clients": 8}, "eval": {"every": 1000, "last": 1}})

    a, b = estimate(cfg(10, "HtFE2")), estimate(cfg(20, "HtFE2"))
    # one evaluation in both, so training doubles and the total is just under 2x (0.5% covers the eval share)
    assert b["steps"] == 2 * a["steps"] and 1.99 * a["flops"] < b["flops"] <= 2 * a["flops"]
    assert estimate(cfg(10, "HtFE-img-8"))["flops"] > a["flops"]  # 8 clients: all of HtFE-img-8 (up to ResNet-152) vs FedAvgCNN/ResNet-18


def test_vit_forward_flops_match_the_published_vit_s16_count():
    from raysim.tools.estimate import vit_forward_flops

    # timm lists ViT-S/16 at 224 as 4.6 GMACs = 9.2 GFLOP; the analytic count ignores norms/softmax (within 5%)
    assert vit_forward_flops("vit-small-patch16-224") == pytest.approx(9.2e9, rel=0.05)
    assert vit_forward_flops("vit-base") > vit_forward_flops("vit-small")
