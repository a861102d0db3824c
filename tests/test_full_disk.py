"""A full output file system under `reputd run`: the output directory is a small tmpfs of its own.

What must hold while there is no room: the daemon stays up (no SIGBUS: IndexFiles are allocated in full
when created and ConsumeQueue files written with pwrite, so no room is an OSError naming the file), says
so (an `output_space_exhausted` event naming the file and the errno, `reputd_output_space_exhausted_total`,
`/healthz` degraded), never checkpoints past what its files hold, and goes on by itself once room is made
(a remount with a bigger size, a deleted ballast file), or on the next start. Every scenario ends equal to
a clean `reputd rebuild`.

Where mounting is impossible (not root, no CAP_SYS_ADMIN), RLIMIT_FSIZE stands in for the full file
system: a file over the limit cannot be allocated (EFBIG; Python ignores the SIGXFSZ that comes with
it), and raising the limit of the running daemon with prlimit(2) makes room. The RLIMIT_FSIZE scenario
runs everywhere, so both ways of meeting "no room" are always tested; nothing here is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from daemon.engine.checkpoint import CHECKPOINT_FILE
from indexcore.indexfile import IndexHeader
from tests.stress import report, scale
from tests.test_daemon import REPUTD, Store, assert_same_as_rebuild, clean_env, output_files, wait_for

KEYS_PER_MESSAGE = 3  # a Store message's UNIQ_KEY and two KEYS
PAGE = 4096
CQ_UNIT = struct.Struct(">qiq")  # physical offset, size, tags code
SIGBUS_EXIT = -signal.SIGBUS


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _mount_works() -> tuple[bool, str]:
    probe = Path(f"/tmp/reputd-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        res = _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe))
        if res.returncode != 0:
            return False, res.stderr.strip() or f"mount exited {res.returncode}"
        _run("umount", str(probe))
        return True, ""
    except OSError as e:
        return False, str(e)
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


CAN_MOUNT, MOUNT_ERROR = _mount_works()


class Tmpfs:
    """A tmpfs of `size` bytes mounted on `path`; unmounted by close()."""

    def __init__(self, path: Path, size: int):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        res = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
        assert res.returncode == 0, f"mount tmpfs on {path}: {res.stderr}"
        self.mounted = True

    def resize(self, size: int) -> None:
        res = _run("mount", "-o", f"remount,size={size}", str(self.path))
        assert res.returncode == 0, f"remount {self.path}: {res.stderr}"

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def close(self) -> None:
        if self.mounted:
            if _run("umount", str(self.path)).returncode != 0:
                _run("umount", "-l", str(self.path))
            self.mounted = False


class Daemon:
    """`reputd run` with its JSON log collected by a thread (a pipe, so neither a full output file system
    nor RLIMIT_FSIZE can stop the log itself)."""

    def __init__(self, store: Store, *args: str):
        self.store = store
        self.proc = subprocess.Popen([*REPUTD, "run", "--config", str(store.config), *args], env=clean_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._drain, args=(self.proc.stdout, self.lines), daemon=True),
                         threading.Thread(target=self._drain, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self._threads:
            t.start()

    @staticmethod
    def _drain(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)

    def events(self, name: str | None = None) -> list[dict]:
        out = []
        for line in list(self.lines):
            if line.startswith("{"):
                event = json.loads(line)
                if name is None or event.get("event") == name:
                    out.append(event)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=5)
        # kept next to the store (not on the tmpfs) for a failing test's post-mortem
        log = self.store.tmp / f"daemon-{self.proc.pid}.log"
        log.write_text("".join(self.lines) + "".join(self.err))
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def rebuild_into(store: Store, out: Path) -> dict[str, bytes]:
    """A clean rebuild of the CommitLog as it is now, into a fresh directory (Store.rebuild() reuses one,
    and a rebuild into files from an earlier rebuild continues them)."""
    shutil.rmtree(out, ignore_errors=True)
    res = subprocess.run([*REPUTD, "rebuild", "--config", str(store.config), "--out", str(out)], env=clean_env(),
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    files = output_files(out)
    shutil.rmtree(out)
    return files


def checkpoint_offset(store: Store) -> int:
    return json.loads((store.out / CHECKPOINT_FILE).read_text())["payload"]["reputFromOffset"]


def assert_checkpoint_covered(snapshot: dict[str, bytes], reference: dict[str, bytes], checkpoint: int) -> None:
    """Every ConsumeQueue unit of a clean rebuild below the checkpoint is in the files as they were while
    the disk was full: the checkpoint never claims data the output does not hold."""
    checked = 0
    for name, ref in reference.items():
        if not name.startswith("consumequeue"):
            continue
        have = snapshot.get(name, b"")
        for pos in range(0, len(ref), CQ_UNIT.size):
            phy, size, _ = CQ_UNIT.unpack_from(ref, pos)
            if size == 0 or phy + size > checkpoint:
                continue
            assert have[pos : pos + CQ_UNIT.size] == ref[pos : pos + CQ_UNIT.size], \
                f"{name} unit at {pos} (offset {phy}) is below the checkpoint {checkpoint} but not on disk"
            checked += 1
    assert checked > 0


def assert_no_space_reported(daemon: Daemon, store: Store, errno_name: str) -> dict:
    """The event names the file and the errno; the counter and /healthz say the same; still running."""
    event = wait_for(lambda: next(iter(daemon.events("output_space_exhausted")), None), timeout=60,
                     what="output_space_exhausted event")
    assert event["errno"] == errno_name, event
    assert event["stage"] in ("dispatch", "flush", "recovery"), event
    assert Path(event["file"]).is_relative_to(store.out), event
    health = wait_for(lambda: (h := store.health())["status"] == "degraded" and "space" in h["reason"] and h,
                      timeout=30, what="health degraded by no space")
    assert errno_name in health["reason"]
    metrics = store.metrics()
    assert sum(v for k, v in metrics.items() if k.startswith("reputd_output_space_exhausted_total")) >= 1
    assert daemon.proc.poll() is None, f"daemon died ({daemon.proc.returncode}): {daemon.stderr[-2000:]}"
    assert "Traceback" not in daemon.stderr
    return health


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path, store={"flushConsumeQueueLeastPages": 0})
    yield s
    s.writer.close()


def _skip_unless_mount():
    """Without a mount the tmpfs tests cannot run: they are reported as skipped with the reason, and the
    RLIMIT_FSIZE test below (which always runs) covers the daemon's no-room path."""
    if not CAN_MOUNT:
        pytest.skip(f"mount -t tmpfs impossible ({MOUNT_ERROR}); test_rlimit_fsize_* covers no-room")


