"""The run's state on disk: the server's shared state and each client's private state per round.

Layout under `out_dir/state/`:
  server/<round>.pt            global shared state after that round
  clients/<cid>/<round>.pt     a client's private state (and privacy ledger) after a round it changed in
                               (an identical state is not written again: the latest version up to a round is its state)
  progress.json                {"completed_round": r}: written last, once every piece of round r is on disk

With `record_uploads=true`, `out_dir/uploads/<round>.pt` also holds what the server saw in a round (an
attacker's view, read by raysim.attacks): {"pre": broadcast state, "uploads": {cid: {name: tensor}},
"num_samples": {cid: n}}, clients in id order.

A resumed run continues from `completed_round`; versions newer than it (an interrupted round) are
ignored, so a crash at any moment leaves a consistent state to resume from. Files are written to a
temporary name and renamed, so a reader never sees half a file.

Safety: every checkpoint is written with its SHA-256 next to it (`<round>.pt.sha256`) and read back with
`torch.load(weights_only=True)`: tensors, numbers, strings and containers only, so a run folder from
elsewhere cannot run code when it is resumed or audited. On resume, `StateStore.resumable_round` reads
every piece of the last completed round; a truncated or corrupted one is named, and the run falls back
to the round before when all of its pieces are intact (the store keeps at least the last two rounds;
every round's client states with output.keep_client_states=all, or auto with record_uploads).

Single writer: `RunLock` holds `out_dir/run.lock` (an flock on a file naming the pid and host) for the
whole run, so a second run or a resume of the same folder stops with a message naming the holder. The
lock dies with its process, so a lock file left by a killed run is taken over.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

from raysim.errors import CheckpointError, RunFolderLocked
from raysim.safeio import DIGEST_SUFFIX, SAFE_NUMPY, _reason, atomic_save, atomic_write, load_checked, read_regular, safe_load, serialize  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"

def _versions(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(int(p.stem) for p in folder.glob("*.pt") if p.stem.isdigit())


def _unlink_version(folder: Path, v: int) -> None:
    (folder / f"{v:05d}.pt").unlink(missing_ok=True)
    (folder / f"{v:05d}.pt{DIGEST_SUFFIX}").unlink(missing_ok=True)


class StateStore:
    """`keep_all_clients`: keep every round's client checkpoint (output.keep_client_states=all, or auto with
    record_uploads) instead of only those a resume can need; the audit then has the model behind each
    recorded release. The server's state is pruned either way (the uploads record holds each round's
    broadcast state)."""

    def __init__(self, out_dir: str | Path, *, keep_all_clients: bool = False) -> None:
        self.root = Path(out_dir) / "state"
        self.keep_all_clients = keep_all_clients
        # per client, the SHA-256 of the version this store last wrote (save_client skips an identical one); a new
        # store (a resumed run, a replaced actor) writes each client's first version again
        self._written: dict[int, bytes] = {}

    # -- progress ---------------------------------------------------------------------------
    def completed_round(self) -> int:
        p = self.root / "progress.json"
        if not p.is_file():
            return -1
        try:
            return int(json.loads(read_regular(p, root=self.root.parent, max_bytes=4096, error=CheckpointError))["completed_round"])
        except CheckpointError as e:
            raise CheckpointError(f"{e}; it should read {{\"completed_round\": N}}") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{p} is truncated or corrupted ({_reason(e)}); it should read {{\"completed_round\": N}}") from None

    def mark_complete(self, round_idx: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".progress.json.tmp{os.getpid()}"
        try:
            tmp.write_text(json.dumps({"completed_round": round_idx}))
            os.replace(tmp, self.root / "progress.json")
        except BaseException:  # a full disk: the previous progress.json stands, no temporary file is left
            tmp.unlink(missing_ok=True)
            raise

    # -- server -----------------------------------------------------------------------------
    def save_server(self, round_idx: int, state: dict) -> None:
        atomic_save(state, self.root / "server" / f"{round_idx:05d}.pt")
        self._prune(self.root / "server", keep_from=round_idx - 1)

    def load_server(self, upto_round: int) -> Optional[dict]:
        return self._load_latest(self.root / "server", upto_round)

    # -- train.optimizer_state=shared: the one SGD state the clients hand on (methods/base.py OptimizerCarry) -----------
    def save_shared_optimizer(self, round_idx: int, state: dict) -> None:
        atomic_save(state, self.root / "optimizer" / f"{round_idx:05d}.pt")
        self._prune(self.root / "optimizer", keep_from=round_idx - 1)

    def load_shared_optimizer(self, upto_round: int) -> Optional[dict]:
        return self._load_latest(self.root / "optimizer", upto_round)

    # -- clients ----------------------------------------------------------------------------
    def save_client(self, client_id: int, round_idx: int, state: dict) -> bool:
        """Write the client's state after `round_idx`; False (nothing written) when it is byte for byte the version
        this store last wrote for the client, which a resume from `round_idx` or later loads anyway (the latest
        version up to that round). A stateless method's clients (PromptFL without DP: no private state, no
        ledger) are then written once. Every round's version is written when the store keeps them all."""
        data = serialize(state)
        digest = hashlib.sha256(data).digest()
        if self._last_written(client_id, digest):
            return False
        atomic_write(data, self.root / "clients" / str(client_id) / f"{round_idx:05d}.pt")
        self._written[client_id] = digest
        return True

    def holds(self, client_id: int, state: dict) -> bool:
        """Whether `save_client` would skip `state`: it is byte for byte the client's version this store last wrote."""
        return self._last_written(client_id, hashlib.sha256(serialize(state)).digest())

    def _last_written(self, client_id: int, digest: bytes) -> bool:
        """`digest` is that of the client's version this store last wrote (never, when it keeps every round's)."""
        return not self.keep_all_clients and self._written.get(client_id) == digest

    def load_client(self, client_id: int, upto_round: int) -> Optional[dict]:
        return self._load_latest(self.root / "clients" / str(client_id), upto_round)

    def client_rounds(self, client_id: int) -> list[int]:
        """The rounds whose end-of-round state of the client is on disk."""
        return _versions(self.root / "clients" / str(client_id))

    def prune_client(self, client_id: int, completed_round: int) -> None:
        """Drop versions that a resume from `completed_round` (or later) can never need (none when the
        store keeps every round's client state)."""
        if self.keep_all_clients:
            return
        folder = self.root / "clients" / str(client_id)
        usable = [v for v in _versions(folder) if v <= completed_round]
        if usable:
            self._prune(folder, keep_from=usable[-1])

    # -- what the server saw (record_uploads) ----------------------------------------------
    @property
    def uploads_dir(self) -> Path:
        return self.root.parent / "uploads"

    def save_uploads(self, round_idx: int, record: dict) -> None:
        atomic_save(record, self.uploads_dir / f"{round_idx:05d}.pt")

    def upload_rounds(self) -> list[int]:
        """Recorded rounds, up to the last completed one (a half-finished round is not part of the run)."""
        done = self.completed_round()
        return [r for r in _versions(self.uploads_dir) if r <= done]

    def load_uploads(self, round_idx: int) -> dict:
        return load_checked(self.uploads_dir / f"{round_idx:05d}.pt", root=self.root.parent)

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _latest(folder: Path, upto_round: int) -> Optional[Path]:
        usable = [v for v in _versions(folder) if v <= upto_round]
        return folder / f"{usable[-1]:05d}.pt" if usable else None

    def _load_latest(self, folder: Path, upto_round: int) -> Optional[dict]:
        path = self._latest(folder, upto_round)
        return None if path is None else load_checked(path, root=self.root.parent)

    @staticmethod
    def _prune(folder: Path, keep_from: int) -> None:
        for v in _versions(folder):
            if v < keep_from:
                _unlink_version(folder, v)

    # -- resume: is the last completed round intact? ---------------------------------------
    def pieces(self, round_idx: int) -> list[Path]:
        """The files a resume from `round_idx` reads: the server's state and each client's latest version."""
        folders = [self.root / "server"]
        clients = self.root / "clients"
        if clients.is_dir():
            folders += sorted((p for p in clients.iterdir() if p.is_dir()), key=lambda p: (len(p.name), p.name))
        return [p for p in (self._latest(f, round_idx) for f in folders) if p is not None]

    def damaged(self, round_idx: int) -> list[tuple[Path, CheckpointError]]:
        """The pieces of `round_idx` that do not load (a missing server state counts as damaged)."""
        bad: list[tuple[Path, CheckpointError]] = []
        if round_idx >= 0 and self._latest(self.root / "server", round_idx) is None:
            p = self.root / "server" / f"{round_idx:05d}.pt"
            bad.append((p, CheckpointError(f"{p} is missing")))
        for p in self.pieces(round_idx):
            try:
                load_checked(p, root=self.root.parent)
            except CheckpointError as e:
                bad.append((p, e))
        return bad

    def resumable_round(self, completed: int) -> int:
        """The round a resume continues from: `completed` when all its pieces are intact, else the round
        before it when all of that round's pieces are (progress.json is moved back to it, and the damaged
        round is replayed). Raises a CheckpointError naming the damaged file otherwise, or at once when a
        file holds an object that could run code (that folder is not to be trusted)."""
        if completed < 0:
            return completed
        bad = self.damaged(completed)
        if not bad:
            return completed
        unsafe = [e for _, e in bad if "could run code" in str(e)]
        if unsafe:
            raise CheckpointError(f"output.resume={self.root.parent}: {unsafe[0]}")
        first = bad[0][1]
        more = f" (and {len(bad) - 1} more file(s) of that round)" if len(bad) > 1 else ""
        prev = completed - 1
        prev_bad = self.damaged(prev)
        if not prev_bad:
            if prev >= 0:
                where = f"the last good round is {prev}: resuming after it (round {completed} is replayed)"
            else:
                where = "there is no round before it: starting again from round 0"
            log.warning("resume=%s: %s%s; %s", self.root.parent, first, more, where)
            self.mark_complete(prev)
            return prev
        raise CheckpointError(
            f"output.resume={self.root.parent}: {first}{more}; round {completed} cannot be restored, and the round before "
            f"it, {prev}, the only other one kept under state/, is damaged too ({prev_bad[0][1]}). "
            "No intact round is left to resume from; start a new run."
        )


