"""Output files are created complete or not at all (indexcore.mappedfile.create_file), and what a creation
cut short leaves is passed over by readers and removed by the next writer, never taken for data."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from indexcore import _failpoints, openfiles
from indexcore.consumequeue import BLANK_UNIT, CQ_UNIT, CQ_UNIT_SIZE
from indexcore.indexfile import INDEX_HEADER, IndexFile, index_file_size
from indexcore.indexservice import IndexService
from indexcore.mappedfile import (
    CREATE_CLOSED,
    CREATE_EXISTED,
    CREATE_KEEP_OPEN,
    CREATE_MAKE_PARENT,
    TEMP_SUFFIX,
    create_file,
    create_in_place,
    create_in_place_many,
)
from indexcore.queuefiles import ConsumeQueue
from indexcore.queuestore import ConsumeQueueStore
from tests.conftest import DispatchRec, make_dispatch_batch

STEPS = ("before_create", "after_create", "after_allocate", "after_header", "after_fsync", "after_rename")
SLOTS, ENTRIES = 7, 5


class Killed(BaseException):
    """Stands for SIGKILL at a fail point: nothing after it runs."""


@pytest.fixture
def kill_at():
    def arm(point: str) -> None:
        def hook(reached: str) -> None:
            if reached == point:
                raise Killed(point)
        _failpoints.hook = hook
    yield arm
    _failpoints.hook = None


@pytest.mark.parametrize("step", STEPS)
def test_a_file_is_complete_or_absent_at_every_step(tmp_path, kill_at, step):
    path = tmp_path / "00000000000000000000"
    kill_at(f"test.{step}")
    with pytest.raises(Killed):
        create_file(str(path), 4096, b"header", label="test")
    tmp = Path(str(path) + TEMP_SUFFIX)
    if step == "after_rename":
        assert path.read_bytes() == b"header" + bytes(4090)
        assert not tmp.exists()
    else:
        assert not path.exists()
        assert tmp.exists() == (step != "before_create")


def test_no_room_leaves_nothing(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="cannot allocate") as e:
        create_file(str(tmp_path / "f"), 4096, label="test")
    assert e.value.filename == str(tmp_path / "f")
    assert os.listdir(tmp_path) == []


def test_create_never_replaces_a_file(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        create_file(str(tmp_path / "f"), 4096, label="test")
    assert (tmp_path / "f").read_bytes() == b"x"


def rec(phy: int, keys: str) -> DispatchRec:
    return DispatchRec(phy_offset=phy, msg_size=100, topic="T", store_timestamp=1_700_000_000_000 + phy, keys=keys)


def test_index_leftovers_are_passed_over_by_readers_and_removed_by_writers(tmp_path):
    service = IndexService(str(tmp_path), SLOTS, ENTRIES)
    service.load()
    service.build_index(make_dispatch_batch([rec(0, "a b c d"), rec(100, "e")]))  # four a file: two files
    service.close()
    names = sorted(os.listdir(tmp_path / "index"))
    assert len(names) == 2
    before = {n: (tmp_path / "index" / n).read_bytes() for n in names}
    leftover = tmp_path / "index" / f"29991231000000000{TEMP_SUFFIX}"
    leftover.write_bytes(b"\0" * 10)
    empty = tmp_path / "index" / "29991231000000000"  # a 0-byte newest file, as an older reputd left
    empty.write_bytes(b"")
    reader = IndexService(str(tmp_path), SLOTS, ENTRIES)
    reader.load(readonly=True)
    assert reader.names == names
    assert reader.query_offset("T", "e", 64, 0, 2**63 - 1).phy_offsets == [100]
    reader.close()
    assert leftover.exists()  # a reader changes nothing
    assert empty.exists()
    writer = IndexService(str(tmp_path), SLOTS, ENTRIES)
    writer.load()
    assert sorted(writer.removed) == sorted([str(leftover), str(empty)])
    writer.close()
    assert {n: (tmp_path / "index" / n).read_bytes() for n in sorted(os.listdir(tmp_path / "index"))} == before


def test_an_index_file_allocated_without_its_header_is_removed(tmp_path):
    """An older reputd (or a broker) killed after allocating a new IndexFile, before its header: all zeros,
    after a predecessor whose end it would have been seeded with. It holds nothing."""
    service = IndexService(str(tmp_path), SLOTS, ENTRIES)
    service.load()
    service.build_index(make_dispatch_batch([rec(0, "a b c"), rec(100, "d")]))
    service.close()
    zero = tmp_path / "index" / "29991231000000000"
    with open(zero, "wb") as f:
        f.truncate(index_file_size(SLOTS, ENTRIES))
    again = IndexService(str(tmp_path), SLOTS, ENTRIES)
    again.load()
    assert again.removed == [str(zero)]
    assert again.resume_point().phy_offset == 100
    again.close()


def test_a_first_index_file_with_a_zero_header_is_a_real_one(tmp_path):
    """The first file's seed values are zeros: its header is all zero until the first put, and it stays."""
    IndexFile(str(tmp_path / "f"), SLOTS, ENTRIES, create=True).close()
    assert INDEX_HEADER.unpack_from((tmp_path / "f").read_bytes()) == (0, 0, 0, 0, 0, 0)
    (tmp_path / "index").mkdir()
    os.replace(tmp_path / "f", tmp_path / "index" / "20231114221320000")
    service = IndexService(str(tmp_path), SLOTS, ENTRIES)
    service.load()
    assert service.removed == []
    assert service.names == ["20231114221320000"]
    assert service.resume_point() is None
    service.close()


