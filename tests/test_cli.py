"""The `reputd` command line, run as a subprocess the way an operator runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from daemon.cli import common as cli
from indexcore.commitlog import PHYSICAL_OFFSET_OFFSET
from indexcore.writer import CommitLogWriter, Message
from tests.conformance import discover, files_under

SEGMENT = 64 * 1024
REPUTD = [sys.executable, "-m", "daemon.cli"]


def run(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    full_env.update(env or {})
    return subprocess.run([*REPUTD, *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=120,
                          check=False)


def write_config(tmp: Path, **store) -> Path:
    cfg = {"store": {"storePathRootDir": str(tmp / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": 400, "maxHashSlotNum": 31, "maxIndexNum": 50, **store},
           "output": {"dir": str(tmp / "out")}, "logging": {"level": "warning"}}
    path = tmp / "reputd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def make_store(tmp: Path, topics=("TopicA", "TopicB"), n: int = 300) -> list:
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 250))
    results = []
    with CommitLogWriter(str(tmp / "store" / "commitlog"), SEGMENT, clock=lambda: next(clock)) as w:
        for i in range(n):
            props = {"TAGS": "TagA", "KEYS": f"order-{i} 订单😀{i % 7}", "UNIQ_KEY": f"{i:032X}"}
            results.append(w.append(Message(topics[i % len(topics)], i % 3, bytes([i % 256]) * (i % 500), props)))
    return results


@pytest.fixture
def store(tmp_path):
    results = make_store(tmp_path)
    return tmp_path, write_config(tmp_path), results


def test_help_for_every_command():
    """`--help` works for the tool and for every command, exiting 0."""
    for args in ([], ["run"], ["rebuild"], ["query"], ["query", "key"], ["query", "queue"], ["query", "msgid"],
                 ["inspect"], ["produce"]):
        res = run(*args, "--help")
        assert res.returncode == 0, res.stderr
        assert "usage:" in res.stdout


def test_usage_error_exits_2():
    """A missing argument is a usage error: exit 2, no traceback."""
    res = run("query", "key", "TopicA")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr


def test_rebuild_then_query_key(store):
    """rebuild writes consumequeue/ and index/; query key finds a message by a CJK+emoji key."""
    tmp, config, results = store
    res = run("rebuild", "--config", str(config), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["messages"] == len(results)
    assert summary["endOffset"] == results[-1].phy_offset + results[-1].msg_size
    assert (tmp / "out" / "consumequeue" / "TopicA" / "0").is_dir()
    assert list((tmp / "out" / "index").iterdir())
    res = run("query", "key", "TopicA", "订单😀3", "--config", str(config), "--json")
    assert res.returncode == 0, res.stderr
    found = [json.loads(line) for line in res.stdout.splitlines()]
    expected = [r for i, r in enumerate(results) if i % 2 == 0 and i % 7 == 3]
    assert [m["commitLogOffset"] for m in found] == sorted((r.phy_offset for r in expected), reverse=True)[:64]
    for field in ("commitLogOffset", "msgId", "topic", "queueId", "queueOffset", "storeTimestamp", "bornTimestamp",
                  "tags", "keys", "uniqKey", "sysFlag", "bodySize"):
        assert field in found[0]


def test_query_key_raw_prints_candidate_offsets(store):
    """--raw prints the index's candidates, newest first, one per line."""
    _tmp, config, results = store
    assert run("rebuild", "--config", str(config)).returncode == 0
    res = run("query", "key", "TopicB", "order-5", "--raw", "--config", str(config))
    assert res.returncode == 0, res.stderr
    assert [int(x) for x in res.stdout.split()] == [results[5].phy_offset]


