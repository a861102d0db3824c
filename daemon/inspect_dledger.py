"""`reputd inspect` on the files of a DLedger CommitLog (`dledger-<selfId>/`): a data file's entries (the entry
header and the message inside, decoded by the same kernel as the reput), the index file's units, and the
checkpoint's committedIndex/endIndex. Rows carry the message's store offset (entry pos + 48) as
`commitLogOffset`, as every other store file names it, and whether the entry is committed yet."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

from indexcore.commitlog import MessageRecord
from indexcore.dispatch import DelayLevelTable
from indexcore.dledger import (
    DATA_DIR,
    DLEDGER_ENTRIES,
    ENTRY_HEADER,
    ENTRY_HEADER_SIZE,
    HOME_PREFIX,
    INDEX_DIR,
    INDEX_UNIT,
    INDEX_UNIT_SIZE,
    EntryHeader,
    committed_position,
    parse_properties,
)
from indexcore.errors import StoreError
from indexcore.reader import DEFAULT_BATCH_BYTES, Stop, decode_segment


def dledger_kind(path: str) -> str | None:
    """`dledger-data`, `dledger-index` or `dledger-checkpoint` for a file under `dledger-<selfId>/`, else None."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if len(parts) >= 2 and parts[-2].startswith(HOME_PREFIX) and parts[-1] in ("checkpoint", "checkpoint.bak"):
        return "dledger-checkpoint"
    if len(parts) >= 3 and parts[-3].startswith(HOME_PREFIX) and parts[-1].isdigit() and len(parts[-1]) == 20:
        return {DATA_DIR: "dledger-data", INDEX_DIR: "dledger-index"}.get(parts[-2])
    return None


def _home(path: str) -> tuple[str, str]:
    """(storePathRootDir, selfId) of a file under `<root>/dledger-<selfId>/...`."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    i = max(i for i, p in enumerate(parts) if p.startswith(HOME_PREFIX))
    return os.sep.join(parts[:i]) or os.sep, parts[i][len(HOME_PREFIX):]


def inspect_dledger_data(path: str, limit: int | None, delay_table: DelayLevelTable, max_message_size: int,
                         segment_size: int):
    from daemon.inspect_file import Inspection, _limited, _where_it_stopped  # noqa: PLC0415 - its own caller

    size = os.path.getsize(path)
    base = int(os.path.basename(path))
    header = {"kind": "dledger-data", "path": path, "fileFromOffset": base, "fileSize": size}
    root, self_id = _home(path)
    try:
        committed = committed_position(root, self_id, segment_size)
        header |= {"committedIndex": committed.committed_index, "committedPosition": committed.position}
    except (StoreError, OSError) as e:
        committed = None
        header["committedPosition"] = f"unknown: {e}"
    out = Inspection(header, iter(()))

    def rows() -> Iterator[dict]:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = 0
            while True:
                result = decode_segment(mm, pos, segment_offset=base, segment_size=size, max_bytes=DEFAULT_BATCH_BYTES,
                                        max_message_size=max_message_size, delay_table=delay_table,
                                        multi_flags=DLEDGER_ENTRIES)
                b = result.batch
                for i in range(len(b)):
                    at = int(b.phy_offset[i]) - base
                    e = EntryHeader._make(ENTRY_HEADER.unpack_from(mm, at - ENTRY_HEADER_SIZE))
                    row = {"entryPos": e.pos, "entryIndex": e.index, "entryTerm": e.term, "entrySize": e.size}
                    if committed is not None:
                        row["committed"] = e.end <= committed.position
                    yield row | {
                        "commitLogOffset": int(b.phy_offset[i]), "size": int(b.msg_size[i]), "topic": b.topic_of(i),
                        "queueId": int(b.queue_id[i]), "queueOffset": int(b.queue_offset[i]),
                        "sysFlag": int(b.sys_flag[i]), "storeTimestamp": int(b.store_timestamp[i]),
                        "tagsCode": int(b.tags_code[i]), "keys": b.keys[i], "uniqKey": b.uniq_key[i],
                        "properties": MessageRecord.decode(mm, at, check_crc=False).property_map()}
                pos = result.position
                if result.stop is not Stop.LIMIT:
                    break
            out.trailer = _where_it_stopped(mm, path, base, size, max_message_size, result)
            if result.stop is Stop.BLANK:
                out.trailer["stop"] = "DLedger BLANK (int -1, int bytes left)"

    out.rows = _limited(rows(), limit)
    return out


def inspect_dledger_index(path: str, limit: int | None):
    from daemon.inspect_file import Inspection, _limited  # noqa: PLC0415

    size = os.path.getsize(path)
    base = int(os.path.basename(path))
    out = Inspection({"kind": "dledger-index", "path": path, "fileFromOffset": base, "fileSize": size,
                      "unitSize": INDEX_UNIT_SIZE}, iter(()))

    def rows() -> Iterator[dict]:
        if size < INDEX_UNIT_SIZE:
            return
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for at in range(0, size - size % INDEX_UNIT_SIZE, INDEX_UNIT_SIZE):
                magic, pos, entry_size, index, term = INDEX_UNIT.unpack_from(mm, at)
                if magic == 0 and entry_size == 0:
                    out.trailer = {"stoppedAt": base + at, "stop": "end of written units"}
                    return
                yield {"unitOffset": base + at, "magic": magic, "entryPos": pos, "entrySize": entry_size,
                       "entryIndex": index, "entryTerm": term}

    out.rows = _limited(rows(), limit)
    return out


def inspect_dledger_checkpoint(path: str):
    from daemon.inspect_file import Inspection  # noqa: PLC0415

    with open(path, encoding="utf-8", errors="replace") as f:
        props = parse_properties(f.read())
    return Inspection({"kind": "dledger-checkpoint", "path": path, **props}, iter(()))


__all__ = ["dledger_kind", "inspect_dledger_checkpoint", "inspect_dledger_data", "inspect_dledger_index"]
