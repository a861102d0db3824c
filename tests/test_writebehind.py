"""`run`'s ConsumeQueue writer thread (daemon/engine/writebehind.py): the writes a batch hands over are made in
the order handed over, nothing that touches a file (a descriptor closed, a sync, a read) overtakes them, the
flusher syncs a plan's files only once the writes before the plan are made, and after a failed write nothing
is checkpointed. The crash side (kill -9 while it writes, SIGTERM draining it) is the end-to-end trial below."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from daemon.engine.flusher import Flusher, sync_plans
from daemon.engine.writebehind import WriteBehind
from indexcore import _kernels as openfiles_kernels
from indexcore.consumequeue import CQ_UNIT, CQ_UNIT_SIZE
from indexcore.openfiles import OpenFiles
from tests.conftest import DispatchRec, make_dispatch_batch
from tests.test_flusher import append, close, dispatch_all, make_config
from tests.test_queuetable import _dispatcher


class GatedWriteBehind(WriteBehind):
    """A writer thread that makes nothing until `gate` is set: what is handed over stays in flight."""

    def __init__(self, **kw):
        self.gate = threading.Event()
        self.made: list[int] = []
        super().__init__(**kw)

    def _write(self, writes, paths, under=None):
        self.gate.wait()
        self.made.append(len(writes))
        return super()._write(writes, paths, under)


def _open_later(gate: threading.Event, after: float = 0.2) -> None:
    threading.Timer(after, gate.set).start()


def test_writes_handed_over_are_made_in_order(tmp_path: Path) -> None:
    """200 batches of overlapping writes to 3 files, handed over one after another: each file ends as the same
    writes made in order here would leave it."""
    rng = np.random.default_rng(7)
    files = OpenFiles(2)
    writer = WriteBehind(max_behind=4)
    files.write_behind(writer)
    paths = [str(tmp_path / f"f{i}") for i in range(3)]
    expect = [bytearray(4096) for _ in paths]
    for p in paths:
        Path(p).write_bytes(bytes(4096))
    for _ in range(200):
        for _ in range(int(rng.integers(1, 6))):
            i, at, n = int(rng.integers(3)), int(rng.integers(0, 4000)), int(rng.integers(1, 96))
            data = rng.integers(0, 256, n, dtype=np.uint8)
            files.write_later(paths[i], data, at)
            expect[i][at : at + n] = data.tobytes()
        files.submit_writes()
    files.flush_writes()
    assert [Path(p).read_bytes() for p in paths] == [bytes(e) for e in expect]
    files.close()
    writer.close()


def test_a_descriptor_is_closed_only_after_the_writes_in_flight_to_it(tmp_path: Path) -> None:
    """A set of one descriptor: opening a second file closes the first while a write to it is in flight on the
    writer thread; the close waits for it (a write to a closed, or reused, descriptor would be lost)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes(64))
    b.write_bytes(bytes(64))
    files = OpenFiles(1)
    writer = GatedWriteBehind()
    files.write_behind(writer)
    files.write_later(str(a), b"A" * 8, 0)  # through the set's descriptor of a
    files.submit_writes()
    _open_later(writer.gate)
    files.write_later(str(b), b"B" * 8, 8)  # the set is full: b is written through a descriptor of its own
    files.fd(str(b))  # evicts a's
    assert writer.made == [1]  # the write to a was made before its descriptor was closed
    files.flush_writes()
    assert a.read_bytes()[:8] == b"A" * 8
    assert b.read_bytes()[8:16] == b"B" * 8
    files.close()
    writer.close()


def test_a_sync_waits_for_the_writes_handed_over(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(64))
    files = OpenFiles(4)
    writer = GatedWriteBehind()
    files.write_behind(writer)
    files.write_later(str(path), b"x" * 16, 0)
    files.submit_writes()
    assert path.read_bytes()[:16] == bytes(16)  # in flight
    _open_later(writer.gate)
    files.sync(str(path))
    assert path.read_bytes()[:16] == b"x" * 16
    files.close()
    writer.close()


def test_a_failed_write_drops_the_later_ones_and_stops_every_checkpoint(tmp_path: Path) -> None:
    """A write that fails (its file is gone) is raised once by the wait of the dispatching side, the writes
    handed over after it are dropped, and the dispatch and every later barrier keep refusing: a checkpoint
    never follows writes that were not made."""
    good = tmp_path / "good"
    good.write_bytes(bytes(64))
    files = OpenFiles(1)
    writer = GatedWriteBehind()
    files.write_behind(writer)
    files.fd(str(good))  # the set is full: the next file is opened for its write
    files.write_later(str(tmp_path / "gone"), b"x", 0)
    files.submit_writes()
    files.write_later(str(good), b"y" * 4, 0)
    files.submit_writes()
    writer.gate.set()
    with pytest.raises(OSError, match="cannot write") as failed:
        files.flush_writes()
    assert failed.value.filename == str(tmp_path / "gone")
    assert good.read_bytes()[:4] == bytes(4)  # after the failure: dropped
    with pytest.raises(OSError, match="a ConsumeQueue write failed"):
        writer.barrier()()
    files.write_later(str(good), b"z" * 4, 0)
    with pytest.raises(OSError, match="cannot write"):
        files.submit_writes()
    files.flush_writes()  # raised once: closing what is left goes on
    files.close()
    writer.close()


