"""ConsumeQueue (STORE_FORMAT.md §7): units, positions, pre-blank, the order quirk, recovery, truncation.

The model-based tests run random unit sequences through a real, mmapped `ConsumeQueue` and through
`CQModel`, a plain dict-of-bytearrays reading of §7.5/§7.6, and compare bytes, offsets and reads.
"""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from indexcore.consumequeue import (
    BLANK_UNIT,
    CQ_UNIT,
    CQ_UNIT_SIZE,
    DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE,
    PutStats,
    pack_units,
)
from indexcore.errors import StoreLayoutError
from indexcore.mappedfile import offset_to_file_name
from indexcore.openfiles import OpenFiles
from indexcore.queuefiles import ConsumeQueue
from indexcore.queuestore import ConsumeQueueStore
from tests.conftest import DispatchRec, make_dispatch_batch

# The model's own layout, straight from §7.2 (not imported from indexcore).
UNIT = struct.Struct(">qiq")
UNIT_SIZE = 20
BLANK = UNIT.pack(0, 0x7FFFFFFF, 0)
DEFAULT_FILE_SIZE = 300_000 * 20

Unit = tuple[int, int, int, int]  # (queue_offset, commit_log_offset, msg_size, tags_code)


class CQModel:
    """One ConsumeQueue as {file start: bytearray}, following §7.5 one unit at a time."""

    def __init__(self, file_size: int):
        self.file_size = file_size
        self.files: dict[int, bytearray] = {}
        self.write_pos = 0
        self.max_physic_offset = -1
        self.min_logic_offset = 0
        self.stats = PutStats()

    @property
    def last_start(self) -> int:
        return max(self.files)

    @property
    def write_offset(self) -> int:
        return self.last_start + self.write_pos if self.files else 0

    @property
    def max_offset(self) -> int:
        return self.write_offset // UNIT_SIZE

    @property
    def min_offset(self) -> int:
        return self.min_logic_offset // UNIT_SIZE

    def put(self, queue_offset: int, phy: int, size: int, tags_code: int) -> None:
        fs = self.file_size
        if phy + size <= self.max_physic_offset:  # step 3: already built
            self.stats.already_built += 1
            return
        expect = queue_offset * UNIT_SIZE
        first_create = False
        if not self.files:  # step 5
            self.files[expect - expect % fs] = bytearray(fs)
            self.write_pos = 0
            first_create = True
        elif self.write_pos == fs:
            self.files[self.last_start + fs] = bytearray(fs)
            self.write_pos = 0
        if first_create and queue_offset != 0:  # step 6: pre-blank
            self.min_logic_offset = expect
            blanks = (expect % fs) // UNIT_SIZE
            self.files[self.last_start][: blanks * UNIT_SIZE] = BLANK * blanks
            self.stats.pre_blanks += blanks
            self.write_pos = blanks * UNIT_SIZE
        if queue_offset != 0:  # step 7
            current = self.write_offset
            if expect < current:
                self.stats.already_built += 1
                return
            while expect > current:  # reputd's rule: blank units up to its own offset, across files
                if self.write_pos == fs:
                    self.files[self.last_start + fs] = bytearray(fs)
                    self.write_pos = 0
                UNIT.pack_into(self.files[self.last_start], self.write_pos, 0, 0x7FFFFFFF, 0)
                self.write_pos += UNIT_SIZE
                self.stats.gap_blanks += 1
                current = self.write_offset
            if self.write_pos == fs:
                self.files[self.last_start + fs] = bytearray(fs)
                self.write_pos = 0
        self.max_physic_offset = phy + size  # step 8
        UNIT.pack_into(self.files[self.last_start], self.write_pos, phy, size, tags_code)
        self.write_pos += UNIT_SIZE
        self.stats.written += 1

    def read_units(self, queue_offset: int, max_count: int | None) -> list[tuple[int, int, int]]:
        """Units from queue_offset to the end of the written part of its file."""
        if not self.min_offset <= queue_offset < self.max_offset:
            return []
        logical = queue_offset * UNIT_SIZE
        start = logical - logical % self.file_size
        end = self.write_offset if start == self.last_start else start + self.file_size
        n = (end - logical) // UNIT_SIZE
        if max_count is not None:
            n = min(n, max_count)
        return [UNIT.unpack_from(self.files[start], logical - start + i * UNIT_SIZE) for i in range(n)]

    def last_real_unit_end(self) -> int:
        """offset + size of the newest unit that is not a pre-blank unit; -1 when there is none."""
        for start in sorted(self.files, reverse=True):
            end = self.write_pos if start == self.last_start else self.file_size
            for pos in range(end - UNIT_SIZE, -1, -UNIT_SIZE):
                unit = self.files[start][pos : pos + UNIT_SIZE]
                if unit != BLANK:
                    offset, size, _ = UNIT.unpack(unit)
                    return offset + size
        return -1

    def truncate_to(self, phy: int) -> None:
        """§7.6 truncateDirtyLogicFiles on the last files, plus reputd's promise: removed units are zeroed
        and emptied files deleted. The queue then restarts from its last real unit (a kept pre-blank
        prefix says nothing about the CommitLog)."""
        while self.files:
            start = self.last_start
            data = self.files[start]
            keep = 0
            for pos in range(0, self.file_size, UNIT_SIZE):
                offset, size, _ = UNIT.unpack_from(data, pos)
                if offset < 0 or size <= 0 or offset >= phy:
                    break
                keep += 1
            if keep == 0:
                del self.files[start]
                continue
            data[keep * UNIT_SIZE :] = bytes(self.file_size - keep * UNIT_SIZE)
            self.write_pos = keep * UNIT_SIZE
            break
        if not self.files:
            self.write_pos = 0
            self.min_logic_offset = 0
        self.max_physic_offset = self.last_real_unit_end()

    def reopened(self) -> None:
        """What a restart forgets: minLogicOffset comes back as the first file's start
        (`correctMinOffset` with CommitLog min offset 0, where every unit qualifies)."""
        self.min_logic_offset = min(self.files) if self.files else 0


