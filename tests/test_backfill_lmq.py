"""`reputd backfill` with LMQ multi-dispatch: the same ConsumeQueues as `reputd rebuild` and the broker, with
ranges cut inside segments, so a queue's units come from many tasks and meet again in one writer."""

from __future__ import annotations

import random

import pytest
import structlog

from daemon.backfill import BackfillFailed, backfill
from daemon.config import load_config
from daemon.engine.rebuild import rebuild
from indexcore.commitlog import TRANSACTION_COMMIT_TYPE, TRANSACTION_PREPARED_TYPE
from indexcore.multidispatch import LMQ_PREFIX, MULTI_QUEUE_OFFSET_FIELD, PROPERTY_INNER_MULTI_DISPATCH
from indexcore.writer import Message
from tests.conformance import files_under
from tests.test_backfill import assert_no_staging, assert_same_files, outputs
from tests.test_multidispatch import (
    CQ_FILE,
    LMQ_STORES,
    MD,
    MQO,
    SEGMENT,
    laid_out,
    lmq_config,
    model_of,
    raw_record,
    segment_of,
    write_workload,
    writer,
)

RANGE_BYTES = 3000  # a 64 KiB segment in 22 ranges: most cut inside a record
CONFORMANCE_RANGE_BYTES = 20000  # 4 ranges a segment: the broker's store has 18 segments
ROOMS = 40


@pytest.mark.parametrize("store", LMQ_STORES, ids=[s.name for s in LMQ_STORES])
def test_lmq_conformance_store_backfills_as_the_broker_wrote_it(spark, store, tmp_path):
    """Small ranges and windows, three writer partitions: every file equals the rebuild's, and every
    ConsumeQueue file, each LMQ queue's included, equals the broker's byte for byte."""
    config_path = store.make_workspace(tmp_path)
    rebuild(load_config(config_path, env={}, overrides={"output.dir": str(tmp_path / "reference")}))
    config = load_config(config_path, env={}, overrides={
        "output.dir": str(tmp_path / "bf"), "backfill.rangeBytes": str(CONFORMANCE_RANGE_BYTES),
        "reput.batchBytes": "1024"})
    summary = backfill(config, spark=spark, partitions=3)
    assert summary.messages == len(store.manifest["messages"])
    assert summary.ranges == 4 * summary.segments
    assert_same_files(outputs(tmp_path / "bf"), outputs(tmp_path / "reference"))
    broker = files_under(store.store / "consumequeue")
    assert any(name.startswith(LMQ_PREFIX) for name in broker)
    assert_same_files(files_under(tmp_path / "bf" / "consumequeue"), broker)
    assert_no_staging(tmp_path / "bf")


def three_rooms_each(rng: random.Random, n: int) -> list[Message | None]:
    """Every message names 3 distinct LMQ queues; some are transactions (PREPARED get offsets, no unit), and
    one broker restart hands out LMQ offsets from 0 again (units appended at the queue's end or skipped)."""
    out: list[Message | None] = []
    for i in range(n):
        rooms = rng.sample(range(1, ROOMS + 1), 3)
        props = {"TAGS": f"t{i % 5}", "KEYS": f"k{i}", PROPERTY_INNER_MULTI_DISPATCH:
                 ",".join(f"{LMQ_PREFIX}room-{r}" for r in rooms)}
        sys_flag = TRANSACTION_PREPARED_TYPE if i % 31 == 0 else TRANSACTION_COMMIT_TYPE if i % 31 == 1 else 0
        out.append(Message(("im-chat", "TopicTest")[i % 2], i % 4, bytes(rng.randrange(120)), props,
                           sys_flag=sys_flag))
        if i == n * 2 // 3:
            out.append(None)
    return out


@pytest.fixture(scope="module")
def three_lmq_store(tmp_path_factory):
    """A store of several segments whose every message goes to 3 LMQ queues (a few starting past offset
    0), its records, and the files the broker's sequential dispatch gives (the model)."""
    tmp = tmp_path_factory.mktemp("lmq3")
    rng = random.Random(14)
    first = {f"{LMQ_PREFIX}room-{r}": rng.randrange(1, 30) for r in range(1, ROOMS + 1, 7)}
    records = write_workload(tmp, three_rooms_each(rng, 2400), first_offsets=first)
    assert records[-1].physical_offset // SEGMENT >= 3
    return tmp, records, model_of(records, True, CQ_FILE)


def test_every_message_in_three_lmq_queues_backfills_as_rebuild(spark, three_lmq_store, tmp_path):
    """Ranges cut inside segments (and inside records), two partitions: the same files as a rebuild, and
    the ConsumeQueues the broker's sequential dispatch writes."""
    tmp, records, expected = three_lmq_store
    base = lmq_config(tmp)
    rebuild(load_config(base, {}, {"output.dir": str(tmp_path / "reference")}))
    config = load_config(base, {}, {"output.dir": str(tmp_path / "bf"), "backfill.rangeBytes": str(RANGE_BYTES),
                                    "reput.batchBytes": "700"})
    summary = backfill(config, spark=spark, partitions=2)
    assert summary.messages == len(records)
    assert summary.ranges > 10 * summary.segments
    assert_same_files(outputs(tmp_path / "bf"), outputs(tmp_path / "reference"))
    cq = files_under(tmp_path / "bf" / "consumequeue")
    assert cq == expected
    assert len({name.split("/")[0] for name in cq if name.startswith(LMQ_PREFIX)}) == ROOMS


