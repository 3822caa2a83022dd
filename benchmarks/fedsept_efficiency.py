"""Client-side efficiency of FedSEPT against PromptFL (the columns of fedsept.txt Table 5).

At real ViT-B/16 size (open_clip "ViT-B-16", random weights: time, FLOPs, bytes and memory do not depend
on the weights). Image features are frozen in every method, so only the text tower is exercised and the
inputs are random unit vectors of the image-feature width (512).

Columns, per client:
  Comm. (KiB)   upload + download of the per-round shared state, fp32
  Lat. (ms)     one predictor call on a batch of --batch images (median of --repeats, after one warm-up)
  FLOPs (G)     the same call, counted by torch.utils.flop_counter.FlopCounterMode
  1st pass      building the predictor from a new model (text features computed) plus that first call:
                time and FLOPs (what every batch costs without a cache)
  Train (s/r)   one local round (`local_train`) on --train-samples examples, DP-SGD on the shared tensor
  Mem. (MB)     peak memory of that single-batch inference: torch.cuda.max_memory_allocated on a GPU;
                on the CPU the process's peak resident set (VmHWM, reset before the call)
  +Mem. (MB)    the increase of that peak over the memory in use just before the call (working memory)

Rows: PromptFL; FedSEPT (logit fusion, expert text features cached once per model); FedSEPT-NC (no
cache: the M x C expert prompts are re-encoded for every batch, i.e. the first pass); FedSEPT-PF
(prompt-level fusion: a prompt per input, B x C prompts encoded per batch); FedSEPT-patch (the patch-token
router of SPEC 1.3: the router attends over the image tower's K tokens, 197 x 768 for ViT-B/16, random here).

    python benchmarks/fedsept_efficiency.py --classes 10 --batch 8 --device cpu
    python benchmarks/fedsept_efficiency.py --actors 4 --actor-gpus 0.25     # 4 client actors sharing one GPU
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


def _status_kib(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(m.group(1)) if m else 0


class PeakMemory:
    """Peak memory of a block, in MB: (peak, increase over the start)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            try:
                Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            except OSError:
                pass
            self.start = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.peak = _status_kib("VmHWM") * 1024
        return False

    @property
    def mb(self) -> tuple[float, float]:
        return self.peak / 2**20, (self.peak - self.start) / 2**20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_methods(n_ctx: int, batch: int, experts: int, rank: int):
    from raysim.methods import TrainConfig, get_method

    train = TrainConfig(n_ctx=n_ctx, batch_size=batch, lr=0.001)
    fed = get_method("fedsept")
    base = dict(experts=experts, rank=rank)
    return [
        ("PromptFL", get_method("promptfl")(train, None)),
        ("FedSEPT", fed(train, fed.Options(**base))),
        ("FedSEPT-NC", fed(train, fed.Options(**base, cache_text=False))),
        ("FedSEPT-PF", fed(train, fed.Options(**base, fusion="prompt"))),
        ("FedSEPT-patch", fed(train, fed.Options(**base, router="patch"))),
    ]


