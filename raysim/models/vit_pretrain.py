"""The shipped offline ViT backbone of the VPDR methods (`raysim/assets/raysim-vit/`), and how to remake it.

VPDR fine-tunes adapters on a *pretrained* frozen ViT. Offline there is no ImageNet checkpoint, so the
project pretrains a small `transformers` ViTModel itself and ships it (fp32, < 1 MB):

- data: the project's generator (raysim/data/synthetic.py) drawing only its 12 shapes and 26 letters,
  never its digits, in its four styles, with a data seed (11) that no registered dataset uses. The
  evaluation stand-in `digits4` shows the ten digit classes, so the backbone has never seen a class it is
  evaluated on (the styles are shared: like an ImageNet backbone that has seen photos and sketches);
- model: 32x32 input, 4 px patches (64 patch tokens + CLS), width 64, 4 blocks, 4 heads, MLP 128;
- objective: supervised cross-entropy over the 38 classes through a linear head on the mean patch token
  after the final LayerNorm (the feature VPDR's adapters feed), AdamW, random shifts and flips of up to
  3 px, cosine schedule; the head is dropped, only the ViTModel is saved.

    python -m raysim.models.vit_pretrain --out raysim/assets/raysim-vit      # about 4 minutes on one CPU thread

`MODEL_CARD.md` next to the weights records the arguments, the time and the accuracies it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from raysim.data import synthetic as syn
from raysim.models.vit_adapter import VIT_ASSET_DIR, random_hf_vit

PRETRAIN_CLASSES = tuple(syn.SHAPES + syn.LETTERS)  # no digits: disjoint from the digits4 stand-in
DATA_SEED = 11
MEAN = (0.5, 0.5, 0.5)  # the ViT's own normalisation (HF ViT defaults); the loaders pass CLIP's, close enough
STD = (0.5, 0.5, 0.5)


def _normalise(u8: torch.Tensor) -> torch.Tensor:
    x = u8.float() / 255.0
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def _augment(x: torch.Tensor, gen: torch.Generator, shift: int = 3) -> torch.Tensor:
    n = x.shape[0]
    pad = F.pad(x, (shift,) * 4, mode="replicate")
    dx = torch.randint(0, 2 * shift + 1, (n,), generator=gen)
    dy = torch.randint(0, 2 * shift + 1, (n,), generator=gen)
    S = x.shape[-1]
    out = torch.stack([pad[i, :, dy[i]:dy[i] + S, dx[i]:dx[i] + S] for i in range(n)])
    flip = torch.rand(n, generator=gen) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


def pretrain(out: str | Path, *, steps: int = 700, batch_size: int = 128, lr: float = 2e-3, width: int = 64, layers: int = 4,
             heads: int = 4, per_cell: int = 40, seed: int = 0, threads: int = 1, cache_dir: Optional[str] = "~/.cache/raysim",
             log_every: int = 100) -> dict:
    """Train the backbone and write it as a HF ViTModel folder to `out` (+ MODEL_CARD.md); returns the metrics."""
    torch.set_num_threads(threads)
    t0 = time.time()
    params = syn.SyntheticParams(classes=PRETRAIN_CLASSES, train_per_cell=per_cell, test_per_cell=max(4, per_cell // 4),
                                 seed=DATA_SEED)
    train, test = syn.generate(params, cache_dir)
    xtr, ytr = _normalise(train.images), torch.as_tensor(train.labels)
    xte, yte = _normalise(test.images), torch.as_tensor(test.labels)
    bb = random_hf_vit(image_size=32, patch_size=4, width=width, layers=layers, heads=heads, seed=seed)
    vit = bb.vit
    for p in vit.parameters():
        p.requires_grad_(True)
    head = torch.nn.Linear(width, len(PRETRAIN_CLASSES))
    params_ = list(vit.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params_, lr=lr, weight_decay=0.05)
    gen = torch.Generator().manual_seed(seed)
    warm = max(1, steps // 20)

    def feats(x: torch.Tensor) -> torch.Tensor:
        return vit(pixel_values=x).last_hidden_state[:, 1:].mean(1)

    vit.train()
    losses = []
    for step in range(steps):
        f = min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * f
        idx = torch.randint(0, len(ytr), (batch_size,), generator=gen)
        loss = F.cross_entropy(head(feats(_augment(xtr[idx], gen))), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.3f} ({time.time() - t0:.0f} s)", flush=True)
    vit.eval()
    with torch.no_grad():
        acc_tr = float(torch.cat([head(feats(xtr[i:i + 512])).argmax(1) for i in range(0, len(ytr), 512)]).eq(ytr).float().mean())
        acc_te = float(torch.cat([head(feats(xte[i:i + 512])).argmax(1) for i in range(0, len(yte), 512)]).eq(yte).float().mean())
    seconds = time.time() - t0
    out_p = Path(out)
    out_p.mkdir(parents=True, exist_ok=True)
    vit.save_pretrained(str(out_p), safe_serialization=True)
    metrics = {"train_accuracy": acc_tr, "test_accuracy": acc_te, "final_loss": sum(losses[-50:]) / min(50, len(losses)),
               "seconds": seconds, "steps": steps, "batch_size": batch_size, "lr": lr, "width": width, "layers": layers,
               "heads": heads, "per_cell": per_cell, "seed": seed, "threads": threads, "data_seed": DATA_SEED,
               "classes": len(PRETRAIN_CLASSES), "train_images": len(ytr), "test_images": len(yte),
               "parameters": sum(p.numel() for p in vit.parameters())}
    (out_p / "pretrain.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out_p / "MODEL_CARD.md").write_text(_card(metrics))
    return metrics


def _card(m: dict) -> str:
    return (
        "# raysim-vit: the offline backbone of the VPDR methods\n\n"
        f"A `transformers` ViTModel (32x32 input, 4 px patches, width {m['width']}, {m['layers']} blocks, {m['heads']} heads; "
        f"{m['parameters']:,} parameters, fp32) pretrained by `python -m raysim.models.vit_pretrain` "
        "(raysim/models/vit_pretrain.py) with supervised cross-entropy on the project's generator drawing its "
        f"{m['classes']} shapes and letters (no digits) in the four styles, data seed {m['data_seed']}: "
        f"{m['train_images']:,} training images, {m['steps']} steps of batch {m['batch_size']}, AdamW lr {m['lr']}, "
        f"{m['threads']} CPU threads, {m['seconds']:.0f} s.\n\n"
        f"Measured at the end of that run: {100 * m['train_accuracy']:.1f}% training and {100 * m['test_accuracy']:.1f}% "
        f"held-out accuracy over the {m['classes']} pretraining classes ({m['test_images']:,} held-out images).\n\n"
        "Its classes are disjoint from the `digits4` stand-in the VPDR methods are evaluated on; its inputs are "
        "normalised with mean = std = 0.5 during pretraining (the loaders give CLIP's normalisation, which is close).\n"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(VIT_ASSET_DIR))
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--per-cell", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    m = pretrain(a.out, steps=a.steps, batch_size=a.batch_size, lr=a.lr, width=a.width, layers=a.layers,
                 per_cell=a.per_cell, threads=a.threads, seed=a.seed)
    print(json.dumps(m, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
