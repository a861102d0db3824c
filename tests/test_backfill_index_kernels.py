"""The backfill's IndexFile kernels (indexcore._kernels): a decode window's key records (`key_records`), a chunk's
put from them (`put_key_records`) and the chunks' linking (`link_chains`) against what they replace: the numpy
records the decode made before, and one sequential `put_keys` of all the keys (the broker's putKey loop)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.backfill.ranges import NO_CREATOR
from daemon.backfill.stage import KEY_DTYPE
from daemon.backfill.writers import read_chain_ends, write_chain_ends
from indexcore import _kernels
from indexcore.indexfile import FIRST_INDEX, HASH_SLOT_SIZE, INDEX_ENTRY_SIZE, INDEX_HEADER_SIZE, index_file_size


def numpy_key_records(key_hash, key_owner, selected, phy, ts):
    """The decode's key records as ranges.RangeRows built them with numpy before the kernel."""
    picked = selected[key_owner]
    hashes, owners = key_hash[picked], key_owner[picked]
    n, k = len(phy), len(hashes)
    run = np.empty(k, dtype=KEY_DTYPE)
    if not k:
        return run, False
    last_of_owner = np.ones(k, dtype=bool)
    last_of_owner[:-1] = owners[1:] != owners[:-1]
    following = np.minimum(owners + 1, n - 1)
    run["hash"], run["phy"], run["ts"] = hashes, phy[owners], ts[owners]
    run["creator"] = np.where(last_of_owner, ts[following], ts[owners])
    last_is_last = int(owners[-1]) == n - 1
    if last_is_last:
        run["creator"][-1] = NO_CREATOR
    return run, last_is_last


@st.composite
def windows(draw):
    n = draw(st.integers(1, 30))
    keys_per_record = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    owner = np.repeat(np.arange(n, dtype=np.int64), keys_per_record)
    key_hash = np.array(draw(st.lists(st.integers(0, 2**31 - 1), min_size=len(owner), max_size=len(owner))),
                        dtype=np.int64)
    selected = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    ts = np.cumsum(np.array(draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n)), dtype=np.int64)) + 10**12
    phy = np.arange(n, dtype=np.int64) * 300 + 7
    return key_hash, owner, selected, phy, ts


@settings(max_examples=300, deadline=None)
@given(windows())
def test_key_records_are_the_numpy_records(window) -> None:
    expected, expected_last = numpy_key_records(*window)
    out = np.zeros(len(window[0]) + 1, dtype=KEY_DTYPE)
    k, last_is_last = _kernels.key_records(out, *window)
    assert k == len(expected)
    assert out[:k].tobytes() == expected.tobytes()
    assert (last_is_last if k else False) == expected_last


def test_key_records_refuses_an_owner_outside_the_window() -> None:
    out = np.zeros(1, dtype=KEY_DTYPE)
    with pytest.raises(ValueError, match="owner 3 is not a record"):
        _kernels.key_records(out, np.array([5], np.int64), np.array([3], np.int64), np.ones(2, bool),
                             np.zeros(2, np.int64), np.zeros(2, np.int64))


def sequential_file(records: np.ndarray, slot_num: int, index_num: int, first: int, begin_ts: int,
                    begin_phy: int) -> tuple[bytes, tuple]:
    """The file one put_keys of keys [first, ...) makes (`first` > 0: the file's keys before them are not
    there, as for a chunk, and its slots are empty)."""
    buf = bytearray(index_file_size(slot_num, index_num))
    entries_at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * slot_num
    out = _kernels.put_keys(buf, entries_at, slot_num, FIRST_INDEX + first, index_num, begin_ts, begin_phy,
                            records["hash"].astype(np.int64), records["phy"].astype(np.int64),
                            records["ts"].astype(np.int64))
    return bytes(buf), out


@st.composite
def files(draw):
    slot_num = draw(st.integers(1, 12))
    k = draw(st.integers(1, 60))
    records = np.zeros(k, dtype=KEY_DTYPE)
    records["hash"] = draw(st.lists(st.integers(0, 2**31 - 1), min_size=k, max_size=k))
    records["phy"] = np.arange(k) * 100 + 40
    records["ts"] = np.cumsum(draw(st.lists(st.integers(0, 3_000_000), min_size=k, max_size=k))) + 10**12
    cuts = sorted(set(draw(st.lists(st.integers(1, k - 1), max_size=5)) if k > 1 else []))
    seeded = draw(st.booleans())
    return slot_num, records, [0, *cuts, k], seeded, draw(st.integers(1, 8))


