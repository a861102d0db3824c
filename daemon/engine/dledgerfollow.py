"""How far `reputd run` may read a live DLedger CommitLog, and its lag, measured as the broker measures it.

The broker dispatches up to DLedger's committedPos, held in memory (DLedgerCommitLog.getMaxOffset), and
`dispatchBehindBytes` is measured against it. reputd is outside the process and reads what DLedger persists:
- **Any group**: `committedIndex` in `dledger-<selfId>/checkpoint`, which DLedger's flush thread rewrites every
  `checkPointInterval` (3 s in 0.2.3, which 4.9.3 does not change) and at shutdown
  (DLedgerMmapFileStore.FlushDataService, persistCheckPoint), turned into a position through the index file
  (`indexcore.dledger.committed_position`). reputd then trails the broker by up to those 3 s (plus its poll
  interval); a store killed before its first checkpoint (the first 3 s of a new store) has none, and nothing
  is dispatched until the restarted broker writes one.
- **A one-node group** (`dLegerPeers` names only this node): an entry is committed as soon as it is appended
  (DLedgerEntryPusher.waitAck completes at once with one peer, and the QuorumAckChecker's quorum is the node
  itself, so committedIndex follows ledgerEndIndex within a millisecond). There the committed bound is the end of
  the last entry, found in the DLedger index file, whose unit appendAsLeader writes right after the entry's data
  (DLedgerMmapFileStore.java:343-352): a binary search on the sparse index file, checked against the data
  header. reputd then follows within its poll interval, as with a plain CommitLog. The checkpoint's position is
  the floor when the index file is missing or behind.
A restarted one-node broker commits every entry its log holds (its QuorumAckChecker moves its own watermark to
ledgerEndIndex), so the entries past a stale checkpoint that reputd already dispatched are the ones the broker
dispatches too. Entries a new leader cut after reputd dispatched them are repaired (`daemon.engine.dledgerfence`).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import time

from daemon.config import StoreConfig
from indexcore.commitlog import MessageRecord
from indexcore.dledger import (
    BLANK,
    BLANK_MAGIC,
    ENTRY_HEADER_SIZE,
    ENTRY_MAGIC,
    INDEX_DIR,
    INDEX_FILE_SIZE,
    INDEX_UNIT,
    INDEX_UNIT_SIZE,
    committed_position,
    data_files,
    entry_from_index,
)
from indexcore.dledgerlog import DLedgerLog
from indexcore.errors import CorruptRecordError, StoreLayoutError
from indexcore.mappedfile import offset_to_file_name
from indexcore.reader import CommitLog, ReadResult, ReadStatus

MS_PER_SECOND = 1000
ENTRY_PREFIX = BLANK  # an entry starts `int magic, int size`; a BLANK `int -1, int bytes left`


def peer_ids(peers: str) -> list[str]:
    """The node ids of `dLegerPeers` (`n0-host:port;n1-host:port`, MemberState)."""
    return [p.split("-")[0].strip() for p in peers.split(";") if p.strip()]


def one_node_group(store: StoreConfig) -> bool:
    """Whether the broker's own settings make this node a group of one (every entry committed when appended)."""
    return peer_ids(store.d_leger_peers) == [store.d_leger_self_id]


def last_entry_end(log: DLedgerLog) -> int | None:
    """The end (pos + size) of the last entry the DLedger index file has a unit for, checked against its data
    header (`dledger.entry_from_index`); None when there is none or it does not match (then the checkpoint's
    position is used)."""
    index_path = os.path.join(log.home, INDEX_DIR)
    try:
        with open(os.path.join(index_path, offset_to_file_name(0)), "rb") as f:
            fd = f.fileno()
            units = min(os.fstat(fd).st_size, INDEX_FILE_SIZE) // INDEX_UNIT_SIZE

            def written(i: int) -> bool:
                data = os.pread(fd, INDEX_UNIT_SIZE, i * INDEX_UNIT_SIZE)
                if len(data) < INDEX_UNIT_SIZE:
                    return False
                magic, _pos, _size, index, _term = INDEX_UNIT.unpack(data)
                return magic == ENTRY_MAGIC and index == i

            # units are written in order from index 0 (a log's first index): the last one ends them
            found = bisect.bisect_left(range(units), True, key=lambda i: not written(i)) - 1
        if found < 0:
            return None
        h = entry_from_index(data_files(log.data_dir, log.segment_size), index_path, found, log.segment_size)
    except (OSError, StoreLayoutError):
        return None
    return None if h is None else h.pos + h.size


