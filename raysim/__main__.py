"""`python -m raysim ...`: the same command line as the `raysim` console script (raysim.cli)."""

import sys

from raysim.cli import main

if __name__ == "__main__":
    sys.exit(main())
