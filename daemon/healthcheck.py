"""`python -m daemon.healthcheck`, the container image's HEALTHCHECK command: the check itself is
daemon/ops/healthcheck.py; this entry keeps the command images and compose files already name."""

import sys

from daemon.ops.healthcheck import main

if __name__ == "__main__":
    sys.exit(main())
