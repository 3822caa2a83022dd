"""Evaluation protocols (a registry): how a client's model is scored on the federation's test data.

A protocol is built once per client host from the federation's test set and who owns each row, and
scores one client's predictor. `in_cross` is FedSEPT's protocol (SPEC 1.10): In-Client accuracy on the
client's own test split, Cross-Client accuracy on all other clients' test splits (top-1 and top-5).
Other papers' protocols register here too (`fedtsp`: FedTSP's sample-weighted local accuracy at the best
round and its "global accuracy"; `vpdr`), and the run picks one with `eval.protocol=NAME`.

A protocol also says how a finished run is summarised (`summarize(run_dir, last=...)`, the numbers in
RunResult.summary and summary.md, and `markdown`), so a comparison command that reads run folders can ask
the protocol of each run for its numbers.

This module sits below raysim.build (which checks the eval section with `check_eval`, here) and imports nothing
of the engine; the engine's generic evaluation machinery (raysim/engine/evaluation.py) uses it.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from raysim.config.limits import MAX_BATCH_SIZE, MAX_ROUNDS
from raysim.config.rules import at_most, check
from raysim.config.schema import EvalConfig, TrainConfig
from raysim.data.federation import FederationData, as_tensor
from raysim.errors import shown
from raysim.registry import Registry


@dataclass
class Hits:
    """One model's per-row hits on some of a protocol's test rows: `rows` (sorted row ids), and whether
    the top-1 / top-5 prediction on each was right."""

    rows: np.ndarray
    top1: np.ndarray
    top5: np.ndarray

    def part(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(top1, top5) on `rows` (each must be among self.rows; duplicates and any order allowed)."""
        pos = np.minimum(np.searchsorted(self.rows, rows), max(0, len(self.rows) - 1))
        if len(rows) and not np.array_equal(self.rows[pos], rows):
            raise ValueError("these hits do not cover every row asked for")
        return self.top1[pos], self.top5[pos]



class Protocol:
    """How a client's model is scored. A client's score reads the hits of its model on some test rows
    (`client_rows`), which depend on which clients are evaluated this round (`among`, None = all);
    `rows(among)` is the union over the evaluated clients. `score` runs one client's predictor on its
    rows; a method whose predictor is the same for every client (Method.predicts_globally) has its hits
    computed once on `rows(among)` and every client scored from them with `score_hits`, which gives the
    same numbers."""

    name = ""

    def __init__(self, data: FederationData, *, batch_size: int) -> None:
        self.batch_size = batch_size

    def rows(self, among: Optional[Sequence[int]] = None) -> np.ndarray:
        """Sorted ids of the test rows any evaluated client's score reads."""
        raise NotImplementedError

    def client_rows(self, client_id: int, among: Optional[Sequence[int]] = None) -> np.ndarray:
        """Sorted ids of the test rows client `client_id`'s score reads (default: all of `rows(among)`)."""
        return self.rows(among)

    def hits(self, predict: Callable[..., Tensor], rows: np.ndarray) -> Hits:
        raise NotImplementedError

    def score_hits(self, client_id: int, hits: Hits) -> dict[str, Any]:
        """The client's numbers from its model's hits on `rows(among)` (or on its `client_rows` alone)."""
        raise NotImplementedError

    def score_many(self, client_ids: Sequence[int], hits: Hits) -> list[dict[str, Any]]:
        """`score_hits` of each of `client_ids` from one model's hits (a protocol may do it in one pass)."""
        return [self.score_hits(c, hits) for c in client_ids]

    def score(self, client_id: int, predict: Callable[..., Tensor], among: Optional[Sequence[int]] = None) -> dict[str, Any]:
        return self.score_hits(client_id, self.hits(predict, self.client_rows(client_id, among)))

    # -- a finished run's numbers ---------------------------------------------------------------
    @classmethod
    def summarize(cls, run_dir: str | Path, *, last: int = 5) -> dict[str, float]:
        """SPEC 1.10: the mean In-Client / Cross-Client accuracy of the last `last` evaluated rounds (from
        results.csv), HM of the two means."""
        from raysim.metrics import summarize

        return summarize(Path(run_dir) / "results.csv", last=last)

    @classmethod
    def markdown(cls, method: str, summary: dict[str, float], title: str = "") -> str:
        from raysim.metrics import summary_table

        return (summary_table([(method, summary)], title=title)
                + f"\nMean of the last {int(summary.get('rounds_averaged', 0))} evaluated rounds; accuracies in %.\n")


