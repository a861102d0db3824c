"""A CommitLog writer fast enough to pace a live benchmark at 100,000 msgs/s and more.

`indexcore.writer.CommitLogWriter` encodes every record in Python and tops out near 55,000 msgs/s,
too close to the rates the live benchmark and the soak ask for. This writer encodes a template of
records once (with the library's own `MessageRecord` encoder, so the layout is the broker's), then
appends by copying chunks of pre-encoded bytes into the mapped CommitLog segment, as a broker's mmap
writes do, after patching in bulk with numpy what differs per record:

    QUEUEOFFSET      the record's unit index in its queue (records cycle over topic x queue, so the
                     n-th record of the log is the (n // pairs)-th of its queue)
    PHYSICALOFFSET   where it lands in the log
    BORNTIMESTAMP,   the wall clock (ms) when the chunk is copied in, so append-to-dispatch latency can
    STORETIMESTAMP   be measured from the store timestamp, as bench/latency.py does
    UNIQ_KEY, KEYS   16 hex digits of the record's sequence number, so every message has its own keys
                     (the properties are outside BODYCRC, which therefore stays valid)

Every template record has the same size (topics of one length, one body size, fixed-width property
values), so a chunk is a plain 2-D array of records. A segment ends as the broker ends it: a BLANK
record when the next record plus the 8-byte BLANK would not fit, then a new pre-allocated segment file.
The log it writes decodes with `indexcore.reader`, and `reputd rebuild` of it equals what `reputd run`
builds while following it (tests/test_paced_writer.py).

    python bench/paced_writer.py DIR [--rate 100000] [--seconds 10] [--max]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from indexcore.commitlog import (
    BORN_HOST_OFFSET,
    BORN_TIMESTAMP_OFFSET,
    END_FILE_MIN_BLANK_LENGTH,
    PHYSICAL_OFFSET_OFFSET,
    QUEUE_OFFSET_OFFSET,
    MessageRecord,
    body_crc32,
    encode_blank,
    encode_properties,
)
from indexcore.mappedfile import MappedFile, offset_to_file_name
from indexcore.writer import DEFAULT_BORN_HOST, DEFAULT_STORE_HOST

STORE_TIMESTAMP_OFFSET = BORN_HOST_OFFSET + len(DEFAULT_BORN_HOST.address) + 4  # IPv4 born host
SEQ_HEX_DIGITS = 16
_HEX = np.frombuffer(b"0123456789ABCDEF", dtype=np.uint8)
_NIBBLE_SHIFTS = np.arange(4 * (SEQ_HEX_DIGITS - 1), -1, -4, dtype=np.uint64)
DEFAULT_SEGMENT_SIZE = 128 * 1024 * 1024


STALL_S = 0.005  # a write() slower than this is a stall of the writer's own (`run` counts them)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def _hex16(values: np.ndarray) -> np.ndarray:
    """(n, 16) uint8: each value as 16 upper-case hex digits."""
    return _HEX[(values.astype(np.uint64)[:, None] >> _NIBBLE_SHIFTS) & 0xF]


def _be64(values: np.ndarray) -> np.ndarray:
    """(n, 8) uint8: each value as a big-endian int64."""
    return values.astype(">i8").view(np.uint8).reshape(-1, 8)


class PacedWriter:
    """Appends pre-encoded records to a new CommitLog directory; `write(n)` appends n records now."""

    def __init__(self, directory: str, segment_size: int = DEFAULT_SEGMENT_SIZE, *,
                 topics: tuple[str, ...] = ("PacedTopicA", "PacedTopicB"), queues: int = 4, body_size: int = 256,
                 tags: int = 3, template_records: int = 4096, seed: int = 1, clock=wall_clock_ms):
        if len({len(t.encode()) for t in topics}) != 1:
            raise ValueError("topics must all have the same length in bytes (records are one fixed size)")
        if not 1 <= tags <= 10:
            raise ValueError("tags must be 1-10 (fixed-width TAGS values)")
        os.makedirs(directory, exist_ok=True)
        if os.listdir(directory):
            raise ValueError(f"{directory} is not empty: the paced writer only starts a new CommitLog")
        self.directory = directory
        self.segment_size = segment_size
        self.clock = clock
        self.pairs = len(topics) * queues
        self.count = 0  # records written
        rng = random.Random(seed)
        run_id = rng.getrandbits(64)
        self._template, self._uniq_at, self._keys_at = self._encode_template(
            topics, queues, body_size, tags, -(-max(template_records, self.pairs) // self.pairs) * self.pairs,
            rng, run_id)
        self.record_size = self._template.shape[1]
        if self.record_size + END_FILE_MIN_BLANK_LENGTH > segment_size:
            raise ValueError(f"a {self.record_size}-byte record does not fit a {segment_size}-byte segment")
        self._file: MappedFile | None = None
        self._view: np.ndarray | None = None
        self._file_start = 0
        self._pos = 0
        self._open(0)

    @staticmethod
    def _encode_template(topics, queues, body_size, tags, n, rng, run_id):
        rows = []
        uniq_at = keys_at = -1
        uniq_prefix = f"{run_id:0{SEQ_HEX_DIGITS}X}"
        for i in range(n):
            pair = i % (len(topics) * queues)
            body = rng.randbytes(body_size)
            props = encode_properties({"UNIQ_KEY": uniq_prefix + "0" * SEQ_HEX_DIGITS,
                                       "KEYS": "key-" + "0" * SEQ_HEX_DIGITS, "TAGS": f"Tag{i % tags}"})
            record = MessageRecord(
                topic=topics[pair // queues], queue_id=pair % queues, flag=0, queue_offset=0, physical_offset=0,
                sys_flag=0, born_timestamp=0, born_host=DEFAULT_BORN_HOST, store_timestamp=0,
                store_host=DEFAULT_STORE_HOST, reconsume_times=0, prepared_transaction_offset=0, body=body,
                properties=props, body_crc=body_crc32(body))
            data = record.encode()
            props_at = len(data) - len(props)
            uniq_at = props_at + props.index(b"UNIQ_KEY\x01") + len("UNIQ_KEY\x01") + SEQ_HEX_DIGITS
            keys_at = props_at + props.index(b"KEYS\x01") + len("KEYS\x01key-")
            rows.append(data)
        if len({len(r) for r in rows}) != 1:
            raise AssertionError("template records differ in size")
        return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(n, -1), uniq_at, keys_at

    @property
    def max_offset(self) -> int:
        """The end of the written data."""
        return self._file_start + self._pos

    def queue_offsets(self) -> dict[tuple[str, int], int]:
        """The next queue offset of every (topic, queue id) written so far."""
        out = {}
        for pair in range(min(self.count, self.pairs)):
            rec = MessageRecord.decode(self._template[pair].tobytes(), check_crc=False)
            out[(rec.topic, rec.queue_id)] = (self.count - pair + self.pairs - 1) // self.pairs
        return out

    def _open(self, start: int) -> None:
        self._close_file()
        path = os.path.join(self.directory, offset_to_file_name(start))
        self._file = MappedFile(path, self.segment_size, create=True)
        self._view = np.frombuffer(self._file.buffer, dtype=np.uint8)
        self._file_start = start
        self._pos = 0

    def _close_file(self) -> None:
        if self._file is not None:
            self._view = None  # release the export before the mapping is closed
            self._file.flush()
            self._file.close()
            self._file = None

    def write(self, n: int) -> None:
        """Append n records, stamped with the clock now; rolls segments as the broker does."""
        now = self.clock()
        while n > 0:
            fit = max(0, (self.segment_size - END_FILE_MIN_BLANK_LENGTH - self._pos) // self.record_size)
            if fit == 0:
                self._file.write(self._pos, encode_blank(self.segment_size - self._pos))
                self._open(self._file_start + self.segment_size)
                continue
            k = min(n, fit)
            self._write_chunk(k, now)
            n -= k

    def _write_chunk(self, k: int, now: int) -> None:
        size = self.record_size
        seq = np.arange(self.count, self.count + k, dtype=np.int64)
        chunk = self._template.take(seq % len(self._template), axis=0)  # a copy: patched before it is seen
        chunk[:, QUEUE_OFFSET_OFFSET : QUEUE_OFFSET_OFFSET + 8] = _be64(seq // self.pairs)
        phy = self._file_start + self._pos + np.arange(k, dtype=np.int64) * size
        chunk[:, PHYSICAL_OFFSET_OFFSET : PHYSICAL_OFFSET_OFFSET + 8] = _be64(phy)
        stamp = _be64(np.array([now], dtype=np.int64))
        chunk[:, BORN_TIMESTAMP_OFFSET : BORN_TIMESTAMP_OFFSET + 8] = stamp
        chunk[:, STORE_TIMESTAMP_OFFSET : STORE_TIMESTAMP_OFFSET + 8] = stamp
        digits = _hex16(seq)
        chunk[:, self._uniq_at : self._uniq_at + SEQ_HEX_DIGITS] = digits
        chunk[:, self._keys_at : self._keys_at + SEQ_HEX_DIGITS] = digits
        self._view[self._pos : self._pos + k * size] = chunk.reshape(-1)
        self._pos += k * size
        self.count += k

    def run(self, rate: float, seconds: float, *, tick: float = 0.002, stop=None, on_tick=None) -> dict:
        """Append at `rate` msgs/s for `seconds` (or until `stop`, a threading.Event, is set); returns the
        figures. Each tick appends what is due, so a late tick catches up and the average rate holds."""
        max_chunk = max(1, int(rate * 0.1))  # never more than 100 ms worth in one copy
        sent0 = self.count
        # the writer's own stalls (a page fault of its mapping): records stamped before a write that took
        # longer than STALL_S are late by that much before any reader can see them
        stalls, stalled_records, longest = 0, 0, 0.0
        cpu0, t0 = time.process_time(), time.monotonic()
        next_tick = t0
        while True:
            now = time.monotonic()
            elapsed = now - t0
            if elapsed >= seconds or (stop is not None and stop.is_set()):
                break
            due = int(elapsed * rate) - (self.count - sent0)
            if due > 0:
                n = min(due, max_chunk)
                self.write(n)
                took = time.monotonic() - now
                longest = max(longest, took)
                if took > STALL_S:
                    stalls, stalled_records = stalls + 1, stalled_records + n
            if on_tick is not None:
                on_tick(self)
            next_tick += tick
            delay = next_tick - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                next_tick = time.monotonic()
        wall = time.monotonic() - t0
        sent = self.count - sent0
        cpu = time.process_time() - cpu0
        return {"messages": sent, "seconds": round(wall, 3), "msgs_per_s": round(sent / wall) if wall else 0,
                "cpu_seconds": round(cpu, 3), "cpu_fraction": round(cpu / wall, 4) if wall else 0.0,
                "bytes": sent * self.record_size, "record_size": self.record_size,
                "stalls": stalls, "stalled_records": stalled_records, "longest_write_ms": round(longest * 1000, 2)}

    def run_max(self, seconds: float, chunk: int = 8192) -> dict:
        """Append as fast as possible for `seconds`: the writer's ceiling."""
        sent0 = self.count
        cpu0, t0 = time.process_time(), time.monotonic()
        while time.monotonic() - t0 < seconds:
            self.write(chunk)
        wall = time.monotonic() - t0
        sent = self.count - sent0
        cpu = time.process_time() - cpu0
        return {"messages": sent, "seconds": round(wall, 3), "msgs_per_s": round(sent / wall),
                "cpu_seconds": round(cpu, 3), "cpu_fraction": round(cpu / wall, 4), "record_size": self.record_size}

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        self._close_file()

    def __enter__(self) -> PacedWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", help="a new (empty or missing) CommitLog directory")
    ap.add_argument("--rate", type=float, default=100_000, help="messages per second (default 100,000)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--max", action="store_true", help="write as fast as possible instead, for the ceiling")
    ap.add_argument("--segment-size", type=int, default=DEFAULT_SEGMENT_SIZE)
    ap.add_argument("--body-size", type=int, default=256)
    ap.add_argument("--queues", type=int, default=4)
    args = ap.parse_args()
    with PacedWriter(args.directory, args.segment_size, body_size=args.body_size, queues=args.queues) as w:
        figures = w.run_max(args.seconds) if args.max else w.run(args.rate, args.seconds)
    mode = "max" if args.max else f"paced at {args.rate:,.0f} msgs/s"
    print(f"{mode}: {figures['messages']:,} messages ({figures['record_size']} bytes each) in "
          f"{figures['seconds']:.1f} s = {figures['msgs_per_s']:,} msgs/s, "
          f"{figures['msgs_per_s'] * figures['record_size'] / 1e6:.1f} MB/s; "
          f"CPU {figures['cpu_fraction'] * 100:.1f}% of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