def num_tokens(model: str) -> int:
    """Tokens of an open_clip ViT's image tower: CLS + (image / patch)^2."""
    import open_clip

    vc = (open_clip.get_model_config(model) or {}).get("vision_cfg", {})
    size, patch = vc.get("image_size", 224), vc.get("patch_size", 16)
    size = size[0] if isinstance(size, (list, tuple)) else size
    return 1 + (size // patch) ** 2


def measure(name, method, env, args, device) -> dict[str, float]:
    from raysim.methods import ClientData
    from raysim.privacy.dpsgd import DPSGD, NoDP

    g = torch.Generator().manual_seed(0)
    D, C = env.feature_dim, len(env.classnames)
    shared = {k: v.to(device) for k, v in method.init_shared(env, g).items()}
    n = args.train_samples or 2 * args.batch
    x = F.normalize(torch.randn(n, D, generator=g), dim=-1)
    y = torch.randint(0, C, (n,), generator=g)
    toks = None
    if method.needs().tokens:  # random tokens of the image tower's shape, float16 as cached
        toks = torch.randn(n, num_tokens(args.model), env.token_dim, generator=g).to(torch.float16)
    data = ClientData(0, x, y, x[: args.batch], y[: args.batch], C, tokens_train=toks,
                      tokens_test=None if toks is None else toks[: args.batch])
    private = method.init_private(env, data, g)
    comm_kib = 2 * sum(t.numel() * t.element_size() for t in shared.values()) / 1024

    # one local round (DP-SGD on the uploaded tensor, as in the paper's setting)
    privacy = NoDP()
    if args.dp:
        privacy = DPSGD(sigma=1.0, clip=1.0, sample_rate=min(1.0, args.batch / n), generator=torch.Generator().manual_seed(1))
    sync(device)
    t0 = time.perf_counter()
    res = method.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(2), privacy=privacy)
    sync(device)
    train_s = time.perf_counter() - t0
    shared = {k: v.to(device) for k, v in res.upload.items()}
    private = res.private

    # first pass: build the predictor (FedSEPT fills its text cache here) and score one batch
    inputs = (data.x_test.to(device),) + (() if toks is None else (data.tokens_test.to(device),))
    sync(device)
    t0 = time.perf_counter()
    predict = method.predictor(env, shared, private)
    predict(*inputs)
    sync(device)
    first_ms = 1000 * (time.perf_counter() - t0)
    with FlopCounterMode(display=False) as fc:
        method.predictor(env, shared, private)(*inputs)
    first_gflops = fc.get_total_flops() / 1e9

    # steady state: the same predictor on the next batches
    sync(device)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        predict(*inputs)
        sync(device)
        times.append(time.perf_counter() - t0)
    lat_ms = 1000 * sorted(times)[len(times) // 2]  # median: robust to a shared machine
    with FlopCounterMode(display=False) as fc:
        predict(*inputs)
    gflops = fc.get_total_flops() / 1e9
    with PeakMemory(device) as pm:
        predict(*inputs)
    mem, mem_delta = pm.mb
    print(f"  {name}: done (train {train_s:.2f}s, latency {lat_ms:.2f}ms)", file=sys.stderr, flush=True)
    return {"comm": comm_kib, "lat": lat_ms, "flops": gflops, "first": first_ms, "first_flops": first_gflops,
            "train": train_s, "mem": mem, "mem_delta": mem_delta}


def table(rows: list[tuple[str, dict[str, float]]], ref: str = "FedSEPT") -> str:
    r = dict(rows)[ref]
    cols = [("comm", "Comm. (KiB)", "{:.2f}"), ("lat", "Lat. (ms)", "{:.3f}"), ("flops", "FLOPs (G)", "{:.4g}"),
            ("first", "1st pass (ms)", "{:.1f}"), ("first_flops", "1st-pass FLOPs (G)", "{:.4g}"), ("train", "Train (s/r)", "{:.3f}"),
            ("mem", "Mem. (MB)", "{:.1f}"), ("mem_delta", "+Mem. (MB)", "{:.1f}")]
    from raysim.metrics import markdown_table

    body = []
    for name, m in rows:
        cells = []
        for key, _, fmt in cols:
            ratio = m[key] / r[key] if r[key] > 0 else float("nan")
            cells.append(f"{fmt.format(m[key])} ({ratio:.2f}x)")
        body.append([name, *cells])
    return markdown_table(["Method", *(c[1] for c in cols)], body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="ViT-B-16", help="open_clip model (random weights)")
    p.add_argument("--classes", type=int, default=10, help="C, classes scored per input")
    p.add_argument("--batch", type=int, default=32, help="inference and training batch size")
    p.add_argument("--train-samples", type=int, default=0, help="examples in the local round (default 2 x batch)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--repeats", type=int, default=7, help="timed inference calls (after one warm-up)")
    p.add_argument("--n-ctx", type=int, default=16)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--no-dp", dest="dp", action="store_false", help="time the local round without DP-SGD")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed PromptFL warm-up round")
    p.add_argument("--only", default="", help="comma-separated subset of rows")
    p.add_argument("--actors", type=int, default=0, help="run the measurement in N Ray actors at once (0 = here)")
    p.add_argument("--actor-gpus", type=float, default=0.0, help="GPU fraction per actor, e.g. 0.25 (needs a GPU)")
    p.add_argument("--actor-cpus", type=float, default=1.0, help="CPUs per actor")
    p.add_argument("--address", default="", help="Ray cluster address for --actors (default: a local one)")
    args = p.parse_args(argv)

    if args.actors > 0:
        rows, dev = in_actors(args)
    else:
        rows, dev = run_rows(args)
    print(f"### Client-side efficiency ({args.model}, random weights; C={args.classes}, batch {args.batch}, "
          f"L={args.n_ctx}, M={args.experts}, r={args.rank}; {dev}; train: "
          f"{args.train_samples or 2 * args.batch} examples, {'DP-SGD' if args.dp else 'no DP'})\n")
    print(table(rows))
    cuda = args.actor_gpus > 0 if args.actors > 0 else args.device != "cpu" and torch.cuda.is_available()
    print("Ratios are to FedSEPT. Mem.: " + ("torch.cuda.max_memory_allocated during the call." if cuda
          else "peak RSS of the process during the call.") + " +Mem.: its increase over the memory in use before the call.")
    return 0


