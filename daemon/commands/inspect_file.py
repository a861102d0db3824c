"""`reputd inspect`: decode any store file and show its header, then its entries one per line.

The kind is told from the path and the name, as the broker lays them out: a 20-digit name under
`consumequeue/TOPIC/QUEUE/` is a ConsumeQueue file, any other 20-digit name a CommitLog segment, a
17-digit name an IndexFile, `checkpoint` the broker's checkpoint and `reputd.checkpoint` reputd's own
(the file that decides where `reputd run` resumes). Files are mapped and entries streamed, so a 1 GiB
segment is shown in bounded memory. Every name in the output is camelCase, as the broker names fields.

Where a segment's records stop follows the reader's rule (`indexcore.reader.at_written_end`): in the
newest segment of its directory, zeros or a last record still being written are the end of the written
data, not corruption.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterator
from typing import Any

from daemon.commands.inspection import Inspection, _limited, _where_it_stopped, check_file_size
from daemon.config import Config
from daemon.engine.checkpoint import CHECKPOINT_FILE as REPUTD_CHECKPOINT_FILE
from daemon.engine.checkpoint import CheckpointError, read_checkpoint
from indexcore.checkpoint import CHECKPOINT_FILE, StoreCheckpoint
from indexcore.commitlog import MessageRecord
from indexcore.consumequeue import CONSUME_QUEUE_DIR, CQ_UNIT_SIZE, ConsumeQueueUnit
from indexcore.dispatch import DelayLevelTable
from indexcore.errors import CorruptEntryError, StoreLayoutError
from indexcore.indexfile import FIRST_INDEX, IndexFile, IndexHeader, header_fault, index_file_size
from indexcore.reader import DEFAULT_BATCH_BYTES, Stop, decode_segment

_QUEUE_FILE_NAME = re.compile(r"\d{20}")
_INDEX_FILE_NAME = re.compile(r"\d{17}")
_WORD = re.compile(r"_([a-z0-9])")


def camel(name: str) -> str:
    """`begin_phy_offset` -> `beginPhyOffset`."""
    return _WORD.sub(lambda m: m[1].upper(), name)


def camel_keys(value: Any) -> Any:
    """The value with every mapping key in camelCase, at any depth."""
    if isinstance(value, dict):
        return {camel(k) if isinstance(k, str) else k: camel_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [camel_keys(v) for v in value]
    return value


# what `inspect` takes, told by name and place, as the broker lays the files out (the usage errors list them)
ACCEPTED_KINDS = (
    "inspect decodes a CommitLog segment (commitlog/<20 digits>), a ConsumeQueue file "
    "(consumequeue/TOPIC/QUEUE/<20 digits>), an IndexFile (index/<17 digits>), the broker's checkpoint, "
    f"{REPUTD_CHECKPOINT_FILE}, or a DLedger CommitLog's files: a data file (dledger-<selfId>/data/<20 digits>), "
    "its index file (dledger-<selfId>/index/<20 digits>) and its checkpoint (dledger-<selfId>/checkpoint)")


class UnknownFileKind(ValueError):
    """A path whose name and place say no kind `inspect` decodes: a usage error (exit 2), as a missing path."""


def file_kind(path: str) -> str:
    name = os.path.basename(path)
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if name == CHECKPOINT_FILE:
        return "checkpoint"
    if name == REPUTD_CHECKPOINT_FILE:
        return "reputd-checkpoint"
    if _INDEX_FILE_NAME.fullmatch(name):
        return "indexfile"
    if _QUEUE_FILE_NAME.fullmatch(name):
        return "consumequeue" if len(parts) >= 4 and parts[-4] == CONSUME_QUEUE_DIR else "commitlog"
    raise UnknownFileKind(f"{path}: cannot tell the kind of file from its name: {ACCEPTED_KINDS}")


def inspect_path(path: str, config: Config, *, limit: int | None = None, hash_slot_num: int | None = None,
                 index_num: int | None = None) -> Inspection:
    """Inspect the file at `path`, of whatever kind its name says (`file_kind`)."""
    from daemon.commands import inspect_dledger  # noqa: PLC0415 - DLedger CommitLog files (dledger-<selfId>/)

    store = config.store
    kind = inspect_dledger.dledger_kind(path) or file_kind(path)
    if kind in ("dledger-data", "commitlog"):  # the size rule of every command; one odd file is decoded as it is
        check_file_size(path, store.mapped_file_size_commit_log, "mappedFileSizeCommitLog")
    if kind == "dledger-data":
        return inspect_dledger.inspect_dledger_data(path, limit, DelayLevelTable(store.message_delay_level),
                                                    store.max_message_size, os.path.getsize(path))
    if kind == "commitlog":
        return inspect_commitlog(path, limit, DelayLevelTable(store.message_delay_level), store.max_message_size)
    if kind == "dledger-index":
        return inspect_dledger.inspect_dledger_index(path, limit)
    if kind == "dledger-checkpoint":
        return inspect_dledger.inspect_dledger_checkpoint(path)
    if kind == "consumequeue":
        check_file_size(path, store.mapped_file_size_consume_queue, "mappedFileSizeConsumeQueue")
        return inspect_consumequeue(path, limit)
    if kind == "indexfile":
        return inspect_indexfile(path, hash_slot_num or store.max_hash_slot_num, index_num or store.max_index_num,
                                 limit)
    if kind == "reputd-checkpoint":
        return inspect_reputd_checkpoint(path)
    return inspect_checkpoint(path)


def inspect_commitlog(path: str, limit: int | None, delay_table: DelayLevelTable,
                      max_message_size: int) -> Inspection:
    size = os.path.getsize(path)
    base = int(os.path.basename(path))
    out = Inspection({"kind": "commitlog", "path": path, "fileFromOffset": base, "fileSize": size}, iter(()))

    def rows() -> Iterator[dict]:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = 0
            while True:
                result = decode_segment(mm, pos, segment_offset=base, segment_size=size,
                                        max_bytes=DEFAULT_BATCH_BYTES, max_message_size=max_message_size,
                                        delay_table=delay_table)
                b = result.batch
                for i in range(len(b)):
                    at = int(b.phy_offset[i]) - base
                    yield {"commitLogOffset": int(b.phy_offset[i]), "size": int(b.msg_size[i]),
                           "topic": b.topic_of(i), "queueId": int(b.queue_id[i]),
                           "queueOffset": int(b.queue_offset[i]), "sysFlag": int(b.sys_flag[i]),
                           "storeTimestamp": int(b.store_timestamp[i]), "tagsCode": int(b.tags_code[i]),
                           "keys": b.keys[i], "uniqKey": b.uniq_key[i],
                           "properties": MessageRecord.decode(mm, at, check_crc=False).property_map()}
                pos = result.position
                if result.stop is not Stop.LIMIT:
                    break
            out.trailer = _where_it_stopped(mm, path, base, size, max_message_size, result)

    out.rows = _limited(rows(), limit)
    return out


def inspect_consumequeue(path: str, limit: int | None) -> Inspection:
    start = int(os.path.basename(path))
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    size = os.path.getsize(path)
    header = {"kind": "consumequeue", "path": path, "topic": parts[-3], "queueId": int(parts[-2]),
              "fileFromOffset": start, "fileSize": size}
    out = Inspection(header, iter(()))

    def rows() -> Iterator[dict]:
        if size == 0:
            return
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for i in range(size // CQ_UNIT_SIZE):
                u = ConsumeQueueUnit.decode(mm, i * CQ_UNIT_SIZE)
                if not u.is_valid:
                    # the write position; written bytes after it are damage (`ConsumeQueue` refuses the file)
                    if any(mm[(i + 1) * CQ_UNIT_SIZE:]):
                        field = "commit_log_offset" if u.commit_log_offset < 0 else "msg_size"
                        out.trailer["error"] = str(CorruptEntryError(
                            path, f"unit at queue offset {start // CQ_UNIT_SIZE + i}", field,
                            f"{getattr(u, field)} makes it no valid unit, and written units follow it"))
                    return
                yield {"queueOffset": start // CQ_UNIT_SIZE + i, **camel_keys(u._asdict())}

    out.rows = _limited(rows(), limit)
    return out


def _newest_in_directory(path: str) -> bool:
    """Whether no IndexFile in the same directory has a later name (the one a writer may be putting into)."""
    name = os.path.basename(path)
    names = os.listdir(os.path.dirname(os.path.abspath(path)))
    return not any(_INDEX_FILE_NAME.fullmatch(n) and n > name for n in names)


def inspect_indexfile(path: str, hash_slot_num: int, index_num: int, limit: int | None) -> Inspection:
    """The header and the recorded entries; damage (a header no writer leaves, a slot or prev_index that
    does not point back into the recorded entries, a negative time diff) goes to the trailer, so a damaged
    file is shown as far as it can be and exits 1. The rows stop at maxIndexNum whatever indexCount says."""
    size = os.path.getsize(path)
    expected = index_file_size(hash_slot_num, index_num)
    if size != expected:
        from indexcore.errors import SizeMismatchError  # noqa: PLC0415 - only for this message

        raise SizeMismatchError(path, f"IndexFile is {size} bytes; maxHashSlotNum {hash_slot_num} and maxIndexNum "
                                      f"{index_num} give {expected} (pass the broker's values with --config or "
                                      "--hash-slot-num/--index-num)")
    f = IndexFile(path, hash_slot_num, index_num, readonly=True)
    header = {"kind": "indexfile", "path": path, "hashSlotNum": hash_slot_num, "indexNum": index_num,
              **camel_keys(f.header._asdict())}
    out = Inspection(header, iter(()))
    on_disk = IndexHeader.decode(f.header_bytes())
    fault = header_fault(on_disk, hash_slot_num, index_num)
    count = min(f.index_count, index_num)
    if fault is not None:
        header["indexCount"] = on_disk.index_count
        out.trailer["error"] = str(CorruptEntryError(path, "header", *fault))
    else:
        bad = f.slot_fault(newest=_newest_in_directory(path))
        if bad is not None:
            out.trailer["error"] = str(bad)

    def rows() -> Iterator[dict]:
        try:
            for n in range(FIRST_INDEX, count):
                e = f.entry(n)
                if "error" not in out.trailer:
                    bad = f.entry_fault(n, e)
                    if bad is not None:
                        out.trailer["error"] = str(bad)
                yield {"index": n, **camel_keys(e._asdict())}
        finally:
            f.close()

    out.rows = _limited(rows(), limit)
    return out


def inspect_checkpoint(path: str) -> Inspection:
    """The broker's `checkpoint`."""
    with open(path, "rb") as f:
        cp = StoreCheckpoint.decode(f.read(), path)
    return Inspection({"kind": "checkpoint", "path": path, **camel_keys(cp._asdict())}, iter(()))


def inspect_reputd_checkpoint(path: str) -> Inspection:
    """reputd's own checkpoint: the offset `reputd run` resumes from and each dispatcher's state there."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        cp = read_checkpoint(directory)
    except CheckpointError as e:
        raise StoreLayoutError(e.path, e.detail) from None
    if cp is None:
        raise StoreLayoutError(path, "no such file")
    header = {"kind": "reputd-checkpoint", "path": path, "reputFromOffset": cp.reput_from_offset,
              "writtenAtMs": cp.written_at_ms, "dispatchers": sorted(cp.dispatchers)}
    rows = ({"dispatcher": name, "state": camel_keys(state)} for name, state in sorted(cp.dispatchers.items()))
    return Inspection(header, rows)


def text_value(value: Any) -> str:
    """A value as the text output shows it: lists comma-separated, mappings as JSON."""
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        import json  # noqa: PLC0415 - text output of checkpoint states only

        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return str(value)


def text_line(row: dict) -> str:
    return " ".join(f"{k}={text_value(v)}" for k, v in row.items())
