"""`query trace` and its decoder of the trace records RocketMQ clients write (daemon/commands/tracedata.py).

The oracle is tests/fixtures/trace_store/: a CommitLog the real 4.9.3 store wrote, holding business messages
and their traces encoded by the 4.9.3 client's own TraceDataEncoder (tests/fixtures/realbroker/TraceStore.java),
and what the client's TraceView made of each msgId's trace messages after the store's queryMessage. The
decoder is also held to the encoder's output record by record, and to the older layouts on its own."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from daemon.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from daemon.commands.trace import query_trace
from daemon.commands.tracedata import (
    CONTENT_SPLITOR,
    FIELD_SPLITOR,
    TraceDecodeError,
    TraceRecord,
    decode_trace_data,
)
from daemon.config import load_config
from daemon.engine.rebuild import rebuild
from tests.test_cli import run

FIXTURE = Path(__file__).parent / "fixtures" / "trace_store"
HARNESS = Path(__file__).parent / "fixtures" / "realbroker" / "TraceStore.java"
MANIFEST = json.loads((FIXTURE / "manifest.json").read_text())
SIZES = {"mappedFileSizeCommitLog": 65536, "mappedFileSizeConsumeQueue": 1280, "maxHashSlotNum": 97,
         "maxIndexNum": 400}


def unpack(tmp: Path) -> Path:
    log = tmp / "store" / "commitlog"
    log.mkdir(parents=True)
    (log / "00000000000000000000").write_bytes(gzip.decompress((FIXTURE / "00000000000000000000.gz").read_bytes()))
    return tmp / "store"


def configured(tmp: Path, root: Path) -> Path:
    path = tmp / "reputd.yaml"
    path.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **SIZES},
                                    "output": {"dir": str(tmp / "out")}, "logging": {"level": "warning"}}))
    return path


@pytest.fixture(scope="module")
def trace_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace")
    path = configured(tmp, unpack(tmp))
    config = load_config(path, env={})
    rebuild(config)
    return path, config


def as_java_view(view) -> dict:
    """Our view in the fields TraceView has, as the client's decoder leaves them for each record type (a bean
    field the record does not carry keeps TraceBean's default, "", or the decoding host's own address)."""
    r = view.record
    carries_bean = r.trace_type in ("Pub", "EndTransaction")
    return {"msgType": r.trace_type, "groupName": r.group_name, "clientHost": view.client_host,
            "timeStamp": r.timestamp, "costTime": r.cost_time or 0,
            "status": "success" if r.success in (True, None) else "failed",
            "topic": r.topic if carries_bean else "", "tags": r.tags if carries_bean else "", "keys": r.keys,
            "offSetMsgId": r.offset_msg_id or "", "traceCommitLogOffset": view.trace_offset}


def java_view(v: dict) -> dict:
    return {k: v[k] for k in v if k != "storeHost"}  # a Sub record's storeHost is the decoding host's address


def key(v: dict) -> tuple:
    return (v["timeStamp"], v["msgType"], v["traceCommitLogOffset"], v["groupName"])


@pytest.mark.parametrize("traced", MANIFEST["traced"], ids=lambda t: t["msgId"][-4:])
def test_each_trace_is_what_the_clients_trace_view_found(trace_store, traced):
    _, config = trace_store
    result = query_trace(config, traced["msgId"])
    assert result.damage is None
    assert result.errors == []
    assert sorted((as_java_view(v) for v in result.views), key=key) == sorted(map(java_view, traced["views"]), key=key)
    pubs = [v for v in result.views if v.record.trace_type == "Pub"]
    assert [v.record.store_host for v in pubs] == [v["storeHost"] for v in traced["views"] if v["msgType"] == "Pub"]


@pytest.mark.parametrize("encoded", MANIFEST["encoded"], ids=lambda e: e["type"])
def test_the_decoder_reads_each_record_the_clients_encoder_wrote_and_writes_it_back(encoded):
    (record,), errors = decode_trace_data(encoded["transData"])
    assert errors == []
    assert record.trace_type == encoded["type"]
    assert record.encode() == encoded["transData"]


def test_older_client_layouts_and_damage_are_read_as_the_client_reads_them():
    """A Pub of 13 fields (no offsetMsgId) and of 15 (a client host), a SubAfter of 6 and 7 fields; a
    record whose number is not one is left out and reported; a type the client does not know is passed over;
    empty fields at a record's end are kept (Java's split would drop them)."""
    s = CONTENT_SPLITOR

    def rec(*fields) -> str:
        return s.join(map(str, fields)) + FIELD_SPLITOR

    body = (rec("Pub", 10, "r", "pg", "T", "ID1", "tg", "k", "h:1", 4, 2, 1, "true")
            + rec("Pub", 11, "r", "pg", "T", "ID1", "tg", "k", "h:1", 4, 2, 0, "OFF", "false", "10.0.0.9")
            + rec("SubAfter", "req", "ID1", 5, "false", "k")
            + rec("SubAfter", "req", "ID1", 6, "true", "k", 3)
            + rec("SubAfter", "req", "ID1", 6, "true", "k", 0, 12, "")
            + rec("Pub", "x1", "r", "pg", "T", "ID1", "tg", "k", "h:1", 4, 2, 0, "OFF", "true")
            + rec("Nonsense", 1, 2) + rec("SubBefore", 13, "r", "cg", "req", "ID1", 0, ""))
    records, errors = decode_trace_data(body)
    assert [(r.trace_type, r.timestamp) for r in records] == [("Pub", 10), ("Pub", 11), ("SubAfter", None),
                                                              ("SubAfter", None), ("SubAfter", 12), ("SubBefore", 13)]
    assert (records[0].msg_type, records[0].offset_msg_id, records[0].success) == ("Trans_Msg_Half", None, True)
    assert (records[1].offset_msg_id, records[1].success, records[1].client_host) == ("OFF", False, "10.0.0.9")
    assert (records[2].context_code, records[3].context_code, records[4].group_name) == (None, 3, "")
    assert records[5].keys == ""
    assert [(e.index, e.field) for e in errors] == [(5, "timeStamp")]
    assert isinstance(errors[0], TraceDecodeError)
    assert TraceRecord("SubBefore", "ID1", 13, "r", "cg", "req", retry_times=0, keys="").encode() == body.split(
        FIELD_SPLITOR)[7] + FIELD_SPLITOR


def test_the_trace_on_a_terminal_as_mqadmin_lays_it_out(trace_store):
    path, _ = trace_store
    first = MANIFEST["traced"][0]
    res = run("query", "trace", "--config", str(path), first["msgId"], "--format", "text", env={"TZ": "UTC"})
    assert res.returncode == EXIT_OK, res.stderr
    lines = res.stdout.splitlines()
    assert lines[:2] == ["#Type      #ProducerGroup       #ClientHost          #SendTime            #CostTimes #Status",
                         "Pub        pg-trace             192.0.2.50           2026-11-18 11:06:40  3ms        success"]
    subs = [line.split() for line in lines if line.startswith("Sub ")]
    assert [(s[1], s[5], s[6], s[7]) for s in subs] == [
        ("cg-a", "7ms", "failed", "0"), ("cg-a", "8ms", "failed", "1"), ("cg-a", "9ms", "success", "2"),
        ("cg-b", "7ms", "success", "0")]


def test_the_offset_msgid_is_looked_up_by_its_messages_uniq_key(trace_store):
    path, _ = trace_store
    txn = MANIFEST["traced"][5]
    res = run("query", "trace", "--config", str(path), txn["offsetMsgId"], "--json")
    assert res.returncode == EXIT_OK, res.stderr
    got = [json.loads(line) for line in res.stdout.splitlines()]
    assert [v["type"] for v in got] == ["Pub", "EndTransaction", "SubBefore", "SubAfter"]
    assert (got[1]["transactionState"], got[1]["fromTransactionCheck"], got[0]["msgType"]) == (
        "COMMIT_MESSAGE", True, "Trans_Msg_Half")
    assert {v["msgId"] for v in got} == {txn["msgId"]}


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["00000000000000000000000000000000"], EXIT_OK, ""),
    (["C0A8000100002A9F0000000000000001", "--trace-topic", "NOPE"], EXIT_FAILURE,
     "no ConsumeQueue of topic 'NOPE' here, so no key of it (topics: RMQ_SYS_TRACE_TOPIC, TopicTrace)"),
    (["not-an-id"], EXIT_USAGE, "msgId"),
])
def test_no_trace_a_missing_trace_topic_and_a_bad_id(trace_store, args, code, needle):
    path, _ = trace_store
    res = run("query", "trace", "--config", str(path), *args, "--json")
    assert res.returncode == code, res.stderr
    assert needle in res.stderr
    assert res.stdout == ""


@pytest.mark.stress_only
def test_a_fresh_trace_store_of_the_real_store_and_client_answers_alike(tmp_path):
    """TraceStore.java run again (the real 4.9.3 store; the client's trace classes from REPUTD_ROCKETMQ_SRC, an
    apache/rocketmq checkout at rocketmq-all-4.9.3): `query trace` gives its TraceViews for every msgId."""
    from tests.test_realbroker_live import java_build, java_command

    src = os.environ.get("REPUTD_ROCKETMQ_SRC")
    trace_dir = Path(src or "/nonexistent") / "client/src/main/java/org/apache/rocketmq/client"
    if not (trace_dir / "trace" / "TraceDataEncoder.java").is_file():
        pytest.skip("REPUTD_ROCKETMQ_SRC names no apache/rocketmq checkout with the 4.9.3 client's trace sources")
    build = java_build()
    classes = tmp_path / "classes"
    sources = [*(trace_dir / "trace" / f"{n}.java" for n in ("TraceBean", "TraceConstants", "TraceContext",
                                                              "TraceDataEncoder", "TraceTransferBean", "TraceType",
                                                              "TraceView")),
               trace_dir / "producer" / "LocalTransactionState.java", HARNESS]
    subprocess.run(["javac", "-nowarn", "-encoding", "UTF-8", "-cp", f"{build}/classes:{build}/lib/*", "-d",
                    str(classes), *map(str, sources)], check=True, timeout=300)
    java = java_command(build)
    java[-1] += f":{classes}"
    out = subprocess.run([*java, "-Dfile.encoding=UTF-8", "TraceStore", str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=300, check=True)
    manifest = json.loads(out.stdout)
    shutil.rmtree(tmp_path / "store" / "consumequeue")
    shutil.rmtree(tmp_path / "store" / "index")
    config = load_config(configured(tmp_path, tmp_path / "store"), env={})
    rebuild(config)
    for traced in manifest["traced"]:
        got = sorted((as_java_view(v) for v in query_trace(config, traced["msgId"]).views), key=key)
        assert got == sorted(map(java_view, traced["views"]), key=key)