def make_events(rng: random.Random) -> list[Unit]:
    """Units in CommitLog order: consecutive queue offsets, sometimes starting past 0, with replays of
    earlier units, holes in the queue offsets, stale offsets behind the write position and rare restarts at 0."""
    q = 0 if rng.random() < 0.4 else rng.randrange(1, 60)
    phy = rng.randrange(0, 3000)
    events: list[Unit] = []
    fresh: list[Unit] = []
    for _ in range(rng.randrange(1, 120)):
        r = rng.random()
        if r < 0.08 and fresh:  # replay: a run of earlier units dispatched again
            k = rng.randrange(len(fresh))
            events.extend(fresh[k : k + rng.randint(1, 8)])
            continue
        unit_q = q
        if r < 0.13:  # a hole in QUEUEOFFSET: the broker appends at the write position anyway
            unit_q = q = q + rng.randint(1, 7)
        elif r < 0.17 and q > 0:  # a stale queue offset, behind the write position
            unit_q = rng.randrange(0, q)
        elif r < 0.18:  # the queue's offsets restart at 0
            unit_q = q = 0
        size = rng.randint(1, 400)
        unit = (unit_q, phy, size, rng.randint(-(2**31), 2**31 - 1))
        events.append(unit)
        fresh.append(unit)
        phy += size + (rng.randint(1, 500) if rng.random() < 0.3 else 0)
        if unit_q == q:
            q += 1
    return events


def chunks(rng: random.Random, events: list[Unit]) -> list[list[Unit]]:
    """The events cut into random batches (put_units is called once per batch)."""
    out, i = [], 0
    while i < len(events):
        n = rng.randint(1, 12)
        out.append(events[i : i + n])
        i += n
    return out


def put(cq: ConsumeQueue, batch: list[Unit]) -> PutStats:
    cols = list(zip(*batch, strict=True))
    return cq.put_units(np.array(cols[0], np.int64), np.array(cols[1], np.int64), np.array(cols[2], np.int32),
                        np.array(cols[3], np.int64))


def dir_bytes(directory: Path) -> dict[str, bytes]:
    if not directory.exists():
        return {}
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def cq_files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted((root / "consumequeue").rglob("*")) if p.is_file()}


def model_bytes(model: CQModel) -> dict[str, bytes]:
    return {f"{start:020d}": bytes(data) for start, data in sorted(model.files.items())}


def assert_matches(cq: ConsumeQueue, model: CQModel, directory: Path, msg: str, *, check_min: bool = True) -> None:
    assert dir_bytes(directory) == model_bytes(model), msg
    assert cq.max_offset == model.max_offset, msg
    assert cq.max_physic_offset == model.max_physic_offset, msg
    if check_min:
        assert cq.min_offset == model.min_offset, msg
    for q in range(max(0, model.min_offset - 2), model.max_offset + 2):
        for max_count in (None, 1, 3):
            assert cq.read_units(q, max_count) == model.read_units(q, max_count), f"{msg} read_units({q}, {max_count})"


FILE_SIZES = (20, 100, 200)


@pytest.mark.parametrize("seed", range(80))
def test_random_units_match_model(tmp_path: Path, seed: int) -> None:
    """Random batches (pre-blank, holes, stale offsets, replays, file rolls, restarts) match the §7.5 model."""
    rng = random.Random(seed)
    fs = rng.choice(FILE_SIZES)
    events = make_events(rng)
    directory = tmp_path / "cq"
    cq = ConsumeQueue(str(directory), "T", 0, fs)
    model = CQModel(fs)
    for n, batch in enumerate(chunks(rng, events)):
        msg = f"seed={seed} file_size={fs} batch={n} {batch}"
        before = PutStats(model.stats.written, model.stats.already_built, model.stats.gap_blanks,
                          model.stats.pre_blanks)
        for unit in batch:
            model.put(*unit)
        stats = put(cq, batch)
        expected = PutStats(model.stats.written - before.written, model.stats.already_built - before.already_built,
                            model.stats.gap_blanks - before.gap_blanks, model.stats.pre_blanks - before.pre_blanks)
        assert stats == expected, msg
        assert_matches(cq, model, directory, msg)
        if rng.random() < 0.2:
            cq.close()
            cq = ConsumeQueue(str(directory), "T", 0, fs)
            model.reopened()
            assert_matches(cq, model, directory, msg + " after reopen")
    cq.close()


