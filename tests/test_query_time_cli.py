"""`reputd query time` and `query offset` through the real command line: the output forms, the command a cut
answer prints (run as printed), times as the other queries take them, and the guards every command has
(exit codes, a topic or directory the output lacks, retention, damage, a closed stdout)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from daemon.cli import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from daemon.commands.render import display_width
from indexcore.consumequeue import CQ_UNIT_SIZE
from indexcore.writer import CommitLogWriter, Message
from tests.test_cli import REPUTD, SEGMENT, run, write_config
from tests.tools import catches

T0 = 1_800_000_000_000
STEP = 10  # ms between messages, two messages each time: store times repeat


def build(tmp: Path, body: int = 0) -> tuple[Path, list]:
    """120 messages of topic TT over 3 queues (and 20 of OTHER), two per store time, tags TagA/TagB/none;
    bodies of `body` bytes more than their number."""
    times = iter(t for i in range(200) for t in (T0 + i * STEP,) * 2)
    results = []
    with CommitLogWriter(str(tmp / "store" / "commitlog"), SEGMENT, clock=lambda: next(times)) as w:
        for i in range(140):
            tag = ("TagA", "TagB", None)[i % 3]
            topic = "OTHER" if i % 7 == 6 else "TT"
            results.append(w.append(Message(topic, i % 3, b"body-%d" % i + bytes(body), {"TAGS": tag} if tag else {})))
    config = write_config(tmp)
    assert run("rebuild", "--config", str(config)).returncode == EXIT_OK
    return config, results


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build(tmp_path_factory.mktemp("timecli"))


def lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def rerun(command: str) -> subprocess.CompletedProcess:
    """A printed command, run as printed but for the program (this interpreter's reputd): its words from
    `query` on."""
    words = shlex.split(command)
    return run(*words[words.index("query"):])


def test_piped_messages_then_the_command_that_continues(store):
    """Piped: one JSON object per message with its offsets and store time, ordered by store time then
    CommitLog offset across the queues; a cut answer ends with a `more` object whose command prints the rest."""
    config, results = store
    tt = sorted((r.store_timestamp, r.phy_offset) for r in results if r.topic == "TT")
    begin, end = T0 + 5 * STEP, T0 + 40 * STEP
    expected = [x for x in tt if begin <= x[0] <= end]
    first = run("query", "time", "--config", str(config), "TT", "--begin", str(begin), "--end", str(end),
                "--count", "20")
    assert first.returncode == EXIT_OK, first.stderr
    got = lines(first.stdout)
    assert [(m["storeTimestamp"], m["commitLogOffset"]) for m in got[:-1]] == expected[:20]
    assert {"queueId", "queueOffset"} <= set(got[0])
    more = got[-1]
    assert (more["type"], more["nextBegin"], more["nextFrom"]) == ("more", *expected[20])
    pages = got[:-1]
    while more is not None:
        rest = rerun(more["command"])
        assert rest.returncode == EXIT_OK, rest.stderr
        page = lines(rest.stdout)
        more = page.pop() if page[-1].get("type") == "more" else None
        pages += page
    assert [(m["storeTimestamp"], m["commitLogOffset"]) for m in pages] == expected


def test_on_a_terminal_a_table_and_notes_with_local_times(store):
    config, results = store
    begin = "2027-01-15T08:00:00.010"  # T0 is 2027-01-15 08:00:00 UTC
    res = run("query", "time", "--config", str(config), "TT", "--begin", begin + "Z", "--end", str(T0 + 3 * STEP),
              "--tags", "TagA || TagB", "--format", "text", env={"TZ": "Asia/Shanghai"})
    assert res.returncode == EXIT_OK, res.stderr
    header, *rows = res.stdout.splitlines()
    assert header.split() == ["#Message", "ID", "#QID", "#Offset", "#Store", "Time", "#CommitLog", "Offset", "#Tags",
                              "#Keys"]
    expected = [r for r in results if r.topic == "TT" and T0 + STEP <= r.store_timestamp <= T0 + 3 * STEP
                and r.phy_offset not in {x.phy_offset for x in results[2::3]}]
    assert len(rows) == len(expected)
    assert "2027-01-15 16:00:00,010" in rows[0]  # printed in local time (UTC+8)
    assert res.stderr.splitlines() == [f"{len(rows)} messages of TT tagged 'TagA || TagB' stored in [2027-01-15 "
                                       "16:00:00,010, 2027-01-15 16:00:00,030], by store time across its queues"]


def test_the_table_lines_up_after_wide_tags(tmp_path):
    """Tags of CJK and emoji characters take two terminal columns each: the #Keys column starts at the same
    column on every line (it moved left by one column per wide character)."""
    times = iter(range(T0, T0 + 100))
    with CommitLogWriter(str(tmp_path / "store" / "commitlog"), SEGMENT, clock=lambda: next(times)) as w:
        for i, tag in enumerate(("TagA", "标签A", "😀tag", "タグB", "e\u0301")):
            w.append(Message("TT", 0, b"body", {"TAGS": tag, "KEYS": f"k{i}"}))
    config = write_config(tmp_path)
    assert run("rebuild", "--config", str(config)).returncode == EXIT_OK
    res = run("query", "time", "--config", str(config), "TT", "--begin", str(T0), "--end", str(T0 + 10),
              "--format", "text", env={"TZ": "UTC"})
    assert res.returncode == EXIT_OK, res.stderr
    header, *rows = res.stdout.splitlines()
    assert len(rows) == 5
    starts = {display_width(line[:line.rindex(" ") + 1]) for line in (header, *rows)}
    assert len(starts) == 1, res.stdout


def test_tag_counts_per_queue_and_in_all(store):
    config, results = store
    res = run("query", "time", "--config", str(config), "TT", "--begin", str(T0), "--tag-counts", "--json")
    assert res.returncode == EXIT_OK, res.stderr
    got = lines(res.stdout)
    assert [c["queueId"] for c in got] == [0, 1, 2, None]
    total = got[-1]
    tt = [r for r in results if r.topic == "TT"]
    tags = [("TagA", "TagB", None)[results.index(r) % 3] for r in tt]
    assert total["tags"] == {"TagA": tags.count("TagA"), "TagB": tags.count("TagB")}
    assert (total["untagged"], total["messages"]) == (tags.count(None), len(tt))


def test_query_offset_takes_times_as_every_query_does(store):
    config, results = store
    q0 = [r for r in results if r.topic == "TT" and r.queue_id == 0]
    at = run("query", "offset", "--config", str(config), "TT", "0", str(q0[5].store_timestamp), "--json")
    assert at.returncode == EXIT_OK, at.stderr
    assert json.loads(at.stdout)["queueOffset"] == q0[5].queue_offset
    ago = run("query", "offset", "--config", str(config), "TT", "0", "-1h", "--json")  # a relative TIME positional
    assert ago.returncode == EXIT_OK, ago.stderr
    assert json.loads(ago.stdout)["queueOffset"] == q0[0].queue_offset  # an hour ago is before T0: the first unit
    late = run("query", "offset", "--config", str(config), "TT", "0", "2030-01-01T00:00:00Z", "--json")
    assert json.loads(late.stdout)["queueOffset"] == q0[-1].queue_offset  # after the last: the last unit


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["time", "NOPE", "--begin", "0"], EXIT_FAILURE, "no ConsumeQueue of topic 'NOPE' here (topics: OTHER, TT)"),
    (["time", "TT", "--begin", "0", "--queue", "7"], EXIT_FAILURE, "topic 'TT' has no queue 7 here (queues: 0, 1, 2)"),
    (["offset", "TT", "9", "0"], EXIT_FAILURE, "topic 'TT' has no queue 9 here"),
    (["time", "TT", "--begin", "-1h", "--end", "-2h"], EXIT_USAGE, "is later than --end"),
    (["time", "TT", "--begin", "yesterday"], EXIT_USAGE, "is not a time"),
    (["time", "TT", "--begin", "0", "--tags", "||"], EXIT_USAGE, "names no tag"),
    (["time", "TT", "--begin", "0", "--tag-counts", "--body"], EXIT_USAGE, "--tag-counts reads no body"),
    (["offset", "TT", "0", "soon"], EXIT_USAGE, "TIME 'soon' is not a time"),
])
def test_mistakes_get_one_line_and_the_exit_code(store, args, code, needle):
    config, _ = store
    res = run("query", *args, "--config", str(config))
    assert res.returncode == code, res.stderr
    assert needle in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_an_output_without_consumequeue_cannot_be_looked_at(store, tmp_path):
    config, _ = store
    (tmp_path / "empty").mkdir()
    res = run("query", "time", "--config", str(config), "TT", "--begin", "0", "--out", str(tmp_path / "empty"))
    assert res.returncode == EXIT_FAILURE
    assert "no consumequeue directory" in res.stderr
    missing = run("query", "offset", "--config", str(config), "TT", "0", "0", "--out", str(tmp_path / "nope"))
    assert missing.returncode == EXIT_USAGE


def test_exit_code_kept_when_stdout_is_closed_or_cut(store):
    config, _ = store
    args = [*REPUTD, "query", "time", "--config", str(config), "TT", "--begin", "0", "--count", "100"]
    closed = subprocess.run(" ".join(map(shlex.quote, args)) + " >&-", shell=True, capture_output=True, text=True,
                            check=False)
    assert (closed.returncode, closed.stderr) == (EXIT_OK, "")
    cut = subprocess.run(" ".join(map(shlex.quote, args)) + " | head -1", shell=True, capture_output=True, text=True,
                         check=False, executable="/bin/bash")
    assert cut.stderr == ""
    piped = subprocess.run(f"set -o pipefail; {' '.join(map(shlex.quote, args))} | head -1 >/dev/null; "
                           "echo ${PIPESTATUS[0]}", shell=True, capture_output=True, text=True, check=False,
                           executable="/bin/bash")
    assert piped.stdout.strip() == str(EXIT_OK)


def test_retention_removed_units_the_window_may_hold_are_said(tmp_path):
    """Retention deleted the first segments: a window reaching back before the oldest message kept answers what
    is kept and says how many units it left out; one after it says nothing of them."""
    config, results = build(tmp_path, 1500)
    log_dir = tmp_path / "store" / "commitlog"
    first = sorted(os.listdir(log_dir))[1]
    os.unlink(log_dir / sorted(os.listdir(log_dir))[0])
    kept = [r for r in results if r.topic == "TT" and r.phy_offset >= int(first)]
    gone = [r for r in results if r.topic == "TT" and r.phy_offset < int(first)]
    res = run("query", "time", "--config", str(config), "TT", "--begin", "0", "--count", "1000", "--json")
    assert res.returncode == EXIT_OK, res.stderr
    got = lines(res.stdout)
    assert [m["commitLogOffset"] for m in got[:-1]] == [r.phy_offset for r in sorted(
        kept, key=lambda r: (r.store_timestamp, r.phy_offset))]
    assert got[-1] == {"type": "removed", "removed": len(gone), "unit": "unit", "commitLogMinOffset": int(first)}
    assert f"left out {len(gone)} units below the CommitLog's first offset {int(first)}" in res.stderr
    later = run("query", "time", "--config", str(config), "TT", "--begin", str(kept[-1].store_timestamp), "--json")
    assert later.returncode == EXIT_OK, later.stderr
    assert later.stderr == ""


def test_a_damaged_unit_in_the_window_is_named_after_the_messages_before_it(tmp_path):
    """The messages found before the damaged unit (none when a search step met it), then one line naming the
    unit's file, queue offset and field: exit 1."""
    config, results = build(tmp_path)
    q1 = [r for r in results if r.topic == "TT" and r.queue_id == 1]
    victim = q1[12]  # not a step of the searches: met by the read of the window
    path = tmp_path / "out" / "consumequeue" / "TT" / "1"
    file_size = 400  # write_config's mappedFileSizeConsumeQueue
    logical = victim.queue_offset * CQ_UNIT_SIZE
    unit_file = path / f"{logical - logical % file_size:020d}"
    with open(unit_file, "r+b") as f:
        f.seek(logical % file_size)
        f.write(struct.pack(">qiq", victim.phy_offset + 1, victim.msg_size, 0))
    res = run("query", "time", "--config", str(config), "TT", "--begin", str(q1[5].store_timestamp), "--end",
              str(q1[15].store_timestamp), "--queue", "1", "--json", "--count", "100")
    assert res.returncode == EXIT_FAILURE
    found = [m["commitLogOffset"] for m in lines(res.stdout)]
    assert found == [r.phy_offset for r in q1[5:12]]
    assert res.stderr.strip() == (f"reputd: error: {unit_file}: unit at queue offset {victim.queue_offset}: field "
                                  f"commit_log_offset: no record starts at CommitLog offset {victim.phy_offset + 1}")


@pytest.mark.parametrize("kind", ["time", "offset", "trace"])
def test_a_signal_while_the_query_runs_is_one_line_and_130(store, kind):
    config, _ = store
    args = {"time": ["TT", "--begin", "0", "--scan"], "offset": ["TT", "0", "0"],
            "trace": ["C0A8000100002A9F0000000000000001"]}[kind]
    proc = subprocess.Popen([*REPUTD, "query", kind, "--config", str(config), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while proc.poll() is None and not catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (EXIT_INTERRUPTED, "reputd: interrupted\n")


def test_an_invalid_unit_is_damage_wherever_the_search_lands(tmp_path):
    """The newest file's end is found by bisection: whether it stops at the invalid unit (written units follow
    it: damage, as the queue's recovery says for `query queue`) or past it (the unit is met when read), the
    answer names the same file, unit and field as `query queue`'s."""
    config, results = build(tmp_path)
    q1 = [r for r in results if r.topic == "TT" and r.queue_id == 1]
    unit_file = tmp_path / "out" / "consumequeue" / "TT" / "1" / f"{400:020d}"  # the newest of two files of 20
    pristine = unit_file.read_bytes()
    for index in (27, 30):  # the bisection over the file's 20 units passes its unit 7 and stops at unit 10
        victim = q1[index]
        data = bytearray(pristine)
        struct.pack_into(">qiq", data, (victim.queue_offset - 20) * CQ_UNIT_SIZE, -1, victim.msg_size, 0)
        unit_file.write_bytes(bytes(data))
        by_time = run("query", "time", "--config", str(config), "TT", "--queue", "1", "--begin", "0", "--json")
        by_queue = run("query", "queue", "--config", str(config), "TT", "1", "0", "--json")
        assert by_time.returncode == by_queue.returncode == EXIT_FAILURE
        named = f"reputd: error: {unit_file}: unit at queue offset {victim.queue_offset}: field commit_log_offset: -1 "
        assert by_time.stderr.startswith(named), by_time.stderr
        assert by_queue.stderr.startswith(named), by_queue.stderr
