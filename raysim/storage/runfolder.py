"""One run folder (a run's out_dir), read and written through one object.

    config.yaml              the run's config (`RunFolder.cfg`, `write_config`)
    run.lock                 the single writer's lock (`lock()`; raysim.storage.store.RunLock)
    state/                   server and client checkpoints, progress.json (`store`, `completed_round`,
                             `client_state`, `latest_client_state`, `server_state`)
    uploads/<round>.pt       what the server saw, with output.record_uploads=true (`upload_rounds`, `uploads`,
                             `records`, `participations`)
    results.csv              the per-round results (`utility`)

Resume (`resume_config`) and the check that a new run never overwrites an earlier one (`refuse_if_taken`)
live here, as do the pieces the attacks rebuild a finished run from: its method (`method`), data (`data`),
client environment (`env`), a client's initial private state and the broadcast part of a server state.
The engine writes through the same folder layout (StateStore); nothing here imports the engine.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from raysim.errors import ConfigError, RunFolderLocked
from raysim.storage.store import LOCK_NAME, RunLock, StateStore

log = logging.getLogger(__name__)

CONFIG = "config.yaml"
RESULTS = "results.csv"


def check_writable_folder(path: Path, key: str) -> None:
    """Refuse, in one line naming the path and what to do, a folder that cannot be made or written: a name
    too long, an existing file, a file on the way, a read-only or forbidden parent."""
    limit = os.pathconf("/", "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    long = next((part for part in path.parts if len(os.fsencode(part)) > limit), None)
    if long is not None or len(os.fsencode(str(path.absolute()))) > 4000:
        what = f"a name of {len(os.fsencode(long))} bytes (at most {limit})" if long is not None else "a path over 4,000 bytes"
        raise ConfigError(f"{key}={str(path)[:80]}... has {what}; choose a shorter output.out_dir")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={path} is an existing file, not a folder; choose another output.out_dir")
    d = path
    while not d.exists():
        if d.parent == d:
            break
        d = d.parent
    if d != path and not d.is_dir():
        raise ConfigError(f"{key}={path} lies under {d}, which is a file; choose another output.out_dir")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path}: {d} cannot be written (read-only or permission denied); choose another output.out_dir")


def flat(cfg: Any) -> dict[str, Any]:
    """A config as one level of `key` / `section.key` entries."""
    from raysim.config import flatten

    return flatten(cfg.to_dict())


class RunFolder:
    """A run's out_dir. `RunFolder(path)` names a folder (which may not hold a run yet, e.g. a new
    out_dir); `RunFolder.open(path)` opens a finished or interrupted run and refuses a folder that is not
    one (ConfigError: the commands exit with status 2)."""

    def __init__(self, path: str | Path, cfg: Any = None, *, data: Any = None) -> None:
        """`cfg`, `data`: the run's config and federation where the caller has them already."""
        self.path = Path(path).expanduser()
        self._cfg = cfg
        self._method: Any = None
        self._data: Any = data
        self._env: Any = None
        self._rounds_of: Optional[dict[int, list[int]]] = None

    @classmethod
    def open(cls, path: str | Path, *, missing: str = "{path} holds no config.yaml; pass the out_dir of a run") -> "RunFolder":
        """The run in `path`; `missing` (formatted with `path`) is the message when it holds no config.yaml."""
        run = cls(path)
        if not run.is_run():
            raise ConfigError(missing.format(path=run.path))
        return run

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def __str__(self) -> str:
        return str(self.path)

    @property
    def run_dir(self) -> Path:  # the name the audit and the attacks have always used
        return self.path

    # -- config ------------------------------------------------------------------------------------
    def is_run(self) -> bool:
        return os.path.lexists(self.path / CONFIG)  # a link or device there is refused when it is read

    @property
    def cfg(self) -> Any:
        """The run's config (a flat config.yaml of the previous release is moved to sections)."""
        if self._cfg is None:
            from raysim.build import build_config
            from raysim.config import load_yaml

            if not self.is_run():
                raise ConfigError(f"{self.path} holds no config.yaml; pass the out_dir of a run")
            self._cfg = build_config(load_yaml(self.path / CONFIG, root=self.path))
        return self._cfg

    def write_config(self, cfg: Any) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / CONFIG).write_text(cfg.to_yaml())
        self._cfg = cfg

    def resume_config(self, overrides: Optional[dict[str, Any]] = None) -> Any:
        """The config of this run with resumable keys (field metadata: execution, output, data.data_root,
        train.rounds to extend a run) overridden; any other change is refused. `overrides` are sectioned
        (`{"output": {"progress": False}}`; the command line's have been through the flat-key shim)."""
        from raysim.build import build_config
        from raysim.config import flatten, merge_config

        if not self.is_run():
            raise ConfigError(f"output.resume={self.path}: no config.yaml there; pass the out_dir of an earlier run")
        saved_cfg = self.cfg
        saved, allowed = flat(saved_cfg), saved_cfg.resumable_keys()
        overrides = dict(overrides or {})
        changed = {k: v for k, v in flatten(overrides).items() if saved.get(k) != v}
        bad = sorted(k for k in changed if k not in allowed)
        if bad:
            raise ConfigError(
                f"resume: {', '.join(bad)} would change the results of the run being resumed; "
                f"only these keys may change: {', '.join(sorted(allowed))}"
            )
        cfg = build_config(merge_config(saved_cfg.to_dict(), overrides))
        cfg.output.resume = cfg.output.out_dir = str(self.path)
        return cfg

    def differences(self, cfg: Any) -> list[str]:
        """The keys (besides the resumable ones) on which `cfg` differs from this run's config."""
        saved, now, allowed = flat(self.cfg), flat(cfg), cfg.resumable_keys()
        return sorted(k for k in set(saved) | set(now) if k not in allowed and saved.get(k) != now.get(k))

    def refuse_if_taken(self) -> None:
        """A new run may write here only when the folder is empty (or holds only a stale lock file)."""
        out = self.path
        check_writable_folder(out, "output.out_dir")
        if out.exists() and any(p.name != LOCK_NAME for p in out.iterdir()):
            holder = RunLock(out).holder()
            if holder is not None:
                raise RunFolderLocked(
                    f"out_dir {out} is being written by a run that is still going ({RunLock.describe(holder)}); choose another out_dir"
                )
            raise ConfigError(
                f"out_dir {out} already holds files; pass output.resume={out} to continue that run, or choose another out_dir"
            )

    # -- lock, progress, checkpoints ------------------------------------------------------------------
    def lock(self) -> RunLock:
        return RunLock(self.path)

    @property
    def store(self) -> StateStore:
        return StateStore(self.path)

    def completed_round(self) -> int:
        """The last round whose every piece is on disk (-1: none)."""
        return self.store.completed_round()

    def client_state(self, cid: int, round_idx: int) -> Optional[dict]:
        """The client's checkpoint written at the end of exactly `round_idx` (None when not on disk)."""
        from raysim.safeio import load_checked

        path = self.store.root / "clients" / str(cid) / f"{round_idx:05d}.pt"
        return load_checked(path, root=self.path) if os.path.lexists(path) else None

    def latest_client_state(self, cid: int) -> Optional[dict]:
        """The client's checkpoint of the last completed round it changed in (None: it never took part)."""
        return self.store.load_client(cid, self.completed_round())

    def server_state(self, upto_round: Optional[int] = None) -> Optional[dict]:
        """The server's shared state after `upto_round` (default: the last completed round)."""
        return self.store.load_server(self.completed_round() if upto_round is None else upto_round)

    # -- recorded uploads -----------------------------------------------------------------------------
    def upload_rounds(self) -> list[int]:
        return self.store.upload_rounds()

    def uploads(self, round_idx: int) -> dict:
        """{"pre": broadcast state, "uploads": {cid: {name: tensor}}, "num_samples": {cid: n}} of a round."""
        return self.store.load_uploads(round_idx)

    def records(self, jobs: list[tuple[int, int]]):
        """(round, client, that round's upload record) for each (round, client) job, in order, reading each
        round's record once (the jobs come grouped by round)."""
        record, at = None, -1
        for r, cid in jobs:
            if at != r:
                record, at = self.uploads(r), r
            yield r, cid, record

    def participations(self, cid: int) -> list[int]:
        """The recorded rounds in which the client uploaded."""
        if self._rounds_of is None:
            self._rounds_of = {}
            for r in self.upload_rounds():
                for c in self.uploads(r)["uploads"]:
                    self._rounds_of.setdefault(int(c), []).append(r)
        return self._rounds_of.get(cid, [])

    def state_before(self, cid: int, round_idx: int) -> Optional[dict]:
        """The client's private state as it entered `round_idx`: its checkpoint of the last round it took
        part in before, or its initial state when it took part in none. None when that checkpoint was
        pruned (a run kept with output.keep_client_states=last), or when the run was recorded only from a
        later round on (its earlier participations are unknown)."""
        before = [r for r in self.participations(cid) if r < round_idx]
        if before:
            return self.client_state(cid, before[-1])
        if self.upload_rounds()[:1] != [0]:
            return None
        return {"private": self.initial_private(cid)}

    def releasing_state(self, cid: int, round_idx: int) -> Optional[dict]:
        """The client state behind its round-`round_idx` release: its checkpoint of that round for a method
        that releases after its local training (the default), the state it entered the round with for one
        that declares `release_first` (the VPDR frameworks, SPEC 3.4: release, aggregate, then train)."""
        if getattr(self.method, "release_first", False):
            return self.state_before(cid, round_idx)
        return self.client_state(cid, round_idx)

    # -- results ----------------------------------------------------------------------------------------
    def utility(self) -> dict[str, float]:
        """The run's summary over its last eval.last evaluated rounds (results.csv; {} without one)."""
        from raysim.metrics import summarize

        path = self.path / RESULTS
        if not os.path.lexists(path):
            return {}
        return summarize(self.results(), last=max(1, self.cfg.eval.last))

    def results(self) -> Any:
        """results.csv as a DataFrame of the completed rounds, checked against the run's record of them
        (state/progress.json): a file cut short, or missing a completed round, is a DataError naming it."""
        import io

        import pandas as pd

        from raysim.errors import DataError
        from raysim.safeio import read_regular

        path = self.path / RESULTS
        raw = read_regular(path, root=self.path)
        done = self.completed_round()
        redo = f"resume the run (output.resume={self.path}) to rewrite it, or audit another run"
        if raw and not raw.endswith(b"\n"):
            raise DataError(f"{path} is truncated (its last line is cut short); {redo}")
        try:
            df = pd.read_csv(io.BytesIO(raw))
            rounds = pd.to_numeric(df["round"], errors="raise").astype(int)
        except Exception as e:  # not a CSV of rounds at all
            raise DataError(f"{path} is not a results table ({type(e).__name__}: {str(e)[:120]}); {redo}") from None
        missing = sorted(set(range(done + 1)) - set(rounds.tolist()))
        if missing:
            shown = ", ".join(str(r) for r in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise DataError(
                f"{path} is truncated: the run completed rounds 0 to {done} (state/progress.json) but it has no row for "
                f"round(s) {shown}; {redo}"
            )
        past = sorted(set(rounds[rounds > done].tolist()))
        if past:  # a round the run did not complete (cut off before its checkpoint) or rows written by hand
            log.warning("%s: ignoring %d row(s) of round(s) %s, past the last completed round %d (state/progress.json)",
                        path, int((rounds > done).sum()), ", ".join(map(str, past[:5])) + (" ..." if len(past) > 5 else ""), done)
        return df[rounds <= done]

    # -- the run rebuilt: method, data, client environment ------------------------------------------------
    @property
    def method(self) -> Any:
        """The run's method, built from its config (as the engine builds it)."""
        if self._method is None:
            from raysim.build import make_method

            self._method = make_method(self.cfg)
        return self._method

    @property
    def data(self) -> Any:
        """The run's federation (dataset, partition, frozen features), as its clients trained on it."""
        if self._data is None:
            from raysim.data.prepare import prepare_data

            self._data = prepare_data(self.cfg, self.method.needs(), progress=False)
        return self._data

    @property
    def env(self) -> Any:
        """The method's client environment (frozen towers, class names) on the run's device."""
        if self._env is None:
            from raysim.build import env_spec

            self._env = self.method.build_env(env_spec(self.cfg, self.data.classnames), role="client")
        return self._env

    def initial_private(self, cid: int) -> dict[str, Any]:
        """A client's private state before its first participation (from its own seeded stream)."""
        from raysim.methods.base import initial_private

        return initial_private(self.method, self.env, self.data.client(cid), self.cfg.train.seed)

    def broadcast(self, state: dict[str, Any]) -> dict[str, Any]:
        """The part of a server state that is broadcast (without the method's `server_only` keys)."""
        from raysim.methods.base import broadcast_state

        return broadcast_state(self.method, state)
