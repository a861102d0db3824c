"""The backfill on a DLedger CommitLog (`store.enableDLegerCommitLog: true`).

The segments are the DLedger data files of `dledger-<selfId>/data`, after the old `commitlog/` of a store upgraded
from the plain CommitLog (as `reputd rebuild` reads them, indexcore/dledgerlog.py). With `--segments`, the last
directory listed is the DLedger data directory and any before it the old CommitLog's. Ranges are cut in bytes as
for a plain CommitLog; a range that starts inside a data file finds its first entry by a header that validates
itself (`boundaries.entry_at`: magic 1, bodyLen = size - 48 and the pos field naming its own offset), and each task
decodes whole entries (reput offsets are entry positions, store offsets entry pos + 48). `--from` and `--to` are
entry positions. Without `--to`, the backfill stops at the committed position of the local store's DLedger
checkpoint, where `reputd rebuild` stops (daemon/dledgerfollow.py), as the broker dispatches only committed
entries; an archive read with `--segments` and no local DLedger log is read to the end of its entries.
"""

from __future__ import annotations

import os

from daemon.backfill.source import LOCAL, SegmentDir, SegmentListing
from daemon.config import Config
from daemon.engine.dledgermode import open_commit_log
from indexcore.dledger import data_dir


def enabled(config: Config) -> bool:
    return config.store.enable_d_leger_commit_log


def segment_dirs(config: Config) -> tuple[SegmentDir, ...]:
    """The store's own: the old CommitLog directories that exist, then the DLedger data directory."""
    store = config.store
    old = [d for d in store.commit_log_dirs if os.path.isdir(d)]
    return (*(SegmentDir(LOCAL, d) for d in old),
            SegmentDir(LOCAL, data_dir(store.store_path_root_dir, store.d_leger_self_id)))


def dledger_from(listing: SegmentListing) -> int:
    """dividedCommitlogOffset: the first segment of the last directory (the DLedger data); -1 when it has none."""
    last = listing.dirs[-1]
    prefix = last.child("")
    starts = [seg.start for seg in listing.segments if seg.location.startswith(prefix)]
    return min(starts, default=-1)


def committed_end(config: Config) -> int | None:
    """Where `reputd rebuild` of the local store stops (its log's read limit: the committed position, or in a
    one-node group the end of the last entry, daemon/dledgerfollow.py); None without a local DLedger log."""
    store = config.store
    if not os.path.isdir(data_dir(store.store_path_root_dir, store.d_leger_self_id)):
        return None
    return open_commit_log(store).read_limit
