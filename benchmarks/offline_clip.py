"""Zero-shot vs centralised CoOp with raysim's small offline CLIP on the `synthetic` benchmark.

    python benchmarks/offline_clip.py [--checkpoint DIR] [--shots 64] [--n-ctx 4] [--epochs 30] [--seeds 0,1,2]

By default the model is the shipped one (`raysim-clip`: frozen MiniLM text tower + small CNN image tower,
assembled by `raysim.models.bundled.bundled_checkpoint`); `--checkpoint DIR` uses a folder written by
`raysim pretrain`. CoOp (Zhou et al., 2022) learns `n_ctx` shared context vectors that replace the word
embeddings of "a photo of a" in "a photo of a {class}." (initialised from them), on `shots` training images
per class drawn evenly over the domains from the `synthetic` train split; both towers stay frozen, so image
features are computed once. Accuracy is top-1 (%) on the whole `synthetic` test split (10 classes x 4 domains
x 20 images), per domain; CoOp is averaged over seeds. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from raysim.data import synthetic as syn  # noqa: E402
from raysim.models import bundled  # noqa: E402
from raysim.tools import pretrain as pt  # noqa: E402

TEMPLATE = "a photo of a {}."
CTX_INIT = "a photo of a"


def load_model(checkpoint: str, cache_dir: str):
    """(model, tokenizer): a `raysim pretrain` folder, or the shipped asset when `checkpoint` is empty."""
    import open_clip

    if checkpoint:
        model, tok, _ = pt.load(checkpoint)
        return model, tok
    name = bundled.register_bundled()
    model = open_clip.create_model(name, pretrained=str(bundled.bundled_checkpoint(cache_dir)))
    return model.eval(), open_clip.get_tokenizer(name)


@torch.no_grad()
def image_features(model, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    out = [model.encode_image(pt.normalise_uint8(images[i: i + batch_size]), normalize=True)
           for i in range(0, len(images), batch_size)]
    return torch.cat(out)


def few_shot_indices(labels: np.ndarray, domains: np.ndarray, shots: int, seed: int) -> np.ndarray:
    """`shots` indices per class, spread evenly (round robin) over the domains."""
    rng = np.random.default_rng(seed)
    picked = []
    for c in np.unique(labels):
        pools = [rng.permutation(np.flatnonzero((labels == c) & (domains == d))).tolist() for d in np.unique(domains)]
        for k in range(shots):
            picked.append(pools[k % len(pools)].pop())
    return np.asarray(picked)


class CoOp(torch.nn.Module):
    """Shared learned context in front of the class names, through the frozen MiniLM text tower."""

    def __init__(self, model, tokenizer, classnames, n_ctx: int = 4) -> None:
        super().__init__()
        self.model = model
        words = CTX_INIT.split()
        if n_ctx != len(words):
            words = ["X"] * n_ctx  # generic placeholder tokens, overwritten by the learned context
        ids = tokenizer([" ".join(words) + " " + TEMPLATE.format(c)[len("a photo of a "):] for c in classnames])
        self.register_buffer("ids", ids)
        self.register_buffer("mask", (ids != model.text.config.pad_token_id).long())
        with torch.no_grad():
            emb = pt.token_embedding(model)(ids)
        self.register_buffer("emb", emb)
        self.n_ctx = n_ctx
        init = emb[0, 1: 1 + n_ctx].clone() if n_ctx == len(CTX_INIT.split()) else 0.02 * torch.randn(n_ctx, emb.shape[-1])
        self.ctx = torch.nn.Parameter(init)

    def forward(self) -> torch.Tensor:
        C = self.emb.shape[0]
        emb = torch.cat([self.emb[:, :1], self.ctx[None].expand(C, -1, -1), self.emb[:, 1 + self.n_ctx:]], dim=1)
        return pt.encode_text_with_embeddings(self.model, emb, self.mask, normalize=True)


def per_domain(pred: np.ndarray, labels: np.ndarray, domains: np.ndarray) -> dict:
    res = {name: float((pred[domains == d] == labels[domains == d]).mean() * 100) for d, name in enumerate(syn.DOMAINS)}
    res["overall"] = float((pred == labels).mean() * 100)
    return res


def run_coop(model, tokenizer, classnames, ftr, ytr, fte, yte, dte, *, n_ctx: int, epochs: int, lr: float,
             batch_size: int, seed: int) -> dict:
    torch.manual_seed(seed)
    coop = CoOp(model, tokenizer, classnames, n_ctx)
    opt = torch.optim.SGD([coop.ctx], lr=lr, momentum=0.9)
    steps = epochs * max(1, int(np.ceil(len(ytr) / batch_size)))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    scale = model.logit_scale.exp().detach()
    y = torch.from_numpy(ytr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), batch_size):
            b = perm[i: i + batch_size]
            loss = F.cross_entropy(scale * ftr[b] @ coop().T, y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    with torch.no_grad():
        pred = (fte @ coop().T).argmax(-1).numpy()
    return per_domain(pred, yte, dte)


def table(rows: dict[str, dict]) -> str:
    from raysim.metrics import markdown_table

    cols = list(syn.DOMAINS) + ["overall"]
    return markdown_table(["", *cols], [[name, *(f"{r[c]:.1f}" for c in cols)] for name, r in rows.items()])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="", help="a `raysim pretrain` output folder (default: the shipped model)")
    p.add_argument("--cache-dir", default="~/.cache/raysim")
    p.add_argument("--shots", type=int, default=64, help="training images per class (spread over the domains)")
    p.add_argument("--n-ctx", type=int, default=4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    model, tok = load_model(a.checkpoint, a.cache_dir)
    for q in model.parameters():
        q.requires_grad_(False)
    bench = syn.DEFAULT
    train, test = syn.generate(bench, a.cache_dir)
    classnames = list(bench.classes)
    fte = image_features(model, test.images)
    zs = pt.zero_shot_accuracy(model, tok, test.images, test.labels, classnames, test.domains, list(bench.domains),
                               templates=(TEMPLATE,))
    rows = {f"zero-shot (\"{TEMPLATE.format('{class}')}\")": zs}
    coop = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        idx = few_shot_indices(train.labels, train.domains, a.shots, seed)
        ftr = image_features(model, train.images[idx])
        coop.append(run_coop(model, tok, classnames, ftr, train.labels[idx], fte, test.labels, test.domains,
                             n_ctx=a.n_ctx, epochs=a.epochs, lr=a.lr, batch_size=a.batch_size, seed=seed))
    mean = {k: float(np.mean([r[k] for r in coop])) for k in coop[0]}
    rows[f"CoOp ({a.shots} shots/class, {a.n_ctx} ctx, mean of {len(coop)} seeds)"] = mean
    rows["gain"] = {k: mean[k] - zs[k] for k in mean}
    print(table(rows))
    print(f"\nchance {100 / len(classnames):.1f}%; CoOp overall per seed: "
          + ", ".join(f"{r['overall']:.1f}" for r in coop) + f"; {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
