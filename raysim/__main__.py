"""`python -m raysim ...`: the same command line as the `raysim` console script (raysim.tools.cli)."""

import sys

from raysim.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
