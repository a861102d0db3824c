"""The DLedger CommitLog format (indexcore/dledger.py) and a DLedger data directory read as the record stream
(indexcore/dledgerlog.py), against the real 4.9.3 DLedger store in shared/ (`dledger`) and files built here."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexcore.commitlog import MessageRecord
from indexcore.dledger import (
    BLANK,
    ENTRY_HEADER_SIZE,
    INDEX_UNIT,
    CorruptEntryHeaderError,
    committed_position,
    data_dir,
    encode_blank,
    encode_entry,
    read_checkpoint,
)
from indexcore.dledgerlog import DLedgerLog
from indexcore.mappedfile import offset_to_file_name
from indexcore.reader import CommitLog, CommitLogReader, ReadStatus
from tests.conformance import conformance_roots

SEGMENT = 65536


def _dledger_store() -> Path | None:
    for root in conformance_roots():
        if (root / "dledger" / "store" / "dledger-n0" / "data").is_dir():
            return root / "dledger"
    return None


STORE = _dledger_store()
needs_store = pytest.mark.skipif(STORE is None, reason="the shared dledger conformance store is not on this machine")


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((STORE / "manifest.json").read_text())


@pytest.fixture
def store_copy(tmp_path) -> Path:
    """A writable copy of the DLedger store's dledger-n0/ (data, index, checkpoint) under a fresh root."""
    root = tmp_path / "store"
    shutil.copytree(STORE / "store" / "dledger-n0", root / "dledger-n0")
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root


def read_all(log: CommitLog) -> tuple[dict[str, np.ndarray], ReadStatus, object, int]:
    reader = CommitLogReader(log, batch_bytes=20000)
    cols: dict[str, list] = {"phy": [], "size": [], "qo": [], "ts": []}
    offset = log.min_offset
    while True:
        res = reader.read(offset)
        b = res.batch
        cols["phy"].append(b.phy_offset)
        cols["size"].append(b.msg_size)
        cols["qo"].append(b.queue_offset)
        cols["ts"].append(b.store_timestamp)
        if res.status is not ReadStatus.OK:
            reader.close()
            return {k: np.concatenate(v) for k, v in cols.items()}, res.status, res.error, res.next_offset
        offset = res.next_offset


@needs_store
def test_every_message_of_the_real_store_is_read_at_entry_pos_plus_48(manifest, store_copy):
    """The kernel reads the 3,015 entries of the real store in order: offset = dledger_pos + 48, size = the
    message's TOTALSIZE, queue offset and store time as the broker stored them; the read ends at the committed
    position, committedPos = pos + size of entry committedIndex (1,591,901)."""
    log = DLedgerLog(str(store_copy), "n0", SEGMENT)
    cols, status, error, end = read_all(log)
    msgs = manifest["messages"]
    assert status is ReadStatus.END
    assert error is None
    assert end == log.read_limit == 1591901 == msgs[-1]["dledger_pos"] + msgs[-1]["dledger_size"]
    assert cols["phy"].tolist() == [m["dledger_pos"] + ENTRY_HEADER_SIZE for m in msgs]
    assert cols["phy"].tolist() == [m["phy_offset"] for m in msgs]
    assert cols["size"].tolist() == [m["msg_size"] for m in msgs] == [m["dledger_size"] - 48 for m in msgs]
    assert cols["qo"].tolist() == [m["queue_offset"] for m in msgs]
    assert cols["ts"].tolist() == [m["store_timestamp"] for m in msgs]


@needs_store
def test_read_record_takes_the_store_offset(manifest, store_copy):
    """A query's offset is entry pos + 48: the record there is the manifest's message."""
    log = DLedgerLog(str(store_copy), "n0", SEGMENT)
    for m in manifest["messages"][::97]:
        rec = log.read_record(m["phy_offset"])
        assert (rec.topic, rec.queue_offset, rec.store_timestamp, rec.total_size) == (
            m["topic"], m["queue_offset"], m["store_timestamp"], m["msg_size"])