def test_full_tmpfs_stalls_cleanly_and_resumes_after_a_remount(store, tmp_path):
    _skip_unless_mount()
    fs = Tmpfs(store.out, 256 * 1024)
    try:
        store.append(600)
        daemon = Daemon(store)
        try:
            wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="first checkpoint")
            store.append(scale(3000, 12000))
            started = time.monotonic()
            health = assert_no_space_reported(daemon, store, "ENOSPC")
            stuck_for = time.monotonic() - started
            held = checkpoint_offset(store)
            assert held < store.end
            # stays stuck, and the checkpoint stays put, over a few retries
            time.sleep(3)
            assert daemon.proc.poll() is None
            assert store.health()["status"] == "degraded"
            assert checkpoint_offset(store) == held == store.health()["checkpointOffset"]
            snapshot = output_files(store.out)
            reference = rebuild_into(store, store.tmp / "stalled-reference")
            assert_checkpoint_covered(snapshot, reference, held)
            failed = daemon.events("dispatch_failed")
            assert failed
            assert all(e["errno"] == "ENOSPC" for e in failed)
            # the back-off grows while stuck at the same place (1, 2, 4 s...), so a full disk is not a
            # retry storm: at most 3 failed sessions in the first 6.5 s
            stamps = [datetime.fromisoformat(e["timestamp"]).timestamp()
                      for e in daemon.events("output_space_exhausted") if e["stage"] == "dispatch"]
            time.sleep(max(0.0, stamps[0] + 7 - time.time()))
            stamps = [datetime.fromisoformat(e["timestamp"]).timestamp()
                      for e in daemon.events("output_space_exhausted") if e["stage"] == "dispatch"]
            assert len([t for t in stamps if t - stamps[0] < 6.5]) <= 3, stamps
            fs.resize(8 * 1024 * 1024)
            freed = time.monotonic()
            wait_for(lambda: store.health().get("checkpointOffset") == store.end, timeout=60,
                     what="catch-up once room is made")
            resumed_in = time.monotonic() - freed
            assert store.health()["status"] == "healthy"
            store.append(300)  # and it keeps following
            wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="follows after room")
            metrics = store.metrics()
        finally:
            code = daemon.stop()
        assert code == 0, daemon.stderr
        assert_same_as_rebuild(store)
        report("full_disk_remount", messages=store.count, stalled_at=held, stuck_reported_after_s=round(stuck_for, 2),
               resumed_after_s=round(resumed_in, 2), health_reason=health["reason"].split(";")[0],
               no_space_events=int(sum(v for k, v in metrics.items()
                                       if k.startswith("reputd_output_space_exhausted_total"))))
    finally:
        fs.close()


