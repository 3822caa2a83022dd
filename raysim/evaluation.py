"""Evaluation protocols (a registry): how a client's model is scored on the federation's test data.

A protocol is built once per client host from the federation's test set and who owns each row, and
scores one client's predictor. `in_cross` is FedSEPT's protocol (SPEC 1.10): In-Client accuracy on the
client's own test split, Cross-Client accuracy on all other clients' test splits (top-1 and top-5).
Other papers' protocols (FedTSP's sample-weighted local accuracy, VPDR's per-domain accuracy) register
here too, and the run picks one with `evaluation=NAME`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from raysim.data.federation import FederationData, as_tensor
from raysim.registry import Registry


class Protocol:
    name = ""

    def __init__(self, data: FederationData, *, batch_size: int) -> None:
        self.batch_size = batch_size

    def score(self, client_id: int, predict: Callable[..., Tensor]) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def summarize_run(cls, client_results: Path, *, title: str = "") -> tuple[dict[str, float], str]:
        """The protocol's own end-of-run summary from client_results.csv: (numbers added to the run's summary,
        Markdown appended to summary.md). None by default (the In / Cross / HM summary stands alone)."""
        return {}, ""


PROTOCOLS: Registry[type[Protocol]] = Registry("evaluation protocol")


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

    def hits(self, predict: Callable[..., Tensor]) -> tuple[np.ndarray, np.ndarray]:
        bs = self.batch_size
        top1, top5 = [], []
        for i in range(0, len(self.y), bs):
            inputs = (self.x[i : i + bs],) + (() if self.tokens is None else (self.tokens[i : i + bs],))
            logits = predict(*inputs).float().cpu()
            y = self.y[i : i + bs]
            top1.append(logits.argmax(-1) == y)
            k = min(5, logits.shape[-1])
            top5.append((logits.topk(k, dim=-1).indices == y[:, None]).any(-1))
        return torch.cat(top1).numpy(), torch.cat(top5).numpy()

    def score(self, client_id: int, predict: Callable[..., Tensor]) -> dict[str, Any]:
        correct, correct5 = self.hits(predict)
        own = self.owner == client_id

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

    def score(self, client_id: int, predict: Callable[..., Tensor]) -> dict[str, Any]:
        idx = self.test_idx[client_id]
        top1 = top5 = 0
        for i in range(0, len(idx), self.batch_size):
            rows = idx[i : i + self.batch_size]
            logits = predict(self.x[rows]).float().cpu()
            y = self.y[rows]
            top1 += int((logits.argmax(-1) == y).sum())
            k = min(5, logits.shape[-1])
            top5 += int((logits.topk(k, dim=-1).indices == y[:, None]).any(-1).sum())
        n = len(idx)
        return {"in_client": top1 / n if n else math.nan, "cross_client": math.nan, "in_top5": top5 / n if n else math.nan,
                "cross_top5": math.nan, "n_in": n, "n_cross": 0, "domain": self.domains[client_id]}

    @classmethod
    def summarize_run(cls, client_results: Path, *, title: str = "") -> tuple[dict[str, float], str]:
        table = vpdr_table(client_results)
        if not table:
            return {}, ""
        from raysim.metrics import markdown_table

        cols = [c for c in table if c not in ("AVG", "STD")]
        md = markdown_table(["Method", *cols, "AVG", "STD"],
                            [[title or "method", *(f"{100 * table[c]:.2f}" for c in cols), f"{100 * table['AVG']:.2f}",
                              f"{100 * table['STD']:.2f}"]],
                            title="VPDR protocol (last evaluated round; accuracy per domain, AVG and STD over clients, %)")
        return {"vpdr_avg": table["AVG"], "vpdr_std": table["STD"], **{f"vpdr_{c}": table[c] for c in cols}}, md


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
