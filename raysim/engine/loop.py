"""The round loop. The engine owns orchestration, sampling, DP accounting, evaluation and I/O; the
method only fills in its client and server halves (methods/base.py)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from raysim.config import RunConfig, flatten
from raysim.data.prepare import client_domains, materialize_images, prepare_data  # noqa: F401 (moved there; re-exported)
from raysim.errors import ConfigError, shown
from raysim.metrics import RunLogger, harmonic_mean, summary_table
from raysim.sampling import eval_clients, participants
from raysim.storage.runfolder import RunFolder
from raysim.storage.store import LOCK_NAME, RunLock, StateStore

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    out_dir: Path
    summary: dict[str, float]
    rounds: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        return summary_table([(self.info.get("method", "method"), self.summary)])


@dataclass(frozen=True)
class EvalSchedule:
    """Rounds (0-based) after which the clients are evaluated: every `every` rounds plus the last `last`.
    Computed per round (`r in schedule`), so a run's size costs nothing up front; iterable and comparable
    to a set for small runs."""

    rounds: int
    every: int
    last: int

    def __contains__(self, r: object) -> bool:
        return isinstance(r, int) and 0 <= r < self.rounds and ((r + 1) % self.every == 0 or r >= self.rounds - self.last)

    def __iter__(self):
        return (r for r in range(self.rounds) if r in self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (set, frozenset)):
            return set(self) == other
        return isinstance(other, EvalSchedule) and (self.rounds, self.every, self.last) == (other.rounds, other.every, other.last)

    __hash__ = None  # type: ignore[assignment]


def eval_rounds(rounds: int, every: int, last: int) -> EvalSchedule:
    """Rounds (0-based) after which all clients are evaluated: every `every` rounds plus the last `last`."""
    return EvalSchedule(rounds, every, last)


def metric_columns(method: Any) -> tuple[str, ...]:
    """results.csv columns for the method's declared metrics (besides train_loss)."""
    return tuple([f"train_{m}" for m in method.client_metrics if m != "loss"] + [f"server_{m}" for m in method.server_metrics])


def round_metrics(reports: list[Any], server: dict[str, float], columns: tuple[str, ...]) -> dict[str, float]:
    """The round's declared metrics: the mean over clients of each client metric, and the server's."""
    out: dict[str, float] = {}
    for col in columns:
        kind, name = col.split("_", 1)
        if kind == "server":
            out[col] = float(server.get(name, math.nan))
        else:
            vals = [float(r.metrics[name]) for r in reports if name in r.metrics and math.isfinite(float(r.metrics[name]))]
            out[col] = float(np.mean(vals)) if vals else math.nan
    return out