class RunLock:
    """One writer per run folder: `out_dir/run.lock`, flock-ed for the life of the run and naming the
    pid and host that hold it. A second run or resume of the folder gets a RunFolderLocked naming them.
    A lock file whose process is gone (killed, crashed) holds no flock, so it is simply taken over.

    `release` removes the lock file, and the folders `acquire` created when they are left empty, so a
    failed start leaves nothing behind."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self.fd: Optional[int] = None
        self.created: list[Path] = []

    def holder(self) -> Optional[dict[str, Any]]:
        """Who holds the lock now (pid, host, started), or None when nobody does."""
        if not self.path.is_file():
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            import fcntl

            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return self._read(fd) or {"pid": "?", "host": "?"}
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    @staticmethod
    def _read(fd: int) -> dict[str, Any]:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            raw = b""
            while chunk := os.read(fd, 65536):
                raw += chunk
            return json.loads(raw.decode() or "{}")
        except (OSError, ValueError):
            return {}

    @staticmethod
    def describe(info: dict[str, Any]) -> str:
        since = info.get("started")
        when = f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if isinstance(since, (int, float)) else ""
        return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}{when}"

    def acquire(self) -> "RunLock":
        import fcntl

        missing = []
        d = self.out_dir
        while not d.exists():
            missing.append(d)
            d = d.parent
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.created = missing  # innermost first
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = self._read(fd)
                os.close(fd)
                self._remove_created()
                raise RunFolderLocked(
                    f"{self.out_dir} is being written by another run ({self.describe(info)}); two writers would "
                    f"corrupt it. Wait for that run to end (or stop it), then pass output.resume={self.out_dir}; or choose another out_dir."
                ) from None
            try:  # a holder that was releasing may have removed the file we opened: lock the one at the path
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        old = self._read(fd)
        if old.get("pid") not in (None, os.getpid()):
            log.warning("%s: taking over the lock left by %s, which no longer holds it", self.out_dir, self.describe(old))
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv}
        os.write(fd, json.dumps(info).encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        import fcntl

        try:
            self.path.unlink(missing_ok=True)  # unlink first: a waiter that opened it re-checks the inode
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for d in self.created:  # innermost first; only while empty
            try:
                d.rmdir()
            except OSError:
                break
        self.created = []

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
