"""Real DLedger CommitLog stores written now, for the live-follow, mixed-store and truncation tests.

The writer is the real RocketMQ 4.9.3 `DLedgerCommitLog` on DLedger 0.2.3 (`../shared/realbroker/build_dledger.sh`,
`DLedgerConformanceWriter`), driven by `tests/fixtures/java/DLedgerLive.java` (`write`: a paced one-node-group
writer that can be killed with SIGKILL and started again on the same store; `reput`: the broker's own reput over a
store, which on a copy without consumequeue/, index/ and checkpoint is its cold rebuild) and by the harness's own
`mixed` mode (plain CommitLog, then DLedger from `dividedCommitlogOffset`). Every JVM runs in a private network
namespace when `unshare -n` is allowed (DLedger's RPC server listens on its peer port: parallel runs never meet),
else on a free port. Without java and javac the tests skip saying why, and fail under CI=true (`tests.tools`).

The store's sizes are the harness's (`SETTINGS`): 64 KiB data files, 1,280-byte ConsumeQueue files, 97 slots and
400 entries per IndexFile, so a few hundred messages roll every kind of file.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conformance import REPO
from tests.test_daemon import free_port
from tests.tools import require_tool

REALBROKER = Path(os.environ.get("REPUTD_REALBROKER_DIR", REPO.parent / "shared" / "realbroker"))
FIXTURE = REPO / "tests" / "fixtures" / "java" / "DLedgerLive.java"
# DLedgerConformanceWriter.config, as reputd spells it
SETTINGS = {"mappedFileSizeCommitLog": 65536, "mappedFileSizeConsumeQueue": 1280, "maxHashSlotNum": 97,
            "maxIndexNum": 400, "enableDLegerCommitLog": True, "dLegerGroup": "broker-a", "dLegerSelfId": "n0",
            "dLegerPeers": "n0-127.0.0.1:40911"}
SELF_ID = "n0"
JVM_FLAGS = ["-Xms128m", "-Xmx384m", "-Duser.timezone=UTC", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
             "-Dtls.server.mode=disabled", "--add-opens", "java.base/java.nio=ALL-UNNAMED",
             "--add-opens", "java.base/jdk.internal.ref=ALL-UNNAMED", "--add-opens", "java.base/sun.nio.ch=ALL-UNNAMED",
             "--add-exports", "java.base/sun.nio.ch=ALL-UNNAMED"]


@functools.cache
def _built() -> tuple[str, str]:
    """(the DLedger build directory, a directory with DLedgerLive compiled against it); built once a session."""
    require_tool("java", "openjdk-17-jdk-headless", "the real DLedger store tests were not run")
    require_tool("javac", "openjdk-17-jdk-headless", "the real DLedger store tests were not run")
    script = REALBROKER / "build_dledger.sh"
    if not script.is_file():
        pytest.skip(f"the real DLedger store tests need {script} (set REPUTD_REALBROKER_DIR)")
    res = subprocess.run([str(script)], capture_output=True, text=True, timeout=1800, check=False)
    assert res.returncode == 0, f"build_dledger.sh failed: {res.stderr[-2000:]}"
    assert res.stdout.strip(), "build_dledger.sh printed no build directory"
    build = res.stdout.strip().splitlines()[-1]
    classes = tempfile.mkdtemp(prefix="reputd-dledger-live-")
    res = subprocess.run(["javac", "-nowarn", "-cp", f"{build}/harness:{build}/classes:{build}/lib/*", "-d", classes,
                          str(FIXTURE)], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return build, classes


def dledger_build() -> str:
    """The DLedger build directory, or skip (fail under CI=true) saying why."""
    return _built()[0]


@functools.cache
def _netns() -> bool:
    """Whether a private network namespace with loopback up can be made here."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    res = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, timeout=30,
                         check=False)
    return res.returncode == 0


def java(main: str, *args: str) -> list[str]:
    """The command line running `main` (DLedgerLive or DLedgerConformanceWriter) with `args`; `{port}` in an
    argument becomes the DLedger peer port. In a private network namespace the JVM is the command's own process
    (exec), so a SIGKILL to it reaches the broker."""
    build, classes = _built()
    port = "40911" if _netns() else str(free_port())
    cmd = ["java", *JVM_FLAGS, "-cp", f"{classes}:{build}/harness:{build}/classes:{build}/lib/*", main,
           *(a.replace("{port}", port) for a in args)]
    if not _netns():
        return cmd
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def write(store: Path, messages: int, seed: int, log: Path, timeout: float = 300) -> dict:
    """A whole `DLedgerLive write` run (new or existing store); its summary (DLedger state, max offset)."""
    with log.open("a") as err:
        res = subprocess.run(java("DLedgerLive", "write", "--store", str(store), "--messages", str(messages),
                                  "--seed", str(seed), "--peer-port", "{port}"),
                             stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout, check=False)
    assert res.returncode == 0, log.read_text(errors="replace")[-3000:]
    return last_json(res.stdout)


