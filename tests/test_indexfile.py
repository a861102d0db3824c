"""IndexFile (STORE_FORMAT.md §8.2–§8.5): the §16.3/§16.4/§16.6 vectors and a model-based test.

`ModelIndexFile` (tests/conftest.py) keeps entries in a list and answers queries by walking every entry
of the key's slot newest first, without the prev links; the real file is mmapped and compared with it
byte for byte.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexcore.errors import CorruptEntryError
from indexcore.indexfile import INDEX_ENTRY_SIZE, INDEX_HEADER_SIZE, IndexEntry, IndexFile, IndexHeader
from indexcore.javahash import index_key_hash
from tests.conftest import ModelIndexFile, model_index_key_hash

KEY1 = "TopicA#key1"
EMOJI = "TopicA#k\U0001f600"
T0 = 1700000000123
FOREVER = 2**63 - 1

# keys whose hashes collide fully (Aa/BB ...), share a slot, or hash to 0 (Integer.MIN_VALUE)
ALPHABET = ["Aa", "BB", "AaAa", "BBBB", "AaBB", "BBAa", "key1", "key2", "k3", "polygenelubricants", EMOJI, KEY1]
NEVER_PUT = "T#absent"


def hexb(text: str) -> bytes:
    return bytes.fromhex("".join(text.split()))


def new_file(directory: Path, name: str, slots: int, entries: int, **preset: int) -> IndexFile:
    return IndexFile(str(directory / name), slots, entries, create=True, **preset)


def put(f: IndexFile, key: str, phy: int, ts: int) -> bool:
    return f.put_key(index_key_hash(key), phy, ts)


def select(f: IndexFile, key: str, max_num: int = 32, begin: int = 0, end: int = FOREVER) -> list[int]:
    out: list[int] = []
    f.select_phy_offsets(out, index_key_hash(key), max_num, begin, end)
    return out


def expected_file(size: int, parts: dict[int, str]) -> bytes:
    buf = bytearray(size)
    for at, text in parts.items():
        data = hexb(text)
        buf[at : at + len(data)] = data
    return bytes(buf)


# --- §16.3 / §16.4 / §16.6 ----------------------------------------------------------------------------

HEADER_16_3 = "0000018bcfe5687b 0000018bcfe57f6f 0000000000000000 0000000000000131 00000002 00000003"
ENTRY_1 = "2641fa83 0000000000000000 00000000 00000000"
ENTRY_2 = "4367741d 0000000000000131 00000005 00000000"


def test_key_hashes_of_the_vectors() -> None:
    """The §6.2 hashes and slots (97) of the vector keys, by the library and by the test's own hash."""
    for key, h, slot in [(KEY1, 641858179, 61), (EMOJI, 1130853405, 51), ("polygenelubricants", 0, 0),
                         ("TopicA#\u8ba2\u5355-123", 1111418391, 54)]:
        assert index_key_hash(key) == model_index_key_hash(key) == h
        assert h % 97 == slot
    assert index_key_hash("Aa") == index_key_hash("BB")
    assert len({index_key_hash(k) for k in ("AaAa", "BBBB", "AaBB", "BBAa")}) == 1


def test_vector_16_3_two_puts(tmp_path: Path) -> None:
    """§16.3: two puts into a 97-slot, 10-entry file give exactly the 628 documented bytes."""
    f = new_file(tmp_path, "f", 97, 10)
    assert put(f, KEY1, 0, 1700000000123)
    assert put(f, EMOJI, 305, 1700000005999)
    data = (tmp_path / "f").read_bytes()
    assert len(data) == 628
    assert data == expected_file(628, {0: HEADER_16_3, 244: "00000002", 284: "00000001", 448: ENTRY_1,
                                       468: ENTRY_2})
    assert f.header == IndexHeader(1700000000123, 1700000005999, 0, 305, 2, 3)
    assert f.slot(61) == 1
    assert f.slot(51) == 2
    assert f.entry(0) == IndexEntry(0, 0, 0, 0)
    assert f.entry(2) == IndexEntry(1130853405, 305, 5, 0)
    f.close()


