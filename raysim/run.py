"""Front door: `python raysim/run.py [--config FILE.yaml] [key=value ...]` (also `raysim run ...`).

Runs one federation (or, with --sweep, a Ray Tune sweep) and prints the paper-style table; the command
itself is raysim/tools/run.py.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: put the repository root first, not raysim/ itself
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from raysim.tools.run import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
