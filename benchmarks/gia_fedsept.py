"""Multi-client gradient inversion against FedSEPT or PromptFL (fedsept.txt section 5.5, SPEC 1.12).

An honest-but-curious server broadcasts theta_pre. Each of --clients clients takes one local step of plain
SGD (lr --eta, no momentum, no weight decay, one batch holding all of its --samples images) and uploads
theta_post of the shared tensor (FedSEPT's A, PromptFL's ctx), optionally privatised by DP-SGD
(--epsilon: sigma calibrated for this single step, clipping norm --clip). The server takes
g^ = -(theta_post - theta_pre) / eta and inverts it with `raysim.attacks.gradient_inversion`:
Inverting-Gradients with labels known, Adam from Gaussian noise, --restarts restarts of --iterations
steps, keeping the lowest-loss one. The client's private state (FedSEPT's R and router) is given to the
attacker as it was at theta_pre: the white-box upper bound. The router runs without dropout, so g^ is
exact. The attacker's costly step, the text-tower Jacobian at theta_pre, depends only on theta_pre and
the client's R (not its router or images), so it is computed once and reused for every client with the
same R (here all of them: R starts at 0).

Data: each client gets --samples images of distinct classes (labels known to the attacker), drawn at
random (seeded) from the train split of --dataset, no image shared between clients.

Columns, per client and their mean (metrics of `reconstruction_metrics`):
  GradCos    cosine of the gradient of the reconstruction to g^
  PSNR (dB)  against the closest original of the client (Hungarian matching on PSNR)
  CLIPCos    cosine of the CLIP image embeddings of reconstruction and closest original (matched)
  Top-1      agreement of the CLIP zero-shot predictions of those pairs
  ... (rand) the same for random images (clamped Gaussian noise, the attack's starting point): what
             the metrics read when nothing leaks
  Time (s)   the inversion of that client (all restarts)

    python benchmarks/gia_fedsept.py                                     # SPEC: 2,000 iterations, 4 restarts
    python benchmarks/gia_fedsept.py --iterations 300 --restarts 2 --save-png gia.png
    python benchmarks/gia_fedsept.py --iterations 300 --restarts 2 --epsilon 1
    python benchmarks/gia_fedsept.py --method promptfl --model raysim-tiny --pretrained ""  # random CLIP, fast
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

METRICS = ("GradCos", "PSNR", "CLIPCos", "Top-1")
HEADERS = {"GradCos": "GradCos", "PSNR": "PSNR (dB)", "CLIPCos": "CLIPCos", "Top-1": "Top-1"}


def draw_clients(labels: np.ndarray, clients: int, samples: int, seed: int) -> list[np.ndarray]:
    """Row indices of `samples` images of distinct classes per client, disjoint across clients (seeded)."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    if samples > len(classes):
        raise SystemExit(f"--samples {samples} > {len(classes)} classes: a client's images must have distinct classes")
    pool = {int(c): list(rng.permutation(np.flatnonzero(labels == c))) for c in classes}
    out = []
    for _ in range(clients):
        chosen = rng.choice(classes, size=samples, replace=False)
        if any(not pool[int(c)] for c in chosen):
            raise SystemExit(f"not enough images for {clients} clients x {samples} samples")
        out.append(np.array([pool[int(c)].pop() for c in chosen]))
    return out


def build_method(args):
    from raysim.methods import TrainConfig, get_method

    cls = get_method(args.method)
    # one plain SGD step on one batch: g^ is exact (no momentum, no weight decay)
    train = TrainConfig(lr=args.eta, momentum=0.0, weight_decay=0.0, batch_size=args.samples, local_epochs=1,
                        n_ctx=args.n_ctx, ctx_init=args.ctx_init, seed=args.seed)
    if args.method == "fedsept":
        return cls(train, cls.Options(experts=args.experts, rank=args.rank, router_dropout=0.0))
    if args.method == "promptfl":
        return cls(train, None)
    raise SystemExit(f"--method must be fedsept or promptfl, got {args.method!r}")