@needs_store
def test_committed_position_without_the_index_file_and_from_the_bak(store_copy):
    """committedPos is found through the index file or, without it, by walking the data; a missing checkpoint
    falls back to checkpoint.bak; a lower committedIndex stops the reader after that entry."""
    home = store_copy / "dledger-n0"
    full = committed_position(str(store_copy), "n0", SEGMENT)
    assert (full.position, full.committed_index) == (1591901, 3014)
    (home / "checkpoint").write_text("committedIndex=1000\nendIndex=3014\n")
    with_index = committed_position(str(store_copy), "n0", SEGMENT)
    shutil.rmtree(home / "index")
    without = committed_position(str(store_copy), "n0", SEGMENT)
    assert with_index == without
    assert without.committed_index == 1000
    log = DLedgerLog(str(store_copy), "n0", SEGMENT)
    cols, status, _, end = read_all(log)
    assert status is ReadStatus.END
    assert len(cols["phy"]) == 1001
    assert end == without.position
    (home / "checkpoint").unlink()
    assert read_checkpoint(str(home)).path.endswith("checkpoint.bak")
    assert committed_position(str(store_copy), "n0", SEGMENT).committed_index == 3014
    (home / "checkpoint.bak").unlink()
    none = committed_position(str(store_copy), "n0", SEGMENT)
    assert (none.position, none.committed_index) == (0, -1)  # getMaxOffset: nothing committed, nothing dispatched
    assert len(read_all(DLedgerLog(str(store_copy), "n0", SEGMENT))[0]["phy"]) == 0


@needs_store
@pytest.mark.parametrize(("at", "field", "value", "expect"), [
    (0, "pos", 0, "entry pos field 0 does not match the entry's offset {off}"),
    (0, "magic", 7, "entry magic field 7 is not 1"),
    (0, "body_length", 5, "entry bodyLen field 5 is not size - 48"),
])
def test_corrupt_entry_header_is_one_line_naming_file_offset_and_field(manifest, store_copy, at, field, value,
                                                                        expect):
    """A damaged entry header stops the read there with one line: the data file, the entry's offset, the field."""
    m = manifest["messages"][200]
    pos = m["dledger_pos"]
    seg = pos - pos % SEGMENT
    path = data_dir(str(store_copy), "n0") + "/" + offset_to_file_name(seg)
    fmt = {"pos": (24, ">q"), "magic": (0, ">i"), "body_length": (44, ">i")}[field]
    with open(path, "r+b") as f:
        f.seek(pos - seg + fmt[0])
        f.write(struct.pack(fmt[1], value))
    log = DLedgerLog(str(store_copy), "n0", SEGMENT)
    cols, status, error, end = read_all(log)
    assert status is ReadStatus.CORRUPT
    assert end == pos
    assert len(cols["phy"]) == 200
    assert isinstance(error, CorruptEntryHeaderError)
    assert error.field == f"entry.{field}"
    line = str(error)
    assert "\n" not in line
    assert line.startswith(f"{path} @ {pos}: ")
    assert expect.format(off=pos) in line


def _write_log(root: Path, bodies: list[bytes], *, first_file: int = 0) -> list[int]:
    """A DLedger data directory holding `bodies` as messages (each a real CommitLog record), rolled with the
    DLedger BLANK as DLedger rolls (size + 8 > bytes left); returns the entries' positions."""
    d = Path(data_dir(str(root), "n0"))
    d.mkdir(parents=True, exist_ok=True)
    files: dict[int, bytearray] = {}
    pos, out = first_file, []
    for i, body in enumerate(bodies):
        props = b"KEYS\x01k" + str(i).encode()
        rec = MessageRecord("T", 0, 0, i, 0, 0, 1, _host(), 1000 + i, _host(), 0, 0, body, props, 0)
        size = ENTRY_HEADER_SIZE + rec.total_size
        seg = pos - pos % SEGMENT
        if size + 8 > SEGMENT - (pos - seg):
            files.setdefault(seg, bytearray(SEGMENT))[pos - seg: pos - seg + 8] = encode_blank(SEGMENT - (pos - seg))
            pos = seg + SEGMENT
            seg = pos
        rec = MessageRecord(rec.topic, 0, 0, i, pos + 48, 0, 1, rec.born_host, rec.store_timestamp, rec.store_host, 0,
                            0, body, rec.properties, _crc(body))
        entry = encode_entry(i, 0, pos, rec.encode())
        files.setdefault(seg, bytearray(SEGMENT))[pos - seg: pos - seg + len(entry)] = entry
        out.append(pos)
        pos += len(entry)
    for seg, data in files.items():
        (d / offset_to_file_name(seg)).write_bytes(bytes(data))
    (d.parent / "checkpoint").write_text(f"committedIndex={len(bodies) - 1}\nendIndex={len(bodies) - 1}\n")
    return out


def _host():
    from indexcore.commitlog import Host
    return Host(bytes([192, 0, 2, 1]), 10911)


def _crc(body: bytes) -> int:
    from indexcore.commitlog import body_crc32
    return body_crc32(body)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 9000), min_size=1, max_size=40), st.integers(1, 8000))