def run_rows(args) -> tuple[list[tuple[str, dict[str, float]]], str]:
    """Every row measured in this process: (rows, a description of the device)."""
    from raysim.models.clip import ModelSpec, build_clip_env, resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    classnames = [f"object number {i}" for i in range(args.classes)]
    t0 = time.perf_counter()
    env = build_clip_env(ModelSpec(args.model), classnames, args.n_ctx, device=device)
    print(f"{args.model} text tower on {device}, width {env.ctx_width}, feature dim {env.feature_dim} "
          f"({time.perf_counter() - t0:.1f}s to build)", file=sys.stderr)
    methods = build_methods(args.n_ctx, args.batch, args.experts, args.rank)
    if args.only:
        keep = {s.strip() for s in args.only.split(",")}
        methods = [(n, m) for n, m in methods if n in keep or n == "FedSEPT"]
    if args.warmup:  # first-use costs (allocator, autograd/vmap set-up) out of the timed rows
        measure("warm-up", methods[0][1], env, argparse.Namespace(**{**vars(args), "repeats": 1}), device)
    rows = [(name, measure(name, m, env, args, device)) for name, m in methods]
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return rows, dev


def in_actors(args) -> tuple[list[tuple[str, dict[str, float]]], str]:
    """The same measurement in `--actors` Ray actors at once, each holding `--actor-gpus` of a GPU (client
    actors sharing a GPU, as `client_gpus` does in a run). Each cell is the median over the actors; every
    actor's device is reported. The actors run concurrently, so latencies include the contention."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=args.address or None, include_dashboard=False, configure_logging=False, log_to_driver=False)
    gpus = float(ray.cluster_resources().get("GPU", 0))
    if args.actor_gpus > 0 and gpus == 0:
        raise SystemExit("--actor-gpus > 0 but the Ray cluster has no GPU")
    sub = argparse.Namespace(**{**vars(args), "actors": 0, "device": "cuda" if args.actor_gpus > 0 else "cpu"})
    # by reference to this module, never by value (run as a script, __main__ would drag torch's globals along)
    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    task = importlib.import_module("fedsept_efficiency")._actor_rows
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    remote = ray.remote(num_cpus=args.actor_cpus, num_gpus=args.actor_gpus)(task).options(
        runtime_env={"env_vars": {"PYTHONPATH": path}}
    )
    try:
        results = ray.get([remote.remote(sub) for _ in range(args.actors)])
    finally:
        if started:
            ray.shutdown()
    names = [n for n, _ in results[0][0]]
    rows = []
    for i, name in enumerate(names):
        cells = [r[0][i][1] for r in results]
        rows.append((name, {k: sorted(c[k] for c in cells)[len(cells) // 2] for k in cells[0]}))
    devices = sorted({r[1] for r in results})
    dev = f"{args.actors} Ray actors at once, {args.actor_gpus:g} GPU each, on {', '.join(devices)}"
    return rows, dev


def _actor_rows(args):
    """What one actor runs (this module is importable there: `in_actors` puts its folder on PYTHONPATH)."""
    rows, dev = run_rows(args)
    return rows, f"{dev} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')})"


if __name__ == "__main__":
    raise SystemExit(main())