def attack(args) -> tuple[list[dict[str, float]], dict]:
    """Per client: {metric: value, metric (rand): value, time}; and what --save-png draws."""
    from raysim.attacks.gradient_inversion import (
        ClientView,
        TextJacobianCache,
        image_features,
        invert_client,
        observed_gradient,
        pixel_range,
        prompt_shared_grad,
        reconstruction_metrics,
    )
    from raysim.data import DATASETS, LoadSpec
    from raysim.methods import ClientData, EnvSpec
    from raysim.models.clip import ModelSpec, image_size_of, load_clip
    from raysim.privacy import DPSGD, NoDP, noise_multiplier

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    spec = ModelSpec(args.model, args.pretrained, cache_dir=args.cache_dir)
    clip = load_clip(spec)
    size = image_size_of(clip)
    bundle = DATASETS.get(args.dataset)(LoadSpec(data_root=args.data_root, image_size=size, cache_dir=args.cache_dir))
    method = build_method(args)
    env = method.build_env(EnvSpec(spec, bundle.classnames), role="client")
    C = len(bundle.classnames)
    print(f"{args.model} ({args.pretrained or 'random'}), {size}px, {args.dataset} ({C} classes), {args.method}: "
          f"{time.perf_counter() - t0:.1f}s to load", file=sys.stderr, flush=True)

    sigma = 0.0
    if math.isfinite(args.epsilon):
        sigma = noise_multiplier(epsilon=args.epsilon, delta=args.delta, sample_rate=1.0, steps=1)
    shared = method.init_shared(env, torch.Generator().manual_seed(args.seed))  # the broadcast theta_pre
    (name,) = shared
    low, high = pixel_range()
    rows, grid = [], []
    # the text-tower Jacobian at theta_pre depends on theta_pre and the client's R (0 here for every
    # client), not on its router or images: computed once, recomputed only for a client whose R differs
    jacobians = TextJacobianCache()
    for k, idx in enumerate(draw_clients(bundle.train.labels, args.clients, args.samples, args.seed)):
        images = torch.stack([torch.as_tensor(bundle.train.images[int(i)]) for i in idx]).float()
        labels = torch.as_tensor(bundle.train.labels[idx]).long()
        with torch.no_grad():
            feats = image_features(clip, images)
        data = ClientData(k, feats, labels, feats, labels, C)
        private = method.init_private(env, data, torch.Generator().manual_seed(args.seed * 1000 + 100 + k))
        privacy = NoDP() if sigma == 0 else DPSGD(
            sigma=sigma, clip=args.clip, sample_rate=1.0, generator=torch.Generator().manual_seed(args.seed * 1000 + 200 + k))
        t1 = time.perf_counter()
        post = method.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(args.seed * 1000 + 300 + k),
                                  privacy=privacy).upload[name]
        # the server's side: theta_pre, theta_post, the labels, the client's state at theta_pre
        computed = jacobians.misses
        grad = prompt_shared_grad(method, env, clip, shared, private, cache=jacobians)
        view = ClientView(grad.fn, grad.target(observed_gradient(shared[name], post, lr=args.eta)), labels, images)
        how = "computed" if jacobians.misses > computed else "reused"
        print(f"  client {k}: local step and the attacker's gradient function (text Jacobian at theta_pre {how}) in "
              f"{time.perf_counter() - t1:.1f}s", file=sys.stderr, flush=True)

        t1 = time.perf_counter()
        inv, metrics = invert_client(view, k, clip=clip, env=env, image_size=size, iterations=args.iterations,
                                     restarts=args.restarts, lr=args.lr, tv_weight=args.tv, seed=args.seed)
        seconds = time.perf_counter() - t1
        got = metrics.as_dict()

        noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(args.seed * 1000 + 400 + k))
        noise = torch.max(torch.min(noise, high), low)
        noise_cos = torch.nn.functional.cosine_similarity(
            view.fn(noise, labels).detach().reshape(-1), view.target.reshape(-1), dim=0)
        base = reconstruction_metrics(noise, view.originals, clip=clip, env=env, grad_cos=float(noise_cos)).as_dict()

        row = {**got, **{f"{m} (rand)": v for m, v in base.items()}, "time": seconds}
        rows.append(row)
        grid.append((images, inv.images, [bundle.classnames[int(c)] for c in labels]))
        print(f"  client {k}: GradCos {got['GradCos']:.4f} PSNR {got['PSNR']:.2f} CLIPCos {got['CLIPCos']:.4f} "
              f"Top-1 {got['Top-1']:.2f} ({seconds:.1f}s)", file=sys.stderr, flush=True)
    return rows, {"grid": grid, "sigma": sigma}


