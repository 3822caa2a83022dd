"""Ray Tune sweeps (raysim.tools.sweep): sweep-file validation, and a 2x2 sweep of a tiny federation on 2 cores."""

from __future__ import annotations

import glob
import math
import os
from pathlib import Path

import pytest

from raysim.errors import ConfigError
from raysim.tools.sweep import load_sweep, trial_bundles, trials_that_fit, validate_sweep

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "sweeps" / "smoke.yaml"


def smoke_spec(tmp_path, cache_dir, name="smoke"):
    return load_sweep(SMOKE, [f"storage={tmp_path / 'sweeps'}", f"name={name}", f"output.cache_dir={cache_dir}"])


# ---------------------------------------------------------------- validation (no Ray)


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "sweeps" / "*.yaml"))), ids=os.path.basename)
def test_shipped_sweeps_validate(path):
    spec = validate_sweep(load_sweep(path))
    assert spec["space"] and spec["metric"] in ("hm",)


def test_shipped_sweeps_cover_the_studies():
    spaces = {Path(p).stem: validate_sweep(load_sweep(p))["space"] for p in glob.glob(str(ROOT / "sweeps" / "*.yaml"))}
    assert spaces["epsilon"]["dp.epsilon"]["grid"] == [0.25, 0.5, 0.75, 1.0, math.inf]
    assert spaces["beta"]["data.beta"]["grid"] == [0.1, 0.3, 0.5]
    assert "fedsept.rank" in spaces["rank"] and "fedsept.experts" in spaces["experts"]


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"spaces": {}}, "unknown sweep key 'spaces'. Did you mean 'space'"),
        ({"base": {"round": 2}}, "unknown config key 'round'"),
        ({"space": {"dp.epsilonn": {"grid": [1.0]}}}, "dp.epsilonn"),
        ({"space": {"data.beta": {"grid": [-1.0]}}}, "beta must be a positive number"),
        ({"space": {"data.beta": {"range": [0.1, 0.5]}}}, "must be one of"),
        ({"space": {"train.lr": {"loguniform": [0.0, 1.0]}}}, "lo > 0"),
        ({"space": {"train.lr": {"uniform": [0.5, 0.1]}}}, "lo < hi"),
        ({"metric": "accuracy"}, "metric must be one of"),
        ({"asha": {"grace": 1}}, "unknown asha key 'grace'"),
        ({"base": {"output": {"out_dir": "x"}}}, "set per trial"),
        ({"base": {"execution": {"num_actors": 0}}}, "fixed number of client actors"),
        ({"num_samples": 0}, "num_samples"),
    ],
)
def test_bad_sweep_files_are_rejected(bad, match):
    spec = {"base": {"execution": {"num_actors": 1}, "train": {"rounds": 2}}, "space": {"train.seed": {"grid": [1, 2]}}}
    for k, v in bad.items():
        spec[k] = {**spec[k], **v} if k == "base" else v
    with pytest.raises(ConfigError, match=match):
        validate_sweep(spec)


def test_overrides_go_to_sweep_or_base():
    spec = load_sweep(SMOKE, ["name=x", "train.rounds=3", "dp.delta=1e-6", "--resume"])
    assert spec["name"] == "x" and spec["restore"] is True
    assert spec["base"]["train"]["rounds"] == 3 and float(spec["base"]["dp"]["delta"]) == 1e-6  # moved into its section


def test_placement_group_bundles():
    # driver + one bundle per client actor; the server bundle only when it reserves something
    b = trial_bundles({"train": {"num_clients": 4}, "execution": {"num_actors": 2, "client_cpus": 0.5, "client_gpus": 0.25}})
    assert b == [{"CPU": 0.01}, {"CPU": 0.5, "GPU": 0.25}, {"CPU": 0.5, "GPU": 0.25}]
    b = trial_bundles({"train": {"num_clients": 3}, "execution": {"placement": "actor_per_client", "client_cpus": 0, "server_cpus": 1}})
    assert b == [{"CPU": 0.01}, {"CPU": 1.0}] + [{"CPU": 0.01}] * 3
    assert trial_bundles({"execution": {"num_actors": 1, "client_gpus": 0.5}}, has_gpu=False)[1] == {"CPU": 1.0}
    assert trials_that_fit([{"CPU": 0.01}, {"CPU": 0.5}], {"CPU": 2.0}) == 3
    assert trials_that_fit([{"CPU": 0.01}, {"CPU": 0.5, "GPU": 0.5}], {"CPU": 8.0, "GPU": 1.0}) == 2


