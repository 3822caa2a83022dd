"""Client-side efficiency of FedSEPT and its baselines (the columns of fedsept.txt Table 5).

At real ViT-B/16 size (open_clip "ViT-B-16", random weights: time, FLOPs, bytes and memory do not depend
on the weights). Image features are frozen in every method, so only the text tower is exercised and the
inputs are random unit vectors of the image-feature width (512); methods that read the image tower's tokens
get random tokens of its shape (197 x 768 for ViT-B/16, float16 as cached).

Every method is driven through its own Method API, as a run would: `build_env` (role client),
`init_shared`, `init_private`, one untimed first participation (no DP) and a server `aggregate` over K
clients' uploads (the measured client's and K - 1 stand-ins of the same shapes), so the timed round starts
from a steady state (pFedMoAP's bank holds K contexts and the client its own last one); then the timed
`local_train` with a DP-SGD handle, another `aggregate`, and the `predictor` of the new state.

Columns, per client:
  Comm. (KiB)   Up + Down of one round, fp32 as sent
  Up (KiB)      bytes of the tensors the client uploads (its declared `releases`)
  Down (KiB)    bytes of the broadcast it starts the round from (the server state without `server_only`
                keys); pFedMoAP's broadcast carries its expert bank, K x L x w floats (K = --clients)
  Lat. (ms)     one predictor call on a batch of --batch images (median of --repeats, after one warm-up)
  FLOPs (G)     the same call, counted by torch.utils.flop_counter.FlopCounterMode
  1st pass      building the predictor from the new state (text features computed) plus that first call:
                time and FLOPs (what every batch costs without a cache)
  Train (s/r)   one local round (`local_train`) on --train-samples examples, DP-SGD on the uploaded tensors
  Mem. (MB)     peak memory of that single-batch inference: torch.cuda.max_memory_allocated on a GPU;
                on the CPU the process's peak resident set (VmHWM, reset before the call)
  +Mem. (MB)    the increase of that peak over the memory in use just before the call (working memory)

Rows (`--methods`, default all): PromptFL; FedPGP; FedOTP-pooled (`tokens=pooled`, the official code's
one-point transport) and FedOTP-patch (`tokens=patch`, Sinkhorn over the mapped patch tokens; skipped with
a note when the tower has no tokens raysim can read); FedPHA; pFedMoAP; DP-FPL; FedSEPT-NC (no cache: the
M x C expert prompts are re-encoded for every batch, i.e. the first pass); FedSEPT-PF (prompt-level fusion:
a prompt per input, B x C prompts encoded per batch); FedSEPT (logit fusion, expert text features cached
once per model); FedSEPT-patch (the patch-token router of SPEC 1.3). An entry of `--methods` is one of
these labels or, like `raysim compare`, `name` or `name:key=value;key=value` (e.g. `dpfpl:rank=8`).
Ratios are to FedSEPT (to the first row when FedSEPT is not among them). On a CPU shared with other jobs,
`--threads 1`: with more threads than free cores every multi-op call waits on a descheduled thread.

    python benchmarks/fedsept_efficiency.py --classes 10 --batch 8 --device cpu --threads 1   # README's table
    python benchmarks/fedsept_efficiency.py --methods PromptFL,FedSEPT,fedotp:tokens=patch --model raysim-tiny
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


# the default rows: (label, entry) in fedsept.txt Table 5's order, then the patch router
ROWS = (
    ("PromptFL", "promptfl"),
    ("FedPGP", "fedpgp"),
    ("FedOTP-pooled", "fedotp:tokens=pooled"),
    ("FedOTP-patch", "fedotp:tokens=patch"),
    ("FedPHA", "fedpha"),
    ("pFedMoAP", "pfedmoap"),
    ("DP-FPL", "dpfpl"),
    ("FedSEPT-NC", "fedsept:cache_text=false"),
    ("FedSEPT-PF", "fedsept:fusion=prompt"),
    ("FedSEPT", "fedsept"),
    ("FedSEPT-patch", "fedsept:router=patch"),
)


def select_rows(methods: str) -> list[tuple[str, str]]:
    """`--methods`: comma-separated row labels (ROWS) or compare-style entries `name[:key=value;...]`."""
    if not methods.strip():
        return list(ROWS)
    labels = dict(ROWS)
    return [(m, labels.get(m, m)) for m in (s.strip() for s in methods.split(",")) if m]


def row_config(entry: str, args):
    """The RunConfig of one row: the benchmark's train section (the paper's L = 16 from N(0, 0.02^2): no ctx_init
    phrase), model and device, plus the entry's overrides (`--experts`/`--rank` are FedSEPT's M and r; an
    entry's own `fedsept:experts=...` wins)."""
    from raysim.build import build_config
    from raysim.config import deep_merge
    from raysim.tools.compare import parse_entry

    e = parse_entry(entry)
    base = {
        "method": e.method,
        "model": {"name": args.model, "pretrained": ""},
        "train": {"n_ctx": args.n_ctx, "batch_size": args.batch, "lr": 0.001, "num_clients": args.clients, "ctx_init": ""},
        "execution": {"device": args.device},
    }
    if e.method == "fedsept":
        base["fedsept"] = {"experts": args.experts, "rank": args.rank}
    return build_config(deep_merge(base, e.overrides))


