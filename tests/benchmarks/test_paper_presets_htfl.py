"""The FedTSP and VPDR paper presets (benchmarks/tables/paper/fedtsp_*.yaml, vpdr_*.yaml): each is its offline
miniature at paper scale with every flag the miniature sets, passes `raysim compare --dry-run` with a finite
positive GPU-hours estimate, plans every cell of its paper table (FedTSP Table 1, VPDR Table 1, the alpha table,
the ablation) in the setting of the code behind it, and agrees with the flag table of its docs page; the
whole-network FLOP model scales with the work."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

import pytest
import yaml
from paper_cells import assert_dry_run_lists_the_plan, cells, value  # tests/benchmarks/paper_cells.py

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
    """A flag's value in a table spec: `rounds` for train.rounds, a grid axis, the list of the columns' values
    for a key every column sets, else the shared setting."""
    if flag == "train.rounds":
        return spec["rounds"]
    if flag in (spec.get("grid") or {}):
        return spec["grid"][flag]
    columns = spec.get("columns") or []
    if columns and all(flag in c for c in columns):
        return [c[flag] for c in columns]
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
    flag the docs' flag table sets for this preset (from the paper or the code behind the table). A row the
    preset adds is a row of the paper table (PAPER_TABLES)."""
    from raysim.tools.compare import entry_from

    mini = yaml.safe_load((ROOT / "benchmarks" / "tables" / f"{name}.yaml").read_text())
    preset = yaml.safe_load((PAPER / f"{name}.yaml").read_text())
    documented = set(preset_flags(name))
    assert [m for m in preset["methods"] if m in mini["methods"]] == mini["methods"], f"{name}: a miniature row is lost"
    for item in [m for m in preset["methods"] if m not in mini["methods"]]:
        entry = entry_from(item)
        keys = {k.removeprefix(f"{entry.method}."): v for k, v in flat(entry.overrides).items()}
        assert any(method == entry.method and all(opts.get(k, v) == v for k, v in keys.items())
                   for method, opts in PAPER_TABLES.get(name, ([], []))[1]), f"{name}: {entry.label} is no row of the paper's table"
    grid, mini_grid = preset.get("grid") or {}, mini.get("grid") or {}
    for axis in set(grid) | set(mini_grid):
        assert axis in documented or grid.get(axis) == mini_grid.get(axis), f"{name}: grid axis {axis} differs undocumented"
    scale = ("model_family", "model", "backbone", "dataset", "num_clients", "local_epochs", "data_root")
    got = flat(preset["setting"])
    columns = preset.get("columns") or []
    for flag, want in flat(mini["setting"]).items():
        per_column = bool(columns) and all(flag in c for c in columns)
        assert flag in got or flag in grid or per_column, f"{name}: the preset drops {flag}"
        if flag.rsplit(".", 1)[1] not in scale and flag not in documented:
            assert got[flag] == want, f"{name}: {flag}={got[flag]!r}, the miniature {want!r}"


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
    from raysim.build import build_config
    from raysim.tools.estimate import estimate

    def cfg(rounds, family):
        return build_config({"method": "fedproto", "fedproto": {"model_family": family, "feature_dim": 512},
                             "data": {"dataset": "cifar10", "partition": "dirichlet", "shots": 0},
                             "train": {"rounds": rounds, "num_clients": 8}, "eval": {"every": 1000, "last": 1}})

    a, b = estimate(cfg(10, "HtFE2")), estimate(cfg(20, "HtFE2"))
    # one evaluation in both, so training doubles and the total is just under 2x (0.5% covers the eval share)
    assert b["steps"] == 2 * a["steps"] and 1.99 * a["flops"] < b["flops"] <= 2 * a["flops"]
    assert estimate(cfg(10, "HtFE-img-8"))["flops"] > a["flops"]  # 8 clients: all of HtFE-img-8 (up to ResNet-152) vs FedAvgCNN/ResNet-18


