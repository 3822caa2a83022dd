"""Ray Tune sweeps: `raysim sweep SWEEP.yaml [key=value ...]` (also `python raysim/run.py --sweep ...`).

A sweep file::

    name: epsilon                 # experiment folder <storage>/<name>
    storage: runs/sweeps          # default
    base: {method: promptfl, rounds: 20, num_actors: 2, dp: {delta: 1.0e-5}}
    space:                        # any config key, dotted for sections
      dp.epsilon: {grid: [0.25, 0.5, 0.75, 1.0, inf]}
      seed: {choice: [1, 2, 3]}   # also {uniform: [lo, hi]}, {loguniform: [lo, hi]}
    num_samples: 1                # samples of the random keys (grid keys are crossed with them)
    metric: hm                    # reported once per round; mode: max
    asha: {max_t: 20, grace_period: 10, reduction_factor: 2}   # optional early stopping
    max_concurrent: null          # default: as many trials as the cluster can hold
    restore: false                # true (or --resume): continue the experiment with Tuner.restore

One trial is one federation (raysim.engine.loop.run) whose ServerActor and ClientActors live in the trial's
placement group: one small bundle for the trial driver, one for the server (when it reserves resources)
and one per client actor, so a trial starts only when all of its actors fit, and never deadlocks.
The run's out_dir is `<trial dir>/run` (results.csv, summary.md, tensorboard/ as for a plain run).

Outputs in `<storage>/<name>/`: trials.csv and trials.md (one row per trial: swept values, final In /
Cross / HM as in summary.md, epsilon spent, wall time, and a per-setting mean ± std when a setting has several
trials) and hm_vs_<key>.png for every swept key but train.seed, a replicate axis: each plot draws the mean
over the seeds with a ± std band (raysim/tools/sweep_report.py).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

if TYPE_CHECKING:
    import pandas

from raysim.build import build_config
from raysim.config import (
    RunConfig,
    load_yaml,
    merge_config,
    move_flat_key,
    move_flat_keys,
    parse_overrides,
    set_dotted,
    unflatten,
)
from raysim.engine.cluster import init_ray, plan_hosts
from raysim.errors import ConfigError, shown
from raysim.tools.sweep_report import _yaml_value, markdown_table, plot_paths, trials_table, write_outputs, write_plots  # noqa: F401

log = logging.getLogger(__name__)

SWEEP_KEYS = (
    "name", "description", "storage", "base", "space", "num_samples", "metric", "mode", "asha",
    "max_concurrent", "restore",
)
DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform")
ASHA_KEYS = ("max_t", "grace_period", "reduction_factor")
# what each trial reports per round (tune.report); `metric` must be one of these
METRICS = (
    "hm", "in_client", "cross_client", "train_loss", "epsilon_max", "bytes_up", "bytes_down", "seconds",
    "summary_hm", "summary_in_client", "summary_cross_client",
)
# config keys a sweep sets itself, per trial
TRIAL_OWNED = ("out_dir", "resume")
MIN_BUNDLE_CPU = 0.01  # Ray rejects empty bundles; the trial driver mostly waits on its actors
MAX_SWEEP_VALUES = 10_000  # values of one swept key, and num_samples: each value is checked as a config here
TABLE_METRICS = ("in_client", "cross_client", "hm", "epsilon_spent", "rounds_done", "wall_s")


# --------------------------------------------------------------------------------------------
# sweep file -> validated spec

def _did_you_mean(key: str, choices: Sequence[str]) -> str:
    hint = difflib.get_close_matches(key, list(choices), n=1)
    return f" Did you mean {hint[0]!r}?" if hint else ""


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool):
        raise ConfigError(f"{what} must be a number, got {shown(v)}")
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{what} must be a number, got {shown(v)}") from None


def validate_sweep(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Check a sweep spec at the edge; return it with defaults filled in. Raises ConfigError."""
    out = _with_defaults(spec)
    base, cfg = _check_base(out["base"])
    clean_space = _check_space(base, out["space"])
    out["base"], out["space"] = base, clean_space
    _check_objective(out)
    if out["asha"] is not None:
        swept = _space_values(clean_space, "train.rounds")  # swept keys are at their sectioned place by now
        rounds = max([cfg.train.rounds] + [int(v) for v in swept])
        out["asha"] = _check_asha(out["asha"], rounds)
    _check_run_keys(out)
    _check_fixed_hosts(base, clean_space)
    return out