def test_query_queue_and_msgid(store):
    """query queue walks a ConsumeQueue; query msgid decodes an offset msgId."""
    _tmp, config, results = store
    assert run("rebuild", "--config", str(config)).returncode == 0
    res = run("query", "queue", "TopicA", "1", "0", "--count", "3", "--config", str(config), "--json")
    assert res.returncode == 0, res.stderr
    *msgs, result = [json.loads(line) for line in res.stdout.splitlines()]
    assert result["status"] == "FOUND"
    assert result["nextBeginOffset"] == 3
    in_queue = [r for r in results if r.topic == "TopicA" and r.queue_id == 1]
    assert [m["commitLogOffset"] for m in msgs] == [r.phy_offset for r in in_queue[:3]]
    assert [m["queueOffset"] for m in msgs] == [0, 1, 2]
    res = run("query", "msgid", results[7].msg_id, "--config", str(config), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["commitLogOffset"] == results[7].phy_offset
    res = run("query", "queue", "TopicA", "1", "100000", "--config", str(config), "--format", "text")
    assert res.returncode == 0
    assert "OFFSET_OVERFLOW_BADLY" in res.stderr


def test_inspect_every_kind(store):
    """inspect streams a header line then entries for a segment, a ConsumeQueue file, an IndexFile, a checkpoint."""
    tmp, config, _ = store
    assert run("rebuild", "--config", str(config)).returncode == 0
    index_file = next((tmp / "out" / "index").iterdir())
    for path, kind in ((tmp / "store" / "commitlog" / f"{0:020d}", "commitlog"),
                       (tmp / "out" / "consumequeue" / "TopicA" / "0" / f"{0:020d}", "consumequeue"),
                       (index_file, "indexfile")):
        res = run("inspect", str(path), "--config", str(config), "--json", "--limit", "5")
        assert res.returncode == 0, res.stderr
        header, *rows = (json.loads(line) for line in res.stdout.splitlines())
        assert header["kind"] == kind
        assert len(rows) == 5
    stores = discover()
    if stores:
        res = run("inspect", str(stores[0].store / "checkpoint"), "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout.splitlines()[0])["kind"] == "checkpoint"


def test_produce_appends_and_resumes(tmp_path):
    """produce writes messages; a second run appends after them with continuing queue offsets."""
    config = write_config(tmp_path)
    assert run("produce", "--config", str(config), "--messages", "50", "--topics", "T1,T2").returncode == 0
    res = run("produce", "--config", str(config), "--messages", "50", "--topics", "T1,T2", "--seed", "9")
    assert res.returncode == 0, res.stderr
    assert run("rebuild", "--config", str(config)).returncode == 0
    res = run("query", "queue", "T1", "0", "0", "--count", "100", "--config", str(config), "--json")
    offsets = [json.loads(line)["queueOffset"] for line in res.stdout.splitlines()[:-1]]
    per_run = len(range(0, 50 // 2, 4))  # T1 takes every other message, queue 0 every fourth of those
    assert offsets == list(range(2 * per_run))


def test_produce_topic_count_makes_that_many_topics_of_each_name(tmp_path):
    """`--topic-count 3` over `--topics A,B`: six topics A0-A2, B0-B2, the messages in turn, 2 queues each."""
    config = write_config(tmp_path)
    res = run("produce", "--config", str(config), "--messages", "24", "--topics", "A,B", "--topic-count", "3",
              "--queues", "2")
    assert res.returncode == 0, res.stderr
    assert run("rebuild", "--config", str(config)).returncode == 0
    queues = sorted(str(p.relative_to(tmp_path / "out" / "consumequeue"))
                    for p in (tmp_path / "out" / "consumequeue").glob("*/*"))
    assert queues == [f"{t}{i}/{q}" for t in "AB" for i in range(3) for q in range(2)]


def test_config_error_names_the_key(tmp_path):
    """An impossible value exits 2 and names the key; so does a mistyped environment variable."""
    config = write_config(tmp_path, mappedFileSizeConsumeQueue=1234)
    res = run("rebuild", "--config", str(config))
    assert res.returncode == 2
    assert "store.mappedFileSizeConsumeQueue" in res.stderr
    res = run("rebuild", "--config", str(write_config(tmp_path)), env={"REPUTD_STORE_MAX_HASH_SLOTS": "3"})
    assert res.returncode == 2
    assert "REPUTD_STORE_MAX_HASH_SLOTS" in res.stderr
    assert "Traceback" not in res.stderr


def test_missing_commitlog_directory_is_a_clear_error(tmp_path):
    """A store root that does not exist: exit 2 naming the key that names it; a store root without a
    CommitLog directory: data missing, exit 1 naming the directory; no traceback."""
    res = run("rebuild", "--config", str(write_config(tmp_path)))
    assert res.returncode == 2
    assert f"reputd: error: {tmp_path / 'store'}: no such store root directory (store.storePathRootDir)" in res.stderr
    (tmp_path / "store").mkdir()
    res = run("rebuild", "--config", str(write_config(tmp_path)))
    assert res.returncode == 1
    assert f"{tmp_path / 'store' / 'commitlog'}: the store root {tmp_path / 'store'} has no commitlog/" in res.stderr
    assert "Traceback" not in res.stderr


def test_corrupt_record_exits_1_naming_file_offset_and_field(store):
    """A damaged PHYSICALOFFSET stops the rebuild with exit 1 and names file, offset and field."""
    tmp, config, results = store
    victim = results[10]
    segment = tmp / "store" / "commitlog" / f"{victim.phy_offset - victim.phy_offset % SEGMENT:020d}"
    with open(segment, "r+b") as f:
        f.seek(victim.phy_offset % SEGMENT + PHYSICAL_OFFSET_OFFSET)
        f.write((victim.phy_offset + 1).to_bytes(8, "big"))
    res = run("rebuild", "--config", str(config))
    assert res.returncode == 1
    assert str(segment) in res.stderr
    assert f"offset {victim.phy_offset}" in res.stderr
    assert "physical_offset" in res.stderr
    assert "Traceback" not in res.stderr


def test_hostile_topic_writes_nothing_outside_the_output(tmp_path):
    """A stored topic `../x` is a corrupt record: exit 1, and no file appears outside the output dir."""
    with CommitLogWriter(str(tmp_path / "store" / "commitlog"), SEGMENT) as w:
        w.append(Message("Fine", 0, b"a", {"KEYS": "k"}))
        w.append(Message("../x", 0, b"b", {"KEYS": "k"}))
    config = write_config(tmp_path)
    before = set(files_under(tmp_path.parent))
    res = run("rebuild", "--config", str(config))
    assert res.returncode == 1
    assert "topic" in res.stderr
    assert "Traceback" not in res.stderr
    created = set(files_under(tmp_path.parent)) - before
    out = str((tmp_path / "out").relative_to(tmp_path.parent))
    assert created
    assert all(p.startswith(out + os.sep) for p in created)
    assert not (tmp_path / "out" / "consumequeue" / ".." / "x").exists()


def test_cli_rebuild_of_a_conformance_store_is_byte_identical(tmp_path):
    """The CLI, not just the library, reproduces the broker's ConsumeQueue bytes."""
    stores = discover()
    assert stores
    s = stores[0]
    config = s.make_workspace(tmp_path)
    res = run("rebuild", "--config", str(config))
    assert res.returncode == 0, res.stderr
    assert files_under(tmp_path / "store" / "consumequeue") == files_under(s.store / "consumequeue")


def test_inspect_reports_a_corrupt_record(store):
    """inspect of a damaged segment prints the records before the damage and exits 1 naming it."""
    tmp, config, results = store
    segment = tmp / "store" / "commitlog" / f"{0:020d}"
    with open(segment, "r+b") as f:
        f.seek(results[3].phy_offset + PHYSICAL_OFFSET_OFFSET)
        f.write((12345).to_bytes(8, "big"))
    res = run("inspect", str(segment), "--json", "--config", str(config))
    assert res.returncode == 1
    assert len(res.stdout.splitlines()) == 1 + 3
    assert f"offset {results[3].phy_offset}" in res.stderr
    assert "physical_offset" in res.stderr


def _limit_file_size() -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_no_room_for_a_file_is_a_clean_error(store):
    """A file that cannot be allocated (here: over RLIMIT_FSIZE) exits 1 naming it, leaving no partial file."""
    tmp, _, _ = store
    config = write_config(tmp, maxIndexNum=100_000)  # a 2 MB IndexFile, over the 1 MB limit
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    res = subprocess.run([*REPUTD, "rebuild", "--config", str(config)], capture_output=True, text=True, env=env,
                         timeout=120, check=False, preexec_fn=_limit_file_size)
    assert res.returncode == 1, res.stderr
    assert "cannot allocate" in res.stderr
    assert "Traceback" not in res.stderr
    assert list((tmp / "out" / "index").iterdir()) == []


def _with_dispatchers(config: Path, dispatchers: list) -> Path:
    cfg = yaml.safe_load(config.read_text())
    cfg["dispatchers"] = dispatchers
    config.write_text(yaml.safe_dump(cfg))
    return config


def test_plugin_dispatcher_named_in_the_config_sees_every_batch(store):
    """A `package.module:Class` dispatcher gets its options, every batch in order, then close()."""
    tmp, config, results = store
    record = tmp / "batches.jsonl"
    _with_dispatchers(config, ["consumequeue", {"name": "tests.plugins.recording:RecordingDispatcher",
                                                "options": {"path": str(record)}}])
    res = run("rebuild", "--config", str(config), cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert lines[-1] == {"closed": True}
    assert [p for line in lines[:-1] for p in line["phy"]] == [r.phy_offset for r in results]
    assert (tmp / "out" / "consumequeue").is_dir()
    assert not (tmp / "out" / "index").exists()


@pytest.mark.parametrize(("name", "needle"), [("tests.plugins.nope:X", "cannot import"),
                                              ("tests.plugins.recording:Missing", "has no"),
                                              ("tests.plugins.recording:NotADispatcher", "lacks dispatch")])
def test_bad_plugin_is_a_config_error(store, name, needle):
    """A plug-in that cannot be imported, does not exist or lacks the protocol: exit 2 naming the entry."""
    tmp, config, _ = store
    _with_dispatchers(config, [{"name": name, "options": {"path": str(tmp / "x")}}])
    res = run("rebuild", "--config", str(config), cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 2, res.stderr
    assert "dispatchers[0]" in res.stderr
    assert needle in res.stderr
    assert "Traceback" not in res.stderr


def seen_at_the_pass(store, command: str, measure: str, preexec_fn=None) -> list:
    """Run `reputd COMMAND` in a child process whose pass over the CommitLog (`rebuild`, `verify` or
    `run_daemon`, as the library functions) is spied on: what the Python expression `measure` gave each
    time the command started its pass."""
    _, config, _ = store
    probe = (
        "import gc, json, resource, sys, daemon.engine.rebuild as rb, daemon.commands.verify as vf, "
        "daemon.engine.reput as rp\n"
        "from daemon import cli\n"
        "seen = []\n"
        "def spy(real):\n"
        "    def call(*a, **k):\n"
        f"        seen.append({measure})\n"
        "        return real(*a, **k)\n"
        "    return call\n"
        "rb.rebuild, vf.verify, rp.run_daemon = spy(rb.rebuild), spy(vf.verify), spy(rp.run_daemon)\n"
        f"args = [{command!r}, '--config', {str(config)!r}] + (['--until-caught-up'] if {command!r} == 'run' else [])\n"
        "code = cli.main(args)\n"
        "print(json.dumps(seen))\n"
        "sys.exit(code)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    if command == "verify":
        assert run("rebuild", "--config", str(config)).returncode == 0
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120,
                         check=False, preexec_fn=preexec_fn)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", ["rebuild", "verify"])
def test_whole_log_commands_freeze_start_up_objects_before_the_pass(store, command):
    """rebuild and verify move what start-up made out of the cyclic collector's reach before they read the
    CommitLog, and collect young objects less often (collections during the pass hold the GIL the read-ahead
    thread waits for, and a pass over 100,000 queues keeps several objects a queue); the library functions
    themselves leave a caller's gc alone."""
    seen = seen_at_the_pass(store, command, "[gc.get_freeze_count(), gc.get_threshold()[0]]")
    assert len(seen) == 1, seen  # the command ran the pass once
    assert seen[0][0] > 1000, seen  # with start-up's objects (tens of thousands) frozen before it
    assert seen[0][1] == cli.PASS_GC_YOUNG, seen  # and young objects collected every 50,000 allocations, not 700


def test_whole_log_commands_keep_freed_memory_for_the_next_batch(store):
    """A pass sets glibc's malloc thresholds (mallopt) before it reads: freed batches' memory is reused, not given
    back and faulted in again zeroed for every batch; where there is no mallopt nothing is done."""
    seen = seen_at_the_pass(store, "rebuild", "__import__('daemon.cli.common', fromlist=['_']).PASS_STATE")
    assert seen == [{"memory_kept": True}]  # glibc's mallopt took both before the pass began
    calls = []

    class Libc:
        @staticmethod
        def mallopt(param, value):
            calls.append((param, value))
            return 1

    assert cli._keep_freed_memory(Libc())
    assert calls == [(cli.M_TRIM_THRESHOLD, cli.PASS_TRIM_THRESHOLD), (cli.M_MMAP_THRESHOLD, cli.PASS_MMAP_THRESHOLD)]
    assert not cli._keep_freed_memory(object())  # another C library: nothing to call


def test_rebuild_imports_neither_the_metrics_server_nor_verify(store):
    """A rebuild serves no metrics and verifies nothing: prometheus_client with http.server, `daemon.commands.verify`
    and numpy.ma (which `np.unique` imports) stay out of its process, 60 ms of CPU of every rebuild (0.25 s of
    imports against 0.19, measured on the 64-queue store's rebuild)."""
    _, config, _ = store
    probe = ("import sys\nfrom daemon import cli\n"
             f"code = cli.main(['rebuild', '--config', {str(config)!r}])\n"
             "print(' '.join(sorted(sys.modules)))\nsys.exit(code)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr
    loaded = set(res.stdout.strip().splitlines()[-1].split())
    assert {"daemon.engine.rebuild", "daemon.engine.recovery", "daemon.engine.cleaner"} <= loaded
    unneeded = {"prometheus_client", "http.server", "daemon.ops.metrics", "daemon.commands.verify", "numpy.ma"}
    assert not loaded & unneeded, sorted(loaded & unneeded)


@pytest.mark.parametrize("command", ["run", "rebuild", "verify"])
def test_store_commands_raise_the_open_files_limit_to_the_hard_one(store, command):
    """Started under a shell's low soft limit, run, rebuild and verify raise it to the hard limit before they
    open the store's files, as the broker's JVM does (a store keeps half the soft limit of its queue files
    open); the hard limit stays as it was."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 64
    if hard != resource.RLIM_INFINITY and hard <= low:
        pytest.skip(f"the hard limit here ({hard}) leaves nothing to raise")

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))

    seen = seen_at_the_pass(store, command, "resource.getrlimit(resource.RLIMIT_NOFILE)", preexec_fn=lower)
    wanted = cli.NOFILE_WHEN_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    assert seen == [[wanted, hard]], seen


def test_open_files_limit_left_alone_when_high_enough_or_refused(monkeypatch):
    """Nothing is lowered, an unlimited hard limit gets fs.nr_open's default, and a refusal is not an error."""
    import resource

    calls = []
    limits = {"now": (resource.RLIM_INFINITY, resource.RLIM_INFINITY)}
    monkeypatch.setattr(resource, "getrlimit", lambda _which: limits["now"])

    def setrlimit(_which, value):
        calls.append(value)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    cli.raise_open_files_limit()  # soft unlimited already
    limits["now"] = (4096, 1024 * 1024 * 4)
    cli.raise_open_files_limit()  # refused: no exception
    limits["now"] = (1024, resource.RLIM_INFINITY)
    cli.raise_open_files_limit()
    limits["now"] = (8192, 8192)
    cli.raise_open_files_limit()  # at the hard limit already
    assert calls == [(1024 * 1024 * 4, 1024 * 1024 * 4), (cli.NOFILE_WHEN_UNLIMITED, resource.RLIM_INFINITY)]


def test_rebuild_called_as_a_library_function_leaves_gc_alone(store, monkeypatch):
    import gc

    from daemon.config import load_config
    from daemon.engine.rebuild import rebuild

    _, config, results = store
    for name in [k for k in os.environ if k.startswith("REPUTD_")]:
        monkeypatch.delenv(name)
    before = gc.get_freeze_count()
    assert rebuild(load_config(str(config))).messages == len(results)
    assert gc.get_freeze_count() == before


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