def test_queue_leftovers_are_passed_over_by_readers_and_removed_by_writers(tmp_path):
    size = 4 * CQ_UNIT_SIZE
    cq = ConsumeQueue(str(tmp_path / "q"), "T", 0, size)
    n = 6
    cq.put_units(np.arange(n), np.arange(n) * 100, np.full(n, 100, np.int32), np.zeros(n, np.int64))
    cq.close()
    files = sorted(os.listdir(tmp_path / "q"))
    before = {f: (tmp_path / "q" / f).read_bytes() for f in files}
    (tmp_path / "q" / f"{2 * size:020d}{TEMP_SUFFIX}").write_bytes(b"")
    (tmp_path / "q" / f"{2 * size:020d}").write_bytes(b"")
    reader = ConsumeQueue(str(tmp_path / "q"), "T", 0, size, readonly=True)
    assert reader.max_offset == n
    assert len(os.listdir(tmp_path / "q")) == len(files) + 2
    writer = ConsumeQueue(str(tmp_path / "q"), "T", 0, size)
    assert len(writer.removed) == 2
    assert writer.max_offset == n
    writer.close()
    assert {f: (tmp_path / "q" / f).read_bytes() for f in sorted(os.listdir(tmp_path / "q"))} == before


def test_a_first_queue_file_left_without_its_blanks_is_removed(tmp_path):
    """An older reputd killed after allocating a queue's first file, before its pre-blank units: the next
    put must lay them down, not append at unit 0."""
    size = 10 * CQ_UNIT_SIZE
    (tmp_path / "consumequeue" / "T" / "0").mkdir(parents=True)
    with open(tmp_path / "consumequeue" / "T" / "0" / f"{0:020d}", "wb") as f:
        f.truncate(size)
    store = ConsumeQueueStore(str(tmp_path), size)
    store.load()
    cq = store.queue("T", 0)
    assert len(cq.removed) == 1
    cq.put_units(np.array([3]), np.array([500]), np.array([100], np.int32), np.array([0]))
    store.close()
    data = (tmp_path / "consumequeue" / "T" / "0" / f"{0:020d}").read_bytes()
    assert data[: 3 * CQ_UNIT_SIZE] == BLANK_UNIT * 3