def start_writer(store: Path, messages: int, seed: int, log: Path, index_num: int | None = None) -> subprocess.Popen:
    """A `DLedgerLive write` that is writing (its `STARTED` line read): kill it with `kill_writer`, or `finish`.
    `index_num` sets the writer's entries per IndexFile (SETTINGS' 400 otherwise)."""
    extra = ["--index-num", str(index_num)] if index_num is not None else []
    with log.open("a") as err:
        proc = subprocess.Popen(java("DLedgerLive", "write", "--store", str(store), "--messages", str(messages),
                                     "--seed", str(seed), "--peer-port", "{port}", *extra),
                                stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline()
    if not line.startswith("STARTED"):
        proc.kill()
        proc.wait()
        raise AssertionError("DLedgerLive did not start: " + log.read_text(errors="replace")[-3000:])
    return proc


def wait_puts(proc: subprocess.Popen, puts: int) -> None:
    """Until the writer has printed `PUT n` with n >= puts."""
    for line in proc.stdout:
        if line.startswith("PUT ") and int(line.split()[1]) >= puts:
            return
    raise AssertionError(f"the writer ended before {puts} puts (exit {proc.wait()})")


def kill_writer(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()


def finish(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"DLedgerLive write exited {proc.returncode}"
    return last_json(out)


def copy_logs(store: Path, dest: Path) -> Path:
    """A copy of the store's logs alone (dledger-n0/, and commitlog/ of a mixed store), sparse as written."""
    dest.mkdir(parents=True)
    for sub in (f"dledger-{SELF_ID}", "commitlog"):
        if (store / sub).is_dir():
            subprocess.run(["cp", "-r", "--sparse=always", str(store / sub), str(dest / sub)], check=True, timeout=120)
    return dest


def broker_rebuild(store: Path, dest: Path, log: Path) -> Path:
    """The broker's own cold rebuild of `store`'s logs in `dest` (its reput from nothing): the reference output."""
    copy_logs(store, dest)
    with log.open("a") as err:
        res = subprocess.run(java("DLedgerLive", "reput", "--store", str(dest), "--peer-port", "{port}"),
                             stdout=subprocess.PIPE, stderr=err, text=True, timeout=300, check=False)
    assert res.returncode == 0, log.read_text(errors="replace")[-3000:]
    return dest


def write_mixed(store: Path, plain: int, dledger: int, seed: int, log: Path) -> dict:
    """The harness's `mixed` store: `plain` messages in commitlog/, clean shutdown, then `dledger` more with
    enableDLegerCommitLog=true (DLedger from dividedCommitlogOffset). Returns its raw result."""
    raw = store.parent / (store.name + "-mixed.json")
    with log.open("a") as err:
        res = subprocess.run(java("DLedgerConformanceWriter", "mixed", "--store", str(store), "--seed", str(seed),
                                  "--messages-plain", str(plain), "--messages-dledger", str(dledger),
                                  "--peer-port", "{port}", "--out", str(raw)),
                             stdout=subprocess.PIPE, stderr=err, text=True, timeout=300, check=False)
    assert res.returncode == 0, log.read_text(errors="replace")[-3000:]
    return json.loads(raw.read_text())


def broker_files(root: Path) -> tuple[dict[str, bytes], list[bytes]]:
    """(ConsumeQueue files by relative path, IndexFiles in name order): the broker names IndexFiles by its wall
    clock, so they are compared by content in order."""
    cq = {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "consumequeue").rglob("*")) if p.is_file()}
    index = [p.read_bytes() for p in sorted((root / "index").iterdir())] if (root / "index").is_dir() else []
    return cq, index


def differences(reference: Path, ours: Path) -> list[str]:
    """What differs between two outputs: ConsumeQueue files by name, IndexFiles by position in name order."""
    cq_r, ix_r = broker_files(reference)
    cq_o, ix_o = broker_files(ours)
    differ = [n for n in sorted(set(cq_r) | set(cq_o)) if cq_r.get(n) != cq_o.get(n)]
    if len(ix_r) != len(ix_o):
        differ.append(f"IndexFiles: {len(ix_r)} vs {len(ix_o)}")
    differ += [f"IndexFile #{i}" for i, (a, b) in enumerate(zip(ix_r, ix_o, strict=False)) if a != b]
    return differ


def reputd_config(path: Path, root: Path, out: Path | None = None, **extra) -> Path:
    """A reputd config for a store the harness wrote (its sizes and DLedger keys)."""
    import yaml

    store = {"storePathRootDir": str(root), **SETTINGS, **extra.pop("store", {})}
    doc = {"store": store, "logging": {"level": "warning"}, **extra}
    if out is not None:
        doc["output"] = {"dir": str(out)}
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return path
