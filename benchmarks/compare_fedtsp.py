"""FedTSP vs FedProto vs FedTGP vs local-only training on bundled data with the HtFE client zoo.

    python benchmarks/compare_fedtsp.py --dataset digits --rounds 10 --clients 4 --family HtFE2

The model-homogeneous settings (fedtsp.txt Table 3: GFL, and PFL as "-FT") with one model for all clients:

    python benchmarks/compare_fedtsp.py --methods fedavg,fedavg_ft,fedtsp_gfl,fedtsp_gfl_ft --homo-model fedavgcnn

`fedavg_ft` and `fedtsp_gfl_ft` are fedavg and fedtsp_gfl with `finetune_epochs=--finetune-epochs`; so are
`fedbabu_ft`, `fedetf_per` and `fedfa_ft` (the other GFL / PFL baselines: fedbabu, fedetf, fedfa, fedpcl, fedpac).

Prints, per method, the metrics of fedtsp.txt section 4 computed from each run's client_results.csv:
  local accuracy  = sum over clients of correct on their own test split / sum of own test samples
  global accuracy = mean over clients of the client model's accuracy on the union of all test splits
and the same two with top-5, at the best round (per column) and at the last round.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def round_metrics(client_csv: str | Path) -> dict[int, dict[str, float]]:
    """{round: {local, global, local_top5, global_top5}} from a run's client_results.csv."""
    by_round: dict[int, list[dict[str, str]]] = defaultdict(list)
    with open(client_csv, newline="") as f:
        for r in csv.DictReader(f):
            by_round[int(r["round"])].append(r)
    out = {}
    for rnd, rows in sorted(by_round.items()):
        m = {}
        for suffix, (a_in, a_cross) in {"": ("in_client", "cross_client"), "_top5": ("in_top5", "cross_top5")}.items():
            n_in = sum(int(r["n_in"]) for r in rows)
            hits_in = sum(float(r[a_in] or 0) * int(r["n_in"]) for r in rows)
            glob = []
            for r in rows:
                n_i, n_c = int(r["n_in"]), int(r["n_cross"])
                hits = (float(r[a_in] or 0) * n_i) + (float(r[a_cross] or 0) * n_c)
                glob.append(hits / max(1, n_i + n_c))
            m["local" + suffix] = hits_in / max(1, n_in)
            m["global" + suffix] = sum(glob) / len(glob)
        out[rnd] = m
    return out


COLUMNS = ["local", "global", "local_top5", "global_top5"]


def table(results: dict[str, dict[int, dict[str, float]]]) -> str:
    from raysim.metrics import markdown_table

    rows = []
    for name, per_round in results.items():
        last = per_round[max(per_round)]
        best = {c: max(m[c] for m in per_round.values()) for c in COLUMNS}
        rows.append([name, *(f"{100 * best[c]:.2f}" for c in COLUMNS), *(f"{100 * last[c]:.2f}" for c in COLUMNS)])
    return markdown_table(["Method", *(f"{c} (best)" for c in COLUMNS), *(f"{c} (last)" for c in COLUMNS)], rows)


