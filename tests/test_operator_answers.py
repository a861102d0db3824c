"""What an operator reads when something is wrong (issue 44, items 8, 10, 11, 13, 14), through the real CLI:
`run`'s errors on stderr too, bytes that are no CommitLog named as `rebuild` names them, printed commands
that run as printed, one rule for output directories, `inspect`'s usage errors, and the index's whole
seconds explained when a time range leaves a message out. (The configuration mistakes in every command:
tests/test_one_answer.py.)"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from daemon.cli.common import program
from tests.test_cli import REPUTD, SEGMENT, make_store, write_config

BIN = Path(REPUTD[0]).parent
SCRIPT = BIN / "reputd"


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    env.update(extra)
    return env


def reputd(*args: str, cwd: Path | None = None, argv0: list[str] | None = None, **env: str):
    return subprocess.run([*(argv0 or REPUTD), *args], capture_output=True, text=True, env=_env(**env), cwd=cwd,
                          timeout=120, check=False)


@pytest.fixture
def no_commitlog(tmp_path):
    """A store whose only segment is random bytes, not a RocketMQ CommitLog."""
    seg = tmp_path / "store" / "commitlog"
    seg.mkdir(parents=True)
    (seg / f"{0:020d}").write_bytes(os.urandom(SEGMENT))
    return tmp_path, write_config(tmp_path), seg / f"{0:020d}"


def test_verify_of_bytes_that_are_no_commitlog_says_what_rebuild_says(no_commitlog):
    """Item 10: not `outputMissing` with a rebuild that then fails, but the corrupt record, as `rebuild` says it;
    and `rebuild`'s line on stdout says it failed, not `rebuilt 0 new messages`."""
    tmp, config, segment = no_commitlog
    store = str(tmp / "store")  # verified as a broker's store root, where the files would be
    rebuild = reputd("rebuild", "--config", str(config))
    assert rebuild.returncode == 1
    error = rebuild.stderr.splitlines()[-1].removeprefix("reputd: error: ")
    assert error.startswith(f"corrupt record in {segment} @ offset 0: field magic_code: ")
    assert rebuild.stdout.startswith("failed: rebuilt 0 messages, 0 bytes [0, 0) before the error below; ")
    assert "new messages" not in rebuild.stdout
    as_json = json.loads(reputd("rebuild", "--config", str(config), "--json").stdout)
    assert (as_json["failed"], as_json["error"], as_json["messages"]) == (True, error, 0)
    verify = reputd("verify", "--config", str(config), "--store", store)
    assert verify.returncode == 1
    assert "outputMissing" not in verify.stdout
    assert "repair:" not in verify.stdout
    assert "commitLogCorrupt: 1 finding" in verify.stdout
    assert f"error {error}" in verify.stdout
    assert "nothing to rebuild until the segment is repaired or restored" in verify.stdout
    summary = json.loads(reputd("verify", "--config", str(config), "--store", store, "--json").stdout.splitlines()[-1])
    assert summary["repair"] is None
    assert list(summary["byKind"]) == ["commitLogCorrupt"]


def test_run_says_why_it_stopped_on_stderr(no_commitlog):
    """Item 8: the JSON log on stdout, and the one line on stderr every failing command gives."""
    _, config, segment = no_commitlog
    res = reputd("run", "--until-caught-up", "--config", str(config))
    assert res.returncode == 1
    assert all(line.startswith("{") for line in res.stdout.splitlines())
    lines = res.stderr.splitlines()
    assert lines[-2].startswith("stopped before the end: dispatched 0 messages, 0 bytes [0, 0) in ")
    assert lines[-1].startswith(f"reputd: error: corrupt record in {segment} @ offset 0: field magic_code: ")


def test_printed_commands_start_with_the_program_that_printed_them(tmp_path):
    """Item 11: after `make run`, `.venv/bin/reputd` is not on PATH: the repair plan names it by its path, with
    absolute --config and --out (given relative), and runs as printed from another directory; with that
    directory on PATH the plan says `reputd`."""
    make_store(tmp_path)
    write_config(tmp_path)
    assert reputd("rebuild", "--config", "reputd.yaml", cwd=tmp_path).returncode == 0
    for queue in (tmp_path / "out" / "consumequeue" / "TopicA").iterdir():
        for f in queue.iterdir():
            f.unlink()
        break
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p or ".") != BIN)
    res = reputd("verify", "--config", "reputd.yaml", cwd=tmp_path, argv0=[str(SCRIPT)], PATH=path)
    assert res.returncode == 1, res.stderr
    plan = next(x for x in res.stdout.splitlines() if x.startswith("repair: ")).removeprefix("repair: ")
    words = shlex.split(plan)
    assert words[:2] == [str(SCRIPT), "rebuild"]
    assert words[words.index("--config") + 1] == str(tmp_path / "reputd.yaml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(words, capture_output=True, text=True, env=_env(PATH=path), cwd=elsewhere, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    on_path = reputd("verify", "--config", "reputd.yaml", cwd=tmp_path, argv0=[str(SCRIPT)],
                     PATH=f"{BIN}{os.pathsep}{path}")
    assert "repair: reputd rebuild --config " in on_path.stdout


