"""Every "write all of it" goes through `indexcore.mappedfile.pwrite_all`: a write the kernel cuts short goes on
from the byte it stopped at, and a write of nothing or a failure is an OSError naming the file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from daemon.backfill.commit import MERGED, commit_queue_file
from daemon.backfill.writers import read_chain_ends, write_chain_ends
from indexcore.consumequeue import BLANK_UNIT, CQ_UNIT, CQ_UNIT_SIZE
from indexcore.mappedfile import pwrite_all
from indexcore.openfiles import OpenFiles

SHORT = 7  # bytes the patched kernel writes per call: not a multiple of any unit or column


@pytest.fixture
def short_writes(monkeypatch):
    """`os.pwrite` and `os.writev` write at most SHORT bytes a call, as a kernel may; the calls are counted."""
    real_pwrite = os.pwrite
    calls = []

    def pwrite(fd, data, position):
        calls.append(position)
        return real_pwrite(fd, memoryview(data).cast("B")[:SHORT], position)

    def writev(fd, buffers):
        first = next((memoryview(b).cast("B") for b in buffers if len(memoryview(b).cast("B"))), b"")
        return os.write(fd, first[:SHORT])

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "writev", writev)
    return calls


def test_pwrite_all_goes_on_after_a_short_write(tmp_path, short_writes):
    path = tmp_path / "f"
    path.write_bytes(bytes(100))
    data = bytes(range(1, 51))
    fd = os.open(path, os.O_RDWR)
    try:
        pwrite_all(fd, data, 20, str(path))
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(20) + data + bytes(30)
    assert short_writes == list(range(20, 70, SHORT))


def test_pwrite_all_takes_a_write_of_nothing_for_an_error_naming_the_file(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(bytes(10))
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, position: real_pwrite(fd, memoryview(data)[:0], position))
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(OSError, match=r"cannot write 4 bytes at 3 \(the kernel wrote nothing\)") as e:
            pwrite_all(fd, b"abcd", 3, str(path))
    finally:
        os.close(fd)
    assert e.value.errno == errno.EIO
    assert e.value.filename == str(path)


def test_open_files_write_goes_on_after_a_short_write(tmp_path, short_writes):
    path = str(tmp_path / "f")
    Path(path).write_bytes(bytes(64))
    files = OpenFiles(2)
    try:
        files.write(path, b"x" * 40, 10)
    finally:
        files.close()
    assert Path(path).read_bytes() == bytes(10) + b"x" * 40 + bytes(14)


def test_open_files_write_that_fails_names_its_file(tmp_path):
    path = str(tmp_path / "f")
    Path(path).write_bytes(bytes(64))
    files = OpenFiles(2)
    os.close(files.fd(path))  # the descriptor gone behind its back: the write fails
    with pytest.raises(OSError, match=r"cannot write 5 bytes at 9 \(Bad file descriptor\)") as e:
        files.write(path, b"hello", 9)
    assert e.value.errno == errno.EBADF
    assert e.value.filename == path
    files._fds.clear()


def test_the_backfill_merge_writes_every_unit_after_short_writes(tmp_path, short_writes):
    """The merge of a backfilled ConsumeQueue file into the blank head of one already there writes all of
    its units: a short `pwrite` once left the rest of a run blank while the merge reported success."""
    units = 300
    ours = b"".join(CQ_UNIT.pack(1000 + 97 * i, 97, i) for i in range(units - 5)) + BLANK_UNIT * 5
    final = tmp_path / "out" / f"{0:020d}"
    final.parent.mkdir()
    final.write_bytes(BLANK_UNIT * units)
    staged = tmp_path / "staged"
    staged.write_bytes(ours)
    assert commit_queue_file(str(staged), str(final)) == MERGED
    assert final.read_bytes() == ours
    assert len(short_writes) == -(-(units - 5) * CQ_UNIT_SIZE // SHORT)


def test_chain_ends_are_written_whole_after_short_writes(tmp_path, short_writes):
    """A chunk's chain ends survive a kernel that writes a few bytes a call (a short `writev` was retried once)."""
    path = str(tmp_path / "chunk.ends")
    columns = [np.arange(n, dtype=np.int32) * k for n, k in ((40, 3), (40, 5), (40, 7))]
    write_chain_ends(path, *columns)
    back = read_chain_ends(path)
    for name, column in zip(("first_entry", "slot", "last_entry"), columns, strict=True):
        np.testing.assert_array_equal(back[name], column)
    assert os.path.getsize(path) == 3 * 8 + 3 * 40 * 4
