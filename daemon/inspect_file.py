"""`reputd inspect`: decode any store file and show its header, then its entries one per line.

The kind is told from the path and the name, as the broker lays them out: a 20-digit name under
`consumequeue/TOPIC/QUEUE/` is a ConsumeQueue file, any other 20-digit name a CommitLog segment, a
17-digit name an IndexFile, `checkpoint` the store checkpoint. Files are mapped and entries streamed,
so a 1 GiB segment is shown in bounded memory.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from indexcore.checkpoint import CHECKPOINT_FILE, StoreCheckpoint
from indexcore.consumequeue import CONSUME_QUEUE_DIR, CQ_UNIT_SIZE, ConsumeQueueUnit
from indexcore.dispatch import DelayLevelTable
from indexcore.errors import StoreLayoutError
from indexcore.indexfile import FIRST_INDEX, IndexFile, index_file_size
from indexcore.reader import DEFAULT_BATCH_BYTES, Stop, decode_segment

_QUEUE_FILE_NAME = re.compile(r"\d{20}")
_INDEX_FILE_NAME = re.compile(r"\d{17}")


@dataclass
class Inspection:
    """A file's header fields and a stream of its entries; `trailer` is filled once the stream ends."""

    header: dict
    rows: Iterator[dict]
    trailer: dict = field(default_factory=dict)


def file_kind(path: str) -> str:
    name = os.path.basename(path)
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if name == CHECKPOINT_FILE:
        return "checkpoint"
    if _INDEX_FILE_NAME.fullmatch(name):
        return "indexfile"
    if _QUEUE_FILE_NAME.fullmatch(name):
        return "consumequeue" if len(parts) >= 4 and parts[-4] == CONSUME_QUEUE_DIR else "commitlog"
    raise StoreLayoutError(path, "cannot tell the kind of file: expected a CommitLog segment (20-digit name), "
                                 "a ConsumeQueue file (consumequeue/TOPIC/QUEUE/20-digit), an IndexFile "
                                 "(17-digit name) or checkpoint")


def _limited(rows: Iterator[dict], limit: int | None) -> Iterator[dict]:
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            return
        yield row


def inspect_commitlog(path: str, limit: int | None, delay_table: DelayLevelTable) -> Inspection:
    size = os.path.getsize(path)
    base = int(os.path.basename(path))
    out = Inspection({"kind": "commitlog", "path": path, "fileFromOffset": base, "fileSize": size}, iter(()))

    def rows() -> Iterator[dict]:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = 0
            while True:
                result = decode_segment(mm, pos, segment_offset=base, segment_size=size,
                                        max_bytes=DEFAULT_BATCH_BYTES, delay_table=delay_table)
                b = result.batch
                for i in range(len(b)):
                    yield {"commitLogOffset": int(b.phy_offset[i]), "size": int(b.msg_size[i]),
                           "topic": b.topic_of(i), "queueId": int(b.queue_id[i]),
                           "queueOffset": int(b.queue_offset[i]), "sysFlag": int(b.sys_flag[i]),
                           "storeTimestamp": int(b.store_timestamp[i]), "tagsCode": int(b.tags_code[i]),
                           "keys": b.keys[i], "uniqKey": b.uniq_key[i]}
                pos = result.position
                if result.stop is not Stop.LIMIT:
                    break
        stops = {Stop.BLANK: "blank", Stop.END: "end of written data", Stop.ERROR: "corrupt"}
        out.trailer = {"stoppedAt": base + pos, "stop": stops[result.stop]}
        if result.error is not None:
            out.trailer["error"] = str(result.error.located(path, base + pos))

    out.rows = _limited(rows(), limit)
    return out


def inspect_consumequeue(path: str, limit: int | None) -> Inspection:
    start = int(os.path.basename(path))
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    size = os.path.getsize(path)

    def rows() -> Iterator[dict]:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for i in range(size // CQ_UNIT_SIZE):
                u = ConsumeQueueUnit.decode(mm, i * CQ_UNIT_SIZE)
                if not u.is_valid:
                    return
                yield {"queueOffset": start // CQ_UNIT_SIZE + i, **u._asdict()}

    header = {"kind": "consumequeue", "path": path, "topic": parts[-3], "queueId": int(parts[-2]),
              "fileFromOffset": start, "fileSize": size}
    return Inspection(header, _limited(rows(), limit))


def inspect_indexfile(path: str, hash_slot_num: int, index_num: int, limit: int | None) -> Inspection:
    size = os.path.getsize(path)
    expected = index_file_size(hash_slot_num, index_num)
    if size != expected:
        raise StoreLayoutError(path, f"IndexFile is {size} bytes; maxHashSlotNum {hash_slot_num} and maxIndexNum "
                                     f"{index_num} give {expected} (pass the broker's values with --config or "
                                     "--hash-slot-num/--index-num)")
    f = IndexFile(path, hash_slot_num, index_num, readonly=True)
    header = {"kind": "indexfile", "path": path, "hashSlotNum": hash_slot_num, "indexNum": index_num,
              **f.header._asdict()}

    def rows() -> Iterator[dict]:
        try:
            for n in range(FIRST_INDEX, f.index_count):
                yield {"index": n, **f.entry(n)._asdict()}
        finally:
            f.close()

    return Inspection(header, _limited(rows(), limit))


def inspect_checkpoint(path: str) -> Inspection:
    with open(path, "rb") as f:
        cp = StoreCheckpoint.decode(f.read(), path)
    return Inspection({"kind": "checkpoint", "path": path, **cp._asdict()}, iter(()))


def text_line(row: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in row.items())