class OneNodeDLedgerLog(DLedgerLog):
    """A DLedger log of a one-node group: readers stop at the end of the last entry appended (module
    docstring), never below the checkpoint's committed position."""

    def refresh(self) -> list[tuple[int, str]]:
        segments = super().refresh()
        self._last_entry()
        return segments

    def _last_entry(self) -> bool:
        """Move the read limit to the last entry's end; whether it moved."""
        if not self.use_committed or self.read_limit is None:
            return False
        end = last_entry_end(self)
        if end is None or end <= self.read_limit:
            return False
        self.read_limit = end
        return True

    def at_end(self, result: ReadResult) -> ReadResult:
        """Reads reach the limit: an entry appended since moves it (no file event tells), and reading goes on."""
        if self.read_limit is not None and result.next_offset >= self.read_limit and result.error is None \
                and self._last_entry() and self.read_limit > result.next_offset:
            CommitLog.refresh(self)  # a data file may be new too
            return dataclasses.replace(result, status=ReadStatus.OK)
        return super().at_end(result)


def committed_end(log: DLedgerLog, store: StoreConfig) -> int:
    """The committed position now (at scrape time, without touching the loop's log): what the lag is measured
    against, as the broker measures dispatchBehindBytes against committedPos."""
    committed = committed_position(log.root, log.self_id, log.segment_size).position
    floor = max(committed, log.divided_offset)
    if one_node_group(store):
        end = last_entry_end(log)
        if end is not None:
            return max(floor, end)
    return floor


def oldest_undispatched_timestamp(log: DLedgerLog, offset: int) -> int | None:
    """STORETIMESTAMP (ms) of the message in the entry at reput offset `offset` (past a DLedger BLANK: the next
    file's first); below dividedCommitlogOffset, of the plain record there (`head`). None when none is readable
    (being written, or damaged: no age to report)."""
    if offset < log.divided_offset:
        from daemon import head  # noqa: PLC0415 - head imports the session, which imports this module

        return head.oldest_undispatched_timestamp(log, offset, head.segments_now(log, offset))
    size = log.segment_size
    at = offset
    for _ in range(2):
        seg = at - at % size
        try:
            with open(os.path.join(log.data_dir, offset_to_file_name(seg)), "rb") as f:
                prefix = os.pread(f.fileno(), 8, at - seg)
                if len(prefix) < 8:
                    return None
                magic, entry_size = ENTRY_PREFIX.unpack(prefix)
                if magic == BLANK_MAGIC:
                    at = seg + size
                    continue
                if magic != ENTRY_MAGIC or entry_size <= ENTRY_HEADER_SIZE:
                    return None
                body = os.pread(f.fileno(), entry_size - ENTRY_HEADER_SIZE, at - seg + ENTRY_HEADER_SIZE)
            return MessageRecord.decode(body, check_crc=False, max_message_size=len(body)).store_timestamp
        except (OSError, CorruptRecordError, ValueError):
            return None
    return None


def lag_end_and_age(log: DLedgerLog, store: StoreConfig, offset: int) -> tuple[int, float]:
    """(the committed position, seconds since the oldest committed entry not dispatched yet was stored)."""
    end = max(offset, committed_end(log, store))
    behind_s = 0.0
    if end > offset:
        stored = oldest_undispatched_timestamp(log, offset)
        if stored is not None:
            behind_s = max(0.0, time.time() - stored / MS_PER_SECOND)
    return end, behind_s