PROTOCOLS: Registry[type[Protocol]] = Registry("evaluation protocol")


def check_eval(e: EvalConfig, t: TrainConfig) -> None:
    """The eval section's checks (the protocol is looked up in PROTOCOLS); called from raysim.build."""
    check(0 <= e.clients <= t.num_clients,
          f"eval.clients is how many clients are evaluated per evaluated round: 0 (all) up to train.num_clients="
          f"{t.num_clients}; got {e.clients}")
    check(e.protocol in PROTOCOLS, f"eval.protocol must be one of {', '.join(PROTOCOLS.names())}, got {shown(e.protocol)}")
    check(e.batch_size >= 1, f"eval.batch_size must be >= 1, got {e.batch_size}")
    check(e.every >= 1 and e.last >= 0, "eval.every must be >= 1 and eval.last >= 0")
    at_most(e.every, MAX_ROUNDS, "eval.every")
    at_most(e.last, MAX_ROUNDS, "eval.last")
    at_most(e.batch_size, MAX_BATCH_SIZE, "eval.batch_size")


register_protocol = PROTOCOLS.add


@register_protocol
class InCross(Protocol):
    """In-Client (own test split) and Cross-Client (all other clients' test splits) accuracy."""

    name = "in_cross"

    def __init__(self, data: FederationData, *, batch_size: int) -> None:
        super().__init__(data, batch_size=batch_size)
        xte, yte = as_tensor(data.x_test), as_tensor(data.y_test)
        tte = None if data.tok_test is None else as_tensor(data.tok_test)
        owner = np.full(len(data.y_test), -1, dtype=np.int64)
        for cid, te in enumerate(data.test_idx):
            owner[te] = cid
        used = owner >= 0
        rows = slice(None) if used.all() else torch.as_tensor(used)  # all rows: no copy (tokens can be GBs)
        self.x, self.y = xte[rows], yte[rows]
        self.tokens = None if tte is None else tte[rows]
        self.owner = owner[used]
        self._rows: tuple[Any, np.ndarray] = (None, np.arange(len(self.owner)))

    def rows(self, among: Optional[Sequence[int]] = None) -> np.ndarray:
        """All rows of the evaluated clients' test splits: a client's In-Client rows are its own, its
        Cross-Client rows the other evaluated clients' (all other clients' when every client is evaluated)."""
        key = None if among is None else tuple(int(c) for c in among)
        if self._rows[0] != key:  # one set of evaluated clients per run (eval.clients): computed once
            self._rows = (key, np.arange(len(self.owner)) if key is None else np.flatnonzero(np.isin(self.owner, np.asarray(key))))
        return self._rows[1]

    def hits(self, predict: Callable[..., Tensor], rows: np.ndarray) -> Hits:
        bs = self.batch_size
        whole = len(rows) == len(self.owner)  # all rows (sorted, unique): slices, no gather

        def take(a: Tensor, i: int) -> Tensor:
            return a[i : i + bs] if whole else a[torch.as_tensor(rows[i : i + bs])]

        top1, top5 = [torch.zeros(0, dtype=torch.bool)], [torch.zeros(0, dtype=torch.bool)]
        for i in range(0, len(rows), bs):
            inputs = (take(self.x, i),) + (() if self.tokens is None else (take(self.tokens, i),))
            logits = predict(*inputs).float().cpu()
            y = take(self.y, i)
            top1.append(logits.argmax(-1) == y)
            k = min(5, logits.shape[-1])
            top5.append((logits.topk(k, dim=-1).indices == y[:, None]).any(-1))
        return Hits(np.asarray(rows), torch.cat(top1).numpy(), torch.cat(top5).numpy())

    def score_hits(self, client_id: int, hits: Hits) -> dict[str, Any]:
        correct, correct5 = hits.top1, hits.top5
        own = self.owner[hits.rows] == client_id

        def acc(mask: np.ndarray, hits: np.ndarray) -> float:
            return float(hits[mask].mean()) if mask.any() else math.nan

        return {
            "in_client": acc(own, correct),
            "cross_client": acc(~own, correct),
            "in_top5": acc(own, correct5),
            "cross_top5": acc(~own, correct5),
            "n_in": int(own.sum()),
            "n_cross": int((~own).sum()),
        }

    def score_many(self, client_ids: Sequence[int], hits: Hits) -> list[dict[str, Any]]:
        """As score_hits for each client, from per-owner hit counts (one pass over the rows, not one per
        client): In = own hits / own rows, Cross = (all hits - own hits) / (all rows - own rows)."""
        owner = self.owner[hits.rows]
        size = int(owner.max()) + 1 if len(owner) else 0
        n = np.bincount(owner, minlength=size)
        h1 = np.bincount(owner, weights=hits.top1, minlength=size)
        h5 = np.bincount(owner, weights=hits.top5, minlength=size)
        total, t1, t5 = int(n.sum()), float(h1.sum()), float(h5.sum())
        out = []
        for c in client_ids:
            n_in = int(n[c]) if c < size else 0
            a1, a5 = (float(h1[c]), float(h5[c])) if c < size else (0.0, 0.0)
            n_cross = total - n_in
            out.append({
                "in_client": a1 / n_in if n_in else math.nan,
                "cross_client": (t1 - a1) / n_cross if n_cross else math.nan,
                "in_top5": a5 / n_in if n_in else math.nan,
                "cross_top5": (t5 - a5) / n_cross if n_cross else math.nan,
                "n_in": n_in,
                "n_cross": n_cross,
            })
        return out


