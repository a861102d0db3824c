"""The command line as an operator meets it in an incident (issue 12): every answer is right or says why it
cannot be given, the output reads like mqadmin's, and nothing misleads. Each test runs the real CLI as a
subprocess and checks the exit code, the line on stderr, and that no traceback is printed."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from daemon.cli import build_parser
from indexcore.commitlog import Host
from indexcore.msgid import create_offset_msg_id
from indexcore.writer import CommitLogWriter, Message
from tests.conformance import discover
from tests.test_cli import REPUTD, SEGMENT, json_lines, make_store, run, write_config

ROOT = Path(__file__).resolve().parents[1]
CAMEL = re.compile(r"[a-z][a-zA-Z0-9]*")
HUMAN_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")
FIRST_STORE_MS = 1_700_000_000_000  # tests.test_cli.make_store's clock: 250 ms a message from here


def no_traceback(res) -> None:
    assert "Traceback" not in res.stderr


def on_terminal(*args: str, env: dict | None = None, cwd: Path | None = None, stdout_tty: bool = False,
                timeout: float = 120) -> tuple[int, str, str]:
    """Run reputd with stderr (and with `stdout_tty` stdout too) on a pseudo-terminal, as in an operator's
    shell; returns (exit code, stdout, what the terminal received)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    full_env.update({"COLUMNS": "200", **(env or {})})
    master, slave = pty.openpty()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([*REPUTD, *args], stdout=slave if stdout_tty else out, stderr=slave,
                                stdin=subprocess.DEVNULL, env=full_env, cwd=cwd)
        os.close(slave)
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed its end
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        os.close(master)
        code = proc.wait(timeout)
        out.seek(0)
        return code, out.read(), b"".join(chunks).decode("utf-8", "replace")


def screen(text: str) -> list[str]:
    """The lines a terminal shows for `text`: a carriage return moves back to the line's start, so later
    characters overwrite earlier ones."""
    lines, cur, col = [], [], 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(cur))
            cur, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            if col < len(cur):
                cur[col] = ch
            else:
                cur.append(ch)
            col += 1
    if cur:
        lines.append("".join(cur))
    return [line.rstrip() for line in lines]


# --- 1. a wrong output directory is not an empty answer ------------------------------------------------

def test_queries_against_a_wrong_output_directory_say_so(built):
    """No index/ or consumequeue/ where the output should be, or a topic or queue it does not have: exit 1
    naming what is missing, never an empty answer."""
    tmp, config, _ = built
    (tmp / "typo").mkdir()
    res = run("query", "key", "TopicA", "order-0", "--config", str(config), "--out", str(tmp / "typo"))
    assert res.returncode == 1
    assert f"{tmp / 'typo' / 'index'}: no index directory" in res.stderr
    no_traceback(res)
    res = run("query", "queue", "TopicA", "0", "0", "--config", str(config), "--out", str(tmp / "typo"))
    assert res.returncode == 1
    assert f"{tmp / 'typo' / 'consumequeue'}: no consumequeue directory" in res.stderr
    res = run("query", "key", "TopicA", "order-0", "--config", str(config), "--out", str(tmp / "typo2"))
    assert res.returncode == 2  # a directory that does not exist: the option is wrong, as in every command
    assert f"reputd: error: {tmp / 'typo2'}: no such output directory (--out)" in res.stderr
    assert "NO_MESSAGE_IN_QUEUE" not in res.stderr
    res = run("query", "queue", "TopicC", "0", "0", "--config", str(config))
    assert res.returncode == 1
    assert "no ConsumeQueue of topic 'TopicC' here (topics: TopicA, TopicB)" in res.stderr
    res = run("query", "queue", "TopicA", "7", "0", "--config", str(config))
    assert res.returncode == 1
    assert "topic 'TopicA' has no queue 7 here (queues: 0, 1, 2)" in res.stderr
    no_traceback(res)


def test_an_unknown_key_in_a_good_output_is_an_empty_answer(built):
    """A key the index does not know: exit 0, nothing on stdout, `no message` for a person. A topic the
    output has no ConsumeQueue for is exit 1 naming the topics it has, as `query queue` says it."""
    _tmp, config, _ = built
    res = run("query", "key", "TopicA", "no-such-key", "--config", str(config))
    assert (res.returncode, res.stdout) == (0, "")
    res = run("query", "key", "TopicA", "no-such-key", "--config", str(config), "--format", "text")
    assert (res.returncode, res.stdout) == (0, "")
    assert "no message with key 'no-such-key' in topic 'TopicA'" in res.stderr
    res = run("query", "key", "NoSuchTopic", "order-0", "--config", str(config), "--format", "text")
    assert (res.returncode, res.stdout) == (1, "")
    assert "no ConsumeQueue of topic 'NoSuchTopic' here, so no key of it (topics: TopicA, TopicB)" in res.stderr
    no_traceback(res)


