"""`raysim compare`: entries, grids, the paper layouts' marks, resumability, refusals."""

from __future__ import annotations

import csv
import math

import pytest

from raysim.tools.compare import CompareSpec, Entry, Table, parse_entry, parse_grid

TINY = ["data.dataset=digits", "data.shots=8", "model.name=raysim-tiny", "model.pretrained=", "train.num_clients=3",
        "train.n_ctx=4", "execution.backend=inline", "output.tensorboard=false"]


def test_entries_split_section_options_from_dotted_keys():
    e = parse_entry("fedsept:rank=8;train.lr=0.002;variant=wo_r")
    assert e.method == "fedsept" and e.label == "fedsept:rank=8;train.lr=0.002;variant=wo_r"
    assert e.overrides == {"fedsept": {"rank": 8, "variant": "wo_r"}, "train": {"lr": 0.002}}
    assert parse_entry("promptfl").overrides == {}
    assert parse_grid(["data.beta=0.1,0.5"]) == {"data.beta": [0.1, 0.5]}
    spec = CompareSpec(methods=[Entry("a", "a")], grid={"x": [1, 2], "y": ["u", "v"]})
    assert spec.cells() == [{"x": 1, "y": "u"}, {"x": 1, "y": "v"}, {"x": 2, "y": "u"}, {"x": 2, "y": "v"}]


def test_named_columns_set_several_keys_and_the_grid_runs_inside_each(tmp_path):
    """A spec's `columns:` (FedSEPT Table 4: one column per skew, each in its own setting): each column's keys reach its
    runs only, the grid's product runs inside every column, and a malformed list is refused with the spec's name."""
    import yaml

    from raysim.errors import ConfigError
    from raysim.tools.compare import plan, spec_from_args

    spec_file = tmp_path / "t.yaml"
    spec_file.write_text(yaml.safe_dump({
        "methods": ["promptfl"], "grid": {"dp.epsilon": [1.0, float("inf")]},
        "columns": [{"label": "A", "data.dataset": "digits", "train.num_clients": 3},
                    {"label": "B", "data": {"dataset": "synthetic", "partition": "dirichlet", "beta": 0.1}}]}))
    spec, _ = spec_from_args([str(spec_file)])
    assert [c["column"] for c in spec.cells()] == ["A", "A", "B", "B"]
    got = {(cell["column"], cfg.dp.epsilon): cfg for cell, _, _, cfg in plan(spec, tmp_path / "out")}
    a, b = got[("A", 1.0)], got[("B", float("inf"))]
    assert (a.data.dataset, a.train.num_clients, a.data.partition) == ("digits", 3, "pathological")
    assert (b.data.dataset, b.data.partition, b.data.beta, b.train.num_clients) == ("synthetic", "dirichlet", 0.1, 10)
    spec_file.write_text(yaml.safe_dump({"methods": ["promptfl"], "columns": [{"data.dataset": "digits"}]}))
    with pytest.raises(ConfigError, match="t.yaml: columns is a list of mappings, each with a label"):
        spec_from_args([str(spec_file)])


def test_marks_follow_the_papers():
    t = Table(["A", "B"], ["m1", "m2", "m3", "m4"], [[0.5, 0.1], [0.7, 0.3], [0.6, math.nan], [0.4, 0.2]], marks="rank3")
    assert t.ranks() == [[3, 3], [1, 1], [2, 0], [0, 2]]  # nan is never ranked
    md = t.markdown()
    assert "**70.00**" in md and "<u>60.00</u>" in md and "*50.00*" in md and "–" in md
    # pairs: the better of the rows sharing a method; STD is better when lower
    p = Table(["AVG", "STD"], ["x:igpp", "x:vpdr", "y:igpp", "y:vpdr"], [[0.5, 0.1], [0.6, 0.2], [0.8, 0.05], [0.7, 0.01]],
              marks="pairs", higher_better=[True, False], groups=["x", "x", "y", "y"])
    assert p.ranks() == [[0, 1], [1, 0], [1, 0], [0, 1]]


def test_compare_writes_the_table_resumes_and_refuses_changed_settings(tmp_path, capsys):
    from raysim.tools.compare import main

    out = tmp_path / "cmp"
    args = ["--methods", "zeroshot,promptfl", "--grid", "train.lr=0.05,0.002", "--rounds", "1", "--out", str(out),
            "--max-concurrent", "1", *TINY]  # one after another in this process (the concurrent path: test_compare_concurrent.py)
    assert main(args) == 0
    text = (out / "table.md").read_text()
    assert "lr=0.05 HM" in text and "lr=0.002 In-Client" in text and "**" in text
    assert (out / "table.png").stat().st_size > 0
    rows = list(csv.reader(open(out / "table.csv")))
    assert [r[0] for r in rows[1:]] == ["zeroshot", "promptfl"] and len(rows[0]) == 1 + 2 * 3
    capsys.readouterr()
    # the same command again reads every run back and gives the same table
    assert main(args) == 0
    assert capsys.readouterr().err.count("done earlier") == 4
    assert list(csv.reader(open(out / "table.csv"))) == rows
    # a different setting with the same --out is refused, nothing is overwritten
    assert main([*args, "dp.epsilon=1"]) == 2
    assert list(csv.reader(open(out / "table.csv"))) == rows


