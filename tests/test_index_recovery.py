"""Putting the index back to a checkpoint after a kill (IndexService.state / truncate_to), resuming from a
checkpoint's offset or from the files alone down to the key (IndexResume), and the header sanity check at load.

A kill leaves the files as the page cache had them: every put made after the checkpoint, maybe one cut
short. `truncate_to(state)` must give the bytes of a run that stopped at the checkpoint, so that
dispatching again from there ends with the files of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexcore.errors import StoreLayoutError
from indexcore.indexfile import INDEX_HEADER_SIZE, IndexFile
from indexcore.indexservice import IndexQueryDamaged, IndexResume, IndexService, IndexState, index_file_name
from tests.conformance import discover
from tests.conftest import DispatchRec, make_dispatch_batch, model_index_key_hash

T0 = 1700000000123
FOREVER = 2**63 - 1
NOT, PREPARED, COMMIT, ROLLBACK = 0x0, 0x4, 0x8, 0xC
KEYS = ["Aa", "BB", "AaAa", "BBBB", "k1", "k2", "hot", "\u8ba2\u5355", "e\U0001f600"]  # Aa/BB... collide fully
TOPICS = ["T", "Topic2"]
HEADER = struct.Struct(">qqqqii")
BIG_BATCH = 10_000  # max_msgs_num_batch: queries return every candidate


def rec(phy: int, ts: int, keys: str | None = None, uniq: str | None = None, flag: int = NOT) -> DispatchRec:
    return DispatchRec(phy_offset=phy, msg_size=100, topic="T", sys_flag=flag, store_timestamp=ts, keys=keys,
                       uniq_key=uniq)


def disk_files(root: Path) -> dict[str, bytes]:
    directory = root / "index"
    if not directory.exists():
        return {}
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def raw_header(root: Path, name: str) -> tuple[int, ...]:
    return HEADER.unpack_from((root / "index" / name).read_bytes())


def run(root: Path, batches: list[list[DispatchRec]], slots: int, entries: int) -> IndexService:
    service = IndexService(str(root), slots, entries, BIG_BATCH)
    service.load()
    for batch in batches:
        service.build_index(make_dispatch_batch(batch))
    return service


def straight(root: Path, batches: list[list[DispatchRec]], slots: int, entries: int) -> dict[str, bytes]:
    """The files of an uninterrupted run, closed as the daemon closes it."""
    run(root, batches, slots, entries).close()
    return disk_files(root)


def via_json(state: IndexState | None) -> IndexState | None:
    """The state as the daemon's checkpoint file carries it."""
    return None if state is None else IndexState.from_dict(json.loads(json.dumps(state.as_dict())))


def recover(root: Path, state: IndexState | None, slots: int, entries: int):
    service = IndexService(str(root), slots, entries, BIG_BATCH)
    report = service.truncate_to(via_json(state))
    return service, report


def cut_short_put(service: IndexService, n: int, slots_written: np.ndarray) -> None:
    """Kill inside put_keys: `n` entries written past the count, only the slots picked by `slots_written`
    updated, the header not rewritten. Closes the service (a close adds no bytes a kill would not leave)."""
    f = service.last_file
    n = min(n, f.room)
    path = Path(f.path)
    before = path.read_bytes()
    if n:
        hashes = np.array([model_index_key_hash(f"T#{KEYS[i % len(KEYS)]}") for i in range(n)])
        phys = f.end_phy_offset + 1 + np.arange(n) * 7
        f.put_keys(hashes, phys, np.full(n, f.end_timestamp + 1))
    service.close()
    data = bytearray(path.read_bytes())
    data[:INDEX_HEADER_SIZE] = before[:INDEX_HEADER_SIZE]
    for s in np.flatnonzero(~slots_written[: f.hash_slot_num]):
        at = INDEX_HEADER_SIZE + 4 * int(s)
        data[at : at + 4] = before[at : at + 4]
    path.write_bytes(bytes(data))


# --- property: state, more dispatch, kill, truncate, replay == uninterrupted --------------------------------

records = st.lists(
    st.tuples(
        st.sampled_from(TOPICS),
        st.sampled_from([None, None, None, None, "uniq", *KEYS]),
        st.one_of(st.just([]), st.lists(st.sampled_from(KEYS), max_size=4)),  # keyless records roll files
        st.sampled_from([NOT] * 5 + [PREPARED, COMMIT, ROLLBACK]),
        st.integers(1, 400),
        st.one_of(st.integers(0, 3000), st.integers(-1500, -1), st.integers(0, 200_000)),
    ),
    min_size=1, max_size=70)