@pytest.mark.parametrize("seed", range(80))
def test_truncate_then_replay_matches_uninterrupted_run(tmp_path: Path, seed: int) -> None:
    """truncate_to at a random offset, then replay from at or before the queue's max physical offset:
    the files end byte-identical to a run that never stopped."""
    rng = random.Random(seed)
    fs = rng.choice(FILE_SIZES)
    events = make_events(rng)
    batches = chunks(rng, events)

    straight = ConsumeQueue(str(tmp_path / "a"), "T", 0, fs)
    for batch in batches:
        put(straight, batch)
    straight.close()

    crash_at = rng.randint(0, len(events))
    directory = tmp_path / "b"
    cq = ConsumeQueue(str(directory), "T", 0, fs)
    model = CQModel(fs)
    for batch in chunks(rng, events[:crash_at]):
        put(cq, batch)
        for unit in batch:
            model.put(*unit)
    phys = [e[1] for e in events]
    truncate_at = rng.choice([0, rng.randint(0, phys[-1] + 500), *phys])
    msg = f"seed={seed} file_size={fs} crash_at={crash_at} truncate_to({truncate_at})"
    cq.truncate_to(truncate_at)
    model.truncate_to(truncate_at)
    assert_matches(cq, model, directory, msg)
    reopened = rng.random() < 0.5
    if reopened:
        cq.close()
        cq = ConsumeQueue(str(directory), "T", 0, fs)
        model.reopened()
        assert_matches(cq, model, directory, msg + " after reopen")

    resume = max(cq.max_physic_offset, 0)
    latest = next((i for i, e in enumerate(events) if e[1] >= resume), len(events))
    replay_from = rng.randint(0, latest)
    for batch in chunks(rng, events[replay_from:]):
        put(cq, batch)
    cq.close()
    msg += f" reopened={reopened} replay_from={replay_from}"
    assert dir_bytes(directory) == dir_bytes(tmp_path / "a"), msg
    again = ConsumeQueue(str(directory), "T", 0, fs)
    reference = ConsumeQueue(str(tmp_path / "a"), "T", 0, fs)
    assert (again.max_offset, again.max_physic_offset) == (reference.max_offset, reference.max_physic_offset), msg
    again.close()
    reference.close()


def put_gathered(cq: ConsumeQueue, files: OpenFiles, batch: list[Unit], hold: int) -> PutStats:
    """A batch put as the store puts it in a rebuild: deferred, small appends gathered until `hold` bytes."""
    qo, phy, size, tags = (np.array(c, np.int64) for c in zip(*batch, strict=True))
    ends = phy + size
    one_streak = bool(np.all(np.diff(qo) == 1) and np.all(np.diff(ends) > 0))
    stats = cq.put_packed(qo, pack_units(phy, size.astype(np.int32), tags), ends, one_streak, later=True, hold=hold)
    files.flush_writes()
    return stats


def zero_from(data: dict[str, bytes], name: str | None, at: int, end: int) -> dict[str, bytes]:
    if name is None or at >= end:
        return data
    out = dict(data)
    out[name] = out[name][:at] + bytes(end - at) + out[name][end:]
    return out


@pytest.mark.parametrize("seed", range(60))
def test_gathered_appends_write_what_the_broker_writes_and_a_kill_loses_only_a_tail(tmp_path: Path, seed: int) -> None:
    """Appends gathered in memory (`hold`) end in the bytes of the §7.5 model; at every moment the files
    are the model's with only the gathered tail unwritten, and a kill there (the gathered units lost),
    then a reload and a replay from the start, ends as a run that never stopped."""
    rng = random.Random(seed)
    fs = rng.choice(FILE_SIZES)
    hold = rng.choice([UNIT_SIZE + 1, 3 * UNIT_SIZE, 10 * UNIT_SIZE, 1 << 20])
    events = make_events(rng)
    straight = ConsumeQueue(str(tmp_path / "a"), "T", 0, fs)
    for batch in chunks(rng, events):
        put(straight, batch)
    straight.close()

    directory = tmp_path / "b"
    files = OpenFiles(4)
    cq = ConsumeQueue(str(directory), "T", 0, fs, open_files=files)
    model = CQModel(fs)
    batches = chunks(rng, events)
    kill_after = rng.randrange(len(batches))
    for n, batch in enumerate(batches):
        msg = f"seed={seed} file_size={fs} hold={hold} batch={n}"
        before = PutStats(model.stats.written, model.stats.already_built, model.stats.gap_blanks,
                          model.stats.pre_blanks)
        for unit in batch:
            model.put(*unit)
        stats = put_gathered(cq, files, batch, hold)
        assert stats == PutStats(model.stats.written - before.written, model.stats.already_built - before.already_built,
                                 model.stats.gap_blanks - before.gap_blanks,
                                 model.stats.pre_blanks - before.pre_blanks), msg
        assert cq.held_bytes < hold, msg
        assert (cq.max_offset, cq.max_physic_offset) == (model.max_offset, model.max_physic_offset), msg
        held_name = os.path.basename(cq.writing_path) if cq.held_bytes else None
        unwritten_at = cq.write_offset - cq.held_bytes - (model.last_start if model.files else 0)
        expected = zero_from(model_bytes(model), held_name, unwritten_at, unwritten_at + cq.held_bytes)
        assert dir_bytes(directory) == expected, msg
        if n == kill_after:
            break
    files.close()  # the kill: what was written is in the page cache, the gathered units are gone
    cq = ConsumeQueue(str(directory), "T", 0, fs)
    for batch in chunks(rng, events):
        put(cq, batch)
    cq.close()
    assert dir_bytes(directory) == dir_bytes(tmp_path / "a"), f"seed={seed} killed after batch {kill_after}"