def test_vector_16_4_chain_queries_and_fill(tmp_path: Path) -> None:
    """§16.4: a third put chains to entry 1; the documented queries, isTimeMatched and the fill rule hold."""
    f = new_file(tmp_path, "f", 97, 10)
    put(f, KEY1, 0, 1700000000123)
    put(f, EMOJI, 305, 1700000005999)
    assert put(f, KEY1, 610, 1700000010500)
    data = (tmp_path / "f").read_bytes()
    assert data == expected_file(628, {
        0: "0000018bcfe5687b 0000018bcfe59104 0000000000000000 0000000000000262 00000002 00000004",
        244: "00000002", 284: "00000003", 448: ENTRY_1, 468: ENTRY_2,
        488: "2641fa83 0000000000000262 0000000a 00000001"})
    assert select(f, KEY1) == [610, 0]
    assert select(f, KEY1, begin=1700000005000) == [610]
    assert select(f, KEY1, max_num=1) == [610]
    assert select(f, EMOJI) == [305]
    assert not f.is_time_matched(0, 1700000000000)
    assert f.is_time_matched(1700000000123, 1700000000123)
    for i in range(4, 10):
        assert put(f, f"k{i}", 1000 * i, 1700000010500)
    assert f.index_count == 10
    assert f.is_write_full()
    before = (tmp_path / "f").read_bytes()
    assert not put(f, KEY1, 99999, 1700000020000)
    assert f.put_keys(np.array([1, 2]), np.array([5, 6]), np.array([7, 8])) == 0
    assert f.index_count == 10
    assert (tmp_path / "f").read_bytes() == before
    f.close()


HEADER_16_6_NEW = "0000018bcfe56800 0000018bcfe56800 00000000000003e8 00000000000003e8 00000000 00000000"


def test_vector_16_6_new_file_from_full_predecessor(tmp_path: Path) -> None:
    """§16.6: the pre-set header before any put, the first-entry quirk after one, and the two windows."""
    f = new_file(tmp_path, "f", 97, 10, end_phy_offset=1000, end_timestamp=1700000000000)
    assert (tmp_path / "f").read_bytes() == expected_file(628, {0: HEADER_16_6_NEW})
    assert put(f, KEY1, 1200, 1700000003000)
    assert (tmp_path / "f").read_bytes() == expected_file(628, {
        0: "0000018bcfe573b8 0000018bcfe573b8 00000000000004b0 00000000000004b0 00000001 00000002",
        284: "00000001", 448: "2641fa83 00000000000004b0 00000003 00000000"})
    assert select(f, KEY1, begin=1700000003000, end=1700000003999) == []
    assert select(f, KEY1, begin=1700000006000, end=1700000006000) == [1200]
    f.close()


def test_vector_16_6_flush_before_first_put(tmp_path: Path) -> None:
    """§16.6/§8.2: flush() writes the in-memory header, so indexCount reads 1 in a flushed new file."""
    f = new_file(tmp_path, "f", 97, 10, end_phy_offset=1000, end_timestamp=1700000000000)
    f.flush()
    assert (tmp_path / "f").read_bytes()[:INDEX_HEADER_SIZE] == hexb(HEADER_16_6_NEW[:-8] + "00000001")
    f.close()
    again = IndexFile(str(tmp_path / "f"), 97, 10)
    assert again.header == IndexHeader(1700000000000, 1700000000000, 1000, 1000, 0, 1)
    again.close()


def test_reopened_new_file_counts_from_one(tmp_path: Path) -> None:
    """§8.2: an on-disk indexCount of 0 loads as 1, and the first put after reopening is entry 1."""
    new_file(tmp_path, "f", 97, 10).close()
    f = IndexFile(str(tmp_path / "f"), 97, 10)
    assert f.index_count == 1
    assert put(f, KEY1, 0, 1700000000123)
    assert f.entry(1) == IndexEntry(641858179, 0, 0, 0)
    f.close()


def test_collisions_return_every_candidate(tmp_path: Path) -> None:
    """Only the 32-bit hash is compared (§8.5, #3613): "Aa" finds "BB" entries too, newest first."""
    f = new_file(tmp_path, "f", 7, 50)
    for i, key in enumerate(["Aa", "BB", "x", "Aa", "AaAa", "BBBB"]):
        put(f, key, 100 * i, T0 + 1000 * i)
    assert select(f, "Aa") == select(f, "BB") == [300, 100, 0]
    assert select(f, "BBAa") == [500, 400]
    assert select(f, "x") == [200]
    f.close()


