"""What a running `reputd run` exposes and what it needs.

* Metrics and health listen on loopback by default (the endpoint has no authentication): the defaults,
  the shipped config, and the sockets a running daemon actually holds (/proc/net/tcp{,6}), plus a
  connection to a non-loopback address of this machine that must be refused.
* The CommitLog can be read-only: a read-only bind mount (root ignores file modes, so chmod alone proves
  nothing), and the daemon's own mappings and descriptors of CommitLog files are read-only
  (/proc/PID/maps, /proc/PID/fdinfo) while it follows and dispatches correctly.
* A plug-in dispatcher is code to import, so only the config file may name one: `REPUTD_DISPATCHERS` and
  the `dispatchers` override may choose among the built-ins and the file's plug-ins, nothing else.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from daemon.config import ConfigError, MetricsConfig, default_config, load_config
from daemon.ops.metrics import Health, MetricsServer, ReputMetrics
from tests.test_daemon import REPUTD, Store, assert_same_as_rebuild, clean_env, free_port, stop, wait_for

ROOT = Path(__file__).resolve().parent.parent
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


# --- metrics on loopback ---------------------------------------------------------------------------

def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket the process holds, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state != LISTEN or inode not in inodes:
                    continue
                addr_hex, port_hex = local.split(":")
                raw = bytes.fromhex(addr_hex)
                # /proc prints the address as host-order 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.append((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return out


def non_loopback_addresses() -> list[str]:
    """IPv4 addresses of this machine other than 127/8 (the primary route's, and those `ip` lists)."""
    found = set()
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.123", 9))  # no packet is sent: this only picks the source address
        found.add(s.getsockname()[0])
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        res = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=5, check=False)
        for line in res.stdout.splitlines():
            parts = line.split()
            if "inet" in parts:
                found.add(parts[parts.index("inet") + 1].split("/")[0])
    return sorted(a for a in found if not a.startswith("127."))


def test_metrics_default_to_loopback_in_code_and_shipped_config():
    assert MetricsConfig().host == "127.0.0.1"
    assert default_config().metrics.host == "127.0.0.1"
    assert load_config(ROOT / "config" / "reputd.yaml", env={}).metrics.host == "127.0.0.1"


def test_a_running_daemon_listens_on_loopback_only(tmp_path):
    store = Store(tmp_path)  # its config sets metrics.port only, so the host is the default
    assert "host" not in yaml.safe_load(store.config.read_text())["metrics"]
    store.append(200)
    proc = store.start()
    try:
        wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="daemon up")
        sockets = listening_sockets(proc.pid)
        assert sockets == [("127.0.0.1", store.port)], sockets
        addresses = non_loopback_addresses()
        assert addresses, "this machine has no non-loopback IPv4 address to try"
        for address in addresses:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, store.port), timeout=5).close()
    finally:
        code, _, err = stop(proc)
    assert code == 0, err
    store.writer.close()


def test_the_non_loopback_probe_does_see_a_wildcard_bind():
    """The control for the test above: bound to 0.0.0.0, the endpoint is reachable on those addresses."""
    addresses = non_loopback_addresses()
    assert addresses
    server = MetricsServer("0.0.0.0", free_port(), ReputMetrics(lambda: None), Health())
    server.start()
    try:
        # this process may hold other listening sockets (pyspark's accumulator server, in a full run)
        assert ("0.0.0.0", server.address[1]) in listening_sockets(os.getpid())
        with socket.create_connection((addresses[0], server.address[1]), timeout=5):
            pass
    finally:
        server.stop()


# --- a read-only CommitLog -------------------------------------------------------------------------

def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


class ReadOnlyBind:
    """`src` bind-mounted read-only on `dst`: writes through `dst` fail with EROFS, even for root."""

    def __init__(self, src: Path, dst: Path):
        dst.mkdir(parents=True)
        self.dst = dst
        self.mounted = False
        res = _run("mount", "--bind", str(src), str(dst))
        self.error = res.stderr.strip()
        if res.returncode == 0:
            self.mounted = True
            res = _run("mount", "-o", "remount,ro,bind", str(dst))
            self.error = res.stderr.strip()
            if res.returncode != 0:
                self.close()

    def close(self) -> None:
        if self.mounted and _run("umount", str(self.dst)).returncode != 0:
            _run("umount", "-l", str(self.dst))
        self.mounted = False


def chmod_read_only(directory: Path) -> None:
    for p in [directory, *directory.iterdir()]:
        p.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH | (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
                                                                 if p.is_dir() else 0))


def commitlog_access(pid: int, commitlog: str) -> tuple[list[str], list[int]]:
    """Permissions of the process's mappings of CommitLog files, and the access mode of its descriptors."""
    maps, modes = [], []
    with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith(commitlog + os.sep):
                maps.append(parts[1])
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(commitlog):
                flags = next(line for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                             if line.startswith("flags:"))
                modes.append(int(flags.split()[1], 8) & os.O_ACCMODE)
    return maps, modes


