"""Retention (issue 28 §1): which ConsumeQueue files and IndexFiles go once the CommitLog's first offset moves.

The model is the 4.9.3 broker's code transcribed over plain lists (`MappedFileQueue.deleteExpiredFileByOffset`,
`ConsumeQueue.correctMinOffset`, `IndexService.deleteExpiredFile`), read from the files' raw bytes; the real
files, queues and services are cleaned by `indexcore.retention` and the files kept compared with it.
"""

from __future__ import annotations

import os
import random
import struct
import threading
from pathlib import Path

import pytest
import yaml

from daemon.config import load_config
from daemon.engine.checkpoint import read_checkpoint
from daemon.engine.cleaner import Cleaner, commit_log_min_offset
from daemon.engine.session import open_session
from daemon.ops.metrics import ReputMetrics
from indexcore.indexfile import IndexHeader, index_file_size
from indexcore.indexservice import IndexService, index_file_name
from indexcore.mappedfile import offset_to_file_name
from indexcore.queuefiles import ConsumeQueue
from indexcore.queuestore import ConsumeQueueStore
from indexcore.retention import delete_expired, expired_index_prefix, expired_prefix
from indexcore.writer import CommitLogWriter, Message

UNIT = struct.Struct(">qiq")  # the model's own layout (STORE_FORMAT.md §7.2)
UNIT_SIZE = 20
SEEDS = range(200)


# --- the model ------------------------------------------------------------------------------------------------

def model_kept_queue_files(files: list[bytes], min_phy_offset: int) -> int:
    """`deleteExpiredFileByOffset(offset, 20)` over files oldest first: index of the first file kept. The last
    unit is bytes [size-20, size); a file whose last unit is not written stops the walk (the live broker's
    `selectMappedBuffer` returns null there: "this being not executed forever")."""
    first = 0
    for data in files[:-1]:
        last = data[-UNIT_SIZE:]
        if not any(last):
            break
        if UNIT.unpack(last)[0] < min_phy_offset:
            first += 1
        else:
            break
    return first


def model_min_offset(first_file_start: int, data: bytes, min_phy_offset: int, before: int) -> int:
    """`correctMinOffset`: the first unit of the first file at or past the offset; unchanged if none is."""
    for i in range(0, len(data), UNIT_SIZE):
        if UNIT.unpack(data[i : i + UNIT_SIZE])[0] >= min_phy_offset:
            return (first_file_start + i) // UNIT_SIZE
    return before


def model_kept_index_files(end_phy_offsets: list[int], min_phy_offset: int) -> int:
    """`IndexService.deleteExpiredFile(offset)`: index of the first IndexFile kept."""
    if not end_phy_offsets or not end_phy_offsets[0] < min_phy_offset:
        return 0
    first = 0
    for end in end_phy_offsets[:-1]:
        if end < min_phy_offset:
            first += 1
        else:
            break
    return first


# --- the pure rule ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_expired_prefix_is_the_brokers_walk(seed):
    """Random last units (some unwritten), any offset: as many files go as the broker's loop deletes."""
    rng = random.Random(seed)
    n = rng.randint(0, 8)
    lasts = sorted(rng.randrange(0, 10_000) for _ in range(n))
    lasts = [None if rng.random() < 0.15 else v for v in lasts]
    files = [bytes(UNIT_SIZE) if v is None else UNIT.pack(v, 100, 0) for v in lasts]
    offset = rng.randrange(0, 12_000)
    asked: list[int] = []

    def last_unit(i: int):
        asked.append(i)
        return lasts[i]

    got = expired_prefix(n, last_unit, offset)
    assert got == model_kept_queue_files(files, offset), f"seed {seed}"
    assert n - 1 not in asked or n == 0, "the newest file is never read: it is never deleted"
    assert asked == list(range(len(asked))), "files are read oldest first, only as far as the walk goes"


@pytest.mark.parametrize("seed", SEEDS)
def test_expired_index_prefix_is_the_brokers_walk(seed):
    rng = random.Random(seed)
    ends = sorted(rng.randrange(0, 10_000) for _ in range(rng.randint(0, 8)))
    offset = rng.randrange(0, 12_000)
    assert expired_index_prefix(len(ends), ends.__getitem__, offset) == model_kept_index_files(ends, offset)


