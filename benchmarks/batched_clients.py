"""Client-batched local training (execution.batch_clients): s/round client by client vs in stacks.

    python benchmarks/batched_clients.py [--per-round 10 100] [--rounds 6] [--repeats 2] [--ray 0] [--dp 0]

The peer workload of issue 17: PromptFL on digits with a tiny random CLIP (raysim-tiny), 100 clients of
which 10 take part per round, one SGD step per client (each holds fewer examples than a batch); and the
same with 100 clients per round (participation 1). Timed per round after start-up (the first round warms
caches and is left out; the median of the rest): a plain single-process loop (`Method.local_train`
client by client and `aggregate`, nothing else), the engine inline with batch_clients=false, and the
engine inline with batch_clients=true (all clients on one host; --ray N adds the Ray backend with N
actors). Runs alternate, `--repeats` times, so the machine's drift spreads over all of them. Before any
timing it checks that the batched engine's uploads equal the client-by-client ones (1e-5).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def config(tmp: Path, tag: str, clients: int, per_round: int, rounds: int, **execution):
    from raysim.build import build_config
    return build_config({
        "method": "promptfl",
        "data": {"dataset": "digits", "partition": "iid", "shots": 0, "min_samples": 1},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": clients, "participation": per_round / clients, "rounds": rounds, "batch_size": 32},
        "eval": {"every": 10**6, "last": 0},
        "execution": {"backend": "inline", **execution},
        "output": {"progress": False, "tensorboard": False, "cache_dir": str(tmp / "cache"), "out_dir": str(tmp / tag)},
    })


def plain_loop(cfg) -> list[float]:
    """The same client and server code in one process: no hosts, privacy handles, checkpoints or logs."""
    import torch

    from raysim.build import env_spec, make_method
    from raysim.engine.loop import prepare_data
    from raysim.methods import Upload
    from raysim.privacy import NoDP
    from raysim.sampling import generator, participants

    torch.set_num_threads(cfg.execution.num_threads)
    method = make_method(cfg)
    data = prepare_data(cfg, method.needs(), progress=False)
    env = method.build_env(env_spec(cfg, data.classnames), role="client")
    shared = method.init_shared(env, generator(cfg.train.seed, "server-init"))
    clients = {cid: data.client(cid) for cid in range(cfg.train.num_clients)}
    times = []
    for r in range(cfg.train.rounds):
        t0 = time.perf_counter()
        uploads = []
        for cid in participants(cfg.train.seed, r, cfg.train.num_clients, cfg.train.participation):
            res = method.local_train(env, shared, {}, clients[cid], rng=generator(cfg.train.seed, "train", r, cid), privacy=NoDP())
            uploads.append(Upload(cid, res.upload, res.num_samples))
        shared = method.aggregate(env, shared, uploads, generator(cfg.train.seed, "server", r))
        times.append(time.perf_counter() - t0)
    return times


def engine_loop(cfg) -> list[float]:
    from raysim.engine.loop import run

    return [row["seconds"] for row in run(cfg).rounds]


def check_equal(tmp: Path, clients: int, per_round: int) -> int:
    """The batched engine's uploads against client by client's, two rounds (1e-5: float reassociation)."""
    import torch

    from raysim.engine.loop import run
    from raysim.storage.store import StateStore

    seen = []
    for batch in (False, True):
        cfg = config(tmp, f"check-{per_round}-{batch}", clients, per_round, 2, batch_clients=batch)
        cfg.output.record_uploads = True
        run(cfg)
        seen.append(StateStore(cfg.output.out_dir).load_uploads(1)["uploads"])
    a, b = seen
    assert a.keys() == b.keys()
    for c in a:
        torch.testing.assert_close(b[c]["ctx"], a[c]["ctx"], rtol=0, atol=1e-5)
    return len(a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--per-round", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ray", type=int, default=0, help="also the Ray backend with this many actors (0 = not)")
    ap.add_argument("--stack-size", type=int, default=None, help="execution.stack_size (default: the config's)")
    args = ap.parse_args(argv)

    from raysim.metrics import markdown_table

    tmp = Path(tempfile.mkdtemp(prefix="raysim-batched-"))
    extra = {} if args.stack_size is None else {"stack_size": args.stack_size}
    for per_round in args.per_round:
        n = check_equal(tmp, args.clients, per_round)
        print(f"checked: {n} clients' uploads batched == client by client (atol 1e-5)")
        runs: dict[str, list[float]] = {}
        med = lambda xs: statistics.median(xs[1:] if len(xs) > 1 else xs)  # noqa: E731 - the first round warms caches
        for rep in range(args.repeats):
            def cfg(tag, _p=per_round, _r=rep, **x):
                return config(tmp, f"{tag}-{_p}-{_r}", args.clients, _p, args.rounds, **x)

            runs.setdefault("plain single-process loop", []).append(med(plain_loop(cfg("plain"))))
            runs.setdefault("engine inline, batch_clients=false", []).append(med(engine_loop(cfg("seq", batch_clients=False))))
            runs.setdefault("engine inline, batch_clients=true", []).append(med(engine_loop(cfg("bat", batch_clients=True, **extra))))
            if args.ray:
                for batch in (False, True):
                    runs.setdefault(f"engine ray ({args.ray} actors), batch_clients={str(batch).lower()}", []).append(
                        med(engine_loop(cfg(f"ray{batch}", backend="ray", num_actors=args.ray, batch_clients=batch, **extra))))
        plain = statistics.median(runs["plain single-process loop"])
        print(f"\nPromptFL, digits, raysim-tiny (random), {args.clients} clients, {per_round} per round, one step each, "
              f"{args.rounds} rounds x {args.repeats} repeats")
        print(markdown_table(["loop", "s / round", "ratio to plain"],
                             [[k, f"{statistics.median(v):.4f}", f"{statistics.median(v) / plain:.2f}"] for k, v in runs.items()]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
