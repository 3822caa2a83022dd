"""The watchdog of a local Ray cluster raysim starts itself: when the driver dies, however it dies (kill -9
included), every process the cluster started goes with it.

Ray stops its GCS and raylet with their driver, but not every helper: after a kill -9 of a driver, Ray 2.60's
dashboard agent, runtime-env agent and some actor processes outlive it until the machine is rebooted or the
next run's cluster is shut down. `start_reaper` starts one small process per cluster, in a session of its
own, holding the read end of a pipe whose write end only the driver holds. While the driver lives, the reaper
records the driver's process tree (pid and start time of each of Ray's processes below it, from /proc) every `POLL_S` seconds; when the
pipe reads end-of-file (the driver exited: normally, by an exception or by a signal), it sends SIGTERM to
every recorded process still alive and, after `GRACE_S`, SIGKILL to any left. A process is matched by pid
*and* start time, so a pid the system has since reused is never touched.

    python -m raysim.engine.reaper DRIVER_PID     (stdin: the pipe; started by `start_reaper`)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

POLL_S = 1.0  # how often the driver's tree is recorded
GRACE_S = 5.0  # between SIGTERM and SIGKILL


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks, state) of `pid` from /proc (Linux), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19]), fields[0]
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _tree(root: int) -> dict[int, int]:
    """{pid: start time} of every Ray process below `root` (Ray's servers and agents, its workers `ray::...`),
    not `root` itself nor this reaper, nor anything else the driver runs."""
    stats = {int(d): st for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d))) is not None}
    below, todo = set(), [root]
    while todo:
        p = todo.pop()
        kids = [c for c, st in stats.items() if st[0] == p and c not in below]
        below.update(kids)
        todo.extend(kids)
    return {pid: stats[pid][1] for pid in below if pid != os.getpid() and "ray" in _cmdline(pid)}


def _alive(recorded: dict[int, int]) -> list[int]:
    """The recorded processes still running (same pid and start time; a zombie is not running)."""
    out = []
    for pid, started in recorded.items():
        st = _stat(pid)
        if st is not None and st[1] == started and st[2] != "Z":
            out.append(pid)
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def reap(recorded: dict[int, int], *, grace_s: float = GRACE_S) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, to each recorded process still alive; how many were found."""
    found = _alive(recorded)
    _signal(found, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive({p: recorded[p] for p in found}):
        time.sleep(0.1)
    _signal(_alive({p: recorded[p] for p in found}), signal.SIGKILL)
    return len(found)


def watch(driver: int, fd: int = 0, *, poll_s: float = POLL_S) -> int:
    """Record `driver`'s tree until `fd` reads end-of-file, then reap what was recorded."""
    recorded: dict[int, int] = {}
    while True:
        ready, _, _ = select.select([fd], [], [], poll_s)
        if ready and not os.read(fd, 1024):
            break
        recorded.update(_tree(driver))
        recorded = {pid: recorded[pid] for pid in _alive(recorded)}
    return reap(recorded)


_REAPERS: list[subprocess.Popen] = []  # held for the life of this process: their pipes close when it ends


def start_reaper() -> subprocess.Popen | None:
    """The reaper of this process's cluster (call right after starting it). The pipe's write end stays in this
    process only (not inheritable), so it closes exactly when this process ends. Linux only (it reads /proc):
    elsewhere None, and Ray's own clean-up is all there is."""
    if not os.path.isdir("/proc/self"):
        return None
    proc = subprocess.Popen([sys.executable, "-m", "raysim.engine.reaper", str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
    _REAPERS.append(proc)
    return proc


if __name__ == "__main__":
    watch(int(sys.argv[1]))