def test_full_tmpfs_killed_while_full_resumes_on_restart_after_ballast_is_deleted(store, tmp_path):
    _skip_unless_mount()
    fs = Tmpfs(store.out, 2 * 1024 * 1024)
    try:
        store.append(600)
        assert store.run("--until-caught-up").returncode == 0
        ballast = fill_with_ballast(fs, "ballast", 40 * PAGE)  # leaves about 160 KiB
        store.append(scale(3000, 12000))
        # one-shot mode meets the full disk: exit 1 with the reason, not SIGBUS, not a traceback
        res = store.run("--until-caught-up")
        assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
        assert "Traceback" not in res.stderr
        ev = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
        assert any(e["event"] == "output_space_exhausted" and e["errno"] == "ENOSPC" for e in ev)
        held = checkpoint_offset(store)
        assert held < store.end
        daemon = Daemon(store)
        try:
            assert_no_space_reported(daemon, store, "ENOSPC")
            assert checkpoint_offset(store) == held
        finally:
            code = daemon.stop(signal.SIGKILL)  # the harshest way to stop while full
        assert code == -signal.SIGKILL
        assert_checkpoint_covered(output_files(store.out), rebuild_into(store, store.tmp / "stalled-reference"),
                                  checkpoint_offset(store))
        ballast.unlink()
        daemon = Daemon(store)
        try:
            wait_for(lambda: store.health().get("checkpointOffset") == store.end, timeout=60,
                     what="catch-up on restart with room")
            assert store.health()["status"] == "healthy"
            assert not daemon.events("output_space_exhausted")
        finally:
            code = daemon.stop()
        assert code == 0, daemon.stderr
        assert_same_as_rebuild(store)
    finally:
        fs.close()


def test_rlimit_fsize_no_room_then_room_via_prlimit(store):
    """No mount needed: an IndexFile (8,428 bytes here) over RLIMIT_FSIZE cannot be allocated. The daemon
    reports EFBIG naming the file, is neither killed by SIGXFSZ nor by SIGBUS, checkpoints nothing past
    what it holds, and catches up when the running process's limit is raised (prlimit)."""
    # 665 messages of 3 keys fill five IndexFiles of 399 entries exactly, so the very first record appended
    # next needs a new one, however the daemon's reads cut the appends into batches (with 600, the rest of
    # the fifth file took a batch that ended before the roll, and the checkpoint moved when that came first)
    index_num = yaml.safe_load(store.config.read_text())["store"]["maxIndexNum"]  # entry numbers start at 1
    store.append(5 * (index_num - 1) // KEYS_PER_MESSAGE)
    assert store.run("--until-caught-up").returncode == 0
    newest = max((store.out / "index").iterdir())
    assert IndexHeader.decode(newest.read_bytes()).index_count == index_num  # full: the next key rolls
    first = store.end
    daemon = Daemon(store)
    try:
        wait_for(lambda: store.health().get("checkpointOffset") == first, what="daemon up")
        # ConsumeQueue files (2,000 bytes) still fit; the signal that comes with EFBIG is ignored by Python
        resource.prlimit(daemon.proc.pid, resource.RLIMIT_FSIZE, (6000, resource.RLIM_INFINITY))
        store.append(scale(1500, 6000))
        assert_no_space_reported(daemon, store, "EFBIG")
        event = daemon.events("output_space_exhausted")[0]
        assert Path(event["file"]).parent == store.out / "index", event
        assert checkpoint_offset(store) == first  # the first batch needs a new IndexFile: nothing moves
        assert not (store.out / "index" / Path(event["file"]).name).exists()  # no partial file left
        resource.prlimit(daemon.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        wait_for(lambda: store.health().get("checkpointOffset") == store.end, timeout=60, what="catch-up")
        assert store.health()["status"] == "healthy"
    finally:
        code = daemon.stop()
    assert code not in (-signal.SIGXFSZ, SIGBUS_EXIT)
    assert code == 0, daemon.stderr
    assert_same_as_rebuild(store)


def fill_with_ballast(fs: Tmpfs, name: str, leave: int) -> Path:
    """Take all but `leave` bytes of the tmpfs with an allocated (not sparse) file."""
    ballast = fs.path / name
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(PAGE, fs.free_bytes() - leave))
    finally:
        os.close(fd)
    return ballast


@pytest.mark.stress_only
def test_full_tmpfs_repeatedly_while_following(store, tmp_path):
    """Stress: the disk fills and is freed (a ballast file deleted) again and again while messages keep
    arriving; every time the daemon stalls cleanly and goes on; the end equals a clean rebuild."""
    _skip_unless_mount()
    fs = Tmpfs(store.out, 32 * 1024 * 1024)
    cycles = 8
    try:
        store.append(600)
        daemon = Daemon(store)
        try:
            wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="first checkpoint")
            for cycle in range(cycles):
                seen = len(daemon.events("output_space_exhausted"))
                ballast = fill_with_ballast(fs, f"ballast-{cycle}", 40 * PAGE)
                store.append(3000)
                wait_for(lambda n=seen: len(daemon.events("output_space_exhausted")) > n, timeout=60,
                         what=f"disk full again (cycle {cycle})")
                assert daemon.proc.poll() is None
                assert store.health()["checkpointOffset"] < store.end
                ballast.unlink()
                wait_for(lambda: store.health().get("checkpointOffset") == store.end, timeout=90,
                         what=f"catch-up (cycle {cycle})")
        finally:
            code = daemon.stop()
        assert code == 0, daemon.stderr
        assert_same_as_rebuild(store)
        report("full_disk_cycles", cycles=cycles, messages=store.count,
               no_space_events=len(daemon.events("output_space_exhausted")))
    finally:
        fs.close()
