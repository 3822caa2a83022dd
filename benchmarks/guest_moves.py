"""What moving a stack's guests costs: client-batched rounds whose stacks span hosts, at 1,000 and 100,000 clients.

    python benchmarks/guest_moves.py [--clients 1000 100000] [--per-round 100] [--rounds 4] [--hosts 2] [--dp 1.0]

Client-batched training plans a round's stacks from its participants alone (raysim/engine/batched.py
`stacked_round`): the host of a stack's first member trains it, and its members that live on other hosts
("guests") are brought there and back: their own host copies their private state, privacy state (DP
calibration, ledger) and calibration count (`ClientHost.export_guests`), the training host installs them for
the call and packs them up again (`train_stacks`), and their own host puts the results back
(`settle_guests`). This benchmark times that traffic in a real engine run.

Workload: scale.py's (PromptFL, the peer workload's width-64 random CLIP, features written straight into the
cache, clients split IID, one SGD step per client), `--per-round` clients a round, DP-SGD at dp.epsilon=--dp
(so every guest carries a ledger; 0: DP off), execution.batch_clients=true, stack_size = --per-round (one
stack a round), backend=inline with --hosts in-process client hosts (pooled: client c on host c mod H, so
about (H-1)/H of a stack's members are guests). The first round (warm-up) is left out.

It reports, per timed round and per guest (medians over the rounds):

- export: `ClientHost.export_guests` (a deep copy of the private state, the privacy snapshot);
- settle: `ClientHost.settle_guests` (putting the results back), without the checkpoint writes that end the call
  (`ClientHost.commit`; likewise taken out of `train_stacks` below);
- the host-side install and pack-up inside `train_stacks`: its wall time minus the stack's own training,
  `raysim.engine.batched.train_stacks`;
- serialise: pickle.dumps + pickle.loads of the exported and the returned guests (what crossing to a Ray
  actor through the driver adds, twice each way; Ray's own serialiser is pickle protocol 5 with out-of-band
  tensor buffers, so this is of the same order, not Ray's exact cost), and the bytes moved per guest;
- the round's wall time (`results.csv` seconds), for scale.

Inline, the move is in process: nothing crosses a process boundary; on Ray each guest is a round trip
own host -> driver -> training host -> driver -> own host, whose serialisation is the `serialise` column
plus Ray's per-call latency (one export, one train and one settle call per host and round, not per guest).
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(clients: int, per_round: int, rounds: int, hosts: int, dp: float, cache_dir: str, out_dir: str) -> dict:
    import benchlib
    import scale

    from raysim.build import build_config
    from raysim.config import merge_config
    from raysim.engine import batched
    from raysim.engine.hosts import ClientHost
    from raysim.engine.loop import run

    model = benchlib.register_bench_model()
    spec = {"clients": clients, "per_round": per_round, "rounds": rounds, "eval": False, "actors": hosts,
            "train_per_client": 10, "test_per_client": 2, "seed": 0, "dim": 64, "model": model, "cache_dir": cache_dir,
            "image_size": 32, "set": []}
    scale.register_dataset(spec)
    values = scale.config(spec, "inline", out_dir)
    extra = {"execution": {"batch_clients": True, "stack_size": per_round, "num_actors": hosts}}
    if dp:
        extra["dp"] = {"epsilon": dp}
    cfg = build_config(merge_config(values, extra))

    per_round_log: list[dict] = []
    active: list[str] = []  # the timed calls running now, innermost last

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            active.append(name)
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                active.pop()
            per_round_log[-1][name] += time.perf_counter() - t0
            return out
        return wrapper

    def commit(self, round_idx):  # the checkpoint writes that end a host's calls are not moves: taken out of them
        t0 = time.perf_counter()
        orig_commit(self, round_idx)
        if active and per_round_log:
            per_round_log[-1][active[-1]] -= time.perf_counter() - t0

    orig_export, orig_train, orig_settle = ClientHost.export_guests, ClientHost.train_stacks, ClientHost.settle_guests
    orig_commit = ClientHost.commit
    orig_stacks = batched.train_stacks

    def export(self, round_idx, by_trainer):
        if not per_round_log or per_round_log[-1]["round"] != round_idx:
            per_round_log.append({"round": round_idx, "export": 0.0, "settle": 0.0, "train_stacks": 0.0, "stack_training": 0.0,
                                  "guests": 0, "ser": 0.0, "bytes": 0})
        out = timed("export", orig_export)(self, round_idx, by_trainer)
        t0 = time.perf_counter()
        blob = pickle.dumps(out, protocol=5)
        pickle.loads(blob)
        per_round_log[-1]["ser"] += time.perf_counter() - t0
        per_round_log[-1]["bytes"] += len(blob)
        per_round_log[-1]["guests"] += sum(len(v) for v in out.values())
        return out

    def train_stacks(self, round_idx, stacks, shared, guests):
        out = timed("train_stacks", orig_train)(self, round_idx, stacks, shared, guests)
        t0 = time.perf_counter()
        blob = pickle.dumps(out[2], protocol=5)
        pickle.loads(blob)
        per_round_log[-1]["ser"] += time.perf_counter() - t0
        per_round_log[-1]["bytes"] += len(blob)
        return out

    ClientHost.export_guests = export  # type: ignore[method-assign]
    ClientHost.commit = commit  # type: ignore[method-assign]
    ClientHost.train_stacks = train_stacks  # type: ignore[method-assign]
    ClientHost.settle_guests = lambda self, *a: timed("settle", orig_settle)(self, *a)  # type: ignore[method-assign]
    batched.train_stacks = lambda *a: timed("stack_training", orig_stacks)(*a)
    try:
        t0 = time.perf_counter()
        res = run(cfg)
        total = time.perf_counter() - t0
    finally:
        ClientHost.export_guests, ClientHost.train_stacks, ClientHost.settle_guests = orig_export, orig_train, orig_settle
        ClientHost.commit = orig_commit  # type: ignore[method-assign]
        batched.train_stacks = orig_stacks
    seconds = {row["round"]: row["seconds"] for row in res.rounds}
    timed_rounds = [r for r in per_round_log if r["round"] > 0 and r["guests"]]
    med = statistics.median

    def per_guest(key: str) -> float:
        return med(r[key] / r["guests"] for r in timed_rounds)

    return {
        "clients": clients, "guests/round": med(r["guests"] for r in timed_rounds),
        "export_us": 1e6 * per_guest("export"),
        "install_us": 1e6 * med((r["train_stacks"] - r["stack_training"]) / r["guests"] for r in timed_rounds),
        "settle_us": 1e6 * per_guest("settle"), "serialise_us": 1e6 * per_guest("ser"), "bytes": per_guest("bytes"),
        "moves_ms": 1e3 * med(r["export"] + r["settle"] + r["train_stacks"] - r["stack_training"] for r in timed_rounds),
        "round_ms": 1e3 * med(seconds[r["round"]] for r in timed_rounds), "run_s": total,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1000, 100000])
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds (after one warm-up round)")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--dp", type=float, default=1.0, help="dp.epsilon (0: DP off)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, args.per_round, args.rounds, args.hosts, args.dp, str(Path(tmp) / "cache"), str(Path(tmp) / f"run{n}"))
                for n in args.clients]
    print(f"per round: {args.per_round} clients, one stack, {args.hosts} hosts inline, dp.epsilon={args.dp}; "
          f"medians over {args.rounds} rounds")
    print("| clients | guests / round | export us / guest | install + pack us / guest | settle us / guest | "
          "serialise us / guest | bytes / guest | moves ms / round | round ms | run s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['clients']:,} | {r['guests/round']:.0f} | {r['export_us']:.0f} | {r['install_us']:.0f} | {r['settle_us']:.0f} | "
              f"{r['serialise_us']:.0f} | {r['bytes']:,.0f} | {r['moves_ms']:.1f} | {r['round_ms']:.0f} | {r['run_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
