"""The lag a broker's operators watch: the CommitLog's max offset is the end of the written data, wherever
the files end. A broker pre-creates its next segment (and the one after) before it needs them; those files
of zeros must not count as written (issue 11 item 5). The real broker's own writer is the stress-mode check
in tests/test_realbroker_live.py."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest

from daemon.engine.head import (
    HeadDescriptor,
    oldest_undispatched_timestamp,
    segments_now,
    written_below,
    written_end,
)
from daemon.ops.metrics import RetentionBehind
from indexcore.errors import StoreError
from indexcore.reader import CommitLog
from indexcore.writer import CommitLogWriter, Message
from tests.test_daemon import SEGMENT, START_MS, Store, stop, wait_for
from tests.test_headwarm import resident


def precreate(directory: Path, end: int, ahead: int = 2) -> list[Path]:
    """What a broker's AllocateMappedFileService leaves: the next `ahead` segments, full size, all zeros."""
    made = []
    start = end - end % SEGMENT
    for k in range(1, ahead + 1):
        path = directory / f"{start + k * SEGMENT:020d}"
        if not path.exists():
            with open(path, "wb") as f:
                f.truncate(SEGMENT)
            made.append(path)
    return made


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_written_end_is_past_the_data_not_past_the_files(tmp_path, ahead):
    log_dir = tmp_path / "commitlog"
    with CommitLogWriter(str(log_dir), SEGMENT) as w:
        while w.max_offset < SEGMENT + 5000:
            w.append(Message("T", 0, b"x" * 300, {"KEYS": "k"}))
        end = w.max_offset
    precreate(log_dir, end, ahead)
    log = CommitLog(str(log_dir), SEGMENT, follow=True)
    assert len(log.segments) == 2 + ahead
    assert log.max_offset == (2 + ahead) * SEGMENT  # what the files span
    for offset in (0, SEGMENT, end - 300, end):
        assert written_end(log, offset) == end
    assert written_end(log, end + 2 * SEGMENT) == end + 2 * SEGMENT  # never below the offset itself


def test_lag_reads_zero_after_catching_up_on_a_preallocating_writer(tmp_path):
    """The daemon follows a CommitLog whose next two segments always exist already: once caught up, the
    lag gauge is 0 and /healthz's commitLogMaxOffset is the end of the data (before: the start of the
    newest file, up to two segments of lag that is not there)."""
    store = Store(tmp_path)
    log_dir = tmp_path / "store" / "commitlog"
    store.append(300)
    precreate(log_dir, store.end)
    proc = store.start()
    try:
        for _ in range(3):
            while store.end // SEGMENT == (store.end + 20_000) // SEGMENT:
                store.append(50)
            store.append(120)  # into a segment created ahead of time
            precreate(log_dir, store.end)
            wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="caught up")
            metrics = store.metrics()
            assert metrics["rocketmq_storage_dispatch_behind_bytes"] == 0
            assert metrics["reputd_commitlog_max_offset_bytes"] == store.end
            assert store.health()["commitLogMaxOffset"] == store.end
            assert len(list(log_dir.iterdir())) == store.end // SEGMENT + 3
    finally:
        code, _, err = stop(proc)
        store.writer.close()
    assert code == 0, err


# --- the gauges at scrape time, far behind, after a start, after idle (issue 28 §5) -----------------------

class Clock:
    """time.time() for the daemon's lag, set by the test: ages are then exact."""

    def __init__(self, now_ms: int):
        self.now_ms = now_ms

    def __call__(self) -> float:
        return self.now_ms / 1000


def sample(service, name: str) -> float:
    return service.metrics.registry.get_sample_value(name)


def lag_of(service) -> tuple[float, float]:
    """The two gauges, the seconds to the millisecond (store timestamps are milliseconds)."""
    return (sample(service, "rocketmq_storage_dispatch_behind_bytes"),
            round(sample(service, "reputd_dispatch_behind_seconds"), 3))


