"""The FedTSP and VPDR paper presets (benchmarks/tables/paper/fedtsp_*.yaml, vpdr_*.yaml): each is its offline
miniature at paper scale with every flag the miniature sets, passes `raysim compare --dry-run` with a finite
positive GPU-hours estimate, and agrees with the flag table of its docs page; the whole-network FLOP model
scales with the work."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "benchmarks" / "tables" / "paper"
NAMES = ("fedtsp_table1", "fedtsp_table3", "fedtsp_table4", "vpdr_table1", "vpdr_ablation", "vpdr_alpha")


def doc_flags(paper: str) -> dict[Optional[str], dict[str, object]]:
    """{preset name, or None for every preset of the paper: {flag: preset value}} from the flag tables of the
    docs' "Paper presets" section: rows before its first ### `name.yaml` heading hold for every preset,
    rows under such a heading for that preset only (the last column, a YAML scalar or list)."""
    text = (ROOT / "docs" / "papers" / f"{paper}.md").read_text()
    section = text.split("## Paper presets", 1)[1].split("\n## ", 1)[0]
    out: dict[Optional[str], dict[str, object]] = {None: {}}
    current: Optional[str] = None
    for line in section.splitlines():
        h = re.match(r"###\s+`([a-z0-9_]+)\.yaml`", line)
        if h:
            current = h.group(1)
            out.setdefault(current, {})
            continue
        m = re.match(r"\|\s*`([a-z0-9_.]+)`\s*\|.*\|\s*`([^`]*)`\s*\|\s*$", line)
        if m:
            out[current][m.group(1)] = yaml.safe_load(m.group(2))
    return out


def preset_flags(name: str) -> dict[str, object]:
    """The docs' flags of preset `name`: the paper's common rows, then its own."""
    flags = doc_flags(name.split("_")[0])
    return {**flags[None], **flags.get(name, {})}


def preset_value(spec: dict, flag: str) -> object:
    """A flag's value in a table spec: `rounds` for train.rounds, a grid axis, else the shared setting."""
    if flag == "train.rounds":
        return spec["rounds"]
    if flag in (spec.get("grid") or {}):
        return spec["grid"][flag]
    section, key = flag.split(".", 1)
    return spec["setting"][section][key]


def flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("name", NAMES)
def test_preset_keeps_every_flag_of_its_miniature(name):
    """Every method row and every setting flag of the miniature is in the preset; only scale may differ, and a
    flag the docs' flag table sets for this preset (from the paper or the code behind the table)."""
    mini = yaml.safe_load((ROOT / "benchmarks" / "tables" / f"{name}.yaml").read_text())
    preset = yaml.safe_load((PAPER / f"{name}.yaml").read_text())
    documented = set(preset_flags(name))
    assert preset["methods"] == mini["methods"]
    grid, mini_grid = preset.get("grid") or {}, mini.get("grid") or {}
    for axis in set(grid) | set(mini_grid):
        assert axis in documented or grid.get(axis) == mini_grid.get(axis), f"{name}: grid axis {axis} differs undocumented"
    scale = ("model_family", "model", "backbone", "dataset", "num_clients", "local_epochs", "data_root")
    got = flat(preset["setting"])
    for flag, value in flat(mini["setting"]).items():
        assert flag in got or flag in grid, f"{name}: the preset drops {flag}"
        if flag.rsplit(".", 1)[1] not in scale and flag not in documented:
            assert got[flag] == value, f"{name}: {flag}={got[flag]!r}, the miniature {value!r}"


@pytest.mark.parametrize("name", NAMES)
def test_preset_sets_the_docs_flag_table(name):
    flags = preset_flags(name)
    assert flags, f"docs/papers/{name.split('_')[0]}.md has no flag table for {name}"
    spec = yaml.safe_load((PAPER / f"{name}.yaml").read_text())
    for flag, want in flags.items():
        assert preset_value(spec, flag) == want, f"{name}: {flag}={preset_value(spec, flag)!r}, the docs say {want!r}"


