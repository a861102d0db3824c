"""The backfill's ConsumeQueue writers at many queues, without Spark: ranges decoded and staged as the decode
tasks do, queues written from bucket spans piece by piece, committed by the driver's rule; the files are the
rebuild's."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from daemon.backfill import queuewriter
from daemon.backfill.commit import LINKED, commit_queue_dir
from daemon.backfill.phases import queue_work
from daemon.backfill.plan import walk_ranges
from daemon.backfill.ranges import DecodeSettings, decode_range, plan_ranges
from daemon.backfill.source import LOCAL, SegmentDir, SegmentListing
from daemon.backfill.stage import QUEUE_BUCKETS, StagedRange, queue_bucket
from daemon.backfill.writers import Attempt
from daemon.config import load_config
from daemon.engine.rebuild import rebuild
from indexcore.dispatch import DEFAULT_MESSAGE_DELAY_LEVEL
from indexcore.writer import CommitLogWriter, Message
from tests.conformance import files_under

SEGMENT = 1 << 20
CQ_FILE = 400  # 20 units a file: queues of many files
TOPICS, QUEUES, ROUNDS, HOT = 150, 8, 5, 2000


@pytest.fixture(scope="module")
def many_queues(tmp_path_factory) -> tuple[Path, Path]:
    """1,200 queues of 5 messages each, round-robin as brokers spread them, and one hot queue of 2,000
    (100 files), over two segments; and its rebuild."""
    root = tmp_path_factory.mktemp("many-queues")
    ticks = iter(range(10**9))
    clock = lambda: 1_700_000_000_000 + next(ticks)  # noqa: E731
    with CommitLogWriter(str(root / "store" / "commitlog"), SEGMENT, clock=clock) as w:
        for i in range(TOPICS * QUEUES * ROUNDS):
            w.append(Message(f"T{i % TOPICS}", i // TOPICS % QUEUES, b"m", {"TAGS": "a"}))
            if i % 3 == 0:
                w.append(Message("Hot", 0, b"h", {}))
    path = root / "rebuild.yaml"
    store = {"storePathRootDir": str(root / "store"), "mappedFileSizeCommitLog": SEGMENT,
             "mappedFileSizeConsumeQueue": CQ_FILE, "messageIndexEnable": False}
    path.write_text(yaml.safe_dump({"store": store, "output": {"dir": str(root / "reference")},
                                    "logging": {"level": "warning"}}))
    rebuild(load_config(path, env={}))
    return root, root / "reference"


def staged_ranges(store: Path, stage_root: Path, range_bytes: int) -> list:
    listing = SegmentListing([SegmentDir(LOCAL, str(store / "commitlog"))], SEGMENT)
    settings = DecodeSettings(SEGMENT, True, 4 << 20, DEFAULT_MESSAGE_DELAY_LEVEL, 64 << 10, 1 << 20, False, False,
                              False, stage_root=str(stage_root))
    tasks = plan_ranges(listing.segments, SEGMENT, listing.min_offset, None, range_bytes)
    outcomes = {o.number: o for t in tasks for o in decode_range(t, settings)}
    plan, _ = walk_ranges(tasks, outcomes, SEGMENT, listing.missing, listing.min_offset, None, "stop", False)
    return [outcomes[n] for n in plan.ranges]


def test_many_queues_are_written_from_bucket_spans_as_rebuild_writes_them(many_queues, tmp_path, monkeypatch):
    """Each range stages its units queue after queue in bucket order; three tasks take a span of buckets each,
    read a piece of at most WRITE_PIECE_UNITS units from every range at once (the hot queue's bucket, over it,
    a few ranges at a time), put each queue once and sync by syncing the file system once (a file is synced on
    its own only when its queue rolls to the next, ConsumeQueue's rule); the driver renames each queue's
    directory into place, counting its units' messages as new. Every file is the rebuild's."""
    monkeypatch.setattr(queuewriter, "WRITE_PIECE_UNITS", 1000)
    syncs = {"syncfs": 0, "fdatasync": 0}
    monkeypatch.setattr(queuewriter, "_sync_file_system", lambda path: syncs.__setitem__("syncfs", syncs["syncfs"] + 1))
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.__setitem__("fdatasync", syncs["fdatasync"] + 1),
                                                     real_fdatasync(fd))[1])
    root, reference = many_queues
    ranges = staged_ranges(root / "store", tmp_path / "stage", 128 << 10)
    assert len(ranges) >= 6
    table = StagedRange(ranges[0].stage_dir).unit_table()
    assert len(table.bucket) > TOPICS * QUEUES // 2
    assert (np.diff(table.bucket) >= 0).all()
    assert table.bucket.tolist() == [queue_bucket(table.topics[t], q) for t, q in
                                     zip(table.topic.tolist(), table.queue_id.tolist(), strict=True)]
    work = queue_work(ranges, tuple(o.stage_dir for o in ranges), 3)
    assert len(work) == 3
    assert (work[0].buckets[0], work[-1].buckets[1]) == (0, QUEUE_BUCKETS)
    assert all(a.buckets[1] == b.buckets[0] for a, b in itertools.pairwise(work))
    hot = queue_bucket("Hot", 0)
    tables = [StagedRange(o.stage_dir).unit_table() for o in ranges]
    reads = [r for w in work for b0, b1, r in queuewriter.pieces(tables, w.buckets) if b0 <= hot < b1]
    assert len(reads) == 1
    assert len(reads[0]) > 1  # the hot queue's piece is read a few ranges at a time
    out = tmp_path / "out" / "consumequeue"
    counts = {LINKED: 0}
    new_offsets = []  # as a rerun into an output holding other files asks (newMessages)
    for i, w in enumerate(work):
        stats, staged = queuewriter.write_queues(w, stage_dir=str(tmp_path / f"task{i}"), file_size=CQ_FILE,
                                                 attempt=Attempt(i, i, 0))
        assert stats.queues == len(staged) > queuewriter.SYNC_WHOLE_FS_FILES
        for q in staged:
            inode = os.stat(q.directory).st_ino
            counts[LINKED] += commit_queue_dir(q.directory, str(out / q.topic / str(q.queue_id)), q.files,
                                               new_offsets)[LINKED]
            assert os.stat(out / q.topic / str(q.queue_id)).st_ino == inode  # renamed whole
    assert syncs == {"syncfs": 3, "fdatasync": HOT // 20 - 1}
    expected = {k: v for k, v in files_under(reference).items() if k.startswith("consumequeue/")}
    assert counts[LINKED] == len(expected) == TOPICS * QUEUES + HOT // 20
    assert files_under(tmp_path / "out") == expected
    assert len(np.unique(np.concatenate(new_offsets))) == TOPICS * QUEUES * ROUNDS + HOT  # every message is new


def test_a_task_of_few_queues_syncs_each_file(many_queues, tmp_path, monkeypatch):
    """Under SYNC_WHOLE_FS_FILES files a task syncs each one it wrote, not the whole file system."""
    calls = []
    monkeypatch.setattr(queuewriter, "_sync_file_system", calls.append)
    root, reference = many_queues
    ranges = staged_ranges(root / "store", tmp_path / "stage", 1 << 20)
    hot = queue_bucket("Hot", 0)
    work = queuewriter.QueueWork(tuple(o.stage_dir for o in ranges), (hot, hot + 1))
    _, staged = queuewriter.write_queues(work, stage_dir=str(tmp_path / "task"), file_size=CQ_FILE,
                                         attempt=Attempt(0, 0, 0))
    assert calls == []
    assert ("Hot", 0) in {(q.topic, q.queue_id) for q in staged}
    q = next(q for q in staged if q.topic == "Hot")
    assert q.files == HOT // 20
    assert {p.name: p.read_bytes() for p in Path(q.directory).iterdir()} == {
        p.name: p.read_bytes() for p in (reference / "consumequeue" / "Hot" / "0").iterdir()}
