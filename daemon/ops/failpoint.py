"""Test hook: kill this process at a named step of an output file's creation or roll.

The crash matrix (tests/test_crash_matrix.py) sets REPUTD_FAILPOINT to `POINT` or `POINT@N` (the Nth time
the point is reached), e.g. `index.after_allocate@2`; the process then dies by SIGKILL there, leaving the
files exactly as a kill at that instant would. The points are named in `indexcore.mappedfile.create_file`
(`index.{before_create|after_create|after_allocate|after_header|after_fsync|after_rename}`) and
`create_in_place` (`consumequeue.{before_create|after_create|after_allocate|after_header}`),
`indexcore.indexservice` (`index.after_straddling_key`), `daemon.engine.dledgerfence`
(`dledger.after_repair_checkpoint`, a truncation repair's checkpoint written) and `indexcore.retention`
(`retention.after_delete`, after each expired file deleted) and `daemon.engine.writebehind`
(`consumequeue.write_behind`, on `run`'s writer thread before it writes a batch handed over). Unset, nothing
is installed and every point is a no-op. Not for production use.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

from indexcore import _failpoints

ENV_FAILPOINT = "REPUTD_FAILPOINT"


def install_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Read REPUTD_FAILPOINT once and arm the hook it names."""
    spec = (os.environ if environ is None else environ).get(ENV_FAILPOINT)
    if not spec:
        return
    point, _, nth = spec.partition("@")
    left = int(nth) if nth else 1

    def hook(reached: str) -> None:
        nonlocal left
        if reached == point:
            left -= 1
            if left == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    _failpoints.hook = hook
