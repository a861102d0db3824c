"""daemon: the reputd service built on indexcore.

    config        YAML configuration, environment overrides, validation (ConfigError names the key)
    dispatchers   the Dispatcher protocol and the built-in ConsumeQueue and IndexFile dispatchers
    rebuild       the offline pipeline: recovery -> CommitLog reader -> batches -> dispatchers -> checkpoint
    reput         `reputd run`: the service and its live reput loop
    session       one life of the live pipeline, and opening one
    recovery      where every start resumes: checkpoint, replay markers, quarantine, the resume rules
    head          the CommitLog's head: the end of the written data, records still being written
    flusher       the flush thread and the checkpoint it writes after each complete flush
    failpoint     test hook: kill the process at a named step of a file's creation (REPUTD_FAILPOINT)
    checkpoint    reputd's own checkpoint file (reputFromOffset + dispatcher states)
    metrics       Prometheus instruments, /metrics and /healthz
    sdnotify      systemd notifications (READY, STATUS, WATCHDOG, EXTEND_TIMEOUT_USEC, STOPPING)
    query         queries by key, queue offset and msgId (read-only)
    inspect_file  decoding any store file for `reputd inspect`
    produce       sample messages for demos and load
    logs          structlog set-up
    cli           the `reputd` command line
"""

import os

# numpy's OpenBLAS starts a spinning thread per core at import; reputd does no linear algebra, and on a
# small machine those threads take CPU from the reput loop.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def __getattr__(name: str) -> str:
    """`__version__`, looked up on first use: importlib.metadata costs more start-up time than a
    rebuild of a small store, and only the metrics need it."""
    if name != "__version__":
        raise AttributeError(name)
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 - see above

    try:
        return version("reputd")
    except PackageNotFoundError:  # a source tree that was never installed: the one place it is written
        import tomllib  # noqa: PLC0415 - see above

        try:
            pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
            with open(pyproject, "rb") as f:
                return tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "0+unknown"
