"""`reputd inspect`: decode any store file and show its header and entries.

The kind is told from the path and the name, as the broker lays them out: a 20-digit name under
`commitlog/` is a CommitLog segment, under `consumequeue/TOPIC/QUEUE/` a ConsumeQueue file, a 17-digit
name an IndexFile, `checkpoint` the store checkpoint.
"""

from __future__ import annotations

import os
import re

from indexcore.checkpoint import CHECKPOINT_FILE, StoreCheckpoint
from indexcore.consumequeue import CQ_UNIT_SIZE, ConsumeQueueUnit
from indexcore.dispatch import DelayLevelTable
from indexcore.errors import StoreLayoutError
from indexcore.indexfile import FIRST_INDEX, IndexFile, index_file_size
from indexcore.reader import Stop, decode_segment

_CQ_NAME = re.compile(r"\d{20}")
_INDEX_NAME = re.compile(r"\d{17}")


def file_kind(path: str) -> str:
    name = os.path.basename(path)
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if name == CHECKPOINT_FILE:
        return "checkpoint"
    if _INDEX_NAME.fullmatch(name):
        return "indexfile"
    if _CQ_NAME.fullmatch(name):
        if len(parts) >= 4 and parts[-4] == "consumequeue":
            return "consumequeue"
        return "commitlog"
    raise StoreLayoutError(path, "cannot tell the kind of file: expected a CommitLog segment (20-digit name), "
                                 "a ConsumeQueue file (consumequeue/TOPIC/QUEUE/20-digit), an IndexFile "
                                 "(17-digit name) or checkpoint")


def inspect_commitlog(path: str, limit: int | None, delay_table: DelayLevelTable) -> dict:
    size = os.path.getsize(path)
    base = int(os.path.basename(path))
    with open(path, "rb") as f:
        data = f.read()
    records: list[dict] = []
    pos = 0
    result = None
    while limit is None or len(records) < limit:
        result = decode_segment(data, pos, segment_offset=base, segment_size=size, max_bytes=size,
                                delay_table=delay_table)
        b = result.batch
        for i in range(len(b)):
            records.append({
                "commitLogOffset": int(b.phy_offset[i]), "size": int(b.msg_size[i]), "topic": b.topic_of(i),
                "queueId": int(b.queue_id[i]), "queueOffset": int(b.queue_offset[i]),
                "sysFlag": int(b.sys_flag[i]), "storeTimestamp": int(b.store_timestamp[i]),
                "tagsCode": int(b.tags_code[i]), "keys": b.keys[i], "uniqKey": b.uniq_key[i],
            })
        pos = result.position
        if result.stop is not Stop.LIMIT:
            break
    end = {Stop.BLANK: "blank", Stop.END: "end of written data", Stop.ERROR: "corrupt", Stop.LIMIT: "limit"}
    out = {"kind": "commitlog", "path": path, "fileFromOffset": base, "fileSize": size,
           "records": records[:limit] if limit is not None else records,
           "stoppedAt": base + pos, "stop": end[result.stop] if result else "limit"}
    if result is not None and result.error is not None:
        out["error"] = str(result.error.located(path, base + pos))
    return out


def inspect_consumequeue(path: str, limit: int | None) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    start = int(os.path.basename(path))
    units = []
    for i in range(len(data) // CQ_UNIT_SIZE):
        u = ConsumeQueueUnit.decode(data, i * CQ_UNIT_SIZE)
        if not u.is_valid or (limit is not None and len(units) >= limit):
            break
        units.append({"queueOffset": start // CQ_UNIT_SIZE + i, **u._asdict()})
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    return {"kind": "consumequeue", "path": path, "topic": parts[-3], "queueId": int(parts[-2]),
            "fileFromOffset": start, "fileSize": len(data), "units": units}


def inspect_indexfile(path: str, hash_slot_num: int, index_num: int, limit: int | None) -> dict:
    size = os.path.getsize(path)
    if size != index_file_size(hash_slot_num, index_num):
        raise StoreLayoutError(path, f"IndexFile is {size} bytes; maxHashSlotNum {hash_slot_num} and maxIndexNum "
                                     f"{index_num} give {index_file_size(hash_slot_num, index_num)} "
                                     "(pass the broker's values with --config or --hash-slot-num/--index-num)")
    f = IndexFile(path, hash_slot_num, index_num, readonly=True)
    try:
        last = f.index_count if limit is None else min(f.index_count, FIRST_INDEX + limit)
        entries = [{"index": n, **f.entry(n)._asdict()} for n in range(FIRST_INDEX, last)]
        return {"kind": "indexfile", "path": path, "hashSlotNum": hash_slot_num, "indexNum": index_num,
                "header": f.header._asdict(), "entries": entries}
    finally:
        f.close()


def inspect_checkpoint(path: str) -> dict:
    with open(path, "rb") as f:
        cp = StoreCheckpoint.decode(f.read(), path)
    return {"kind": "checkpoint", "path": path, **cp._asdict()}


def render_text(info: dict) -> str:
    """Header lines, then one line per entry."""
    rows = info.get("records") or info.get("units") or info.get("entries") or []
    head = {k: v for k, v in info.items() if k not in ("records", "units", "entries")}
    lines = [f"{k}: {v}" for k, v in head.items()]
    lines += [" ".join(f"{k}={v}" for k, v in row.items()) for row in rows]
    return "\n".join(lines)
