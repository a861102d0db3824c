"""indexcore/dledgerwriter.py lays DLedger entries out as DLedger 0.2.3's appendAsLeader does: the messages of the
real 4.9.3 DLedger store in shared/ (`dledger`), appended again in order, give its data files and index units byte
for byte (BLANKs, file rolls and PHYSICALOFFSET = pos + 48 included); `truncate_to` then appending is a follower's
truncate, and a plain CommitLog's records copy over."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from indexcore.dledger import ENTRY_HEADER, ENTRY_HEADER_SIZE, ENTRY_MAGIC
from indexcore.dledgerwriter import DLedgerLogWriter, commitlog_records, copy_commitlog
from indexcore.writer import CommitLogWriter, Message
from tests.conformance import conformance_roots

SEGMENT = 65536


def _store() -> Path | None:
    for root in conformance_roots():
        if (root / "dledger" / "store" / "dledger-n0" / "data").is_dir():
            return root / "dledger" / "store" / "dledger-n0"
    return None


STORE = _store()
needs_store = pytest.mark.skipif(STORE is None, reason="the shared dledger conformance store is not on this machine")


def real_entries(home: Path) -> list[tuple[int, bytes]]:
    """(term, message bytes) of every entry of a real DLedger log, in order."""
    out = []
    for name in sorted(os.listdir(home / "data")):
        data = (home / "data" / name).read_bytes()
        at = 0
        while at + ENTRY_HEADER_SIZE <= len(data):
            magic, size, _index, term, *_ = ENTRY_HEADER.unpack_from(data, at)
            if magic != ENTRY_MAGIC:
                break
            out.append((term, data[at + ENTRY_HEADER_SIZE : at + size]))
            at += size
    return out


@needs_store
def test_the_real_stores_messages_appended_again_give_its_files_byte_for_byte(tmp_path):
    entries = real_entries(STORE)
    writer = DLedgerLogWriter(str(tmp_path), SEGMENT)
    for term, body in entries:
        writer.append(body, term)
    names = sorted(os.listdir(STORE / "data"))
    assert sorted(os.listdir(tmp_path / "data")) == names
    assert [n for n in names if (STORE / "data" / n).read_bytes() != (tmp_path / "data" / n).read_bytes()] == []
    real_index = (STORE / "index" / names[0]).read_bytes()  # stored cut to its written part
    ours = (tmp_path / "index" / names[0]).read_bytes()
    assert ours[: len(real_index)] == real_index
    assert not any(ours[len(real_index) :])
    assert len(ours) == 167_772_160


@needs_store
def test_truncate_to_then_append_is_what_a_follower_holds(tmp_path):
    """Cut after entry 100 and appended again: the same files as the log written once."""
    entries = real_entries(STORE)[:300]
    once, twice = tmp_path / "once", tmp_path / "twice"
    w = DLedgerLogWriter(str(once), SEGMENT)
    positions = [w.append(body, term)[1] for term, body in entries]
    w = DLedgerLogWriter(str(twice), SEGMENT)
    for term, body in entries:
        w.append(body, term)
    w.truncate_to(100, positions[100])
    for term, body in entries[100:]:
        w.append(body, term)
    for sub in ("data", "index"):
        for name in sorted(os.listdir(once / sub)):
            assert (once / sub / name).read_bytes() == (twice / sub / name).read_bytes(), f"{sub}/{name}"


def test_a_plain_commitlogs_records_copy_over_with_their_offsets_moved(tmp_path):
    """A message's PHYSICALOFFSET becomes its entry's pos + 48; the rest of its bytes are the plain record's."""
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 7))
    plain = CommitLogWriter(str(tmp_path / "plain"), 4096, clock=lambda: next(clock))
    for i in range(120):
        plain.append(Message("T", i % 2, bytes(90 + i % 60), {"KEYS": f"k{i}"}))
    plain.close()
    records = list(commitlog_records(str(tmp_path / "plain"), 4096))
    assert len(records) == 120
    writer = DLedgerLogWriter(str(tmp_path / "dledger"), 4096)
    for record in records:
        index, pos = writer.append(record, 0)
        with open(tmp_path / "dledger" / "data" / f"{pos - pos % 4096:020d}", "rb") as f:
            body = os.pread(f.fileno(), len(record), pos % 4096 + ENTRY_HEADER_SIZE)
        assert int.from_bytes(body[28:36], "big") == pos + ENTRY_HEADER_SIZE
        assert body[:28] + body[36:] == record[:28] + record[36:]
        assert index == records.index(record)


def test_copy_commitlog_in_one_pass_writes_what_append_writes(tmp_path):
    """The benchmark's converter: the same data files, index units and checkpoint as entry-by-entry appends."""
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 7))
    plain = CommitLogWriter(str(tmp_path / "plain"), 8192, clock=lambda: next(clock))
    for i in range(400):
        plain.append(Message(f"T{i % 3}", i % 4, bytes([i % 7]) * (30 + i % 200), {"KEYS": f"k{i} x", "TAGS": "a"}))
    plain.close()
    entries = copy_commitlog(str(tmp_path / "plain"), 8192, str(tmp_path / "bulk"))
    writer = DLedgerLogWriter(str(tmp_path / "one"), 8192)
    for record in commitlog_records(str(tmp_path / "plain"), 8192):
        writer.append(record, 0)
    assert entries == writer.next_index == 400
    for sub in ("data", "index"):
        names = sorted(os.listdir(tmp_path / "one" / sub))
        assert sorted(os.listdir(tmp_path / "bulk" / sub)) == names
        for name in names:
            assert (tmp_path / "bulk" / sub / name).read_bytes() == (tmp_path / "one" / sub / name).read_bytes()
    assert (tmp_path / "bulk" / "checkpoint").read_text() == "committedIndex=399\nendIndex=399\n"
