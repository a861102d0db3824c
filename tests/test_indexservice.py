"""IndexService (STORE_FORMAT.md §8.6–§8.8): rolling, dedupe on replay, transaction types, queries, names.

`ModelIndexService` applies §8.6/§8.7 one record at a time over `ModelIndexFile`s (tests/conftest.py);
the real service gets the same records in columnar batches and must write the same files.
"""

from __future__ import annotations

import itertools
import os
import random
import struct
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from indexcore.indexservice import IndexService, index_file_name, index_file_time
from tests.conftest import DispatchRec, ModelIndexFile, make_dispatch_batch, model_index_key_hash

REPO = Path(__file__).resolve().parents[1]
T0 = 1700000000123
FOREVER = 2**63 - 1
NOT, PREPARED, COMMIT, ROLLBACK = 0x0, 0x4, 0x8, 0xC
KEYS = ["Aa", "BB", "AaAa", "BBBB", "k1", "k2", "hot", "\u8ba2\u5355", "e\U0001f600", "a#b"]
TOPICS = ["T", "Topic2"]


class ModelIndexService:
    """§8.6 buildIndex and §8.7 rolling, record by record; §8.8 queryOffset."""

    def __init__(self, hash_slot_num: int, index_num: int, max_msgs_num_batch: int = 64):
        self.hash_slot_num = hash_slot_num
        self.index_num = index_num
        self.max_msgs_num_batch = max_msgs_num_batch
        self.files: list[tuple[str, ModelIndexFile]] = []
        self._last_ms = -1

    def _create(self, store_timestamp: int) -> ModelIndexFile:
        """A new file named by the creating record's store time (strictly after the newest name), seeded
        with the previous file's end values."""
        ms = max(store_timestamp, self._last_ms + 1)
        self._last_ms = ms
        prev = self.files[-1][1] if self.files else None
        f = ModelIndexFile(self.hash_slot_num, self.index_num, prev.end_phy_offset if prev else 0,
                           prev.end_timestamp if prev else 0)
        self.files.append((index_file_name(ms), f))
        return f

    def dispatch(self, rec: DispatchRec) -> None:
        if not self.files or self.files[-1][1].is_write_full():
            self._create(rec.store_timestamp)
        f = self.files[-1][1]
        if rec.phy_offset < f.end_phy_offset or rec.sys_flag & 0xC == ROLLBACK:
            return
        keys = [] if rec.uniq_key is None else [rec.uniq_key]
        keys += [k for k in (rec.keys or "").split(" ") if k]
        for key in keys:
            key_hash = model_index_key_hash(f"{rec.topic}#{key}")
            if not f.put(key_hash, rec.phy_offset, rec.store_timestamp):
                f = self._create(rec.store_timestamp)
                assert f.put(key_hash, rec.phy_offset, rec.store_timestamp)

    def close(self) -> None:
        """close() leaves the bytes as 4.9.3 does: a full file was flushed when it filled, a non-full one
        only ever has what its puts wrote (a rolled file with no put keeps indexCount 0)."""
        if self.files and self.files[-1][1].is_write_full():
            self.files[-1][1].header_count_on_disk = True

    def query(self, topic: str, key: str, max_num: int, begin: int, end: int) -> tuple[list[int], int, int]:
        max_num = min(max_num, self.max_msgs_num_batch)
        key_hash = model_index_key_hash(f"{topic}#{key}")
        out: list[int] = []
        last_ts = last_phy = 0
        for i, (_, f) in enumerate(reversed(self.files)):
            if i == 0:
                last_ts, last_phy = f.end_timestamp, f.end_phy_offset
            if f.is_time_matched(begin, end):
                f.select(out, key_hash, max_num, begin, end)
            if f.begin_timestamp < begin or len(out) >= max_num:
                break
        return out, last_ts, last_phy

    def file_bytes(self) -> dict[str, bytes]:
        return {name: f.to_bytes() for name, f in self.files}


def disk_files(root: Path) -> dict[str, bytes]:
    directory = root / "index"
    if not directory.exists():
        return {}
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def header_of(root: Path, name: str) -> tuple[int, ...]:
    """The six §8.2 header fields of an index file, as on disk."""
    return struct.unpack_from(">qqqqii", (root / "index" / name).read_bytes())


