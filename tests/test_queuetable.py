"""A store places a batch's units for all its queues at once (`ConsumeQueueStore.dispatch` over the queues'
`QueueTable`): the same files as each queue putting its own units, no Python put per queue that continues,
appends gathered for a time at most, and a flush plan that looks at the queues written since the last one."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest

from daemon.config import load_config
from daemon.engine.dispatchers import ConsumeQueueDispatcher
from indexcore import queuetable
from indexcore.consumequeue import CQ_UNIT, CQ_UNIT_SIZE, PutStats
from indexcore.errors import StoreLayoutError
from indexcore.queuefiles import ConsumeQueue
from indexcore.queuestore import ConsumeQueueStore, consume_queue_units
from tests.conftest import DispatchRec, make_dispatch_batch

UNITS = np.dtype([("commit_log_offset", "<i8"), ("size", "<i4"), ("tags", "<i8")])  # CQ_UNIT_SIZE bytes


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def random_batches(rng: random.Random, queues: list[tuple[str, int]]) -> list[list[DispatchRec]]:
    """Records over `queues` in random batches: most continue their queue, some skip queue offsets (a gap),
    some queues start past offset 0 (pre-blanks), some batches come again (a replay)."""
    next_qo = {q: (rng.choice([0, 0, 0, 7, 45]) if rng.random() < 0.3 else 0) for q in queues}
    recs, phy = [], 0
    for _ in range(rng.randint(200, 1500)):
        q = rng.choice(queues)
        if rng.random() < 0.02:
            next_qo[q] += rng.randint(1, 30)
        recs.append(DispatchRec(phy_offset=phy, msg_size=rng.randint(60, 400), topic=q[0], queue_id=q[1],
                                queue_offset=next_qo[q], tags_code=rng.randint(-5, 5)))
        next_qo[q] += 1
        phy += recs[-1].msg_size
    cuts = sorted(rng.sample(range(1, len(recs)), rng.randint(1, 15)))
    batches = [recs[a:b] for a, b in zip([0, *cuts], [*cuts, len(recs)], strict=True)]
    if rng.random() < 0.5:
        at = rng.randrange(len(batches))
        batches.insert(at + 1, batches[rng.randrange(at + 1)])
    return batches


@pytest.mark.parametrize("seed", range(12))
def test_a_store_puts_a_batch_into_many_queues_as_each_queue_alone_would(tmp_path: Path, seed: int) -> None:
    """Every queue of a batch placed at once (rolls, gaps, pre-blanks, replays, gathered or not) gives the
    files and counts of each queue putting its own units with `ConsumeQueue.put_packed`."""
    rng = random.Random(seed)
    queues = [(f"T{t}", q) for t in range(rng.randint(1, 12)) for q in range(rng.randint(1, 5))]
    file_size = rng.choice([5, 40, 300]) * CQ_UNIT_SIZE
    store = ConsumeQueueStore(str(tmp_path / "store"), file_size, open_files_limit=rng.choice([2, 1000]))
    store.hold_bytes = rng.choice([0, 100, 1 << 20])
    alone: dict[tuple[str, int], ConsumeQueue] = {}
    for batch in random_batches(rng, queues):
        b = make_dispatch_batch(batch)
        expected = PutStats()
        for g in consume_queue_units(b):
            cq = alone.get((g.topic, g.queue_id))
            if cq is None:
                cq = alone[(g.topic, g.queue_id)] = ConsumeQueue(
                    str(tmp_path / "alone" / "consumequeue" / g.topic / str(g.queue_id)), g.topic, g.queue_id,
                    file_size)
            cq.put_packed(g.queue_offset, g.units, g.ends, g.one_streak, stats=expected)
        assert store.dispatch(b) == expected, f"seed {seed}"
        for key, cq in alone.items():
            assert (store.queues[key].max_offset, store.queues[key].max_physic_offset) == \
                (cq.max_offset, cq.max_physic_offset), f"seed {seed} {key}"
    store.close()
    for cq in alone.values():
        cq.close()
    assert tree(tmp_path / "store") == tree(tmp_path / "alone"), f"seed {seed}"


def test_units_that_continue_their_queues_take_no_put_of_their_own(tmp_path: Path, monkeypatch) -> None:
    """Once 500 queues exist, a batch continuing each of them is placed without a Python put per queue."""
    store = ConsumeQueueStore(str(tmp_path), 1000 * CQ_UNIT_SIZE)
    queues = [(f"T{t}", q) for t in range(125) for q in range(4)]

    def batch(round_: int) -> list[DispatchRec]:
        return [DispatchRec(phy_offset=(round_ * len(queues) + i) * 100, topic=t, queue_id=q, queue_offset=round_)
                for i, (t, q) in enumerate(queues)]

    store.dispatch(make_dispatch_batch(batch(0)))

    def no_put(*args, **kwargs):
        raise AssertionError("a queue put on its own")

    monkeypatch.setattr(ConsumeQueue, "put_packed", no_put)
    for round_ in range(1, 4):
        assert store.dispatch(make_dispatch_batch(batch(round_))) == PutStats(written=len(queues))
    monkeypatch.undo()
    store.close()
    data = (tmp_path / "consumequeue" / "T7" / "2" / f"{0:020d}").read_bytes()
    i = queues.index(("T7", 2))
    assert [CQ_UNIT.unpack_from(data, n * CQ_UNIT_SIZE) for n in range(4)] == \
        [((r * len(queues) + i) * 100, 100, 0) for r in range(4)]


def test_gathered_appends_are_written_once_a_hold_old(tmp_path: Path) -> None:
    """With `hold_seconds` (`run`'s setting), a queue's few appends are gathered, and written once the first of
    them is that old, all together, by the next batch's dispatch, whatever queue it puts to."""
    store = ConsumeQueueStore(str(tmp_path), 1000 * CQ_UNIT_SIZE)
    store.hold_bytes, store.hold_seconds = 1 << 20, 0.2
    path = tmp_path / "consumequeue" / "A" / "0" / f"{0:020d}"
    store.dispatch(make_dispatch_batch([DispatchRec(phy_offset=0, topic="A", queue_offset=0)]))
    assert not any(path.read_bytes())
    store.dispatch(make_dispatch_batch([DispatchRec(phy_offset=100, topic="B", queue_offset=0)]))
    assert not any(path.read_bytes())  # young yet
    time.sleep(0.25)
    store.dispatch(make_dispatch_batch([DispatchRec(phy_offset=200, topic="B", queue_offset=1)]))
    assert CQ_UNIT.unpack_from(path.read_bytes()) == (0, 100, 0)
    b = tmp_path / "consumequeue" / "B" / "0" / f"{0:020d}"
    assert [CQ_UNIT.unpack_from(b.read_bytes(), n * CQ_UNIT_SIZE) for n in range(2)] == [(100, 100, 0), (200, 100, 0)]
    store.dispatch(make_dispatch_batch([DispatchRec(phy_offset=300, topic="A", queue_offset=1)]))
    assert not any(path.read_bytes()[CQ_UNIT_SIZE:])  # young
    store.close()
    assert CQ_UNIT.unpack_from(path.read_bytes(), CQ_UNIT_SIZE) == (300, 100, 0)


def test_appends_that_come_of_age_together_are_written_a_few_queues_a_batch(tmp_path: Path, monkeypatch) -> None:
    """10 queues gathered in one batch, all past `hold_seconds` at once: each later batch writes the appends of
    the RELEASE_OLD_QUEUES (3 here, and no share) queues gathered first, not all 10 (`run` over 10,000 queues
    wrote thousands of files in one batch every second), and the files end as if written at once."""
    monkeypatch.setattr(queuetable, "RELEASE_OLD_QUEUES", 3)
    monkeypatch.setattr(queuetable, "RELEASE_CATCH_UP", 0.0)  # the least only
    store = ConsumeQueueStore(str(tmp_path), 1000 * CQ_UNIT_SIZE)
    store.hold_bytes, store.hold_seconds = 1 << 20, 1e-9
    queues = [f"T{i}" for i in range(10)]
    store.dispatch(make_dispatch_batch([DispatchRec(phy_offset=i * 100, topic=t) for i, t in enumerate(queues)]))
    first = [tmp_path / "consumequeue" / t / "0" / f"{0:020d}" for t in queues]

    def written() -> list[bool]:
        return [CQ_UNIT.unpack_from(p.read_bytes()) == (i * 100, 100, 0) for i, p in enumerate(first)]

    seen = [written()]
    for n in range(4):  # a batch to another queue each time
        store.dispatch(make_dispatch_batch([DispatchRec(phy_offset=(10 + n) * 100, topic="Z", queue_offset=n)]))
        seen.append(written())
    assert [sum(w) for w in seen] == [0, 3, 6, 9, 10]  # gathered, then 3 a batch
    assert seen[1] == [True] * 3 + [False] * 7  # the oldest first
    store.close()
    assert all(written())


def test_a_flush_plan_writes_aged_appends_only_when_the_dispatch_pauses(tmp_path: Path) -> None:
    """While batches come, the flusher's plan (under the dispatch lock) leaves the aged appends of queues it does
    not sync to the batches; once none came for `hold_seconds`, it writes them itself."""
    d = _dispatcher(tmp_path)
    queues = [f"T{i}" for i in range(5)]
    d.dispatch(make_dispatch_batch([DispatchRec(phy_offset=i * 100, topic=t) for i, t in enumerate(queues)]))
    d.flush()
    d.queues.hold_seconds = 3600.0
    d.dispatch(make_dispatch_batch([DispatchRec(phy_offset=(5 + i) * 100, topic=t, queue_offset=1)
                                    for i, t in enumerate(queues)]))
    paths = [tmp_path / "out" / "consumequeue" / t / "0" / f"{0:020d}" for t in queues]
    d.queues.hold_seconds = 0.0  # all of them aged: as if the batch came a hold ago ...
    d.queues.last_put = time.monotonic() + 3600  # ... and the dispatch went on since
    plan = d.prepare_flush(thorough=False, least_pages=2)  # no queue has 2 dirty pages: none synced
    assert plan.paths == []
    assert not plan.complete
    assert not any(any(p.read_bytes()[CQ_UNIT_SIZE:]) for p in paths)
    d.queues.last_put = time.monotonic() - 1  # the dispatch paused
    d.prepare_flush(thorough=False, least_pages=2)
    assert all(CQ_UNIT.unpack_from(p.read_bytes(), CQ_UNIT_SIZE)[0] == (5 + i) * 100 for i, p in enumerate(paths))
    d.close()


def _dispatcher(tmp_path: Path) -> ConsumeQueueDispatcher:
    (tmp_path / "store" / "commitlog").mkdir(parents=True)
    config = tmp_path / "reputd.yaml"
    config.write_text(f"store: {{storePathRootDir: {tmp_path / 'store'}, mappedFileSizeConsumeQueue: 20000}}\n"
                      f"output: {{dir: {tmp_path / 'out'}}}\n")
    cfg = load_config(str(config), {})
    return ConsumeQueueDispatcher(cfg.store, cfg.output.dir)


def test_a_flush_plan_looks_only_at_the_queues_written_since_the_last_one(tmp_path: Path, monkeypatch) -> None:
    """300 queues, 3 of them written since the last flush: the plan reads the state of those 3 and syncs
    their files after writing what they gathered; the idle ones are not looked at."""
    d = _dispatcher(tmp_path)
    queues = [(f"T{t}", q) for t in range(75) for q in range(4)]
    d.dispatch(make_dispatch_batch([DispatchRec(phy_offset=i * 100, topic=t, queue_id=q)
                                    for i, (t, q) in enumerate(queues)]))
    d.flush()
    looked: list[str] = []
    real = ConsumeQueue.writing_path.fget
    monkeypatch.setattr(ConsumeQueue, "writing_path", property(lambda cq: looked.append(cq.topic) or real(cq)))
    active = queues[10:13]
    d.dispatch(make_dispatch_batch([DispatchRec(phy_offset=(len(queues) + i) * 100, topic=t, queue_id=q,
                                                queue_offset=1) for i, (t, q) in enumerate(active)]))
    looked.clear()
    plan = d.prepare_flush(thorough=False, least_pages=0)
    assert sorted(looked) == sorted(t for t, _ in active)
    assert sorted(plan.paths) == sorted(str(tmp_path / "out" / "consumequeue" / t / str(q) / f"{0:020d}")
                                        for t, q in active)
    for path in plan.paths:  # gathered appends written before the plan: the sync covers them
        assert CQ_UNIT.unpack_from(Path(path).read_bytes(), CQ_UNIT_SIZE)[1] == 100
    plan.done()
    looked.clear()
    assert d.prepare_flush(thorough=False, least_pages=0).paths == []
    assert looked == []
    monkeypatch.undo()
    d.close()


def test_the_store_keeps_its_descriptors_within_its_bound(tmp_path: Path) -> None:
    """2,000 queues written through a store bounded at 64 descriptors: never more open."""
    store = ConsumeQueueStore(str(tmp_path), 1000 * CQ_UNIT_SIZE, open_files_limit=64)
    recs = [DispatchRec(phy_offset=i * 100, topic=f"T{i % 500}", queue_id=i // 500 % 4, queue_offset=i // 2000)
            for i in range(6000)]
    for a in range(0, len(recs), 1500):
        store.dispatch(make_dispatch_batch(recs[a : a + 1500]))
        assert len(store.open_files) <= 64
    store.close()
    files = [p for p in (tmp_path / "consumequeue").rglob("*") if p.is_file()]
    assert len(files) == 2000
    assert all(np.frombuffer(p.read_bytes()[: 3 * CQ_UNIT_SIZE], np.uint8).any() for p in files)


@pytest.mark.parametrize("topic", ["a/b", "..", ".", "", "/etc", "x/../.."])
def test_a_topic_that_would_leave_consumequeue_is_a_layout_error(tmp_path: Path, topic: str) -> None:
    store = ConsumeQueueStore(str(tmp_path))
    with pytest.raises(StoreLayoutError, match="would leave the consumequeue directory"):
        store.dispatch(make_dispatch_batch([DispatchRec(phy_offset=0, topic=topic)]))
    store.close()
    assert not (tmp_path / "consumequeue").exists() or all(p.name != "0" for p in tmp_path.rglob("*"))


def test_topic_names_with_dots_and_percent_signs_are_queues(tmp_path: Path) -> None:
    store = ConsumeQueueStore(str(tmp_path))
    for i, topic in enumerate(["a.b", "...", "%LMQ%x", "%RETRY%group"]):
        store.dispatch(make_dispatch_batch([DispatchRec(phy_offset=100 * i, topic=topic)]))
    store.close()
    assert sorted(p.name for p in (tmp_path / "consumequeue").iterdir()) == ["%LMQ%x", "%RETRY%group", "...", "a.b"]


@pytest.mark.parametrize("seed", range(3))
def test_the_gathered_appends_released_in_any_order_are_written_in_each_queues_order(seed: int) -> None:
    """Random gathers, releases of some queues, of the oldest and of all, against a model: each queue gets its
    pieces in the order gathered, exactly once; the arrays a batch pinned are let go with its last piece; the
    oldest unit held is the model's. (A release marks what it takes and compacts the rows only once most are
    taken, so that it costs what it writes, not every entry held.)"""
    from indexcore.queuetable import QueueTable

    rng = np.random.default_rng(seed)

    class Recorder:
        def __init__(self) -> None:
            self.got: list[int] = []

        def write_later(self, data, position: int) -> None:
            for piece in data if isinstance(data, list) else [data]:  # views of the batches' arrays, or a copy
                self.got.extend(np.frombuffer(piece, dtype=UNITS)["commit_log_offset"].tolist())

    table = QueueTable(4)
    queues = [Recorder() for _ in range(40)]
    for q in queues:
        table.add(q)
    held: dict[int, list[int]] = {i: [] for i in range(40)}
    expect: dict[int, list[int]] = {i: [] for i in range(40)}
    arrays: dict[int, tuple[np.ndarray, set[int]]] = {}
    phy = 0
    for step in range(400):
        action = rng.integers(10)
        if action < 6:
            slots = np.sort(rng.choice(40, size=int(rng.integers(1, 12)), replace=False))
            counts = rng.integers(1, 4, len(slots))
            units = np.zeros(int(counts.sum()), dtype=UNITS)
            units["commit_log_offset"] = np.arange(phy, phy + len(units))
            phy += len(units)
            hi = np.cumsum(counts)
            lo = hi - counts
            table.gather(units, slots, lo, hi, np.zeros(len(slots), np.int64), float(step))
            for s, a, b in zip(slots.tolist(), lo.tolist(), hi.tolist(), strict=True):
                held[s].extend(units["commit_log_offset"][a:b].tolist())
            arrays[id(units)] = (units, set(slots.tolist()))
        elif action < 8:
            chosen = np.sort(rng.choice(40, size=int(rng.integers(1, 6)), replace=False))
            table.release(chosen)
            for s in chosen.tolist():
                expect[s] += held[s]
                held[s] = []
        elif action < 9:
            before = float(step - rng.integers(0, 20))
            table.release_older(before, int(rng.integers(1, 5)))
            for s, q in enumerate(queues):  # what the table wrote, the model takes as released
                if len(q.got) > len(expect[s]):
                    assert q.got[len(expect[s]):] == held[s]
                    expect[s] += held[s]
                    held[s] = []
        else:
            table.release()
            for s in range(40):
                expect[s] += held[s]
                held[s] = []
        assert [q.got for q in queues] == [expect[s] for s in range(40)]
        live = [v for v in held.values() if v]
        assert table.holding == bool(live)
        assert table.oldest_held() == (min(v[0] for v in live) if live else None)
        for _, waiting in arrays.values():  # a batch's pieces of the queues released are written
            waiting.intersection_update(s for s in range(40) if held[s])
        assert table.pinned == sum(u.nbytes for u, waiting in arrays.values() if waiting)
    table.release()
    assert table.pinned == 0
    assert not table._arrays


def test_many_small_pieces_of_a_queue_are_handed_over_as_one_buffer() -> None:
    """A queue's appends gathered a unit at a time from many batches (`run` over 10,000 queues) are released as one
    contiguous buffer per queue, its pieces copied back to back in the order gathered, not a view per piece; large
    pieces are still written from the batches' own arrays."""
    from indexcore.queuetable import SMALL_PIECES, QueueTable

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[tuple[object, int]] = []

        def write_later(self, data, position: int) -> None:
            self.writes.append((data, position))

    table = QueueTable(4)
    queues = [Recorder() for _ in range(3)]
    for q in queues:
        table.add(q)
    phy = 0
    for _ in range(5):  # five batches, one unit for each queue in each
        units = np.zeros(3, dtype=UNITS)
        units["commit_log_offset"] = np.arange(phy, phy + 3)
        phy += 3
        table.gather(units, np.arange(3), np.arange(3), np.arange(1, 4), np.full(3, 40), 0.0)
    table.release(np.array([0, 2]))
    for s, q in ((0, queues[0]), (2, queues[2])):
        [(data, position)] = q.writes
        assert not isinstance(data, list)
        assert position == 40
        assert np.frombuffer(data, dtype=UNITS)["commit_log_offset"].tolist() == list(range(s, 15, 3))
    assert queues[1].writes == []
    assert table.pinned == 5 * 3 * UNITS.itemsize

    big = np.zeros(8 * SMALL_PIECES // UNITS.itemsize, dtype=UNITS)
    table.gather(big, np.array([1]), np.array([0]), np.array([len(big)]), np.array([140]), 0.0)
    table.release()
    [(data, position)] = queues[1].writes  # five one-unit pieces and a large one: views of the batches' arrays
    assert isinstance(data, list)
    assert len(data) == 6
    assert data[-1].base is big
    assert table.pinned == 0


def test_the_slot_index_answers_as_a_dict_of_the_queues_entered() -> None:
    """Random topics and queue ids entered into `SlotIndex`es (rows and columns growing) and looked up a batch at
    once: each answer is the slot entered, as a dict of (topic, queue id) says, or -1 for a queue not entered; a
    small index leaves out what does not fit in its cells (its caller looks those up by key) and never answers
    another queue's slot."""
    from indexcore.queuetable import SlotIndex

    rng = random.Random(43)
    roomy, small, model = SlotIndex(), SlotIndex(max_cells=300 * 40), {}
    topics = [f"T{i}" for i in range(300)]
    for step in range(3000):
        topic, qid = rng.choice(topics), rng.choice([0, 1, 3, 7, rng.randrange(64), rng.randrange(2000)])
        if (topic, qid) not in model:
            model[(topic, qid)] = step
            assert roomy.add(topic, qid, step) == step
            assert small.add(topic, qid, step) == step
        if step % 100 == 99:
            batch_topics = rng.sample(topics, 20)
            ti = np.array([rng.randrange(20) for _ in range(50)], dtype=np.int64)
            qi = np.array([rng.choice([0, 1, 3, rng.randrange(2000)]) for _ in range(50)], dtype=np.int64)
            expect = [model.get((batch_topics[t], q), -1) for t, q in zip(ti.tolist(), qi.tolist(), strict=True)]
            assert roomy.lookup(tuple(batch_topics), ti, qi).tolist() == expect
            got = small.lookup(tuple(batch_topics), ti, qi).tolist()
            assert all(g in (e, -1) for g, e in zip(got, expect, strict=True))
    assert small._rows.size <= small.max_cells
    assert 0 < np.count_nonzero(small._rows >= 0) < len(model)
