"""`raysim compare --max-concurrent N`: a table's runs as Ray tasks on the cluster the runs name.

Each (entry, cell, seed) run not finished yet is one Ray task that calls raysim.engine.loop.run on the
run's validated config (resume already set by the driver, which checked every folder first). What a task
reserves (`run_bundles`):

- an inline-backend run (the whole federation in the task's process): execution.num_threads CPUs, plus
  execution.client_gpus of a GPU when the cluster has GPUs;
- a Ray-backend run: a placement group of its actors' bundles, as a sweep trial reserves
  (raysim.tools.sweep.trial_bundles): a small one for the task itself, one for the server when it reserves
  anything, one per client actor; the run's actors are captured into the group. With execution.num_actors=0
  its actors are as many as fit next to the task's own bundle (`pool_for_task`).

As many runs are in flight at once as fit the cluster (or `--max-concurrent`). The driver shows one
progress line for the whole table (runs done / running / queued, each running run's latest round, read
from its results.csv): redrawn in place on a terminal, as log lines otherwise. A run gives the same bits in
a Ray worker as in the driver (the hosts pin torch's threads to execution.num_threads), so the table is
bitwise the one of `--max-concurrent 1`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from raysim.engine.cluster import init_ray, plan_hosts
from raysim.errors import ConfigError

MIN_BUNDLE_CPU = 0.01  # the task of a Ray-backend run mostly waits on its actors (as a sweep's trial driver)
POLL_S = 1.0


def run_bundles(cfg: Any, cluster: Mapping[str, float]) -> list[dict[str, float]]:
    """What one run reserves on `cluster`: one bundle for an inline run, a placement group's for a Ray-backend one."""
    x = cfg.execution
    has_gpu = float(cluster.get("GPU", 0)) > 0
    cg, sg = (x.client_gpus, x.server_gpus) if has_gpu else (0.0, 0.0)

    def bundle(cpu: float, gpu: float) -> dict[str, float]:
        b = {"CPU": float(cpu)} if cpu > 0 else {}
        if gpu > 0:
            b["GPU"] = float(gpu)
        return b or {"CPU": MIN_BUNDLE_CPU}

    if x.backend == "inline":
        return [bundle(max(1, x.num_threads), cg)]
    hosts = plan_hosts(cfg, float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0)) if has_gpu else 0.0)
    bundles = [{"CPU": MIN_BUNDLE_CPU}]
    if x.server_cpus > 0 or sg > 0:
        bundles.append(bundle(x.server_cpus, sg))
    return bundles + [bundle(x.client_cpus, cg) for _ in hosts]


def pool_for_task(cfg: Any, cluster: Mapping[str, float]) -> Any:
    """`cfg` with its client actors counted for a run that is itself a Ray task: a pooled Ray-backend run with
    num_actors=0 ("as many as the cluster has room for") would plan them from the whole cluster inside the
    task, where the task's own bundle (MIN_BUNDLE_CPU) is already reserved, so its placement group could never
    fit; it gets the number that fits next to that bundle, fixed in its config (results do not depend on the
    pool size). Other configs are returned as they are."""
    import dataclasses

    x = cfg.execution
    if x.backend != "ray" or x.placement != "pooled" or x.num_actors > 0:
        return cfg
    has_gpu = float(cluster.get("GPU", 0)) > 0
    hosts = plan_hosts(cfg, float(cluster.get("CPU", 0)) - MIN_BUNDLE_CPU, float(cluster.get("GPU", 0)) if has_gpu else 0.0)
    return dataclasses.replace(cfg, execution=dataclasses.replace(x, num_actors=len(hosts)))


