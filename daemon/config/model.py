"""The configuration's shape: the frozen dataclasses a loaded configuration is, ConfigError, and the
names of the environment variables (``REPUTD_SECTION_KEY``)."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from indexcore.commitlog import DEFAULT_MAPPED_FILE_SIZE_COMMIT_LOG, DEFAULT_MAX_MESSAGE_SIZE
from indexcore.consumequeue import CQ_UNIT_SIZE, DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE
from indexcore.dispatch import DEFAULT_MESSAGE_DELAY_LEVEL, parse_delay_levels
from indexcore.indexfile import DEFAULT_MAX_HASH_SLOT_NUM, DEFAULT_MAX_INDEX_NUM
from indexcore.indexservice import DEFAULT_MAX_MSGS_NUM_BATCH

ENV_PREFIX = "REPUTD_"
CONFIG_ENV = "REPUTD_CONFIG"
DEFAULT_CONFIG_FILE = os.path.join("config", "reputd.yaml")  # relative to the current directory
# Names under the prefix that are not config keys (the CLI may read the config file's path from it),
# so the typo check must not reject them.
ENV_IGNORED = frozenset({CONFIG_ENV, "REPUTD_DEBUG", "REPUTD_CONFORMANCE_DIR", "REPUTD_FAILPOINT",
                         "REPUTD_IMAGE"})  # the container image's stage (Dockerfile), not a key

CQ_STORE_UNIT_SIZE = CQ_UNIT_SIZE
ON_CORRUPTION_STOP, ON_CORRUPTION_SKIP_SEGMENT = "stop", "skip-segment"
BUILTIN_DISPATCHERS = ("consumequeue", "index")
ROOT_DIR_PLACEHOLDER = "{storePathRootDir}"
_CAMEL_WORD = re.compile(r"(.)([A-Z][a-z]+)")
_CAMEL_TAIL = re.compile(r"([a-z0-9])([A-Z])")


class ConfigError(Exception):
    """Bad configuration; ``key`` is the dotted key at fault ('' for the whole file) and str() names it."""

    key: str
    message: str

    def __init__(self, key: str, message: str) -> None:
        super().__init__(key, message)
        self.key = key
        self.message = message

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The part of the broker's MessageStoreConfig that locates the CommitLog and shapes the output files."""

    store_path_root_dir: str
    store_path_commit_log: str
    mapped_file_size_commit_log: int = DEFAULT_MAPPED_FILE_SIZE_COMMIT_LOG
    mapped_file_size_consume_queue: int = DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE
    max_hash_slot_num: int = DEFAULT_MAX_HASH_SLOT_NUM
    max_index_num: int = DEFAULT_MAX_INDEX_NUM
    message_index_enable: bool = True
    max_msgs_num_batch: int = DEFAULT_MAX_MSGS_NUM_BATCH
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    message_delay_level: str = DEFAULT_MESSAGE_DELAY_LEVEL
    check_crc_on_recover: bool = True
    flush_interval_consume_queue: int = 1000
    flush_consume_queue_least_pages: int = 2
    flush_consume_queue_thorough_interval: int = 60000
    clean_resource_interval: int = 10000
    enable_multi_dispatch: bool = False
    enable_lmq: bool = False
    max_transfer_bytes_on_message_in_memory: int = 256 * 1024
    max_transfer_count_on_message_in_memory: int = 32
    # DLedger CommitLog mode (daemon/engine/dledgermode.py): the CommitLog is <root>/dledger-<selfId>/data
    enable_d_leger_commit_log: bool = False
    d_leger_self_id: str = ""
    d_leger_group: str = ""
    d_leger_peers: str = ""

    @property
    def commit_log_dirs(self) -> tuple[str, ...]:
        """The CommitLog directories; RocketMQ spreads files over several when the path is comma-separated."""
        return tuple(part for part in (p.strip() for p in self.store_path_commit_log.split(",")) if part)

    @property
    def delay_levels_ms(self) -> tuple[int, ...]:
        """Delay per level in ms, level 1 first; needed to compute the tags code of scheduled messages."""
        return parse_delay_levels(self.message_delay_level)