# --- many files at once (the first files of the queues an LMQ batch meets) --------------------------------

def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _many(root: Path) -> list[tuple[str, str, bytes, int]]:
    """Queue directories two levels deep, a topic's first with CREATE_MAKE_PARENT, some with pre-blank units as
    their header, every other one kept open, one existing already."""
    files = []
    for i in range(40):
        directory = root / "consumequeue" / f"%LMQ%room-{i // 2}" / str(i % 2)
        flags = (CREATE_MAKE_PARENT if i % 2 == 0 else 0) | (CREATE_KEEP_OPEN if i % 4 < 2 else 0)
        files.append((str(directory), str(directory / "00000000000000000000"), BLANK_UNIT * (i % 3), flags))
    existing = Path(files[7][1])
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"made by someone else")
    return files


@pytest.mark.parametrize("watched", [False, True], ids=["kernel", "file by file"])
def test_create_in_place_many_makes_what_create_in_place_makes(tmp_path, watched):
    """The kernel's batch (no fail point hook) and the file-by-file path (a hook installed, as in the crash
    matrix) take the same steps: the same directories and files, the existing one left alone, a descriptor
    for those kept open and none left for the others."""
    files = _many(tmp_path)
    before = _open_descriptors()
    if watched:
        _failpoints.hook = lambda point: None
    try:
        made = create_in_place_many(files, 4000, label="test")
    finally:
        _failpoints.hook = None
    assert made[7] == CREATE_EXISTED
    for i, fd in enumerate(made):
        if i != 7:
            assert fd >= 0 if files[i][3] & CREATE_KEEP_OPEN else fd == CREATE_CLOSED
    kept = [fd for fd in made if fd >= 0]
    assert _open_descriptors() == before + len(kept) == before + 20
    for fd in kept:
        os.write(fd, b"")  # read-write
        os.close(fd)
    for i, (directory, path, header, _) in enumerate(files):
        data = Path(path).read_bytes()
        assert data == (b"made by someone else" if i == 7 else header + bytes(4000 - len(header)))
        assert os.listdir(directory) == ["00000000000000000000"]  # no temporary


@pytest.mark.parametrize("watched", [False, True], ids=["kernel", "file by file"])
def test_create_in_place_many_error_names_the_path_and_closes_what_it_made(tmp_path, watched):
    files = _many(tmp_path)
    blocked = tmp_path / "consumequeue" / "%LMQ%blocked"
    blocked.write_bytes(b"a file where a topic directory should be")
    files.insert(20, (str(blocked / "0"), str(blocked / "0" / "00000000000000000000"), b"", CREATE_KEEP_OPEN))
    before = _open_descriptors()
    if watched:
        _failpoints.hook = lambda point: None
    try:
        with pytest.raises(NotADirectoryError) as e:
            create_in_place_many(files, 4000, label="test")
    finally:
        _failpoints.hook = None
    assert e.value.filename == str(blocked / "0")
    assert _open_descriptors() == before
    for _, path, header, _ in files[:20]:  # made before the error: complete, and they stay
        if Path(path).read_bytes() != b"made by someone else":
            assert Path(path).read_bytes() == header + bytes(4000 - len(header))


def test_a_queue_file_made_in_place_is_never_synced_an_index_file_is(tmp_path, monkeypatch):
    """A ConsumeQueue file's creation waits for no disk (the flusher syncs it and its directory before a
    checkpoint covers it); an IndexFile, written through its mapping, is synced before its rename."""
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    os.close(create_in_place(str(tmp_path / "a"), 4000, b""))
    assert create_in_place(str(tmp_path / "b"), 4000, BLANK_UNIT, keep_open=False) == CREATE_CLOSED
    assert synced == []
    create_file(str(tmp_path / "c"), 4000, b"")
    assert len(synced) == 1


