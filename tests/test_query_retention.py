"""Queries over data retention removed (issue 28 §4), through the real CLI: a candidate or unit below the
CommitLog's first offset is left out, as the broker's `queryMessage` and `getMessage` leave it out, and the
answer says so (one stderr line; a last `{"type": "removed"}` object in the machine formats)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from daemon.cli import EXIT_FAILURE, EXIT_OK
from indexcore.writer import CommitLogWriter, Message
from tests.test_cli import SEGMENT, run, write_config

# "0A" and '1"' have one Java hash (48*31+65 == 49*31+34): TBB#1"... collides with TBB#0A...
UNIQ = "0A" + "1" * 14 + "7FFFFFFFFFFFFFF0"  # as an offset msgId its offset is past any CommitLog
COLLIDING_KEY = '1"' + UNIQ[2:]
DELETED_SEGMENTS = 3


def build(tmp: Path) -> tuple[Path, list, int]:
    """Messages across six segments: `dup` in the first segment and again near the end, a collision with
    UNIQ's hash under topic TBB in the first segment, UNIQ itself (topic TAa) near the end. The output is
    built, then retention deletes the first DELETED_SEGMENTS segments (the output is not cleaned yet)."""
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 250))
    results = []
    with CommitLogWriter(str(tmp / "store" / "commitlog"), SEGMENT, clock=lambda: next(clock)) as w:
        results.append(w.append(Message("TAa", 0, b"old", {"KEYS": "dup only-old"})))
        results.append(w.append(Message("TBB", 0, b"collides", {"KEYS": COLLIDING_KEY})))
        i = 0
        while w.max_offset < 6 * SEGMENT:
            results.append(w.append(Message("TAa", i % 2, b"x" * 400, {"KEYS": f"k{i}"})))
            i += 1
        results.append(w.append(Message("TAa", 0, b"new", {"KEYS": "dup", "UNIQ_KEY": UNIQ})))
    config = write_config(tmp)
    assert run("rebuild", "--config", str(config)).returncode == EXIT_OK
    log_dir = tmp / "store" / "commitlog"
    for name in sorted(os.listdir(log_dir))[:DELETED_SEGMENTS]:
        os.unlink(log_dir / name)
    return config, results, DELETED_SEGMENTS * SEGMENT


@pytest.fixture(scope="module")
def removed_store(tmp_path_factory):
    return build(tmp_path_factory.mktemp("retention"))


def removed_line(first: int, n: int = 1) -> str:
    return (f"reputd: note: left out {n} index candidate{'s' * (n > 1)} below the CommitLog's first offset {first}: "
            f"retention deleted {'their segments' if n > 1 else 'its segment'}")


def test_key_whose_only_message_was_removed_is_an_empty_answer_that_says_so(removed_store):
    config, _, first = removed_store
    res = run("query", "key", "--config", str(config), "TAa", "only-old")
    assert res.returncode == EXIT_OK, res.stderr
    assert res.stderr.strip() == removed_line(first)
    assert [json.loads(line) for line in res.stdout.splitlines()] == [
        {"type": "removed", "removed": 1, "unit": "index candidate", "commitLogMinOffset": first}]
    text = run("query", "key", "--config", str(config), "TAa", "only-old", "--format", "text")
    assert text.returncode == EXIT_OK
    assert text.stdout == ""
    assert text.stderr.splitlines() == ["no message with key 'only-old' in topic 'TAa'", removed_line(first)]


def test_key_with_a_retained_and_a_removed_message_answers_the_retained_one(removed_store):
    config, results, first = removed_store
    res = run("query", "key", "--config", str(config), "TAa", "dup", "--json")
    assert res.returncode == EXIT_OK, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [m["commitLogOffset"] for m in lines[:-1]] == [results[-1].phy_offset]
    assert lines[-1] == {"type": "removed", "removed": 1, "unit": "index candidate", "commitLogMinOffset": first}
    assert res.stderr.strip() == removed_line(first)


def test_msgid_of_a_retained_message_past_a_removed_collision_under_another_topic(removed_store):
    """Without --topic the UNIQ_KEY is looked up under every topic: under TBB a hash collision points into
    the removed segments, and is left out."""
    config, results, first = removed_store
    res = run("query", "msgid", "--config", str(config), UNIQ, "--json")
    assert res.returncode == EXIT_OK, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [m["commitLogOffset"] for m in lines[:-1]] == [results[-1].phy_offset]
    assert lines[-1]["type"] == "removed"
    assert res.stderr.strip() == removed_line(first)


def test_queue_offset_below_the_first_retained_unit_is_offset_too_small(removed_store):
    config, results, first = removed_store
    retained = [r for r in results if r.phy_offset >= first and r.queue_id == 0 and r.topic == "TAa"]
    res = run("query", "queue", "--config", str(config), "TAa", "0", "0", "--json")
    assert res.returncode == EXIT_OK, res.stderr
    result = json.loads(res.stdout)  # no message: the GetMessageResult alone
    assert (result["status"], result["minOffset"]) == ("OFFSET_TOO_SMALL", retained[0].queue_offset)
    assert result["nextBeginOffset"] == retained[0].queue_offset
    res = run("query", "queue", "--config", str(config), "TAa", "0", str(retained[0].queue_offset), "--count", "1",
              "--json")
    assert res.returncode == EXIT_OK, res.stderr
    assert json.loads(res.stdout.splitlines()[0])["commitLogOffset"] == retained[0].phy_offset


def test_a_removed_offset_msgid_says_retention_removed_it(removed_store):
    config, results, first = removed_store
    res = run("query", "msgid", "--config", str(config), results[0].msg_id)
    assert res.returncode == EXIT_FAILURE
    assert f"below the CommitLog's first offset {first}; retention deleted that segment" in res.stderr


def test_a_rebuild_continuing_the_output_cleans_it_and_the_answers_stay(tmp_path):
    """`rebuild` on the output applies the broker's rule once; verify agrees with what is left, and the
    queries answer as before."""
    config, results, _ = build(tmp_path)
    out = tmp_path / "out"
    before = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    res = run("rebuild", "--config", str(config), "--json")
    assert res.returncode == EXIT_OK, res.stderr
    after = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert len(after) < len(before)
    assert run("verify", "--config", str(config)).returncode == EXIT_OK
    dup = run("query", "key", "--config", str(config), "TAa", "dup", "--json")
    assert dup.returncode == EXIT_OK
    assert json.loads(dup.stdout.splitlines()[0])["commitLogOffset"] == results[-1].phy_offset
    assert run("query", "msgid", "--config", str(config), UNIQ).returncode == EXIT_OK


def test_units_into_removed_segments_are_passed_over_as_get_message_does(tmp_path):
    """A queue whose units go back below the first offset after a retained one (LMQ offsets can): FOUND with
    the retained message, the removed unit passed over and counted; from the removed unit alone,
    MESSAGE_WAS_REMOVING. nextBeginOffset counts both, as the broker's `i` does."""
    config, results, first = build(tmp_path)
    new = results[-1]
    queue = tmp_path / "out" / "consumequeue" / "Crafted" / "0"
    queue.mkdir(parents=True)
    units = [(100, 50, 0), (new.phy_offset, new.msg_size, 0), (200, 50, 0)]
    data = b"".join(struct.pack(">qiq", *u) for u in units)
    (queue / "00000000000000000000").write_bytes(data + bytes(400 - len(data)))
    found = run("query", "queue", "--config", str(config), "Crafted", "0", "1", "--json")
    assert found.returncode == EXIT_OK, found.stderr
    lines = [json.loads(line) for line in found.stdout.splitlines()]
    assert [m["commitLogOffset"] for m in lines[:-1]] == [new.phy_offset]
    assert (lines[-1]["status"], lines[-1]["removed"], lines[-1]["commitLogMinOffset"]) == ("FOUND", 1, first)
    assert found.stderr.strip() == (f"reputd: note: left out 1 unit below the CommitLog's first offset {first}: "
                                    "retention deleted its segment")
    removing = run("query", "queue", "--config", str(config), "Crafted", "0", "2", "--format", "text")
    assert removing.returncode == EXIT_OK, removing.stderr
    assert removing.stderr.splitlines()[0] == "MESSAGE_WAS_REMOVING: Crafted/0 holds queue offsets [1, 3)"
    assert removing.stderr.splitlines()[-1] == (f"reputd: note: left out 1 unit below the CommitLog's first offset "
                                                f"{first}: retention deleted its segment")
    too_small = run("query", "queue", "--config", str(config), "Crafted", "0", "0", "--format", "text")
    assert "OFFSET_TOO_SMALL: Crafted/0 holds queue offsets [1, 3)" in too_small.stderr
