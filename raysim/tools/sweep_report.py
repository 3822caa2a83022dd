"""A sweep's outputs in `<storage>/<name>/`: trials.csv and trials.md (one row per trial: swept values, final
In / Cross / HM as in summary.md, epsilon spent, wall time; then, when a setting has several trials, a
summary per setting: mean ± sample std and n) and hm_vs_<key>.png for every swept key but the seed.

`train.seed` in a sweep's space is a replicate axis: never an x axis; every plot draws, per setting, the
mean HM over the seeds with a ± std band (raysim/tools/sweep.py runs the sweep)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from raysim.config import get_dotted, merge_config, unflatten

if TYPE_CHECKING:
    import pandas

REPLICATE_KEYS = ("train.seed",)  # swept keys that are replicates of one setting, not settings


def setting_keys(spec: Mapping[str, Any]) -> list[str]:
    """The swept keys that make a setting (every swept key but the seed)."""
    return [k for k in spec["space"] if k not in REPLICATE_KEYS]

def _yaml_value(v: Any) -> Any:
    """'inf' / '.inf' in a sweep file mean infinity, as in config files."""
    if isinstance(v, str) and v.strip().lower() in ("inf", "+inf", ".inf", "infinity"):
        return math.inf
    return v


def trials_table(grid, spec: Mapping[str, Any]) -> "pandas.DataFrame":
    """One row per trial: swept values, final In / Cross / HM (summary.md's), epsilon spent, wall time."""
    import pandas as pd

    from raysim.metrics import summarize

    keys = list(spec["space"])
    rows = []
    for result in grid:
        cfg_flat = result.config or {}
        m = result.metrics or {}
        trial_dir = Path(result.path)
        run_dir = trial_dir / "run"
        row: dict[str, Any] = {"trial": trial_dir.name}
        for k in keys:
            row[k] = cfg_flat.get(k, math.nan)
        summary = {"in_client": m.get("summary_in_client", math.nan), "cross_client": m.get("summary_cross_client", math.nan),
                   "hm": m.get("summary_hm", math.nan)}
        rounds_done = int(m.get("round", -1)) + 1
        if (run_dir / "results.csv").is_file():  # the run's own files are the reference when readable here
            try:
                from raysim.config import load_yaml

                run_cfg = load_yaml(run_dir / "config.yaml", root=run_dir) if (run_dir / "config.yaml").is_file() else {}
                last = (run_cfg.get("eval") or {}).get("last", run_cfg.get("eval_last", 5))
                summary = summarize(run_dir / "results.csv", last=max(1, int(last)))
                rounds_done = len(pd.read_csv(run_dir / "results.csv"))
            except Exception:  # noqa: BLE001 - an empty results.csv of a trial that failed in round 0
                pass
        row.update({k: summary.get(k, math.nan) for k in ("in_client", "cross_client", "hm")})
        dp_eps = get_dotted(merge_config(spec["base"], unflatten(cfg_flat)), "dp.epsilon", math.inf)
        eps = m.get("epsilon_spent", math.nan)
        row["epsilon_spent"] = math.inf if not math.isfinite(_yaml_float(dp_eps)) else eps
        row["rounds_done"] = rounds_done
        row["wall_s"] = float(m.get("time_total_s", math.nan))
        rounds = get_dotted(merge_config(spec["base"], unflatten(cfg_flat)), "train.rounds", 10)
        row["status"] = "error" if result.error else ("completed" if rounds_done >= int(rounds) else "stopped")
        row["out_dir"] = str(run_dir)
        rows.append(row)
    df = pd.DataFrame(rows, columns=["trial", *keys, "in_client", "cross_client", "hm", "epsilon_spent", "rounds_done",
                                     "wall_s", "status", "out_dir"])
    return df.sort_values(by=keys + ["trial"], kind="stable", ignore_index=True) if len(df) else df


def _yaml_float(v: Any) -> float:
    try:
        return float(_yaml_value(v))
    except (TypeError, ValueError):
        return math.nan


def _fmt_cell(v: Any, pct: bool = False) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf"
        return f"{100 * v:.2f}" if pct else f"{v:.4g}"
    return str(v)


def markdown_table(df, spec: Mapping[str, Any]) -> str:
    keys = list(spec["space"])
    cols = ["trial", *keys, "in_client", "cross_client", "hm", "epsilon_spent", "rounds_done", "wall_s", "status"]
    heads = ["Trial", *keys, "In-Client", "Cross-Client", "HM", "epsilon spent", "rounds", "wall (s)", "status"]
    lines = [f"### Sweep {spec['name']}", ""]
    if spec.get("description"):
        lines += [str(spec["description"]).strip(), ""]
    lines += ["| " + " | ".join(heads) + " |", "|" + "|".join("---" if c in ("trial", "status") else "---:" for c in cols) + "|"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_fmt_cell(r[c], pct=c in ("in_client", "cross_client", "hm")) for c in cols) + " |")
    lines += ["", "Accuracies in %: mean of each trial's last evaluated rounds (as in its summary.md). "
              "epsilon spent: max over clients (inf = no DP)."]
    return "\n".join(lines) + "\n"


def plot_paths(exp_dir: Path, keys: Sequence[str]) -> dict[str, Path]:
    return {k: exp_dir / f"hm_vs_{k.replace('.', '_')}.png" for k in keys if k not in REPLICATE_KEYS}