def test_create_in_place_never_replaces_a_file_and_no_room_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        create_in_place(str(tmp_path / "f"), 4096, label="test")
    assert (tmp_path / "f").read_bytes() == b"x"

    def full(fd, data, position):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="cannot write") as e:
        create_in_place(str(tmp_path / "g"), 4096, BLANK_UNIT, label="test")
    assert e.value.filename == str(tmp_path / "g")
    assert sorted(os.listdir(tmp_path)) == ["f"]


QUEUE_STEPS = ("before_create", "after_create", "after_allocate", "after_header")


@pytest.mark.parametrize("blanks", [0, 300], ids=["no pre-blanks", "300 pre-blanks"])
@pytest.mark.parametrize("step", [*QUEUE_STEPS, "torn_header"])
def test_a_queue_file_cut_short_at_any_step_of_its_creation_ends_as_if_never_cut(tmp_path, kill_at, step, blanks):
    """What a kill leaves of a ConsumeQueue file created in place (nothing, an empty file, a file of zeros,
    its pre-blank units, or only the first page of them, as a kill between two pages of the write leaves it)
    is taken by the next load for a creation cut short or a queue to complete: the same put then gives the
    bytes of a creation never cut."""
    size = 400 * CQ_UNIT_SIZE
    directory = tmp_path / "consumequeue" / "T" / "0"
    directory.mkdir(parents=True)
    path = directory / f"{0:020d}"
    if step == "torn_header":
        with open(path, "wb") as f:
            f.truncate(size)
            f.write((BLANK_UNIT * blanks)[:4096])
    else:
        kill_at(f"consumequeue.{step}")
        with pytest.raises(Killed):
            ConsumeQueue(str(directory), "T", 0, size, new=True).put_units(
                np.array([blanks]), np.array([500]), np.array([100], np.int32), np.array([7]))
        _failpoints.hook = None
    store = ConsumeQueueStore(str(tmp_path), size)
    store.load()
    store.queue("T", 0).put_units(np.array([blanks]), np.array([500]), np.array([100], np.int32), np.array([7]))
    store.close()
    clean = tmp_path / "clean"
    ConsumeQueue(str(clean), "T", 0, size).put_units(np.array([blanks]), np.array([500]), np.array([100], np.int32),
                                                    np.array([7]))
    assert os.listdir(directory) == [f"{0:020d}"]
    assert path.read_bytes() == (clean / f"{0:020d}").read_bytes()


def test_deferred_writes_keep_their_order_and_are_made_before_a_descriptor_closes(tmp_path):
    from indexcore.openfiles import OpenFiles

    paths = [str(tmp_path / name) for name in ("a", "b", "c")]
    for p in paths:
        Path(p).write_bytes(bytes(100))
    files = OpenFiles(1)
    files.write_later(paths[0], np.frombuffer(b"AAAA", np.uint8), 0)  # a is opened and kept
    files.write_later(paths[1], b"BB", 10)  # the set is full: b is opened for its write only, a stays
    assert len(files) == 1
    assert Path(paths[0]).read_bytes()[:4] == bytes(4)  # deferred
    files.write_later(paths[1], b"bb", 10)
    files.write(paths[1], b"X", 11)  # a plain write comes after those deferred (and takes b's descriptor)
    assert Path(paths[0]).read_bytes()[:4] == b"AAAA"
    assert Path(paths[1]).read_bytes()[10:12] == b"bX"
    files.write_later(paths[2], b"CC", 0)
    files.discard(paths[1])  # deferred writes are made before a descriptor closes
    assert Path(paths[2]).read_bytes()[:2] == b"CC"
    files.write_later(paths[0], b"D", 50)
    files.close()
    assert Path(paths[0]).read_bytes()[50:51] == b"D"