def query(service: IndexService, topic: str, key: str, max_num: int = 64, begin: int = 0,
          end: int = FOREVER) -> tuple[list[int], int, int]:
    r = service.query_offset(topic, key, max_num, begin, end)
    return r.phy_offsets, r.index_last_update_timestamp, r.index_last_update_phy_offset


def rec(phy: int, ts: int, keys: str | None = None, uniq: str | None = None, flag: int = NOT,
        topic: str = "T") -> DispatchRec:
    return DispatchRec(phy_offset=phy, msg_size=100, topic=topic, sys_flag=flag, store_timestamp=ts, keys=keys,
                       uniq_key=uniq)


def build(root: Path, batches: list[list[DispatchRec]], slots: int = 5, entries: int = 4,
          max_batch: int = 64) -> IndexService:
    service = IndexService(str(root), slots, entries, max_batch)
    for batch in batches:
        service.build_index(make_dispatch_batch(batch))
    return service


# --- rolling ------------------------------------------------------------------------------------------


def test_files_roll_when_full(tmp_path: Path) -> None:
    """With index_num 4 (3 entries a file), 7 single-key records make three files: 3 + 3 + 1 entries."""
    recs = [rec(1000 * i, T0 + 1000 * i, keys=f"k{i}") for i in range(7)]
    service = build(tmp_path, [recs])
    assert service.names == [index_file_name(T0), index_file_name(T0 + 3000), index_file_name(T0 + 6000)]
    counts = [header_of(tmp_path, name)[5] for name in service.names]
    assert counts == [4, 4, 2]
    service.close()


def test_new_file_header_starts_from_previous_end(tmp_path: Path) -> None:
    """A record without keys after a full file creates the next file at once, its header begin = end =
    the full file's end values; closing keeps indexCount 0 on disk, as 4.9.3 never flushes a non-full file."""
    recs = [rec(1000 * i, T0 + 1000 * i, keys="k") for i in range(3)] + [rec(5000, T0 + 9000)]
    service = build(tmp_path, [recs])
    assert service.names == [index_file_name(T0), index_file_name(T0 + 9000)]
    assert header_of(tmp_path, service.names[1]) == (T0 + 2000, T0 + 2000, 2000, 2000, 0, 0)
    service.close()
    assert header_of(tmp_path, service.names[1]) == (T0 + 2000, T0 + 2000, 2000, 2000, 0, 0)


@pytest.mark.parametrize("follower", [rec(5000, T0 + 9000, flag=ROLLBACK, keys="x"), rec(1000, T0 + 9000, keys="x"),
                                      rec(5000, T0 + 9000, keys="")],
                         ids=["rollback", "replayed", "empty-keys"])
def test_any_record_after_a_full_file_creates_the_next(tmp_path: Path, follower: DispatchRec) -> None:
    """Even a record that indexes nothing (rollback, already indexed, no keys) first gets a non-full file."""
    recs = [rec(1000 * i, T0 + 1000 * i, keys="k") for i in range(3)]
    service = build(tmp_path, [recs, [follower]])
    assert service.names == [index_file_name(T0), index_file_name(T0 + 9000)]
    service.close()


def test_roll_is_named_by_the_record_that_follows_the_full_file(tmp_path: Path) -> None:
    """The file after a full one is named by the next record's store time, even when that record has no keys
    and a later one in the same batch has them."""
    recs = [rec(1000 * i, T0 + 1000 * i, keys="k") for i in range(3)]
    recs += [rec(3000, T0 + 5000), rec(4000, T0 + 8000, keys="k")]
    service = build(tmp_path, [recs])
    assert service.names == [index_file_name(T0), index_file_name(T0 + 5000)]
    service.close()


def test_keys_of_one_message_split_across_files(tmp_path: Path) -> None:
    """A message whose keys do not all fit puts the rest into the next file, seeded with the full file's end."""
    recs = [rec(0, T0, keys="a"), rec(1000, T0 + 2000, keys="b c d", uniq="U")]
    service = build(tmp_path, [recs])
    assert service.names == [index_file_name(T0), index_file_name(T0 + 2000)]
    assert header_of(tmp_path, service.names[0]) == (T0, T0 + 2000, 0, 1000, 3, 4)
    assert header_of(tmp_path, service.names[1]) == (T0 + 2000, T0 + 2000, 1000, 1000, 2, 3)
    for key in ("U", "b", "c", "d"):
        assert query(service, "T", key)[0] == [1000], key
    assert query(service, "T", "a")[0] == [0]
    service.close()


