"""Papercuts an operator meets on a first day (issue 33, issue 27 §2 item 6): each through the real CLI as a
subprocess, checking the exit code and the line printed."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from daemon.ops.outlock import LOCK_FILE
from indexcore.commitlog import COMPRESSED_FLAG, Host
from indexcore.msgid import create_offset_msg_id
from indexcore.writer import CommitLogWriter, Message
from tests.conformance import discover
from tests.test_cli import REPUTD, SEGMENT, json_lines, make_store, run, write_config
from tests.tools import catches, require_tool

ROOT = Path(__file__).resolve().parents[1]


def no_traceback(res) -> None:
    assert "Traceback" not in res.stderr


def listing(path: Path) -> list[str]:
    """Every path under `path`, relative to it, sorted."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# --- 33.2: a command that fails before writing leaves no trace ----------------------------------------

def test_a_rebuild_refused_by_its_config_creates_no_output_directory(tmp_path):
    """Exit 2 on a size setting that is not the broker's, found before the new output directory is made
    (no note saying it was), and a path whose parent does not exist is refused, not made."""
    make_store(tmp_path, n=40)
    config = write_config(tmp_path, mappedFileSizeCommitLog=SEGMENT // 2)
    out = tmp_path / "new"
    res = run("rebuild", "--config", str(config), "--out", str(out))
    assert res.returncode == 2
    assert res.stderr.startswith("reputd: config error: ")
    assert "mappedFileSizeCommitLog" in res.stderr
    no_traceback(res)
    assert not out.exists()
    res = run("rebuild", "--config", str(write_config(tmp_path)), "--out", str(out / "w1out"))
    assert res.returncode == 2
    assert res.stderr == (f"reputd: error: {out / 'w1out'}: no such output directory, and no directory {out} to "
                          "create it in (--out): a writing command creates the output directory, not the path to it\n")
    assert not out.exists()


def test_run_on_a_busy_metrics_port_creates_no_output_directory(tmp_path):
    make_store(tmp_path, n=40)
    config = write_config(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run("run", "--config", str(config), "--out", str(tmp_path / "out-x"),
                  env={"REPUTD_METRICS_PORT": str(port), "REPUTD_METRICS_HOST": "127.0.0.1"})
    assert res.returncode == 2
    assert f"metrics.port: {port} on 127.0.0.1 is in use" in res.stderr
    assert not (tmp_path / "out-x").exists()


def test_a_failed_rebuild_leaves_an_existing_directory_as_it_was(tmp_path):
    """--from inside a record: exit 2 (found before the lock); the directory existed, so it stays, holding
    only what it held (not the lock file, not a checkpoint)."""
    make_store(tmp_path, n=40)
    config = write_config(tmp_path)
    out = tmp_path / "existing"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    res = run("rebuild", "--config", str(config), "--out", str(out), "--from", "5")
    assert res.returncode == 2
    assert "--from 5 is not a record boundary: it falls inside the record at [0, " in res.stderr
    assert listing(out) == ["notes.txt"]


def test_a_failure_after_writing_keeps_what_was_written(tmp_path):
    """A corrupt record half-way: what was dispatched before it stays, with the lock file and checkpoint
    (a rebuild run again continues it)."""
    results = make_store(tmp_path, n=300)
    config = write_config(tmp_path)
    seg = tmp_path / "store" / "commitlog" / f"{0:020d}"
    victim = results[150].phy_offset
    with open(seg, "r+b") as f:
        f.seek(victim + 4)
        f.write(b"\0\0\0\0")  # the magic code
    res = run("rebuild", "--config", str(config))
    assert res.returncode == 1
    assert f"offset {victim}" in res.stderr
    out = tmp_path / "out"
    assert (out / LOCK_FILE).exists()
    assert (out / "reputd.checkpoint").exists()
    assert any(p.is_file() for p in (out / "consumequeue").rglob("*"))


def test_a_held_reputd_lock_file_that_existed_stays(tmp_path):
    """A second rebuild refused by a size setting on an output that holds files: nothing of it is
    removed, the lock file included."""
    make_store(tmp_path, n=40)
    config = write_config(tmp_path)
    assert run("rebuild", "--config", str(config)).returncode == 0
    before = listing(tmp_path / "out")
    res = run("rebuild", "--config", str(write_config(tmp_path, mappedFileSizeConsumeQueue=4000)))
    assert res.returncode == 2, res.stderr
    assert listing(tmp_path / "out") == before


# --- 27 §2.6: a running broker's store root is refused before anything is written --------------------

HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)  # F_SETLK on [0, 1): FileChannel.tryLock(0, 1, false)
print("held", flush=True)
sys.stdin.read()
"""


def hold_broker_lock(path: Path) -> subprocess.Popen:
    """A process holding the broker's `lock` as the JVM does (a POSIX record lock, fcntl F_SETLK)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def broker_store(tmp: Path) -> tuple[Path, Path]:
    """A broker store root (CommitLog and the broker's `lock`) and a config whose output is that root."""
    make_store(tmp, n=40)
    (tmp / "store" / "lock").write_bytes(b"lock")
    return tmp / "store", write_config(tmp)


@pytest.mark.parametrize("command", ["rebuild", "run", "backfill"])
def test_a_store_root_whose_broker_holds_its_lock_is_refused_with_nothing_written(tmp_path, command):
    root, config = broker_store(tmp_path)
    before = listing(root)
    holder = hold_broker_lock(root / "lock")
    try:
        extra = ["--until-caught-up"] if command == "run" else []
        res = run(command, "--config", str(config), "--store", str(root), *extra)
        # a reader still reads: verify knows the broker is running by the same test
        checked = run("verify", "--config", str(config), "--store", str(root))
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert res.returncode == 2, res.stderr
    assert res.stderr == (f"reputd: error: output directory {root} is the store root of a running broker (PID "
                          f"{holder.pid} holds {root / 'lock'}), which writes consumequeue/ and index/ there "
                          f"itself: stop the broker first, or write elsewhere with --out DIR; nothing was written\n")
    assert listing(root) == before
    assert "broker running" in checked.stdout
    # writing elsewhere while the broker runs is what reputd is for; once it stops, the root is writable too
    res = run("rebuild", "--config", str(config), "--store", str(root), "--out", str(tmp_path / "elsewhere"))
    assert res.returncode == 0, res.stderr
    res = run("rebuild", "--config", str(config), "--store", str(root))
    assert res.returncode == 0, res.stderr


def test_a_store_root_of_the_real_broker_running_is_refused(tmp_path):
    """The real 4.9.3 store (LiveWriter: DefaultMessageStore.start() takes `lock`) writing into a root:
    `reputd rebuild` into it is exit 2 and leaves neither reputd.lock nor reputd.checkpoint there."""
    from tests.test_realbroker_live import REALBROKER, java_command

    require_tool("java", "default-jdk-headless", "the refusal was not checked against the real broker's lock")
    build = Path(os.environ.get("RMQ493_BUILD", "/var/tmp/rmq493-build"))
    if not (build / "harness" / "LiveWriter.class").is_file():
        pytest.skip(f"the real store is not built at {build} (run {REALBROKER / 'build.sh'})")
    root = tmp_path / "broker"
    sizes = {"mappedFileSizeCommitLog": 1 << 20, "mappedFileSizeConsumeQueue": 6000, "maxHashSlotNum": 97,
             "maxIndexNum": 400}
    config = write_config(tmp_path, storePathRootDir=str(root), **sizes)
    writer = subprocess.Popen([*java_command(str(build)), "LiveWriter", "--store", str(root), "--messages", "5000",
                               "--rate", "50", "--ha-port", "0", "--commitlog-size", str(1 << 20), "--cq-size",
                               "6000", "--hash-slots", "97", "--index-num", "400"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert writer.stdout.readline().startswith("STARTED"), "LiveWriter did not start"
        res = run("rebuild", "--config", str(config), "--store", str(root))
        left = {"reputd.lock", "reputd.checkpoint"} & set(os.listdir(root))
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    assert res.returncode == 2, res.stderr
    assert f"output directory {root} is the store root of a running broker (PID {writer.pid} holds" in res.stderr
    assert not left


# --- 33.1: piped `query queue` carries what a script pages on ----------------------------------------

def test_a_script_pages_through_a_queue_on_the_piped_result_line(built):
    """Messages, then one object with status, nextBeginOffset, minOffset and maxOffset, as the broker's
    GetMessageResult; a script asking from nextBeginOffset while status is FOUND gets every message once,
    and the overflow status is on stdout, not prose on stderr."""
    _tmp, config, results = built
    in_queue = [r.phy_offset for r in results if r.topic == "TopicA" and r.queue_id == 1]
    seen, offset, pages = [], 0, []
    while True:
        res = run("query", "queue", "TopicA", "1", str(offset), "--count", "7", "--config", str(config))
        assert res.returncode == 0
        assert res.stderr == ""
        *messages, result = json_lines(res.stdout)
        assert "commitLogOffset" not in result
        assert all("status" not in m for m in messages)
        pages.append(result)
        if result["status"] != "FOUND":
            break
        assert result["messageCount"] == len(messages)
        assert messages
        assert [m["queueOffset"] for m in messages] == list(range(offset, result["nextBeginOffset"]))
        seen += [m["commitLogOffset"] for m in messages]
        offset = result["nextBeginOffset"]
    assert seen == in_queue
    assert pages[0] == {"status": "FOUND", "nextBeginOffset": 7, "minOffset": 0, "maxOffset": len(in_queue),
                        "messageCount": 7, "topic": "TopicA", "queueId": 1, "offset": 0, "removed": 0,
                        "commitLogMinOffset": 0}
    assert pages[-1] == {"status": "OFFSET_OVERFLOW_ONE", "nextBeginOffset": len(in_queue), "minOffset": 0,
                         "maxOffset": len(in_queue), "messageCount": 0, "topic": "TopicA", "queueId": 1,
                         "offset": len(in_queue), "removed": 0, "commitLogMinOffset": 0}
    res = run("query", "queue", "TopicA", "1", "100000", "--config", str(config), "--json")
    assert res.returncode == 0
    assert res.stderr == ""
    assert json_lines(res.stdout) == [{"status": "OFFSET_OVERFLOW_BADLY", "nextBeginOffset": 0, "minOffset": 0,
                                       "maxOffset": len(in_queue), "messageCount": 0, "topic": "TopicA",
                                       "queueId": 1, "offset": 100000, "removed": 0, "commitLogMinOffset": 0}]
    # the terminal format is the human one: the status on stderr, no result object
    res = run("query", "queue", "TopicA", "1", "100000", "--config", str(config), "--format", "text")
    assert (res.returncode, res.stdout) == (0, "")
    assert res.stderr == f"OFFSET_OVERFLOW_BADLY: TopicA/1 holds queue offsets [0, {len(in_queue)})\n"


# --- 33.3: `query msgid` errors --------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "what"), [("hello", "not hexadecimal"), ("ABCDEF0123", "10 hex digits"),
                                            ("0" * 33, "33 hex digits")])
def test_text_that_cannot_be_a_msgid_is_a_usage_error(built, text, what):
    _tmp, config, _ = built
    res = run("query", "msgid", text, "--config", str(config))
    assert res.returncode == 2
    assert res.stderr == (f"reputd: error: {text!r} is not a msgId ({what}): an offset msgId is 32 hex digits "
                          "(IPv4 store host + port + CommitLog offset) or 56 (IPv6); a client msgId, the "
                          "UNIQ_KEY, 32 (56 from an IPv6 producer, 34 from a 5.x client)\n")


def test_a_msgid_that_names_no_message_is_one_line_with_no_impossible_address(built):
    """A UNIQ_KEY-like id whose port field is above 65535, and an offset msgId past the CommitLog: one line
    each, exit 1, and never shown as an address and offset."""
    _tmp, config, _ = built
    uniq = "13968CAF0DDBA0E07E8B15D5EE0F5AF4"  # as an offset msgId: 19.150.140.175, port 232497376
    res = run("query", "msgid", uniq, "--config", str(config))
    assert res.returncode == 1
    assert res.stderr == (f"reputd: error: no message with msgId {uniq}: not an offset msgId (its port would be "
                          "232497376, not in 0-65535); as a UNIQ_KEY: not in the index under any of 2 topics\n")
    negative = "C0A80001" "8001ABCD" "0000000000000010"  # pid 0x8001 makes the port field negative
    res = run("query", "msgid", negative, "--config", str(config))
    assert res.returncode == 1
    assert res.stderr.startswith(f"reputd: error: no message with msgId {negative}: not an offset msgId (its port "
                                 f"would be {0x8001ABCD - (1 << 32)}, not in 0-65535); as a UNIQ_KEY")
    far = create_offset_msg_id(Host(bytes([192, 0, 2, 1]), 10911), 1 << 40)
    res = run("query", "msgid", far, "--config", str(config))
    assert res.returncode == 1
    assert res.stderr.startswith(f"reputd: error: no message with msgId {far}: not an offset msgId of this "
                                 f"CommitLog (its offset would be {1 << 40}, outside the CommitLog's [0, ")
    assert len(res.stderr.splitlines()) == 1


def test_a_uniq_key_with_an_impossible_port_is_found_by_its_key(tmp_path):
    """A producer's UNIQ_KEY that reads as 19.150.140.175:232497376: answered as the UNIQ_KEY it is."""
    uniq = "13968CAF0DDBA0E07E8B15D5EE0F5AF4"
    with CommitLogWriter(str(tmp_path / "store" / "commitlog"), SEGMENT) as w:
        w.append(Message("TopicA", 0, b"x", {"UNIQ_KEY": "0" * 32}))
        found = w.append(Message("TopicA", 1, b"hello", {"UNIQ_KEY": uniq}))
    config = write_config(tmp_path)
    assert run("rebuild", "--config", str(config)).returncode == 0
    res = run("query", "msgid", uniq, "--config", str(config))
    assert (res.returncode, res.stderr) == (0, "")
    assert [m["commitLogOffset"] for m in json_lines(res.stdout)] == [found.phy_offset]


# --- 33.6: an interrupted rebuild's summary line says so ------------------------------------------------

@pytest.mark.parametrize("as_json", [False, True])
def test_an_interrupted_rebuilds_summary_says_interrupted(tmp_path, as_json):
    """SIGINT mid-rebuild: exit 130, and the stdout summary read alone cannot pass for success: the line
    starts with `interrupted:`, the --json summary has `interrupted: true`."""
    from tests.test_one_writer import WAIT_S, _env, _slow_config

    results = make_store(tmp_path, n=2000)  # a dozen 64 KiB segments, one batch each
    started = tmp_path / "started"
    config = _slow_config(tmp_path, "out", started)
    proc = subprocess.Popen([*REPUTD, "rebuild", "--config", str(config), *(["--json"] if as_json else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    deadline = time.monotonic() + WAIT_S
    while not (started.exists() and len(started.read_text().split()) >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the rebuild did not reach its second batch"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, err
    assert "reputd: interrupted by SIGINT: stopped at CommitLog offset" in err
    (line,) = out.splitlines()
    if as_json:
        summary = json.loads(line)
        assert summary["interrupted"] is True
        assert summary["startOffset"] == 0
        assert 0 < summary["endOffset"] < results[-1].phy_offset
    else:
        assert line.startswith("interrupted: rebuilt "), line


@pytest.mark.parametrize("command", ["rebuild", "verify", "query"])
@pytest.mark.parametrize(("sig", "after"), [(signal.SIGINT, 0.0), (signal.SIGTERM, 0.0), (signal.SIGINT, 0.03)],
                         ids=["int-0s", "term-0s", "int-0.03s"])
def test_a_signal_while_a_command_starts_is_one_line_and_130(tmp_path, command, sig, after):
    """SIGINT or SIGTERM once reputd's first lines run, while it still imports its modules (numpy alone takes
    longer than `after`): the one line `reputd: interrupted`, exit 130, no output directory. A SIGINT printed
    a KeyboardInterrupt traceback and the process died of the signal; a SIGTERM ended it silently (143)."""
    make_store(tmp_path, n=200)
    config = write_config(tmp_path)
    args = {"rebuild": ["rebuild", "--config", str(config), "--out", str(tmp_path / "out")],
            "verify": ["verify", "--config", str(config)],
            "query": ["query", "key", "TopicA", "k1", "--config", str(config)]}[command]
    proc = subprocess.Popen([*REPUTD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 60
    while proc.poll() is None and not catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(after)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "reputd: interrupted\n", err
    assert not (tmp_path / "out").exists()


# --- 33.8: compressed bodies --------------------------------------------------------------------------

TEXT = "compressed body, 压缩的消息 " * 20


@pytest.fixture
def compressed(tmp_path):
    """A zlib body with COMPRESSED_FLAG, a body with the flag that is not zlib, and a plain one."""
    with CommitLogWriter(str(tmp_path / "store" / "commitlog"), SEGMENT) as w:
        good = w.append(Message("TopicA", 0, zlib.compress(TEXT.encode()), {"KEYS": "k1"}, sys_flag=COMPRESSED_FLAG))
        bad = w.append(Message("TopicA", 0, b"not zlib at all", {"KEYS": "k2"}, sys_flag=COMPRESSED_FLAG))
        plain = w.append(Message("TopicA", 0, b"plain", {"KEYS": "k3"}))
    config = write_config(tmp_path)
    assert run("rebuild", "--config", str(config)).returncode == 0
    return tmp_path, config, good, bad, plain


def test_a_compressed_body_is_shown_and_saved_decompressed_and_says_so(compressed):
    tmp, config, good, _bad, _plain = compressed
    stored = zlib.compress(TEXT.encode())
    res = run("query", "msgid", good.msg_id, "--config", str(config), "--format", "text", "--body",
              "--save-body", str(tmp / "bodies"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert f"Body Size:           {len(stored)}" in lines
    assert (f"Body Compression:    zlib; shown decompressed ({len(TEXT.encode()):,} bytes; --raw-body: as stored)"
            in lines)
    assert f"Body:                {TEXT}" in lines
    assert (tmp / "bodies" / good.msg_id).read_bytes() == TEXT.encode()
    (msg,) = json_lines(run("query", "msgid", good.msg_id, "--config", str(config), "--body").stdout)
    assert msg["body"] == TEXT
    assert msg["bodyCompression"] == {"type": "zlib", "decompressed": True, "size": len(TEXT.encode())}
    assert msg["bodySize"] == len(stored)


def test_raw_body_keeps_the_stored_bytes(compressed):
    tmp, config, good, _bad, _plain = compressed
    stored = zlib.compress(TEXT.encode())
    res = run("query", "queue", "TopicA", "0", "0", "--count", "1", "--config", str(config), "--raw-body",
              "--save-body", str(tmp / "raw"))
    assert res.returncode == 0, res.stderr
    msg, _result = json_lines(res.stdout)
    assert base64.b64decode(msg["bodyBase64"]) == stored
    assert msg["bodyCompression"] == {"type": "zlib", "decompressed": False}
    assert (tmp / "raw" / good.msg_id).read_bytes() == stored
    res = run("query", "msgid", good.msg_id, "--config", str(config), "--format", "text", "--raw-body")
    assert "Body Compression:    zlib; shown as stored (--raw-body)" in res.stdout.splitlines()


def test_a_body_that_does_not_decompress_is_shown_as_stored_saying_why(compressed):
    tmp, config, _good, bad, plain = compressed
    res = run("query", "msgid", bad.msg_id, "--config", str(config), "--format", "text", "--body",
              "--save-body", str(tmp / "bodies"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert ("Body Compression:    zlib, but it does not decompress (Error -3 while decompressing data: incorrect "
            "header check); shown as stored") in lines
    assert "Body:                not zlib at all" in lines
    assert (tmp / "bodies" / bad.msg_id).read_bytes() == b"not zlib at all"
    res = run("query", "msgid", plain.msg_id, "--config", str(config), "--format", "text", "--body")
    assert not [line for line in res.stdout.splitlines() if line.startswith("Body Compression")]
    assert "Body:                plain" in res.stdout.splitlines()


def test_the_brokers_compressed_bodies_decompress(tmp_path):
    """COMPRESSED_FLAG bodies of the broker-written store (the first six; each is two CLI runs): --raw-body
    saves the stored bytes (the manifest's sha256), and the default saves what zlib inflates them to."""
    stores = [s for s in discover() if any(m["sys_flag"] & COMPRESSED_FLAG for m in s.manifest["messages"])]
    if not stores:
        pytest.skip("no conformance store with compressed bodies (set REPUTD_CONFORMANCE_DIR)")
    store = stores[0]
    config = store.make_workspace(tmp_path)
    assert run("rebuild", "--config", str(config)).returncode == 0
    wanted = [m for m in store.manifest["messages"] if m["sys_flag"] & COMPRESSED_FLAG][:6]
    for raw in (True, False):
        out = tmp_path / ("raw" if raw else "inflated")
        for m in wanted:
            res = run("query", "msgid", m["msg_id"], "--config", str(config), "--save-body", str(out),
                      *(["--raw-body"] if raw else []))
            assert res.returncode == 0, res.stderr
            assert json_lines(res.stdout)[0]["bodyCompression"]["decompressed"] is not raw
    for m in wanted:
        stored = (tmp_path / "raw" / m["msg_id"]).read_bytes()
        assert hashlib.sha256(stored).hexdigest() == m["body_sha256"]
        assert (tmp_path / "inflated" / m["msg_id"]).read_bytes() == zlib.decompress(stored)


# --- 33.11: the tools the suite runs are installed, and missing in CI is a failure -----------------------

SYSTEM_TOOLS = ROOT / ".ci" / "system-tools"
TOOLS_NEEDED = ("promtool (Debian package prometheus), jq (Debian package jq), systemd-analyze (Debian package "
                "systemd), java (Debian package default-jdk-headless), javac (Debian package default-jdk-headless)")


def bare_path(tmp: Path, *, root: bool) -> Path:
    """A PATH directory holding bash and an `id` (saying uid 0 when `root`), and none of the tools."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to(shutil.which("bash"))
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {0 if root else 1000}\n")
    (bin_dir / "id").chmod(0o755)
    return bin_dir


def system_tools(bin_dir: Path, *args: str, ci: bool) -> subprocess.CompletedProcess:
    env = {"PATH": str(bin_dir), **({"CI": "true"} if ci else {})}
    return subprocess.run([str(bin_dir / "bash"), str(SYSTEM_TOOLS), *args], capture_output=True, text=True,
                          env=env, timeout=60, check=False)


def test_system_tools_names_what_is_missing_and_fails_only_in_ci(tmp_path):
    """No root, no apt-get: a developer's `make test` goes on (the tests skip, saying why); CI stops."""
    bin_dir = bare_path(tmp_path, root=False)
    res = system_tools(bin_dir, "--install", ci=True)
    assert res.returncode == 1
    assert res.stderr == (f"error: the test suite needs {TOOLS_NEEDED}; install them (as root: .ci/system-tools "
                          "--install)\n")
    res = system_tools(bin_dir, "--install", ci=False)
    assert res.returncode == 0
    assert res.stderr.startswith(f"note: not installed: {TOOLS_NEEDED}; the tests that run them will skip")


FAKE_APT_GET = """#!{python}
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "calls"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1] == "update":
    open(os.path.join(here, "lists"), "w").close()
    sys.exit(0)
if not os.path.exists(os.path.join(here, "lists")):  # a fresh image: no package lists were ever fetched
    print("E: Unable to locate package prometheus", file=sys.stderr)
    sys.exit(100)
for tool in ("promtool", "jq", "systemd-analyze", "java", "javac"):
    with open(os.path.join(here, tool), "w") as f:
        f.write("#!/bin/sh\\n")
    os.chmod(os.path.join(here, tool), 0o755)
"""


def test_system_tools_fetches_the_package_lists_on_a_fresh_machine(tmp_path):
    """As root on a machine whose apt-get has never run `update`: install fails, the lists are fetched,
    install runs again, and every tool is there (apt-get here is a stand-in recording its calls)."""
    bin_dir = bare_path(tmp_path, root=True)
    (bin_dir / "apt-get").write_text(FAKE_APT_GET.replace("{python}", sys.executable))
    (bin_dir / "apt-get").chmod(0o755)
    res = system_tools(bin_dir, "--install", ci=True)
    assert res.returncode == 0, res.stderr
    install = "install -y -q --no-install-recommends prometheus jq systemd default-jdk-headless"
    assert (bin_dir / "calls").read_text().splitlines() == [install, "update -q", install]
    assert "installing prometheus jq systemd default-jdk-headless for the tests that run them" in res.stderr
    res = system_tools(bin_dir, "--install", ci=True)  # nothing missing: nothing run
    assert (res.returncode, res.stderr) == (0, "")
    assert len((bin_dir / "calls").read_text().splitlines()) == 3


@pytest.mark.parametrize("ci", [True, False])
def test_a_test_needing_a_missing_tool_fails_in_ci_and_skips_elsewhere(tmp_path, ci):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env.update({"PATH": str(tmp_path), **({"CI": "true"} if ci else {})})
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/test_ops_kit.py::test_promtool_checks_the_rules"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300, check=False)
    reason = ("promtool is not installed (Debian: apt-get install --no-install-recommends prometheus, or as root "
              ".ci/system-tools --install); the rules' unit tests in config/prometheus/reputd-rules.test.yml were "
              "not run")
    if ci:
        assert res.returncode == 1, res.stdout
        assert f"CI=true: {reason}" in res.stdout
        assert "1 failed" in res.stdout
    else:
        assert res.returncode == 0, res.stdout
        assert "1 skipped" in res.stdout
        assert reason in " ".join(res.stdout.split())


def test_make_test_and_ci_install_the_tools_first():
    """`make test` runs .ci/system-tools --install before pytest; .ci/run makes a missing tool fatal."""
    res = subprocess.run(["make", "-n", "test"], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    commands = res.stdout.splitlines()
    assert ".ci/system-tools --install" in commands
    assert commands.index(".ci/system-tools --install") < next(
        i for i, c in enumerate(commands) if "-m pytest" in c)
    assert 'export CI="${CI:-true}"' in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_closing_line_says_one_file_and_one_segment_in_the_singular(tmp_path):
    """`1 index file`, `from 1 segment`: the counts of the closing line agree with their nouns (`1 index files` was
    printed by every rebuild of a store with one IndexFile)."""
    make_store(tmp_path, topics=("TopicA",), n=3)
    config = write_config(tmp_path, maxIndexNum=5000)
    res = run("rebuild", "--config", str(config))
    assert res.returncode == 0, res.stderr
    assert "; 3 consumequeue files, 1 index file; output " in res.stdout, res.stdout