def test_zoo_flops_counted_on_the_meta_device_equal_the_real_models():
    """The estimate builds each zoo model on the meta device (shapes only, no weights initialised): the count is the
    one of the same model on real tensors (integer FLOP counts, so equal)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from raysim.models.zoo import make_client_model
    from raysim.tools.estimate import cnn_forward_flops

    for arch, classes, size in (("fedavgcnn", 10, 32), ("resnet4", 200, 64), ("mobilenet_v2", 100, 32)):
        model = make_client_model(arch, 512, classes, image_size=size).eval()
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model(torch.zeros(1, 3, size, size))
        assert cnn_forward_flops(arch, 512, classes, size) == counter.get_total_flops() > 0, arch


def test_fedtsp_clients_are_counted_at_the_plms_width():
    """feature_dim 0 is the PLM's width: BERT MiniLM's 384 (read from the folder's config), BERT-base's 768 for
    a folder that is not on this machine, an explicit feature_dim as given (was: 512 for every PLM)."""
    from raysim.build import build_config
    from raysim.models.zoo import arch_of
    from raysim.tools.estimate import client_forward_flops, cnn_forward_flops

    def counted(**fedtsp):
        cfg = build_config({"method": "fedtsp", "data": {"dataset": "digits"}, "train": {"num_clients": 2},
                            "fedtsp": {"model_family": "tiny", "plm": "bert", **fedtsp}})
        return client_forward_flops(cfg)

    for width, opts in ((384, {}), (768, {"plm_path": "/nonexistent/bert-base-uncased"}), (768, {"feature_dim": 768})):
        want = [cnn_forward_flops(arch_of("tiny", k), width, 10, 32) for k in range(2)]
        assert counted(**opts) == want, (width, opts)
    assert counted() != [cnn_forward_flops(arch_of("tiny", k), 512, 10, 32) for k in range(2)]


def test_vit_forward_flops_match_the_published_vit_s16_count():
    from raysim.tools.estimate import vit_forward_flops

    # timm lists ViT-S/16 at 224 as 4.6 GMACs = 9.2 GFLOP; the analytic count ignores norms/softmax (within 5%)
    assert vit_forward_flops("vit-small-patch16-224") == pytest.approx(9.2e9, rel=0.05)
    assert vit_forward_flops("vit-base") > vit_forward_flops("vit-small")


# -- every cell of each paper table (fedtsp.txt Table 1; vpdr.txt Table 1, the alpha table, the ablation) -----------
ALPHAS = (0.1, 0.5, 1.0)
FEDTSP_BASELINES = ("fedgen", "fedgh", "lgfedavg", "fml", "feddistill", "fedkd", "fedmrl", "fedproto", "fedtgp", "alignfed")
VPDR_FRAMEWORKS = ("fedproto", "fedpcl", "fpl", "fedplvm", "fedtgp", "mpft")
IGPP, VPDR = {"dcr": False, "dp.prototypes": "igpp"}, {"dcr": True, "dp.prototypes": "vpp"}
# per preset: the paper table's columns (the keys each fixes) and rows (method and the options that make the row), as
# the paper prints them: FedTSP's rows FedGen ... AlignFed, FedTSP-CLIP, FedTSP-BERT over CIFAR-10 / CIFAR-100 /
# Tiny-ImageNet x alpha; VPDR's six frameworks + IGPP / + VPDR over Digits / Office-Caltech / PACS (Table 1) and over
# alpha (the alpha table); FedProto with VPP and DCR on or off on Office-Caltech and on PACS (the two ablation tables)
PAPER_TABLES: dict[str, tuple[list[dict], list[tuple[str, dict]]]] = {
    "fedtsp_table1": ([{"data.dataset": d, "data.beta": a} for d in ("cifar10", "cifar100", "tiny_imagenet") for a in ALPHAS],
                      [*((m, {}) for m in FEDTSP_BASELINES), ("fedtsp", {"plm": "clip"}), ("fedtsp", {"plm": "bert"})]),
    "vpdr_table1": ([{"data.dataset": d} for d in ("vpdr_digits", "office_caltech10", "pacs")],
                    [(f"vpdr_{f}", row) for f in VPDR_FRAMEWORKS for row in (IGPP, VPDR)]),
    "vpdr_alpha": ([{"data.beta": a} for a in (0.1, 0.5, 1.0, 5.0, 10.0)],
                   [(f"vpdr_{f}", row) for f in VPDR_FRAMEWORKS for row in (IGPP, VPDR)]),
    "vpdr_ablation": ([{"data.dataset": d} for d in ("office_caltech10", "pacs")],
                      [("vpdr_fedproto", {"dcr": dcr, "dp.prototypes": p}) for p in ("igpp", "vpp") for dcr in (False, True)]),
}
# the VPDR code's training data per dataset (utils/domain_skew.py keep_ratio and its RandomCrop(224, padding 4) + flip;
# label_skew.py keeps every CIFAR image and does not augment): (data.train_fraction, data.augment)
VPDR_CODE_DATA = {"vpdr_digits": (0.1, "official"), "office_caltech10": (0.3, "official"), "pacs": (0.3, "official"),
                  "cifar10": (1.0, "off")}
# FedTSP's (len_prompt m, prompt_epochs E_s) in the code's runs on each dataset: the batch scripts' CIFAR-10 1 / 1 and
# CIFAR-100 10 / 20 (SPEC 2.2-2.3); Tiny_FedTSPv4_lamda_CLIP.sh, the one Tiny-ImageNet script, --len_prompt=0 --prompt_epoch=0
FEDTSP_CODE_PROMPTS = {"cifar10": (1, 1), "cifar100": (10, 20), "tiny_imagenet": (0, 0)}


def table_setting(cfg) -> dict[str, object]:
    """The setting of a planned paper cell beyond its row and column: the docs flag tables' (the paper's where it says,
    else the code's: VPDR's kept fraction and augmentation, FedTSP's prompt settings per dataset)."""
    d = cfg.data.dataset
    if cfg.method.startswith("vpdr_"):
        fraction, augment = VPDR_CODE_DATA[d]
        label_skew = d.startswith("cifar")
        return {"data.train_fraction": fraction, "data.augment": augment, "train.num_clients": 20 if label_skew else 4,
                "data.partition": "dirichlet_shared_test" if label_skew else "domain", "dp.conversion": "classic",
                "train.rounds": 20, "train.local_epochs": 2, "train.batch_size": 256}
    want: dict[str, object] = {"data.partition": "pfllib", "train.num_clients": 20, "train.participation": 1.0,
                               "train.rounds": 300, "train.local_epochs": 5, "train.batch_size": 100, "model_family": "HtFE9"}
    if cfg.method == "fedtsp":
        want["len_prompt"], want["prompt_epochs"] = FEDTSP_CODE_PROMPTS[d]
        if value(cfg, "plm") == "clip":
            want["model.name"] = "ViT-B-32"
    return want


def missing_cells(path: Path) -> list[str]:
    """The cells of the paper table `path` is the preset of that its dry run does not plan (FedTSP's Table 1 without
    DP, VPDR's tables at epsilon 1), and each planned paper cell whose setting is not the table's (table_setting)."""
    columns, rows = PAPER_TABLES[path.stem]
    fedtsp = path.stem.startswith("fedtsp")
    out = []
    for col, method, opts, hits in cells(path, columns, rows, where=(lambda c: not c.dp.enabled) if fedtsp else
                                         (lambda c: c.dp.enabled and c.dp.epsilon == 1.0)):
        if not hits:
            out.append(f"{method} {opts or ''} at {col}, " + ("no DP" if fedtsp else "epsilon 1"))
        for c in hits:
            out += [f"{method} {opts or ''} at {col}: {k}={value(c, k)!r}, the code's {v!r}"
                    for k, v in table_setting(c).items() if value(c, k) != v]
    return out


@pytest.mark.parametrize("name", sorted(PAPER_TABLES))
def test_dry_run_lists_every_cell_of_the_paper_table(name, tmp_path, capsys, monkeypatch):
    assert missing_cells(PAPER / f"{name}.yaml") == []
    assert_dry_run_lists_the_plan(PAPER / f"{name}.yaml", tmp_path, capsys, monkeypatch)


def test_a_missing_cell_fails(tmp_path):
    """The check above can fail: FedTSP Table 1 without its Tiny-ImageNet column or its CLIP row, VPDR Table 1 without
    PACS, the alpha table without FPL's VPDR row, and PACS kept whole instead of the code's 30% each name what is wrong."""
    def edited(name, edit):
        spec = yaml.safe_load((PAPER / f"{name}.yaml").read_text())
        edit(spec)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        return missing_cells(tmp_path / f"{name}.yaml")

    no_tiny = edited("fedtsp_table1", lambda s: s.update(columns=[c for c in s["columns"] if c["data.dataset"] != "tiny_imagenet"]))
    assert len(no_tiny) == 3 * 12 and all("tiny_imagenet" in m for m in no_tiny)  # 3 alphas x the 12 paper rows
    no_clip = edited("fedtsp_table1", lambda s: s.update(methods=[m for m in s["methods"] if "CLIP" not in str(m)]))
    assert len(no_clip) == 9 and all("'plm': 'clip'" in m for m in no_clip)
    no_pacs = edited("vpdr_table1", lambda s: s.update(columns=[c for c in s["columns"] if c["data.dataset"] != "pacs"]))
    assert len(no_pacs) == 12 and all("'pacs'" in m for m in no_pacs)  # 6 frameworks x IGPP / VPDR
    no_fpl = edited("vpdr_alpha", lambda s: s.update(methods=[m for m in s["methods"] if m["label"] != "fpl + VPDR"]))
    assert len(no_fpl) == 5 and all(m.startswith("vpdr_fpl {'dcr': True") for m in no_fpl)
    whole = edited("vpdr_ablation", lambda s: s["columns"][1].update({"data.train_fraction": 1.0}))
    assert len(whole) == 4 and all("'pacs'" in m and "train_fraction=1.0, the code's 0.3" in m for m in whole)


@pytest.mark.parametrize("name", sorted(n for n in NAMES if n.startswith("vpdr")))
def test_the_docs_list_each_vpdr_presets_fraction_and_augmentation(name):
    """The code's values per dataset are checked cell by cell above; the docs' flag table names both flags."""
    assert {"data.train_fraction", "data.augment"} <= set(preset_flags(name))


# how docs/papers/{fedtsp,vpdr}.md word each preset's dry-run estimate
DOC_ESTIMATE = {"fedtsp_table1": "Table 1 {} (117 runs", "vpdr_table1": "Table 1 {} (Digits",
                "vpdr_ablation": "ablation {} (Office-Caltech", "vpdr_alpha": "alpha table {} (60 runs"}


@pytest.mark.parametrize("name", sorted(DOC_ESTIMATE))
def test_the_docs_print_each_presets_dry_run_estimate(name, tmp_path, capsys, monkeypatch):
    from raysim.tools.compare import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([str(PAPER / f"{name}.yaml"), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    hours = re.search(r"estimated GPU-hours: ([0-9.e+-]+)", capsys.readouterr().out).group(1)
    doc = ROOT / "docs" / "papers" / f"{name.split('_')[0]}.md"
    text = " ".join(doc.read_text().split())
    assert " ".join(DOC_ESTIMATE[name].format(hours).split()) in text, f"{doc.name} does not print {name}'s {hours}"


def test_the_estimate_trains_on_the_kept_fraction_of_each_domain():
    from raysim.build import build_config
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


def test_the_clip_miniature_of_table4_is_the_bert_one_with_the_codes_plm():
    """benchmarks/tables/fedtsp_table4_clip.yaml is fedtsp_table4.yaml with the PLM of the code behind Table 4
    (the paper preset's, CLIP) and nothing else changed, so the two tables compare the PLM alone."""
    tables = ROOT / "benchmarks" / "tables"
    bert, clip = (yaml.safe_load((tables / f"{n}.yaml").read_text()) for n in ("fedtsp_table4", "fedtsp_table4_clip"))
    assert bert["setting"]["fedtsp"].pop("plm") == "bert"
    preset = yaml.safe_load((PAPER / "fedtsp_table4.yaml").read_text())
    assert clip["setting"]["fedtsp"].pop("plm") == preset["setting"]["fedtsp"]["plm"] == "clip"
    assert "model" not in clip["setting"]  # the bundled default model's text tower: raysim-clip3 offline
    del bert["title"], clip["title"]
    assert bert == clip
