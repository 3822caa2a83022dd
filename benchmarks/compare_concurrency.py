"""`raysim compare --max-concurrent N` against the same table run one by one (issue 28).

    python benchmarks/compare_concurrency.py [--concurrent 2] [--rounds 3] [--seeds 1,2,3] [--methods zeroshot,promptfl]
                                             [--clients 4] [--keep DIR]

Runs one table twice, each time in a fresh process and a fresh output folder: `--max-concurrent 1` (the
runs one after another in the driver) and `--max-concurrent N` (the runs as Ray tasks on a local cluster
the command starts, N at once). The default table is 2 methods x 3 seeds = 6 runs of PromptFL / zero-shot on
digits with a tiny random CLIP (inline backend, execution.num_threads=1, so each run reserves one CPU).
Prints the wall time of each command (process start to exit: Python and Ray start-up included), and
checks that table.csv is identical as text and every run's results.csv identical in its accuracy and
loss columns (bitwise, as written); exits 1 when they differ.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("round", "in_client", "cross_client", "hm", "train_loss")


def table_command(out: Path, args: argparse.Namespace, concurrent: int) -> list[str]:
    return [sys.executable, "-m", "raysim", "compare", "--methods", args.methods, "--seeds", args.seeds,
            "--rounds", str(args.rounds), "--max-concurrent", str(concurrent), "--out", str(out),
            "data.dataset=digits", "data.shots=16", "model.name=raysim-tiny", "model.pretrained=",
            f"train.num_clients={args.clients}", "eval.every=1", "eval.last=1", "execution.backend=inline",
            "execution.num_threads=1", "execution.address=local", "output.tensorboard=false"]


def results(out: Path) -> tuple[str, dict[str, list[tuple[str, ...]]]]:
    runs = {}
    for path in sorted(out.rglob("results.csv")):
        with open(path, newline="") as f:
            runs[path.parent.relative_to(out).as_posix()] = [tuple(r[k] for k in COLUMNS) for r in csv.DictReader(f)]
    return (out / "table.csv").read_text(), runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrent", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--methods", default="zeroshot,promptfl")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--keep", default="", help="folder to keep both tables in (default: a temporary one)")
    args = p.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="compare-concurrency-"))
    walls, outs = {}, {}
    for n in (1, args.concurrent):
        out = base / f"max-concurrent-{n}"
        cmd = table_command(out, args, n)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        walls[n] = time.perf_counter() - t0
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        outs[n] = out
        print(f"--max-concurrent {n}: {walls[n]:.1f} s wall ({out})", flush=True)
    (t1, r1), (tn, rn) = results(outs[1]), results(outs[args.concurrent])
    same = t1 == tn and r1 == rn and len(r1) > 0
    print(f"runs: {len(r1)}; speed-up x{walls[1] / walls[args.concurrent]:.2f}; table.csv and results identical: {same}")
    print(t1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