# --- real files -------------------------------------------------------------------------------------------------

def write_queue(directory: Path, file_size: int, rng: random.Random) -> list[bytes]:
    """A queue of random length whose units point at growing offsets; its first file may start with
    pre-blank units and past offset 0. Written as raw files, the way a broker leaves them."""
    directory.mkdir(parents=True, exist_ok=True)
    per_file = file_size // UNIT_SIZE
    first_file = rng.randint(0, 3)
    files = rng.randint(1, 7)
    units = files * per_file - rng.randint(0, per_file - 1)  # the newest file partly written
    blanks = rng.randint(0, per_file - 1) if rng.random() < 0.3 else 0
    phy = rng.randint(0, 500)
    data = bytearray()
    for i in range(units):
        if i < blanks:
            data += UNIT.pack(0, 0x7FFFFFFF, 0)
        else:
            data += UNIT.pack(phy, 100, 7)
            phy += rng.randint(100, 400)
    data += bytes(files * file_size - len(data))
    out = []
    for f in range(files):
        chunk = bytes(data[f * file_size : (f + 1) * file_size])
        (directory / offset_to_file_name((first_file + f) * file_size)).write_bytes(chunk)
        out.append(chunk)
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_queue_files_kept_match_the_brokers_rule_for_random_layouts(tmp_path, seed):
    """Random queues, a random CommitLog first offset: the files kept, and the min offset, are the model's."""
    rng = random.Random(seed)
    file_size = UNIT_SIZE * rng.choice((3, 5, 8))
    root = tmp_path / "consumequeue"
    layouts = {q: write_queue(root / "T" / str(q), file_size, rng) for q in range(3)}
    store = ConsumeQueueStore(str(tmp_path), file_size)
    store.load()
    before = {q: store.queue("T", q).min_offset for q in layouts}
    offset = rng.randrange(0, 8000)
    delete_expired(list(store), None, offset)
    for q, files in layouts.items():
        first = model_kept_queue_files(files, offset)
        names = sorted(os.listdir(root / "T" / str(q)))
        starts = sorted(int(n) for n in names)
        assert len(names) == len(files) - first, f"seed {seed} queue {q}"
        cq = store.queue("T", q)
        assert cq.file_starts == starts
        kept_start = starts[0]
        assert cq.min_offset == model_min_offset(kept_start, files[first], offset,
                                                 max(before[q], kept_start // UNIT_SIZE)), f"seed {seed} queue {q}"
    store.close()


def test_an_unwritten_last_unit_stops_the_walk(tmp_path):
    """A file older than the newest whose last unit holds zeros is not taken to point below the offset."""
    d = tmp_path / "consumequeue" / "T" / "0"
    d.mkdir(parents=True)
    size = 3 * UNIT_SIZE
    contents = [UNIT.pack(0, 10, 0) + UNIT.pack(10, 10, 0) + UNIT.pack(20, 10, 0),
                UNIT.pack(30, 10, 0) + bytes(2 * UNIT_SIZE),  # a gap: its last unit was never written
                *(UNIT.pack(100 + 30 * i, 10, 0) * 3 for i in range(4))]
    for i, data in enumerate(contents):
        (d / offset_to_file_name(i * size)).write_bytes(data)
    cq = ConsumeQueue(str(d), "T", 0, size)
    delete_expired([cq], None, 10_000)
    assert sorted(os.listdir(d)) == [offset_to_file_name(i * size) for i in range(1, 6)]


def write_index(directory: Path, slots: int, num: int, ends: list[int]) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for i, end in enumerate(ends):
        name = index_file_name(1_700_000_000_000 + 1000 * i)
        header = IndexHeader(1_700_000_000_000, 1_700_000_000_000 + i, max(0, end - 50), end, 1, 2).encode()
        (directory / name).write_bytes(header + bytes(index_file_size(slots, num) - len(header)))
        names.append(name)
    return names


@pytest.mark.parametrize("seed", SEEDS)
def test_index_files_kept_match_the_brokers_rule_for_random_layouts(tmp_path, seed):
    rng = random.Random(seed)
    ends = sorted(rng.randrange(50, 10_000) for _ in range(rng.randint(1, 7)))
    names = write_index(tmp_path / "index", 7, 3, ends)
    service = IndexService(str(tmp_path), 7, 3)
    service.load()
    offset = rng.randrange(0, 12_000)
    delete_expired([], service, offset)
    kept = names[model_kept_index_files(ends, offset):]
    assert sorted(os.listdir(tmp_path / "index")) == kept, f"seed {seed}"
    assert service.names == kept
    service.close()


def test_a_kill_between_two_deletions_leaves_what_the_next_pass_finishes(tmp_path):
    """Files go oldest first: stopping after any of them leaves a queue that loads, and the next pass (after a
    restart) ends where one pass ends."""
    rng = random.Random(5)
    size = 5 * UNIT_SIZE
    one_pass = tmp_path / "one"
    files = write_queue(one_pass / "consumequeue" / "T" / "0", size, rng)
    while len(files) < 4:
        files = write_queue(one_pass / "consumequeue" / "T" / "0", size, rng)
    last_units = [UNIT.unpack(f[-UNIT_SIZE:])[0] for f in files]
    offset = last_units[-2] + 1  # every file but the newest expires
    for cut in range(len(files) - 1):
        d = tmp_path / f"cut{cut}" / "consumequeue" / "T" / "0"
        d.mkdir(parents=True)
        for i, data in enumerate(files):
            (d / offset_to_file_name(i * size)).write_bytes(data)
        cq = ConsumeQueue(str(d), "T", 0, size)
        for path in cq.forget_oldest(cut):  # the kill: only the first `cut` unlinks happened
            os.unlink(path)
        reloaded = ConsumeQueue(str(d), "T", 0, size)
        delete_expired([reloaded], None, offset)
        assert sorted(os.listdir(d)) == [offset_to_file_name((len(files) - 1) * size)], f"cut after {cut}"
        assert (d / offset_to_file_name((len(files) - 1) * size)).read_bytes() == files[-1]


# --- the daemon's cleaner on a session ----------------------------------------------------------------------------

SEGMENT = 64 * 1024


def session_store(tmp_path: Path, messages: int):
    writer = CommitLogWriter(str(tmp_path / "store" / "commitlog"), SEGMENT,
                             clock=iter(range(1_700_000_000_000, 1_800_000_000_000, 97)).__next__)
    for i in range(messages):
        writer.append(Message(f"T{i % 2}", i % 2, b"x" * 300, {"KEYS": f"k{i}", "UNIQ_KEY": f"{i:032X}"}))
    writer.close()
    cfg = {"store": {"storePathRootDir": str(tmp_path / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": 400, "maxHashSlotNum": 17, "maxIndexNum": 60,
                     "cleanResourceInterval": 50, "deleteConsumeQueueFilesInterval": 0},
           "output": {"dir": str(tmp_path / "out")}, "metrics": {"enabled": False}}
    path = tmp_path / "reputd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(str(path), env={})


def dispatch_all(session, until: int | None = None) -> None:
    """Dispatch what the session's reader reads, to the end of the CommitLog or to `until`."""
    while until is None or session.dispatched_offset < until:
        result = session.reader.read(session.dispatched_offset, verify_end=True)
        if len(result.batch):
            for d in session.dispatchers:
                d.dispatch(result.batch)
        session.dispatched_offset = result.next_offset
        if result.status.name != "OK":
            return


def close(session) -> None:
    for d in session.dispatchers:
        d.close()
    session.reader.close()


def test_cleaner_cleans_below_the_first_offset_and_keeps_what_a_recovery_to_the_checkpoint_needs(tmp_path):
    """A checkpoint behind the CommitLog's first offset no longer bounds the pass: every queue loses its files
    whose last unit points below the first offset, but keeps the file a recovery to the checkpoint would leave
    as its newest (the last starting below the checkpoint's offset); the IndexFile the checkpoint names and
    the newer ones stay. What stays expired is published as behind."""
    config = session_store(tmp_path, 3000)
    metrics = ReputMetrics(lambda: None)
    s = open_session(config, metrics)
    dispatch_all(s)
    segments = sorted(os.listdir(tmp_path / "store" / "commitlog"))
    for name in segments[:6]:
        os.unlink(tmp_path / "store" / "commitlog" / name)
    first = commit_log_min_offset(config.store.commit_log_dirs)
    assert first == int(segments[6])
    checkpoint = first // 2  # the checkpoint trails the CommitLog's first offset
    s.checkpoint_offset = checkpoint
    names = list(s.dispatchers[1].service.names)
    s.checkpoint_states = {"index": {"name": names[1]}}
    expired_index = model_kept_index_files([s.dispatchers[1].service.end_phy_offset_of(n) for n in names], first)
    queues = {cq.queue_id: [Path(cq.file_path(st)).read_bytes() for st in cq.file_starts]
              for cq in s.dispatchers[0].queues}
    result = Cleaner(s).clean_once(paced=False)
    assert result.cleaned_below == first
    assert s.dispatchers[1].service.names == names[1:]
    assert result.index_files_kept == expired_index - 1 > 0
    kept_for_recovery = 0
    for cq in s.dispatchers[0].queues:
        files = queues[cq.queue_id]
        firsts = [UNIT.unpack(f[:UNIT_SIZE])[0] for f in files]
        recovery_keeps = max(i for i, phy in enumerate(firsts) if phy < checkpoint)
        assert model_kept_queue_files(files, first) > recovery_keeps  # the rule alone would delete it
        assert len(cq.file_starts) == len(files) - recovery_keeps, f"queue {cq.queue_id}"
        kept_for_recovery += model_kept_queue_files(files, first) - recovery_keeps
    behind = s.retention_behind
    assert (behind.files, behind.index_files) == (kept_for_recovery, result.index_files_kept)
    assert metrics.registry.get_sample_value("reputd_deleted_files_total", {"kind": "consumequeue"}) == \
        result.files["consumequeue"] > 0
    close(s)


def test_cleaner_thread_deletes_while_dispatch_and_flush_go_on(tmp_path):
    """The thread cleans once the first offset moves while the flusher syncs and checkpoints beside it, and
    the files left are exactly the broker's rule over the final files."""
    from daemon.engine.flusher import Flusher

    config = session_store(tmp_path, 3000)
    s = open_session(config, ReputMetrics(lambda: None))
    dispatch_all(s)
    errors: list[Exception] = []
    flusher = Flusher(s, errors.append)
    assert flusher.flush_once(thorough=True)
    segments = sorted(os.listdir(tmp_path / "store" / "commitlog"))
    for name in segments[:5]:
        os.unlink(tmp_path / "store" / "commitlog" / name)
    first = int(segments[5])
    files_before = s.dispatchers[0].files() + s.dispatchers[1].files()
    cleaner = Cleaner(s)
    done = threading.Event()
    cleaner.start()
    try:
        for _ in range(200):
            flusher.flush_once(thorough=True)
            if cleaner.last_cleaned == first:
                done.set()
                break
            threading.Event().wait(0.02)
    finally:
        cleaner.stop()
    assert done.is_set()
    assert errors == []
    assert s.dispatchers[0].files() + s.dispatchers[1].files() < files_before
    assert read_checkpoint(config.output.dir).reput_from_offset == s.dispatched_offset
    for cq in s.dispatchers[0].queues:
        raw = [Path(cq.file_path(st)).read_bytes() for st in cq.file_starts]
        assert model_kept_queue_files(raw, first) == 0, f"{cq.topic}/{cq.queue_id} kept an expired file"
    ends = [s.dispatchers[1].service.end_phy_offset_of(n) for n in s.dispatchers[1].service.names]
    assert model_kept_index_files(ends, first) == 0
    close(s)



def test_a_commitlog_directory_with_a_stray_file_cleans_nothing(tmp_path):
    """The loop reports a stray file and waits (`commitlog_unavailable`); the clean-up waits too, silently."""
    d = tmp_path / "commitlog"
    d.mkdir()
    (d / offset_to_file_name(1 << 20)).write_bytes(b"")
    assert commit_log_min_offset((str(d),)) == 1 << 20
    (d / "stray").write_bytes(b"")
    assert commit_log_min_offset((str(d),)) is None
