"""daemon.ops.sdnotify against real AF_UNIX datagram sockets standing in for systemd's notification socket."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from daemon.ops.sdnotify import Notifier

RECV_TIMEOUT_S = 2.0


class FakeSystemd:
    """A bound datagram socket reading notifications the way systemd's manager does."""

    def __init__(self, sock: socket.socket, env_value: str, path: str | None) -> None:
        self.sock = sock
        self.env_value = env_value
        self.path = path

    def recv(self) -> str:
        return self.sock.recv(65536).decode("utf-8")

    def assert_nothing_sent(self) -> None:
        self.sock.setblocking(False)
        try:
            with pytest.raises(BlockingIOError):
                self.sock.recv(65536)
        finally:
            self.sock.settimeout(RECV_TIMEOUT_S)

    def vanish(self) -> None:
        self.sock.close()
        if self.path is not None:
            os.unlink(self.path)


@contextmanager
def _path_socket() -> Iterator[FakeSystemd]:
    # A short directory of its own: AF_UNIX paths are limited to 107 bytes, and pytest's tmp_path can be long.
    directory = tempfile.mkdtemp(prefix="sdn-")
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(RECV_TIMEOUT_S)
    try:
        yield FakeSystemd(sock, path, path)
    finally:
        sock.close()
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(directory)


@contextmanager
def _abstract_socket() -> Iterator[FakeSystemd]:
    name = f"reputd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(RECV_TIMEOUT_S)
    try:
        yield FakeSystemd(sock, "@" + name, None)
    finally:
        sock.close()


@pytest.fixture(params=["path", "abstract"])
def systemd(request) -> Iterator[FakeSystemd]:
    with _path_socket() if request.param == "path" else _abstract_socket() as fake:
        yield fake


@pytest.fixture
def path_systemd() -> Iterator[FakeSystemd]:
    with _path_socket() as fake:
        yield fake


def _notifier(fake: FakeSystemd, **extra: str) -> Notifier:
    return Notifier.from_env({"NOTIFY_SOCKET": fake.env_value, **extra})


# --- exact messages ---------------------------------------------------------------------------------------

def test_ready_alone(systemd):
    n = _notifier(systemd)
    assert n.enabled
    assert n.ready() is True
    assert systemd.recv() == "READY=1"
    assert n.last_error is None


def test_ready_with_status(systemd):
    assert _notifier(systemd).ready("following commitlog at 1024") is True
    assert systemd.recv() == "READY=1\nSTATUS=following commitlog at 1024"


def test_status(systemd):
    assert _notifier(systemd).status("recovering from checkpoint") is True
    assert systemd.recv() == "STATUS=recovering from checkpoint"


def test_stopping(systemd):
    n = _notifier(systemd)
    assert n.stopping() is True
    assert systemd.recv() == "STOPPING=1"
    assert n.stopping("flushing") is True
    assert systemd.recv() == "STOPPING=1\nSTATUS=flushing"


def test_extend_timeout(systemd):
    assert _notifier(systemd).extend_timeout(30_000_000) is True
    assert systemd.recv() == "EXTEND_TIMEOUT_USEC=30000000"


def test_extend_timeout_rejects_non_positive(systemd):
    with pytest.raises(ValueError, match="positive"):
        _notifier(systemd).extend_timeout(0)
    systemd.assert_nothing_sent()


def test_report_errno(systemd):
    assert _notifier(systemd).report_errno(5, "I/O error on commitlog") is True
    assert systemd.recv() == "ERRNO=5\nSTATUS=I/O error on commitlog"


def test_newlines_in_status_cannot_inject_assignments(systemd):
    assert _notifier(systemd).status("line one\nREADY=1\r\nx") is True
    assert systemd.recv() == "STATUS=line one READY=1  x"


def test_non_ascii_status_is_utf8(systemd):
    assert _notifier(systemd).status("主题 ok") is True
    assert systemd.recv() == "STATUS=主题 ok"


def test_watchdog_ping(systemd):
    n = _notifier(systemd, WATCHDOG_USEC="30000000", WATCHDOG_PID=str(os.getpid()))
    assert n.watchdog() is True
    assert systemd.recv() == "WATCHDOG=1"


def test_each_call_is_one_datagram(systemd):
    n = _notifier(systemd)
    assert n.status("a")
    assert n.status("b")
    assert [systemd.recv(), systemd.recv()] == ["STATUS=a", "STATUS=b"]


# --- watchdog settings ------------------------------------------------------------------------------------

def test_watchdog_interval_is_half_the_timeout(systemd):
    n = _notifier(systemd, WATCHDOG_USEC="30000000")
    assert n.watchdog_usec == 30_000_000
    assert n.watchdog_interval == 15.0


def test_watchdog_interval_sub_second(systemd):
    assert _notifier(systemd, WATCHDOG_USEC="1500").watchdog_interval == pytest.approx(0.00075)


def test_watchdog_pid_equal_to_ours_enables_it(systemd):
    n = _notifier(systemd, WATCHDOG_USEC="20000000", WATCHDOG_PID=str(os.getpid()))
    assert n.watchdog_interval == 10.0


def test_watchdog_pid_mismatch_disables_watchdog_only(systemd):
    n = _notifier(systemd, WATCHDOG_USEC="20000000", WATCHDOG_PID=str(os.getpid() + 1))
    assert n.watchdog_interval is None
    assert n.watchdog_usec is None
    assert n.watchdog() is True  # nothing to do, nothing failed
    systemd.assert_nothing_sent()
    assert n.ready() is True  # the notification socket itself is still ours to use
    assert systemd.recv() == "READY=1"