def oldest_age_s(log_dir: Path, offset: int, now_ms: int) -> float:
    """The truth, decoded independently: the age of the record at `offset` (past a BLANK: the next segment's
    first)."""
    log = CommitLog(str(log_dir), SEGMENT)
    record_at = offset
    try:
        stored = log.read_record(record_at).store_timestamp
    except StoreError:
        stored = log.read_record(log.segment_start(offset) + SEGMENT).store_timestamp
    return round((now_ms - stored) / 1000, 3)


@pytest.fixture
def service(tmp_path, monkeypatch):
    """A ReputService whose session is open on a backlog but whose loop is driven by the test, one read at a
    time, with the real reader and dispatchers: the reader's scan of the directory goes stale as it would
    in a loop that is segments behind."""
    from daemon.config import load_config
    from daemon.engine.reput import ReputService
    from daemon.engine.session import open_session

    store = Store(tmp_path)
    clock = Clock(START_MS)
    monkeypatch.setattr("daemon.engine.reput.time.time", clock)
    svc = ReputService(load_config(str(store.config), env={}))
    svc.store, svc.clock = store, clock
    store.append(2000)  # about 2 segments of backlog before the start
    svc.session = open_session(svc.config, svc.metrics)
    yield svc
    for d in svc.session.dispatchers:
        d.close()
    svc.session.reader.close()
    store.writer.close()


def step(service) -> int:
    """One read of the loop, dispatched; returns the offset reached."""
    s = service.session
    assert service._dispatch(s, s.reader.read(s.dispatched_offset))
    return s.dispatched_offset


def test_lag_is_true_right_after_a_start_with_a_backlog(service):
    """Before: 0.0 seconds after every session start, whatever waited; now the age of the first record."""
    store, clock = service.store, service.clock
    clock.now_ms = START_MS + 3_600_000
    assert service.session.dispatched_offset == 0
    assert lag_of(service) == (store.end, oldest_age_s(store.tmp / "store" / "commitlog", 0, clock.now_ms))
    assert lag_of(service)[1] == 3600.0


def test_lag_is_true_while_far_behind_and_the_writer_adds_segments(service):
    """The loop reads one segment, the writer adds eight more that the loop's scan has not seen: the bytes
    gauge counts them all (before: only up to the last segment scanned), the seconds gauge the oldest
    record not dispatched."""
    store, clock = service.store, service.clock
    offset = step(service)
    assert offset == SEGMENT
    scanned = service.session.commit_log.max_offset
    while store.end < scanned + 8 * SEGMENT:
        store.append(500)
    assert service.session.commit_log.max_offset == scanned, "the loop's own scan is stale, as when behind"
    clock.now_ms = START_MS + 3_600_000  # past every record's store timestamp
    behind, seconds = lag_of(service)
    assert behind == store.end - offset
    assert seconds == oldest_age_s(store.tmp / "store" / "commitlog", offset, clock.now_ms)
    assert sample(service, "reputd_commitlog_max_offset_bytes") == store.end
    assert service.progress()["commitLogMaxOffset"] == store.end
    while offset < store.end:
        offset = step(service)
        age = oldest_age_s(store.tmp / "store" / "commitlog", offset, clock.now_ms) if offset < store.end else 0.0
        assert lag_of(service) == (store.end - offset, age)


def test_lag_seconds_after_idle_is_the_age_of_the_new_data(service):
    """Caught up, then idle for 70 s, then data stored 5 s ago: 5 s behind (before: 75 s, the age of the last
    record dispatched before the idle spell)."""
    store, clock = service.store, service.clock
    while service.session.dispatched_offset < store.end:
        step(service)
    clock.now_ms = START_MS + 10_000_000
    assert lag_of(service) == (0, 0.0)
    clock.now_ms += 70_000
    store._clock = iter(range(clock.now_ms - 5_000, clock.now_ms, 1))
    before = store.end
    store.append(40)
    assert lag_of(service) == (store.end - before, 5.0)



