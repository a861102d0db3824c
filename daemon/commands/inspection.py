"""What every `reputd inspect` decoder shares: the shape of an inspection, the row limit, and where a
segment's records stop (the reader's rule, `indexcore.reader.at_written_end`). Both the CommitLog and the
DLedger decoders use it, so neither imports the other."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from indexcore.commitlog import RECORD_PREFIX
from indexcore.reader import Stop, at_written_end

_SEGMENT_FILE_NAME = re.compile(r"\d{20}")


@dataclass
class Inspection:
    """A file's header fields and a stream of its entries; `trailer` is filled once the stream ends."""

    header: dict
    rows: Iterator[dict]
    trailer: dict = field(default_factory=dict)


def _limited(rows: Iterator[dict], limit: int | None) -> Iterator[dict]:
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            return
        yield row


def _has_written_successor(path: str, base: int) -> bool:
    """Whether a later segment in the same directory holds data (a broker pre-creates its next segment,
    all zeros, before it needs it: that one does not count)."""
    directory = os.path.dirname(os.path.abspath(path))
    for name in os.listdir(directory):
        if _SEGMENT_FILE_NAME.fullmatch(name) and int(name) > base:
            with open(os.path.join(directory, name), "rb") as f:
                head = f.read(RECORD_PREFIX.size)
            if len(head) == RECORD_PREFIX.size and RECORD_PREFIX.unpack(head)[0] != 0:
                return True
    return False


def _where_it_stopped(mm, path: str, base: int, size: int, max_message_size: int, result) -> dict:
    pos = result.position
    trailer: dict = {"stoppedAt": base + pos}
    if result.stop is Stop.BLANK:
        trailer["stop"] = "blank"
        return trailer
    bad = result.stop is Stop.ERROR
    successor = _has_written_successor(path, base)
    if not successor and at_written_end(mm, pos, size, max_message_size, bad_record=bad):
        trailer["stop"] = "end of written data"
        if bad:
            trailer["incompleteRecord"] = f"still being written: {result.error.located(path, base + pos)}"
        return trailer
    trailer["stop"] = "corrupt"
    if bad:
        trailer["error"] = str(result.error.located(path, base + pos))
    else:
        where = "before the end of a segment that has a successor" if successor else "with data after it"
        trailer["error"] = f"{path} @ offset {base + pos}: zero TOTALSIZE {where}"
    return trailer


def check_file_size(path: str, expected: int, what: str) -> None:
    """The size rule every command follows, for the one file `inspect` decodes: a file of another size than
    the setting `what` gives (`mappedFileSizeCommitLog` for a CommitLog segment or DLedger data file,
    `mappedFileSizeConsumeQueue` for a ConsumeQueue file), like every file of its directory, means the
    setting is not the broker's: SizeMismatchError, the configuration error (exit 2) the other commands
    give. One file of another size among right ones is damage: decoded as it is."""
    from indexcore.errors import SizeMismatchError  # noqa: PLC0415 - only for this message

    size = os.path.getsize(path)
    if size == expected:
        return
    directory = os.path.dirname(os.path.abspath(path))
    names = [n for n in os.listdir(directory) if _SEGMENT_FILE_NAME.fullmatch(n)]
    if {os.path.getsize(os.path.join(directory, n)) for n in names} != {size}:
        return
    if what == "mappedFileSizeCommitLog":
        raise SizeMismatchError(path, f"segment is {size} bytes, mappedFileSizeCommitLog is {expected}; the segments "
                                      f"here are {size} bytes")
    raise SizeMismatchError(path, f"every ConsumeQueue file here is {size} bytes, {what} is {expected}")
