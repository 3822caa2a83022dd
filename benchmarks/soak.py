"""Soak test: a long run stays flat. 1,000 clients x 200 rounds by default (PromptFL on the tiny random
CLIP and digits, IID, 10% participation), printing every 20 rounds the resident memory of every process
of the run (the driver, and with backend=ray its actors and Ray's own processes; read from /proc) and the size of the
run's state/ folder. Memory and state/ should stop growing once every client has been seen: whatever
grows after that is a leak, beyond the clients' own state.

    python benchmarks/soak.py                                   # 1,000 clients x 200 rounds, inline
    python benchmarks/soak.py --backend ray --actors 2          # the same through Ray actors
    python benchmarks/soak.py --clients 200 --rounds 60 key=value ...   # a smaller size; any config key

This is a benchmark, not a test: it takes minutes, and prints numbers to read (the README quotes one run).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def folder_size(path: Path) -> tuple[int, int]:
    """(bytes, files) under `path`."""
    size = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                size += os.path.getsize(os.path.join(root, n))
                files += 1
            except OSError:  # renamed away while we looked
                pass
    return size, files


def _proc(pid: int) -> tuple[int, str, int]:
    """(parent pid, name, RSS bytes) from /proc (Linux; no psutil needed)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rss = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    name = fields["Name"].strip() if cmd.rsplit("/", 1)[-1].startswith("python") or not cmd else cmd.rsplit("/", 1)[-1]
    return int(fields["PPid"]), name, rss


def processes_rss() -> list[tuple[str, int]]:
    """(name, RSS bytes) of this process and all its descendants (Ray's GCS, raylet, workers, actors)."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                table[int(d)] = _proc(int(d))
            except (OSError, KeyError, ValueError):  # gone while we looked
                pass
    me, out, todo = os.getpid(), [], [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in table:
            out.append(("driver" if pid == me else table[pid][1][:28], table[pid][2]))
        todo += [c for c, (ppid, _, _) in table.items() if ppid == pid]
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--participation", type=float, default=0.1)
    ap.add_argument("--every", type=int, default=20, help="print every N rounds")
    ap.add_argument("--backend", default="inline", choices=["inline", "ray"])
    ap.add_argument("--actors", type=int, default=2, help="backend=ray: client actors")
    ap.add_argument("--out", default="", help="run folder (default: a temporary one, removed at the end)")
    ap.add_argument("--cache-dir", default="~/.cache/raysim")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="more config keys (method=, data.dataset=, ...)")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from raysim.build import build_config
    from raysim.config import merge_config, parse_user_overrides
    from raysim.engine.loop import run
    from raysim.metrics import markdown_table

    tmp = None if a.out else tempfile.TemporaryDirectory(prefix="raysim-soak-")
    out = Path(a.out or tmp.name) / "run"
    values = {
        "method": "promptfl",
        "data": {"dataset": "digits", "partition": "iid", "shots": 0},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"n_ctx": 4, "num_clients": a.clients, "participation": a.participation, "rounds": a.rounds, "batch_size": 8},
        "eval": {"every": a.every, "last": 1},
        "execution": {"backend": a.backend, "num_actors": a.actors if a.backend == "ray" else 0},
        "output": {"progress": False, "tensorboard": True, "cache_dir": a.cache_dir, "out_dir": str(out)},
    }
    cfg = build_config(merge_config(values, parse_user_overrides(a.overrides)))
    print(f"soak: {cfg.method} on {cfg.data.dataset}, {cfg.train.num_clients} clients x {cfg.train.rounds} rounds, participation "
          f"{cfg.train.participation}, backend={cfg.execution.backend}"
          + (f" ({cfg.execution.num_actors} actors)" if cfg.execution.backend == "ray" else "")
          + f", tensorboard on; out_dir {out}", flush=True)
    rows = []
    snapshots: dict[int, list[tuple[str, int]]] = {}
    t0 = time.perf_counter()

    def on_round(row):
        r = int(row["round"]) + 1
        if r % a.every and r != cfg.train.rounds and r != 1:
            return
        procs = processes_rss()
        snapshots[r] = procs
        driver = sum(rss for name, rss in procs if name == "driver")
        state, files = folder_size(out / "state")
        whole, _ = folder_size(out)
        rows.append([r, f"{time.perf_counter() - t0:.0f}", mib(driver), mib(sum(rss for _, rss in procs)), len(procs),
                     mib(state), files, mib(whole)])
        print(f"round {r:4d}: {rows[-1][1]:>5} s  driver {rows[-1][2]} MiB  all {len(procs)} processes {rows[-1][3]} MiB  "
              f"state/ {rows[-1][5]} MiB in {files} files  out_dir {rows[-1][7]} MiB", flush=True)

    result = run(cfg, on_round=on_round)
    print()
    print(markdown_table(
        ["after round", "elapsed (s)", "driver RSS (MiB)", "all processes RSS (MiB)", "processes", "state/ (MiB)", "state/ files",
         "out_dir (MiB)"], rows))
    # over the second half every client has long been seen (and has its state): growth there is a leak
    last = rows[-1]
    first = min(rows, key=lambda row: abs(row[0] - cfg.train.rounds // 2))
    print(f"growth from round {first[0]} to {last[0]}: driver {float(last[2]) - float(first[2]):+.1f} MiB, all processes "
          f"{float(last[3]) - float(first[3]):+.1f} MiB, state/ {float(last[5]) - float(first[5]):+.2f} MiB "
          f"({last[6] - first[6]:+d} files); {time.perf_counter() - t0:.0f} s in all; HM {100 * result.summary['hm']:.2f} "
          "(1-2 training images per client on a random model: the accuracy is not the point)")
    if len(snapshots[first[0]]) > 1:  # which process grew (RSS counts shared pages, e.g. the object store, in each)
        before, after = snapshots[first[0]], snapshots[last[0]]
        if [n for n, _ in before] == [n for n, _ in after]:
            print(markdown_table(["process", f"RSS after round {first[0]} (MiB)", f"after round {last[0]} (MiB)", "growth (MiB)"],
                                 [[n, mib(b), mib(a), f"{(a - b) / 2**20:+.1f}"] for (n, b), (_, a) in zip(before, after)]))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
