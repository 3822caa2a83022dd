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
from paper_cells import assert_dry_run_lists_the_plan, cells, value  # tests/benchmarks/paper_cells.py

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
    from raysim.build import build_config
    from raysim.tools.estimate import estimate

    base = {"method": "promptfl", "model": {"name": "ViT-B-16", "pretrained": "openai"},
            "data": {"dataset": "oxford_pets", "shots": 16}, "train": {"rounds": 50, "num_clients": 10}}
    a = estimate(build_config(base))
    b = estimate(build_config({**base, "train": {"rounds": 100, "num_clients": 10}}))
    c = estimate(build_config({**base, "dp": {"epsilon": 1.0}}))
    # the step FLOPs double; the image features are paid once, so the total grows by less than 2x
    assert b["steps"] == 2 * a["steps"] and a["flops"] < b["flops"] < 2 * a["flops"]
    assert c["flops"] > a["flops"]


# -- every cell of every paper table (fedsept.txt Tables 1-5), as the presets' dry runs plan them -------------------
CLIP_SETS = ("food101", "caltech101", "flowers102", "dtd", "oxford_pets")
BETAS = (0.1, 0.3, 0.5)
BASELINES = ("promptfl", "fedpgp", "fedotp", "fedpha", "pfedmoap", "dpfpl")
CODE_CLIENTS = {"pacs": 8, "office31": 6, "officehome": 8, "domainnet": 12}  # 2 per domain; DomainNet's 6 domains (the code's)
# per preset: the paper table's columns (the keys each column fixes) and its rows (method, and the options that make
# the row: Table 4's variants, Table 5's FedSEPT-NC / -PF); every column at epsilon 1
PAPER_TABLES: dict[str, tuple[list[dict], list[tuple[str, dict]]]] = {
    "table1": ([{"data.dataset": d, "data.partition": "pathological"} for d in CLIP_SETS],
               [(m, {}) for m in (*BASELINES, "fedsept")]),
    "table2": ([{"data.dataset": d, "data.partition": "dirichlet", "data.beta": b} for d in ("cifar10", "cifar100") for b in BETAS],
               [(m, {}) for m in (*BASELINES, "fedsept")]),
    **{f"table3_{d}": ([{"data.dataset": d, "data.partition": "domain", "data.beta": b} for b in BETAS],
                       [(m, {}) for m in (*BASELINES, "fedsept")]) for d in CODE_CLIENTS},
    "table4_ablation": ([{"data.dataset": "oxford_pets", "data.partition": "pathological"},
                         {"data.dataset": "cifar10", "data.partition": "dirichlet", "data.beta": 0.1},
                         {"data.dataset": "officehome", "data.partition": "domain", "data.beta": 0.1}],
                        [("fedsept", {"variant": v}) for v in ("full", "single", "full_meps", "wo_r", "top1", "uniform")]),
    "table5_efficiency": ([{"data.dataset": "oxford_pets", "data.partition": "pathological"}],
                          [("fedsept", {"cache_text": True, "fusion": "logit"}), ("fedsept", {"cache_text": False}),
                           ("fedsept", {"fusion": "prompt"}), *((m, {}) for m in BASELINES)]),
}


def missing_cells(path: Path) -> list[str]:
    """The (row, column) cells of the paper table `path` is the preset of that its dry run does not plan, and each
    planned paper cell whose setting is not the table's (clients, participation, the code's split and transform)."""
    columns, rows = PAPER_TABLES[path.stem.removeprefix("fedsept_")]
    out = []
    for col, method, opts, hits in cells(path, columns, rows, where=lambda c: c.dp.enabled and c.dp.epsilon == 1.0):
        if not hits:
            out.append(f"{method} {opts or ''} at {col}, epsilon 1")
        for c in hits:
            d = c.data.dataset
            want = ({"train.num_clients": 100, "train.participation": 0.1, "data.cifar_transform": "official"}
                    if d.startswith("cifar") else
                    {"train.num_clients": CODE_CLIENTS[d], "data.domain_reseed": True} if d in CODE_CLIENTS else
                    {"train.num_clients": 10, "data.shots": 16})
            want["train.optimizer_state"] = "fresh" if method == "fedpha" else "shared"  # the code's one SGD
            out += [f"{method} at {col}: {k}={value(c, k)!r}, the code's {v!r}" for k, v in want.items() if value(c, k) != v]
    return out


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_dry_run_lists_every_cell_of_the_paper_table(path, tmp_path, capsys, monkeypatch):
    assert missing_cells(path) == []
    assert_dry_run_lists_the_plan(path, tmp_path, capsys, monkeypatch)


def test_a_missing_cell_fails(tmp_path):
    """The check above can fail: a Table 3 preset without beta 0.3, a Table 4 without its CIFAR-10 column, and a
    Table 3 preset with the fresh draw per class instead of the code's re-seeded split each name what is wrong."""
    t3 = yaml.safe_load((ROOT / "benchmarks/tables/paper/fedsept_table3_pacs.yaml").read_text())
    t3["grid"]["data.beta"] = [0.1, 0.5]
    (tmp_path / "fedsept_table3_pacs.yaml").write_text(yaml.safe_dump(t3))
    assert any("'data.beta': 0.3" in m for m in missing_cells(tmp_path / "fedsept_table3_pacs.yaml"))
    t4 = yaml.safe_load((ROOT / "benchmarks/tables/paper/fedsept_table4_ablation.yaml").read_text())
    t4["columns"] = [c for c in t4["columns"] if c["data.dataset"] != "cifar10"]
    (tmp_path / "fedsept_table4_ablation.yaml").write_text(yaml.safe_dump(t4))
    assert sum("cifar10" in m for m in missing_cells(tmp_path / "fedsept_table4_ablation.yaml")) == 6  # every variant
    t3 = yaml.safe_load((ROOT / "benchmarks/tables/paper/fedsept_table3_pacs.yaml").read_text())
    t3["setting"]["data"]["domain_reseed"] = False
    (tmp_path / "fedsept_table3_pacs.yaml").write_text(yaml.safe_dump(t3))
    assert any("domain_reseed" in m for m in missing_cells(tmp_path / "fedsept_table3_pacs.yaml"))
