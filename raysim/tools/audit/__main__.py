"""`python -m raysim.tools.audit` = `raysim audit`."""

from raysim.tools.audit.cli import main

raise SystemExit(main())
