"""A per-record CommitLog writer, as a broker writes: each record (and each BLANK) with a write of its own,
the next segment created ahead of time at full size and zero-filled.

4.9.3's `MappedFileQueue.getLastMappedFile` asks `AllocateMappedFileService` for the next file *and the one
after it* when a segment is full (`putRequestAndReturnMappedFile(nextFilePath, nextNextFilePath)`), and
`MappedFile.init` makes each with `RandomAccessFile` + `FileChannel.map(READ_WRITE, 0, fileSize)`: a file
of zeros at its full size (sparse; `warmMapedFileEnable` is off by default). So while segment N is being
filled, N+1 already exists full of zeros; the roll writes N's BLANK, then the first record into N+1, and
N+2 is created. The suite's other writers append in chunks of many records; this one makes a reader meet
the head at every instant of a roll (issue 28 §3).

Run as a process: `python -m tests.record_writer DIR SEGMENT_SIZE ROLLS RATE [--skip I,J]` writes at about
RATE records/s (0: as fast as it can) until its ROLLS-th segment roll and prints one JSON line: records,
rolls, end offset, seconds, and the offsets of the records `--skip` (record indexes) left unwritten: zeros
the size of a record with data after them, real corruption.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from indexcore.commitlog import encode_blank
from indexcore.mappedfile import offset_to_file_name
from indexcore.writer import CommitLogWriter, Message

START_MS = 1_700_000_000_000
TOPICS = ("TopicA", "TopicB", "订单Topic")
BLANK_SIZE = len(encode_blank(64))


class _Segment:
    """One segment file written with pwrite, one call per record; while `writer.dropping`, a record's write
    is dropped (a BLANK, 8 bytes, still goes through, so the roll happens)."""

    def __init__(self, writer: RecordWriter, path: str):
        self.writer = writer
        self.fd = os.open(path, os.O_RDWR)

    def write(self, position: int, data: bytes) -> None:
        if self.writer.dropping and len(data) > BLANK_SIZE:
            return
        os.pwrite(self.fd, data, position)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        os.close(self.fd)


def preallocate(path: str, size: int) -> None:
    """`MappedFile.init`: create the file, then extend it to its full size (zeros)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


class RecordWriter(CommitLogWriter):
    """`CommitLogWriter`'s records, each written with its own pwrite into broker-style pre-created segments.
    `skip` (a set of record indexes) leaves those records unwritten: zeros where they belong, real damage."""

    def __init__(self, directory: str, segment_size: int, *, skip: frozenset[int] = frozenset(), **kw):
        self.rolls = 0
        self.skipped: list[int] = []
        self._skip = skip
        self._index = 0
        self.dropping = False
        super().__init__(directory, segment_size, **kw)

    def _open(self, start: int) -> None:
        if self._file is not None:
            self._file.close()
            self.rolls += 1
        path = os.path.join(self.directory, offset_to_file_name(start))
        preallocate(path, self.segment_size)  # normally already there: created with the previous roll
        self._file = _Segment(self, path)
        self._file_start = start
        self._pos = 0
        # AllocateMappedFileService's "next next" file, made before the first record goes into this one
        preallocate(os.path.join(self.directory, offset_to_file_name(start + self.segment_size)), self.segment_size)

    def append(self, msg: Message):
        index, self._index = self._index, self._index + 1
        self.dropping = index in self._skip
        try:
            result = super().append(msg)
        finally:
            self.dropping = False
        if index in self._skip:
            self.skipped.append(result.phy_offset)
        return result


def message(i: int, body_size: int = 160) -> Message:
    props = {"TAGS": f"Tag{i % 3}", "KEYS": f"order-{i} k{i % 11}", "UNIQ_KEY": f"{i:032X}"}
    return Message(TOPICS[i % len(TOPICS)], i % 4, bytes([i % 251 + 1]) * (body_size + i % 50), props)


def write_rolls(directory: str, segment_size: int, rolls: int, rate: float, *, skip: frozenset[int] = frozenset(),
                clock_start: int = START_MS) -> dict:
    """Append records one by one at about `rate` a second (0: unpaced) until the `rolls`-th segment roll."""
    os.makedirs(directory, exist_ok=True)
    ticks = iter(range(clock_start, clock_start + 10**12, 7))
    w = RecordWriter(directory, segment_size, skip=skip, clock=lambda: next(ticks))
    n = 0
    begin = time.monotonic()
    try:
        while w.rolls < rolls:
            if rate and n >= (time.monotonic() - begin) * rate:
                time.sleep(0.0005)
                continue
            w.append(message(n))
            n += 1
        return {"records": n, "rolls": w.rolls, "end": w.max_offset, "skipped": w.skipped,
                "seconds": round(time.monotonic() - begin, 3)}
    finally:
        w.close()


def last_of_segment(segment_size: int, segment: int, scratch: str) -> int:
    """The index of the last record `write_rolls` puts in the `segment`-th segment (written in `scratch`)."""
    w = RecordWriter(scratch, segment_size, clock=lambda: START_MS)
    try:
        n = 0
        while w.append(message(n)).phy_offset < (segment + 1) * segment_size:
            n += 1
        return n - 1
    finally:
        w.close()


def main(argv: list[str]) -> int:
    directory, segment_size, rolls, rate, *rest = argv
    skip = frozenset()
    if rest[:1] == ["--skip"]:
        skip = frozenset(int(x) for x in rest[1].split(","))
    summary = write_rolls(directory, int(segment_size), int(rolls), float(rate), skip=skip)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main(sys.argv[1:]))