def test_any_log_reads_every_entry_across_dledger_blanks(tmp_path_factory, sizes, batch):
    """Whatever the entry sizes and the batch size, every entry is read once, in order, at pos + 48, across the
    DLedger BLANKs ending each file, and the read ends at the committed position (the last entry's end)."""
    root = tmp_path_factory.mktemp("log")
    positions = _write_log(root, [bytes([i % 251]) * n for i, n in enumerate(sizes)])
    log = DLedgerLog(str(root), "n0", SEGMENT)
    reader = CommitLogReader(log, batch_bytes=batch)
    offset, got = 0, []
    for _ in range(10_000):
        res = reader.read(offset)
        got += res.batch.phy_offset.tolist()
        if res.status is not ReadStatus.OK:
            break
        offset = res.next_offset
    reader.close()
    assert res.status is ReadStatus.END
    assert res.error is None
    assert got == [p + 48 for p in positions]
    assert res.next_offset == log.read_limit


def test_blank_declaring_the_wrong_length_is_corrupt(tmp_path):
    """A DLedger BLANK must declare exactly the bytes left in its file (int -1 first, then the length)."""
    positions = _write_log(tmp_path, [b"x" * 30000, b"y" * 30000, b"z" * 30000])
    assert positions[2] == SEGMENT
    path = Path(data_dir(str(tmp_path), "n0")) / offset_to_file_name(0)
    data = bytearray(path.read_bytes())
    blank_at = positions[1] + ENTRY_HEADER_SIZE + MessageRecord.decode(
        bytes(data), positions[1] + 48).total_size
    assert BLANK.unpack_from(data, blank_at) == (-1, SEGMENT - blank_at)
    BLANK.pack_into(data, blank_at, -1, 12)
    path.write_bytes(bytes(data))
    _cols, status, error, end = read_all(DLedgerLog(str(tmp_path), "n0", SEGMENT))
    assert status is ReadStatus.CORRUPT
    assert end == blank_at
    assert error.field == "entry.size"
    assert f"DLedger BLANK declares 12 bytes left, {SEGMENT - blank_at} are left" in str(error)


def test_committed_index_past_the_data_is_capped_at_the_last_entry(tmp_path):
    """A committedIndex past the entries written (the data's tail zeroed, a follower behind): DLedger caps it at
    the last entry (updateCommittedIndex), and an index unit naming an entry the data no longer holds is not
    believed."""
    positions = _write_log(tmp_path, [b"a" * 100] * 5)
    path = Path(data_dir(str(tmp_path), "n0")) / offset_to_file_name(0)
    data = bytearray(path.read_bytes())
    data[positions[3]:] = bytes(len(data) - positions[3])
    path.write_bytes(bytes(data))
    log = DLedgerLog(str(tmp_path), "n0", SEGMENT)
    assert log.committed.committed_index == 2
    assert log.read_limit == positions[3]
    idx = tmp_path / "dledger-n0" / "index"
    idx.mkdir()
    (idx / offset_to_file_name(0)).write_bytes(b"".join(
        INDEX_UNIT.pack(1, p, 48 + 191, i, 0) for i, p in enumerate(positions)))
    assert DLedgerLog(str(tmp_path), "n0", SEGMENT).read_limit == positions[3]


def test_committed_entries_missing_before_the_committed_position_is_corrupt(tmp_path):
    """An entry zeroed before the committed position (data after it): corruption at the gap, not an END that
    would quietly dispatch less than the broker."""
    positions = _write_log(tmp_path, [b"a" * 100] * 5)
    path = Path(data_dir(str(tmp_path), "n0")) / offset_to_file_name(0)
    data = bytearray(path.read_bytes())
    data[positions[2]:positions[3]] = bytes(positions[3] - positions[2])
    path.write_bytes(bytes(data))
    idx = tmp_path / "dledger-n0" / "index"
    idx.mkdir()
    (idx / offset_to_file_name(0)).write_bytes(b"".join(
        INDEX_UNIT.pack(1, p, positions[1] - positions[0], i, 0) for i, p in enumerate(positions)))
    log = DLedgerLog(str(tmp_path), "n0", SEGMENT)
    assert log.read_limit == positions[4] + positions[1] - positions[0]
    cols, status, error, end = read_all(log)
    assert status is ReadStatus.CORRUPT
    assert end == positions[2]
    assert len(cols["phy"]) == 2
    assert str(path) in str(error)


def test_data_dir_missing_is_a_layout_error(tmp_path):
    from indexcore.errors import StoreLayoutError
    with pytest.raises(StoreLayoutError) as info:
        DLedgerLog(str(tmp_path), "n0", SEGMENT)
    assert os.path.join(str(tmp_path), "dledger-n0", "data") in str(info.value)


