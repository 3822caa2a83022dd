"""Why FedSEPT's shared part barely learns on the offline benchmark: the measurements behind the README.

    python benchmarks/fedsept_offline_analysis.py [key=value ...]     # default: synthetic-large, the default model (raysim-clip3)

Prints, on the run's model and dataset (centralised: all training features, no federation):

1. Zero-shot accuracy on the test set with four contexts of the same length: the phrase "a photo of a"
   (PromptFL's default start), all zeros, N(0, 0.02^2) (CoOp's random start, PromptFL with ctx_init=""),
   and FedSEPT's initial expert prompt A B0 with A, B0 ~ N(0, 0.02^2) (SPEC 1.2).
2. How far one SGD step moves the prompt: for the CE gradient g at FedSEPT's initial prompt, a step on a
   full prompt moves it by lr * |g|; a step on A moves P = A B0 by lr * |g B0^T B0|. The ratio, and the
   share of |g| inside B0's row space (the only directions A can move P in).
3. Centralised CoOp from each start (same lr, steps, batches): test accuracy after S steps, so "can a
   near-zero context be trained back on this model" is measured, not assumed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch
    import torch.nn.functional as F

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="centralised CoOp steps per start")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)

    from raysim.build import build_config, make_method
    from raysim.config import merge_config, parse_overrides
    from raysim.engine.loop import prepare_data
    from raysim.methods.fedsept.fedsept_parts import public_basis
    from raysim.models.clip import ModelSpec, build_clip_env

    values = merge_config({"method": "promptfl", "data": {"dataset": "synthetic-large"}, "train": {"num_clients": 10}},
                          parse_overrides(a.overrides))
    cfg = build_config(values)
    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    n_ctx = cfg.train.n_ctx
    spec = ModelSpec(cfg.model.name, cfg.model.pretrained)
    env = build_clip_env(spec, data.classnames, n_ctx, ctx_init="a photo of a")
    xtr, ytr = torch.as_tensor(data.x_train).float(), torch.as_tensor(data.y_train)
    xte, yte = torch.as_tensor(data.x_test).float(), torch.as_tensor(data.y_test)
    g = torch.Generator().manual_seed(cfg.train.seed)
    width = env.prompts.initial_context(g).shape[-1]
    B0 = public_basis(1, a.rank, width)
    starts = {
        "'a photo of a'": env.prompts.initial_context(g),
        "zeros": torch.zeros(n_ctx, width),
        "N(0, 0.02^2)": torch.randn(n_ctx, width, generator=g) * 0.02,
        "A B0 (FedSEPT init)": (torch.randn(n_ctx, a.rank, generator=g) * 0.02) @ B0,
    }

    def accuracy(ctx: torch.Tensor) -> float:
        with torch.no_grad():
            text = env.prompts.text_features(ctx)
            return float(((env.logit_scale * xte @ text.t()).argmax(1) == yte).float().mean())

    print(f"{cfg.data.dataset}, {len(data.classnames)} classes, {cfg.model.name} ({cfg.model.pretrained or 'random'}), "
          f"n_ctx={n_ctx}, width={width}")
    print("\n1. zero-shot test accuracy by context")
    for name, ctx in starts.items():
        print(f"   {name:24s} |ctx|={float(ctx.norm()):.4f}  acc={100 * accuracy(ctx):.2f}%")

    print("\n2. one SGD step at FedSEPT's initial prompt")
    P = starts["A B0 (FedSEPT init)"].clone().requires_grad_(True)
    loss = F.cross_entropy(env.logit_scale * xtr @ env.prompts.text_features(P).t(), ytr)
    (grad,) = torch.autograd.grad(loss, P)
    through_a = grad @ B0.t() @ B0  # dP for dA = -lr * grad @ B0^T
    Q, _ = torch.linalg.qr(B0.t())  # (w, r) orthonormal basis of B0's row space
    inside = grad @ Q @ Q.t()
    print(f"   |dP| through A / |dP| of a full prompt = {float(through_a.norm() / grad.norm()):.4f}")
    print(f"   share of |g| in B0's {a.rank}-dim row space = {float(inside.norm() / grad.norm()):.4f}")
    sv = torch.linalg.svdvals(B0)
    print(f"   B0^T B0 nonzero eigenvalues: {float(sv.min() ** 2):.4f} .. {float(sv.max() ** 2):.4f} (w * 0.02^2 = {width * 4e-4:.4f})")

    print(f"\n3. centralised CoOp, {a.steps} SGD steps (lr {a.lr}, batch {a.batch}, momentum 0.9), test accuracy")
    for name, ctx0 in starts.items():
        ctx = ctx0.clone().requires_grad_(True)
        opt = torch.optim.SGD([ctx], lr=a.lr, momentum=0.9)
        gen = torch.Generator().manual_seed(0)
        for _ in range(a.steps):
            idx = torch.randint(0, len(ytr), (a.batch,), generator=gen)
            loss = F.cross_entropy(env.logit_scale * xtr[idx] @ env.prompts.text_features(ctx).t(), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"   from {name:24s} -> {100 * accuracy(ctx.detach()):.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