# --- 2. query msgid takes both ids -------------------------------------------------------------------

def test_msgid_takes_the_offset_msgid_and_the_uniq_key(built):
    """An offset msgId whose offset starts a record, and a UNIQ_KEY found through the index (every topic,
    or --topic), give the same message; an id that is neither exits 1 saying what was tried."""
    _tmp, config, results = built
    victim = results[7]  # TopicB, UNIQ_KEY f"{7:032X}"
    uniq = f"{7:032X}"
    by_offset = run("query", "msgid", victim.msg_id, "--config", str(config), "--json")
    assert by_offset.returncode == 0, by_offset.stderr
    by_uniq = run("query", "msgid", uniq, "--config", str(config), "--json")
    assert by_uniq.returncode == 0, by_uniq.stderr
    assert json_lines(by_offset.stdout) == json_lines(by_uniq.stdout)
    (msg,) = json_lines(by_uniq.stdout)
    assert (msg["commitLogOffset"], msg["msgId"], msg["uniqKey"]) == (victim.phy_offset, victim.msg_id, uniq)
    res = run("query", "msgid", uniq, "--topic", "TopicB", "--config", str(config), "--json")
    assert [m["commitLogOffset"] for m in json_lines(res.stdout)] == [victim.phy_offset]
    res = run("query", "msgid", uniq, "--topic", "TopicA", "--config", str(config))
    assert res.returncode == 1
    assert f"reputd: error: no message with msgId {uniq}: " in res.stderr
    assert res.stderr.endswith("as a UNIQ_KEY: not in the index under topic 'TopicA'\n")
    assert len(res.stderr.splitlines()) == 1
    no_traceback(res)


def test_an_offset_inside_a_record_is_no_message_not_corruption(built):
    """An offset msgId pointing into the middle of a record: `no message at that offset`, exit 1, and the
    word corrupt nowhere."""
    _tmp, config, results = built
    inside = create_offset_msg_id(Host(bytes([192, 0, 2, 1]), 10911), results[5].phy_offset + 13)
    res = run("query", "msgid", inside, "--config", str(config))
    assert res.returncode == 1
    assert f"CommitLog offset {results[5].phy_offset + 13}): no message at that offset" in res.stderr
    assert "corrupt" not in res.stderr
    no_traceback(res)


def test_an_offset_msgid_of_another_store_host_is_answered_with_a_warning(built):
    """The record at the offset was stored by 192.0.2.1:10911; an id naming 198.51.100.7:10911 gets the
    record and a warning naming both hosts."""
    _tmp, config, results = built
    other = create_offset_msg_id(Host(bytes([198, 51, 100, 7]), 10911), results[3].phy_offset)
    res = run("query", "msgid", other, "--config", str(config), "--json")
    assert res.returncode == 0, res.stderr
    assert [m["commitLogOffset"] for m in json_lines(res.stdout)] == [results[3].phy_offset]
    assert "warning: msgId" in res.stderr
    assert "names store host 198.51.100.7:10911" in res.stderr
    assert "stored by 192.0.2.1:10911" in res.stderr


# --- 3. inspect of a live broker's newest segment ------------------------------------------------------

