"""How a verify report reads on a terminal: the summary line, the findings by kind with a few examples
each, and the repair steps (`reputd verify` without --json)."""

from __future__ import annotations

import shlex

from daemon.commands.verify import VerifyReport, _n
from indexcore.verify import (
    COMMIT_LOG_CORRUPT,
    OUTPUT_MISSING,
    Finding,
)


def format_text(report: VerifyReport, examples: int = 3) -> list[str]:
    """The human summary: one block per kind (count and the first examples), then the verdict."""
    lines = [f"verified {report.directory} ({report.mode})",
             f"  {report.messages:,} messages [{report.from_offset}, {report.end_offset}) in {report.seconds:.2f} s "
             f"({report.msgs_per_second:,.0f} msgs/s); {_n(report.queues, 'queue')} in "
             f"{_n(report.queue_files, 'file')}, {_n(report.units, 'unit')}; {_n(report.index_files, 'IndexFile')}, "
             f"{_n(report.entries, 'entry', 'entries')}"
             + (f" ({report.entries_not_judged:,} not judged: see the note)" if report.entries_not_judged else "")]
    if report.frontier is not None:
        ev = ", ".join(f"{k} {v}" for k, v in report.frontier.evidence.items()) or "none"
        lines.append(f"  dispatch frontier {report.frontier.offset} ({ev})")
    for note in report.notes:
        lines.append(f"note: {note}")
    by_kind: dict[str, list[Finding]] = {}
    for f in report.findings:
        by_kind.setdefault(f.kind, []).append(f)
    for kind, fs in by_kind.items():
        total = sum(f.count for f in fs)
        lines.append(f"{kind}: {len(fs)} finding{'s' * (len(fs) != 1)}, {total:,} in all")
        for f in fs[:examples]:
            lines.append("  " + _describe(f))
        if len(fs) > examples:
            lines.append(f"  ... and {len(fs) - examples} more (--json lists them all)")
    if report.consistent:
        lines.append("consistent: no difference from what the CommitLog implies")
    elif all(f.kind == COMMIT_LOG_CORRUPT for f in report.findings):
        lines.append(f"{len(report.findings)} finding{'s' * (len(report.findings) != 1)}: the CommitLog is corrupt "
                     "(what `rebuild` and `run` stop at too)")
    else:
        lines.append(f"{len(report.findings)} finding{'s' * (len(report.findings) != 1)}: the files differ from "
                     "what the CommitLog implies")
        lines.extend(_repair_lines(report.repair))
    return lines


_NOUNS = {"queueOffsets": ("unit", "units", "queue offsets"), "entries": ("entry", "entries", "entries"),
          "slots": ("slot", "slots", "slots"), "queueOffsetsLost": ("unit lost", "units lost", "queue offsets")}


def _describe(f: Finding) -> str:
    where = f.file if f.position is None else f"{f.file} @ {f.position}"
    d = f.as_dict()
    if f.kind == OUTPUT_MISSING:
        lo, hi = d["commitLogData"]
        return f"{' and '.join(d['missing'])} absent; the CommitLog holds data [{lo}, {hi})"
    extra = []
    if f.range_name in d:
        one, many, what = _NOUNS.get(f.range_name, ("item", "items", f.range_name))
        ranges = ", ".join(f"[{a}, {b})" for a, b in d[f.range_name][:4]) + (" ..." if len(d[f.range_name]) > 4 else "")
        extra.append(f"{f.count:,} {one if f.count == 1 else many} at {what} {ranges}")
    for key in ("expectedSize", "actualSize", "offset", "error", "ordinal", "indexEntries", "beginPhyOffset",
                "endPhyOffset", "after", "unitsInLastFile"):
        if key in d:
            extra.append(f"{key} {d[key]}")
    if "fields" in d:
        extra.append(", ".join(f"{k} {v['actual']} (expected {v['expected']})" for k, v in d["fields"].items()))
    if f.examples and f.examples[0].get("key"):
        extra.append(f"key {f.examples[0]['key']!r}")
    if f.examples and f.examples[0].get("actualKey") and f.examples[0].get("actualKey") != f.examples[0].get("key"):
        extra.append(f"holds key {f.examples[0]['actualKey']!r}")
    return f"{where}" + (f": {'; '.join(extra)}" if extra else "")


def _repair_lines(plan: dict | None) -> list[str]:
    if plan is None:
        return []
    lines = [f"repair: {plan['command']}"]
    if plan["replace"] or plan["remove"]:
        lines.append(f"  then, with {plan['stop']} stopped:")
    for r in plan["replace"]:
        lines.append(f"  replace {shlex.quote(r['to'])} by {shlex.quote(r['from'])}"
                     + (f" ({r['note']})" if "note" in r else ""))
    for path in plan["remove"]:
        lines.append(f"  remove {shlex.quote(path)}")
    if "note" in plan:
        lines.append(f"  note: {plan['note']}")
    return lines
