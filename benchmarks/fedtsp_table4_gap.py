"""Why FedTSP's private rows of the offline Table 4 sat above its no-DP row (#46): the smallest cell
(epsilon 1) of benchmarks/tables/fedtsp_table4.yaml with and without DP, and the controls that separate what
differs between the two paths. Each run is the spec's own config (digits, Dirichlet 0.1, 4 clients, the tiny
zoo, BERT MiniLM, 5 rounds, seed 1), inline; a control patches one thing in-process and says what.

    HF_HUB_OFFLINE=1 python benchmarks/fedtsp_table4_gap.py [--out DIR] [--only name,name]

Prints, per run, FedTSP's best-round sample-weighted local accuracy (the table's number), and the
server's text prototypes after the last round (its saved state): the mean off-diagonal cosine between
classes, and the mean cosine of each class's prototype to the no-DP run's.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

SPEC = Path(__file__).resolve().parent / "tables" / "fedtsp_table4.yaml"


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = obj.__dict__[name]
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def first_round_without_text() -> contextlib.AbstractContextManager:
    """No alignment term in a client's first round, as the private variant had before Step 0 (its release at the end of round 0)."""
    from raysim.methods.fedtsp.fedtsp import FedTSP

    orig = FedTSP.local_train

    def local_train(self, env, shared, private, data, *, rng, privacy):
        if int(private.get("rounds", 0)) == 0:
            shared = {k: v for k, v in shared.items() if k != "text_protos"}
        return orig(self, env, shared, private, data, rng=rng, privacy=privacy)

    return patched(FedTSP, "local_train", local_train)


def server_text_at_77_positions() -> contextlib.AbstractContextManager:
    """The no-DP server's text from the fixed 77-position embedding, read at all positions (the layout the
    release had before #46), instead of padded to the longest prompt."""
    from raysim.models.plm import TextPrototypes

    def from_texts(cls, plm, per):
        texts = [t for ts in per for t in ts]
        return cls.from_release(plm, plm.embed_fixed(texts).float(), len(per))

    return patched(TextPrototypes, "from_texts", classmethod(from_texts))


def release_without(what: str) -> contextlib.AbstractContextManager:
    """The description release without noise (`noise`: clipped to C only) or without anything (`all`:
    the clean embedding itself), through the same private path."""
    from raysim.privacy.mechanisms.embedding_release import EmbeddingRelease

    orig = EmbeddingRelease.apply

    def apply(self, tensor, *, clip, multiplier, generator, unclipped=False):
        if what == "all":
            return tensor.detach().clone()
        return orig(self, tensor, clip=clip, multiplier=0.0, generator=generator, unclipped=unclipped)

    return patched(EmbeddingRelease, "apply", apply)


def configs(out: Path) -> dict[str, dict[str, Any]]:
    """The spec's no-DP and paper configs of the epsilon-1 cell, as dicts."""
    from raysim.tools.compare import plan, spec_from_args

    spec, _ = spec_from_args([str(SPEC)])
    found = {}
    for _cell, entry, _folder, cfg in plan(spec, out / "plan"):
        if float(cfg.dp.epsilon) in (1.0, math.inf) and entry.label.startswith(("FedTSP (no DP)", "FedTSP + DP (paper")):
            found["nodp" if not cfg.dp.enabled else "paper"] = cfg.to_dict()
    return found


def text_stats(out_dir: Path, reference: torch.Tensor | None) -> tuple[float, float, torch.Tensor]:
    """(mean off-diagonal cosine of the last saved P^T, mean cosine to `reference`, P^T normalised)."""
    last = sorted((out_dir / "state" / "server").glob("*.pt"))[-1]
    text = torch.load(last, map_location="cpu", weights_only=False)["text_protos"]
    P = F.normalize(text.float(), dim=-1)
    S = P @ P.t()
    off = float(S[~torch.eye(len(P), dtype=torch.bool)].mean())
    ref = float((P * reference).sum(-1).mean()) if reference is not None else math.nan
    return off, ref, P


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    with contextlib.ExitStack() as stack:  # without --out the runs go to a temporary folder, removed after
        out = Path(a.out) if a.out else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedtsp-gap-")))
        report(out, set(filter(None, a.only.split(","))))


def report(out: Path, only: set[str]) -> None:
    from raysim.build import build_config
    from raysim.engine.evaluation import PROTOCOLS
    from raysim.engine.loop import run

    base = configs(out)
    none: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    runs: list[tuple[str, str, dict[str, Any], Callable[[], contextlib.AbstractContextManager]]] = [
        ("nodp", "FedTSP without DP (the spec's row)", {}, none),
        ("nodp_lam0", "without DP, fedtsp.lam=0 (no text term at all: CE alone)", {"lam": 0.0}, none),
        ("nodp_warm", "without DP, no alignment in the first round", {}, first_round_without_text),
        ("nodp_77", "without DP, server text at 77 positions (the old release layout)", {}, server_text_at_77_positions),
        ("paper_old", "paper, epsilon 1, dp_positions=noised (the old code's layout)", {"dp_positions": "noised"}, none),
        ("paper", "paper, epsilon 1 (end positions from the clean tokens)", {}, none),
        ("paper_clip_only", "paper's path, clipped to C, no noise", {}, lambda: release_without("noise")),
        ("paper_clean", "paper's path, the clean embedding (no clip, no noise)", {}, lambda: release_without("all")),
        ("code", "code, epsilon 1 (unclipped + Eq. 11 sigma)", {"dp_budget": "code"}, none),
    ]
    reference = None
    print("| run | what | local acc % | P^T off-diag cos | cos to no-DP P^T |\n|---|---|---:|---:|---:|")
    for name, what, opts, ctx in runs:
        if only and name not in only and name != "nodp":
            continue
        d = dict(base["nodp" if name.startswith("nodp") else "paper"])
        d = {**d, "execution": {**d["execution"], "backend": "inline"},
             "output": {**d["output"], "out_dir": str(out / name), "progress": False, "tensorboard": False}}
        d["fedtsp"] = {**d["fedtsp"], **opts}
        with ctx():
            res = run(build_config(d))
        acc = PROTOCOLS.get("fedtsp").summarize(res.out_dir)["local"]
        off, ref, P = text_stats(res.out_dir, reference)
        if name == "nodp":
            reference = P
        print(f"| {name} | {what} | {100 * acc:.2f} | {off:.3f} | {ref:.3f} |", flush=True)


if __name__ == "__main__":
    main()
