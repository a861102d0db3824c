"""Rebuilds every conformance store (tests/conformance.py finds them) and holds the output to what RocketMQ
4.9.3 wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import load_config
from daemon.query import query_key, query_offsets, query_queue
from daemon.rebuild import rebuild
from indexcore.commitlog import KEY_SEPARATOR
from indexcore.consumequeue import CQ_UNIT_SIZE, ConsumeQueueStore
from tests.conformance import conformance_roots, discover, files_under

STORES = discover()


def test_conformance_stores_are_present():
    """The suite must not pass vacuously: at least one broker-written store is found."""
    where = conformance_roots()
    assert STORES, f"no conformance store (manifest.json + store/commitlog or store/dledger-*/data) under {where}"


@pytest.fixture(scope="module", params=STORES, ids=[s.name for s in STORES])
def rebuilt(request, tmp_path_factory):
    store = request.param
    tmp = tmp_path_factory.mktemp(store.name)
    config = load_config(store.make_workspace(tmp), env={})
    summary = rebuild(config)
    return store, config, summary


def test_rebuild_reads_every_message(rebuilt):
    """The rebuild dispatches every message the broker put, and stops at the end of the written data."""
    store, _, summary = rebuilt
    assert summary.messages == len(store.manifest["messages"])
    assert summary.pending is None
    assert summary.end_offset == max(m["phy_offset"] + m["msg_size"] for m in store.manifest["messages"])


def test_consume_queue_files_are_byte_identical(rebuilt):
    """Every ConsumeQueue file equals the broker's, and no other file exists."""
    store, config, _ = rebuilt
    expected = files_under(store.store / "consumequeue")
    actual = files_under(Path(config.output.dir) / "consumequeue")
    assert sorted(actual) == sorted(expected)
    differing = [name for name in expected if actual[name] != expected[name]]
    assert differing == []


def test_index_files_are_identical_in_name_order(rebuilt):
    """IndexFiles taken in name order have the broker's bytes (names are creation times, so not compared)."""
    store, config, _ = rebuilt
    expected = list(files_under(store.store / "index").values())
    actual = files_under(Path(config.output.dir) / "index")
    assert len(actual) == len(expected)
    for i, (name, data) in enumerate(actual.items()):
        assert data == expected[i], f"index file #{i} ({name}) differs"


def test_raw_index_queries_match_the_broker(rebuilt):
    """IndexService.queryOffset answers: candidate offsets in the broker's order and its last-update values."""
    store, config, _ = rebuilt
    mismatches = []
    for q in store.manifest["query_message"]:
        got = query_offsets(config, q["topic"], q["key"], q["max_num"], q["begin"], q["end"])
        if (got.phy_offsets, got.index_last_update_timestamp, got.index_last_update_phy_offset) != (
                q["index_query_offset_raw"], q["index_last_update_timestamp"], q["index_last_update_phy_offset"]):
            mismatches.append((q["topic"], q["key"], q["why"]))
    assert mismatches == [], f"{len(mismatches)} of {len(store.manifest['query_message'])} differ"


def _has_key(message: dict, topic: str, key: str) -> bool:
    if message["topic"] != topic:
        return False
    return key == message.get("uniq_key") or key in (message.get("keys") or "").split(KEY_SEPARATOR)


def test_exact_key_queries_drop_hash_collisions(rebuilt):
    """`query key` returns exactly the broker's queryMessage offsets whose message has that topic and key."""
    store, config, _ = rebuilt
    by_offset = {m["phy_offset"]: m for m in store.manifest["messages"]}
    mismatches = []
    for q in store.manifest["query_message"]:
        expected = sorted({o for o in q["query_message_phy_offsets"] if _has_key(by_offset[o], q["topic"], q["key"])},
                          reverse=True)
        got = [r.physical_offset for r in query_key(config, q["topic"], q["key"], q["max_num"], q["begin"], q["end"])]
        if got != expected:
            mismatches.append((q["topic"], q["key"], q["why"], got, expected))
    assert mismatches == []


def test_get_message_reads_back_the_same(rebuilt):
    """`getMessage` answers: status, queue bounds, next offset and the CommitLog offsets of the messages."""
    store, config, _ = rebuilt
    for g in store.manifest["get_message"]:
        got = query_queue(config, g["topic"], g["queue_id"], g["offset"], g["max_msg_nums"])
        assert (got.status, got.min_offset, got.max_offset, got.next_begin_offset) == (
            g["status"], g["min_offset"], g["max_offset"], g["next_begin_offset"]), g
        assert [m.physical_offset for m in got.messages] == (g["phy_offsets"] or []), g
        assert [m.queue_offset for m in got.messages] == (g.get("queue_offsets_in_commitlog") or []), g


def test_consume_queue_entries_read_back_the_same(rebuilt):
    """`ConsumeQueue.getIndexBuffer` answers: the unit at an offset and the bytes left in its file."""
    store, config, _ = rebuilt
    queues = ConsumeQueueStore(config.output.dir, config.store.mapped_file_size_consume_queue, readonly=True)
    for e in store.manifest["consume_queue_entry"]:
        units = queues.queue(e["topic"], e["queue_id"]).read_units(e["offset"])
        if e["commitlog_offset"] is None:  # past the queue's end: getIndexBuffer returns null
            assert units == [], e
            continue
        assert units[0] == (e["commitlog_offset"], e["size"], e["tags_code"]), e
        assert len(units) * CQ_UNIT_SIZE == e["buffer_bytes_to_end_of_cq_file"], e
    queues.close()


def test_consume_queue_table_matches(rebuilt):
    """Per queue: min and max queue offset and max physical offset, as the broker reported them."""
    store, config, _ = rebuilt
    queues = ConsumeQueueStore(config.output.dir, config.store.mapped_file_size_consume_queue, readonly=True)
    queues.load()
    table = {f"{cq.topic}/{cq.queue_id}": {"min_offset_in_queue": cq.min_offset, "max_offset_in_queue": cq.max_offset,
                                           "max_physic_offset": cq.max_physic_offset} for cq in queues}
    queues.close()
    assert table == store.manifest["consume_queue_table"]
