"""`reputd verify`: its options and its front end (the check itself is daemon/commands/verify.py)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from daemon.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    _check_inputs,
    _freeze_start_up,
    _non_negative,
    _store_command,
    command_line,
    raise_open_files_limit,
)

if TYPE_CHECKING:
    from daemon.config import Config


def _add_verify(sub) -> None:
    p = _store_command(sub, "verify", "Check consumequeue/ and index/ against what the CommitLog implies, read-only "
                                      "(exit 0 consistent, 1 differences found).")
    p.add_argument("--from", dest="from_offset", type=_non_negative,
                   help="CommitLog offset of a record to start at (default: the oldest segment)")
    p.add_argument("--json", action="store_true", help="one JSON object per finding, then a summary object")
    p.set_defaults(handler=cmd_verify)


def cmd_verify(args, config: Config) -> int:
    """A reader: it takes no lock on the output directory."""
    import json

    from daemon.commands.verify import VerifyUsageError, verify
    from daemon.commands.verify_text import format_text
    from daemon.engine.rebuild import ProgressBar
    from daemon.ops.logs import configure_logging

    _check_inputs(args, config, output=True)
    bar = ProgressBar() if sys.stderr.isatty() and not args.json else None
    configure_logging(config.logging.level, config.logging.format, stream=bar)
    raise_open_files_limit()
    _freeze_start_up()
    try:
        report = verify(config, from_offset=args.from_offset, progress=bar,
                        rebuild_command=lambda out: command_line(args, config, "rebuild", out=out))
    except VerifyUsageError as e:
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if bar is not None:
            bar.finish()
    if args.json:
        for finding in report.findings:
            print(json.dumps({"type": "finding", **finding.as_dict()}, ensure_ascii=False))
        print(json.dumps(report.summary(), ensure_ascii=False))
    else:
        print("\n".join(format_text(report)))
    return EXIT_OK if report.consistent else EXIT_FAILURE
