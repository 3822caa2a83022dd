"""Why the prototype MIA reads what it reads: a diagnosis of a recorded prototype run (raysim audit's threat model).

For each client of the last recorded round (the model behind its release, as the audit picks it), with
the client's own extractor:

  train acc / test acc   the client model's accuracy on its training set and on its own test split: the
                         generalisation gap is what memorisation a membership attack can find
  n / class              the client's mean training samples per attacked class
  AUC released           the audit's prototype MIA: cosine to the released prototype of the class
                         (members: the client's training samples, non-members: its test split)
  AUC clean              the same against the clean class mean of the client's training features
  AUC leave-one-out      the same, but each member scored against the class mean *without itself*
                         ((n p - z_i) / (n - 1)), each non-member against the mean without one member
                         drawn at random; NOT an attack (it needs to know who is a member):
                         a diagnostic that removes the member's own 1/n share of its prototype, so what
                         is left is the extractor placing training samples nearer their class mean than
                         unseen ones (memorisation)
  self share             the mean over members of cos(z_i, p) - cos(z_i, p_-i): how much of a member's
                         score is its own contribution to the prototype
  score std              the spread (std) of the non-members' scores: the self share moves a member by
                         it is measured against: the AUC rises with self share / score std

AUC released ~ AUC clean >> AUC leave-one-out ~ 0.5 says the attack sees only the self-inclusion of
each member in its class mean, which shrinks as 1/n; AUC leave-one-out > 0.5 says the model memorised.

    python benchmarks/mia_diagnosis.py RUN_DIR [--clients 0 1]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def diagnose(run_dir: Path, clients: list[int] | None = None, max_per_class: int = 800) -> list[dict[str, float]]:
    from raysim.attacks.base import classifier_of, extractor_of
    from raysim.attacks.base import features as _features
    from raysim.attacks.prototype_mia import roc_metrics
    from raysim.storage.runfolder import RunFolder as RunView

    view = RunView.open(run_dir)
    store = view.store
    r = store.upload_rounds()[-1]
    record = store.load_uploads(r)
    method, env, data = view.method, view.env, view.data
    rows = []
    for cid in sorted(record["uploads"]):
        if clients is not None and cid not in clients:
            continue
        saved = view.releasing_state(cid, r)
        if saved is None:
            continue
        model = method.model(env, saved["private"]).eval()
        extract, classify = extractor_of(method, model), classifier_of(model)
        cd = data.client(cid)
        ftr, fte = _features(extract, cd.x_train, env.device), _features(extract, cd.x_test, env.device)
        with torch.no_grad():
            acc_tr = float((classify(ftr.to(env.device)).argmax(-1).cpu() == cd.y_train).float().mean())
            acc_te = float((classify(fte.to(env.device)).argmax(-1).cpu() == cd.y_test).float().mean())
        released = record["uploads"][cid]["protos"].float()
        per: dict[str, list[float]] = {"released": [], "clean": [], "loo": []}
        shares, ns, spread = [], [], []
        gen = torch.Generator().manual_seed(cid)
        for c in torch.unique(cd.y_train).tolist():
            a, b = ftr[cd.y_train == c][:max_per_class], fte[cd.y_test == c][:max_per_class]
            n = int((cd.y_train == c).sum())
            if n < 2 or len(b) == 0:
                continue
            clean = ftr[cd.y_train == c].mean(0)
            loo = (n * clean - a) / (n - 1)  # each member's class mean without itself
            s_rel = F.cosine_similarity(a, released[c].expand_as(a), dim=-1)
            s_cln = F.cosine_similarity(a, clean.expand_as(a), dim=-1)
            s_loo = F.cosine_similarity(a, loo, dim=-1)
            for key, proto in (("released", released[c]), ("clean", clean)):
                sm = s_rel if key == "released" else s_cln
                sn = F.cosine_similarity(b, proto.expand_as(b), dim=-1)
                per[key].append(roc_metrics(sm.numpy(), sn.numpy())[0])
            # non-members against a class mean of n - 1 members too (one member left out at random, seeded), so
            # both sides are scored against means of the same size: without memorisation this AUC is 0.5
            drop = torch.randint(0, len(a), (len(b),), generator=gen)
            s_loo_n = F.cosine_similarity(b, (n * clean - a[drop]) / (n - 1), dim=-1)
            per["loo"].append(roc_metrics(s_loo.numpy(), s_loo_n.numpy())[0])
            shares.append(float((s_cln - s_loo).mean()))
            if len(b) > 1:
                spread.append(float(s_loo_n.std()))
            ns.append(n)
        rows.append({"client": cid, "round": r, "train acc": acc_tr, "test acc": acc_te, "n / class": float(np.mean(ns)),
                     "AUC released": float(np.mean(per["released"])), "AUC clean": float(np.mean(per["clean"])),
                     "AUC leave-one-out": float(np.mean(per["loo"])), "self share": float(np.mean(shares)),
                     "score std": float(np.mean(spread)) if spread else float("nan")})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--clients", type=int, nargs="*", default=None)
    args = ap.parse_args(argv)
    from raysim.metrics import markdown_table

    torch.set_num_threads(1)
    rows = diagnose(args.run_dir, args.clients)
    cols = ["train acc", "test acc", "n / class", "AUC released", "AUC clean", "AUC leave-one-out", "self share", "score std"]
    mean = {c: float(np.mean([r[c] for r in rows])) for c in cols}
    body = [[str(r["client"]), *(f"{r[c]:.4f}" if c != "n / class" else f"{r[c]:.1f}" for c in cols)] for r in rows]
    body.append(["mean", *(f"{mean[c]:.4f}" if c != "n / class" else f"{mean[c]:.1f}" for c in cols)])
    print(f"### {args.run_dir} (round {rows[0]['round'] if rows else '-'})\n")
    print(markdown_table(["client", *cols], body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