def test_lmq_backfill_from_an_offset_matches_rebuild_from_it(spark, three_lmq_store, tmp_path):
    """From a record in the middle: every LMQ queue starts with the broker's pre-blank units up to its
    first unit there, as in a rebuild from the same offset."""
    tmp, records, _ = three_lmq_store
    start = records[len(records) // 2 + 3].physical_offset
    base = lmq_config(tmp)
    rebuild(load_config(base, {}, {"output.dir": str(tmp_path / "reference")}), from_offset=start)
    config = load_config(base, {}, {"output.dir": str(tmp_path / "bf"), "backfill.rangeBytes": str(RANGE_BYTES)})
    summary = backfill(config, spark=spark, from_offset=start)
    assert summary.start_offset == start
    assert_same_files(outputs(tmp_path / "bf"), outputs(tmp_path / "reference"))


def test_a_multi_queue_offset_the_broker_cannot_parse_fails_the_backfill(spark, tmp_path):
    """The rebuild's typed error: the job fails naming the segment, the record's offset and the field, and
    writes nothing."""
    good = raw_record(0, b"INNER_MULTI_DISPATCH\x01%LMQ%r1\x02INNER_MULTI_QUEUE_OFFSET\x010")
    bad = raw_record(good.total_size, b"INNER_MULTI_DISPATCH\x01%LMQ%r1,%LMQ%r2\x02INNER_MULTI_QUEUE_OFFSET\x013,x")
    after = raw_record(good.total_size + bad.total_size, b"KEYS\x01k")
    log = tmp_path / "store" / "commitlog"
    log.mkdir(parents=True)
    (log / f"{0:020d}").write_bytes(segment_of([good, bad, after]))
    with pytest.raises(BackfillFailed) as err:
        backfill(load_config(lmq_config(tmp_path), {}), spark=spark)
    message = str(err.value)
    assert str(log / f"{0:020d}") in message
    assert f"offset {good.total_size}" in message
    assert MULTI_QUEUE_OFFSET_FIELD in message
    assert not (tmp_path / "out" / "consumequeue").exists()
    assert_no_staging(tmp_path / "out")


def test_a_name_repeated_at_other_offsets_is_put_in_record_order(spark, tmp_path):
    """A repeated name whose pieces carry different offsets (`0,3`: not what 4.9.3 hands out, but what a
    CommitLog may hold) starts two runs of one queue at one physical offset: the writer must put them in
    the record's order (the second is then skipped), not the other way round (a queue pre-blanked up to 3).
    The shuffle sorts them by the decoding task's row sequence too, so this holds whatever order ties
    would otherwise arrive in (a local Spark happens to keep them in order)."""
    specs = []
    for k in range(60):
        specs.append((f"INNER_MULTI_DISPATCH\x01%LMQ%r{k},%LMQ%r{k}\x02INNER_MULTI_QUEUE_OFFSET\x01{k % 2},3"
                      .encode(), 0, k % 4))
        specs.append((f"INNER_MULTI_DISPATCH\x01%LMQ%r{k}\x02INNER_MULTI_QUEUE_OFFSET\x01{k % 2 + 1}".encode(), 0, 1))
    records = laid_out(specs)
    log = tmp_path / "store" / "commitlog"
    log.mkdir(parents=True)
    (log / f"{0:020d}").write_bytes(segment_of(records))
    base = lmq_config(tmp_path)
    rebuild(load_config(base, {}, {"output.dir": str(tmp_path / "reference")}))
    config = load_config(base, {}, {"output.dir": str(tmp_path / "bf"), "backfill.rangeBytes": "700",
                                    "reput.batchBytes": "300"})
    backfill(config, spark=spark, partitions=3)
    assert_same_files(outputs(tmp_path / "bf"), outputs(tmp_path / "reference"))
    assert files_under(tmp_path / "bf" / "consumequeue") == model_of(records, True, CQ_FILE)


def test_names_and_offsets_of_different_counts_are_logged_as_rebuild_logs_them(spark, tmp_path):
    """No extra unit (as rebuild and the broker), and one warning per such record, whichever range holds it."""
    w = writer(tmp_path, multi=False)
    odd = []
    for i in range(300):
        props = {MD: f"%LMQ%r{i % 7}", MQO: str(i // 7)}
        if i % 50 == 7:
            props = {MD: "%LMQ%r1,%LMQ%r2", MQO: "0"}
        m = w.append(Message("im-chat", i % 2, bytes(i % 90), props))
        if i % 50 == 7:
            odd.append(m.phy_offset)
    w.close()
    base = lmq_config(tmp_path)
    rebuild(load_config(base, {}, {"output.dir": str(tmp_path / "reference")}))
    config = load_config(base, {}, {"output.dir": str(tmp_path / "bf"), "backfill.rangeBytes": "2000"})
    with structlog.testing.capture_logs() as logs:
        backfill(config, spark=spark)
    assert_same_files(outputs(tmp_path / "bf"), outputs(tmp_path / "reference"))
    warned = [e for e in logs if e["event"] == "multi_dispatch_count_mismatch"]
    assert sorted(e["commit_log_offset"] for e in warned) == odd
    assert {e["topic"] for e in warned} == {"im-chat"}