def test_a_write_to_a_file_no_descriptor_holds_opens_it_for_itself(tmp_path):
    """The gathered appends of thousands of queues through a set of 4: each write past the set opens its file
    and closes it again, in one call without the GIL; nothing is evicted, no descriptor is left."""
    from indexcore.openfiles import OpenFiles

    before = len(os.listdir("/proc/self/fd"))
    files = OpenFiles(4)
    paths = [tmp_path / f"q{i}" for i in range(300)]
    for i, p in enumerate(paths):
        p.write_bytes(bytes(8))
        files.write_later(str(p), i.to_bytes(8, "big"), 0)
    assert len(os.listdir("/proc/self/fd")) == before + 4
    files.flush_writes()
    assert [int.from_bytes(p.read_bytes(), "big") for p in paths] == list(range(300))
    paths[7].unlink()
    files.write_later(str(paths[7]), b"x", 0)
    with pytest.raises(FileNotFoundError) as e:
        files.flush_writes()
    assert e.value.filename == str(paths[7])
    files.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_deferred_write_that_fails_names_its_file(tmp_path):
    from indexcore.openfiles import OpenFiles

    path = str(tmp_path / "a")
    Path(path).write_bytes(bytes(100))
    files = OpenFiles(4)
    files.write_later(path, b"data", 0)
    os.close(files.fd(path))  # the descriptor gone behind its back: the write fails
    with pytest.raises(OSError, match="cannot write 4 bytes at 0") as e:
        files.flush_writes()
    assert e.value.filename == path
    files._fds.clear()


