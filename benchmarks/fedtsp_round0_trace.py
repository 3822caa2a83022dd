"""How the no-DP row of the offline Table 4 diverges (#46): FedTSP's round 0 batch by batch, per client.

The no-DP config of benchmarks/tables/fedtsp_table4.yaml (digits, Dirichlet 0.1, 4 clients, BERT MiniLM, seed 1),
one round, inline. Each client's local training is observed through the zoo's `on_batch` hook (what a batch's
forward pass gave, before its SGD step); nothing in the training is changed. Per batch it prints the mean
feature norm |f(x)|, the CE of the head, the alignment CE (the text term before lam), and the mean per-sample
norm of the text term's gradient with respect to the feature, |d(lam * align)/df|: the cosine's
gradient scales as lam * e^s / |f| (e^s = 100), so features of small norm get large steps.

    HF_HUB_OFFLINE=1 python benchmarks/fedtsp_round0_trace.py [--lam 7] [--family tiny] [--epochs 1]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from fedtsp_table4_gap import configs  # this folder is on sys.path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lam", type=float, default=7.0)
    ap.add_argument("--family", default="tiny", help="fedtsp.model_family (tiny: the spec's; HtFE2: FedAvgCNN + ResNet18)")
    ap.add_argument("--epochs", type=int, default=1, help="train.local_epochs")
    ap.add_argument("--show", type=int, default=4, help="batches shown per client (the first ones, then the last)")
    a = ap.parse_args()
    from raysim.build import build_config
    from raysim.engine.loop import run
    from raysim.methods.families.zoo import HeteroMethod
    from raysim.methods.fedtsp.fedtsp import FedTSP

    traces: list[tuple[str, int, list[tuple[float, float, float, float]]]] = []

    def train_model(self, env, model, data, rng, extra_loss=None, privacy=None, on_batch=None):
        rows: list[tuple[float, float, float, float]] = []

        def observe(idx: torch.Tensor, feats: torch.Tensor, logits: torch.Tensor) -> None:
            y = data.y_train[idx].to(feats.device)
            f = feats.clone().requires_grad_(True)
            text = extra_loss(f, y) if extra_loss is not None else f.sum() * 0.0
            (grad,) = torch.autograd.grad(text * len(y), f)  # per-sample gradients of the batch-mean loss, x n
            rows.append((float(feats.norm(dim=1).mean()), float(F.cross_entropy(logits, y)),
                         float(text.detach()) / max(self.opts.lam, 1e-12), float(grad.norm(dim=1).mean())))

        loss = HeteroMethod.train_model(self, env, model, data, rng, extra_loss, privacy, on_batch=observe)
        traces.append((model.arch, data.num_train, rows))
        return loss

    with tempfile.TemporaryDirectory(prefix="fedtsp-trace-") as tmp:
        d: dict[str, Any] = configs(Path(tmp))["nodp"]
        d["train"] = {**d["train"], "rounds": 1, "local_epochs": a.epochs}
        d["eval"] = {**d["eval"], "every": 1, "last": 1}
        d["execution"] = {**d["execution"], "backend": "inline"}
        d["output"] = {**d["output"], "out_dir": str(Path(tmp) / "run"), "progress": False, "tensorboard": False}
        d["fedtsp"] = {**d["fedtsp"], "lam": a.lam, "model_family": a.family}
        FedTSP.train_model = train_model  # FedTSP inherits the zoo's; this class attribute shadows it for the run
        try:
            run(build_config(d))
        finally:
            del FedTSP.train_model
    print(f"lam = {a.lam}, fedtsp.model_family = {a.family}, train.local_epochs = {a.epochs}, round 0 (no DP)\n")
    print("| client | arch | samples | batch | mean |f(x)| | CE | align CE | mean |d(lam align)/df| |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for cid, (arch, n, rows) in enumerate(traces):
        shown = sorted({*range(min(a.show, len(rows))), len(rows) - 1})
        for b in shown:
            fn, ce, al, g = rows[b]
            print(f"| {cid} | {arch} | {n} | {b} of {len(rows)} | {fn:.2f} | {ce:.2f} | {al:.2f} | {g:.1f} |")


if __name__ == "__main__":
    main()
