"""The backfill's ConsumeQueue writers at many queues, without Spark: ranges decoded and staged as the decode
tasks do, queues written from bucket spans piece by piece, committed by the driver's rule; the files are the
rebuild's."""

from __future__ import annotations

import itertools
import os
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from daemon.backfill import commit, queuewriter
from daemon.backfill.commit import LINKED, MERGED, PRESENT, commit_queue_dir
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


def _stage_all(root: Path, stage: Path) -> list:
    """Every queue of the store written by three tasks into `stage` (as a backfill's write job stages them)."""
    ranges = staged_ranges(root / "store", stage / "ranges", 128 << 10)
    staged = []
    for i, w in enumerate(queue_work(ranges, tuple(o.stage_dir for o in ranges), 3)):
        staged.extend(queuewriter.write_queues(w, stage_dir=str(stage / f"task{i}"), file_size=CQ_FILE,
                                               attempt=Attempt(i, i, 0))[1])
    return staged


def _bytes_read() -> int:
    """Bytes this process has read with read(2)/pread(2) so far (the kernel's count: whatever does the reads)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_a_second_commit_into_an_output_holding_its_queues_reads_only_what_it_wrote(many_queues, tmp_path):
    """The same backfill committed again into the output it made (a rerun): every file is there already, so
    each is compared, and only the bytes the backfill put in it are read, of both files (the staged queue's
    span). It read every file whole, three times: 16,000 queues of 6 MB files took over 15 minutes. Each file is
    left as it was, and no message is new."""
    root, reference = many_queues
    out = tmp_path / "out" / "consumequeue"
    first = commit.commit_queues(_stage_all(root, tmp_path / "first"), str(out), None, lambda n: None)
    assert first[LINKED] == TOPICS * QUEUES + HOT // 20
    staged = _stage_all(root, tmp_path / "second")
    new_offsets: list = []
    before = _bytes_read()
    again = commit.commit_queues(staged, str(out), new_offsets, lambda n: None)
    read = _bytes_read() - before
    assert again == {LINKED: 0, MERGED: 0, PRESENT: TOPICS * QUEUES + HOT // 20}
    units_bytes = (TOPICS * QUEUES * ROUNDS + HOT) * 20
    assert read <= 2 * units_bytes + (64 << 10), read  # was 3 x 1,300 files x 400 bytes
    assert new_offsets == []
    expected = {k: v for k, v in files_under(reference).items() if k.startswith("consumequeue/")}
    assert files_under(tmp_path / "out") == expected


def test_a_signal_during_the_commit_stops_it_between_two_queues(many_queues, tmp_path, monkeypatch):
    """SIGINT while the commit puts queues in place (the backfill's Interrupt in its commit state): the commit
    stops before the next queue, every queue it put is whole and the rest absent, the merged files are synced,
    and CommitInterrupted says how far it got; the same backfill committed again puts the rest, and the output
    is the rebuild's. The commit used to run on to its end, however long."""
    from daemon.backfill import phases
    from daemon.backfill.interrupt import CommitInterrupted, Interrupt
    from daemon.backfill.phases import CommitSteps

    root, reference = many_queues
    out = tmp_path / "out"
    staged = _stage_all(root, tmp_path / "first")
    said, logged = [], []
    job = SimpleNamespace(out=str(out), say=said.append, broker=None, _broker_check=lambda: None,
                          log=SimpleNamespace(info=lambda event, **kw: logged.append(event),
                                              warning=lambda event, **kw: logged.append((event, kw["stopped"]))))
    interrupt = Interrupt(own=True)
    job.stop_requested = lambda: interrupt.signal is not None
    put = []
    commit_queue_dir = commit.commit_queue_dir

    def then_a_signal(*args, **kwargs):
        counts = commit_queue_dir(*args, **kwargs)
        put.append(args[1])
        if len(put) == 600:
            os.kill(os.getpid(), signal.SIGINT)
        return counts

    monkeypatch.setattr(commit, "commit_queue_dir", then_a_signal)
    monkeypatch.setattr(phases, "COMMIT_PROGRESS_S", 0.0)
    try:
        interrupt.arm(None, "g")
        interrupt.committing()
        steps = CommitSteps(job, len(staged), 1, False, False)
        with pytest.raises(CommitInterrupted) as caught:
            commit.commit_queues(staged, str(out / "consumequeue"), None, lambda n: steps.between(n, 0))
    finally:
        interrupt.stopping()
        interrupt.disarm()
    where = f"after putting the files of 600 of {len(staged):,} queues and 0 of 1 IndexFile in place"
    assert str(caught.value) == (f"the backfill's commit stopped {where} (each whole) and put nothing more in {out}; "
                                 "the same backfill run again puts the rest (what is in place is checked and kept)")
    assert isinstance(caught.value, KeyboardInterrupt)  # exit 130
    assert logged == ["backfill_commit_started", ("backfill_interrupted", where)]
    assert said[0].startswith(f"committing: putting the files of {len(staged):,} queues and 1 IndexFile in place")
    assert len(said) > 1  # a line every COMMIT_PROGRESS_S
    assert all(re.fullmatch(rf"committed [\d,]+ of {len(staged):,} queues in \d+ s, about \d+ s left for the rest",
                            line) for line in said[1:]), said
    reference_files = files_under(reference)
    held = files_under(out)
    assert {str(Path(p).parent) for p in held} == {str(Path(d).relative_to(out)) for d in put}
    assert all(reference_files[k] == v for k, v in held.items())
    monkeypatch.setattr(commit, "commit_queue_dir", commit_queue_dir)
    again = commit.commit_queues(_stage_all(root, tmp_path / "second"), str(out / "consumequeue"), [],
                                 lambda n: None)
    assert again[PRESENT] == len(held)
    assert again[MERGED] == 0
    assert files_under(out) == {k: v for k, v in reference_files.items() if k.startswith("consumequeue/")}


def test_the_messages_a_commit_put_are_counted_once_each():
    """newMessages of a rerun: the distinct CommitLog offsets of the units and keys the commit put (a message has
    a unit in each of its queues and an entry per key), counted as np.unique counts them, at every size."""
    rng = np.random.default_rng(7)
    for n in (0, 1, 2, 1000):
        offsets = np.sort(rng.choice(1 << 40, n, replace=False)).astype(np.int64)
        queue = rng.integers(0, 5, n)
        queues = [offsets[queue == q] for q in range(5)]
        keys = [np.repeat(offsets[::3], 2)]
        arrays = [a for a in queues + keys if len(a)]
        expected = len(np.unique(np.concatenate(arrays))) if arrays else 0
        assert commit.distinct_count(arrays) == expected == n