def test_lag_seconds_counts_only_what_the_commitlog_still_holds(service):
    """What the gauge measures (docs/operations.md, "What the lag in seconds measures"): the age of the oldest
    message the CommitLog still holds and reputd has not dispatched. Once the broker deleted the segment reputd
    was to read next, that is the first message of the oldest segment left, however old the deleted ones were:
    a stall longer than the broker keeps data shows as skipped bytes, not as more seconds."""
    store, clock = service.store, service.clock
    log_dir = store.tmp / "store" / "commitlog"
    assert service.session.dispatched_offset == 0
    clock.now_ms = START_MS + 3_600_000
    oldest = oldest_age_s(log_dir, 0, clock.now_ms)
    assert lag_of(service)[1] == oldest
    os.unlink(log_dir / f"{0:020d}")  # retention, before reputd read it
    behind, seconds = lag_of(service)
    assert behind == store.end  # the bytes gauge still counts from reputd's offset
    assert seconds == oldest_age_s(log_dir, SEGMENT, clock.now_ms)
    assert seconds < oldest


def _resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache now."""
    return sum(resident(path))


def test_the_retention_gauges_are_the_clean_ups_last_look(service):
    """The scrape shows what the session's clean-up published (`Session.retention_behind`): 0 before its
    first look, its figures after."""
    assert sample(service, "reputd_retention_behind_seconds") == 0
    service.session.retention_behind = RetentionBehind(7, 8192, 2, 8_040_080, time.monotonic() - 30)
    get = service.metrics.registry.get_sample_value
    assert get("reputd_retention_behind_files", {"kind": "consumequeue"}) == 7
    assert get("reputd_retention_behind_bytes", {"kind": "index"}) == 8_040_080
    assert 30 <= sample(service, "reputd_retention_behind_seconds") < 60

def test_looks_at_the_head_read_only_the_pages_they_look_at(tmp_path):
    """The frontier look and the lag gauges read a page or a record at and past the writer's head, over
    and over as the head moves. On a pre-allocated segment plain reads there soon start the device's
    readahead, which fills up to read_ahead_kb of zero pages ahead of the writer (8 MiB on the benchmark
    machine, ~10 ms) before a read returns (bench/results/latency.md).
    Their descriptors are advised random: the looks bring in only the pages they read, and leave no
    descriptor open."""
    log_dir = tmp_path / "commitlog"
    size = 64 * 1024 * 1024
    path = log_dir / f"{0:020d}"
    fds = len(os.listdir("/proc/self/fd"))
    head = HeadDescriptor()
    with CommitLogWriter(str(log_dir), size) as w:
        w.append(Message("T", 0, b"x" * 300, {"KEYS": "k"}))
        w._file._mm.madvise(mmap.MADV_RANDOM)  # the writer's own faults bring in only the pages it writes
        w._file._mm.flush()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # and its first fault's readaround is gone
        finally:
            os.close(fd)
        log = CommitLog(str(log_dir), size, follow=True)
        offset = 0
        looks = 300
        for _ in range(looks):  # a writer and a follower: a few records, a look, and so on
            records = [w.append(Message("T", 0, b"x" * 300, {"KEYS": "k"})) for _ in range(10)]
            end = w.max_offset
            assert written_below(log, offset, 4 * 1024 * 1024, head) == end
            assert written_end(log, offset) == end
            assert oldest_undispatched_timestamp(log, offset, segments_now(log, offset)) is not None
            assert oldest_undispatched_timestamp(log, end, segments_now(log, end)) is None
            offset = records[5].phy_offset  # the follower a few records behind
        head.close()
        data_pages = -(-end // mmap.PAGESIZE)
        # what was written, the page each look reads a horizon on, and the few it reads past the head
        assert _resident_pages(path) <= data_pages + looks + 64
    assert len(os.listdir("/proc/self/fd")) == fds