def table(rows: list[dict[str, float]]) -> str:
    cols = [(m, HEADERS[m]) for m in METRICS] + [(f"{m} (rand)", f"{HEADERS[m]} (rand)") for m in METRICS] + [("time", "Time (s)")]
    fmt = {"GradCos": "{:.4f}", "PSNR": "{:.2f}", "CLIPCos": "{:.4f}", "Top-1": "{:.2f}", "time": "{:.1f}"}
    mean = {key: float(np.mean([r[key] for r in rows])) for key, _ in cols}
    from raysim.metrics import markdown_table

    return markdown_table(
        ["Client", *(h for _, h in cols)],
        [[name, *(fmt[key.split(" ")[0]].format(r[key]) for key, _ in cols)]
         for name, r in [(str(k), r) for k, r in enumerate(rows)] + [("mean", mean)]],
    )


def save_png(path: str, grid: list) -> None:
    """Per client, a row of originals over a row of reconstructions (same label order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from raysim.attacks.gradient_inversion import to_pixels

    n, b = len(grid), len(grid[0][0])
    fig, axes = plt.subplots(2 * n, b, figsize=(1.3 * b, 1.45 * 2 * n), squeeze=False)
    for k, (orig, recon, names) in enumerate(grid):
        for r, (imgs, what) in enumerate(((orig, "orig."), (recon, "recon."))):
            pix = to_pixels(imgs).permute(0, 2, 3, 1).numpy()
            for j in range(b):
                ax = axes[2 * k + r, j]
                ax.imshow(pix[j], interpolation="nearest")
                ax.set_xticks([]), ax.set_yticks([])
                if r == 0:
                    ax.set_title(names[j], fontsize=7)
                if j == 0:
                    ax.set_ylabel(f"c{k} {what}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="fedsept", choices=["fedsept", "promptfl"])
    p.add_argument("--model", default="raysim-clip", help="CLIP model (raysim-tiny with --pretrained '' is a fast random one)")
    p.add_argument("--pretrained", default="bundled",
                   help="'bundled' (raysim-clip's shipped weights), an open_clip tag, a path, '' = random")
    p.add_argument("--dataset", default="digits", help="a dataset of the registry (digits, synthetic, ...)")
    p.add_argument("--data-root", default="./data")
    p.add_argument("--cache-dir", default="~/.cache/raysim")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--samples", type=int, default=4, help="images per client (distinct classes), one batch")
    p.add_argument("--eta", type=float, default=1e-3, help="the clients' SGD learning rate (the server knows it)")
    p.add_argument("--epsilon", type=float, default=math.inf, help="DP-SGD epsilon of the one step (default: no DP)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=1.0, help="DP-SGD per-sample clipping norm")
    p.add_argument("--n-ctx", type=int, default=4, help="context tokens (RunConfig's default)")
    p.add_argument("--ctx-init", default="a photo of a", help="PromptFL's initial context (RunConfig's default)")
    p.add_argument("--experts", type=int, default=4, help="FedSEPT M")
    p.add_argument("--rank", type=int, default=16, help="FedSEPT r")
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--restarts", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.1, help="Adam learning rate of the inversion")
    p.add_argument("--tv", type=float, default=1e-4, help="total-variation weight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch default)")
    p.add_argument("--save-png", default="", metavar="PATH", help="write originals vs reconstructions")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return report(args)
    finally:
        torch.set_num_threads(threads)


def report(args) -> int:
    t0 = time.perf_counter()
    rows, extra = attack(args)
    dp = "no DP" if not extra["sigma"] else (
        f"DP-SGD eps={args.epsilon:g} (one step), delta={args.delta:g}, sigma={extra['sigma']:.3f}, clip={args.clip:g}")
    print(f"### Gradient inversion: {args.method}, {args.model} ({args.pretrained or 'random'}), {args.dataset}; "
          f"{args.clients} clients x {args.samples} images, one SGD step eta={args.eta:g}, {dp}; "
          f"{args.iterations} iterations x {args.restarts} restarts, Adam lr {args.lr:g}, TV {args.tv:g}, seed {args.seed}\n")
    print(table(rows))
    print(f"(rand): random images, the attack's starting point. Total {time.perf_counter() - t0:.1f}s on "
          f"{torch.get_num_threads()} CPU thread(s).")
    if args.save_png:
        save_png(args.save_png, extra["grid"])
        print(f"wrote {args.save_png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
