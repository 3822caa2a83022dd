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

The FLOPs beside the times (`--flops`, on by default): each cell runs once more for two rounds, round 1 (the
same participants, data and Poisson batches in both loops: every client draws from its own per-(round,
client) stream) under torch's FlopCounterMode, which counts every tensor op of the round: the forwards, the
backwards and DP-SGD's per-example gradients (vmap's batched shapes). Printed per cell: GFLOP of that round
client by client and batched, and for each DP row the FLOP ratio of the DP round over the non-DP round beside
its time ratio: where the time ratio is near the FLOP ratio the DP round is at its FLOP bound; where it is
above, the round spends time that is not arithmetic (Python, small kernels). Round 1 of the two-round run is
not the timed rounds 1-3 of the timed run (other participants), so the two ratios sit side by side only
approximately; the batched / client-by-client FLOP ratio is exact (the same round in both).
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
    from raysim.build import build_config
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


def round_flops(cfg) -> float:
    """The FLOPs of round 1 of `cfg` (a two-round run: round 0 builds and warms; FlopCounterMode around round 1
    only)."""
    from torch.utils.flop_counter import FlopCounterMode

    import raysim.engine.loop as loop

    assert cfg.train.rounds == 2, "round_flops counts round 1 of a two-round run"
    counted: list[float] = []
    one_round = loop._one_round

    def counting(cfg_, backend, r, **kw):
        if r != 1:
            return one_round(cfg_, backend, r, **kw)
        mode = FlopCounterMode(display=False)
        with mode:
            out = one_round(cfg_, backend, r, **kw)
        counted.append(float(mode.get_total_flops()))
        return out

    loop._one_round = counting
    try:
        loop.run(cfg)
    finally:
        loop._one_round = one_round
    assert len(counted) == 1, "round 1 was not counted"
    return counted[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["promptfl", "dpfpl", "fedpgp", "fedotp", "pfedmoap", "fedsept", "fedpha"])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dp", type=float, nargs="+", default=[0.0, 1.0], help="dp.epsilon values (0 = no DP)")
    ap.add_argument("--no-flops", dest="flops", action="store_false", help="do not count each cell's round FLOPs")
    args = ap.parse_args(argv)

    from raysim.build import make_method
    from raysim.metrics import markdown_table

    tmp = Path(tempfile.mkdtemp(prefix="raysim-batched-methods-"))
    rows = []
    for method in args.methods:
        base: dict[bool, tuple[float, float]] = {}  # the non-DP cell's (s/round, FLOPs), per loop
        for eps in args.dp:
            runs: dict[bool, list[float]] = {False: [], True: []}
            for rep in range(args.repeats):
                for batch in (False, True):
                    cfg = config(tmp, f"{method}-{eps}-{batch}-{rep}", method, args.clients, args.per_round, args.rounds, eps, batch)
                    assert make_method(cfg).supports_batching() or not batch, f"{method} does not stack clients"
                    runs[batch].append(seconds(cfg))
            seq, bat = statistics.median(runs[False]), statistics.median(runs[True])
            row = [method, f"{eps:g}" if eps else "off", f"{seq:.3f}", f"{bat:.3f}", f"{seq / bat:.2f}"]
            if args.flops:
                flops = {b: round_flops(config(tmp, f"{method}-{eps}-{b}", method, args.clients, args.per_round, 2, eps, b))
                         for b in (False, True)}
                row += [f"{flops[False] / 1e9:.2f}", f"{flops[True] / 1e9:.2f}"]
                if not eps:
                    base = {b: ((seq, bat)[b], flops[b]) for b in (False, True)}
                if eps and base:  # a DP row after its method's non-DP row: both ratios per loop
                    for b in (False, True):
                        row += [f"{(seq, bat)[b] / base[b][0]:.1f}", f"{flops[b] / base[b][1]:.1f}"]
                else:
                    row += ["", "", "", ""]
            rows.append(row)
            print(rows[-1], flush=True)
    print(f"\ndigits, raysim-tiny (random), {args.clients} clients, {args.per_round} per round, batch 32, one local epoch, "
          f"{args.rounds} rounds x {args.repeats} repeats, inline")
    head = ["method", "DP-SGD epsilon", "s / round, client by client", "s / round, batched", "speed-up"]
    if args.flops:
        head += ["GFLOP / round, client by client", "GFLOP / round, batched", "DP / non-DP time, client by client",
                 "DP / non-DP FLOPs, client by client", "DP / non-DP time, batched", "DP / non-DP FLOPs, batched"]
    print(markdown_table(head, rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