@dataclass(frozen=True, slots=True)
class OutputConfig:
    """Where the rebuilt consumequeue/ and index/ trees go; the store root unless configured otherwise."""

    dir: str


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """Prometheus endpoint; loopback by default because the metrics are unauthenticated."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 9108


@dataclass(frozen=True, slots=True)
class DispatcherSpec:
    """One dispatcher to run: a built-in name or an importable ``package.module:Class`` plug-in."""

    name: str
    options: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ReputConfig:
    """How the reput loop follows the CommitLog and what it does with damaged data."""

    poll_interval_ms: int = 500
    batch_bytes: int = 4194304
    on_corruption: str = "stop"
    shutdown_timeout_ms: int = 10000


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """How fast `reputd run` deletes the ConsumeQueue files the CommitLog no longer needs (`daemon.engine.cleaner`);
    when it looks is the broker's `store.cleanResourceInterval`."""

    # measured here (ext4 with discard): unlinking a 6 KB ConsumeQueue file takes 0.2-0.3 ms, a 6 MB written
    # one 2-8 ms; these budgets keep a backlog of 10,000 small files to 10 s and a thread's disk time spent
    # deleting to a quarter at most (daemon/engine/cleanplan.py)
    delete_files_per_second: int = 1000
    delete_bytes_per_second: int = 256 * 1024 * 1024


# the AWS SDK's own request timeout (3 s) is also how long a response may send nothing: a busy S3-compatible
# server (MinIO, moto, a gateway) preparing a 16 MiB range sent nothing for longer, and the backfill failed
DEFAULT_S3_REQUEST_TIMEOUT_SECONDS = 60


@dataclass(frozen=True, slots=True)
class BackfillConfig:
    """How `reputd backfill` cuts segments into tasks and reaches archives on S3 (empty: the standard AWS_*
    environment variables, as AWS tools read them)."""

    # 128 MiB: a task costs Spark 20-30 ms of the JVM's CPU whatever its size (an RDD task doing nothing:
    # 17-24 ms), a fifth of a 64 MiB range's work; on the 16M store (7 x 1 GiB, local[2]) the whole
    # backfill took 1.1-2.2 CPU-s less in each of 4 alternations than with 64 MiB ranges (17.6-19.7 against
    # 19.8-21.0), its serial fraction the same (4.0-4.5% against 4.1-4.7%); 256 MiB saved 1-3 CPU-s more but
    # left the serial fraction at 4.5-7.6% and a 1 GiB segment only 4 tasks
    range_bytes: int = 128 * 1024 * 1024
    read_bytes: int = 16 * 1024 * 1024
    s3_endpoint: str = ""
    s3_region: str = ""
    s3_access_key_id: str = ""
    s3_secret_access_key: str = ""
    s3_request_timeout_seconds: int = DEFAULT_S3_REQUEST_TIMEOUT_SECONDS
    catalog_body: bool = False
    jvm_class_archive: str = "auto"


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """Log verbosity and rendering; ``auto`` picks console output on a TTY and JSON otherwise."""

    level: str = "info"
    format: str = "auto"


@dataclass(frozen=True, slots=True)
class Config:
    """The complete, validated configuration; ``source`` is the file it was loaded from, if any; ``defaulted``
    the dotted keys (``store.storePathRootDir``) no layer set, left at their built-in defaults."""

    store: StoreConfig
    output: OutputConfig
    reput: ReputConfig
    dispatchers: tuple[DispatcherSpec, ...]
    metrics: MetricsConfig
    logging: LoggingConfig
    source: str | None
    backfill: BackfillConfig = BackfillConfig()
    retention: RetentionConfig = RetentionConfig()
    defaulted: frozenset[str] = frozenset()


@functools.cache
def _camel_to_snake(name: str) -> str:
    return _CAMEL_TAIL.sub(r"\1_\2", _CAMEL_WORD.sub(r"\1_\2", name)).lower()


def env_var_name(section: str, key: str = "") -> str:
    """Variable overriding ``section.key``; ("store", "maxHashSlotNum") -> REPUTD_STORE_MAX_HASH_SLOT_NUM."""
    parts = [section.upper()] + ([_camel_to_snake(key).upper()] if key else [])
    return ENV_PREFIX + "_".join(parts)
