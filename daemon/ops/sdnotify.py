"""A dependency-free client for systemd's notification protocol (``sd_notify(3)``).

Why: ``systemd/reputd.service`` runs ``reputd run`` as ``Type=notify`` with a ``WatchdogSec=``. systemd then
waits for ``READY=1`` before it calls the unit started (so units ordered after reputd start only once the
daemon has recovered and is following the CommitLog), shows ``STATUS=`` text in ``systemctl status``, and
restarts the daemon when ``WATCHDOG=1`` pings stop arriving (a hung tailing loop, not only a dead process).
The protocol is one ``AF_UNIX`` datagram of newline-separated ``KEY=value`` lines sent to the socket named by
``$NOTIFY_SOCKET``; it is small enough that pulling in python-systemd (a C extension that needs libsystemd
headers to build) is not worth it.

Rules this client keeps:

* Without ``$NOTIFY_SOCKET`` (run by hand, in Docker, in tests) every method does nothing and reports success:
  the daemon calls the same methods whether or not systemd supervises it.
* Sending never raises. A notification is advisory: if the socket is gone (systemd re-executed, the unit's
  ``NotifyAccess=`` changed, the variable was inherited by a process systemd does not know) the daemon must
  keep doing its real work. A failed send returns False and keeps the error in ``last_error`` for the
  caller to log; this module does no logging of its own (it has no logger configuration to respect).
* The watchdog is enabled only as ``sd_watchdog_enabled(3)`` enables it: ``$WATCHDOG_USEC`` is a positive
  integer and ``$WATCHDOG_PID``, when set, is this process's pid. A mismatched pid means the variables were
  inherited from a parent that systemd is watching, and pinging on its behalf would hide that parent's hang.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping, MutableMapping

# Environment variables systemd sets for a Type=notify service (systemd.exec(5), sd_notify(3)).
ENV_NOTIFY_SOCKET = "NOTIFY_SOCKET"
ENV_WATCHDOG_USEC = "WATCHDOG_USEC"
ENV_WATCHDOG_PID = "WATCHDOG_PID"

# Message fields (sd_notify(3), "Well-known assignments").
FIELD_READY = "READY"
FIELD_STATUS = "STATUS"
FIELD_STOPPING = "STOPPING"
FIELD_WATCHDOG = "WATCHDOG"
FIELD_EXTEND_TIMEOUT_USEC = "EXTEND_TIMEOUT_USEC"
FIELD_ERRNO = "ERRNO"

# The value systemd expects for the boolean fields above.
TRUE = "1"

# A leading "@" names a socket in the Linux abstract namespace, whose real first byte is NUL.
ABSTRACT_PREFIX = "@"

# Seconds a send may block. Datagram sends to a full receive queue block; systemd drains its queue quickly,
# and a daemon whose watchdog thread is stuck in a send is exactly what the watchdog should not cause.
SEND_TIMEOUT_S = 1.0

USEC_PER_SECOND = 1_000_000


class Notifier:
    """Sends notifications to systemd; every method is a no-op when there is no notification socket.

    Build it with `Notifier.from_env()`. Methods return True when the message was delivered or there is
    nowhere to deliver it, and False when a send failed (the error is in `last_error`, the running count in
    `errors`). It is safe to call from several threads: each message is sent on its own short-lived socket,
    as libsystemd does, so no state is shared but the error bookkeeping.
    """

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        """`address` is $NOTIFY_SOCKET as systemd writes it (a path, or "@name" for the abstract namespace),
        or None for no supervisor; `watchdog_usec` is the watchdog timeout in microseconds, or None."""
        self._address = address or None
        self._watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self.last_error: OSError | None = None
        self.errors = 0

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        pid: int | None = None,
        unset: bool = False,
    ) -> Notifier:
        """The notifier systemd's environment describes (`environ` defaults to `os.environ`).

        `pid` is the process to check $WATCHDOG_PID against (default `os.getpid()`). With `unset`, the three
        variables are removed from `environ` (it must then be mutable), as ``sd_notify(unset_environment=1)``
        does, so child processes such as a JVM do not inherit a socket meant for this process.
        """
        env = os.environ if environ is None else environ
        address = env.get(ENV_NOTIFY_SOCKET) or None
        watchdog_usec = _watchdog_usec(env, os.getpid() if pid is None else pid)
        if unset:
            if not isinstance(env, MutableMapping):
                raise TypeError("unset=True needs a mutable environment mapping")
            for name in (ENV_NOTIFY_SOCKET, ENV_WATCHDOG_USEC, ENV_WATCHDOG_PID):
                env.pop(name, None)
        return cls(address, watchdog_usec)

    @property
    def enabled(self) -> bool:
        """Whether there is a notification socket at all (i.e. a supervisor that listens)."""
        return self._address is not None

    @property
    def address(self) -> str | None:
        """$NOTIFY_SOCKET as given ("@name" for an abstract socket), or None."""
        return self._address

    @property
    def watchdog_usec(self) -> int | None:
        """The watchdog timeout systemd enforces, in microseconds, or None when the watchdog is off."""
        return self._watchdog_usec if self.enabled else None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between `watchdog()` pings: half the timeout, as sd_watchdog_enabled(3) advises, so one
        late ping does not get the daemon killed. None when the watchdog is off."""
        usec = self.watchdog_usec
        return None if usec is None else usec / 2 / USEC_PER_SECOND

    def ready(self, status: str | None = None) -> bool:
        """Start-up is done (recovery finished, following the CommitLog); optionally with a status line."""
        return self.notify((FIELD_READY, TRUE), *self._status_field(status))

    def status(self, text: str) -> bool:
        """Free-form one-line state for ``systemctl status`` (e.g. the CommitLog offset reached)."""
        return self.notify((FIELD_STATUS, text))

    def watchdog(self) -> bool:
        """Keep-alive ping; does nothing unless the watchdog is enabled for this process."""
        if self.watchdog_usec is None:
            return True
        return self.notify((FIELD_WATCHDOG, TRUE))

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown has begun (flushing, writing the checkpoint); systemd shows the unit as deactivating."""
        return self.notify((FIELD_STOPPING, TRUE), *self._status_field(status))

    def extend_timeout(self, usec: int) -> bool:
        """Ask for `usec` more microseconds before the start (or stop) timeout fires; for a long recovery.

        systemd needs a new extension before this one runs out, so call it again while the work goes on.
        """
        if usec <= 0:
            raise ValueError(f"extend_timeout needs a positive number of microseconds, not {usec}")
        return self.notify((FIELD_EXTEND_TIMEOUT_USEC, str(int(usec))))

    def report_errno(self, code: int, status: str | None = None) -> bool:
        """Report a failure errno (shown by ``systemctl status``) before exiting on an error."""
        return self.notify((FIELD_ERRNO, str(int(code))), *self._status_field(status))

    def notify(self, *fields: tuple[str, str]) -> bool:
        """Send one datagram of ``KEY=value`` lines; False (and `last_error`) when it could not be sent.

        Newlines inside a value would start a new (bogus) assignment, so they are replaced by spaces.
        """
        if self._address is None:
            return True
        message = "\n".join(f"{key}={_one_line(value)}" for key, value in fields).encode("utf-8")
        try:
            target = _socket_address(self._address)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.connect(target)
                sock.sendall(message)
        except OSError as exc:
            self.last_error = exc
            self.errors += 1
            return False
        self.last_error = None
        return True

    @staticmethod
    def _status_field(status: str | None) -> tuple[tuple[str, str], ...]:
        return () if status is None else ((FIELD_STATUS, status),)

    def __repr__(self) -> str:
        return f"Notifier(address={self._address!r}, watchdog_usec={self.watchdog_usec!r})"


def _watchdog_usec(env: Mapping[str, str], pid: int) -> int | None:
    """$WATCHDOG_USEC when it is meant for `pid`, else None (the rules of sd_watchdog_enabled(3))."""
    raw_usec = env.get(ENV_WATCHDOG_USEC)
    if not raw_usec:
        return None
    try:
        usec = int(raw_usec, 10)
    except ValueError:
        return None
    if usec <= 0:
        return None
    raw_pid = env.get(ENV_WATCHDOG_PID)
    if raw_pid:
        try:
            if int(raw_pid, 10) != pid:
                return None
        except ValueError:
            return None
    return usec


def _socket_address(address: str) -> str | bytes:
    """The `connect()` address of $NOTIFY_SOCKET: a path as is, "@name" as the abstract b"\\0name"."""
    if address.startswith(ABSTRACT_PREFIX):
        return b"\0" + address[len(ABSTRACT_PREFIX):].encode("utf-8")
    if address.startswith("/"):
        return address
    # systemd only ever writes absolute paths or "@" names; anything else (a relative path, "vsock:...")
    # is refused here rather than resolved against whatever the working directory happens to be.
    raise OSError(errno.EAFNOSUPPORT, f"unsupported {ENV_NOTIFY_SOCKET} address", address)


def _one_line(value: str) -> str:
    return value.replace("\r", " ").replace("\n", " ")
