"""(Re)write a quoted table's result file from a finished `raysim compare` folder (docs/papers/index.md, "Quoted tables").

    raysim compare benchmarks/tables/fedsept_ablation.yaml --out OUT --max-concurrent 1 execution.backend=inline
    python benchmarks/record_table.py --out OUT --to benchmarks/results/fedsept_ablation.json benchmarks/tables/fedsept_ablation.yaml

The arguments after --out and --to are the comparison's own (its spec and key=value overrides, no --out); keys a
resumed run may change (execution.*, output.*) leave the plan alone and need not be repeated. Every run of that
comparison must be finished in OUT with today's settings. Writes the table compare renders and the digest of the
plan it came from; prints the Markdown to paste under the marker line it also prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from raysim.errors import RaysimError
    from raysim.tools.doc_tables import record

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the --out folder of the finished comparison")
    p.add_argument("--to", required=True, help="the result file to write, benchmarks/results/NAME.json")
    a, compare_args = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        rec = record(argv=compare_args, out=Path(a.out))
        rec.write(Path(a.to))
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {a.to}: {e.strerror or e}; pass a writable --to", file=sys.stderr)
        return 2
    print(f"<!-- table: {a.to} via {rec.command} -->")
    print(rec.rendered())
    print(f"wrote {a.to} (plan digest {rec.plan_digest[:12]})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