@pytest.mark.parametrize("name", ("fedtsp_table1", "fedtsp_table4"))
def test_every_zoo_method_trains_the_family_the_docs_name(name):
    """The flag table names fedtsp.model_family; every other method of the preset trains the same zoo."""
    spec = yaml.safe_load((PAPER / f"{name}.yaml").read_text())
    want = preset_flags(name)["fedtsp.model_family"]
    families = {sec: opts["model_family"] for sec, opts in spec["setting"].items()
                if isinstance(opts, dict) and "model_family" in opts}
    assert families and set(families.values()) == {want}, families


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


# the VPDR code's training data (utils/domain_skew.py keep_ratio and its RandomCrop(224, padding 4) + flip; label_skew.py
# keeps every CIFAR image and does not augment): (data.train_fraction, data.augment) of each VPDR preset
VPDR_CODE_DATA = {"vpdr_table1": (0.1, "official"), "vpdr_ablation": (0.3, "official"), "vpdr_alpha": (1.0, "off")}
# how docs/papers/vpdr.md words each preset's dry-run estimate
VPDR_DOC_ESTIMATE = {"vpdr_table1": "Table 1 {} (Digits", "vpdr_ablation": "ablation {} (PACS", "vpdr_alpha": "alpha table {} GPU-hours"}


@pytest.mark.parametrize("name", sorted(VPDR_CODE_DATA))
def test_vpdr_presets_keep_the_codes_fraction_and_augmentation_and_the_docs_say_so(name):
    fraction, augment = VPDR_CODE_DATA[name]
    data = yaml.safe_load((PAPER / f"{name}.yaml").read_text())["setting"]["data"]
    flags = preset_flags(name)
    assert data["train_fraction"] == flags["data.train_fraction"] == fraction
    assert data["augment"] == flags["data.augment"] == augment


@pytest.mark.parametrize("name", sorted(VPDR_DOC_ESTIMATE))
def test_the_docs_print_each_vpdr_presets_dry_run_estimate(name, tmp_path, capsys, monkeypatch):
    from raysim.tools.compare import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([str(PAPER / f"{name}.yaml"), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    hours = re.search(r"estimated GPU-hours: ([0-9.e+-]+)", capsys.readouterr().out).group(1)
    text = " ".join((ROOT / "docs" / "papers" / "vpdr.md").read_text().split())
    assert " ".join(VPDR_DOC_ESTIMATE[name].format(hours).split()) in text, f"docs/papers/vpdr.md does not print {name}'s {hours}"


def test_the_estimate_trains_on_the_kept_fraction_of_each_domain():
    from raysim.config.checks import build_config
    from raysim.tools.estimate import estimate, sizes

    def cfg(dataset, fraction):
        return build_config({"method": "vpdr_fedproto", "data": {"dataset": dataset, "partition": "domain", "shots": 0,
                                                                  "train_fraction": fraction},
                             "train": {"num_clients": 4, "rounds": 20, "local_epochs": 2, "batch_size": 256}})

    # by hand: PACS's index % 10 <= 7 training splits 1640, 1876, 1336, 3144 keep 492 + 562 + 400 + 943 at 0.3;
    # Office-Caltech's 768, 899, 127, 237 keep 230 + 269 + 38 + 71; Digits' 60000, 7291, 73257, 10000 keep 10%
    assert sizes(cfg("pacs", 0.3)) == (7, 2397, 1995) and sizes(cfg("pacs", 1.0)) == (7, 7996, 1995)
    assert sizes(cfg("office_caltech10", 0.3)) == (10, 608, 502) and sizes(cfg("office_caltech10", 1.0)) == (10, 2031, 502)
    assert sizes(cfg("vpdr_digits", 0.1)) == (10, 15054, 40039) and sizes(cfg("vpdr_digits", 1.0)) == (10, 150548, 40039)
    # steps: 20 rounds x 4 clients x 2 epochs x ceil(n / 4 / 256) batches
    assert estimate(cfg("pacs", 0.3))["steps"] == 20 * 4 * 2 * 3 and estimate(cfg("pacs", 1.0))["steps"] == 20 * 4 * 2 * 8