def test_watchdog_pid_checked_against_given_pid(systemd):
    env = {"NOTIFY_SOCKET": systemd.env_value, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "4242"}
    assert Notifier.from_env(env, pid=4242).watchdog_interval == 2.0
    assert Notifier.from_env(env, pid=4243).watchdog_interval is None


@pytest.mark.parametrize("usec", ["", "0", "-5", "abc", "1.5", " "])
def test_unusable_watchdog_usec_disables_watchdog(systemd, usec):
    n = _notifier(systemd, WATCHDOG_USEC=usec)
    assert n.watchdog_interval is None
    assert n.watchdog() is True
    systemd.assert_nothing_sent()


def test_unparsable_watchdog_pid_disables_watchdog(systemd):
    assert _notifier(systemd, WATCHDOG_USEC="1000000", WATCHDOG_PID="self").watchdog_interval is None


def test_watchdog_without_socket_is_off():
    n = Notifier.from_env({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.watchdog_interval is None


# --- no supervisor ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}])
def test_no_socket_every_method_is_a_no_op(env):
    n = Notifier.from_env(env)
    assert not n.enabled
    assert n.address is None
    assert n.watchdog_interval is None
    assert n.ready("x") is True
    assert n.status("x") is True
    assert n.watchdog() is True
    assert n.stopping() is True
    assert n.extend_timeout(1_000_000) is True
    assert n.report_errno(5) is True
    assert n.last_error is None
    assert n.errors == 0


def test_from_env_defaults_to_os_environ(monkeypatch, systemd):
    monkeypatch.setenv("NOTIFY_SOCKET", systemd.env_value)
    monkeypatch.setenv("WATCHDOG_USEC", "8000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier.from_env()
    assert n.address == systemd.env_value
    assert n.watchdog_interval == 4.0
    assert n.ready()
    assert systemd.recv() == "READY=1"


def test_unset_removes_the_variables_from_the_environment(systemd):
    env = {"NOTIFY_SOCKET": systemd.env_value, "WATCHDOG_USEC": "8000000", "WATCHDOG_PID": str(os.getpid()),
           "OTHER": "kept"}
    n = Notifier.from_env(env, unset=True)
    assert env == {"OTHER": "kept"}
    assert n.watchdog_interval == 4.0
    assert n.status("still works")
    assert systemd.recv() == "STATUS=still works"


def test_unset_needs_a_mutable_mapping():
    from types import MappingProxyType

    with pytest.raises(TypeError):
        Notifier.from_env(MappingProxyType({"NOTIFY_SOCKET": "/x"}), unset=True)


# --- failures never raise ---------------------------------------------------------------------------------

def test_vanished_path_socket_returns_false_and_remembers(path_systemd):
    n = _notifier(path_systemd, WATCHDOG_USEC="2000000")
    path_systemd.vanish()
    assert n.ready("x") is False
    assert isinstance(n.last_error, FileNotFoundError)
    assert n.watchdog() is False
    assert n.errors == 2


def test_vanished_abstract_socket_returns_false():
    with _abstract_socket() as fake:
        n = _notifier(fake)
        fake.vanish()
        assert n.status("x") is False
        assert isinstance(n.last_error, ConnectionRefusedError)
        assert n.errors == 1


def test_socket_file_without_listener_returns_false(path_systemd):
    # The socket file is still there but nobody reads it (the manager died): ECONNREFUSED, not an exception.
    n = _notifier(path_systemd)
    path_systemd.sock.close()
    assert n.ready() is False
    assert isinstance(n.last_error, ConnectionRefusedError)


def test_recovers_once_the_socket_is_back(path_systemd):
    n = _notifier(path_systemd)
    path_systemd.vanish()
    assert n.status("lost") is False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as again:
        again.bind(path_systemd.path)
        again.settimeout(RECV_TIMEOUT_S)
        assert n.status("back") is True
        assert again.recv(1024) == b"STATUS=back"
        assert n.last_error is None
        assert n.errors == 1


def test_path_that_is_not_a_socket_returns_false(tmp_path):
    plain = tmp_path / "plain-file"
    plain.write_text("")
    n = Notifier.from_env({"NOTIFY_SOCKET": str(plain)})
    assert n.ready() is False
    assert isinstance(n.last_error, OSError)


@pytest.mark.parametrize("address", ["relative/notify", "vsock:2:1234"])
def test_unsupported_address_returns_false(address):
    n = Notifier.from_env({"NOTIFY_SOCKET": address})
    assert n.enabled
    assert n.ready() is False
    assert n.last_error is not None
    assert "unsupported NOTIFY_SOCKET" in str(n.last_error)


def test_stream_socket_listener_is_a_send_error():
    # systemd's socket is SOCK_DGRAM; a stream socket at the path must fail cleanly (EPROTOTYPE).
    directory = tempfile.mkdtemp(prefix="sdn-")
    path = os.path.join(directory, "s")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(1)
            n = Notifier.from_env({"NOTIFY_SOCKET": path})
            assert n.ready() is False
            assert isinstance(n.last_error, OSError)
    finally:
        os.unlink(path)
        os.rmdir(directory)