def _with_defaults(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The sweep keys of `spec` (unknown ones refused) over the defaults."""
    if not isinstance(spec, Mapping):
        raise ConfigError("a sweep file must hold a mapping with base: and space:")
    for key in spec:
        if key not in SWEEP_KEYS:
            raise ConfigError(
                f"unknown sweep key {shown(key)}.{_did_you_mean(str(key)[:100], SWEEP_KEYS)} "
                f"Valid sweep keys: {', '.join(SWEEP_KEYS)} (config keys go under base: or space:)."
            )
    out: dict[str, Any] = {
        "name": "sweep", "description": "", "storage": "runs/sweeps", "base": {}, "space": {}, "num_samples": 1,
        "metric": "hm", "mode": "max", "asha": None, "max_concurrent": None, "restore": False,
    }
    out.update({k: v for k, v in spec.items() if v is not None or k in ("asha", "max_concurrent")})
    return out


def _check_base(base: Any) -> tuple[dict[str, Any], RunConfig]:
    """base: as config values ('inf' read as infinity), and the config it builds."""
    base = base or {}
    if not isinstance(base, Mapping):
        raise ConfigError(f"base: must be a mapping of config keys (e.g. method: promptfl), got {shown(base)}")
    base = move_flat_keys({k: _yaml_value(v) for k, v in base.items()})
    for k in TRIAL_OWNED:
        if (base.get("output") or {}).get(k):
            raise ConfigError(f"base: {k} is set per trial by the sweep (each trial writes to <trial dir>/run); remove it")
    return base, build_config(base)  # unknown keys / bad values in base


def _check_space(base: Mapping[str, Any], space: Any) -> dict[str, dict[str, list[Any]]]:
    if not isinstance(space, Mapping) or not space:
        raise ConfigError(
            "space: must map at least one config key to {grid: [...]}, {choice: [...]}, {uniform: [lo, hi]} or {loguniform: [lo, hi]}"
        )
    # a swept key is user input: an old flat key (rounds) is checked as written, then kept at its place now (train.rounds)
    return {move_flat_key(str(key)): _check_dimension(base, str(key), dist) for key, dist in space.items()}


def _check_dimension(base: Mapping[str, Any], key: str, dist: Any) -> dict[str, list[Any]]:
    """One swept key: {kind: values}, every value (both bounds of a range) making a valid config."""
    if key.split(".")[0] in TRIAL_OWNED:
        raise ConfigError(f"space: {key} is set per trial by the sweep and cannot be swept")
    if not isinstance(dist, Mapping) or len(dist) != 1 or next(iter(dist)) not in DISTRIBUTIONS:
        raise ConfigError(
            f"space: {key} must be one of {{grid: [...]}}, {{choice: [...]}}, {{uniform: [lo, hi]}}, "
            f"{{loguniform: [lo, hi]}}; got {shown(dist)}"
        )
    kind, values = next(iter(dist.items()))
    if not isinstance(values, (list, tuple)) or not values:
        raise ConfigError(f"space: {key}.{kind} must be a non-empty list, got {shown(values)}")
    if len(values) > MAX_SWEEP_VALUES:
        raise ConfigError(f"space: {key}.{kind} lists {len(values):,} values; a sweep takes at most {MAX_SWEEP_VALUES:,} per key")
    values = [_yaml_value(v) for v in values]
    if kind in ("uniform", "loguniform"):
        values = _check_range(key, kind, values)
    for v in values:  # every value must make a valid config (unknown key, wrong type, out of range)
        trial = merge_config(base, {})
        set_dotted(trial, key, v)
        try:
            build_config(trial)
        except ConfigError as e:
            raise ConfigError(f"space: {key}={shown(v)}: {e}") from None
    return {kind: values}


def _check_range(key: str, kind: str, values: list[Any]) -> list[float]:
    if len(values) != 2:
        raise ConfigError(f"space: {key}.{kind} takes [lo, hi], got {shown(values)}")
    lo, hi = (_number(v, f"space: {key}.{kind} bound") for v in values)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ConfigError(f"space: {key}.{kind} needs finite lo < hi, got {shown(values)}")
    if kind == "loguniform" and lo <= 0:
        raise ConfigError(f"space: {key}.loguniform needs lo > 0, got {lo}")
    return [lo, hi]


def _check_objective(out: Mapping[str, Any]) -> None:
    if not isinstance(out["num_samples"], int) or isinstance(out["num_samples"], bool) or out["num_samples"] < 1:
        raise ConfigError(f"num_samples must be an integer >= 1, got {shown(out['num_samples'])}")
    if out["num_samples"] > MAX_SWEEP_VALUES:
        raise ConfigError(f"num_samples is at most {MAX_SWEEP_VALUES:,}, got {out['num_samples']:,}")
    if not isinstance(out["metric"], str) or out["metric"] not in METRICS:
        raise ConfigError(f"metric must be one of {', '.join(METRICS)}, got {shown(out['metric'])}")
    if not isinstance(out["mode"], str) or out["mode"] not in ("max", "min"):
        raise ConfigError(f"mode must be max or min, got {shown(out['mode'])}")


def _check_asha(asha: Any, rounds: int) -> dict[str, Any]:
    """asha: over its defaults (max_t = the most rounds a trial runs), checked."""
    if not isinstance(asha, Mapping):
        raise ConfigError("asha: must be a mapping with max_t, grace_period, reduction_factor")
    for k in asha:
        if k not in ASHA_KEYS:
            raise ConfigError(f"unknown asha key {shown(k)}.{_did_you_mean(str(k)[:100], ASHA_KEYS)} Valid: {', '.join(ASHA_KEYS)}")
    asha = {"max_t": rounds, "grace_period": 1, "reduction_factor": 2, **asha}
    for k in ASHA_KEYS:
        v = asha[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1:
            raise ConfigError(f"asha.{k} must be a number >= 1, got {shown(v)}")
    if asha["grace_period"] > asha["max_t"]:
        raise ConfigError(f"asha.grace_period ({asha['grace_period']}) must be <= asha.max_t ({asha['max_t']})")
    if asha["reduction_factor"] <= 1:
        raise ConfigError(f"asha.reduction_factor must be > 1, got {asha['reduction_factor']}")
    return {"max_t": int(asha["max_t"]), "grace_period": int(asha["grace_period"]),
            "reduction_factor": float(asha["reduction_factor"])}


def _check_run_keys(out: dict[str, Any]) -> None:
    """max_concurrent, restore and name (made a plain string, as storage)."""
    mc = out["max_concurrent"]
    if mc is not None and (isinstance(mc, bool) or not isinstance(mc, int) or mc < 1):
        raise ConfigError(f"max_concurrent must be an integer >= 1 (or null for what the cluster holds), got {shown(mc)}")
    if not isinstance(out["restore"], bool):
        raise ConfigError(f"restore must be true or false, got {shown(out['restore'])}")
    for key in ("name", "storage", "description"):
        if not isinstance(out[key], (str, int, float)) or isinstance(out[key], bool):
            raise ConfigError(f"{key} must be a string, got {shown(out[key])}")
    name = str(out["name"])
    if not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"name must be a plain folder name, got {shown(name)}")
    out["name"], out["storage"] = name, str(out["storage"])


def _check_fixed_hosts(base: Mapping[str, Any], space: Mapping[str, Mapping[str, list[Any]]]) -> None:
    """Inside a trial the number of client actors is fixed by the config, never by the cluster size."""
    for values in _trial_grid(base, space):
        c = build_config(values)
        if c.execution.backend == "ray" and c.execution.placement == "pooled" and c.execution.num_actors == 0:
            raise ConfigError(
                "a sweep needs a fixed number of client actors per trial: set num_actors (e.g. base: {execution: {num_actors: 2}}) "
                "or placement: actor_per_client"
            )


def _space_values(space: Mapping[str, Mapping[str, list[Any]]], key: str) -> list[Any]:
    dist = space.get(key)
    if not dist:
        return []
    kind, values = next(iter(dist.items()))
    return list(values)


def _trial_grid(base: Mapping[str, Any], space: Mapping[str, Mapping[str, list[Any]]]) -> list[dict[str, Any]]:
    """Configs at the corners of the space (every listed value, both bounds): for resource checks."""
    import copy
    import itertools

    keys = list(space)
    out = []
    for combo in itertools.product(*[_space_values(space, k) for k in keys]):
        values = merge_config(copy.deepcopy(dict(base)), {})  # each corner its own nested sections
        for k, v in zip(keys, combo):
            set_dotted(values, k, v)
        out.append(values)
        if len(out) >= 256:
            break
    return out or [dict(base)]


def load_sweep(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read a sweep file; `key=value` overrides go to the sweep (name=, storage=, restore=, ...) when the
    key is a sweep key and to `base:` otherwise (rounds=2, address=auto, dp.delta=1e-6, ...)."""
    spec = dict(load_yaml(path))
    if not isinstance(spec.get("base") or {}, Mapping):
        raise ConfigError(f"{path}: base: must be a mapping of config keys (e.g. base: {{method: promptfl}}), got {shown(spec['base'])}")
    items = [o for o in overrides if o != "--resume"]
    if len(items) != len(overrides):
        spec["restore"] = True
    for key, value in parse_overrides(list(items)).items():
        if key in SWEEP_KEYS:
            if key == "base" or key == "space":
                raise ConfigError(f"{key} cannot be overridden on the command line; set its keys directly (e.g. rounds=5)")
            spec[key] = value
        else:
            spec["base"] = merge_config(dict(spec.get("base") or {}), move_flat_keys({key: value}))
    return spec


# --------------------------------------------------------------------------------------------
# resources

def trial_bundles(values: Mapping[str, Any], *, has_gpu: bool = True,
                  cluster: Optional[Mapping[str, float]] = None) -> list[dict[str, float]]:
    """Placement-group bundles of one trial: [driver, (server), client actor x H], H as the trial's
    RayBackend will plan it on `cluster` (`plan_hosts`; a sweep fixes H, so the cluster's size does not
    change it)."""
    cfg = build_config(values)
    cg, sg = (cfg.execution.client_gpus, cfg.execution.server_gpus) if has_gpu else (0.0, 0.0)

    def bundle(cpu: float, gpu: float) -> dict[str, float]:
        b = {"CPU": float(cpu)} if cpu > 0 else {}
        if gpu > 0:
            b["GPU"] = float(gpu)
        return b or {"CPU": MIN_BUNDLE_CPU}

    if cfg.execution.backend == "inline":  # the whole federation runs in the trial driver
        return [bundle(max(cfg.execution.client_cpus, MIN_BUNDLE_CPU), cg)]
    cluster = cluster or {}
    hosts = plan_hosts(cfg, float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0)) if has_gpu else 0.0)
    bundles = [{"CPU": MIN_BUNDLE_CPU}]
    if cfg.execution.server_cpus > 0 or sg > 0:
        bundles.append(bundle(cfg.execution.server_cpus, sg))
    bundles += [bundle(cfg.execution.client_cpus, cg) for _ in hosts]
    return bundles