def test_gathered_appends_are_written_each_time_they_reach_the_hold(tmp_path: Path) -> None:
    """One unit at a time with a hold of three units: the file gets them three by three, and the last two
    when the queue is flushed."""
    files = OpenFiles(2)
    cq = ConsumeQueue(str(tmp_path / "q"), "T", 0, 100 * UNIT_SIZE, open_files=files)
    put(cq, [(0, 0, 10, 0)])  # the first unit creates the file
    written = []
    for i in range(1, 9):
        put_gathered(cq, files, [(i, 10 * i, 10, i)], 3 * UNIT_SIZE)
        data = (tmp_path / "q" / offset_to_file_name(0)).read_bytes()
        written.append(sum(data[n * UNIT_SIZE : (n + 1) * UNIT_SIZE] != bytes(UNIT_SIZE) for n in range(100)))
    assert written == [1, 1, 4, 4, 4, 7, 7, 7]
    assert cq.held_bytes == 2 * UNIT_SIZE
    cq.flush()
    data = (tmp_path / "q" / offset_to_file_name(0)).read_bytes()
    assert [UNIT.unpack_from(data, n * UNIT_SIZE) for n in range(10)] == \
        [(10 * i, 10, i) for i in range(9)] + [(0, 0, 0)]
    cq.close()


def test_store_writes_what_it_gathered_once_the_batches_it_keeps_pass_the_budget(tmp_path: Path, monkeypatch) -> None:
    """A queue that gets a unit a batch is not gathered for ever (each piece keeps its batch's array of units
    in memory): the store writes everything it gathered once those arrays pass HELD_BYTES_BUDGET, and the
    rest when it closes."""
    monkeypatch.setattr("indexcore.queuestore.HELD_BYTES_BUDGET", 3 * UNIT_SIZE)
    store = ConsumeQueueStore(str(tmp_path), 1000 * UNIT_SIZE)
    store.hold_bytes = 1 << 20
    path = tmp_path / "consumequeue" / "T" / "0" / offset_to_file_name(0)
    on_disk = []
    for i in range(9):
        store.dispatch(make_dispatch_batch([DispatchRec(phy_offset=100 * i, queue_offset=i)]))
        data = path.read_bytes()
        on_disk.append(sum(data[n * UNIT_SIZE : (n + 1) * UNIT_SIZE] != bytes(UNIT_SIZE) for n in range(i + 1)))
    assert on_disk == [0, 0, 0, 4, 4, 4, 4, 8, 8]  # four batches' arrays pass the budget of three units
    store.close()
    assert path.read_bytes()[: 9 * UNIT_SIZE] == b"".join(CQ_UNIT.pack(100 * i, 100, 0) for i in range(9))