# ------------------------------------------------------------------------------------ FedTSP's protocol
def fedtsp_round_metrics(client_csv: str | Path) -> dict[int, dict[str, float]]:
    """{round: {local, global, local_top5, global_top5}} from a run's client_results.csv (fedtsp.txt
    section 4, SPEC 2.6):

    local  = sum over clients of correct predictions on their own test split / sum of their test samples
             (sample-weighted: PFLlib's evaluate());
    global = the mean over clients of each client model's accuracy on the union of all clients' test
             splits (own split and everyone else's: (in n_in + cross n_cross) / (n_in + n_cross)).
    Clients without test samples count nowhere."""
    by_round: dict[int, list[dict[str, str]]] = defaultdict(list)
    with open(client_csv, newline="") as f:
        for r in csv.DictReader(f):
            by_round[int(r["round"])].append(r)

    def num(v: str) -> float:
        return float(v) if v not in ("", None) else 0.0  # an empty split has no accuracy and no weight

    out: dict[int, dict[str, float]] = {}
    for rnd, rows in sorted(by_round.items()):
        m: dict[str, float] = {}
        for suffix, (a_in, a_cross) in {"": ("in_client", "cross_client"), "_top5": ("in_top5", "cross_top5")}.items():
            n_in = sum(int(r["n_in"]) for r in rows)
            hits_in = sum(num(r[a_in]) * int(r["n_in"]) for r in rows)
            glob = [(num(r[a_in]) * int(r["n_in"]) + num(r[a_cross]) * int(r["n_cross"])) / (int(r["n_in"]) + int(r["n_cross"]))
                    for r in rows if int(r["n_in"]) + int(r["n_cross"]) > 0]
            m["local" + suffix] = hits_in / n_in if n_in else math.nan
            m["global" + suffix] = float(np.mean(glob)) if glob else math.nan
        out[rnd] = m
    return out