def test_replay_below_end_is_skipped_but_end_is_indexed_again(tmp_path: Path) -> None:
    """Records below the last file's end_phy_offset are already indexed; the one AT it is indexed again."""
    recs = [rec(1000 * i, T0 + 1000 * i, keys=f"k{i}") for i in range(4)]
    service = build(tmp_path, [recs[:3], recs[1:]], slots=7, entries=20)
    assert query(service, "T", "k1")[0] == [1000]
    assert query(service, "T", "k2")[0] == [2000, 2000]
    assert query(service, "T", "k3")[0] == [3000]
    service.close()


def test_transaction_types(tmp_path: Path) -> None:
    """ROLLBACK (0xC, whatever the other bits) is not indexed; NOT, PREPARED and COMMIT are."""
    flags = [NOT, PREPARED, COMMIT, ROLLBACK, ROLLBACK | 0x1, PREPARED | 0x1, 0x2]
    recs = [rec(1000 * i, T0 + i, uniq=f"U{i}", flag=f) for i, f in enumerate(flags)]
    service = build(tmp_path, [recs], slots=7, entries=20)
    found = {i: query(service, "T", f"U{i}")[0] for i in range(len(flags))}
    assert found == {0: [0], 1: [1000], 2: [2000], 3: [], 4: [], 5: [5000], 6: [6000]}
    service.close()


def test_max_num_is_clamped_to_max_msgs_num_batch(tmp_path: Path) -> None:
    """query_offset returns at most max_msgs_num_batch offsets (the newest), whatever max_num asks for."""
    recs = [rec(100 * i, T0 + 10 * i, keys="hot") for i in range(30)]
    service = build(tmp_path, [recs], slots=3, entries=8, max_batch=4)
    assert query(service, "T", "hot", max_num=1000)[0] == [2900, 2800, 2700, 2600]
    assert query(service, "T", "hot", max_num=2)[0] == [2900, 2800]
    service.close()


def test_index_key_is_topic_hash_key(tmp_path: Path) -> None:
    """Keys are stored as topic#key: the same key under another topic is another key (unless hashes collide)."""
    recs = [rec(0, T0, keys="k", topic="A"), rec(1000, T0, keys="k", topic="B")]
    service = build(tmp_path, [recs], slots=97, entries=20)
    assert query(service, "A", "k")[0] == [0]
    assert query(service, "B", "k")[0] == [1000]
    service.close()


# --- names ---------------------------------------------------------------------------------------------


def test_index_file_name_format() -> None:
    """index_file_name is yyyyMMddHHmmssSSS in local time; index_file_time inverts it."""
    for ts in (T0, 1795250325042, 946684799999, 1700000000000):
        local = datetime.fromtimestamp(ts // 1000).strftime("%Y%m%d%H%M%S") + f"{ts % 1000:03d}"
        assert index_file_name(ts) == local
        assert len(local) == 17
        assert index_file_time(local) == ts


@pytest.mark.parametrize(("tz", "name"), [("UTC", "20231114221320123"), ("Asia/Shanghai", "20231115061320123")])
def test_index_file_name_spec_examples(tz: str, name: str) -> None:
    """§8.1: 1700000000123 ms is 20231114221320123 in UTC and 20231115061320123 in Asia/Shanghai."""
    code = "from indexcore.indexservice import index_file_name as n; print(n(1700000000123))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TZ": tz}, cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == name


def test_names_strictly_increase_on_clashes(tmp_path: Path) -> None:
    """Rolls within one millisecond, or by records older than the newest name, take the next free millisecond."""
    recs = [rec(1000 * i, T0, keys="a b c") for i in range(3)] + [rec(3000, T0 - 5000, keys="a b c")]
    service = build(tmp_path, [recs], slots=5, entries=4)
    assert service.names == [index_file_name(T0 + i) for i in range(4)]
    service.close()


# --- model-based ----------------------------------------------------------------------------------------