@pytest.mark.parametrize("seed", range(20))
def test_store_gathering_appends_writes_the_same_files_and_writes_them_before_a_sync_or_read(tmp_path: Path,
                                                                                           seed: int) -> None:
    """A store that gathers appends (`hold_bytes`, a rebuild's setting) writes the files of one that does not,
    with queues rolling files, units replayed, and budget releases; whatever is gathered is on disk after
    `flush`, and `read_units` and `truncate_to` see it."""
    rng = random.Random(seed)
    queues = [(t, q) for t in ("A", "%LMQ%b", "c") for q in range(rng.randint(1, 4))]
    next_qo = dict.fromkeys(queues, 0)
    recs, phy = [], 0
    for _ in range(rng.randint(50, 400)):
        t, q = rng.choice(queues)
        recs.append(DispatchRec(phy_offset=phy, msg_size=rng.randint(50, 300), topic=t, queue_id=q,
                                queue_offset=next_qo[(t, q)], tags_code=rng.randint(-9, 9)))
        next_qo[(t, q)] += 1
        phy += recs[-1].msg_size
    cut = sorted(rng.sample(range(1, len(recs)), min(len(recs) - 1, rng.randint(1, 12))))
    batches = [recs[a:b] for a, b in zip([0, *cut], [*cut, len(recs)], strict=True)]
    if rng.random() < 0.5:  # a replay of earlier records, as a restart from an older offset gives
        at = rng.randrange(len(batches))
        batches.insert(at + 1, batches[rng.randrange(at + 1)])
    file_size = rng.choice([100, 400, 2000])

    plain = ConsumeQueueStore(str(tmp_path / "plain"), file_size)
    gathering = ConsumeQueueStore(str(tmp_path / "gathering"), file_size)
    gathering.hold_bytes = rng.choice([30, 100, 1000])
    for batch in batches:
        assert gathering.dispatch(make_dispatch_batch(batch)) == plain.dispatch(make_dispatch_batch(batch))
        if rng.random() < 0.3:
            key = rng.choice(list(gathering.queues))
            assert gathering.queues[key].read_units(0) == plain.queues[key].read_units(0)
        if rng.random() < 0.2:  # as the dispatcher flushes: the files synced through descriptors of its own
            gathering.flush(lambda paths: None)
            assert cq_files(tmp_path / "gathering") == {tmp_path / "gathering" / p.relative_to(tmp_path / "plain"): b
                                                        for p, b in cq_files(tmp_path / "plain").items()}
    if rng.random() < 0.5:
        middle = recs[len(recs) // 2].phy_offset
        plain.truncate_to(middle)
        gathering.truncate_to(middle)
    plain.close()
    gathering.close()
    assert cq_files(tmp_path / "gathering") == {tmp_path / "gathering" / p.relative_to(tmp_path / "plain"): b
                                                for p, b in cq_files(tmp_path / "plain").items()}


TORN_PAGE = 4096  # pages of this size are the kernel's unit of a write here (mmap.PAGESIZE)


def tear(path: Path, at: int) -> None:
    """What a write stopped by SIGKILL at the page boundary `at` leaves: nothing from `at` on."""
    data = bytearray(path.read_bytes())
    data[at:] = bytes(len(data) - at)
    path.write_bytes(bytes(data))


def units_for(n: int, base: int = 0) -> list[Unit]:
    return [(q, base + 1000 * q, 100 + q % 7, 10_000 + q) for q in range(n)]


@pytest.mark.parametrize(("units", "cut"), [(205, 4096), (410, 8192), (615, 12288), (820, 16384)])
def test_a_last_unit_a_kill_tore_at_a_page_boundary_is_written_again(tmp_path: Path, units: int, cut: int) -> None:
    """A unit across a page boundary can be left half written by a kill (the kernel copies a write page by
    page): its tags_code cut off it looks whole, and a replay would pass it over; cut in its size or
    CommitLog offset it is an invalid unit with written bytes. Either way the queue, reloaded and, from
    where the interrupted run began, replayed, ends as if never torn."""
    fs = 1000 * UNIT_SIZE
    events = units_for(units + 30, base=1 << 40)  # offsets with nonzero high bytes: a cut phy is not zeros
    straight = ConsumeQueue(str(tmp_path / "a"), "T", 0, fs)
    put(straight, events)
    straight.close()

    directory = tmp_path / "b"
    cq = ConsumeQueue(str(directory), "T", 0, fs)
    put(cq, events[: units - 10])  # an earlier run, complete
    put(cq, events[units - 10 : units])  # the interrupted run, begun at record units - 10
    cq.close()
    last = (units - 1) * UNIT_SIZE
    assert last < cut < last + UNIT_SIZE
    tear(directory / offset_to_file_name(0), cut)
    begun = events[units - 10][1]

    cq = ConsumeQueue(str(directory), "T", 0, fs)
    looks_whole = cut - last >= 12 or (cut - last == 11 and events[units - 1][2] >= 256)
    if looks_whole:
        assert cq.torn == []
        assert cq.max_offset == units
        assert cq.drop_torn_tail(events[units - 1][1] + 1) is None  # from past it: written before the run
        assert cq.drop_torn_tail(begun) == events[units - 1][1]
    else:
        assert cq.torn == [str(directory / offset_to_file_name(0))]
        assert cq.max_offset == units - 1
        assert cq.drop_torn_tail(begun) is None  # its last unit now lies inside a page
    assert cq.max_offset == units - 1
    put(cq, events[units - 10 :])
    cq.close()
    assert dir_bytes(directory) == dir_bytes(tmp_path / "a")


def test_only_a_last_unit_across_a_page_boundary_is_taken_for_torn(tmp_path: Path) -> None:
    """A last unit inside a page, a pre-blank unit, and written bytes past the page boundary (damage, not
    a kill) are not taken for a torn write."""
    fs = 1000 * UNIT_SIZE
    cq = ConsumeQueue(str(tmp_path / "inside"), "T", 0, fs)
    put(cq, units_for(204))
    assert cq.drop_torn_tail(0) is None
    cq.close()

    blanks = ConsumeQueue(str(tmp_path / "blanks"), "T", 0, fs)
    put(blanks, [(204, 5000, 100, 1)])  # pre-blank units 0-203, then unit 204 across the boundary
    assert blanks.drop_torn_tail(0) == 5000
    assert blanks.drop_torn_tail(0) is None  # unit 203, a pre-blank unit inside a page
    blanks.close()

    damaged = tmp_path / "damaged"
    cq = ConsumeQueue(str(damaged), "T", 0, fs)
    put(cq, units_for(300))
    cq.close()
    path = damaged / offset_to_file_name(0)
    data = bytearray(path.read_bytes())
    data[204 * UNIT_SIZE + 8 : 204 * UNIT_SIZE + 12] = bytes(4)  # unit 204's size zeroed, units after it kept
    path.write_bytes(bytes(data))
    with pytest.raises(StoreLayoutError, match="unit at queue offset 204: field msg_size: 0 makes it no valid unit"):
        ConsumeQueue(str(damaged), "T", 0, fs)

    older = tmp_path / "older"  # the pattern of a stopped write in a file before the newest: damage
    cq = ConsumeQueue(str(older), "T", 0, fs)
    put(cq, units_for(1100, base=1 << 40))
    cq.close()
    tear(older / offset_to_file_name(0), 204 * UNIT_SIZE + 4)
    with pytest.raises(StoreLayoutError, match="unit at queue offset 204: field msg_size"):
        ConsumeQueue(str(older), "T", 0, fs)
    assert (older / offset_to_file_name(fs)).exists()


# --- §16.2 vectors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("unit", "hex_bytes"),
    [
        ((0, 177, 2598919), "0000000000000000 000000b1 000000000027a807"),
        ((0x40000000, 200, -2065122400), "0000000040000000 000000c8 ffffffff84e8bba0"),
        ((1073745920, 250, 1700000010123), "0000000040001000 000000fa 0000018bcfe58f8b"),
        ((0, 0x7FFFFFFF, 0), "0000000000000000 7fffffff 0000000000000000"),
    ],
)
def test_unit_vectors(unit: tuple[int, int, int], hex_bytes: str) -> None:
    """CQ_UNIT encodes the §16.2 units byte for byte (tagsCode sign-extended) and decodes them back."""
    data = bytes.fromhex(hex_bytes.replace(" ", ""))
    assert CQ_UNIT_SIZE == 20
    assert CQ_UNIT.pack(*unit) == data
    assert CQ_UNIT.unpack(data) == unit