def make_records(raw) -> list[DispatchRec]:
    out, phy, ts = [], 0, T0
    for i, (topic, uniq, tokens, flag, size, step) in enumerate(raw):
        ts += step
        out.append(DispatchRec(phy_offset=phy, msg_size=size, topic=topic, queue_offset=i, sys_flag=flag,
                               store_timestamp=ts, keys=" ".join(tokens) if tokens else None,
                               uniq_key=f"U{i}" if uniq == "uniq" else uniq))
        phy += size
    return out


def split(recs: list[DispatchRec], sizes: list[int]) -> list[list[DispatchRec]]:
    out, i = [], 0
    for size in sizes:
        if i >= len(recs):
            break
        out.append(recs[i : i + size])
        i += size
    if i < len(recs):
        out.append(recs[i:])
    return out


def model_queries(recs: list[DispatchRec]) -> dict[int, list[int]]:
    """Key hash -> CommitLog offsets of every key put, oldest first (a query returns them newest first)."""
    model: dict[int, list[int]] = {}
    for r in recs:
        if r.sys_flag & 0xC == ROLLBACK:
            continue
        keys = ([] if r.uniq_key is None else [r.uniq_key]) + [k for k in (r.keys or "").split(" ") if k]
        for k in keys:
            model.setdefault(model_index_key_hash(f"{r.topic}#{k}"), []).append(r.phy_offset)
    return model


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=records, sizes=st.lists(st.integers(1, 9), min_size=1, max_size=20),
       geometry=st.sampled_from([(7, 5), (7, 12), (13, 20), (64, 50), (11, 6)]), data=st.data())
