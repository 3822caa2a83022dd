"""Evaluation protocols (a registry): how a client's model is scored on the federation's test data.

A protocol is built once per client host from the federation's test set and who owns each row, and
scores one client's predictor. `in_cross` is FedSEPT's protocol (SPEC 1.10): In-Client accuracy on the
client's own test split, Cross-Client accuracy on all other clients' test splits (top-1 and top-5).
Other papers' protocols (FedTSP's sample-weighted local accuracy, VPDR's per-domain accuracy) register
here too, and the run picks one with `evaluation=NAME`.
"""

from __future__ import annotations

import math
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
