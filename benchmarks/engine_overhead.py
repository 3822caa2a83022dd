"""Engine overhead: the same PromptFL workload through the Ray engine and through a plain loop.

    python benchmarks/engine_overhead.py [--clients 100] [--participation 0.1] [--rounds 5] [--actors 2]

The plain loop calls the very same client code (`Method.local_train`) and server code (`aggregate`) in
one process with no actors, no checkpoints and no logging. Both are timed per round after start-up
(Ray start and feature caching are excluded); the ratio is engine seconds / plain seconds. With more
than one actor the engine trains clients in parallel, so on a multi-core machine the ratio can be < 1.
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


def plain_loop(cfg, rounds: int) -> list[float]:
    import torch

    from raysim.build import env_spec, make_method
    from raysim.engine.loop import prepare_data
    from raysim.methods import ClientData, Upload
    from raysim.privacy import NoDP
    from raysim.sampling import generator, participants

    torch.set_num_threads(cfg.execution.num_threads)
    method = make_method(cfg)
    data = prepare_data(cfg, method.needs(), progress=False)
    env = method.build_env(env_spec(cfg, data.classnames), role="client")
    xtr, ytr = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    shared = method.init_shared(env, generator(cfg.train.seed, "server-init"))
    private: dict[int, dict] = {}
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        uploads = []
        for cid in participants(cfg.train.seed, r, cfg.train.num_clients, cfg.train.participation):
            idx = torch.as_tensor(data.train_idx[cid])
            cd = ClientData(cid, xtr[idx], ytr[idx], xtr[:0], ytr[:0], len(data.classnames))
            if cid not in private:
                private[cid] = method.init_private(env, cd, generator(cfg.train.seed, "init", cid))
            res = method.local_train(env, shared, private[cid], cd, rng=generator(cfg.train.seed, "train", r, cid), privacy=NoDP())
            private[cid] = res.private
            uploads.append(Upload(cid, res.upload, res.num_samples))
        shared = method.aggregate(env, shared, uploads, generator(cfg.train.seed, "server", r))
        times.append(time.perf_counter() - t0)
    return times


def engine_loop(cfg) -> list[float]:
    from raysim.engine.loop import run

    rows = run(cfg).rounds
    return [r["seconds"] for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--participation", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--model", default="raysim-clip", help="raysim-clip (bundled weights) or any open_clip model")
    ap.add_argument("--pretrained", default=None, help="default: bundled for raysim-clip, else random weights")
    ap.add_argument("--dataset", default="synthetic")
    ap.add_argument("--partition", default="iid")
    args = ap.parse_args(argv)

    from raysim.build import build_config
    from raysim.config import merge_config
    tmp = Path(tempfile.mkdtemp(prefix="raysim-bench-"))
    common = {
        "method": "promptfl",
        "data": {"dataset": args.dataset, "partition": args.partition, "beta": 0.5, "shots": 0, "min_samples": 5},
        "model": {"name": args.model,
                  "pretrained": args.pretrained if args.pretrained is not None else ("bundled" if args.model == "raysim-clip" else "")},
        "train": {"num_clients": args.clients, "participation": args.participation, "rounds": args.rounds},
        "eval": {"every": 10**6, "last": 0},
        "output": {"progress": False, "tensorboard": False, "cache_dir": str(tmp / "cache")},
    }

    def config(backend: str, out: str, **execution):
        return build_config(merge_config(common, {"execution": {"backend": backend, **execution}, "output": {"out_dir": str(tmp / out)}}))

    plain = plain_loop(config("inline", "plain"), args.rounds)
    inline = engine_loop(config("inline", "inline"))
    ray_t = engine_loop(config("ray", "ray", num_actors=args.actors))
    # the first round warms caches (allocator, lazy imports): report the median of the rest
    med = lambda xs: statistics.median(xs[1:] if len(xs) > 1 else xs)  # noqa: E731
    p, i, r = med(plain), med(inline), med(ray_t)
    print(f"PromptFL, {args.clients} clients, participation {args.participation}, {args.rounds} rounds, model {args.model}")
    from raysim.metrics import markdown_table

    print(markdown_table(["loop", "s / round", "ratio to plain"], [
        ["plain single-process loop", f"{p:.3f}", "1.00"],
        ["engine, backend=inline", f"{i:.3f}", f"{i / p:.2f}"],
        [f"engine, backend=ray ({args.actors} actors)", f"{r:.3f}", f"{r / p:.2f}"],
    ]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