def test_a_bad_entry_is_refused_before_anything_runs(tmp_path):
    from raysim.tools.compare import main

    out = tmp_path / "cmp"
    assert main(["--methods", "promptfl,no_such_method", "--rounds", "1", "--out", str(out), *TINY]) == 2
    assert not out.exists()
    assert main(["--methods", "promptfl", "--layout", "nope", "--out", str(out), *TINY]) == 2
    assert not out.exists()


def test_vpdr_layout_per_domain_avg_std(tmp_path):
    from raysim.tools.compare import RunRecord, VPDRLayout

    recs = []
    for label, accs in (("fedproto:privacy=igpp", [0.5, 0.7, 0.9, 0.3]), ("fedproto:privacy=vpdr", [0.6, 0.7, 0.8, 0.5])):
        d = tmp_path / label.replace(":", "-")
        d.mkdir()
        with open(d / "client_results.csv", "w", newline="") as f:
            w = csv.DictWriter(f, ["round", "client", "domain", "in_client"])
            w.writeheader()
            for c, a in enumerate(accs):
                w.writerow({"round": 0, "client": c, "domain": "", "in_client": 0.0})  # an earlier round: ignored
                w.writerow({"round": 1, "client": c, "domain": ["mnist", "svhn"][c % 2], "in_client": a})
        recs.append(RunRecord(Entry(label, "fedproto"), {}, d, 0.0))
    spec = CompareSpec(methods=[r.entry for r in recs], layout="vpdr")
    t = VPDRLayout().table(recs, spec)
    assert t.header == ["mnist", "svhn", "AVG", "STD"]
    assert t.values[0][:3] == pytest.approx([0.7, 0.5, 0.6])
    assert t.values[0][3] == pytest.approx(math.sqrt((0.01 + 0.01 + 0.09 + 0.09) / 3))  # sample std (ddof 1) over clients
    assert t.ranks() == [[1, 0, 0, 0], [1, 1, 1, 1]]  # equal mnist: both marked; vpdr: better svhn and AVG, lower STD


def test_every_shipped_table_spec_builds(tmp_path):
    """benchmarks/tables/*.yaml: every run of every spec is a valid config (a renamed option fails here)."""
    from pathlib import Path

    from raysim.tools.compare import plan, spec_from_args

    specs = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "tables").glob("*.yaml"))
    assert specs
    for path in specs:
        spec, _ = spec_from_args([str(path)])
        runs = plan(spec, tmp_path / path.stem)
        assert len(runs) == len(spec.methods) * len(spec.cells())
    assert not any(tmp_path.iterdir())  # planning writes nothing


def test_table_caption_names_each_rows_privacy_and_the_methods_backbone(tmp_path):
    """The caption of a table whose rows differ in dp.epsilon (the VPDR ablation's no-LDP row) lists every
    level instead of the first row's, and a method with its own backbone is named by it, not model.name."""
    from raysim.build import build_config
    from raysim.tools.compare import RunRecord, describe

    recs = []
    for label, eps in (("no LDP", math.inf), ("IGPP", 1.0)):
        d = tmp_path / label.replace(" ", "_")
        d.mkdir()
        cfg = build_config({"method": "vpdr_fedproto", "data": {"dataset": "digits4", "partition": "domain"},
                            "train": {"num_clients": 4}, "dp": {"epsilon": eps},
                            "vpdr_fedproto": {"dcr": False}})
        (d / "config.yaml").write_text(cfg.to_yaml())
        recs.append(RunRecord(Entry(label, "vpdr_fedproto"), {}, d, 0.0))
    line = describe(recs, CompareSpec(methods=[r.entry for r in recs], layout="vpdr"))
    assert "dp.epsilon per row: 1 / no DP" in line
    assert "backbone raysim-vit" in line and "raysim-clip" not in line


def test_a_row_whose_config_the_grid_does_not_change_runs_once(tmp_path, capsys):
    """A no-DP row under a grid over dp.epsilon is the same run in every column: made once, read into each
    cell (the same numbers), counted once in the dry run's estimate; the DP row runs per column."""
    from raysim.tools.compare import main

    out = tmp_path / "cmp"
    args = [str(tmp_path / "spec.yaml"), "--rounds", "1", "--out", str(out), "--max-concurrent", "1", *TINY]
    (tmp_path / "spec.yaml").write_text(
        "methods:\n  - {label: nodp, method: promptfl, dp: {epsilon: .inf}}\n  - {label: dp, method: promptfl}\n"
        "grid: {dp.epsilon: [1.0, 2.0]}\n")
    assert main([*args, "--dry-run"]) == 0
    cap = capsys.readouterr()
    assert "3 runs for 4 cells" in cap.err and cap.out.count("the same run as nodp [epsilon=1.0] (made once)") == 1
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "made once" in err and "4 cells from 3 distinct runs" in err
    assert not (out / "epsilon_2.0" / "nodp").exists()  # nothing was run there
    rows = {r[0]: r[1:] for r in csv.reader(open(out / "table.csv"))}
    half = len(rows["nodp"]) // 2
    assert rows["nodp"][:half] == rows["nodp"][half:]  # one run's numbers, read into both epsilon columns
    # and again: the distinct runs are read back, the repeated one is still not made
    assert main(args) == 0
    again = capsys.readouterr().err
    assert again.count("done earlier") == 3 and "made once" in again