def test_a_reader_at_the_committed_position_reads_on_once_more_is_committed(tmp_path):
    """Entries appended but not committed are not read; once DLedger's checkpoint commits them (a new file
    renamed in), the next read at the old committed position goes on, into a new data file too."""
    from indexcore.writer import Message
    from tests.dledger_writer import DLedgerWriter

    w = DLedgerWriter(str(tmp_path), "n0", SEGMENT, commit_on_close=False)
    first = [w.append(Message("T", 0, bytes(5000), {"KEYS": f"k{i}"})) for i in range(20)]
    w.flush()
    w.commit(9)
    log = DLedgerLog(str(tmp_path), "n0", SEGMENT)
    reader = CommitLogReader(log)
    res = reader.read(0)
    assert res.status is ReadStatus.OK
    assert res.batch.phy_offset.tolist() == [r.phy_offset for r in first[:10]]
    end = reader.read(res.next_offset)
    assert end.status is ReadStatus.END
    assert len(end.batch) == 0
    more = [w.append(Message("T", 0, bytes(5000), {"KEYS": f"m{i}"})) for i in range(20)]
    w.flush()
    os.utime(tmp_path / "dledger-n0" / "checkpoint", ns=(0, 0))
    w.commit()
    got, offset = [], end.next_offset
    for _ in range(100):
        res = reader.read(offset)
        got += res.batch.phy_offset.tolist()
        if res.status is not ReadStatus.OK:
            break
        offset = res.next_offset
    reader.close()
    w.close()
    assert res.status is ReadStatus.END
    assert got == [r.phy_offset for r in first[10:] + more]
    assert len(log.segments) > 1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3 * SEGMENT - 1), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(1, 70000))
def test_damaged_data_never_crashes_the_decoder(tmp_path_factory, flips, batch):
    """Any bytes changed anywhere in a DLedger data file: the kernel stops with a typed error or reads on,
    never past a file, and every record it returns lies inside an entry it checked (offset = pos + 48)."""
    from indexcore.errors import StoreError

    root = tmp_path_factory.mktemp("fuzz")
    positions = _write_log(root, [bytes([i]) * (700 + 97 * i) for i in range(60)])
    files = sorted(Path(data_dir(str(root), "n0")).iterdir())
    for at, value in flips:
        path = files[min(at // SEGMENT, len(files) - 1)]
        data = bytearray(path.read_bytes())
        data[at % SEGMENT] = value
        path.write_bytes(bytes(data))
    try:
        log = DLedgerLog(str(root), "n0", SEGMENT)
    except StoreError as e:  # the committed entry itself cannot be found in the damaged data: said at once
        said = str(e)
    else:
        said = None
    if said is not None:
        assert "\n" not in said
        assert str(files[0].parent) in said
        return
    reader = CommitLogReader(log, batch_bytes=batch)
    offset, got = log.min_offset, []
    for _ in range(1000):
        res = reader.read(offset)
        got += res.batch.phy_offset.tolist()
        if res.status is not ReadStatus.OK:
            break
        offset = res.next_offset
    reader.close()
    assert res.status in (ReadStatus.END, ReadStatus.CORRUPT)
    if res.status is ReadStatus.CORRUPT:
        assert isinstance(res.error, StoreError)
        assert "\n" not in str(res.error)
    assert set(got) <= {p + 48 for p in positions}
    assert got == sorted(got)


def test_probe_at_the_committed_position_waits_for_a_commit(tmp_path):
    """Entries appended but not committed are nothing new for a tailing reader's cheap probe (it would spin
    on them); a checkpoint that commits more is."""
    from indexcore.writer import Message
    from tests.dledger_writer import DLedgerWriter

    w = DLedgerWriter(str(tmp_path), "n0", SEGMENT, commit_on_close=False)
    for i in range(6):
        w.append(Message("T", 0, bytes(100), {"KEYS": f"k{i}"}))
    w.flush()
    w.commit(2)
    log = DLedgerLog(str(tmp_path), "n0", SEGMENT)
    reader = CommitLogReader(log)
    res = reader.read(0)
    assert len(res.batch) == 3
    assert reader.read(res.next_offset).status is ReadStatus.END
    assert not reader.probe(res.next_offset)
    os.utime(tmp_path / "dledger-n0" / "checkpoint", ns=(0, 0))
    w.commit()
    assert reader.probe(res.next_offset)
    assert len(reader.read(res.next_offset).batch) == 3
    reader.close()
    w.close()