def test_a_continuation_carries_absolute_paths(tmp_path):
    """Item 11: the command that rebuilds an index into an empty directory, printed by a rebuild given a relative
    --config, runs as printed from another directory."""
    make_store(tmp_path)
    write_config(tmp_path)
    assert reputd("rebuild", "--config", "reputd.yaml", cwd=tmp_path).returncode == 0
    names = sorted((tmp_path / "out" / "index").iterdir())
    assert len(names) >= 3
    names[1].unlink()
    (tmp_path / "out" / "reputd.checkpoint").unlink()
    res = reputd("rebuild", "--config", "reputd.yaml", cwd=tmp_path)
    assert res.returncode == 1
    command = shlex.split(res.stderr.rsplit(": ", 1)[1])
    assert command[:len(program()) + 1] == [*program(), "rebuild"]
    assert command[command.index("--config") + 1] == str(tmp_path / "reputd.yaml")
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd="/", timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_output_directories_follow_one_rule(tmp_path):
    """Item 13: a writing command creates a missing output directory whose parent exists, and says so; a path
    whose parent does not exist is refused (a typo, not a new output); a file is not a directory in every
    command; readers need the directory; an error about a default path says no config was found."""
    make_store(tmp_path, n=40)
    config = str(write_config(tmp_path))
    new = tmp_path / "new"
    res = reputd("rebuild", "--config", config, "--out", str(new))
    assert res.returncode == 0, res.stderr
    assert f"reputd: note: created the output directory {new} (it did not exist)" in res.stderr.splitlines()
    run_out = tmp_path / "run-out"
    res = reputd("run", "--until-caught-up", "--config", config, "--out", str(run_out))
    assert res.returncode == 0, res.stderr
    assert f"reputd: note: created the output directory {run_out} (it did not exist)" in res.stderr
    deep = tmp_path / "typo" / "out"
    res = reputd("rebuild", "--config", config, "--out", str(deep))
    assert res.returncode == 2
    assert res.stderr == (f"reputd: error: {deep}: no such output directory, and no directory {deep.parent} to "
                          "create it in (--out): a writing command creates the output directory, not the path to it\n")
    assert not deep.parent.exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for args in (["verify"], ["rebuild"], ["run", "--until-caught-up"], ["handoff", "--dry-run"],
                 ["query", "key", "TopicA", "order-1"]):
        res = reputd(*args, "--config", config, "--out", str(a_file))
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.splitlines()[-1].startswith(f"reputd: error: {a_file}: not a directory (--out)"), args
    for args in (["verify"], ["query", "key", "TopicA", "order-1"], ["handoff", "--dry-run"]):
        res = reputd(*args, "--config", config, "--out", str(tmp_path / "missing"))
        expected = 0 if args[0] == "handoff" else 2  # the hand-off completes a new output: a writer's rule
        assert res.returncode == expected, (args, res.stderr)
        if expected:
            assert res.stderr == f"reputd: error: {tmp_path / 'missing'}: no such output directory (--out)\n"
    res = reputd("verify", cwd=tmp_path / "new")
    assert res.returncode == 2
    assert res.stderr == (f"reputd: error: {tmp_path / 'new' / 'var' / 'store'}: no such store root directory "
                          "(store.storePathRootDir; config: built-in defaults (no --config, REPUTD_CONFIG or "
                          "./config/reputd.yaml))\n")


def test_inspect_of_a_file_of_no_known_kind_is_a_usage_error(tmp_path):
    """Item 14: exit 2 as for a missing path, listing every kind inspect decodes, the DLedger files among them."""
    stray = tmp_path / "lock"
    stray.write_bytes(b"\0" * 4)
    res = reputd("inspect", str(stray))
    assert res.returncode == 2
    assert res.stderr.startswith(f"reputd: error: {stray}: cannot tell the kind of file from its name: inspect "
                                 "decodes a CommitLog segment (commitlog/<20 digits>), ")
    for kind in ("a data file (dledger-<selfId>/data/<20 digits>)", "its index file (dledger-<selfId>/index/",
                 "its checkpoint (dledger-<selfId>/checkpoint)", "an IndexFile (index/<17 digits>)"):
        assert kind in res.stderr