def _totals(bundles: list[dict[str, float]]) -> dict[str, float]:
    tot: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            tot[k] = tot.get(k, 0.0) + v
    return tot


def trials_that_fit(bundles: list[dict[str, float]], cluster: Mapping[str, float]) -> int:
    need = _totals(bundles)
    fits = [int(cluster.get(k, 0.0) // v + 1e-9) for k, v in need.items() if v > 0]
    return max(0, min(fits)) if fits else 1


# --------------------------------------------------------------------------------------------
# one trial

def federation(config: dict[str, Any], *, base: dict[str, Any], experiment_path: str) -> None:
    """Tune function trainable: one federation; one tune.report per round."""
    import numpy as np
    from ray import tune

    from raysim.engine.loop import resume_config, run
    from raysim.metrics import summarize

    trial_dir = Path(experiment_path) / Path(tune.get_context().get_trial_dir()).name
    run_dir = trial_dir / "run"
    values = merge_config(base, unflatten(config))
    if (run_dir / "config.yaml").is_file():  # restored trial: continue the federation where it stopped
        cfg = resume_config(run_dir, {"output": {"progress": False}})
    else:
        cfg = build_config(merge_config(values, {"output": {"progress": False, "out_dir": str(run_dir)}}))
    last: dict[str, float] = {"in_client": math.nan, "cross_client": math.nan, "hm": math.nan}
    eps_spent = [math.nan]
    t0 = time.perf_counter()

    def on_round(row: dict[str, Any]) -> None:
        for k in last:  # rounds without evaluation carry the last evaluated value forward
            v = row.get(k)
            if isinstance(v, float) and math.isfinite(v):
                last[k] = v
        e = row.get("epsilon_max")
        if isinstance(e, float) and math.isfinite(e):
            eps_spent[0] = e if not math.isfinite(eps_spent[0]) else max(eps_spent[0], e)
        summary = summarize(run_dir / "results.csv", last=max(1, cfg.eval.last))  # as summary.md, so far
        metrics = {
            "round": int(row["round"]),
            **last,
            "evaluated": bool(np.isfinite(row.get("hm", math.nan))),
            "train_loss": float(row.get("train_loss", math.nan)),
            "bytes_up": int(row.get("bytes_up", 0)),
            "bytes_down": int(row.get("bytes_down", 0)),
            "epsilon_max": float(row.get("epsilon_max", math.nan)),
            "epsilon_spent": eps_spent[0],
            "seconds": float(row.get("seconds", math.nan)),
            "summary_in_client": summary["in_client"],
            "summary_cross_client": summary["cross_client"],
            "summary_hm": summary["hm"],
            "run_seconds": time.perf_counter() - t0,
        }
        tune.report(metrics)

    run(cfg, on_round=on_round)


# --------------------------------------------------------------------------------------------
# the sweep

def _search_space(space: Mapping[str, Mapping[str, list[Any]]]) -> dict[str, Any]:
    from ray import tune

    out: dict[str, Any] = {}
    for key, dist in space.items():
        kind, values = next(iter(dist.items()))
        if kind == "grid":
            out[key] = tune.grid_search(list(values))
        elif kind == "choice":
            out[key] = tune.choice(list(values))
        elif kind == "uniform":
            out[key] = tune.uniform(*values)
        else:
            out[key] = tune.loguniform(*values)
    return out


def _absolutize(base: dict[str, Any]) -> dict[str, Any]:
    """Trials run with the trial folder as working directory: make relative paths absolute here."""
    base = merge_config(base, {})  # sectioned already (validate_sweep moved the old keys)
    for section, key in (("data", "data_root"), ("output", "cache_dir")):
        part = base.setdefault(section, {})
        v = part.get(key)
        if isinstance(v, str) and v and not v.startswith("~") and not os.path.isabs(v):
            part[key] = os.path.abspath(v)
    base["data"].setdefault("data_root", os.path.abspath("./data"))
    p = (base.get("model") or {}).get("pretrained")
    if isinstance(p, str) and p and not os.path.isabs(p) and os.path.exists(p):
        base["model"]["pretrained"] = os.path.abspath(p)
    return base


def run_sweep(spec: Mapping[str, Any], *, restore: Optional[bool] = None, verbose: int = 1) -> "pandas.DataFrame":
    """Run (or restore) a sweep; write trials.csv, trials.md and the plots; return the trials table."""
    spec = validate_sweep(spec)
    if restore is not None:
        spec["restore"] = bool(restore)
    base = _absolutize(spec["base"])
    base_cfg = build_config(base)
    storage = Path(spec["storage"]).expanduser().resolve()
    exp_dir = storage / spec["name"]
    _check_experiment_dir(exp_dir, spec["restore"])
    started = init_ray(base_cfg.execution.address, dashboard=base_cfg.execution.dashboard)
    try:
        tuner = _tuner(spec, base, base_cfg, storage, exp_dir, verbose)
        t0 = time.perf_counter()
        grid = tuner.fit()
        log.info("sweep %s: %d trials in %.1fs", spec["name"], len(grid), time.perf_counter() - t0)
    finally:
        if started:
            import ray

            ray.shutdown()
    table = trials_table(grid, spec)
    write_outputs(table, spec, exp_dir)
    table.attrs["exp_dir"] = str(exp_dir)
    table.attrs["num_errors"] = int(grid.num_errors)
    table.attrs["num_terminated"] = int(grid.num_terminated)
    return table


def _check_experiment_dir(exp_dir: Path, restore: bool) -> None:
    """A new sweep never writes into an existing experiment; a restored one needs one."""
    from ray import tune

    can_restore = tune.Tuner.can_restore(str(exp_dir)) if exp_dir.exists() else False
    if not restore and exp_dir.exists() and any(exp_dir.iterdir()):
        raise ConfigError(
            f"sweep folder {exp_dir} already holds an experiment; pass --resume (or restore: true) to continue it, "
            "or choose another name=/storage="
        )
    if restore and not can_restore:
        raise ConfigError(f"restore: no Tune experiment to restore in {exp_dir} (run the sweep once without --resume)")


def _concurrency(spec: Mapping[str, Any], base: dict[str, Any], base_cfg: RunConfig,
                 cluster: Mapping[str, float]) -> int:
    """How many trials run at once: spec's max_concurrent, else as many as the cluster holds (at least 1).
    A local cluster too small for one trial is refused; a remote one may still grow (autoscaler)."""
    has_gpu = float(cluster.get("GPU", 0)) > 0
    corners = _trial_grid(base, spec["space"])
    if not has_gpu and any(build_config(v).execution.client_gpus > 0 or build_config(v).execution.server_gpus > 0 for v in corners):
        log.warning("no GPU in the Ray cluster: client_gpus/server_gpus are not reserved, actors run on CPU")
    needs = [trial_bundles(v, has_gpu=has_gpu, cluster=cluster) for v in corners]
    biggest = max(needs, key=lambda b: sum(_totals(b).values()))
    fit = min(trials_that_fit(b, cluster) for b in needs)
    if fit == 0:
        msg = (f"one trial needs {_totals(biggest)} but the Ray cluster has "
               f"{ {k: v for k, v in cluster.items() if k in _totals(biggest)} }")
        if not base_cfg.execution.address:  # a local cluster never grows
            raise ConfigError(msg + ": lower client_cpus / client_gpus / num_actors")
        log.warning("%s; waiting for the autoscaler to add nodes", msg)
    return spec["max_concurrent"] or max(1, fit)


def _tuner(spec: Mapping[str, Any], base: dict[str, Any], base_cfg: RunConfig, storage: Path, exp_dir: Path,
           verbose: int):
    """The Tuner of a new sweep, or the restored one; each trial reserves its placement group."""
    import ray
    from ray import tune

    cluster = ray.cluster_resources()
    has_gpu = float(cluster.get("GPU", 0)) > 0
    max_concurrent = _concurrency(spec, base, base_cfg, cluster)

    def resources(config: dict[str, Any]):
        values = merge_config(base, unflatten(config))
        return tune.PlacementGroupFactory(trial_bundles(values, has_gpu=has_gpu, cluster=cluster))

    trainable = tune.with_resources(
        tune.with_parameters(federation, base=base, experiment_path=str(exp_dir)), resources
    )
    if spec["restore"]:
        try:
            return tune.Tuner.restore(str(exp_dir), trainable=trainable, resume_unfinished=True, resume_errored=True)
        except ValueError as e:  # e.g. an experiment written by another trainable
            raise ConfigError(f"restore: cannot restore the Tune experiment in {exp_dir}: {e}") from None
    scheduler = None
    if spec["asha"]:
        from ray.tune.schedulers import ASHAScheduler

        scheduler = ASHAScheduler(time_attr="training_iteration", **spec["asha"])
    return tune.Tuner(
        trainable,
        param_space=_search_space(spec["space"]),
        tune_config=tune.TuneConfig(
            metric=spec["metric"], mode=spec["mode"], num_samples=spec["num_samples"],
            scheduler=scheduler, max_concurrent_trials=max_concurrent,
        ),
        run_config=tune.RunConfig(
            name=spec["name"], storage_path=str(storage), verbose=verbose,
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )


def run_sweep_file(path: str | Path, overrides: Sequence[str] = ()) -> int:
    """Front door of `raysim sweep FILE [key=value ...] [--resume]`; returns the exit code."""
    spec = load_sweep(path, overrides)
    df = run_sweep(spec)
    exp_dir = Path(df.attrs["exp_dir"])
    print()
    print((exp_dir / "trials.md").read_text())
    print(f"outputs: {exp_dir}  (trials.csv, trials.md, hm_vs_*.png; tensorboard --logdir {exp_dir})")
    bad = df[df["status"] == "error"] if len(df) else df
    if len(bad):
        print(f"error: {len(bad)} trial(s) failed; see {exp_dir}/<trial>/error.txt", flush=True)
        return 1
    return 0