def num_tokens(model: str) -> int:
    """Tokens of an open_clip ViT's image tower: CLS + (image / patch)^2."""
    import open_clip

    vc = (open_clip.get_model_config(model) or {}).get("vision_cfg", {})
    size, patch = vc.get("image_size", 224), vc.get("patch_size", 16)
    size = size[0] if isinstance(size, (list, tuple)) else size
    return 1 + (size // patch) ** 2


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def shapes(tensors: dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{k} {'x'.join(map(str, t.shape)) or 'scalar'}" for k, t in tensors.items())


def server_round(method, env, state, upload: dict[str, torch.Tensor], n: int, clients: int, g: torch.Generator):
    """The server's `aggregate` over K uploads: the measured client's (id 0) and K - 1 stand-ins of the same
    shapes (its upload plus N(0, 0.02^2) noise), as the other clients of the round. Returns the new state."""
    from raysim.methods.base import ServerResult, Upload

    uploads = [Upload(0, dict(upload), n)]
    for k in range(1, clients):
        other = {name: (t.float() + 0.02 * torch.randn(t.shape, generator=g)).to(t.dtype) for name, t in upload.items()}
        uploads.append(Upload(k, other, n))
    new = method.aggregate(env, state, uploads, g)
    new = new.state if isinstance(new, ServerResult) else new
    return {k: v.detach().cpu() for k, v in new.items()}


def measure(name, method, env, args, device) -> tuple[dict[str, float], dict[str, str]]:
    """One row: (the numbers, what crosses: {"up": shapes, "down": shapes})."""
    from raysim.methods import ClientData
    from raysim.methods.base import broadcast_state
    from raysim.privacy.dpsgd import DPSGD, NoDP

    g = torch.Generator().manual_seed(0)
    D, C = env.feature_dim, len(env.classnames)
    n = args.train_samples or 2 * args.batch
    x = F.normalize(torch.randn(n, D, generator=g), dim=-1)
    y = torch.randint(0, C, (n,), generator=g)
    toks = None
    if method.needs().tokens:  # random tokens of the image tower's shape, float16 as cached
        toks = torch.randn(n, num_tokens(args.model), env.token_dim, generator=g).to(torch.float16)
    data = ClientData(0, x, y, x[: args.batch], y[: args.batch], C, tokens_train=toks,
                      tokens_test=None if toks is None else toks[: args.batch])
    state = {k: v.detach().cpu() for k, v in method.init_shared(env, g).items()}
    private = method.init_private(env, data, g)

    def checked(upload):  # only declared tensors may leave the client, as the engine checks
        extra = sorted(set(upload) - set(method.uploads))
        assert not extra, f"{name} uploads undeclared tensors {extra}"
        return {k: v.detach().cpu() for k, v in upload.items()}

    # an untimed first participation (no DP) and a server round over K clients: the steady state
    first = method.local_train(env, broadcast_state(method, state), private, data, rng=torch.Generator().manual_seed(3), privacy=NoDP())
    state = server_round(method, env, state, checked(first.upload), n, args.clients, g)
    private = first.private

    # the timed round (DP-SGD on the uploaded tensors, as in the paper's setting) from the broadcast
    down = broadcast_state(method, state)
    privacy = NoDP()
    if args.dp:
        privacy = DPSGD(sigma=1.0, clip=1.0, sample_rate=min(1.0, args.batch / n), generator=torch.Generator().manual_seed(1))
    shared = {k: v.to(device) for k, v in down.items()}
    sync(device)
    t0 = time.perf_counter()
    res = method.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(2), privacy=privacy)
    sync(device)
    train_s = time.perf_counter() - t0
    up = checked(res.upload)
    up_kib, down_kib = nbytes(up) / 1024, nbytes(down) / 1024
    state = server_round(method, env, state, up, n, args.clients, g)
    shared = {k: v.to(device) for k, v in broadcast_state(method, state).items()}
    private = res.private

    # first pass: build the predictor (text features, FedSEPT's text cache, pFedMoAP's experts) and score one batch
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
    return ({"comm": up_kib + down_kib, "up": up_kib, "down": down_kib, "lat": lat_ms, "flops": gflops, "first": first_ms,
             "first_flops": first_gflops, "train": train_s, "mem": mem, "mem_delta": mem_delta},
            {"up": shapes(up), "down": shapes(down)})


COLS = (("comm", "Comm. (KiB)", "{:.2f}"), ("up", "Up (KiB)", "{:.2f}"), ("down", "Down (KiB)", "{:.2f}"),
        ("lat", "Lat. (ms)", "{:.3f}"), ("flops", "FLOPs (G)", "{:.4g}"), ("first", "1st pass (ms)", "{:.1f}"),
        ("first_flops", "1st-pass FLOPs (G)", "{:.4g}"), ("train", "Train (s/r)", "{:.3f}"), ("mem", "Mem. (MB)", "{:.1f}"),
        ("mem_delta", "+Mem. (MB)", "{:.1f}"))


def reference(rows: list[tuple[str, dict[str, float]]]) -> str:
    names = [n for n, _ in rows]
    return "FedSEPT" if "FedSEPT" in names else names[0]


def table(rows: list[tuple[str, dict[str, float]]], ref: str = "") -> str:
    from raysim.metrics import markdown_table

    r = dict(rows)[ref or reference(rows)]
    body = []
    for name, m in rows:
        cells = []
        for key, _, fmt in COLS:
            ratio = m[key] / r[key] if r[key] > 0 else float("nan")
            cells.append(f"{fmt.format(m[key])} ({ratio:.2f}x)")
        body.append([name, *cells])
    return markdown_table(["Method", *(c[1] for c in COLS)], body)


def crossing_table(rows: list[tuple[str, dict[str, float]]], info: dict[str, dict[str, str]]) -> str:
    """What crosses per client per round: the upload's and the broadcast's tensors and shapes."""
    from raysim.metrics import markdown_table

    return markdown_table(["Method", "Up (declared uploads)", "Down (broadcast)"],
                          [[n, info[n]["up"], info[n]["down"]] for n, _ in rows], align="lll")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="ViT-B-16", help="open_clip model (random weights), e.g. ViT-B-16 or raysim-tiny")
    p.add_argument("--methods", "--only", dest="methods", default="",
                   help=f"comma-separated rows: labels ({', '.join(n for n, _ in ROWS)}) or name[:key=value;...] (default all)")
    p.add_argument("--classes", type=int, default=10, help="C, classes scored per input")
    p.add_argument("--batch", type=int, default=32, help="inference and training batch size")
    p.add_argument("--train-samples", type=int, default=0, help="examples in the local round (default 2 x batch)")
    p.add_argument("--clients", type=int, default=10, help="K, clients (fedsept.txt: 10); pFedMoAP's bank holds K contexts")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--repeats", type=int, default=7, help="timed inference calls (after one warm-up)")
    p.add_argument("--n-ctx", type=int, default=16)
    p.add_argument("--experts", type=int, default=4, help="FedSEPT's M")
    p.add_argument("--rank", type=int, default=16, help="FedSEPT's r")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--no-dp", dest="dp", action="store_false", help="time the local round without DP-SGD")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up of the first row")
    p.add_argument("--actors", type=int, default=0, help="run the measurement in N Ray actors at once (0 = here)")
    p.add_argument("--actor-gpus", type=float, default=0.0, help="GPU fraction per actor, e.g. 0.25 (needs a GPU)")
    p.add_argument("--actor-cpus", type=float, default=1.0, help="CPUs per actor")
    p.add_argument("--address", default="", help="Ray cluster address for --actors (default: a local one)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.actors > 0:
        rows, dev, info = in_actors(args)
    else:
        rows, dev, info = run_rows(args)
    print(f"### Client-side efficiency ({args.model}, random weights; C={args.classes}, batch {args.batch}, "
          f"L={args.n_ctx}, K={args.clients}, FedSEPT M={args.experts}, r={args.rank}; {dev}; train: "
          f"{args.train_samples or 2 * args.batch} examples, {'DP-SGD' if args.dp else 'no DP'})\n")
    print(table(rows))
    cuda = args.actor_gpus > 0 if args.actors > 0 else args.device != "cpu" and torch.cuda.is_available()
    print(f"Ratios are to {reference(rows)}. Comm. = Up + Down per client per round, fp32; Down is the broadcast "
          f"(pFedMoAP's carries its bank of K = {args.clients} contexts). Mem.: "
          + ("torch.cuda.max_memory_allocated during the call." if cuda else "peak RSS of the process during the call.")
          + " +Mem.: its increase over the memory in use before the call.")
    for note in info.get("_skipped", {}).values():
        print(f"Skipped: {note}")
    print()
    print(crossing_table(rows, info))
    return 0


def run_rows(args) -> tuple[list[tuple[str, dict[str, float]]], str, dict]:
    """Every row measured in this process: (rows, a description of the device, per-row shapes and skipped rows)."""
    from raysim.build import env_spec, make_method
    from raysim.errors import ConfigError
    from raysim.models.clip import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    classnames = [f"object number {i}" for i in range(args.classes)]
    rows: list[tuple[str, dict[str, float]]] = []
    info: dict = {"_skipped": {}}
    warm = args.warmup
    import open_clip  # noqa: F401  # imported, then the libraries' objects frozen out of every gc.collect (PeakMemory): 0.3 s each
    gc.collect()
    gc.freeze()
    try:
        for name, entry in select_rows(args.methods):
            cfg = row_config(entry, args)
            method = make_method(cfg)
            t0 = time.perf_counter()
            try:
                env = method.build_env(env_spec(cfg, classnames), role="client")
            except ConfigError as e:  # FedOTP-patch or FedSEPT-patch on a tower whose tokens raysim cannot read
                if not method.needs().tokens:
                    raise
                info["_skipped"][name] = f"{name} ({entry}): {e}"
                print(f"  {name}: skipped ({e})", file=sys.stderr, flush=True)
                continue
            print(f"  {name}: {args.model} env on {device} ({time.perf_counter() - t0:.1f}s to build)", file=sys.stderr, flush=True)
            if warm:  # first-use costs (allocator, autograd/vmap set-up) out of the timed rows
                measure("warm-up", method, env, argparse.Namespace(**{**vars(args), "repeats": 1}), device)
                warm = False
            numbers, info[name] = measure(name, method, env, args, device)
            rows.append((name, numbers))
            del env, method  # freed by reference counting (PeakMemory collects cycles before the next row's call)
    finally:
        gc.unfreeze()
    if not rows:
        raise SystemExit("no row could be measured: " + "; ".join(info["_skipped"].values()))
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return rows, dev, info


def in_actors(args) -> tuple[list[tuple[str, dict[str, float]]], str, dict]:
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
    return rows, dev, results[0][2]


def _actor_rows(args):
    """What one actor runs (this module is importable there: `in_actors` puts its folder on PYTHONPATH)."""
    rows, dev, info = run_rows(args)
    return rows, f"{dev} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')})", info


if __name__ == "__main__":
    raise SystemExit(main())