# ---------------------------------------------------------------- the 2x2 sweep (Ray, 2 cores)


def client_actor_groups() -> list[str]:
    """Placement group id (hex, "" = none) of every ClientHost actor the GCS knows, oldest first."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    rows = [gcs_pb2.ActorTableData.FromString(b) for b in state._connect_and_get_accessor().get_actor_table(None, None)]
    rows = sorted((r for r in rows if r.class_name.endswith("ClientHost")), key=lambda r: r.start_time)
    nil = bytes(len(rows[0].placement_group_id)) if rows else b""
    return [r.placement_group_id.hex() if r.placement_group_id and r.placement_group_id != nil else "" for r in rows]


def test_smoke_sweep_2x2(ray_session, tmp_path, cache_dir):
    import pandas as pd
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raysim.tools.sweep import run_sweep

    spec = smoke_spec(tmp_path, cache_dir)
    df = run_sweep(spec, verbose=0)
    exp = Path(df.attrs["exp_dir"])
    # every trial ran to the end: none errored, none left pending
    assert df.attrs["num_errors"] == 0 and df.attrs["num_terminated"] == 4
    assert len(df) == 4 and set(df["status"]) == {"completed"} and set(df["rounds_done"]) == {2}
    assert sorted(zip(df["data.beta"], df["train.seed"])) == [(0.3, 1), (0.3, 2), (0.5, 1), (0.5, 2)]
    assert df[["in_client", "cross_client", "hm"]].notna().all().all()
    assert (df["epsilon_spent"] == math.inf).all() and (df["wall_s"] > 0).all()
    # rows on disk, the Markdown table and one plot per swept key
    csv = pd.read_csv(exp / "trials.csv")
    assert len(csv) == 4 and {"data.beta", "train.seed", "in_client", "cross_client", "hm", "epsilon_spent", "wall_s"} <= set(csv)
    md = (exp / "trials.md").read_text()
    assert md.count("| completed |") == 4 and "HM" in md
    per_setting = [line for line in md.split("Per setting (mean ± std")[1].splitlines() if line.startswith("| 0.")]
    assert len(per_setting) == 2 and all(line.endswith(" | 2 |") for line in per_setting)  # a row per beta, n = 2 seeds
    png = exp / "hm_vs_data_beta.png"  # the seed is a replicate axis: no hm_vs_train_seed.png
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (exp / "hm_vs_train_seed.png").exists()
    # each trial's federation wrote the plain-run layout inside its trial folder, TensorBoard included
    for out_dir in df["out_dir"]:
        run = Path(out_dir)
        assert run.parent.parent == exp and (run / "summary.md").is_file() and (run / "results.csv").is_file()
        acc = EventAccumulator(str(run / "tensorboard"))
        acc.Reload()
        assert {"accuracy/hm", "accuracy/in_client", "train/loss", "final/hm"} <= set(acc.Tags()["scalars"])
        assert "_hparams_/session_start_info" in acc.summary_metadata
        # Tune's own per-trial TensorBoard: the reported metric per round and the swept hparams
        tacc = EventAccumulator(str(run.parent))
        tacc.Reload()
        assert len(tacc.Scalars("ray/tune/hm")) == 2
        assert "_hparams_/session_start_info" in tacc.summary_metadata
    # the trial's client actors were reserved inside the trial's placement group (captured by Tune)
    placed = client_actor_groups()
    assert len(placed) >= 4 and all(placed[-4:]), placed
    # a finished experiment restores (nothing left to run) and rewrites the same table
    again = run_sweep(spec, restore=True, verbose=0)
    assert len(again) == 4 and again.attrs["num_errors"] == 0
    with pytest.raises(ConfigError, match="already holds an experiment"):
        run_sweep(spec, verbose=0)


def test_asha_stops_weak_trials_early(ray_session, tmp_path, cache_dir):
    """ASHA (grace period 1, halving) ends the worse trials after their first rounds; every trial still
    gets its row, with how many rounds it ran."""
    from raysim.tools.sweep import run_sweep

    spec = smoke_spec(tmp_path, cache_dir, name="asha")
    spec["base"]["train"]["rounds"] = 3
    spec["asha"] = {"max_t": 3, "grace_period": 1, "reduction_factor": 2}
    df = run_sweep(spec, verbose=0)
    assert len(df) == 4 and df.attrs["num_errors"] == 0
    assert (df["status"] == "stopped").any() and (df["rounds_done"] < 3).any()
    assert (df["rounds_done"] == 3).any()  # the best trial runs to the end


def test_trial_grid_gives_each_corner_its_own_nested_value():
    """The resource check sees every value of a nested space key (dp.epsilon), not the last one for all:
    a base with a dp section of its own must not be shared between the corners."""
    from raysim.tools.sweep import _trial_grid

    corners = _trial_grid({"dp": {"delta": 1e-5}}, {"dp.epsilon": {"grid_search": [1.0, 2.0, 4.0]}})
    assert [c["dp"]["epsilon"] for c in corners] == [1.0, 2.0, 4.0]
    assert all(c["dp"]["delta"] == 1e-5 for c in corners)


def test_seed_is_a_replicate_axis_in_the_sweep_report(tmp_path, monkeypatch):
    """A swept train.seed is never an x axis: the plots draw the mean over the seeds with a ± std band,
    and trials.md gets a per-setting mean ± std (n). Worked value: HM 50 / 70 % -> 60.00 ± 14.14."""
    import pandas as pd
    from matplotlib.axes import Axes

    from raysim.tools.sweep_report import settings_table, write_outputs

    rows = [{"trial": f"t{i}", "data.beta": b, "train.seed": s, "in_client": hm, "cross_client": hm, "hm": hm,
             "epsilon_spent": math.inf, "rounds_done": 2, "wall_s": 1.0, "status": "completed", "out_dir": ""}
            for i, (b, s, hm) in enumerate([(0.3, 1, 0.5), (0.3, 2, 0.7), (0.5, 1, 0.4), (0.5, 2, 0.4)])]
    df = pd.DataFrame(rows)
    spec = {"name": "s", "space": {"data.beta": {"grid": [0.3, 0.5]}, "train.seed": {"grid": [1, 2]}}}
    s = settings_table(df, spec)
    assert list(s["data.beta"]) == [0.3, 0.5] and list(s["n"]) == [2, 2]
    assert s["hm_mean"].tolist() == pytest.approx([0.6, 0.4])
    assert s["hm_std"].tolist() == pytest.approx([math.sqrt(0.02), 0.0])  # sample std (ddof 1) of 0.5, 0.7
    bands, lines = [], []
    real_fill, real_plot = Axes.fill_between, Axes.plot
    monkeypatch.setattr(Axes, "fill_between",
                        lambda self, x, lo, hi, **kw: bands.append((list(lo), list(hi))) or real_fill(self, x, lo, hi, **kw))
    monkeypatch.setattr(Axes, "plot", lambda self, x, y, **kw: lines.append(list(y)) or real_plot(self, x, y, **kw))
    write_outputs(df, spec, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["hm_vs_data_beta.png"]
    assert lines == [pytest.approx([60.0, 40.0])]  # one line: the means over the seeds
    assert bands[0][0] == pytest.approx([60 - 100 * math.sqrt(0.02), 40.0])
    md = (tmp_path / "trials.md").read_text()
    assert "| 0.3 | 60.00 ± 14.14 | 60.00 ± 14.14 | 60.00 ± 14.14 | 2 |" in md