def test_a_deferred_write_of_many_buffers_is_one_vectored_write_that_goes_on_after_a_short_one(tmp_path):
    """A list of buffers is written back to back; a write the kernel cuts short (here: RLIMIT_FSIZE, in a
    child) goes on from the byte it stopped at, inside a buffer, and a refusal reports what was left."""
    script = textwrap.dedent("""
        import os, resource, signal, sys
        import numpy as np
        from indexcore import _kernels
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        parts = [b"abc", b"", np.frombuffer(b"defg", np.uint8), memoryview(b"hij")]
        resource.setrlimit(resource.RLIMIT_FSIZE, (5, resource.RLIM_INFINITY))
        refused = _kernels.pwrite_many([(fd, parts, 0)])
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        done = _kernels.pwrite_many([(fd, b"01", 20), (fd, parts, 10)])
        print(refused, done, os.pread(fd, 30, 0))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "f")], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.split(" b'")[0] == f"(0, 5, 5, {errno.EFBIG}) None"
    assert (tmp_path / "f").read_bytes() == b"abcde" + bytes(5) + b"abcdefghij" + b"01"


def test_a_new_topic_directory_is_made_by_its_first_new_queue_only(tmp_path):
    """A batch meeting a new topic's queues makes its directory once, with the first of them: every other
    queue's mkdir of it failed with EEXIST (6,000 of 16,000 mkdirs rebuilding 8,000 queues in 2,000 topics)."""
    store = ConsumeQueueStore(str(tmp_path))
    store.queue("Old", 0)  # a topic the store holds already
    new = store._new_queues([((topic, q), 0) for topic in ("T0", "Old", "T1") for q in range(4)])
    assert [q.key for q in new if q.make_parent] == [("T0", 0), ("T1", 0)]
    store.made_queues(zip(new, store.create_queue_files(new), strict=True))
    for q in new:
        assert os.listdir(q.directory) == ["00000000000000000000"]
    store.close()


def _two_batches(topics: int) -> list:
    """Two batches putting units into `topics` x 2 queues, one new queue (Late/0) in the second, its first unit
    past offset 0 (its file starts with pre-blank units)."""
    recs = [[DispatchRec(phy_offset=(b * topics * 2 + i) * 100, topic=f"T{i // 2}", queue_id=i % 2, queue_offset=b)
             for i in range(topics * 2)] for b in range(2)]
    recs[1].append(DispatchRec(phy_offset=topics * 400, topic="Late", queue_offset=3))
    return [make_dispatch_batch(r) for r in recs]


def test_a_rebuild_creates_each_new_queue_file_with_its_first_write(tmp_path, monkeypatch):
    """`create_on_write` (a rebuild): a new queue's file is made when its gathered units are first written, with
    the descriptor its creation opened (never opened a second time: 8,000 queues cost 16,553 opens, twice each),
    MAKE_OPEN_AT_ONCE of them at once beside the bounded set; the files end as without it."""
    writes: list[tuple] = []
    made_at_once: list[int] = []
    real_write, real_make = openfiles._kernels.pwrite_many, openfiles.OpenFiles._make

    def pwrite_many(pending, *under):
        writes.extend(pending)
        return real_write(pending, *under)

    def make(files, paths, keep_open):
        made_at_once.append(len(paths))
        return real_make(files, paths, keep_open)

    monkeypatch.setattr(openfiles._kernels, "pwrite_many", pwrite_many)
    monkeypatch.setattr(openfiles.OpenFiles, "_make", make)
    monkeypatch.setattr(openfiles, "MAKE_OPEN_AT_ONCE", 16)
    outs = {}
    for on_write in (False, True):
        writes.clear()
        store = ConsumeQueueStore(str(tmp_path / str(on_write)), 1000 * CQ_UNIT_SIZE, open_files_limit=8)
        store.hold_bytes, store.create_on_write = 1 << 20, on_write
        before = _open_descriptors()
        for batch in _two_batches(150):
            store.dispatch(batch)
        queue_dir = tmp_path / str(on_write) / "consumequeue" / "T7" / "1"
        assert queue_dir.exists() != on_write  # made by its first write: at the end, for a rebuild
        store.close()
        assert _open_descriptors() == before
        reopened = [w for w in writes if w[0] == -1]
        if on_write:
            assert not reopened
            assert max(made_at_once) <= 16
            # in pieces as large as the set allows (8), not one by one once it is full of descriptors with
            # writes pending (301 calls)
            assert len(made_at_once) <= -(-301 // 8) + 1
        else:
            assert len(reopened) > 250  # beyond the 8 descriptors kept, each file opened again to be written
        outs[on_write] = {str(p.relative_to(tmp_path / str(on_write))): p.read_bytes()
                          for p in (tmp_path / str(on_write)).rglob("*") if p.is_file()}
    assert outs[True] == outs[False]
    assert len(outs[True]) == 301
    late = outs[True]["consumequeue/Late/0/00000000000000000000"]
    assert late[: 4 * CQ_UNIT_SIZE] == BLANK_UNIT * 3 + CQ_UNIT.pack(600 * 100, 100, 0)


def test_files_made_ahead_while_waiting_end_as_files_made_by_their_first_write(tmp_path):
    """`OpenFiles.make_ahead` (a rebuild's dispatching thread, while it waits for its read-ahead) creates files of
    `create_later` closed, a piece at a time; their first writes open them again and the files end the same."""
    outs = {}
    for ahead in (False, True):
        store = ConsumeQueueStore(str(tmp_path / str(ahead)), 1000 * CQ_UNIT_SIZE, open_files_limit=8)
        store.hold_bytes, store.create_on_write = 1 << 20, True
        before = _open_descriptors()
        pieces = []
        for batch in _two_batches(150):
            store.dispatch(batch)
            while ahead and (made := store.open_files.make_ahead(32)):
                pieces.append(made)
                assert _open_descriptors() == before  # made closed: the set's room is the writes'
        queue_dir = tmp_path / str(ahead) / "consumequeue" / "T7" / "1"
        assert queue_dir.exists() == ahead
        store.close()
        assert _open_descriptors() == before
        if ahead:
            assert sum(pieces) == 301
            assert max(pieces) == 32
        outs[ahead] = {str(p.relative_to(tmp_path / str(ahead))): p.read_bytes()
                       for p in (tmp_path / str(ahead)).rglob("*") if p.is_file()}
    assert outs[True] == outs[False]
    assert len(outs[True]) == 301
