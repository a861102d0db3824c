"""daemon: the reputd service built on indexcore.

    config        YAML configuration, environment overrides, validation (ConfigError names the key)
    dispatchers   the Dispatcher protocol and the built-in ConsumeQueue and IndexFile dispatchers
    rebuild       the offline pipeline: CommitLog reader -> batches -> dispatchers -> flush
    reput         `reputd run`: the live reput loop, recovery and the session around it
    flusher       the flush thread and the checkpoint it writes after each complete flush
    checkpoint    reputd's own checkpoint file (reputFromOffset + dispatcher states)
    metrics       Prometheus instruments, /metrics and /healthz
    sdnotify      systemd notifications (READY, WATCHDOG, STATUS)
    query         queries by key, queue offset and msgId (read-only)
    inspect_file  decoding any store file for `reputd inspect`
    produce       sample messages for demos and load
    logs          structlog set-up
    cli           the `reputd` command line
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("reputd")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