def test_capacity_is_index_num_minus_one(tmp_path: Path) -> None:
    """A put_keys of more keys than fit puts index_num - 1 of them and stops; index_count stops at index_num."""
    f = new_file(tmp_path, "f", 7, 50)
    n = 60
    assert f.put_keys(np.arange(n) * 7919, np.arange(n) * 10, np.full(n, T0)) == 49
    assert f.index_count == 50
    assert f.is_write_full()
    assert f.room == 0
    f.close()


# --- model-based test -----------------------------------------------------------------------------------


def next_timestamp(rng: random.Random, ts: int) -> int:
    """Mostly non-decreasing store times with random gaps; rarely a jump past the int32 seconds clamp
    or a step back (store clocks do that)."""
    r = rng.random()
    if r < 0.02:
        return ts + (2**31 + rng.randint(0, 10)) * 1000
    if r < 0.05:
        return ts - rng.randint(1, 3000)
    return ts + rng.choice([0, 0, rng.randint(1, 999), rng.randint(1000, 9000), rng.randint(0, 300_000)])


def query_windows(rng: random.Random, times: list[int]) -> list[tuple[int, int]]:
    points = [0, 1, FOREVER, *rng.sample(times, min(4, len(times)))]
    points += [t + d for t in rng.sample(times, min(4, len(times))) for d in (-1500, -1, 1, 999, 1000)]
    out = [(0, FOREVER)]
    for _ in range(12):
        a, b = rng.choice(points), rng.choice(points)
        out.append((min(a, b), max(a, b)))
    out.append((max(times), min(times)))  # an empty window
    return out


def assert_file_matches(f: IndexFile, model: ModelIndexFile, path: Path, rng: random.Random, times: list[int],
                        msg: str) -> None:
    assert path.read_bytes() == model.to_bytes(), msg
    h = f.header
    assert (h.begin_timestamp, h.end_timestamp, h.begin_phy_offset, h.end_phy_offset, h.hash_slot_count,
            h.index_count) == (model.begin_timestamp, model.end_timestamp, model.begin_phy_offset,
                               model.end_phy_offset, model.hash_slot_count, model.index_count), msg
    assert f.is_write_full() == model.is_write_full(), msg
    if not times:
        return
    for begin, end in query_windows(rng, times):
        assert f.is_time_matched(begin, end) == model.is_time_matched(begin, end), f"{msg} window {begin}..{end}"
        for key in [*rng.sample(ALPHABET, 4), NEVER_PUT]:
            max_num = rng.choice([1, 2, 3, 64, rng.randint(1, 60)])
            prefill = [-1] * rng.choice([0, 0, 1, 2])
            got, want = list(prefill), list(prefill)
            f.select_phy_offsets(got, index_key_hash(key), max_num, begin, end)
            model.select(want, model_index_key_hash(key), max_num, begin, end)
            assert got == want, f"{msg} select({key!r}, max_num={max_num}, {begin}, {end}, prefill={len(prefill)})"


