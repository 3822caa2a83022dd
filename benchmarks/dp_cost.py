"""What DP-SGD costs a prompt method's local step, measured beside its FLOP bound.

    python benchmarks/dp_cost.py [--methods promptfl,fedsept] [--batch 16] [--steps 4] [--repeats 3]
                                 [--microbatch 8] [--threads 1] [--model raysim-clip --pretrained bundled]
                                 [--before old_dpsgd.py]   # e.g. git show c596a1a:privacy/dpsgd.py > old_dpsgd.py

The default run's setting (README "The offline benchmark"): raysim-clip, the 10 `synthetic` class names,
n_ctx=4, every client holding 16 examples, so a DP-SGD batch of B=16 (Poisson with q=1). Each method's own
`local_train` runs `--steps` batches on random unit image features (a step's cost does not depend on their
values), once with the non-private handle and once with DP-SGD (sigma=1, clip=1), alternating `--repeats`
times so the machine's drift cancels; the median seconds per step are reported.

The FLOP bound. The trainable prompt sits at the text tower's input, so every example's gradient needs
the text tower's backward: with F the FLOPs of the text forward over the step's S sequences (C classes,
times M experts for FedSEPT) and Bw the FLOPs of one input-gradient backward through it (the tower is
frozen: no weight gradients, so Bw is about F, not 2F), a non-private step costs F + Bw and a DP-SGD step
at least F + B * Bw (one shared forward, B per-example cotangents pulled back through it):

    bound = (F + B * Bw) / (F + Bw)  ~  (1 + B) / 2   when Bw ~ F.

F and Bw are counted here with torch's FlopCounterMode on the method's own text forward; `counted` is the
FLOP ratio of the two steps as implemented (the DP step also counted under FlopCounterMode, which sees the
batched backward's batched shapes), so `counted / bound` > 1 is work beyond the bound (e.g. FedSEPT's
extra plain backward for its private tensors).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(method_name: str, args):
    import torch

    from raysim.build import build_config, env_spec, make_method
    from raysim.data.synthetic import SyntheticParams

    cfg = build_config({
        "method": method_name,
        "model": {"name": args.model, "pretrained": args.pretrained},
        "train": {"batch_size": args.batch, "n_ctx": args.n_ctx, "num_clients": 1, "ctx_init": ""},
        "execution": {"backend": "inline", "device": args.device, "num_threads": args.threads},
    })
    method = make_method(cfg)
    classnames = list(SyntheticParams().classes)[: args.classes]
    env = method.build_env(env_spec(cfg, classnames), role="client")
    return cfg, method, env, torch


def client_data(env, n: int, num_classes: int, torch):
    from raysim.methods.base import ClientData

    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(n, env.feature_dim, generator=g), dim=-1)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return ClientData(0, x, y, x[:0], y[:0], num_classes)


BEFORE = None  # the DPSGD class of another privacy/dpsgd.py (--before), timed beside this one's


def load_before(path: str):
    """The DPSGD class of a privacy/dpsgd.py file, e.g. a previous version: `git show REV:privacy/dpsgd.py > old.py`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("raysim.privacy._dpsgd_before", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.DPSGD


def handle(dp: bool, microbatch: int, torch, cls=None):
    from raysim.privacy import DPSGD, NoDP

    if not dp:
        return NoDP()
    return (cls or DPSGD)(sigma=1.0, clip=1.0, sample_rate=1.0, generator=torch.Generator().manual_seed(1), microbatch=microbatch)


def step_seconds(method, env, shared, private, data, dp: bool, microbatch: int, torch, cls=None) -> tuple[float, float]:
    """(wall, CPU) seconds per step: on a shared machine the process's CPU time is the steadier of the two."""
    from raysim.sampling import generator

    h = handle(dp, microbatch, torch, cls)
    t0, c0 = time.perf_counter(), time.process_time()
    method.local_train(env, shared, private, data, rng=generator(1, "bench"), privacy=h)
    steps = max(1, h.steps)
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def text_flops(method, env, shared, private, torch) -> tuple[float, float, int]:
    """(F, Bw, S): FLOPs of the method's text forward, of one input-gradient backward through it, and its
    number of sequences. Read from the method's gradient-inversion hook (PromptLossParts.text), which is
    exactly the text forward of a step."""
    from torch.utils.flop_counter import FlopCounterMode

    parts = method.loss_parts(env, private)
    theta = shared[parts.name].clone().to(env.device).requires_grad_(True)
    with FlopCounterMode(display=False) as fc:
        text = parts.text(theta)
    forward = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc:
        torch.autograd.grad(text, theta, grad_outputs=torch.ones_like(text))
    backward = fc.get_total_flops()
    return float(forward), float(backward), int(text.numel() // text.shape[-1])


def step_flops(method, env, shared, private, data, dp: bool, microbatch: int, torch, cls=None) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from raysim.sampling import generator

    h = handle(dp, microbatch, torch, cls)
    with FlopCounterMode(display=False) as fc:
        method.local_train(env, shared, private, data, rng=generator(1, "bench"), privacy=h)
    return fc.get_total_flops() / max(1, h.steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="promptfl,fedsept")
    p.add_argument("--model", default="raysim-clip")
    p.add_argument("--pretrained", default="bundled")
    p.add_argument("--classes", type=int, default=10, help="C, the number of class names (synthetic's, in order)")
    p.add_argument("--batch", type=int, default=16, help="B, the DP-SGD batch (the default run: 16 examples per client)")
    p.add_argument("--n-ctx", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="batches per timed local_train call")
    p.add_argument("--repeats", type=int, default=3, help="alternating (non-DP, DP) timing pairs per method")
    p.add_argument("--microbatch", type=int, default=8, help="dp.microbatch for the DP handle (0 = automatic)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--before", default="", help="another privacy/dpsgd.py (e.g. `git show REV:privacy/dpsgd.py > old.py`) "
                   "whose DP step is timed and counted beside this one's, alternating")
    args = p.parse_args(argv)
    before = load_before(args.before) if args.before else None

    rows = []
    for name in [m.strip() for m in args.methods.split(",") if m.strip()]:
        cfg, method, env, torch = build(name, args)
        torch.set_num_threads(args.threads)
        from raysim.sampling import generator

        shared = method.init_shared(env, generator(1, "server-init"))
        data = client_data(env, args.batch * args.steps, len(env.classnames), torch)
        private = method.init_private(env, data, generator(1, "init", 0))
        step_seconds(method, env, shared, private, data, False, args.microbatch, torch)  # warm-up (allocator, first calls)
        step_seconds(method, env, shared, private, data, True, args.microbatch, torch)
        plain, dp, old = [], [], []
        for _ in range(args.repeats):
            plain.append(step_seconds(method, env, shared, private, data, False, args.microbatch, torch))
            dp.append(step_seconds(method, env, shared, private, data, True, args.microbatch, torch))
            if before is not None:
                old.append(step_seconds(method, env, shared, private, data, True, args.microbatch, torch, before))
        f, bw, seqs = text_flops(method, env, shared, private, torch)
        one = client_data(env, args.batch, len(env.classnames), torch)  # one step each for the FLOP count
        counted = step_flops(method, env, shared, private, one, True, args.microbatch, torch) / max(
            1.0, step_flops(method, env, shared, private, one, False, args.microbatch, torch))
        b = args.batch
        extra = {}
        if before is not None:
            extra = dict(old_cpu=statistics.median(t[1] for t in old), old_counted=step_flops(
                method, env, shared, private, one, True, args.microbatch, torch, before) / max(
                1.0, step_flops(method, env, shared, private, one, False, args.microbatch, torch)))
        rows.append(dict(**extra, method=name, seqs=seqs,
                         plain=statistics.median(t[0] for t in plain), dp=statistics.median(t[0] for t in dp),
                         plain_cpu=statistics.median(t[1] for t in plain), dp_cpu=statistics.median(t[1] for t in dp),
                         bound=(f + b * bw) / (f + bw), r=bw / max(f, 1.0), counted=counted))

    print(f"### DP-SGD step cost ({args.model}, C={args.classes}, B={args.batch}, n_ctx={args.n_ctx}, "
          f"dp.microbatch={args.microbatch}, {args.threads} thread(s), {args.device}; median of {args.repeats})\n")
    print("| method | sequences S | non-DP s/step (CPU s) | DP s/step (CPU s) | measured DP / non-DP (CPU) | "
          "FLOP bound (F + B Bw)/(F + Bw) | Bw / F | counted FLOP ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['seqs']} | {r['plain']:.4f} ({r['plain_cpu']:.4f}) | {r['dp']:.4f} ({r['dp_cpu']:.4f}) | "
              f"{r['dp'] / r['plain']:.2f} ({r['dp_cpu'] / r['plain_cpu']:.2f}) | "
              f"{r['bound']:.2f} | {r['r']:.2f} | {r['counted']:.2f} |")
    if before is not None:
        print(f"\nBefore ({args.before}), the same steps alternated with the ones above:\n")
        print("| method | DP / non-DP (CPU), before | after | counted FLOP ratio, before | after |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['method']} | {r['old_cpu'] / r['plain_cpu']:.2f} | {r['dp_cpu'] / r['plain_cpu']:.2f} | "
                  f"{r['old_counted']:.2f} | {r['counted']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