def test_the_dispatch_waits_when_the_writer_is_too_far_behind(tmp_path: Path, monkeypatch) -> None:
    """At most `max_behind` batches are in flight: memory stays bounded when the disk is slow."""
    path = tmp_path / "f"
    path.write_bytes(bytes(64))
    writer = GatedWriteBehind(max_behind=2)
    writer.submit([(-1, b"a", 0, str(path))], [str(path)])
    writer.submit([(-1, b"b", 1, str(path))], [str(path)])
    _open_later(writer.gate, 0.3)
    started = time.monotonic()
    writer.submit([(-1, b"c", 2, str(path))], [str(path)])
    assert time.monotonic() - started >= 0.2
    writer.drain()
    assert path.read_bytes()[:3] == b"abc"
    writer.close()


def test_a_flush_plan_is_synced_only_after_the_writes_before_it(tmp_path: Path, monkeypatch) -> None:
    """The plan is made under the dispatch lock while the batch's writes are still in flight; `sync_plans`
    (the lock released) waits for them before it syncs, so the checkpoint covers units on disk."""
    d = _dispatcher(tmp_path)
    writer = GatedWriteBehind()
    d._writer = writer
    d.queues.open_files.write_behind(writer)
    d.dispatch(make_dispatch_batch([DispatchRec(phy_offset=i * 100, topic=f"T{i}") for i in range(3)]))
    plan = d.prepare_flush(thorough=True, least_pages=0)
    paths = [tmp_path / "out" / "consumequeue" / f"T{i}" / "0" / f"{0:020d}" for i in range(3)]
    assert sorted(plan.paths) == sorted(map(str, paths))
    assert not any(any(p.read_bytes()) for p in paths)  # in flight
    seen: dict[str, tuple] = {}  # what each file held when it was synced

    def sync(ps: list[str]) -> None:
        seen.update((p, CQ_UNIT.unpack_from(Path(p).read_bytes())) for p in ps)

    monkeypatch.setattr("daemon.engine.flusher.sync_paths", sync)
    _open_later(writer.gate)
    sync_plans([plan], str(tmp_path / "out"), set())
    assert seen == {str(p): (i * 100, 100, 0) for i, p in enumerate(paths)}
    assert [CQ_UNIT.unpack_from(p.read_bytes()) for p in paths] == [(i * 100, 100, 0) for i in range(3)]
    d.close()


def test_a_live_session_writes_behind_and_its_checkpoint_covers_written_units(tmp_path, monkeypatch) -> None:
    """`open_session` gives the ConsumeQueue dispatcher its writer thread; a flush's checkpoint then covers
    units that are in the files, and closing the session makes every write handed over (as SIGTERM does)."""
    from daemon.engine.session import open_session
    from daemon.ops.metrics import ReputMetrics

    cfg = make_config(tmp_path, flushConsumeQueueLeastPages=0)
    end = append(tmp_path, 300, queues=3)
    s = open_session(cfg, ReputMetrics(lambda: None))
    cq = next(d for d in s.dispatchers if d.name == "consumequeue")
    assert isinstance(cq._writer, WriteBehind)
    assert cq._writer._thread.is_alive()
    dispatch_all(s)
    assert Flusher(s, lambda e: None).flush_once(thorough=True)
    assert s.checkpoint_offset == end
    for q in range(3):
        data = (tmp_path / "out" / "consumequeue" / "T" / str(q) / f"{0:020d}").read_bytes()
        assert [CQ_UNIT.unpack_from(data, n * CQ_UNIT_SIZE)[1] > 0 for n in range(100)] == [True] * 100
    thread = cq._writer._thread
    close(s)
    assert not thread.is_alive()


