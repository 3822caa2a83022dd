"""Seconds per local step of a prompt method under each text-tower fast path (README "GPUs").

    python benchmarks/gpu_paths.py --device cuda --model ViT-B-16 --pretrained "" [--methods promptfl,fedsept]
                                   [--classes 10] [--batch 32] [--steps 5] [--repeats 3]

For each method the env (text tower + prompts) is built once; each variant switches the tower's fast
paths (`TextTower.set_fast_paths`, what execution.autocast / execution.compile do) and runs the method's
own `local_train` over `--steps` batches of random unit image features (warm-up call first, so torch.compile's
compilation is not timed; the `compile s` column is that first call). Variants: fp32; bf16 and fp16 autocast
(fp16 on CUDA only); torch.compile (inductor), alone and with bf16; and DP-SGD steps (sigma=1, clip=1) with
dp.microbatch=8 and 0 (sized from memory), in fp32 and bf16 (compile is refused with DP-SGD). `upload
rel. diff` is ||upload - upload_fp32|| / ||upload_fp32|| after the same steps from the same seed (DP rows:
against the fp32 DP row with microbatch 8).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dp_cost import build, client_data, handle  # noqa: E402

# (label, autocast, compile, DP-SGD microbatch or None for a non-private step)
VARIANTS = [
    ("fp32", "off", False, None),
    ("bf16 autocast", "bf16", False, None),
    ("fp16 autocast", "fp16", False, None),
    ("compile", "off", True, None),
    ("compile + bf16", "bf16", True, None),
    ("DP-SGD, microbatch 8", "off", False, 8),
    ("DP-SGD, microbatch auto", "off", False, 0),
    ("DP-SGD bf16, microbatch auto", "bf16", False, 0),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="promptfl,fedsept")
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--pretrained", default="")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--n-ctx", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default="", help="semicolon-separated labels to run (default: all that the device can)")
    p.add_argument("--compile-backend", default="inductor")
    args = p.parse_args(argv)

    import torch

    from raysim.models.clip import FastPaths
    from raysim.sampling import generator

    cuda = torch.device(args.device).type == "cuda"
    wanted = {v.strip() for v in args.variants.split(";") if v.strip()}
    variants = [v for v in VARIANTS if (not wanted or v[0] in wanted) and (cuda or v[1] != "fp16")]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    lines = []
    for name in [m.strip() for m in args.methods.split(",") if m.strip()]:
        cfg, method, env, _ = build(name, args)
        torch.set_num_threads(args.threads)
        shared = method.init_shared(env, generator(1, "server-init"))
        data = client_data(env, args.batch * args.steps, len(env.classnames), torch)
        private = method.init_private(env, data, generator(1, "init", 0))
        refs: dict[bool, dict] = {}

        def call(dp_mb, method=method, env=env, shared=shared, private=private, data=data):
            h = handle(dp_mb is not None, dp_mb or 0, torch)
            sync()
            t0 = time.perf_counter()
            res = method.local_train(env, shared, private, data, rng=generator(1, "bench"), privacy=h)
            sync()
            return (time.perf_counter() - t0) / max(1, h.steps), res.upload

        for label, autocast, compiled, dp_mb in variants:
            import torch._dynamo

            torch._dynamo.reset()
            env.tower.set_fast_paths(FastPaths(autocast, compiled, args.compile_backend), env.device)
            first, upload = call(dp_mb)  # warm-up: compilation, allocator, cuBLAS handles
            times = [call(dp_mb)[0] for _ in range(args.repeats)]
            ref = refs.setdefault(dp_mb is not None, upload)
            diff = max(float((upload[k].float() - ref[k].float()).norm() / ref[k].float().norm().clamp_min(1e-30)) for k in ref)
            lines.append((name, label, statistics.median(times), first, diff))
        env.tower.set_fast_paths(FastPaths(), env.device)

    dev = torch.cuda.get_device_name() if cuda else f"CPU, {args.threads} thread(s)"
    print(f"### Text-tower fast paths ({args.model}{' random weights' if not args.pretrained else ''}, C={args.classes}, "
          f"B={args.batch}, n_ctx={args.n_ctx}, {args.steps} steps; {dev}; median of {args.repeats})\n")
    print("| method | variant | s/step | vs fp32 (same method, same privacy) | first call s (compile) | upload rel. diff |")
    print("|---|---|---:|---:|---:|---:|")
    base: dict[tuple[str, bool], float] = {}
    for name, label, s, first, diff in lines:
        key = (name, label.startswith("DP"))
        base.setdefault(key, s)
        print(f"| {name} | {label} | {s:.4f} | {base[key] / s:.2f}x | {first:.1f} | {diff:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