def test_truncate_then_replay_equals_uninterrupted_run(raw, sizes, geometry, data) -> None:
    """State after batch k, more batches (maybe a put cut short), kill, truncate_to(state): the files are
    those of a run that stopped after batch k; replaying the batches after k gives, name for name and byte
    for byte, the files of an uninterrupted run, and queries return every offset of a plain dict model."""
    slots, entries = geometry
    recs = make_records(raw)
    batches = split(recs, sizes)
    no_state = data.draw(st.integers(0, 7), label="no_state") == 0  # checkpoint before any file
    k = 0 if no_state else data.draw(st.integers(1, len(batches)), label="k")
    more = data.draw(st.integers(min(1, len(batches) - k), len(batches) - k), label="more")
    reload_at_state = data.draw(st.booleans(), label="reload_at_state")
    torn = data.draw(st.integers(0, 8), label="entries of a put cut short")
    slots_written = np.array(data.draw(st.lists(st.booleans(), min_size=64, max_size=64), label="its slots written"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        whole = straight(tmp_path / "whole", batches, slots, entries)
        stopped = straight(tmp_path / "stopped", batches[:k], slots, entries)

        root = tmp_path / "crashed"
        service = run(root, batches[:k], slots, entries)
        if reload_at_state:
            service.close()
            service = run(root, [], slots, entries)
        service.flush()
        state = service.state()
        assert disk_files(root) == stopped  # what the page cache holds at the checkpoint is a clean stop
        for batch in batches[k : k + more]:
            service.build_index(make_dispatch_batch(batch))
        if torn and service.last_file is not None:
            cut_short_put(service, torn, slots_written)
        else:
            service.close()

        recovered, report = recover(root, state, slots, entries)
        assert disk_files(root) == stopped
        assert recovered.names == sorted(stopped)
        assert recovered.state() == state
        assert report.name == (state.name if state else None)
        for batch in batches[k:]:
            recovered.build_index(make_dispatch_batch(batch))
        model = model_queries(recs)
        uniq = sorted({r.uniq_key for r in recs if r.uniq_key})
        for topic in TOPICS:
            for key in [*KEYS, *uniq, "absent"]:
                got = recovered.query_offset(topic, key, BIG_BATCH, 0, FOREVER).phy_offsets
                assert got == model.get(model_index_key_hash(f"{topic}#{key}"), [])[::-1], (topic, key)
        recovered.close()
        assert disk_files(root) == whole


# --- the three header cases, and None ---------------------------------------------------------------------

SLOTS, ENTRIES = 7, 5  # four entries a file


def keyed(first: int, n: int, ts: int = T0) -> list[DispatchRec]:
    return [rec(1000 * i, ts + 1000 * i, keys=f"k{i % 3}") for i in range(first, first + n)]


CASES = {
    # four keys fill the first file, a keyless record rolls the second: it has no entry, indexCount 0 on disk
    "no-entries": ([[*keyed(0, 4), rec(4000, T0 + 9000)]], [keyed(5, 6)], (T0 + 3000, T0 + 3000, 3000, 3000, 0, 0)),
    "some-entries": ([keyed(0, 2)], [keyed(2, 5)], (T0, T0 + 1000, 0, 1000, 2, 3)),
    # the batch ends where the file fills: the newest file is full and its header counts 5
    "full": ([keyed(0, 4)], [keyed(4, 3)], (T0, T0 + 3000, 0, 3000, 3, 5)),
    # a rolled file, then keys: the state's header (from the previous end) is written back over the puts'
    "rolled-then-some": ([[*keyed(0, 4), rec(4000, T0 + 9000)], keyed(5, 1)], [keyed(6, 5)],
                         (T0 + 5000, T0 + 5000, 5000, 5000, 1, 2)),
}


@pytest.mark.parametrize("case", CASES)
def test_truncate_restores_a_clean_stop(tmp_path: Path, case: str) -> None:
    """Each newest-file case comes back with the header a run stopped there leaves (count 0 with no entry,
    else the in-memory header), files named after it are deleted, and replay gives the straight run."""
    before, after, header = CASES[case]
    stopped = straight(tmp_path / "stopped", before, SLOTS, ENTRIES)
    whole = straight(tmp_path / "whole", before + after, SLOTS, ENTRIES)
    service = run(tmp_path / "a", before, SLOTS, ENTRIES)
    state = service.state()
    for batch in after:
        service.build_index(make_dispatch_batch(batch))
    extra = len(service.names) - len(stopped)
    service.close()
    assert disk_files(tmp_path / "a") != stopped

    recovered, report = recover(tmp_path / "a", state, SLOTS, ENTRIES)
    assert disk_files(tmp_path / "a") == stopped
    assert raw_header(tmp_path / "a", state.name) == header
    assert len(report.files_deleted) == extra
    assert report.files_deleted == tuple(sorted(set(disk_files(tmp_path / "whole")) - set(stopped)))
    again = IndexService(str(tmp_path / "a"), SLOTS, ENTRIES, BIG_BATCH).truncate_to(state)
    assert (again.files_deleted, again.entries_removed, again.slots_restored) == ((), 0, 0)  # idempotent
    assert disk_files(tmp_path / "a") == stopped
    for batch in after:
        recovered.build_index(make_dispatch_batch(batch))
    recovered.close()
    assert disk_files(tmp_path / "a") == whole


def test_report_counts_entries_and_slots(tmp_path: Path) -> None:
    """The report says which files went and how many entries and slots were put back."""
    service = run(tmp_path, [keyed(0, 1)], SLOTS, ENTRIES)
    state = service.state()
    service.build_index(make_dispatch_batch(keyed(1, 4)))  # k1 k2 k0 into file 1 (k0's slot back to 1), k1 in file 2
    names = list(service.names)
    service.close()
    _, report = recover(tmp_path, state, SLOTS, ENTRIES)
    assert report.as_dict() == {"name": names[0], "files_deleted": [names[1]], "entries_removed": 3,
                                "slots_restored": 3}


def test_state_none_deletes_every_file(tmp_path: Path) -> None:
    """No state (checkpoint before the first file): every file goes and the next dispatch starts afresh."""
    whole = straight(tmp_path / "whole", [keyed(0, 7)], SLOTS, ENTRIES)
    service = run(tmp_path / "a", [], SLOTS, ENTRIES)
    assert service.state() is None
    service.build_index(make_dispatch_batch(keyed(0, 5)))
    service.close()
    recovered, report = recover(tmp_path / "a", None, SLOTS, ENTRIES)
    assert disk_files(tmp_path / "a") == {}
    assert recovered.names == []
    assert report.name is None
    assert len(report.files_deleted) == 2
    recovered.build_index(make_dispatch_batch(keyed(0, 7)))
    recovered.close()
    assert disk_files(tmp_path / "a") == whole


def test_put_cut_short_is_removed(tmp_path: Path) -> None:
    """Entries (and some slots) written by a put the kill stopped before its header write are undone too."""
    stopped = straight(tmp_path / "stopped", [keyed(0, 1)], 64, 50)
    service = run(tmp_path / "a", [keyed(0, 1)], 64, 50)
    state = service.state()
    service.build_index(make_dispatch_batch(keyed(1, 3)))
    cut_short_put(service, 6, np.arange(64) % 2 == 0)
    _, report = recover(tmp_path / "a", state, 64, 50)
    assert report.entries_removed == 3 + 6
    assert disk_files(tmp_path / "a") == stopped


# --- refusals: StoreLayoutError, nothing changed --------------------------------------------------------------


def crashed_store(root: Path) -> IndexState:
    service = run(root, [keyed(0, 2)], SLOTS, ENTRIES)
    state = service.state()
    service.build_index(make_dispatch_batch(keyed(2, 4)))
    service.close()
    return state


@pytest.mark.parametrize("change", [
    {"name": index_file_name(T0 + 1)},  # missing
    {"index_count": 5},  # more entries than the file holds
    {"end_phy_offset": 1500},  # not the last entry kept
    {"hash_slot_count": 1},  # chains do not add up
    {"begin_timestamp": T0 - 1},  # other begin values
], ids=["missing", "fewer-entries", "end-offset", "slot-count", "begin"])
def test_inconsistent_state_is_refused(tmp_path: Path, change: dict) -> None:
    """A state the files cannot have grown from raises StoreLayoutError naming the file; nothing is touched."""
    state = dataclasses.replace(crashed_store(tmp_path), **change)
    before = disk_files(tmp_path)
    with pytest.raises(StoreLayoutError) as e:
        recover(tmp_path, state, SLOTS, ENTRIES)
    assert e.value.path == str(tmp_path / "index" / state.name)
    assert disk_files(tmp_path) == before


def test_same_count_other_header_is_refused(tmp_path: Path) -> None:
    """With nothing to remove, the header must be the state's."""
    service = run(tmp_path, [keyed(0, 2)], SLOTS, ENTRIES)
    state = service.state()
    service.close()
    with pytest.raises(StoreLayoutError, match="differs"):
        recover(tmp_path, dataclasses.replace(state, end_timestamp=T0 + 5), SLOTS, ENTRIES)


@pytest.mark.parametrize("stage", ["header", "header+slots", "header+slots+some-entries"])
def test_truncation_cut_short_finishes_when_run_again(tmp_path: Path, stage: str) -> None:
    """A kill inside truncate_to (it writes the header, then the slots, then zeroes entries from the end):
    truncating again from the same state ends in the same bytes as an uninterrupted truncation."""
    state = crashed_store(tmp_path / "a")
    crashed_store(tmp_path / "b")
    recover(tmp_path / "b", state, SLOTS, ENTRIES)[0].close()
    path_a, path_b = (tmp_path / x / "index" / state.name for x in "ab")
    data, done = bytearray(path_a.read_bytes()), path_b.read_bytes()
    data[:INDEX_HEADER_SIZE] = done[:INDEX_HEADER_SIZE]
    if "slots" in stage:
        table = slice(INDEX_HEADER_SIZE, INDEX_HEADER_SIZE + 4 * SLOTS)
        data[table] = done[table]
    if "entries" in stage:
        tail = INDEX_HEADER_SIZE + 4 * SLOTS + 20 * (state.index_count + 1)
        data[tail:] = done[tail:]
    assert bytes(data) != done, "the simulated kill must leave work undone"
    path_a.write_bytes(bytes(data))
    recover(tmp_path / "a", state, SLOTS, ENTRIES)[0].close()
    assert disk_files(tmp_path / "a") == disk_files(tmp_path / "b")


def test_state_from_dict_rejects_malformed() -> None:
    """from_dict takes exactly what as_dict gives, with the right types and ranges; ValueError otherwise."""
    good = IndexState(index_file_name(T0), T0, T0 + 5, 10, 20, 2, 4)
    assert IndexState.from_dict(json.loads(json.dumps(good.as_dict()))) == good
    d = good.as_dict()
    bad = [
        [1, 2], None, {**d, "extra": 1}, {k: v for k, v in d.items() if k != "index_count"},
        {**d, "name": "2023"}, {**d, "name": 20231114221320123}, {**d, "index_count": True},
        {**d, "index_count": 0}, {**d, "end_phy_offset": "20"}, {**d, "begin_timestamp": 1.5},
        {**d, "begin_phy_offset": -1}, {**d, "hash_slot_count": 5}, {**d, "begin_phy_offset": 21},
        {**d, "end_timestamp": 2**63}, {**d, "index_count": 2**31},
    ]
    for data in bad:
        with pytest.raises(ValueError, match=r"^IndexState"):
            IndexState.from_dict(data)


# --- resume: from a checkpoint's offset, or from the files down to the key -----------------------------------


def test_no_resume_keeps_broker_dedupe(tmp_path: Path) -> None:
    """By default the record at end_phy_offset is indexed again on replay (the broker's `<`)."""
    service = run(tmp_path, [keyed(0, 2)], 13, 20)
    assert service.resume is None
    service.build_index(make_dispatch_batch(keyed(1, 2)))
    assert service.query_offset("T", "k1", 64, 0, FOREVER).phy_offsets == [1000, 1000]
    service.close()


def test_resume_point_resumes_like_an_uninterrupted_run(tmp_path: Path) -> None:
    """Resuming without a checkpoint from the files gives the straight run's files, also when the last
    record filled the file: the next record names the roll."""
    recs = [*keyed(0, 4), rec(4000, T0 + 9000, keys="x"), rec(5000, T0 + 9500, keys="y")]
    whole = straight(tmp_path / "whole", [recs], SLOTS, ENTRIES)
    run(tmp_path / "a", [recs[:4]], SLOTS, ENTRIES).close()
    resumed = run(tmp_path / "a", [], SLOTS, ENTRIES)
    assert resumed.resume_point() == IndexResume(3000, 1)
    resumed.resume_from(resumed.resume_point())
    resumed.build_index(make_dispatch_batch(recs[3:]))
    resumed.close()
    assert disk_files(tmp_path / "a") == whole
    assert sorted(whole)[1] == index_file_name(T0 + 9000)


def test_resume_from_a_checkpoint_offset_leaves_out_records_below(tmp_path: Path) -> None:
    """IndexResume(X): records below X index nothing and roll nothing, even above end_phy_offset."""
    service = IndexService(str(tmp_path), 13, 20, BIG_BATCH)
    service.resume_from(IndexResume(3000))
    service.build_index(make_dispatch_batch(keyed(0, 3)))
    assert service.names == []
    service.build_index(make_dispatch_batch(keyed(0, 5)))
    assert service.names == [index_file_name(T0 + 3000)]
    assert [service.query_offset("T", f"k{i}", 64, 0, FOREVER).phy_offsets for i in range(3)] == [[3000], [4000], []]
    service.close()


def test_keys_straddling_a_roll_are_resumed_from_the_files(tmp_path: Path) -> None:
    """A record whose UNIQ_KEY ends file N and whose KEYS start file N+1, cut at the roll: the files hold
    one of its keys, and resuming puts exactly the other two, in a file named by that record (issue 11)."""
    recs = [rec(0, T0, keys="a b", uniq="u0"), rec(1000, T0 + 1000, keys="c d", uniq="u1")]  # 3 + 3 keys, 4 a file
    whole = straight(tmp_path / "whole", [recs], SLOTS, ENTRIES)
    assert len(whole) == 2
    cut = run(tmp_path / "a", [], SLOTS, ENTRIES)
    real_roll = IndexService._roll

    def roll_then_die(self, ts, stats):
        if self.names:
            raise KeyboardInterrupt  # stands for the kill: no close, nothing more written
        return real_roll(self, ts, stats)

    IndexService._roll = roll_then_die
    try:
        with pytest.raises(KeyboardInterrupt):
            cut.build_index(make_dispatch_batch(recs))
    finally:
        IndexService._roll = real_roll
    del cut
    resumed = run(tmp_path / "a", [], SLOTS, ENTRIES)
    assert resumed.resume_point() == IndexResume(1000, 1)
    resumed.resume_from(resumed.resume_point())
    resumed.build_index(make_dispatch_batch(recs))
    resumed.close()
    assert disk_files(tmp_path / "a") == whole


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(raw=records, geometry=st.sampled_from([(7, 5), (7, 12), (13, 4), (11, 6)]), data=st.data())
def test_resume_point_after_any_cut_matches_the_uninterrupted_run(tmp_path: Path, raw, geometry, data) -> None:
    """Stop after any key put (inside a record, at a roll, after a keyless record), reopen, resume from the
    files alone, dispatch again from any record at or before the cut: the bytes of a run that never stopped."""
    slots, entries = geometry
    recs = make_records(raw)
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        root = Path(d)
        whole = straight(root / "whole", [recs], slots, entries)
        total_keys = sum(len(model_queries([r]).get(k, [])) for r in recs for k in model_queries([r]))
        limit = data.draw(st.integers(0, total_keys), label="keys put before the kill")
        cut = IndexService(str(root / "cut"), slots, entries, BIG_BATCH)
        cut.load()
        put = 0
        real_put = IndexFile.put_keys

        def put_some(self, key_hash, phy_offset, store_timestamp):
            nonlocal put
            k = min(len(key_hash), limit - put)
            if k <= 0:
                raise KeyboardInterrupt
            done = real_put(self, key_hash[:k], phy_offset[:k], store_timestamp[:k])
            put += done
            return done

        IndexFile.put_keys = put_some
        try:
            cut.build_index(make_dispatch_batch(recs))
        except KeyboardInterrupt:
            pass
        finally:
            IndexFile.put_keys = real_put
        del cut
        resumed = IndexService(str(root / "cut"), slots, entries, BIG_BATCH)
        resumed.load()
        point = resumed.resume_point()
        resumed.resume_from(point)
        # at the latest from the record at the resume offset; from the first one when nothing was indexed
        latest = 0 if point is None else sum(1 for r in recs if r.phy_offset < point.phy_offset)
        first = data.draw(st.integers(0, latest), label="replay from")
        resumed.build_index(make_dispatch_batch(recs[first:]))
        resumed.close()
        assert disk_files(root / "cut") == whole


# --- header sanity at load ------------------------------------------------------------------------------------

GARBAGE = {
    "count-negative": {5: -1},
    "count-above-max": {5: ENTRIES + 1},
    "slot-count-negative": {4: -1},
    "slot-count-above-count": {4: 4, 5: 3},
    "slot-count-above-slots": {4: SLOTS + 1, 5: ENTRIES},
    "timestamp-negative": {1: -5},
    "offset-negative": {2: -1},
    "begin-after-end": {2: 10**6},
}


def patch_header(path: Path, fields: dict[int, int]) -> None:
    data = bytearray(path.read_bytes())
    header = list(HEADER.unpack_from(data))
    for i, v in fields.items():
        header[i] = v
    HEADER.pack_into(data, 0, *header)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", [0, -1], ids=["older-file", "newest-file"])
@pytest.mark.parametrize("garbage", GARBAGE)
def test_garbage_header_is_refused_at_load(tmp_path: Path, garbage: str, which: int) -> None:
    """load() checks every file's header; opening a file for writing does too. A read-only load keeps the
    damage for the query that gets to the file: it raises there, with the newer files' candidates."""
    run(tmp_path, [keyed(0, 6)], SLOTS, ENTRIES).close()
    path = tmp_path / "index" / sorted(disk_files(tmp_path))[which]
    patch_header(path, GARBAGE[garbage])
    with pytest.raises(StoreLayoutError) as e:
        IndexService(str(tmp_path), SLOTS, ENTRIES).load()
    assert e.value.path == str(path)
    assert str(path) in str(e.value)
    reader = IndexService(str(tmp_path), SLOTS, ENTRIES)
    reader.load(readonly=True)
    with pytest.raises(IndexQueryDamaged) as e:
        reader.query_offset("T", "k0", 64, 0, 2**63 - 1)
    reader.close()
    assert e.value.path == str(path)
    assert e.value.entry == "header"
    assert str(path) in str(e.value)
    with pytest.raises(StoreLayoutError):
        IndexFile(str(path), SLOTS, ENTRIES)


@pytest.mark.parametrize("fields", [{4: 0, 5: 0}, {4: 1, 5: 0}, {4: 0, 5: 1}, {4: 3, 5: 3}, {4: 4, 5: 5}],
                         ids=["new", "broker-killed-inside-first-put", "flushed-new", "count-reached", "full"])
def test_headers_a_writer_can_leave_load(tmp_path: Path, fields: dict[int, int]) -> None:
    """indexCount 0 counts as 1, and a broker killed between its hashSlotCount and indexCount writes leaves
    one chain more than entries: all loadable."""
    run(tmp_path, [keyed(0, 2)], SLOTS, ENTRIES).close()
    patch_header(tmp_path / "index" / sorted(disk_files(tmp_path))[0], fields)
    service = IndexService(str(tmp_path), SLOTS, ENTRIES)
    service.load()
    service.close()


@pytest.mark.parametrize("store", discover(), ids=lambda s: s.name)
def test_broker_written_index_files_load(store) -> None:
    """Every IndexFile the real broker wrote passes the header check."""
    settings_ = store.store_settings()
    service = IndexService(str(store.store), settings_["maxHashSlotNum"], settings_["maxIndexNum"])
    service.load(readonly=True)
    assert service.names
    service.close()