def test_blank_unit_constant() -> None:
    """BLANK_UNIT is the §7.5 pre-blank unit (0, 0x7FFFFFFF, 0)."""
    expected = bytes.fromhex("0000000000000000" "7fffffff" "0000000000000000")
    assert expected == BLANK_UNIT


def test_record_16_1_lands_at_position_100(tmp_path: Path) -> None:
    """The §16.1 record (TopicA, queue 1, queue offset 5) gives its unit at byte 100 of file 0, after 5 blanks."""
    store = ConsumeQueueStore(str(tmp_path))
    rec = DispatchRec(phy_offset=0, msg_size=177, topic="TopicA", queue_id=1, queue_offset=5,
                      store_timestamp=1700000000123, tags_code=2598919)
    assert store.dispatch(make_dispatch_batch([rec])) == PutStats(written=1, pre_blanks=5)
    store.close()
    path = tmp_path / "consumequeue" / "TopicA" / "1" / "00000000000000000000"
    assert sorted(os.listdir(path.parent)) == ["00000000000000000000"]
    assert path.stat().st_size == DEFAULT_FILE_SIZE
    with path.open("rb") as f:
        head = f.read(4096)
    assert head[:100] == BLANK * 5
    assert head[100:120] == bytes.fromhex("0000000000000000000000b1000000000027a807")
    assert head[120:] == bytes(4096 - 120)
    cq = ConsumeQueueStore(str(tmp_path)).queue("TopicA", 1)
    assert (cq.max_offset, cq.max_physic_offset) == (6, 177)
    cq.close()


@pytest.mark.parametrize(
    ("queue_offset", "file_name", "position"),
    [
        (0, "00000000000000000000", 0),
        (299999, "00000000000000000000", 5999980),
        (300000, "00000000000006000000", 0),
        (1234567, "00000000000024000000", 691340),
    ],
)
def test_position_arithmetic(queue_offset: int, file_name: str, position: int) -> None:
    """§7.3/§16.2: logical byte L = q*20 lives in file L - L % 6,000,000 at position L % 6,000,000."""
    assert DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE == DEFAULT_FILE_SIZE
    logical = queue_offset * CQ_UNIT_SIZE
    assert offset_to_file_name(logical - logical % DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE) == file_name
    assert logical % DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE == position