@pytest.mark.parametrize("seed", range(60))
def test_random_puts_and_queries_match_model(tmp_path: Path, seed: int) -> None:
    """Random keys (full collisions, shared slots, hash 0), rising offsets and store times, until and past
    full; every header, byte and query matches ModelIndexFile, also after reopening."""
    rng = random.Random(seed)
    slots, entries = rng.choice([(7, 50), (7, 20), (3, 12), (1, 6), (13, 40)])
    preset = rng.choice([{}, {"end_phy_offset": 5000, "end_timestamp": T0 - rng.randint(0, 20_000)}])
    path = tmp_path / "idx"
    f = new_file(tmp_path, "idx", slots, entries, **preset)
    model = ModelIndexFile(slots, entries, **preset)
    msg = f"seed={seed} slots={slots} entries={entries} preset={preset}"
    phy, ts, times = preset.get("end_phy_offset", 0), T0, []
    assert_file_matches(f, model, path, rng, times, msg)
    while not model.is_write_full() or rng.random() < 0.5:
        keys, phys, tss = [], [], []
        for _ in range(rng.choice([1, 1, rng.randint(1, 5), rng.randint(1, 30)])):
            keys.append(rng.choice(ALPHABET))
            if rng.random() < 0.6:  # the next message; otherwise another key of the same message
                phy += rng.randint(1, 5000)
                ts = next_timestamp(rng, ts)
            phys.append(phy)
            tss.append(ts)
        want = sum(model.put(model_index_key_hash(k), p, t) for k, p, t in zip(keys, phys, tss, strict=True))
        if len(keys) == 1 and rng.random() < 0.5:
            got = int(put(f, keys[0], phys[0], tss[0]))
        else:
            got = f.put_keys(np.array([index_key_hash(k) for k in keys]), np.array(phys), np.array(tss))
        assert got == want, msg
        times = [model.begin_timestamp + e[2] * 1000 for e in model.entries[1:]] + tss
        assert_file_matches(f, model, path, rng, times, msg)
        if rng.random() < 0.15:
            f.close()
            readonly = rng.random() < 0.3
            f = IndexFile(str(path), slots, entries, readonly=readonly)
            assert_file_matches(f, model, path, rng, times, f"{msg} reopened readonly={readonly}")
            if readonly:
                f.close()
                f = IndexFile(str(path), slots, entries)
    assert f.index_count == entries
    assert len(model.entries) - 1 == entries - 1
    f.close()


# --- put_keys == put_key ------------------------------------------------------------------------------