def mean_of_defined(values: list[float]) -> float:
    """Mean over the finite values (a client without a Cross-Client test set has nan); nan if none."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def flat_config(cfg: RunConfig) -> dict[str, Any]:
    """The config as one level of `key` / `section.key` entries (TensorBoard hparams, sweep tables)."""
    return flatten(cfg.to_dict())


def resume_config(run_dir: str | Path, overrides: Optional[dict[str, Any]] = None) -> RunConfig:
    """The config of the run in `run_dir`, with resumable keys (field metadata: execution, output,
    data.data_root, train.rounds to extend a run) overridden; any other change is refused."""
    return RunFolder(run_dir).resume_config(overrides)


def resolve_out_dir(cfg: RunConfig) -> tuple[Path, int]:
    """Where the run writes and the last completed round; never overwrites an existing run."""
    if cfg.output.resume:
        folder = RunFolder(cfg.output.resume)
        saved = flat_config(folder.resume_config())
        allowed = cfg.resumable_keys()
        for k, v in flat_config(cfg).items():
            if k not in allowed and saved.get(k) != v:
                raise ConfigError(f"resume: {k}={shown(v)} differs from the resumed run's {shown(saved.get(k))}")
        cfg.output.out_dir = str(folder.path)
        return folder.path, folder.completed_round()
    folder = RunFolder(cfg.output.out_dir or f"runs/{cfg.method}-{cfg.data.dataset}-{datetime.now():%Y%m%d-%H%M%S}")
    folder.refuse_if_taken()
    cfg.output.out_dir = str(folder.path)
    return folder.path, -1


def run(cfg: RunConfig, *, on_round: Optional[Callable[[dict[str, Any]], None]] = None) -> RunResult:
    """Run (or resume) one federation and write its outputs. Returns the paper-format summary.

    The run holds out_dir's lock throughout (one writer per folder); a resume first checks that every
    checkpoint of the last completed round loads, falling back to the round before when one does not."""
    out_dir, done = resolve_out_dir(cfg)
    with RunLock(out_dir):
        done = StateStore(out_dir).resumable_round(done)
        return _run(cfg, out_dir, done, on_round)


def _run(cfg: RunConfig, out_dir: Path, done: int, on_round: Optional[Callable[[dict[str, Any]], None]]) -> RunResult:
    fresh = not any(p.name != LOCK_NAME for p in out_dir.iterdir())  # a new run: nothing but our lock yet
    try:
        method, backend, logger, hparams, substeps = _start(cfg, out_dir, done)
    except BaseException:
        if fresh:  # a failed start writes nothing: what it wrote (config.yaml, tensorboard/, ...) goes again
            _remove_all_but_lock(out_dir)
        raise
    info = {"method": cfg.method, **backend.info}
    store = StateStore(out_dir)
    evals = eval_rounds(cfg.train.rounds, cfg.eval.every, cfg.eval.last)
    extra = metric_columns(method)
    rows: list[dict[str, Any]] = []
    bar = _progress_bar(cfg, done)
    try:
        for r in range(done + 1, cfg.train.rounds):
            row, client_rows = _one_round(cfg, backend, r, evaluate=r in evals, extra=extra, substeps=substeps,
                                          setup=method.setup_clients() if r == 0 else ())
            logger.log_round(row, client_rows)
            store.mark_complete(r)
            rows.append(row)
            if on_round is not None:
                on_round(row)
            if bar is not None:
                bar.update(1)
                if math.isfinite(row["hm"]):
                    bar.set_postfix(inn=f"{row['in_client']:.3f}", cross=f"{row['cross_client']:.3f}", hm=f"{row['hm']:.3f}")
    finally:
        if bar is not None:
            bar.close()
        backend.shutdown()
    return _finish(cfg, out_dir, logger, hparams, rows, info)


def _remove_all_but_lock(out_dir: Path) -> None:
    import shutil

    for p in out_dir.iterdir():
        if p.name == LOCK_NAME:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _start(cfg: RunConfig, out_dir: Path, done: int) -> tuple[Any, Any, RunLogger, dict[str, Any], int]:
    """The method, the data (which fails before anything is written), config.yaml, the logger, the backend,
    and the lock-step count of a round (Method.lockstep_steps; 0 = an ordinary round)."""
    from raysim.build import make_method
    from raysim.engine.backends import BACKENDS

    method = make_method(cfg)
    from raysim.privacy.mechanisms import warnings_for

    for line in warnings_for(method, cfg.dp):  # e.g. a reference code's noise that is not a valid guarantee
        log.warning(line)
    if cfg.train.optimizer_state == "shared":
        log.warning("train.optimizer_state=shared: one SGD state runs through every client in id order, as the FedSEPT code's "
                    "one optimiser (a simulation artifact: each client's momentum reaches the next client)%s",
                    "; under DP every client's ledger records it as voiding its guarantee (epsilon inf)" if cfg.dp.enabled else "")
    if done >= cfg.train.rounds - 1:
        log.info("run %s already completed %d rounds", out_dir, done + 1)
    data = prepare_data(cfg, method.needs(), progress=cfg.output.progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(cfg.to_yaml())
    hparams = flat_config(cfg)
    logger = RunLogger(out_dir, tensorboard=cfg.output.tensorboard, hparams=hparams, extra_columns=metric_columns(method))
    logger.resume_at(done)
    backend = BACKENDS[cfg.execution.backend](cfg, data, str(out_dir), done)
    devices = " ".join(backend.info.get("devices", ["cpu"]))
    if cfg.execution.client_gpus > 0 and cfg.execution.backend != "ray" and "cuda" not in devices:  # ray says it itself
        log.warning("execution.client_gpus=%s but no GPU is visible: running on CPU", cfg.execution.client_gpus)
    substeps = int(method.lockstep_steps([len(i) for i in data.train_idx]))
    return method, backend, logger, hparams, substeps


def lockstep_round(backend: Any, r: int, part: list[int], substeps: int) -> tuple[list[Any], dict[str, Any]]:
    """A lock-step round (Method.lockstep_steps = `substeps` > 0): `substeps` calls of the backend's
    train_round on the same participants, each aggregated and broadcast before the next. One report per
    client: its mean loss over the steps, its bytes summed, its epsilon and metrics after the last step;
    a client dropped at any step is dropped (the policy already checked each step)."""
    import dataclasses

    per_client: dict[int, list[Any]] = {}
    bytes_up = bytes_down = 0
    server: dict[str, float] = {}
    for _ in range(substeps):
        reports, stats = backend.train_round(r, part)
        for x in reports:
            per_client.setdefault(x.client_id, []).append(x)
        bytes_up += int(stats["bytes_up"])
        bytes_down += int(stats["bytes_down"])
        server = dict(stats.get("server_metrics", {}))
    merged = []
    for cid in sorted(per_client):
        reps = per_client[cid]
        losses = [x.loss for x in reps if math.isfinite(x.loss)]
        last, dropped = reps[-1], [x for x in reps if x.dropped]
        merged.append(dataclasses.replace(last, loss=float(np.mean(losses)) if losses else math.nan,
                                          bytes_up=sum(x.bytes_up for x in reps), dropped=bool(dropped),
                                          error=dropped[0].error if dropped else ""))
    return merged, {"bytes_up": bytes_up, "bytes_down": bytes_down, "server_metrics": server}


def _progress_bar(cfg: RunConfig, done: int) -> Any:
    if not cfg.output.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.train.rounds, initial=done + 1, desc=f"{cfg.method} rounds", unit="round")


def _one_round(
    cfg: RunConfig, backend: Any, r: int, *, evaluate: bool, extra: tuple[str, ...], substeps: int = 0,
    setup: tuple[int, ...] = ()
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(Step 0 of the `setup` clients,) train, aggregate, (evaluate,) commit round r; its results.csv row and
    client_results.csv rows. Step 0's bytes count in round r's (0's) bytes_up and bytes_down."""
    t0 = time.perf_counter()
    part = participants(cfg.train.seed, r, cfg.train.num_clients, cfg.train.participation)
    pre: dict[str, Any] = {"bytes_up": 0, "bytes_down": 0}
    setup_reports: list[Any] = []
    if setup:  # Step 0 (Method.setup_clients): released, and aggregated into the broadcast round 0 trains on
        setup_reports, pre = backend.setup(r, sorted(setup))
    if substeps > 0:  # a lock-step round: the participants step together, the server aggregating each step
        reports, stats = lockstep_round(backend, r, part, substeps)
    else:
        reports, stats = backend.train_round(r, part)  # raises ClientFailure per on_client_error / min_clients
    dropped = [x for x in reports if x.dropped]
    for x in dropped:
        log.warning("round %d: client %d dropped (on_client_error=drop): %s", r, x.client_id, x.error)
    client_rows: list[dict[str, Any]] = []
    acc_in = acc_cross = hm = math.nan
    if evaluate:  # all clients, or eval.clients of them: the same seeded sample every evaluated round
        sample = eval_clients(cfg.train.seed, cfg.train.num_clients, cfg.eval.clients)
        client_rows = [{"round": r, **row} for row in backend.evaluate(None if len(sample) == cfg.train.num_clients else sample)]
        acc_in = mean_of_defined([c["in_client"] for c in client_rows])
        acc_cross = mean_of_defined([c["cross_client"] for c in client_rows])  # nan with one client
        hm = harmonic_mean(acc_in, acc_cross)
    backend.commit(r)
    losses = [x.loss for x in reports if math.isfinite(x.loss)]
    trained = {x.client_id for x in reports}  # a Step 0 client that does not train in round 0 still spent its release
    eps = [x.epsilon for x in reports] + [x.epsilon for x in setup_reports if x.client_id not in trained]
    row = {
        "round": r,
        "in_client": acc_in,
        "cross_client": acc_cross,
        "hm": hm,
        "train_loss": float(np.mean(losses)) if losses else math.nan,
        "bytes_up": int(stats["bytes_up"]) + int(pre["bytes_up"]),
        "bytes_down": int(stats["bytes_down"]) + int(pre["bytes_down"]),
        "epsilon_max": float(max(eps)) if eps and all(math.isfinite(e) for e in eps) else math.nan,
        "participants": len(part),
        "dropped": len(dropped),
        "eval_clients": len(client_rows) if evaluate else math.nan,
        "seconds": time.perf_counter() - t0,
        **round_metrics(reports, stats.get("server_metrics", {}), extra),
    }
    return row, client_rows