@pytest.mark.parametrize(
    ("queue_offset", "file_name", "position"),
    [(0, "00000000000000000000", 0), (300000, "00000000000006000000", 0),
     (1234567, "00000000000024000000", 691340)],
)
def test_first_unit_goes_to_its_position(tmp_path: Path, queue_offset: int, file_name: str, position: int) -> None:
    """A fresh default-size queue puts its first unit in the §16.2 file and position (sparse 6 MB files)."""
    cq = ConsumeQueue(str(tmp_path), "T", 0)
    stats = put(cq, [(queue_offset, 4096, 300, 7)])
    assert stats == PutStats(written=1, pre_blanks=position // UNIT_SIZE)
    assert os.listdir(tmp_path) == [file_name]
    path = tmp_path / file_name
    assert path.stat().st_size == DEFAULT_FILE_SIZE
    with path.open("rb") as f:
        data = f.read(position + 2 * UNIT_SIZE)
    assert data[:position] == BLANK * (position // UNIT_SIZE)
    assert data[position : position + UNIT_SIZE] == UNIT.pack(4096, 300, 7)
    assert data[position + UNIT_SIZE :] == bytes(UNIT_SIZE)
    assert (cq.min_offset, cq.max_offset) == (queue_offset, queue_offset + 1)
    assert cq.read_units(queue_offset) == [(4096, 300, 7)]
    cq.close()


def test_pre_blank_scaled(tmp_path: Path) -> None:
    """§16.2 pre-blank scaled by 1/1000: 300 units per file, first unit 350 -> file 6000, 50 blanks, unit at 1000."""
    fs = 300 * UNIT_SIZE
    cq = ConsumeQueue(str(tmp_path), "T", 0, fs)
    assert put(cq, [(350, 1 << 30, 200, 99)]) == PutStats(written=1, pre_blanks=50)
    assert os.listdir(tmp_path) == ["00000000000000006000"]
    data = (tmp_path / "00000000000000006000").read_bytes()
    assert data[:1000] == BLANK * 50
    assert data[1000:1020] == UNIT.pack(1 << 30, 200, 99)
    assert data[1020:] == bytes(fs - 1020)
    assert (cq.min_offset, cq.max_offset, cq.max_physic_offset) == (350, 351, (1 << 30) + 200)
    assert cq.read_units(349) == []
    assert cq.read_units(350) == [(1 << 30, 200, 99)]
    cq.close()


def test_a_unit_past_the_write_position_goes_to_its_own_queue_offset(tmp_path: Path) -> None:
    """§7.5 step 7 where reputd differs from 4.9.3 on purpose: expect > current fills the gap with blank units
    (not the broker's append at current, which leaves every later unit off its offset); expect < current is
    skipped as the broker skips it."""
    cq = ConsumeQueue(str(tmp_path), "T", 0, 200)
    assert put(cq, [(0, 0, 10, 1), (1, 10, 10, 2), (2, 20, 10, 3)]) == PutStats(written=3)
    assert put(cq, [(7, 30, 10, 4)]) == PutStats(written=1, gap_blanks=4)
    assert cq.max_offset == 8
    assert cq.read_units(3) == [(0, 0x7FFFFFFF, 0)] * 4 + [(30, 10, 4)]
    assert put(cq, [(8, 40, 10, 5)]) == PutStats(written=1)  # no drift: the next offset continues
    assert put(cq, [(4, 50, 10, 6)]) == PutStats(already_built=1)  # 80 < current 180: "already there"
    assert put(cq, [(23, 60, 10, 7)]) == PutStats(written=1, gap_blanks=14)  # across a file: 10 units a file
    assert sorted(os.listdir(tmp_path)) == ["00000000000000000000", "00000000000000000200", "00000000000000000400"]
    assert (tmp_path / "00000000000000000200").read_bytes() == BLANK * 10
    assert cq.read_units(20) == [(0, 0x7FFFFFFF, 0)] * 3 + [(60, 10, 7)]
    assert (cq.max_offset, cq.max_physic_offset) == (24, 70)
    cq.close()
    again = ConsumeQueue(str(tmp_path), "T", 0, 200)  # the blanks are valid units: recovery keeps the queue
    assert (again.max_offset, again.max_physic_offset) == (24, 70)
    again.close()


def test_queue_offset_zero_skips_the_order_check(tmp_path: Path) -> None:
    """§7.5 note: a unit with queue offset 0 is appended at the write position; 1, 2 after it are then stale."""
    cq = ConsumeQueue(str(tmp_path), "T", 0, 200)
    put(cq, [(q, 100 * q, 50, q) for q in range(5)])
    stats = put(cq, [(0, 1000, 50, 70), (1, 1100, 50, 71), (2, 1200, 50, 72)])
    assert stats == PutStats(written=1, already_built=2)
    assert cq.max_offset == 6
    assert cq.read_units(5) == [(1000, 50, 70)]
    assert cq.max_physic_offset == 1050
    cq.close()


def test_replayed_batch_is_already_built(tmp_path: Path) -> None:
    """Dispatching the same units again writes nothing: every one ends at or below maxPhysicOffset."""
    cq = ConsumeQueue(str(tmp_path), "T", 0, 100)
    units = [(q + 3, 1000 + 64 * q, 64, -q) for q in range(12)]
    assert put(cq, units) == PutStats(written=12, pre_blanks=3)
    before = dir_bytes(tmp_path)
    assert put(cq, units) == PutStats(already_built=12)
    assert put(cq, units[4:9]) == PutStats(already_built=5)
    assert dir_bytes(tmp_path) == before
    cq.close()


def test_truncate_zeroes_and_deletes(tmp_path: Path) -> None:
    """truncate_to removes units at and after the offset, zeroes them, deletes emptied files; reopen agrees."""
    cq = ConsumeQueue(str(tmp_path), "T", 0, 100)
    put(cq, [(q, 1000 * q, 100, q) for q in range(12)])
    assert sorted(os.listdir(tmp_path)) == ["00000000000000000000", "00000000000000000100", "00000000000000000200"]
    cq.truncate_to(7000)
    assert sorted(os.listdir(tmp_path)) == ["00000000000000000000", "00000000000000000100"]
    kept = UNIT.pack(5000, 100, 5) + UNIT.pack(6000, 100, 6)
    assert (tmp_path / "00000000000000000100").read_bytes() == kept + bytes(60)
    assert (cq.max_offset, cq.max_physic_offset) == (7, 6100)
    cq.truncate_to(6050)  # a unit that starts below the offset stays
    assert (cq.max_offset, cq.max_physic_offset) == (7, 6100)
    cq.close()
    again = ConsumeQueue(str(tmp_path), "T", 0, 100)
    assert (again.max_offset, again.max_physic_offset) == (7, 6100)
    again.truncate_to(0)
    assert os.listdir(tmp_path) == []
    assert (again.max_offset, again.min_offset, again.max_physic_offset) == (0, 0, -1)
    again.close()


def test_truncate_below_first_unit_of_pre_blanked_queue_then_replay(tmp_path: Path) -> None:
    """Truncating every real unit of a pre-blanked queue keeps the blanks but not a max physical offset:
    replaying the units rebuilds the very same file."""
    units = [(7 + q, 5000 + 100 * q, 100, q) for q in range(4)]
    cq = ConsumeQueue(str(tmp_path / "b"), "T", 0, 200)
    put(cq, units)
    full = dir_bytes(tmp_path / "b")
    cq.truncate_to(5000)
    assert dir_bytes(tmp_path / "b") == {"00000000000000000000": BLANK * 7 + bytes(200 - 140)}
    assert (cq.max_offset, cq.max_physic_offset) == (7, -1)
    assert put(cq, units) == PutStats(written=4)
    assert dir_bytes(tmp_path / "b") == full
    cq.close()


def test_store_dispatch_skips_prepared_and_rollback(tmp_path: Path) -> None:
    """ConsumeQueueStore.dispatch writes NOT (0x0) and COMMIT (0x8) records only, whatever the other flag bits."""
    flags = [0x0, 0x4, 0x8, 0xC, 0x5, 0x1, 0x9, 0xD, 0x2]
    recs, q = [], {}
    for i, flag in enumerate(flags):
        topic = ("A", "B")[i % 2]
        built = flag & 0xC in (0x0, 0x8)
        recs.append(DispatchRec(phy_offset=1000 * i, msg_size=100 + i, topic=topic, queue_id=i % 3,
                                queue_offset=q.get((topic, i % 3), 0) if built else 0, sys_flag=flag, tags_code=i))
        if built:
            q[(topic, i % 3)] = q.get((topic, i % 3), 0) + 1
    store = ConsumeQueueStore(str(tmp_path), 100)
    stats = store.dispatch(make_dispatch_batch(recs))
    assert stats == PutStats(written=5)
    expected: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for i, r in enumerate(recs):
        if flags[i] & 0xC in (0x0, 0x8):
            expected.setdefault((r.topic, r.queue_id), []).append((r.phy_offset, r.msg_size, r.tags_code))
    got = {key: cq.read_units(0) for key, cq in store.queues.items()}
    assert got == expected
    assert store.max_physic_offset() == 8000 + 108
    store.close()
    on_disk = {(t, int(qid)) for t in os.listdir(tmp_path / "consumequeue")
               for qid in os.listdir(tmp_path / "consumequeue" / t)}
    assert on_disk == set(expected)


def test_store_load_truncate_and_replay(tmp_path: Path) -> None:
    """ConsumeQueueStore: load() recovers every queue; truncate_to then a replay of the batch restores the bytes."""
    recs = [DispatchRec(phy_offset=200 * i, msg_size=150, topic=("A", "B")[i % 2], queue_id=0, queue_offset=i // 2,
                        tags_code=i) for i in range(30)]
    batch = make_dispatch_batch(recs)
    store = ConsumeQueueStore(str(tmp_path), 100)
    store.dispatch(batch)
    store.close()
    full = cq_files(tmp_path)
    loaded = ConsumeQueueStore(str(tmp_path), 100)
    loaded.load()
    assert sorted(loaded.queues) == [("A", 0), ("B", 0)]
    assert loaded.max_physic_offset() == 200 * 29 + 150
    loaded.truncate_to(200 * 13)
    assert loaded.max_physic_offset() == 200 * 12 + 150
    assert loaded.dispatch(batch) == PutStats(written=17, already_built=13)
    loaded.close()
    assert cq_files(tmp_path) == full


def test_correct_min_offset_passes_over_pre_blank_units(tmp_path: Path) -> None:
    """After a reload, correctMinOffset(CommitLog min) skips the blank units of a queue that starts late."""
    cq = ConsumeQueue(str(tmp_path), "T", 0, 10 * CQ_UNIT_SIZE)
    first_phy = 5_000
    cq.put_units(np.array([13, 14]), np.array([first_phy, first_phy + 100]), np.array([100, 100]), np.array([0, 0]))
    assert cq.min_offset == 13
    cq.close()
    reloaded = ConsumeQueue(str(tmp_path), "T", 0, 10 * CQ_UNIT_SIZE)
    reloaded.correct_min_offset(first_phy - first_phy % 4096)
    assert reloaded.min_offset == 13
    reloaded.correct_min_offset(0)
    assert reloaded.min_offset == 10
    reloaded.close()