@register_protocol
class FedTSPEval(InCross):
    """FedTSP's protocol (SPEC 2.6 / 2.10.6): each client is scored as by `in_cross` (its own test split
    and everyone else's, top-1 and top-5), and a run is summarised by the best evaluated round of the
    sample-weighted local accuracy, with the "global accuracy" (each client model on the union of all
    test splits, averaged over clients) at that round and at its own best round. The In / Cross / HM
    means of the last evaluated rounds are kept alongside, so everything reading them still works."""

    name = "fedtsp"

    @classmethod
    def summarize(cls, run_dir: str | Path, *, last: int = 5) -> dict[str, float]:
        out = dict(InCross.summarize(run_dir, last=last))
        path = Path(run_dir) / "client_results.csv"
        per_round = fedtsp_round_metrics(path) if path.is_file() else {}
        per_round = {r: m for r, m in per_round.items() if math.isfinite(m["local"])}
        if not per_round:
            return {**out, "local": math.nan, "best_round": math.nan, "global": math.nan, "global_best": math.nan,
                    "local_top5": math.nan, "global_top5": math.nan}
        best = max(per_round, key=lambda r: (per_round[r]["local"], -r))  # the earliest of equal bests
        m = per_round[best]
        return {
            **out,
            "local": m["local"],  # the number fedtsp.txt reports (best round)
            "best_round": float(best),
            "global": m["global"],  # global accuracy at that round
            "global_best": max(v["global"] for v in per_round.values()),
            "local_top5": m["local_top5"],
            "global_top5": m["global_top5"],
            "local_last": per_round[max(per_round)]["local"],
        }

    @classmethod
    def markdown(cls, method: str, summary: dict[str, float], title: str = "") -> str:
        from raysim.metrics import markdown_table

        def pct(k: str) -> str:
            v = summary.get(k, math.nan)
            return f"{100 * v:.2f}" if math.isfinite(v) else "-"

        best = summary.get("best_round", math.nan)
        table = markdown_table(
            ["Method", "Local (best)", "Global (at best)", "Global (best)", "Local top-5", "Best round"],
            [[method, pct("local"), pct("global"), pct("global_best"), pct("local_top5"),
              str(int(best) + 1) if math.isfinite(best) else "-"]],
            title=title,
        )
        return table + ("\nFedTSP's protocol (fedtsp.txt section 4): local = sample-weighted accuracy over all clients' "
                        "own test splits at the best evaluated round (1-based); global = each client model on the union "
                        "of the test splits, averaged over clients; accuracies in %.\n")