def privacy_scope(cfg: RunConfig) -> str:
    """A summary line saying what the printed epsilon covers when the method's budget says it is not every
    upload (e.g. fedtsp.dp_budget=paper: the description embedding only); empty otherwise."""
    if not cfg.dp.enabled:
        return ""
    from raysim.build import make_method

    shares = make_method(cfg).budget_shares() or {}
    notes = list(dict.fromkeys(s.note for s in shares.values() if s.note))
    return "".join(f"Privacy: the epsilon {n}.\n" for n in notes)


def _finish(cfg: RunConfig, out_dir: Path, logger: RunLogger, hparams: dict[str, Any], rows: list[dict[str, Any]],
            info: dict[str, Any]) -> RunResult:
    from raysim.engine.evaluation import PROTOCOLS

    protocol = PROTOCOLS.get(cfg.eval.protocol)  # the protocol says how a run is summarised
    summary = protocol.summarize(out_dir, last=max(1, cfg.eval.last))
    logger.close(final_metrics=summary, hparams=hparams)
    title = f"{cfg.method} on {cfg.data.dataset} ({cfg.data.partition}, {cfg.train.num_clients} clients)"
    evaluated = len(eval_clients(cfg.train.seed, cfg.train.num_clients, cfg.eval.clients))
    sampled = (f"a sample of {evaluated} of the {cfg.train.num_clients} clients (eval.clients={cfg.eval.clients}, drawn once from "
               f"train.seed={cfg.train.seed}), each scored among the sampled clients" if evaluated < cfg.train.num_clients
               else f"all {evaluated} clients")
    text = protocol.markdown(cfg.method, summary, title=title) + f"Evaluated per evaluated round: {sampled}.\n"
    text += privacy_scope(cfg)
    (out_dir / "summary.md").write_text(text)
    return RunResult(out_dir, summary, rows, {**info, "eval_clients": evaluated})