@settings(max_examples=300, deadline=None)
@given(files())
def test_chunks_put_from_records_and_linked_are_one_sequential_put(case) -> None:
    slot_num, records, cuts, seeded, piece = case
    index_num = len(records) + 3
    begin = (10**12 - 5000, 17) if seeded else (0, 0)
    expected, (count, _, begin_ts, begin_phy) = sequential_file(records, slot_num, index_num, 0, *begin)
    entries_at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * slot_num
    file = bytearray(index_file_size(slot_num, index_num))
    last = np.zeros(slot_num, dtype=np.int32)
    file_begin = begin
    for lo, hi in itertools.pairwise(cuts):
        slots = np.zeros(slot_num, dtype=np.int32)
        # as write_index_chunk: room for one chain start per slot the chunk uses, the keys put a piece at a time
        room = min(hi - lo, slot_num)
        first_entry, first_slot = np.zeros(room, np.int32), np.zeros(room, np.int32)
        entries = np.zeros(INDEX_ENTRY_SIZE * (hi - lo), np.uint8)
        chunk_begin = file_begin if lo == 0 else (int(records["ts"][0]), int(records["phy"][0]))
        end, firsts = FIRST_INDEX + lo, 0
        for at in range(lo, hi, piece):
            part = records[at : min(at + piece, hi)]
            end, firsts, *chunk_begin = _kernels.put_key_records(
                slots, entries[INDEX_ENTRY_SIZE * (at - lo) :], part, end, index_num, *chunk_begin,
                first_entry, first_slot, firsts)
        assert end == FIRST_INDEX + hi
        if lo == 0:
            file_begin = tuple(chunk_begin)
        at = entries_at + INDEX_ENTRY_SIZE * (FIRST_INDEX + lo)
        file[at : at + len(entries)] = entries.tobytes()
        used = first_slot[:firsts]
        assert sorted(used.tolist()) == np.flatnonzero(slots).tolist()  # every slot used, once
        _kernels.link_chains(file, entries_at, index_num, last, first_entry[:firsts], used, slots[used])
    file[INDEX_HEADER_SIZE:entries_at] = last.astype(">i4").tobytes()
    assert bytes(file[INDEX_HEADER_SIZE:]) == expected[INDEX_HEADER_SIZE:]
    assert (count, file_begin) == (FIRST_INDEX + len(records), (begin_ts, begin_phy))


def test_put_key_records_refuses_a_negative_hash_and_keys_past_the_file() -> None:
    slots, first_entry, first_slot = np.zeros(4, np.int32), np.zeros(2, np.int32), np.zeros(2, np.int32)
    records = np.zeros(2, dtype=KEY_DTYPE)
    records["hash"] = [3, -1]
    entries = np.zeros(2 * INDEX_ENTRY_SIZE, np.uint8)
    with pytest.raises(ValueError, match="negative key hash in record 1"):
        _kernels.put_key_records(slots, entries, records, 1, 10, 0, 0, first_entry, first_slot, 0)
    records["hash"] = [3, 4]
    with pytest.raises(ValueError, match="do not fit"):
        _kernels.put_key_records(slots, entries, records, 9, 10, 0, 0, first_entry, first_slot, 0)
    with pytest.raises(ValueError, match="do not fit"):  # no room for the chains' first entries
        _kernels.put_key_records(slots, entries, records, 1, 10, 0, 0, first_entry, first_slot, 1)
    assert not slots.any()
    assert not entries.any()


def test_put_key_records_refuses_a_table_with_more_empty_slots_than_firsts_says() -> None:
    """The room for the chains' first entries is min(keys, slots) of the chunk: a call whose `firsts` does not
    count its table's used slots is stopped at the room's end, never written past it."""
    slots, first_entry, first_slot = np.zeros(4, np.int32), np.zeros(4, np.int32), np.zeros(4, np.int32)
    records = np.zeros(2, dtype=KEY_DTYPE)
    records["hash"] = [1, 2]
    entries = np.zeros(2 * INDEX_ENTRY_SIZE, np.uint8)
    with pytest.raises(ValueError, match="first_entry is full"):
        _kernels.put_key_records(slots, entries, records, 1, 10, 0, 0, first_entry, first_slot, 3)
    assert first_entry.tolist() == [0, 0, 0, 1]


def test_link_chains_refuses_an_entry_or_slot_outside_the_file() -> None:
    file = bytearray(index_file_size(4, 8))
    last = np.zeros(4, np.int32)
    for entry, slot in ((8, 0), (0, 0), (1, 4), (1, -1)):
        with pytest.raises(ValueError, match="out of bounds"):
            _kernels.link_chains(file, INDEX_HEADER_SIZE + 16, 8, last, np.array([entry], np.int32),
                                 np.array([slot], np.int32), np.array([1], np.int32))
    assert not any(file)
    assert not last.any()


@pytest.mark.parametrize("n", [0, 1, 1000])
def test_chain_ends_read_back_as_written(tmp_path, n):
    rng = np.random.default_rng(n)
    columns = [rng.integers(0, 2**31 - 1, n, dtype=np.int64) for _ in range(3)]
    path = str(tmp_path / "chunk.ends")
    write_chain_ends(path, *columns)
    got = read_chain_ends(path)
    assert list(got) == ["first_entry", "slot", "last_entry"]
    for column, want in zip(got.values(), columns, strict=True):
        assert column.dtype == np.int32
        assert column.tolist() == want.tolist()
    if n:
        with open(path, "r+b") as f:
            f.truncate(24 + 4 * (3 * n - 1))
        with pytest.raises(ValueError, match=f"{path}: {3 * n - 1} of {3 * n} chain ends"):
            read_chain_ends(path)
