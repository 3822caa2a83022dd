"""Client-batched training of each prompt method that stacks: s/round client by client vs in stacks, without
DP and under DP-SGD at epsilon 1.

    python benchmarks/batched_methods.py [--methods promptfl dpfpl fedpgp fedotp pfedmoap fedsept fedpha] [--clients 20]
                                         [--per-round 8] [--rounds 4] [--repeats 1] [--dp 0 1]

Digits with a tiny random CLIP (raysim-tiny, whose ViT tower gives FedOTP's default patch tokens), `--clients`
clients (IID) of which `--per-round` take part per round, batch 32 (each client takes a few steps a round), one
local epoch; each method at its defaults (FedSEPT: 4 experts, the pooled router; pFedMoAP's clients have experts
from their second participation on; FedPHA without the EOT quirk, its clients' local prompts of 4-16 tokens).
The engine inline, all clients on one host, with execution.batch_clients=false and =true; per (method, epsilon) the median s/round over the
rounds after the first (which warms caches), median over `--repeats`, the two loops alternating. The
methods' own tests check that the stacks equal client by client (tests/engine/test_batched_prompt_methods.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def config(tmp: Path, tag: str, method: str, clients: int, per_round: int, rounds: int, epsilon: float, batch: bool):
    from raysim.config.checks import build_config

    values = {
        "method": method,
        "data": {"dataset": "digits", "partition": "iid", "shots": 0, "min_samples": 1},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": clients, "participation": per_round / clients, "rounds": rounds, "batch_size": 32},
        "eval": {"every": 10**6, "last": 0},
        "execution": {"backend": "inline", "batch_clients": batch},
        "output": {"progress": False, "tensorboard": False, "cache_dir": str(tmp / "cache"), "out_dir": str(tmp / tag)},
    }
    if epsilon:
        values["dp"] = {"epsilon": epsilon}
    return build_config(values)


def seconds(cfg) -> float:
    from raysim.engine.loop import run

    xs = [row["seconds"] for row in run(cfg).rounds]
    return statistics.median(xs[1:] if len(xs) > 1 else xs)  # the first round warms caches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["promptfl", "dpfpl", "fedpgp", "fedotp", "pfedmoap", "fedsept", "fedpha"])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dp", type=float, nargs="+", default=[0.0, 1.0], help="dp.epsilon values (0 = no DP)")
    args = ap.parse_args(argv)

    from raysim.config.checks import make_method
    from raysim.metrics import markdown_table

    tmp = Path(tempfile.mkdtemp(prefix="raysim-batched-methods-"))
    rows = []
    for method in args.methods:
        for eps in args.dp:
            runs: dict[bool, list[float]] = {False: [], True: []}
            for rep in range(args.repeats):
                for batch in (False, True):
                    cfg = config(tmp, f"{method}-{eps}-{batch}-{rep}", method, args.clients, args.per_round, args.rounds, eps, batch)
                    assert make_method(cfg).supports_batching() or not batch, f"{method} does not stack clients"
                    runs[batch].append(seconds(cfg))
            seq, bat = statistics.median(runs[False]), statistics.median(runs[True])
            rows.append([method, f"{eps:g}" if eps else "off", f"{seq:.3f}", f"{bat:.3f}", f"{seq / bat:.2f}"])
            print(rows[-1], flush=True)
    print(f"\ndigits, raysim-tiny (random), {args.clients} clients, {args.per_round} per round, batch 32, one local epoch, "
          f"{args.rounds} rounds x {args.repeats} repeats, inline")
    print(markdown_table(["method", "DP-SGD epsilon", "s / round, client by client", "s / round, batched", "speed-up"], rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