def test_a_time_range_that_leaves_out_a_message_inside_it_says_why(tmp_path):
    """Item 14: index times are whole seconds after the IndexFile's first store time (as the broker's), so
    `--begin` at a message's own store time can leave it out; the answer stays the broker's and a note says
    which message and the --begin that finds it."""
    results = make_store(tmp_path, n=40)
    config = str(write_config(tmp_path))
    assert reputd("rebuild", "--config", config).returncode == 0
    target = results[1]  # stored 250 ms after the first, whose time begins the IndexFile: indexed at that second
    begin = str(target.store_timestamp)
    res = reputd("query", "key", "TopicB", "order-1", "--begin", begin, "--end", begin, "--config", config,
                 "--format", "text")
    assert res.returncode == 0
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        "no message with key 'order-1' in topic 'TopicB' in that time range",
        f"reputd: note: 1 message with this key stored inside the range (the first at "
        f"{_human(target.store_timestamp)}, {target.store_timestamp}) is left out: the index keeps store times "
        "in whole seconds, as the broker's IndexFile does, and times it before --begin; widen the range by a "
        f"second: --begin {target.store_timestamp - 1000}"]
    wider = reputd("query", "key", "TopicB", "order-1", "--begin", str(target.store_timestamp - 1000), "--end",
                   begin, "--config", config, "--json")
    assert [json.loads(x)["commitLogOffset"] for x in wider.stdout.splitlines()] == [target.phy_offset]


def _human(ms: int) -> str:
    from daemon.commands.render import human_time

    return human_time(ms)


def test_a_time_range_answer_says_what_it_lists_outside_the_range_and_leaves_out_inside(tmp_path):
    """Issue 44 item 14, a non-empty answer (the real 4.9.3 store, as an operator found it): HOTKEY for
    08:38:19,700-19,990 gets the broker's answer, two messages stored at 20,731 and 20,798 (after --end: their
    index time is the whole second 19), while three stored inside the range (19,744-19,795) are timed before
    --begin and left out. The answer stays the broker's; two notes on stderr say both, in every format, and
    `--json` ends with a `{"type": "timeRange"}` object holding the same facts."""
    from tests.conformance import discover

    plain = {s.name: s for s in discover()}.get("visible")
    if plain is None:
        pytest.skip("the conformance store `visible` is not here")
    settings = plain.store_settings()
    config = tmp_path / "plain.yaml"
    config.write_text(json.dumps({"store": {"storePathRootDir": str(plain.store), **{k: settings[k] for k in (
        "mappedFileSizeCommitLog", "mappedFileSizeConsumeQueue", "maxHashSlotNum", "maxIndexNum")}}}))
    begin, end = 1795250299700, 1795250299990
    res = reputd("query", "key", "TopicTest", "HOTKEY", "--begin", str(begin), "--end", str(end), "--config",
                 str(config), "--json")
    assert res.returncode == 0, res.stderr
    *messages, last = map(json.loads, res.stdout.splitlines())
    assert [(m["commitLogOffset"], m["storeTimestamp"]) for m in messages] == [
        (969977, 1795250300798), (944321, 1795250300731)]
    assert last == {"type": "timeRange", "begin": begin, "end": end, "indexTimeUnitMs": 1000,
                    "leftOut": [931388, 919003, 909450], "widerBegin": begin - 1000,
                    "listedAfterEnd": [969977, 944321], "listedBeforeBegin": []}
    assert res.stderr.splitlines() == [
        f"reputd: note: 3 messages with this key stored inside the range (the first at {_human(1795250299744)}, "
        "1795250299744) are left out: the index keeps store times in whole seconds, as the broker's IndexFile does, "
        f"and times them before --begin; widen the range by a second: --begin {begin - 1000}",
        f"reputd: note: 2 messages listed were stored after --end (the last at {_human(1795250300798)}, "
        "1795250300798): the index keeps store times in whole seconds, as the broker's IndexFile does, and times "
        "them inside the range; the broker's query lists them too"]
    wider = reputd("query", "key", "TopicTest", "HOTKEY", "--begin", str(begin - 1000), "--end", str(end),
                   "--config", str(config), "--json")
    assert {931388, 919003, 909450} <= {json.loads(x).get("commitLogOffset") for x in wider.stdout.splitlines()}