def test_follows_a_read_only_commitlog(tmp_path):
    """The broker's side (`store`) stays writable; the daemon reads the same files through a read-only
    bind mount (`ro-store`) that are also mode 0444: it follows, rolls, dispatches, and every mapping
    and descriptor of a CommitLog file it holds is read-only."""
    store = Store(tmp_path)
    store.append(500)
    bind = ReadOnlyBind(tmp_path / "store", tmp_path / "ro-store")
    try:
        cfg = yaml.safe_load(store.config.read_text())
        cfg["store"]["storePathRootDir"] = str(tmp_path / "ro-store")
        store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
        ro_log = str(tmp_path / "ro-store" / "commitlog")
        chmod_read_only(tmp_path / "store" / "commitlog")
        if bind.mounted:
            with pytest.raises(OSError, match="Read-only file system") as info:
                os.open(os.path.join(ro_log, sorted(os.listdir(ro_log))[0]), os.O_RDWR)
            assert info.value.errno == errno.EROFS  # enforced even for root
        else:
            # no mount here (not root?): mode 0444 and the checks of the daemon's own maps and fds remain
            sys.stderr.write(f"read-only bind mount unavailable ({bind.error}); checking maps/fdinfo only\n")
        proc = store.start()
        seen_maps: list[str] = []
        seen_modes: list[int] = []
        try:
            wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="daemon up")
            for _ in range(6):
                store.append(400)  # segment rolls included (about 650 records a segment)
                chmod_read_only(tmp_path / "store" / "commitlog")
                deadline = time.monotonic() + 30
                while store.health().get("reputFromOffset") != store.end:
                    maps, modes = commitlog_access(proc.pid, ro_log)
                    seen_maps += maps
                    seen_modes += modes
                    assert time.monotonic() < deadline, "daemon did not catch up"
                    time.sleep(0.005)
                maps, modes = commitlog_access(proc.pid, ro_log)
                seen_maps += maps
                seen_modes += modes
            wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="checkpoint at the end")
            assert store.health()["status"] == "healthy"
        finally:
            code, out, err = stop(proc)
        assert code == 0, err
        assert seen_maps, "never saw the daemon map a CommitLog segment"
        assert all(p[1] == "-" for p in seen_maps), sorted(set(seen_maps))
        assert all(m == os.O_RDONLY for m in seen_modes), seen_modes
        assert "segment_rolled" in out
        assert_same_as_rebuild(store)
    finally:
        bind.close()
        store.writer.close()


# --- plug-ins only from the config file ------------------------------------------------------------

PLUGIN_SOURCE = '''
import os
open(os.environ["PLUGIN_MARKER"], "a").write("imported\\n")


class Dispatcher:
    name = "probe"

    def __init__(self, options, store, output_dir):
        self.options = options

    def dispatch(self, batch):
        pass

    def flush(self):
        pass

    def close(self):
        pass
'''


def test_environment_cannot_name_a_plugin_the_file_does_not():
    env = {"REPUTD_DISPATCHERS": "consumequeue,index,evil.module:Payload"}
    with pytest.raises(ConfigError) as info:
        load_config(None, env=env)
    assert info.value.key == "dispatchers[2]"
    assert "config file" in str(info.value)
    assert "REPUTD_DISPATCHERS" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides={"dispatchers": ["evil.module:Payload"]})
    assert info.value.key == "dispatchers[0]"
    # built-ins may still be chosen and ordered from the environment
    config = load_config(None, env={"REPUTD_DISPATCHERS": "index"})
    assert [d.name for d in config.dispatchers] == ["index"]


def test_environment_may_choose_among_the_files_plugins(tmp_path):
    path = tmp_path / "reputd.yaml"
    path.write_text(yaml.safe_dump({"dispatchers": [
        "consumequeue", "index", {"name": "acme.audit:Audit", "options": {"path": "/var/log/audit"}}]}))
    config = load_config(path, env={"REPUTD_DISPATCHERS": "acme.audit:Audit, consumequeue"})
    assert [d.name for d in config.dispatchers] == ["acme.audit:Audit", "consumequeue"]
    assert dict(config.dispatchers[0].options) == {"path": "/var/log/audit"}  # the file's options
    with pytest.raises(ConfigError):
        load_config(path, env={"REPUTD_DISPATCHERS": "acme.audit:Other"})


def test_reputd_run_never_imports_a_plugin_named_only_in_the_environment(tmp_path):
    """End to end: the module is importable (PYTHONPATH) and would leave a marker when imported; named
    by REPUTD_DISPATCHERS it is refused with exit 2 and never imported; named by the file it runs."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "probeplugin.py").write_text(PLUGIN_SOURCE)
    marker = tmp_path / "imported"
    store = Store(tmp_path)
    store.append(50)
    store.writer.close()
    env = clean_env({"PYTHONPATH": os.pathsep.join([str(plugins), str(ROOT)]), "PLUGIN_MARKER": str(marker)})
    cmd = [*REPUTD, "run", "--config", str(store.config), "--until-caught-up"]
    res = subprocess.run(cmd, env={**env, "REPUTD_DISPATCHERS": "consumequeue,index,probeplugin:Dispatcher"},
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 2, res.stderr
    assert "dispatchers[2]" in res.stderr
    assert "Traceback" not in res.stderr
    assert not marker.exists()
    assert not (store.out / "consumequeue").exists()  # refused before anything ran
    # the control: named by the file, the same module is imported and run
    cfg = yaml.safe_load(store.config.read_text())
    cfg["dispatchers"] = ["consumequeue", "index", "probeplugin:Dispatcher"]
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert marker.read_text() == "imported\n"


def test_reputd_run_refuses_an_environment_plugin_before_anything_runs(tmp_path):
    """`reputd run` (not only load_config) refuses it: the CLI path reads the environment too."""
    store = Store(tmp_path)
    store.writer.close()
    proc = subprocess.Popen([*REPUTD, "run", "--config", str(store.config)],
                            env=clean_env({"REPUTD_DISPATCHERS": "os:system"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    assert proc.returncode == 2, err
    assert "only the config file may name one" in err
