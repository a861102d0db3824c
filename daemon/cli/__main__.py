"""`python -m daemon.cli`: the `reputd` command (the tests, the benchmarks and `make run` start it so)."""

import sys

from daemon.cli import main

sys.exit(main())
