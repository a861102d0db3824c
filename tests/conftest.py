"""Shared test helpers."""

# --- Store-model helpers for test_consumequeue / test_indexfile / test_indexservice -------------------
# Plain-Python models written straight from STORE_FORMAT.md §7.5/§8.2–§8.8; they share no code with
# indexcore, so a test compares two independent readings of the spec.

import os as _os
import struct as _struct
from typing import NamedTuple as _NamedTuple

import numpy as _np
import pytest

from indexcore.dispatch import DispatchBatch as _DispatchBatch
from tests.stress import STRESS as _STRESS
from tests.stress import report as _report

_OUTCOMES: dict[str, dict[str, list[str]]] = {}


@pytest.fixture(scope="session")
def spark():
    """One local Spark context for every backfill test, as the backfill makes it: 2 cores, 3 attempts per task
    (so a failed attempt is retried)."""
    from daemon.backfill import create_context

    sc = create_context("local[2,3]", {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                                       "spark.driver.memory": "512m", "spark.default.parallelism": "2",
                                       "spark.sql.shuffle.partitions": "2"})
    yield sc
    sc.stop()


@pytest.fixture
def spark_sql(spark):
    """A SparkSession on the tests' context, for what reads the catalog as an operator's Spark does (the
    backfill itself runs RDD jobs and needs none)."""
    from pyspark.sql import SparkSession

    return SparkSession.builder.getOrCreate()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In stress mode, the outcome of every test, so the run's report lists each case tried."""
    if _STRESS and (report.when == "call" or report.outcome != "passed"):
        path, _, name = report.nodeid.partition("::")
        _OUTCOMES.setdefault(path, {}).setdefault(report.outcome, []).append(name)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for path, outcomes in sorted(_OUTCOMES.items()):
        _report(f"cases {path}", **{k: len(v) for k, v in outcomes.items()}, cases=outcomes)


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """The CLI remembers parsed config files under $XDG_CACHE_HOME (daemon/config/memo.py): keep the
    suite's out of the runner's home."""
    previous = _os.environ.get("XDG_CACHE_HOME")
    _os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if previous is None:
        _os.environ.pop("XDG_CACHE_HOME", None)
    else:
        _os.environ["XDG_CACHE_HOME"] = previous


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Suites marked `stress_only` belong to `make stress`: outside it they are deselected, not skipped."""
    if _STRESS:
        return
    dropped = [item for item in items if item.get_closest_marker("stress_only")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not item.get_closest_marker("stress_only")]


MODEL_INDEX_HEADER = _struct.Struct(">qqqqii")  # §8.2 header
MODEL_INDEX_SLOT = _struct.Struct(">i")
MODEL_INDEX_ENTRY = _struct.Struct(">iqii")  # §8.2 entry
MODEL_MAX_TIME_DIFF = 2**31 - 1


class DispatchRec(_NamedTuple):
    """One dispatch request, as a test writes it by hand."""

    phy_offset: int
    msg_size: int = 100
    topic: str = "T"
    queue_id: int = 0
    queue_offset: int = 0
    sys_flag: int = 0
    store_timestamp: int = 1_700_000_000_000
    tags_code: int = 0
    keys: str | None = None
    uniq_key: str | None = None
    prepared_transaction_offset: int = 0


def make_dispatch_batch(recs: list[DispatchRec], end_offset: int | None = None) -> _DispatchBatch:
    """The columnar `DispatchBatch` of hand-written records (in CommitLog order)."""
    if not recs:
        return _DispatchBatch.empty(end_offset or 0)
    topics = tuple(dict.fromkeys(r.topic for r in recs))
    topic_ids = {t: i for i, t in enumerate(topics)}

    def col(name: str, dtype) -> _np.ndarray:
        return _np.array([getattr(r, name) for r in recs], dtype=dtype)

    return _DispatchBatch.of(
        phy_offset=col("phy_offset", _np.int64),
        msg_size=col("msg_size", _np.int32),
        queue_id=col("queue_id", _np.int32),
        queue_offset=col("queue_offset", _np.int64),
        sys_flag=col("sys_flag", _np.int32),
        store_timestamp=col("store_timestamp", _np.int64),
        tags_code=col("tags_code", _np.int64),
        prepared_transaction_offset=col("prepared_transaction_offset", _np.int64),
        topic_id=_np.array([topic_ids[r.topic] for r in recs], dtype=_np.int32),
        topics=topics,
        keys=[r.keys for r in recs],
        uniq_key=[r.uniq_key for r in recs],
        start_offset=recs[0].phy_offset,
        end_offset=end_offset if end_offset is not None else recs[-1].phy_offset + recs[-1].msg_size,
    )


def model_java_hash(s: str) -> int:
    """§6.1 `String.hashCode` over UTF-16 code units, as a signed int32."""
    h = 0
    for unit in _struct.unpack(f">{len(s.encode('utf-16-be', 'surrogatepass')) // 2}H",
                               s.encode("utf-16-be", "surrogatepass")):
        h = (31 * h + unit) % 2**32
    return h - 2**32 if h >= 2**31 else h


def model_index_key_hash(key: str) -> int:
    """§6.1 `indexKeyHashMethod`: abs(hashCode), Integer.MIN_VALUE -> 0."""
    h = model_java_hash(key)
    return 0 if h == -(2**31) else abs(h)


class ModelIndexFile:
    """An IndexFile as lists and dicts (§8.2–§8.5); `to_bytes()` lays it out from scratch."""

    def __init__(self, hash_slot_num: int, index_num: int, end_phy_offset: int = 0, end_timestamp: int = 0):
        self.hash_slot_num = hash_slot_num
        self.index_num = index_num
        self.begin_phy_offset = self.end_phy_offset = max(end_phy_offset, 0)
        self.begin_timestamp = self.end_timestamp = max(end_timestamp, 0)
        self.hash_slot_count = 0
        self.entries: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)]  # entry 0 is never written
        self.slots: dict[int, int] = {}
        self.header_count_on_disk = False  # a new file reads indexCount 0 until a put or a flush

    @property
    def index_count(self) -> int:
        return len(self.entries)

    def is_write_full(self) -> bool:
        return self.index_count >= self.index_num

    def put(self, key_hash: int, phy_offset: int, store_timestamp: int) -> bool:
        """§8.3 putKey."""
        if self.is_write_full():
            return False
        slot = key_hash % self.hash_slot_num
        prev = self.slots.get(slot, 0)
        if self.begin_timestamp <= 0:
            time_diff = 0
        else:
            d = store_timestamp - self.begin_timestamp
            secs = -((-d) // 1000) if d < 0 else d // 1000  # Java long division truncates toward zero
            time_diff = min(max(secs, 0), MODEL_MAX_TIME_DIFF)
        n = self.index_count
        self.entries.append((key_hash, phy_offset, time_diff, prev))
        self.slots[slot] = n
        if n <= 1:
            self.begin_phy_offset = phy_offset
            self.begin_timestamp = store_timestamp
        if prev == 0:
            self.hash_slot_count += 1
        self.end_phy_offset = phy_offset
        self.end_timestamp = store_timestamp
        self.header_count_on_disk = True
        return True

    def is_time_matched(self, begin: int, end: int) -> bool:
        b, e = self.begin_timestamp, self.end_timestamp
        return (begin < b and end > e) or b <= begin <= e or b <= end <= e

    def select(self, out: list[int], key_hash: int, max_num: int, begin: int, end: int) -> None:
        """§8.5 by brute force: every entry of the key's slot, newest first, with the same stop rules."""
        if self.index_count <= 1:
            return
        slot = key_hash % self.hash_slot_num
        for n in range(self.index_count - 1, 0, -1):
            kh, phy, time_diff, _ = self.entries[n]
            if kh % self.hash_slot_num != slot:
                continue
            if len(out) >= max_num:
                return
            t = self.begin_timestamp + time_diff * 1000
            if kh == key_hash and begin <= t <= end:
                out.append(phy)
            if t < begin:
                return

    def to_bytes(self) -> bytes:
        buf = bytearray(40 + 4 * self.hash_slot_num + 20 * self.index_num)
        count = self.index_count if self.header_count_on_disk else 0
        MODEL_INDEX_HEADER.pack_into(buf, 0, self.begin_timestamp, self.end_timestamp, self.begin_phy_offset,
                                     self.end_phy_offset, self.hash_slot_count, count)
        for slot, n in self.slots.items():
            MODEL_INDEX_SLOT.pack_into(buf, 40 + 4 * slot, n)
        entries_at = 40 + 4 * self.hash_slot_num
        for n, entry in enumerate(self.entries[1:], start=1):
            MODEL_INDEX_ENTRY.pack_into(buf, entries_at + 20 * n, *entry)
        return bytes(buf)


@pytest.fixture
def built(tmp_path):
    """A store of 300 messages (tests.test_cli.make_store: UNIQ_KEY f"{i:032X}"), rebuilt into tmp/out, for
    the command-line suites: (tmp_path, config path, the messages' put results)."""
    from tests.test_cli import make_store, run, write_config

    results = make_store(tmp_path)
    config = write_config(tmp_path)
    res = run("rebuild", "--config", str(config))
    assert res.returncode == 0, res.stderr
    return tmp_path, config, results
