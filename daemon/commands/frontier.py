"""The dispatch frontier: how far a store's own files prove its ConsumeQueue and index were dispatched (the
end of the newest unit over all ConsumeQueues, the record at the newest IndexFile's endPhyOffset, the
broker's checkpoint times, reputd's reputFromOffset). `reputd verify` checks a live or crashed store up to
it (daemon/commands/verify.py says why), `reputd handoff` completes an output from it."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import numpy as np

from indexcore.checkpoint import CHECKPOINT_FILE, StoreCheckpoint
from indexcore.consumequeue import CONSUME_QUEUE_DIR, last_written_unit
from indexcore.errors import StoreError
from indexcore.indexfile import INDEX_HEADER, INDEX_HEADER_SIZE
from indexcore.indexservice import INDEX_DIR
from indexcore.reader import CommitLog


@dataclass(slots=True)
class Frontier:
    """Where dispatch has provably reached: records ending at or before `offset`, or stored before
    `timestamp`, are dispatched (the index: ending before `offset`)."""

    offset: int = 0
    timestamp: int = 0
    evidence: dict[str, int] = field(default_factory=dict)

    def cut(self, batch, *, index: bool) -> int:
        """How many leading records of `batch` are dispatched."""
        last_end = int(batch.phy_offset[-1]) + int(batch.msg_size[-1])
        if last_end < self.offset or (not index and last_end == self.offset):
            return len(batch)
        end = batch.phy_offset + batch.msg_size
        done = (end < self.offset) if index else (end <= self.offset)
        if self.timestamp:
            done |= batch.store_timestamp < self.timestamp
        return len(batch) if done.all() else int(np.argmin(done))


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _queue_end(path: str) -> int:
    """The CommitLog end of the last unit of a ConsumeQueue file; -1 when it holds no real unit."""
    last = last_written_unit(path)
    return -1 if last is None else last[0] + last[1]


def dispatch_frontier(out: str, commit_log: CommitLog, broker_checkpoint: StoreCheckpoint | None,
                      reput_from_offset: int | None) -> Frontier:
    """What the files prove dispatched (this module's docstring; daemon/commands/verify.py's says when it counts)."""
    frontier = Frontier()
    cq_end = -1
    root = os.path.join(out, CONSUME_QUEUE_DIR)
    if os.path.isdir(root):
        for topic in os.listdir(root):
            tdir = os.path.join(root, topic)
            if not os.path.isdir(tdir):
                continue
            for qid in os.listdir(tdir):
                qdir = os.path.join(tdir, qid)
                names = sorted(n for n in os.listdir(qdir) if n.isdigit()) if os.path.isdir(qdir) else []
                if names:
                    cq_end = max(cq_end, _queue_end(os.path.join(qdir, names[-1])))
    if cq_end >= 0:
        frontier.evidence["consumeQueueEnd"] = cq_end
    index_dir = os.path.join(out, INDEX_DIR)
    names = sorted(n for n in os.listdir(index_dir) if n.isdigit()) if os.path.isdir(index_dir) else []
    if names:
        with open(os.path.join(index_dir, names[-1]), "rb") as f:
            head = f.read(INDEX_HEADER_SIZE)
        if len(head) == INDEX_HEADER_SIZE:
            end_phy = INDEX_HEADER.unpack(head)[3]
            with contextlib.suppress(StoreError, OSError):
                frontier.evidence["indexEnd"] = end_phy + commit_log.read_record(end_phy, check_crc=False).total_size
    if reput_from_offset is not None:
        frontier.evidence["reputFromOffset"] = reput_from_offset
    frontier.offset = max(frontier.evidence.values(), default=0)
    if broker_checkpoint is not None:
        frontier.timestamp = max(broker_checkpoint.logics_msg_timestamp, broker_checkpoint.index_msg_timestamp)
        if frontier.timestamp:
            frontier.evidence["checkpointTimestamp"] = frontier.timestamp
    return frontier


def _read_broker_checkpoint(root: str) -> StoreCheckpoint | None:
    path = os.path.join(root, CHECKPOINT_FILE)
    try:
        with open(path, "rb") as f:
            return StoreCheckpoint.decode(f.read(), path)
    except (OSError, StoreError):
        return None