def test_a_thorough_flush_hands_the_gathered_appends_over_a_slice_at_a_time(tmp_path, monkeypatch) -> None:
    """Before a thorough flush plans, the appends 7 queues gather are handed to the writer 2 queues at a time,
    each slice under the dispatch lock and the lock free between them (all in the plan held it 90 ms over
    10,000 queues); the plan then has nothing left to hand over, and its checkpoint covers every unit."""
    from daemon.engine import flusher
    from daemon.engine.session import open_session
    from daemon.ops.metrics import ReputMetrics
    from indexcore.queuetable import QueueTable

    monkeypatch.setattr(flusher, "RELEASE_SLICE", 2)
    cfg = make_config(tmp_path, flushConsumeQueueLeastPages=0)
    end = append(tmp_path, 70, queues=7)
    s = open_session(cfg, ReputMetrics(lambda: None))
    dispatch_all(s)
    released: list[int | None] = []  # queues a release was asked for (None: all), and whether the lock was held
    held_lock: list[bool] = []
    real = QueueTable.release

    def release(table, slots=None):
        if table.holding:
            released.append(None if slots is None else len(slots))
            held_lock.append(s.lock.locked())
        return real(table, slots)

    monkeypatch.setattr(QueueTable, "release", release)
    assert Flusher(s, lambda e: None).flush_once(thorough=True)
    assert released == [2, 2, 2, 1]
    assert all(held_lock)
    assert s.checkpoint_offset == end
    for q in range(7):
        data = (tmp_path / "out" / "consumequeue" / "T" / str(q) / f"{0:020d}").read_bytes()
        assert [CQ_UNIT.unpack_from(data, n * CQ_UNIT_SIZE)[1] > 0 for n in range(10)] == [True] * 10
    close(s)


def test_a_flush_drops_the_index_entries_from_the_rss_and_keeps_the_slot_table(tmp_path) -> None:
    """The IndexFile dispatcher's flush releases the entries it wrote from the process's RSS, and not the slot
    table: the next batch's keys touch slots all over it, and faulting them back in (under the dispatch lock) put
    9-26 ms into the batch after each flush."""
    from daemon.config import load_config
    from daemon.engine.dispatchers import IndexDispatcher
    from tests.test_indexservice import _mapping_rss

    (tmp_path / "store" / "commitlog").mkdir(parents=True)
    config = tmp_path / "reputd.yaml"
    slots = 50_000  # 200 KB of slots; 40,000 keys write 800 KB of entries
    config.write_text(f"store: {{storePathRootDir: {tmp_path / 'store'}, maxHashSlotNum: {slots}, "
                      f"maxIndexNum: 400000}}\noutput: {{dir: {tmp_path / 'out'}}}\n")
    cfg = load_config(str(config), {})
    d = IndexDispatcher(cfg.store, cfg.output.dir)
    d.dispatch(make_dispatch_batch([DispatchRec(phy_offset=i * 100, keys=f"k{i}", queue_offset=i)
                                    for i in range(40_000)]))
    path = d.service.last_file.path
    assert _mapping_rss(path) >= 900_000
    plan = d.prepare_flush(thorough=False, least_pages=0)
    assert plan.paths == [path]
    rss = _mapping_rss(path)
    assert 150_000 <= rss <= 4 * slots + 8192  # the slot table's pages (most touched), no entry's
    d.close()


def test_the_writer_opens_files_under_its_directory_relative_to_it(tmp_path: Path, monkeypatch) -> None:
    """A writer given the store's directory opens the files its writes open (those outside the descriptor set)
    relative to a descriptor of that directory: the kernel walks the last names only. Files elsewhere are opened by
    their whole paths, and before the directory exists every write is."""
    import os

    calls: list[tuple] = []
    real = openfiles_kernels.pwrite_many

    def pwrite_many(pending, *under):
        calls.append(under)
        return real(pending, *under)

    monkeypatch.setattr(openfiles_kernels, "pwrite_many", pwrite_many)
    root = tmp_path / "consumequeue"
    writer = WriteBehind(under=str(root))
    elsewhere = tmp_path / "other"
    elsewhere.write_bytes(bytes(40))
    writer.submit([(-1, b"early", 0, str(elsewhere))], [str(elsewhere)])  # no directory yet: whole paths
    writer.drain()
    (root / "T" / "0").mkdir(parents=True)
    inside = root / "T" / "0" / "00000000000000000000"
    inside.write_bytes(bytes(40))
    writer.submit([(-1, b"relative", 8, str(inside)), (-1, b"whole", 20, str(elsewhere))],
                  [str(inside), str(elsewhere)])
    writer.drain()
    os.rename(root, tmp_path / "moved")  # the descriptor follows the directory: proof the write went through it
    writer.submit([(-1, b"moved", 30, str(inside))], [str(inside)])
    writer.drain()
    writer.close()
    assert calls[0] == ()
    assert [len(c) for c in calls[1:]] == [2, 2]
    assert (tmp_path / "moved" / "T" / "0" / "00000000000000000000").read_bytes() == \
        bytes(8) + b"relative" + bytes(14) + b"moved" + bytes(5)
    assert elsewhere.read_bytes() == b"early" + bytes(15) + b"whole" + bytes(15)
