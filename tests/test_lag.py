"""The lag a broker's operators watch: the CommitLog's max offset is the end of the written data, wherever
the files end. A broker pre-creates its next segment (and the one after) before it needs them; those files
of zeros must not count as written (issue 11 item 5). The real broker's own writer is the stress-mode check
in tests/test_realbroker_live.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.head import written_end
from indexcore.reader import CommitLog
from indexcore.writer import CommitLogWriter, Message
from tests.test_daemon import SEGMENT, Store, stop, wait_for


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
