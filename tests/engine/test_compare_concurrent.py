"""`raysim compare` with seeds as replicates (mean ± std, n) and its runs as concurrent Ray tasks: the
concurrent table, fresh or resumed from a partly done folder, is bitwise the sequential one."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from raysim.tools.compare import CompareSpec, Entry, RunRecord, grid_table, main, plan, spec_from_args

TINY = ["data.dataset=digits", "data.shots=8", "model.name=raysim-tiny", "model.pretrained=", "train.num_clients=2",
        "train.n_ctx=4", "eval.every=1", "eval.last=1", "execution.backend=inline", "execution.num_threads=1",
        "output.tensorboard=false"]
ACCURACY = ("round", "in_client", "cross_client", "hm", "train_loss")  # results.csv columns (not the wall times)


def test_seeds_give_one_folder_per_replicate_and_one_seed_keeps_todays_layout(tmp_path):
    spec, _ = spec_from_args(["--methods", "zeroshot,promptfl", "--seeds", "1,2,3", "--rounds", "1", *TINY])
    runs = plan(spec, tmp_path)
    assert [(e.label, cfg.train.seed, f.relative_to(tmp_path).as_posix()) for _, e, f, cfg in runs][:3] == [
        ("zeroshot", 1, "zeroshot/seed-1"), ("zeroshot", 2, "zeroshot/seed-2"), ("zeroshot", 3, "zeroshot/seed-3")]
    assert len(runs) == 6
    one, _ = spec_from_args(["--methods", "promptfl", "--seeds", "7", *TINY])
    (_, _, folder, cfg), = plan(one, tmp_path)
    assert folder == tmp_path / "promptfl" and cfg.train.seed == 7  # a single seed: the folder of today's tables
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("methods: [promptfl]\nseeds: [4, 5]\n")
    from_file, _ = spec_from_args([str(spec_file), *TINY])
    assert from_file.seeds == [4, 5]
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="repeats"):
        spec_from_args(["--methods", "promptfl", "--seeds", "1,1", *TINY])


def test_cells_are_mean_and_sample_std_over_seeds(tmp_path):
    """Worked value: seeds at 50 / 60 / 70 % -> 60.00 ± 10.00 (sample std, ddof 1: sqrt((100+0+100)/2) = 10).
    Marks use the means: B's best seed (90 %) beats A's, yet A's mean (60) beats B's (55)."""
    scores = {("A", 1): 0.5, ("A", 2): 0.6, ("A", 3): 0.7, ("B", 1): 0.9, ("B", 2): 0.3, ("B", 3): 0.45}
    entries = [Entry("A", "a"), Entry("B", "b")]
    recs = [RunRecord(e, {}, tmp_path / f"{e.label}{s}", 0.0, seed=s) for e in entries for s in (1, 2, 3)]
    spec = CompareSpec(methods=entries, seeds=[1, 2, 3])
    t = grid_table(recs, spec, ["HM"], lambda r: {"HM": scores[(r.entry.label, r.seed)]}, marks="rank2")
    assert t.values[0][0] == pytest.approx(0.6) and t.stds[0][0] == pytest.approx(0.1) and t.ns == [[3], [3]]
    assert t.values[1][0] == pytest.approx(0.55)
    assert t.stds[1][0] == pytest.approx(math.sqrt(((0.35) ** 2 + 0.25 ** 2 + 0.1 ** 2) / 2))
    assert t.ranks() == [[1], [2]]
    md = t.markdown()
    assert "**60.00 ± 10.00**" in md and "<u>55.00 ± 31.22</u>" in md and "over 3 seeds" in md
    t.write_csv(tmp_path / "t.csv")
    rows = list(csv.reader(open(tmp_path / "t.csv")))
    assert rows[0] == ["method", "HM mean", "HM std", "HM n"] and rows[1] == ["A", "60.0000", "10.0000", "3"]
    # a cell with one seed missing says n=, one seed only has no ±
    t2 = grid_table(recs[:5], spec, ["HM"], lambda r: {"HM": scores[(r.entry.label, r.seed)]})
    assert t2.ns == [[3], [2]] and "(n=2)" in t2.markdown()
    single = grid_table(recs[:1], CompareSpec(methods=entries[:1]), ["HM"], lambda r: {"HM": 0.5})
    assert not single.replicated and "±" not in single.markdown()


def test_vpdr_layout_keeps_std_across_clients_and_adds_the_seed_spread(tmp_path):
    from raysim.tools.compare import VPDRLayout

    recs = []
    for seed, accs in ((1, [0.5, 0.7]), (2, [0.7, 0.7])):
        d = tmp_path / f"seed-{seed}"
        d.mkdir()
        with open(d / "client_results.csv", "w", newline="") as f:
            w = csv.DictWriter(f, ["round", "client", "domain", "in_client"])
            w.writeheader()
            for c, a in enumerate(accs):
                w.writerow({"round": 0, "client": c, "domain": "", "in_client": a})
        recs.append(RunRecord(Entry("fedproto", "fedproto"), {}, d, 0.0, seed=seed))
    t = VPDRLayout().table(recs, CompareSpec(methods=[recs[0].entry], layout="vpdr", seeds=[1, 2]))
    assert t.header == ["all", "AVG", "STD"]
    # AVG per seed 0.6 and 0.7; STD over clients per seed sqrt(0.02) and 0: the STD column is their mean
    assert t.values[0][1] == pytest.approx(0.65) and t.stds[0][1] == pytest.approx(math.sqrt(0.005))
    assert t.values[0][2] == pytest.approx(math.sqrt(0.02) / 2)
    assert "spread across seeds" in t.markdown()


def table_and_results(out: Path) -> tuple[list[list[str]], dict[str, list[tuple[str, ...]]]]:
    """table.csv as strings, and every run's results.csv accuracy columns as written (bitwise floats)."""
    table = list(csv.reader(open(out / "table.csv")))
    results = {}
    for path in sorted(out.rglob("results.csv")):
        with open(path, newline="") as f:
            results[path.parent.relative_to(out).as_posix()] = [tuple(r[k] for k in ACCURACY) for r in csv.DictReader(f)]
    return table, results


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    out = tmp_path_factory.mktemp("seq") / "cmp"
    args = ["--methods", "zeroshot,promptfl", "--seeds", "1,2", "--rounds", "2", "--out", str(out), *TINY]
    assert main([*args, "--max-concurrent", "1"]) == 0
    return args, out, table_and_results(out)