put_plans = st.lists(
    st.tuples(st.sampled_from(ALPHABET), st.integers(0, 3000), st.integers(-2000, 200_000)), min_size=0, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=put_plans,
    cuts=st.lists(st.integers(1, 12), min_size=1, max_size=40),
    geometry=st.sampled_from([(7, 50), (3, 10), (1, 4), (97, 30)]),
    preset=st.sampled_from([(0, 0), (1000, 1700000000000), (0, 1700000000000)]),
)
def test_put_keys_equals_put_key_one_by_one(plan, cuts, geometry, preset) -> None:
    """N keys through put_keys in any chunking give the same bytes and counts as N put_key calls (and the model)."""
    slots, entries = geometry
    end_phy, end_ts = preset
    hashes = [index_key_hash(k) for k, _, _ in plan]
    phys = np.cumsum([1 + step for _, step, _ in plan], dtype=np.int64) + end_phy
    tss = T0 + np.cumsum([d for _, _, d in plan], dtype=np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        one = new_file(d, "one", slots, entries, end_phy_offset=end_phy, end_timestamp=end_ts)
        many = new_file(d, "many", slots, entries, end_phy_offset=end_phy, end_timestamp=end_ts)
        model = ModelIndexFile(slots, entries, end_phy, end_ts)
        singles = [one.put_key(h, int(p), int(t)) for h, p, t in zip(hashes, phys, tss, strict=True)]
        modelled = [model.put(h, int(p), int(t)) for h, p, t in zip(hashes, phys, tss, strict=True)]
        assert singles == modelled
        i, put_total = 0, 0
        for cut in cuts:
            if i >= len(plan):
                break
            put_total += many.put_keys(np.array(hashes[i : i + cut], dtype=np.int32), phys[i : i + cut],
                                       tss[i : i + cut])
            i += cut
        if i < len(plan):
            put_total += many.put_keys(np.array(hashes[i:], dtype=np.int32), phys[i:], tss[i:])
        assert put_total == sum(singles)
        assert one.header == many.header
        one.close()
        many.close()
        assert (d / "one").read_bytes() == (d / "many").read_bytes() == model.to_bytes()


def test_entry_offsets_are_layout_arithmetic(tmp_path: Path) -> None:
    """Entry n sits at 40 + 4*hash_slot_num + 20*n: the raw bytes there decode to entry(n)."""
    f = new_file(tmp_path, "f", 7, 10)
    put(f, "Aa", 11, T0)
    put(f, "BB", 22, T0 + 2500)
    data = (tmp_path / "f").read_bytes()
    for n in (1, 2):
        at = INDEX_HEADER_SIZE + 4 * 7 + INDEX_ENTRY_SIZE * n
        assert IndexEntry.decode(data, at) == f.entry(n)
    assert f.entry(2) == IndexEntry(2112, 22, 2, 1)
    f.close()


# --- damaged chains (issue 32): a walk is bounded by indexCount and reports what it met ---------------------

PREV_AT = 16  # prev_index inside an entry
TIME_DIFF_AT = 12


def chained(tmp_path: Path, n: int = 8) -> tuple[IndexFile, int]:
    """One slot's chain of `n` entries of KEY1 (1 <- 2 <- ... <- n) in a file of 4 slots and 32 entries."""
    f = new_file(tmp_path, "damaged", 4, 32)
    for i in range(n):
        assert put(f, KEY1, 1000 * (i + 1), T0 + 1000 * i)
    return f, index_key_hash(KEY1) % 4


def patch_entry(f: IndexFile, n: int, at: int, value: int) -> None:
    f._file.write(INDEX_HEADER_SIZE + 4 * f.hash_slot_num + INDEX_ENTRY_SIZE * n + at, value.to_bytes(4, "big",
                                                                                                       signed=True))


def select_damaged(f: IndexFile, newest: bool = False) -> tuple[list[int], CorruptEntryError | None]:
    out: list[int] = []
    try:
        f.select_phy_offsets(out, index_key_hash(KEY1), 32, 0, FOREVER, newest=newest)
    except CorruptEntryError as e:
        return out, e
    return out, None


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_prev_index_cycle_is_reported_after_the_entries_before_it(tmp_path: Path, k: int) -> None:
    """Entry 8-k+1 links back up to 8: entries 8 .. 8-k+1 are returned, then the cycle is named."""
    f, _ = chained(tmp_path)
    patch_entry(f, 8 - k + 1, PREV_AT, 8)
    out, error = select_damaged(f)
    f.close()
    assert out == [1000 * n for n in range(8, 8 - k, -1)]
    assert (error.path, error.entry, error.field) == (str(tmp_path / "damaged"), f"entry {8 - k + 1}", "prev_index")
    assert f"a cycle of {k}" in str(error)


@pytest.mark.parametrize(("at", "value", "entry", "field"), [
    (PREV_AT, 5, "entry 5", "prev_index"),  # a self-loop, which the broker's walk stops at silently
    (PREV_AT, 30, "entry 5", "prev_index"),  # past indexCount 9
    (PREV_AT, 2**31 - 1, "entry 5", "prev_index"),  # past the file
    (PREV_AT, -3, "entry 5", "prev_index"),
    (TIME_DIFF_AT, -1, "entry 5", "time_diff"),
], ids=["self-loop", "past-count", "past-file", "negative-link", "negative-time-diff"])
def test_bad_link_or_time_diff_names_entry_and_field(tmp_path: Path, at: int, value: int, entry: str,
                                                     field: str) -> None:
    f, _ = chained(tmp_path)
    patch_entry(f, 5, at, value)
    out, error = select_damaged(f)
    f.close()
    assert (error.entry, error.field) == (entry, field)
    assert out == ([8000, 7000, 6000, 5000] if field == "prev_index" else [8000, 7000, 6000])


@pytest.mark.parametrize("value", [-1, 12, 2**31 - 1], ids=["negative", "past-count", "past-file"])
def test_bad_slot_is_reported(tmp_path: Path, value: int) -> None:
    f, slot = chained(tmp_path)
    f._file.write(INDEX_HEADER_SIZE + 4 * slot, value.to_bytes(4, "big", signed=True))
    out, error = select_damaged(f)
    f.close()
    assert (out, error.entry, error.field) == ([], f"slot {slot}", "slot")


def test_newest_file_passes_over_a_put_in_progress(tmp_path: Path) -> None:
    """A live writer puts entries and slots before the header: in the newest file a slot past indexCount
    leads through uncounted entries to the counted chain, which is answered whole."""
    f, slot = chained(tmp_path)
    patch_entry(f, 12, 0, index_key_hash(KEY1))
    patch_entry(f, 12, PREV_AT, 8)
    f._file.write(INDEX_HEADER_SIZE + 4 * slot, (12).to_bytes(4, "big"))
    out, error = select_damaged(f, newest=True)
    f.close()
    assert error is None
    assert out == [1000 * n for n in range(8, 0, -1)]