def _tear_last_record(tmp: Path, results: list) -> Path:
    """Zero the second half of the last record, as a broker writing it when the segment is copied leaves it."""
    last = results[-1]
    segment = tmp / "store" / "commitlog" / f"{last.phy_offset - last.phy_offset % SEGMENT:020d}"
    with open(segment, "r+b") as f:
        f.seek(last.phy_offset % SEGMENT + last.msg_size // 2)
        f.write(b"\0" * (last.msg_size - last.msg_size // 2))
    return segment


def test_inspect_calls_a_record_being_written_the_end_of_the_data(tmp_path):
    """The newest segment ends in a record still being written: inspect lists the records before it and
    exits 0 with `end of written data`, as rebuild does."""
    results = make_store(tmp_path)
    segment = _tear_last_record(tmp_path, results)
    res = run("inspect", str(segment), "--json", "--config", str(write_config(tmp_path)))
    assert res.returncode == 0, res.stderr
    rows = json_lines(res.stdout)[1:]
    assert rows[-1]["commitLogOffset"] == results[-2].phy_offset
    assert "stop: end of written data" in res.stderr
    assert f"incompleteRecord: still being written: corrupt record in {segment} @ offset {results[-1].phy_offset}" \
        in res.stderr
    no_traceback(res)
    rebuild = run("rebuild", "--config", str(write_config(tmp_path)), "--json")
    assert rebuild.returncode == 0
    assert json.loads(rebuild.stdout)["endOffset"] == results[-1].phy_offset


# --- 4. offsets and times out of range ----------------------------------------------------------------

def test_rebuild_from_outside_the_commitlog_is_a_usage_error(tmp_path):
    """--from past the end of the written data (or before the first segment) exits 2 naming the range."""
    results = make_store(tmp_path, topics=("TopicA",), n=50)
    config = write_config(tmp_path)
    end = results[-1].phy_offset + results[-1].msg_size
    res = run("rebuild", "--config", str(config), "--from", "99999999")
    assert res.returncode == 2
    assert f"--from 99999999 is outside the CommitLog, which holds [0, {end})" in res.stderr
    no_traceback(res)
    assert not (tmp_path / "out" / "consumequeue").exists()
    res = run("rebuild", "--config", str(config), "--from", str(end), "--json")  # the very end: nothing new
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["messages"] == 0
    res = run("rebuild", "--config", str(config), "--from", str(end))
    assert "rebuilt 0 new messages" in res.stdout


def test_rebuild_from_inside_a_record_is_a_usage_error_naming_the_nearest_boundaries(tmp_path):
    """--from inside a record exits 2 before anything is written (as backfill's --from/--to), naming the
    record it falls in, where the docs promise a record boundary."""
    results = make_store(tmp_path, topics=("TopicA",), n=50)
    config = write_config(tmp_path)
    second = results[1]
    inside = second.phy_offset + 7
    res = run("rebuild", "--config", str(config), "--out", str(tmp_path / "fresh"), "--from", str(inside))
    assert res.returncode == 2
    assert (f"--from {inside} is not a record boundary: it falls inside the record at [{second.phy_offset}, "
            f"{second.phy_offset + second.msg_size})") in res.stderr
    assert res.stdout == ""
    no_traceback(res)
    assert not (tmp_path / "fresh").exists()
    res = run("rebuild", "--config", str(config), "--out", str(tmp_path / "fresh"), "--from", str(second.phy_offset))
    assert res.returncode == 0, res.stderr


def test_begin_later_than_end_is_a_usage_error(built):
    _tmp, config, _ = built
    res = run("query", "key", "TopicA", "order-0", "--config", str(config), "--begin", "2000", "--end", "1000")
    assert res.returncode == 2
    assert "--begin 2000 (2000) is later than --end 1000 (1000)" in res.stderr
    no_traceback(res)


# --- 5. inspect reputd's own checkpoint ----------------------------------------------------------------

def test_inspect_shows_reputds_checkpoint(tmp_path):
    """`reputd.checkpoint` (where `run` resumes) is shown: reputFromOffset, each dispatcher's state."""
    results = make_store(tmp_path, n=80)
    config = write_config(tmp_path)
    res = run("run", "--config", str(config), "--until-caught-up")
    assert res.returncode == 0, res.stderr
    res = run("inspect", str(tmp_path / "out" / "reputd.checkpoint"), "--json")
    assert res.returncode == 0, res.stderr
    header, *rows = json_lines(res.stdout)
    assert header["kind"] == "reputd-checkpoint"
    assert header["reputFromOffset"] == results[-1].phy_offset + results[-1].msg_size
    assert {r["dispatcher"] for r in rows} == {"consumequeue", "index"}
    index = next(r["state"] for r in rows if r["dispatcher"] == "index")
    assert index["endPhyOffset"] == results[-1].phy_offset
    res = run("inspect", str(tmp_path / "out" / "reputd.checkpoint"))
    assert f"reputFromOffset: {header['reputFromOffset']}" in res.stdout


# --- 6. results cut at maxMsgsNumBatch -----------------------------------------------------------------

def test_a_result_cut_at_max_msgs_num_batch_says_so(tmp_path):
    """21 TopicA messages share a key; with maxMsgsNumBatch 8 the index gives 8 candidates and the
    terminal is told that older ones may exist; --max says the same for its own limit."""
    make_store(tmp_path)
    config = write_config(tmp_path, maxMsgsNumBatch=8)
    assert run("rebuild", "--config", str(config)).returncode == 0
    res = run("query", "key", "TopicA", "订单😀3", "--config", str(config), "--format", "text")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 1 + 8
    assert "the index gave 8 candidates, the limit (maxMsgsNumBatch 8" in res.stderr
    res = run("query", "key", "TopicA", "订单😀3", "--config", str(config), "--format", "text", "--max", "3")
    assert "the index gave 3 candidates, the limit (--max 3)" in res.stderr
    res = run("query", "key", "TopicA", "order-4", "--config", str(config), "--format", "text")
    assert "limit" not in res.stderr


# --- 7. output people can read -----------------------------------------------------------------------

def test_query_output_on_a_terminal_reads_like_mqadmin(built):
    """query key: a table with the message id, queue, offset and store time; msgid and queue: a block per
    message with mqadmin's labels and local times with milliseconds."""
    _tmp, config, results = built
    code, _, term = on_terminal("query", "key", "TopicA", "order-4", "--config", str(config), stdout_tty=True)
    assert code == 0
    header, row = [line for line in screen(term) if line]
    assert header.split() == ["#Message", "ID", "#QID", "#Offset", "#Store", "Time", "#CommitLog", "Offset",
                              "#Keys"]
    assert row.startswith(f"{4:032X}")
    assert HUMAN_TIME.search(row)
    assert str(results[4].phy_offset) in row
    code, _, term = on_terminal("query", "msgid", results[4].msg_id, "--config", str(config), stdout_tty=True)
    assert code == 0
    lines = dict(line.split(":", 1) for line in screen(term) if ":" in line)
    assert lines["Topic"].strip() == "TopicA"
    assert lines["Tags"].strip() == "[TagA]"
    assert lines["Keys"].strip() == "[order-4 订单😀4]"
    assert lines["Queue ID"].strip() == "1"
    assert lines["CommitLog Offset"].strip() == str(results[4].phy_offset)
    when = datetime.fromtimestamp(results[4].store_timestamp / 1000).strftime("%Y-%m-%d %H:%M:%S")
    assert lines["Store Timestamp"].strip() == f"{when},{results[4].store_timestamp % 1000:03d}"
    assert lines["Store Host"].strip() == "192.0.2.1:10911"
    assert lines["Body Size"].strip() == str(4 % 500)
    code, _, term = on_terminal("query", "queue", "TopicA", "1", "0", "--count", "2", "--config", str(config),
                                stdout_tty=True)
    assert code == 0
    assert [line for line in screen(term) if line.startswith("Queue Offset:")] == ["Queue Offset:        0",
                                                                                   "Queue Offset:        1"]
    assert "FOUND 2 messages at queue offsets [0, 2)" in term


def test_piped_query_output_is_json_lines(built):
    """Piped (no terminal) every query prints one JSON object per message, nothing else on stdout; --json
    and --format json say the same; --body and --save-body carry the body."""
    tmp, config, results = built
    piped = run("query", "queue", "TopicA", "1", "0", "--count", "3", "--config", str(config))
    assert piped.returncode == 0
    assert [m["queueOffset"] for m in json_lines(piped.stdout)[:-1]] == [0, 1, 2]
    assert piped.stdout == run("query", "queue", "TopicA", "1", "0", "--count", "3", "--config", str(config),
                               "--json").stdout
    victim = results[65]
    res = run("query", "msgid", victim.msg_id, "--config", str(config), "--body", "--save-body", str(tmp / "bodies"))
    (msg,) = json_lines(res.stdout)
    body = b"A" * 65
    assert msg["body"] == body.decode()
    assert Path(msg["bodyPath"]) == tmp / "bodies" / victim.msg_id
    assert (tmp / "bodies" / victim.msg_id).read_bytes() == body
    res = run("query", "msgid", victim.msg_id, "--config", str(config), "--format", "text", "--body")
    assert "Body:                " + body.decode() in res.stdout


# --- 8. camelCase in every JSON output ---------------------------------------------------------------

def _keys(value, path: str = "") -> list[str]:
    """Every mapping key in `value` (message properties are data: their names are the broker's)."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append(f"{path}{k}")
            if k != "properties":
                out.extend(_keys(v, f"{path}{k}."))
    elif isinstance(value, list):
        for v in value:
            out.extend(_keys(v, path))
    return out


def test_every_json_output_is_camel_case(built):
    """inspect (ConsumeQueue, IndexFile, both checkpoints), query messages and the rebuild summary."""
    tmp, config, results = built
    assert run("run", "--config", str(config), "--until-caught-up").returncode == 0
    docs = []
    for path in (tmp / "out" / "consumequeue" / "TopicA" / "0" / f"{0:020d}", next((tmp / "out" / "index").iterdir()),
                 tmp / "out" / "reputd.checkpoint", tmp / "store" / "commitlog" / f"{0:020d}"):
        res = run("inspect", str(path), "--config", str(config), "--json", "--limit", "3")
        assert res.returncode == 0, res.stderr
        docs.extend(json_lines(res.stdout))
    stores = discover()
    if stores:
        res = run("inspect", str(stores[0].store / "checkpoint"), "--json")
        assert res.returncode == 0, res.stderr
        docs.extend(json_lines(res.stdout))
    docs.extend(json_lines(run("query", "msgid", results[0].msg_id, "--config", str(config)).stdout))
    docs.append(json.loads(run("rebuild", "--config", str(config), "--out", str(tmp / "again"), "--json").stdout))
    keys = {k.rsplit(".", 1)[-1] for doc in docs for k in _keys(doc)}
    assert {"commitLogOffset", "msgSize", "tagsCode", "beginTimestamp", "phyOffset", "prevIndex",
            "reputFromOffset", "endPhyOffset", "msgsPerSecond"} <= keys
    assert [k for k in keys if not CAMEL.fullmatch(k)] == []


# --- 9. progress and summaries ------------------------------------------------------------------------

def test_rebuild_progress_ends_at_100_percent_with_logs_above_it(tmp_path):
    """On a terminal: one progress line that ends at 100.0% of the written data (not of the segments'
    capacity), the warning about the record being written printed on a line of its own, and the summary
    once."""
    results = make_store(tmp_path, n=600)
    _tear_last_record(tmp_path, results)
    config = write_config(tmp_path)
    code, out, term = on_terminal("rebuild", "--config", str(config))
    assert code == 0, term
    shown = screen(term)
    progress = [line for line in shown if "msgs/s" in line]
    assert len(progress) == 1
    written = results[-1].phy_offset  # the torn record is not data yet
    assert progress[0].lstrip().startswith("100.0%")
    assert f"{written:,} of {written:,} bytes" in progress[0]
    assert f"{len(results) - 1:,} messages" in progress[0]
    warnings = [line for line in shown if "incomplete_record_at_end" in line]
    assert len(warnings) == 1
    assert "msgs/s" not in warnings[0]
    assert "rebuild_finished" not in term  # the summary is printed once, on stdout
    assert len([line for line in out.splitlines() if line.startswith("rebuilt ")]) == 1


def test_run_logs_caught_up_once_and_until_caught_up_prints_a_summary(tmp_path):
    """`run` logs one caught_up event, with the count dispatched, the first time it reaches the head, and
    not again when more data arrives; `run --until-caught-up` ends with a summary line."""
    results = make_store(tmp_path, n=120)
    config = write_config(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    env.update({"REPUTD_METRICS_ENABLED": "false", "REPUTD_LOGGING_LEVEL": "info"})
    proc = subprocess.Popen([*REPUTD, "run", "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any('"caught_up"' in line for line in list(lines)) and time.monotonic() < deadline:
            time.sleep(0.05)
        with CommitLogWriter(str(tmp_path / "store" / "commitlog"), SEGMENT) as w:
            for i in range(30):
                w.append(Message("TopicA", 0, b"late", {"KEYS": f"late-{i}"}))
        time.sleep(1.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(10)
        err = proc.stderr.read()
    out = "".join(lines)
    assert proc.returncode == 0, err
    events = [e for e in json_lines(out) if e.get("event") == "caught_up"]
    assert len(events) == 1
    assert events[0]["dispatched"] == len(results)
    assert events[0]["reput_from_offset"] == results[-1].phy_offset + results[-1].msg_size
    res = run("run", "--config", str(write_config(tmp_path)), "--out", str(tmp_path / "fresh"), "--until-caught-up")
    assert res.returncode == 0, res.stderr
    summary = [line for line in res.stderr.splitlines() if line.startswith("caught up:")]
    assert len(summary) == 1
    assert f"dispatched {len(results) + 30:,} messages" in summary[0]
    no_traceback(res)


def test_produce_shows_progress_on_a_terminal(tmp_path):
    code, out, term = on_terminal("produce", "--config", str(write_config(tmp_path)), "--messages", "5000")
    assert code == 0, term
    assert "100.0%  5,000 of 5,000 messages" in screen(term)[-1]
    assert out.startswith("produced 5,000 messages")


# --- 10. time arguments -------------------------------------------------------------------------------

def test_begin_and_end_take_iso_8601_and_relative_times(built):
    """--end as ISO 8601 (UTC, with Z) selects what the same instant in epoch ms does; a relative --begin
    of -1h excludes this store's 2023 messages; a time that is none of those is exit 2."""
    _tmp, config, _ = built
    cut = FIRST_STORE_MS + 50 * 250
    iso = datetime.fromtimestamp(cut / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    by_ms = run("query", "key", "TopicA", "订单😀3", "--config", str(config), "--end", str(cut))
    by_iso = run("query", "key", "TopicA", "订单😀3", "--config", str(config), "--end", iso)
    assert by_iso.returncode == 0, by_iso.stderr
    assert by_iso.stdout == by_ms.stdout
    assert 0 < len(json_lines(by_iso.stdout)) < len(json_lines(run("query", "key", "TopicA", "订单😀3", "--config",
                                                                   str(config)).stdout))
    res = run("query", "key", "TopicA", "订单😀3", "--config", str(config), "--begin", "-1h", "--format", "text")
    assert (res.returncode, res.stdout) == (0, "")
    assert "in that time range" in res.stderr
    res = run("query", "key", "TopicA", "x", "--config", str(config), "--begin", "yesterday")
    assert res.returncode == 2
    assert "--begin 'yesterday' is not a time" in res.stderr
    no_traceback(res)


# --- 11. version and help -----------------------------------------------------------------------------

def test_version_and_help_for_every_option():
    res = run("--version")
    assert res.returncode == 0
    assert re.fullmatch(r"reputd \S+\n", res.stdout)
    parser = build_parser()
    missing = []

    def walk(p, name: str) -> None:
        for action in p._actions:
            if action.help is None or not action.help.strip():
                missing.append(f"{name} {action.dest}")
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                for sub, subparser in action.choices.items():
                    walk(subparser, f"{name} {sub}")

    walk(parser, "reputd")
    assert missing == []
    readme = (ROOT / "docs" / "commands.md").read_text() + (ROOT / "docs" / "query.md").read_text()
    for option in ("--no-uniq-key", "--body-size", "--seed", "--save-body", "--until-caught-up", "--metrics"):
        assert option in readme
    res = run("query", "msgid", "--help")
    assert res.returncode == 0
    assert "UNIQ_KEY" in res.stdout


# --- 12. make run installs the daemon only ------------------------------------------------------------

@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_installs_the_daemon_without_spark():
    """`make -n -B` shows what each target would run: `run` installs `.` alone, `test` adds the test and
    backfill extras; the license is an SPDX string (no setuptools deprecation banner)."""
    def commands(target: str) -> str:
        res = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stderr
        return res.stdout

    installs = [line for line in commands("run").splitlines() if "pip install" in line and " -e " in line]
    assert installs
    assert all(line.rstrip().endswith("-e .") for line in installs)
    assert "'.[test,backfill]'" in commands("test")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert not any("pyspark" in d for d in project["optional-dependencies"]["test"])


# --- 13. the default config ---------------------------------------------------------------------------

def test_default_config_rule_and_size_mismatch(tmp_path):
    """Without --config: $REPUTD_CONFIG, else ./config/reputd.yaml, else the built-in defaults; a file size
    that does not match the settings in use is exit 2 naming the keys and the config in use."""
    make_store(tmp_path, n=60)
    (tmp_path / "config").mkdir()
    shutil.move(write_config(tmp_path), tmp_path / "config" / "reputd.yaml")
    res = run("rebuild", cwd=tmp_path)  # ./config/reputd.yaml
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "index").is_dir()
    res = run("query", "key", "TopicA", "order-4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert len(json_lines(res.stdout)) == 1
    other = tmp_path / "other.yaml"
    cfg = yaml.safe_load((tmp_path / "config" / "reputd.yaml").read_text())
    cfg["store"]["maxIndexNum"] = 60
    other.write_text(yaml.safe_dump(cfg))
    res = run("query", "key", "TopicA", "order-4", cwd=tmp_path, env={"REPUTD_CONFIG": str(other)})
    assert res.returncode == 2
    assert "set store.maxHashSlotNum and store.maxIndexNum to the broker's values" in res.stderr
    assert f"(config: {other} (from REPUTD_CONFIG))" in res.stderr
    no_traceback(res)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = run("query", "key", "TopicA", "order-4", "--store", str(tmp_path / "out"), cwd=elsewhere)
    assert res.returncode == 2
    assert "maxHashSlotNum 5000000 and maxIndexNum 20000000 give 420000040" in res.stderr
    assert "(config: built-in defaults (no --config, REPUTD_CONFIG or ./config/reputd.yaml))" in res.stderr
    res = run("rebuild", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out2"), cwd=elsewhere)
    assert res.returncode == 2
    assert "set store.mappedFileSizeCommitLog to the broker's value (" in res.stderr
    no_traceback(res)


# --- 14. a busy metrics port ---------------------------------------------------------------------------

def test_busy_metrics_port_names_address_and_keys(tmp_path):
    """`run` on a port in use: exit 2 naming the port, the address and what to set; `run --until-caught-up`
    opens no port unless --metrics asks for one."""
    make_store(tmp_path, n=40)
    config = write_config(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"REPUTD_METRICS_PORT": str(port), "REPUTD_METRICS_HOST": "127.0.0.1"}
        res = run("run", "--config", str(config), env=env)
        assert res.returncode == 2
        assert (f"reputd: config error: metrics.port: {port} on 127.0.0.1 is in use; set metrics.port "
                "(REPUTD_METRICS_PORT) or metrics.enabled (REPUTD_METRICS_ENABLED): false") in res.stderr
        no_traceback(res)
        res = run("run", "--config", str(config), "--until-caught-up", env=env)
        assert res.returncode == 0, res.stderr
        res = run("run", "--config", str(config), "--until-caught-up", "--metrics", env=env)
        assert res.returncode == 2
        assert f"metrics.port: {port} on 127.0.0.1 is in use" in res.stderr


# --- 15. backfill argument checks before Spark ---------------------------------------------------------

def _no_java_env(tmp: Path) -> dict:
    """An environment in which Spark cannot start: an error about Java means the checks came too late."""
    return {"JAVA_HOME": str(tmp / "no-java"), "PATH": str(tmp / "no-java-bin") + os.pathsep + os.path.dirname(
        sys.executable)}


def test_backfill_refuses_bad_arguments_before_spark_starts(tmp_path):
    make_store(tmp_path, n=40)
    config = write_config(tmp_path)
    (tmp_path / "catalog").mkdir()
    (tmp_path / "catalog" / "notes.txt").write_text("not a catalog")
    env = _no_java_env(tmp_path)
    res = run("backfill", "--config", str(config), "--catalog", str(tmp_path / "catalog"), env=env)
    assert res.returncode == 2
    assert f"--catalog {tmp_path / 'catalog'} exists and is not a reputd catalog" in res.stderr
    assert "Java" not in res.stderr
    no_traceback(res)
    # a catalog of an earlier reputd (topic and date in `key=value` directory names only) is not extended:
    # its files and this version's would open with different columns
    legacy = tmp_path / "legacy"
    (legacy / "topic=TopicA" / "date=2023-11-14").mkdir(parents=True)
    (legacy / "topic=TopicA" / "date=2023-11-14" / f"part-{0:020d}-{100:020d}.parquet").write_bytes(b"PAR1")
    (legacy / "_reputd-backfills").mkdir()
    (legacy / "_reputd-backfills" / f"{0:020d}-{100:020d}").touch()
    res = run("backfill", "--config", str(config), "--catalog", str(legacy), env=env)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"reputd: error: --catalog {legacy} is in the topic=T/date=D/ layout of an earlier reputd, which this one "
        f"does not extend: give a new --catalog path (and backfill the ranges named in {legacy}/_reputd-backfills/ "
        f"into it)")
    assert "Java" not in res.stderr
    no_traceback(res)
    res = run("backfill", "--config", str(config), "--from", "500", "--to", "100", env=env)
    assert res.returncode == 2
    assert "--from 500 is not before --to 100" in res.stderr
    assert not (tmp_path / "out").exists()
    res = run("backfill", "--config", str(config), "--out", str(tmp_path / "reputd.yaml" / "out"), env=env)
    assert res.returncode == 2
    assert f"{tmp_path / 'reputd.yaml' / 'out'}: no such output directory, and no directory " in res.stderr


def test_backfill_into_a_read_only_output_names_out(tmp_path):
    """A read-only mount as --out (a private mount namespace, so the test needs no privilege of its own
    beyond unshare): exit 2 naming --out, before Spark starts."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    prefix = ["unshare", "-rm"] if probe.returncode == 0 else ["unshare", "-m"]
    if subprocess.run([*prefix, "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot create a mount namespace here (unshare -m needs privileges this runner lacks)")
    make_store(tmp_path, n=40)
    config = write_config(tmp_path)
    (tmp_path / "ro").mkdir()
    script = (f"mount -t tmpfs -o ro tmpfs {shlex.quote(str(tmp_path / 'ro'))} && exec "
              + shlex.join([*REPUTD, "backfill", "--config", str(config), "--out", str(tmp_path / "ro")]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    env.update(_no_java_env(tmp_path))
    env["PATH"] += os.pathsep + "/usr/bin:/bin:/usr/sbin:/sbin"
    res = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    if "mount:" in res.stderr:
        pytest.skip(f"cannot mount a read-only tmpfs here: {res.stderr.strip()}")
    assert res.returncode == 2, res.stderr
    assert f"reputd: error: --out: output directory {tmp_path / 'ro'} cannot be created or written" in res.stderr
    assert "Java" not in res.stderr


# --- speed: a query imports only what it needs ---------------------------------------------------------

def test_a_query_process_imports_only_what_it_needs(built):
    """The figure itself is `make bench`'s (scenario query); here, what would slow every query down again:
    numpy, structlog, the daemon's machinery or inspect being imported by `reputd query key`."""
    _tmp, config, results = built
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "daemon.cli", "query", "key", "TopicA", "order-4",
                          "--config", str(config)], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert [m["commitLogOffset"] for m in json_lines(res.stdout)] == [results[4].phy_offset]
    imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    heavy = {m for m in imported if m.split(".")[0] in ("numpy", "structlog", "watchdog", "prometheus_client",
                                                        "inspect", "pyspark")
             or m in ("daemon.engine.rebuild", "daemon.engine.dispatchers", "daemon.engine.reput", "daemon.ops.logs",
                       "shutil")}
    assert heavy == set()


def test_a_remembered_config_spares_the_yaml_parser_and_follows_every_edit(built, tmp_path):
    """The second query with one config file takes its parsed text from the memo (PyYAML is not even
    imported); an edit of the file is seen at once; a memo of another text is never used; a writing command
    never reads a memo."""
    tmp, config, _ = built
    cache = tmp_path / "cache"
    env = {"XDG_CACHE_HOME": str(cache)}

    def imports(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
        full = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
        full.update(env)
        res = subprocess.run([sys.executable, "-X", "importtime", "-m", "daemon.cli", *args], capture_output=True,
                             text=True, env=full, timeout=120, check=False)
        return res, {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}

    query = ("query", "key", "TopicA", "order-4", "--config", str(config))
    first, modules = imports(*query)
    assert first.returncode == 0, first.stderr
    assert "yaml" in modules
    (memo,) = (cache / "reputd").iterdir()
    second, modules = imports(*query)
    assert second.stdout == first.stdout
    assert "yaml" not in modules
    cfg = yaml.safe_load(config.read_text())
    cfg["store"]["maxIndexNum"] = 60  # the files have 50: an edit that must be noticed
    config.write_text(yaml.safe_dump(cfg))
    res = run(*query, env=env)
    assert res.returncode == 2
    assert "maxIndexNum 60" in res.stderr
    doc = json.loads(memo.read_text())
    assert doc["data"]["store"]["maxIndexNum"] == 60
    doc["data"]["output"]["dir"] = str(tmp / "elsewhere")  # values that are not the parser's for this text
    doc["text"] += "\n# another text\n"
    memo.write_text(json.dumps(doc))
    res = run(*query, env=env)
    assert "maxIndexNum 60" in res.stderr  # not the memo's values: it is of another text
    doc["text"] = config.read_text()
    memo.write_text(json.dumps(doc))  # a memo of this text with other values: a query believes it...
    res = run(*query, env=env)
    assert f"{tmp / 'elsewhere'}: no such output directory (output.dir)" in res.stderr
    res = run("rebuild", "--config", str(config), "--json", env=env)  # ...a writing command never reads it
    assert res.returncode == 2
    assert "maxIndexNum 60" in res.stderr
    assert not (tmp / "elsewhere").exists()