def semantic_structure(out_dir: Path, rounds: int, dataset: str, classnames: list[str]) -> dict[str, float] | None:
    """Figure-1 measures of the final global prototypes (FedTSP's text prototypes, FedProto/FedTGP's
    prototypes): Spearman rho against the class hierarchy and the semantic gap; None when the method
    keeps no global prototypes or the dataset has no known hierarchy."""
    from raysim.errors import ConfigError
    from raysim.methods.fedtsp_semantics import semantic_report
    from raysim.store import StateStore

    state = StateStore(out_dir).load_server(rounds - 1) or {}
    protos = state.get("text_protos", state.get("protos"))
    if protos is None or float(protos.abs().sum()) == 0:
        return None
    try:
        return semantic_report(protos, dataset, classnames)
    except ConfigError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--methods", default="fedtsp,fedproto,fedtgp,local")
    p.add_argument("--family", default="HtFE2", help="HtFE2 | HtFE3 | HtFE4 | HtFE9 | tiny")
    p.add_argument("--homo-model", default="fedavgcnn", help="the one model of fedavg / fedtsp_gfl (any zoo model)")
    p.add_argument("--finetune-epochs", type=int, default=1, help="head fine-tuning epochs of the *_ft variants")
    p.add_argument("--plm", default="bert", help="FedTSP's PLM: bert (MiniLM offline) or clip (the run's model)")
    p.add_argument("--model", default="raysim-tiny", help="open_clip model for plm=clip")
    p.add_argument("--pretrained", default="")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--partition", default="dirichlet", help="dirichlet | pfllib (PFLlib's protocol, fedtsp.txt's tables)")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lam", type=float, default=7.0, help="FedTSP lambda (FedProto/FedTGP use 1)")
    p.add_argument("--len-prompt", type=int, default=1)
    p.add_argument("--prompt-epochs", type=int, default=1)
    p.add_argument("--tgp-server-epochs", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--backend", default="inline")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="", help="folder for the runs (default runs/compare_fedtsp-<time>)")
    a = p.parse_args(argv)

    from raysim.config import build_config
    from raysim.engine import run

    out = Path(a.out or f"runs/compare_fedtsp-{time.strftime('%Y%m%d-%H%M%S')}")
    sections = {
        "fedtsp": {"plm": a.plm, "model_family": a.family, "lam": a.lam, "len_prompt": a.len_prompt,
                   "prompt_epochs": a.prompt_epochs},
        "fedproto": {"model_family": a.family, "feature_dim": 512},
        "fedtgp": {"model_family": a.family, "feature_dim": 512, "server_epochs": a.tgp_server_epochs},
        "local": {"model_family": a.family, "feature_dim": 512},
        "fedavg": {"model": a.homo_model, "feature_dim": 512},
        "fedtsp_gfl": {"plm": a.plm, "model": a.homo_model, "lam": a.lam, "len_prompt": a.len_prompt,
                       "prompt_epochs": a.prompt_epochs},
        **{m: {"model": a.homo_model, "feature_dim": 512} for m in ("fedbabu", "fedetf", "fedfa", "fedpcl", "fedpac")},
    }
    # -FT: the head fine-tuned per client (FedETF-Per: its ETF and projection, methods/fedetf.py)
    variants = {"fedavg_ft": "fedavg", "fedtsp_gfl_ft": "fedtsp_gfl", "fedbabu_ft": "fedbabu", "fedetf_per": "fedetf",
                "fedfa_ft": "fedfa"}
    results = {}
    semantics: dict[str, dict[str, float] | None] = {}
    classnames: list[str] = []
    for name in [m.strip() for m in a.methods.split(",") if m.strip()]:
        method = variants.get(name, name)
        section = dict(sections.get(method, {}))
        if name in variants:
            section["finetune_epochs"] = a.finetune_epochs
        t0 = time.perf_counter()
        cfg = build_config({
            "method": method, "dataset": a.dataset, "partition": a.partition, "beta": a.beta, "shots": 0,
            "num_clients": a.clients, "rounds": a.rounds, "local_epochs": a.local_epochs, "batch_size": a.batch_size,
            "seed": a.seed, "backend": a.backend, "device": a.device, "model": a.model, "pretrained": a.pretrained,
            "eval_every": 1, "eval_last": a.rounds, "out_dir": str(out / name), "progress": False,
            "tensorboard": False, method: section,
        })
        res = run(cfg)
        results[name] = round_metrics(res.out_dir / "client_results.csv")
        from raysim.data import DATASETS, LoadSpec

        if name == next(iter([m.strip() for m in a.methods.split(",") if m.strip()])):
            spec = LoadSpec(data_root=cfg.data.data_root, image_size=32, cache_dir=cfg.output.cache_dir)
            classnames = DATASETS.get(a.dataset)(spec).classnames
        semantics[name] = semantic_structure(res.out_dir, a.rounds, a.dataset, classnames)
        print(f"{name}: {a.rounds} rounds in {time.perf_counter() - t0:.0f}s -> {res.out_dir}", file=sys.stderr, flush=True)
    title = (f"{a.dataset}, {a.partition} beta={a.beta}, {a.clients} clients, {a.family}, {a.rounds} rounds, "
             f"E={a.local_epochs}, B={a.batch_size}, FedTSP plm={a.plm} lambda={a.lam}; homogeneous model {a.homo_model}, "
             f"-FT {a.finetune_epochs} epoch(s); accuracies in %")
    from raysim.metrics import markdown_table

    sem = [[n, f"{s['spearman']:.3f}", f"{s['semantic_gap']:.3f}"] for n, s in semantics.items() if s is not None]
    sem_text = ("\n#### Semantic structure of the global prototypes (fedtsp.txt Figure 1)\n\n"
                + markdown_table(["Method", "Spearman rho vs hierarchy", "semantic gap"], sem)) if sem else ""
    text = f"### {title}\n\n{table(results)}{sem_text}"
    print(text)
    (out / "table.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
