"""The `raysim` command (also `python -m raysim`): run, sweep, compare, audit, privacy, pretrain."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """usage: raysim COMMAND [args]

commands:
  run [--config F] [key=value ...]     run one federation (same as python raysim/run.py)
  sweep SWEEP.yaml [key=value ...]     run a Ray Tune sweep
  compare [SPEC.yaml] --methods a,b:k=v [--grid key=v1,v2] [--layout L] [key=value ...]
                                       several methods on one setting: the papers' comparison tables
  audit RUN_DIR|FOLDER [--rounds R] ...
                                       privacy audit of a recorded run (or of every run in a sweep /
                                       compare folder): ledgers, then the attacks that apply
  privacy noise|epsilon ...            noise multiplier for a budget, or the budget of a noise level
  pretrain [--out DIR] ...             pretrain the small offline CLIP on generated image-caption data
  export-pfllib OUT [key=value ...]    write a raysim split as a PFLlib / HtFLlib dataset folder
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        from raysim.tools.run import main as run_main

        return run_main(rest, prog="raysim run")
    if cmd == "sweep":
        from raysim.tools.run import main as run_main

        if not rest:
            print("usage: raysim sweep SWEEP.yaml [key=value ...]", file=sys.stderr)
            return 2
        return run_main(["--sweep", rest[0], *rest[1:]], prog="raysim sweep")
    if cmd == "compare":
        from raysim.tools.compare import main as compare_main

        return compare_main(rest)
    if cmd == "audit":
        from raysim.tools.audit import main as audit_main

        return audit_main(rest)
    if cmd == "privacy":
        from raysim.tools.privacy_cli import main as privacy_main

        return privacy_main(rest)
    if cmd == "pretrain":
        from raysim.tools.pretrain import main as pretrain_main

        return pretrain_main(rest)
    if cmd == "export-pfllib":
        from raysim.tools.export_pfllib import main as export_main

        return export_main(rest)
    print(f"error: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