def runs_that_fit(bundles: list[dict[str, float]], cluster: Mapping[str, float]) -> int:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    fits = [int(cluster.get(k, 0.0) // v + 1e-9) for k, v in need.items() if v > 0]
    return max(0, min(fits)) if fits else 1


def one_run(cfg: Any, cwd: str) -> tuple[float, str]:
    """The Ray task: one run, in the driver's working directory (relative data / cache paths as there);
    returns its wall time and the id of the node it ran on."""
    import ray

    from raysim.engine.loop import run

    os.chdir(cwd)
    t0 = time.perf_counter()
    run(cfg)
    return time.perf_counter() - t0, ray.get_runtime_context().get_node_id()


def latest_round(folder: Path) -> int:
    """Rounds done so far, from the run's results.csv (0 before its first round)."""
    try:
        with open(folder / "results.csv") as f:
            return max(0, sum(1 for line in f if line.strip()) - 1)
    except OSError:
        return 0


class Progress:
    """One display for the whole table: a line redrawn in place on a terminal, log lines otherwise."""

    def __init__(self, total: int, names: Mapping[int, str], log: Callable[[str], None], tty: bool) -> None:
        self.total, self.names, self.log, self.tty = total, names, log, tty
        self.width = 0

    def line(self, done: int, running: Mapping[int, Any], queued: int) -> str:
        now = ", ".join(f"{self.names[i]} r{latest_round(Path(cfg.output.out_dir))}/{cfg.train.rounds}"
                        for i, cfg in running.items())
        return f"compare: {done}/{self.total} done, {len(running)} running" + (f" ({now})" if now else "") + f", {queued} queued"

    def show(self, done: int, running: Mapping[int, Any], queued: int) -> None:
        if self.tty:
            text = self.line(done, running, queued)
            sys.stderr.write("\r" + text.ljust(self.width))
            sys.stderr.flush()
            self.width = len(text)

    def event(self, text: str) -> None:
        if self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            self.width = 0
        self.log(text)


def run_concurrently(configs: Mapping[int, Any], names: Mapping[int, str], *, max_concurrent: int = 0,
                     log: Callable[[str], None] = print, tty: bool | None = None) -> dict[int, float]:
    """Run `configs` (index -> validated config, in order) as Ray tasks, at most `max_concurrent` at once
    (0: as many as the cluster holds); return each run's wall time. Joins or starts Ray as a run does
    (init_ray with the first run's execution.address) and shuts down only what it started."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    order = list(configs)
    first = configs[order[0]]
    started = init_ray(first.execution.address)
    running: dict[Any, tuple[int, Any, Any]] = {}  # ref -> (index, placement group or None, config)
    seconds: dict[int, float] = {}
    try:
        cluster = ray.cluster_resources()
        configs = {i: pool_for_task(configs[i], cluster) for i in order}
        needs = {i: run_bundles(configs[i], cluster) for i in order}
        fit = min(runs_that_fit(b, cluster) for b in needs.values())
        if fit == 0:
            biggest = max(needs.values(), key=lambda b: sum(sum(x.values()) for x in b))
            msg = f"one run needs {biggest} but the Ray cluster has {dict(cluster)}"
            if not first.execution.address:  # a local cluster never grows
                raise ConfigError(msg + ": lower execution.num_threads / client_cpus / num_actors")
            log(f"compare: {msg}; waiting for the cluster to grow")
        limit = max_concurrent or max(1, fit)
        task = ray.remote(one_run)
        cwd = os.getcwd()
        queue = list(order)
        progress = Progress(len(order), names, log, sys.stderr.isatty() if tty is None else tty)
        log(f"compare: {len(order)} runs on the Ray cluster, up to {limit} at once")
        while queue or running:
            while queue and len(running) < limit:
                i = queue.pop(0)
                cfg, bundles = configs[i], needs[i]
                if cfg.execution.backend == "inline":
                    b = bundles[0]
                    ref = task.options(num_cpus=b["CPU"], num_gpus=b.get("GPU", 0)).remote(cfg, cwd)
                    running[ref] = (i, None, cfg)
                else:
                    pg = placement_group(bundles, strategy="PACK")
                    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
                                                                placement_group_capture_child_tasks=True)
                    ref = task.options(num_cpus=MIN_BUNDLE_CPU, scheduling_strategy=strategy).remote(cfg, cwd)
                    running[ref] = (i, pg, cfg)
                progress.event(f"[{len(seconds) + len(running)}/{len(order)}] {names[i]}: started "
                               f"({len(seconds)} done, {len(running)} running, {len(queue)} queued)")
            ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
            for ref in ready:
                i, pg, cfg = running.pop(ref)
                try:
                    seconds[i], node = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, ConfigError):
                        raise ConfigError(f"{names[i]}: {e.cause}") from None
                    raise
                finally:
                    if pg is not None:
                        remove_placement_group(pg)
                progress.event(f"[{len(seconds)}/{len(order)} done] {names[i]}: {cfg.train.rounds} rounds in "
                               f"{seconds[i]:.1f}s on node {node[:12]} -> {cfg.output.out_dir}")
            progress.show(len(seconds), {i: cfg for i, _, cfg in running.values()}, len(queue))
    finally:
        for ref, (_, pg, _) in running.items():  # an error or Ctrl-C: the others stop, their folders resume later
            ray.cancel(ref)
            if pg is not None:
                remove_placement_group(pg)
        if started:
            ray.shutdown()
    return seconds
