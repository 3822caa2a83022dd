"""Generic evaluation machinery of the engine: merging the hits of a model computed in parts, and cutting
the test rows into parts that score the same batches as the whole.

The evaluation protocols themselves (the registry and the papers' protocols: in_cross, fedtsp, vpdr) live
in raysim/protocols.py, below raysim.build (where a run is assembled and checked); their names are re-exported here.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from raysim.protocols import (
    PROTOCOLS,
    FedTSPEval,
    Hits,
    InCross,
    Protocol,
    VPDRProtocol,
    fedtsp_round_metrics,
    register_protocol,
    vpdr_table,
)

__all__ = ["PROTOCOLS", "FedTSPEval", "Hits", "InCross", "Protocol", "VPDRProtocol", "block_part", "fedtsp_round_metrics",
           "merge_hits", "register_protocol", "vpdr_table"]


def merge_hits(parts: Sequence[Hits]) -> Hits:
    """The hits of disjoint parts of the rows, as one (rows sorted)."""
    rows = np.concatenate([p.rows for p in parts])
    order = np.argsort(rows, kind="stable")
    return Hits(rows[order], np.concatenate([p.top1 for p in parts])[order], np.concatenate([p.top5 for p in parts])[order])


def block_part(rows: np.ndarray, part: int, parts: int, block: int) -> np.ndarray:
    """Part `part` of `parts` of `rows`, cut at multiples of `block` (the eval batch size), so that every
    batch a part scores is a batch the whole would score: the same inputs, the same logits."""
    blocks = -(-len(rows) // block)
    lo, hi = (blocks * part) // parts, (blocks * (part + 1)) // parts
    return rows[lo * block : hi * block]