@register_protocol
class VPDRProtocol(Protocol):
    """VPDR's protocol (vpdr.txt tables, SPEC 3.4): every client is tested on its own test split (a shared
    global test set counts as every client's own), the round's number is the unweighted mean over clients,
    and the run reports the last round: accuracy per domain (the mean over the domain's clients), AVG and
    STD over clients (sample standard deviation, ddof = 1, which reproduces the paper's STD column from
    its per-domain accuracies, e.g. Office-Caltech FedProto+IGPP 6.62). Cross-Client is not measured (nan)."""

    name = "vpdr"

    def __init__(self, data: FederationData, *, batch_size: int) -> None:
        super().__init__(data, batch_size=batch_size)
        self.x, self.y = as_tensor(data.x_test), as_tensor(data.y_test)
        self.test_idx = [as_tensor(np.asarray(t, dtype=np.int64)) for t in data.test_idx]
        self.domains = list(data.client_domains) if data.client_domains else [""] * len(data.test_idx)

    def rows(self, among: Optional[Sequence[int]] = None) -> np.ndarray:
        """The evaluated clients' own test rows."""
        which = range(len(self.test_idx)) if among is None else among
        parts = [self.test_idx[c].numpy() for c in which]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    def client_rows(self, client_id: int, among: Optional[Sequence[int]] = None) -> np.ndarray:
        return np.unique(self.test_idx[client_id].numpy())

    def hits(self, predict: Callable[..., Tensor], rows: np.ndarray) -> Hits:
        top1, top5 = [torch.zeros(0, dtype=torch.bool)], [torch.zeros(0, dtype=torch.bool)]
        for i in range(0, len(rows), self.batch_size):
            batch = torch.as_tensor(rows[i : i + self.batch_size])
            logits = predict(self.x[batch]).float().cpu()
            y = self.y[batch]
            top1.append(logits.argmax(-1) == y)
            k = min(5, logits.shape[-1])
            top5.append((logits.topk(k, dim=-1).indices == y[:, None]).any(-1))
        return Hits(np.asarray(rows), torch.cat(top1).numpy(), torch.cat(top5).numpy())

    def score_hits(self, client_id: int, hits: Hits) -> dict[str, Any]:
        top1, top5 = hits.part(self.test_idx[client_id].numpy())  # every row of its split, as often as it is listed
        n = len(top1)
        return {"in_client": float(top1.mean()) if n else math.nan, "cross_client": math.nan,
                "in_top5": float(top5.mean()) if n else math.nan, "cross_top5": math.nan, "n_in": n, "n_cross": 0,
                "domain": self.domains[client_id]}

    @classmethod
    def summarize(cls, run_dir: str | Path, *, last: int = 5) -> dict[str, float]:
        """In-Client of the last evaluated rounds (as every protocol), plus the paper's numbers of the last
        round: vpdr_avg, vpdr_std and vpdr_<domain> (per-domain accuracy)."""
        out = dict(InCross.summarize(run_dir, last=last))
        table = vpdr_table(Path(run_dir) / "client_results.csv")
        if table:
            out.update({"vpdr_avg": table["AVG"], "vpdr_std": table["STD"],
                        **{f"vpdr_{c}": v for c, v in table.items() if c not in ("AVG", "STD")}})
        return out

    @classmethod
    def markdown(cls, method: str, summary: dict[str, float], title: str = "") -> str:
        from raysim.metrics import markdown_table

        domains = [k[len("vpdr_"):] for k in summary if k.startswith("vpdr_") and k not in ("vpdr_avg", "vpdr_std")]
        if "vpdr_avg" not in summary:
            return Protocol.markdown(method, summary, title=title)
        return markdown_table(
            ["Method", *domains, "AVG", "STD"],
            [[method, *(f"{100 * summary['vpdr_' + d]:.2f}" for d in domains), f"{100 * summary['vpdr_avg']:.2f}",
              f"{100 * summary['vpdr_std']:.2f}"]],
            title=title,
        ) + ("\nVPDR protocol (vpdr.txt, SPEC 3.4): the last evaluated round; each client on its own test split; "
             "accuracy per domain (mean over its clients), AVG and STD (ddof = 1) over clients; in %.\n")


def vpdr_table(client_results: Path) -> dict[str, float]:
    """{domain: mean accuracy of its clients, ..., "AVG": mean over clients, "STD": sample std over clients}
    of the last evaluated round in client_results.csv (domains in their first-seen client order; one column
    "all" when the clients have no domains)."""
    import pandas as pd

    path = Path(client_results)
    if not path.is_file():
        return {}
    df = pd.read_csv(path)
    df = df.dropna(subset=["in_client"])
    if df.empty:
        return {}
    last = df[df["round"] == df["round"].max()].sort_values("client")
    acc = last["in_client"].astype(float)
    doms = last["domain"].fillna("").astype(str) if "domain" in last else pd.Series([""] * len(last), index=last.index)
    out: dict[str, float] = {}
    for d in dict.fromkeys(doms):
        out[d or "all"] = float(acc[doms == d].mean())
    out["AVG"] = float(acc.mean())
    out["STD"] = float(acc.std(ddof=1)) if len(acc) > 1 else 0.0
    return out