def settings_table(df, spec: Mapping[str, Any]) -> "pandas.DataFrame":
    """One row per setting (the swept keys but the seed): In / Cross / HM mean and sample std (ddof 1, nan
    for one trial) over its trials, and n (trials with a result)."""
    import pandas as pd

    keys = setting_keys(spec)
    groups = df.groupby(keys, dropna=False, sort=True) if keys else [((), df)]
    rows = []
    for gkey, g in groups:
        gkey = gkey if isinstance(gkey, tuple) else (gkey,)
        row: dict[str, Any] = dict(zip(keys, gkey))
        for m in ("in_client", "cross_client", "hm"):
            vals = g[m].astype(float).dropna()
            row[f"{m}_mean"] = float(vals.mean()) if len(vals) else math.nan
            row[f"{m}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan
        row["n"] = int(g["hm"].astype(float).notna().sum())
        rows.append(row)
    return pd.DataFrame(rows, columns=[*keys, *(f"{m}_{s}" for m in ("in_client", "cross_client", "hm") for s in ("mean", "std")), "n"])


def _pm(mean: float, std: float) -> str:
    return _fmt_cell(mean, pct=True) + (f" ± {100 * std:.2f}" if not math.isnan(std) else "")


def settings_markdown(df, spec: Mapping[str, Any]) -> str:
    """The per-setting summary under trials.md's per-trial rows ("" when every setting has one trial)."""
    s = settings_table(df, spec)
    if not len(s) or int(s["n"].max()) < 2:
        return ""
    keys = setting_keys(spec)
    heads = [*keys, "In-Client", "Cross-Client", "HM", "n"]
    lines = ["", "#### Per setting (mean ± std over its trials)", "",
             "| " + " | ".join(heads) + " |", "|" + "|".join("---:" for _ in heads) + "|"]
    for _, r in s.iterrows():
        cells = [_fmt_cell(r[k]) for k in keys] + [_pm(r[f"{m}_mean"], r[f"{m}_std"]) for m in ("in_client", "cross_client", "hm")]
        lines.append("| " + " | ".join([*cells, str(int(r["n"]))]) + " |")
    replicate = [k for k in spec["space"] if k in REPLICATE_KEYS]
    over = f"the trials of each setting ({', '.join(replicate)} is a replicate axis)" if replicate else "the trials of each setting"
    lines += ["", f"Mean and sample std (ddof 1) over {over}; n = trials with a result."]
    return "\n".join(lines) + "\n"


def write_plots(df, spec: Mapping[str, Any], exp_dir: Path) -> list[Path]:
    """HM (%) against each swept key but the seed; one line per combination of the other setting keys: the
    mean over that setting's trials (its seeds), with a ± std band where it has several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = setting_keys(spec)
    written = []
    for key, path in plot_paths(exp_dir, keys).items():
        others = [k for k in keys if k != key]
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        vals = df[key].tolist()
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)
        uniq = sorted(set(vals), key=lambda v: (float(v) if numeric else str(v)))
        categorical = not numeric or any(math.isinf(float(v)) for v in uniq) or len(uniq) <= 8
        pos = {v: i for i, v in enumerate(uniq)}
        groups = df.groupby(others, dropna=False, sort=True) if others else [((), df)]
        for gkey, g in groups:
            order = pos  # bound now: the key function runs inside this iteration only
            g = g.sort_values(by=key, key=lambda s, order=order: s.map(order.__getitem__) if categorical else s)
            stats = g.groupby(key, sort=False)["hm"].agg(["mean", "std", "count"])  # over the seeds of each x
            x = [pos[v] for v in stats.index] if categorical else stats.index.astype(float)
            gkey = gkey if isinstance(gkey, tuple) else (gkey,)
            label = ", ".join(f"{k}={_fmt_cell(v)}" for k, v in zip(others, gkey)) or None
            line, = ax.plot(x, 100 * stats["mean"].astype(float), marker="o", label=label)
            if (stats["count"] > 1).any():
                sd = stats["std"].astype(float).fillna(0.0)
                ax.fill_between(x, 100 * (stats["mean"] - sd), 100 * (stats["mean"] + sd), color=line.get_color(), alpha=0.2)
        if categorical:
            ax.set_xticks(range(len(uniq)), [_fmt_cell(float(v)) if numeric else str(v) for v in uniq])
        elif min(float(v) for v in uniq) > 0 and spec["space"][key].get("loguniform"):
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel("HM (%)")
        seeds = [k for k in spec["space"] if k in REPLICATE_KEYS]
        ax.set_title(f"{spec['name']}: HM vs {key}" + (" (mean ± std over seeds)" if seeds else ""))
        ax.grid(alpha=0.3)
        if others and len(ax.get_lines()) <= 10:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def write_outputs(df, spec: Mapping[str, Any], exp_dir: Path) -> None:
    exp_dir.mkdir(parents=True, exist_ok=True)
    df.to_csv(exp_dir / "trials.csv", index=False)
    (exp_dir / "trials.md").write_text(markdown_table(df, spec) + (settings_markdown(df, spec) if len(df) else ""))
    if len(df):
        write_plots(df, spec, exp_dir)
