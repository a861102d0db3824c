"""The driver JVM of a local backfill, and the class-data archive that shortens its start.

With a `local[...]` master the driver JVM runs the tasks too, and most of a short backfill's fixed cost
is that JVM loading and verifying Spark's classes: its start-up, then each code path's first use (the first
query, the first Arrow task, the first shuffle). A dynamic class-data-sharing archive (AppCDS, JDK 13+)
keeps those classes parsed and verified in a file the next JVM maps: the first local backfill on a machine
records the classes its JVM loaded when it exits (`-XX:ArchiveClassesAtExit`), every later one maps them
(`-XX:SharedArchiveFile`). An archive only fits the JVM and the jars it was made with, so its name carries
a digest of both: a new Java or PySpark makes a new archive, and the JVM itself ignores one that does not
fit. `backfill.jvmClassArchive` is `auto` (in the user's cache directory), `off`, or a path. In the cache
directory an archive's modification time is when a backfill last mapped it, and one unused for
UNUSED_ARCHIVE_DAYS is removed as a new one is recorded: each is 70-160 MB, and an upgrade of Java, PySpark
or reputd leaves the old one behind for good.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

ARCHIVE_AUTO, ARCHIVE_OFF = "auto", "off"
ARCHIVE_SUFFIX = ".jsa"
CACHE_SUBDIR = "reputd"
# the JVM's own messages about the archive (a class it cannot archive, an archive that does not fit) would
# go to standard output, which `--json` keeps for the summary: warnings go to standard error, without
# the archive's
LOG_OPTIONS = "-Xlog:disable -Xlog:all=warning,cds=off,cds+dynamic=off:stderr"
SAVE_TIMEOUT_SECONDS = 300
ARCHIVE_PREFIX = "spark-driver-"
UNUSED_ARCHIVE_DAYS = 30


@dataclass(frozen=True, slots=True)
class ClassArchive:
    """The archive a backfill maps (`saving` False) or records as it ends (`saving` True, under a temporary
    name that `save` moves into place)."""

    path: str
    saving: bool

    @property
    def temporary(self) -> str:
        return f"{self.path}.{os.getpid()}.tmp"

    def java_options(self) -> str:
        target = f"-XX:ArchiveClassesAtExit={self.temporary}" if self.saving else f"-XX:SharedArchiveFile={self.path}"
        return f"{target} {LOG_OPTIONS}"


def default_archive_dir(env: dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, CACHE_SUBDIR)


@functools.lru_cache(maxsize=8)
def java_version_text(java: str) -> str:
    """What `java -version` prints (run once per runtime and process: it takes a JVM start)."""
    out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60, check=False)
    return out.stderr + out.stdout


def install_digest(java: str, java_options: str) -> str:
    """What an archive depends on: the Java runtime (its path and version), Spark's jars (their directory,
    names, sizes and modification times) and the JVM options it runs with. The directory counts: the archive
    records the class path, and a JVM whose jars are elsewhere (another virtualenv with the same PySpark)
    does not map it, silently: every backfill from the second environment started without it (6-7 s to the
    first job instead of 3). So do the times: the JVM checks each jar's, and the same PySpark installed again
    (a virtualenv made anew) left an archive every backfill chose and the JVM refused ("A jar file is not the
    one used while building the shared archive file", only with cds logging on): a 10,000-message job took
    8.2-8.9 CPU-s instead of 5.2-5.6, for good."""
    import pyspark  # noqa: PLC0415

    h = hashlib.sha256()
    h.update(os.path.realpath(java).encode())
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        h.update(java_version_text(java).encode())
    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
    h.update(os.path.realpath(jars).encode())
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(jars), key=lambda e: e.name):
            st = entry.stat()
            h.update(f"{entry.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(java_options.encode())
    return h.hexdigest()[:16]


def choose_archive(setting: str, java: str, java_options: str,
                   unavailable: Callable[[str, str], None] | None = None) -> ClassArchive | None:
    """The archive this backfill uses or records; None when it is off or its directory cannot be made or
    written, which `unavailable(directory, why)` is told (a user without a home, as a container image's, gave
    up silently: every backfill paid the JVM's full start)."""
    if setting == ARCHIVE_OFF:
        return None
    if setting == ARCHIVE_AUTO:
        directory = default_archive_dir()
        path = os.path.join(directory, f"{ARCHIVE_PREFIX}{install_digest(java, java_options)}{ARCHIVE_SUFFIX}")
    else:
        path = setting
        directory = os.path.dirname(path) or "."
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        if setting == ARCHIVE_AUTO:
            with contextlib.suppress(OSError):
                os.utime(path)  # used now: kept by remove_unused
        return ClassArchive(path, saving=False)
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        why = "not a directory"
    except OSError as e:
        why = e.strerror or str(e)
    else:
        why = None if os.access(directory, os.W_OK) else "not writable"
    if why is not None:
        if unavailable is not None:
            unavailable(directory, why)
        return None
    remove_abandoned(path)
    if setting == ARCHIVE_AUTO:
        remove_unused(directory)
    return ClassArchive(path, saving=True)


def remove_unused(directory: str, now: float | None = None) -> list[str]:
    """Delete the cache directory's archives no backfill has mapped for UNUSED_ARCHIVE_DAYS (their modification
    time is their last use): those of a Java, PySpark, reputd or environment replaced since. Only `auto`'s own
    directory and names; an archive a path names is the operator's. The paths removed."""
    cutoff = (time.time() if now is None else now) - UNUSED_ARCHIVE_DAYS * 86400
    removed = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if not (entry.name.startswith(ARCHIVE_PREFIX) and entry.name.endswith(ARCHIVE_SUFFIX)):
                continue
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed.append(entry.path)
    return removed


def remove_abandoned(path: str) -> None:
    """Delete the temporary archives of recording backfills that died before moving theirs into place (a
    kill -9, a lost machine): each is as large as the archive, and nothing else would ever remove it."""
    prefix, suffix = f"{os.path.basename(path)}.", ".tmp"
    with contextlib.suppress(OSError), os.scandir(os.path.dirname(path) or ".") as entries:
        for entry in entries:
            pid = entry.name[len(prefix):-len(suffix)]
            if entry.name.startswith(prefix) and entry.name.endswith(suffix) and pid.isdigit() \
                    and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: it exists
    return True


def end_gateway(timeout: float) -> None:
    """End the gateway JVM this process launched (PySpark's; it exits at the end of its standard input),
    killing it if it has not within `timeout` seconds; nothing when this process launched none."""
    from pyspark import SparkContext  # noqa: PLC0415

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if proc is None:
        return
    with contextlib.suppress(Exception):
        gateway.shutdown()
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    forwarder = getattr(proc, "stderr_forwarder", None)  # the JVM's last words, before this process ends
    if forwarder is not None:
        forwarder.join(timeout)
    SparkContext._gateway = None
    SparkContext._jvm = None


def save_archive(archive: ClassArchive) -> bool:
    """After the context has stopped: end the driver JVM (it writes the archive as it exits) and move the
    archive into place. False when there was nothing to save (the JVM was not this backfill's)."""
    end_gateway(SAVE_TIMEOUT_SECONDS)
    temporary = archive.temporary
    if not os.path.isfile(temporary) or os.path.getsize(temporary) == 0:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        return False
    os.replace(temporary, archive.path)
    return True
