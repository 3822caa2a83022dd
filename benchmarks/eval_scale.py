"""What an evaluated round costs at many clients, next to a training round (issue 17 item 3).

    python benchmarks/eval_scale.py [--clients 1000] [--per-round 100] [--eval-clients 100] [--test 4]
    python benchmarks/eval_scale.py --clients 10000 --per-round 1000        # the issue's sizes

A generated federation (random class-clustered features of the tiny random CLIP's width, `--train` and
`--test` rows per client, every client's test split its own) through the engine's inline backend, as a
run uses it: `train_round` for `--rounds` rounds of `--per-round` clients, then `evaluate`:

- a global-model method (promptfl: Method.predicts_globally) evaluated on every client: the shared model
  scored once per test row, every client's In / Cross from those hits;
- the same method through the per-client path (as every method was before), on an `--eval-clients`
  sample only (on all clients it would cost clients x test rows predictions);
- a personal method (fedpgp: each client its own U V) with `eval.clients=--eval-clients`: each sampled
  client's model on the sampled clients' test splits.

Printed: seconds per training round (median), per evaluation, and the evaluation in training rounds.
The target is an evaluated round <= 3 training rounds at 10,000 clients.
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
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def federation(clients: int, train: int, test: int, classes: int, dim: int, seed: int = 0):
    """Random unit features around one random centre per class; client k's rows are contiguous."""
    import numpy as np

    from raysim.data.federation import FederationData

    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim)).astype(np.float32)

    def rows(n: int):
        y = rng.integers(0, classes, n)
        x = centres[y] + 0.8 * rng.standard_normal((n, dim)).astype(np.float32)
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), y.astype(np.int64)

    xtr, ytr = rows(clients * train)
    xte, yte = rows(clients * test)
    return FederationData(
        x_train=xtr, y_train=ytr, x_test=xte, y_test=yte,
        train_idx=[np.arange(k * train, (k + 1) * train) for k in range(clients)],
        test_idx=[np.arange(k * test, (k + 1) * test) for k in range(clients)],
        classnames=[f"class {c}" for c in range(classes)],
    )


def measure(method: str, data, args, tmp: Path, evaluations: dict[str, tuple[bool, int]]) -> dict[str, float]:
    """{"train": s per training round (median), name: s of that evaluation} for one method."""
    from raysim.build import build_config
    from raysim.engine.backends import InlineBackend
    from raysim.sampling import eval_clients, participants

    cfg = build_config({
        "method": method, "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": args.clients, "participation": args.per_round / args.clients, "rounds": args.rounds + 1,
                  "n_ctx": 4, "ctx_init": "", "batch_size": 32},
        "eval": {"batch_size": 512},
        "execution": {"backend": "inline"},
        "output": {"out_dir": str(tmp / method), "progress": False, "tensorboard": False},
    })
    b = InlineBackend(cfg, data, cfg.output.out_dir, -1)
    out: dict[str, float] = {}
    times = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        b.train_round(r, participants(cfg.train.seed, r, cfg.train.num_clients, cfg.train.participation))
        times.append(time.perf_counter() - t0)
    out["train"] = statistics.median(times)
    for name, (global_path, n) in evaluations.items():
        b.global_eval = global_path and b.global_eval
        sample = eval_clients(cfg.train.seed, args.clients, n)
        t0 = time.perf_counter()
        rows = b.evaluate(None if len(sample) == args.clients else sample)
        out[name] = time.perf_counter() - t0
        assert len(rows) == len(sample)
    b.shutdown()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=100, help="clients trained per round")
    ap.add_argument("--eval-clients", type=int, default=100, help="eval.clients of the sampled evaluations")
    ap.add_argument("--train", type=int, default=8, help="training rows per client")
    ap.add_argument("--test", type=int, default=4, help="test rows per client")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="training rounds timed (median)")
    ap.add_argument("--methods", default="promptfl,fedpgp", help="which of promptfl, fedpgp to measure")
    ap.add_argument("--before", type=int, default=2000,
                    help="also time promptfl's per-client path on every client (the cost before) up to this many clients")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="raysim-eval-scale-"))
    data = federation(args.clients, args.train, args.test, args.classes, dim=128)  # raysim-tiny's embedding width
    n = args.eval_clients
    rows = []
    methods = args.methods.split(",")
    if "promptfl" in methods:
        evals = {"all": (True, 0), "sample-per-client": (False, n)}
        if args.clients <= args.before:
            evals["before"] = (False, 0)
        res = measure("promptfl", data, args, tmp, evals)
        rows.append(["promptfl (global model), all clients, once per row", args.clients, res["train"], res["all"]])
        rows.append([f"promptfl, per-client path, eval.clients={n}", n, res["train"], res["sample-per-client"]])
        if "before" in res:
            rows.append(["promptfl, per-client path, all clients (before)", args.clients, res["train"], res["before"]])
    if "fedpgp" in methods:
        res = measure("fedpgp", data, args, tmp, {"sample": (False, n)})
        rows.append([f"fedpgp (personal), eval.clients={n}", n, res["train"], res["sample"]])
    from raysim.metrics import markdown_table

    print(f"{args.clients} clients ({args.train} train / {args.test} test rows each, {args.clients * args.test} test rows), "
          f"{args.per_round} trained per round, raysim-tiny (random), inline, 1 thread")
    print(markdown_table(
        ["evaluation", "clients evaluated", "train round (s)", "evaluated round's evaluation (s)", "in train rounds"],
        [[name, str(k), f"{t:.2f}", f"{e:.2f}", f"{e / t:.2f}"] for name, k, t, e in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