def test_concurrent_table_is_bitwise_the_sequential_one(ray_session, sequential, tmp_path, capsys):
    args, seq_out, (table, results) = sequential
    out = tmp_path / "cmp"
    args = [a if a != str(seq_out) else str(out) for a in args]
    assert main([*args, "--max-concurrent", "2"]) == 0
    err = capsys.readouterr().err
    assert "4 runs on the Ray cluster, up to 2 at once" in err and err.count("done]") == 4
    got_table, got_results = table_and_results(out)
    assert len(results) == 4 and got_results == results
    assert got_table == table and table[0][:4] == ["method", "In-Client mean", "In-Client std", "In-Client n"]
    assert "2 seeds (1, 2; mean ± std)" in (out / "table.md").read_text()


def test_a_resumed_concurrent_table_equals_the_sequential_one(ray_session, sequential, tmp_path, capsys):
    """zeroshot finished earlier (read back), promptfl stopped after round 1 of 2 (resumed), all on Ray."""
    args, seq_out, (table, results) = sequential
    out = tmp_path / "cmp"
    args = [a if a != str(seq_out) else str(out) for a in args]
    zeroshot = [a if a != "zeroshot,promptfl" else "zeroshot" for a in args]
    assert main([*zeroshot, "--max-concurrent", "1"]) == 0
    promptfl = [a if a != "zeroshot,promptfl" else "promptfl" for a in args]
    promptfl[promptfl.index("--rounds") + 1] = "1"
    assert main([*promptfl, "--max-concurrent", "1"]) == 0
    capsys.readouterr()
    assert main([*args, "--max-concurrent", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count("done earlier") == 2 and err.count("resuming") == 2 and "2 runs on the Ray cluster" in err
    got_table, got_results = table_and_results(out)
    assert got_results == results and got_table == table


def test_each_run_reserves_what_it_needs_and_the_progress_line_reads_its_round(tmp_path):
    """An inline run: execution.num_threads CPUs in one bundle; a Ray-backend run: a placement group of a
    small bundle for its task, the server's (when it reserves anything) and one per client actor. The one
    progress line names each running run's latest round from its results.csv."""
    from raysim.build import build_config
    from raysim.tools.compare_ray import Progress, run_bundles, runs_that_fit

    inline = build_config({"execution": {"backend": "inline", "num_threads": 2}})
    assert run_bundles(inline, {"CPU": 8.0}) == [{"CPU": 2.0}]
    ray_run = build_config({"train": {"num_clients": 4},
                            "execution": {"backend": "ray", "num_actors": 2, "client_cpus": 0.5, "server_cpus": 1}})
    assert run_bundles(ray_run, {"CPU": 8.0}) == [{"CPU": 0.01}, {"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}]
    assert runs_that_fit(run_bundles(inline, {"CPU": 5.0}), {"CPU": 5.0}) == 2
    assert runs_that_fit(run_bundles(ray_run, {"CPU": 2.0}), {"CPU": 2.0}) == 0
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.csv").write_text("round,hm\n0,0.5\n1,0.6\n")
    cfg = build_config({"train": {"rounds": 5}, "output": {"out_dir": str(run)}})
    lines: list[str] = []
    p = Progress(3, {0: "promptfl seed 1"}, lines.append, tty=False)
    assert p.line(1, {0: cfg}, 1) == "compare: 1/3 done, 1 running (promptfl seed 1 r2/5), 1 queued"
    p.show(1, {0: cfg}, 1)
    assert lines == []  # not a terminal: only the start / finish log lines, no redrawn line


def test_a_ray_backend_run_places_its_actors_in_its_placement_group(ray_session, tmp_path):
    """A Ray-backend run of a concurrent table reserves a placement group (as a sweep trial) and its client
    actors are created inside it; the table is the one of the same run made in this process."""
    from test_tune import client_actor_groups

    args = ["--methods", "promptfl", "--rounds", "1", *[a for a in TINY if not a.startswith("execution.backend")],
            "execution.backend=ray", "execution.num_actors=1", "execution.client_cpus=0.5"]
    before = len(client_actor_groups())
    assert main([*args, "--out", str(tmp_path / "ray"), "--max-concurrent", "2"]) == 0
    placed = client_actor_groups()[before:]
    assert len(placed) == 1 and placed[0], placed  # one client actor, inside a placement group
    assert main([*args, "--out", str(tmp_path / "here"), "--max-concurrent", "1"]) == 0
    assert table_and_results(tmp_path / "ray") == table_and_results(tmp_path / "here")


@pytest.mark.parametrize("cpus", [2.0, 8.0])
def test_a_ray_backend_run_with_num_actors_0_fits_next_to_its_own_task(tmp_path, cpus):
    """A table's Ray-backend run is itself a Ray task holding a small bundle: with num_actors=0 (the default) its
    actors are counted from what is left beside that bundle and fixed in the run's config, so its placement group
    fits the cluster (planned from the whole cluster, as a plain run would, it never fits: `raysim compare` on
    the default backend refused every table of at least as many clients as CPUs)."""
    from raysim.tools.compare_ray import MIN_BUNDLE_CPU, pool_for_task, run_bundles, runs_that_fit

    spec, _ = spec_from_args(["--methods", "promptfl", *[a for a in TINY if not a.startswith("execution.backend")],
                              "execution.backend=ray", "train.num_clients=10"])
    (_, _, _, cfg), = plan(spec, tmp_path)
    assert cfg.execution.num_actors == 0 and cfg.execution.client_cpus == 1.0
    cluster = {"CPU": cpus}
    assert runs_that_fit(run_bundles(cfg, cluster), cluster) == 0  # the whole cluster's actors plus the task's bundle
    fixed = pool_for_task(cfg, cluster)
    assert fixed.execution.num_actors == int(cpus) - 1  # 2 CPUs: 1 actor; 8: 7
    bundles = run_bundles(fixed, cluster)
    assert bundles[0] == {"CPU": MIN_BUNDLE_CPU} and runs_that_fit(bundles, cluster) == 1
    inline = pool_for_task(plan(spec_from_args(["--methods", "promptfl", *TINY])[0], tmp_path)[0][3], cluster)
    assert inline.execution.num_actors == 0  # an inline run is not changed
