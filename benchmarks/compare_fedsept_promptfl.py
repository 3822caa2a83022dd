"""FedSEPT vs PromptFL through the engine, same data, same seed, one In / Cross / HM table.

    python benchmarks/compare_fedsept_promptfl.py --rounds 5 --backend inline dp.epsilon=1
    python benchmarks/compare_fedsept_promptfl.py --methods fedsept,fedsept:router=patch model=... pretrained=...

Extra arguments are config overrides (key=value) applied to every run; `fedsept.*` keys reach FedSEPT
only. A method entry may carry options of its own section after a colon (`fedsept:router=patch;rank=8`).
Each run writes its usual folder under --out (default runs/compare-<timestamp>).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--backend", default="inline", help="inline | ray")
    p.add_argument("--methods", default="promptfl,fedsept", help="comma-separated methods to compare")
    p.add_argument("--out", default="", help="parent folder of the runs")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. dp.epsilon=1 dataset=digits")
    args = p.parse_args(argv)

    from raysim.config import build_config, merge_config, parse_overrides
    from raysim.engine import run
    from raysim.metrics import summary_table

    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    extra = parse_overrides(args.overrides)
    rows = []
    cfg = None
    for entry in [m.strip() for m in args.methods.split(",") if m.strip()]:
        name, _, own = entry.partition(":")
        values = {k: v for k, v in extra.items() if not isinstance(v, dict) or k in ("dp", name)}
        values = merge_config(values, parse_overrides([f"{name}.{kv}" for kv in own.split(";") if kv]))
        folder = entry.replace(":", "-").replace(";", "-").replace("=", "_")
        values = merge_config(values, dict(method=name, rounds=args.rounds, backend=args.backend, out_dir=str(out / folder)))
        cfg = build_config(values)
        t0 = time.perf_counter()
        result = run(cfg)
        print(f"{entry}: {time.perf_counter() - t0:.1f}s, {result.out_dir}", file=sys.stderr)
        rows.append((entry, result.summary))
    assert cfg is not None
    eps = "no DP" if not cfg.dp.enabled else f"epsilon={cfg.dp.epsilon:g}"
    title = (f"{cfg.data.dataset}, {cfg.data.partition}, {cfg.train.num_clients} clients, {cfg.train.rounds} rounds, {cfg.model.name}, "
             f"seed {cfg.train.seed}, {eps}")
    print(summary_table(rows, title=title))
    print(f"Mean of the last {max(1, cfg.eval.last)} evaluated rounds; accuracies in %.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