def make_records(rng: random.Random) -> list[DispatchRec]:
    recs = []
    phy, ts = rng.randrange(0, 5000), T0
    for i in range(rng.randint(1, 120)):
        r = rng.random()
        if r < 0.02:
            ts += (2**31 + 5) * 1000  # past the int32 seconds clamp
        elif r < 0.05:
            ts -= rng.randint(1, 2500)  # store clocks step back
        else:
            ts += rng.choice([0, rng.randint(1, 999), rng.randint(1000, 4000), rng.randint(0, 90_000)])
        tokens = [rng.choice(KEYS) for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 5]))]
        keys = rng.choice([" ".join(tokens), "  ".join(tokens), " " + " ".join(tokens), None if not tokens else ""])
        uniq = rng.choice([None, f"U{i:03d}", rng.choice(KEYS)])
        flag = rng.choice([NOT] * 6 + [PREPARED, COMMIT, ROLLBACK, ROLLBACK | 0x1])
        size = rng.randint(20, 600)
        recs.append(DispatchRec(phy_offset=phy, msg_size=size, topic=rng.choice(TOPICS), queue_id=0,
                                queue_offset=i, sys_flag=flag, store_timestamp=ts, keys=keys, uniq_key=uniq))
        phy += size
    return recs


def schedule(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Batches as (start, stop) record ranges in CommitLog order; some restart earlier (a replay)."""
    out, i = [], 0
    while i < n:
        stop = min(n, i + rng.randint(1, 15))
        start = rng.randrange(0, i) if i and rng.random() < 0.2 else i
        out.append((start, stop))
        i = stop
    return out


def resplit(rng: random.Random, plan: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The same records in the same order, cut into other batches."""
    out = []
    for start, stop in plan:
        cuts = sorted(rng.sample(range(start + 1, stop), min(stop - start - 1, rng.randint(0, 4))))
        bounds = [start, *cuts, stop]
        out += list(itertools.pairwise(bounds))
    return out


def assert_queries_match(service: IndexService, model: ModelIndexService, recs: list[DispatchRec],
                         rng: random.Random, msg: str) -> None:
    times = [r.store_timestamp for r in recs]
    points = [0, FOREVER, *times, *(t + d for t in rng.sample(times, min(5, len(times))) for d in (-1, 999, 1000))]
    uniq = [r.uniq_key for r in recs if r.uniq_key]
    for _ in range(40):
        a, b = rng.choice(points), rng.choice(points)
        begin, end = (0, FOREVER) if rng.random() < 0.25 else (min(a, b), max(a, b))
        topic = rng.choice(TOPICS)
        key = rng.choice([*KEYS, *uniq[:20], "absent"])
        max_num = rng.choice([1, 3, 64, 1000, rng.randint(1, 80)])
        assert query(service, topic, key, max_num, begin, end) == model.query(topic, key, max_num, begin, end), (
            f"{msg} query({topic!r}, {key!r}, {max_num}, {begin}, {end})")


@pytest.mark.parametrize("seed", range(60))
def test_random_dispatch_matches_model(tmp_path: Path, seed: int) -> None:
    """Random records (collisions, split keys, replays, rollbacks, keyless ones) in random batches build the
    files of the per-record §8.6 model, byte for byte and name for name; queries agree before and after load()."""
    rng = random.Random(seed)
    slots, entries = rng.choice([(5, 8), (7, 12), (3, 5), (1, 3), (97, 30)])
    max_batch = rng.choice([3, 5, 64])
    recs = make_records(rng)
    plan = schedule(rng, len(recs))
    msg = f"seed={seed} slots={slots} entries={entries} max_batch={max_batch} plan={plan}"
    service = IndexService(str(tmp_path / "a"), slots, entries, max_batch)
    model = ModelIndexService(slots, entries, max_batch)
    for start, stop in plan:
        service.build_index(make_dispatch_batch(recs[start:stop]))
        for r in recs[start:stop]:
            model.dispatch(r)
        assert service.names == [name for name, _ in model.files], msg
        assert disk_files(tmp_path / "a") == model.file_bytes(), msg
    assert all(len(name) == 17 and name.isdigit() for name in service.names), msg
    assert service.names == sorted(set(service.names)), msg
    assert_queries_match(service, model, recs, rng, msg)
    service.close()
    model.close()
    assert disk_files(tmp_path / "a") == model.file_bytes(), msg

    loaded = IndexService(str(tmp_path / "a"), slots, entries, max_batch)
    loaded.load()
    assert loaded.names == [name for name, _ in model.files], msg
    assert_queries_match(loaded, model, recs, rng, msg + " after load")
    loaded.close()

    other = IndexService(str(tmp_path / "b"), slots, entries, max_batch)
    for start, stop in resplit(rng, plan):
        other.build_index(make_dispatch_batch(recs[start:stop]))
    other.close()
    assert disk_files(tmp_path / "b") == disk_files(tmp_path / "a"), msg + " (second build, other batch cuts)"


@pytest.mark.parametrize("seed", range(30))
def test_build_continues_after_load(tmp_path: Path, seed: int) -> None:
    """Stopping, load()ing and dispatching again from a point at or before the stop gives the model's files:
    those of one uninterrupted build when nothing is replayed, plus the re-indexed end record when it is."""
    rng = random.Random(1000 + seed)
    recs = make_records(rng)
    cut = rng.randint(0, len(recs))
    replay_from = rng.choice([cut, rng.randint(0, cut)])
    msg = f"seed={seed} cut={cut} replay_from={replay_from}"
    whole = build(tmp_path / "a", [recs], slots=3, entries=6)
    whole.close()
    first = build(tmp_path / "b", [recs[:cut]], slots=3, entries=6)
    first.close()
    second = IndexService(str(tmp_path / "b"), 3, 6)
    second.load()
    second.build_index(make_dispatch_batch(recs[replay_from:]))
    second.close()
    model = ModelIndexService(3, 6)
    for r in recs[:cut]:
        model.dispatch(r)
    model.close()
    for r in recs[replay_from:]:
        model.dispatch(r)
    model.close()
    assert disk_files(tmp_path / "b") == model.file_bytes(), msg
    if replay_from == cut:
        assert disk_files(tmp_path / "b") == disk_files(tmp_path / "a"), msg


def _mapping_rss(path: str) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                inside = line.rstrip("\n").endswith(" " + path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_loading_the_newest_file_keeps_none_of_what_it_checks_in_the_rss(tmp_path):
    """A start checks every slot and recorded entry of the newest IndexFile (`IndexFile.structure_fault`), a
    window at a time, releasing each: it used to keep every page it read, so each restart of a daemon with a
    well-filled IndexFile peaked far above its steady RSS (206-400 MB against 68-91 MB in a life). The windows
    still find damage in the very last slot and the very last recorded entry."""
    import numpy as np

    from indexcore.errors import CorruptEntryError
    from indexcore.indexfile import CHECK_WINDOW_BYTES, INDEX_ENTRY_SIZE, INDEX_HEADER_SIZE

    slots, entries, keys = 1_500_000, 3_000_000, 2_500_000  # 6 MB of slots, 50 MB of entries written
    root = str(tmp_path)
    service = IndexService(root, slots, entries)
    service.load()
    os.makedirs(service.directory)
    f = service._create_file(index_file_name(T0), 0, 0)
    rng = np.random.default_rng(7)
    for lo in range(0, keys, 1 << 20):
        n = min(1 << 20, keys - lo)
        f.put_keys(rng.integers(0, 2**31 - 1, n, dtype=np.int64), np.arange(lo, lo + n, dtype=np.int64) * 200,
                   np.full(n, T0, dtype=np.int64))
        f.release()
    f.sync()
    f.close()
    path = os.path.join(service.directory, index_file_name(T0))
    service = IndexService(root, slots, entries)
    service.load()
    try:
        assert service.last_file.index_count == keys + 1
        assert _mapping_rss(path) < 2 * CHECK_WINDOW_BYTES  # was every page of the 56 MB read
    finally:
        service.close()
    with open(path, "r+b") as raw:  # the last slot negative
        raw.seek(INDEX_HEADER_SIZE + 4 * (slots - 1))
        good = raw.read(4)
        raw.seek(-4, os.SEEK_CUR)
        raw.write(struct.pack(">i", -5))
    with pytest.raises(CorruptEntryError, match=f"slot {slots - 1}: field slot: -5 is negative"):
        IndexService(root, slots, entries).load()
    with open(path, "r+b") as raw:  # the last recorded entry linked forward, to itself
        raw.seek(INDEX_HEADER_SIZE + 4 * (slots - 1))
        raw.write(good)
        raw.seek(INDEX_HEADER_SIZE + 4 * slots + INDEX_ENTRY_SIZE * keys + 16)
        raw.write(struct.pack(">i", keys))
    with pytest.raises(CorruptEntryError, match=f"entry {keys}: field prev_index: {keys} links the entry to itself"):
        IndexService(root, slots, entries).load()
