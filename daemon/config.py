"""reputd configuration: defaults < YAML file < ``REPUTD_*`` environment variables < explicit overrides.

Store keys keep RocketMQ's MessageStoreConfig names so operators can copy them from broker.conf. The sizes
that shape files on disk must equal the broker's, or the rebuilt ConsumeQueue/IndexFile will not match it.
Every value is validated as it is read, so a mistake is reported with the dotted key and where it came from.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, NamedTuple

from indexcore.commitlog import DEFAULT_MAPPED_FILE_SIZE_COMMIT_LOG, DEFAULT_MAX_MESSAGE_SIZE
from indexcore.consumequeue import CQ_UNIT_SIZE, DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE
from indexcore.dispatch import DEFAULT_MESSAGE_DELAY_LEVEL, DELAY_UNIT_MS, parse_delay_levels
from indexcore.indexfile import DEFAULT_MAX_HASH_SLOT_NUM, DEFAULT_MAX_INDEX_NUM, index_file_size
from indexcore.indexservice import DEFAULT_MAX_MSGS_NUM_BATCH

__all__ = [
    "BUILTIN_DISPATCHERS",
    "CONFIG_ENV",
    "CQ_STORE_UNIT_SIZE",
    "DEFAULT_CONFIG_FILE",
    "DELAY_UNIT_MS",
    "ENV_IGNORED",
    "ENV_PREFIX",
    "ON_CORRUPTION_SKIP_SEGMENT",
    "ON_CORRUPTION_STOP",
    "BackfillConfig",
    "Config",
    "ConfigError",
    "DispatcherSpec",
    "LoggingConfig",
    "MetricsConfig",
    "OutputConfig",
    "ReputConfig",
    "StoreConfig",
    "config_path",
    "default_config",
    "env_var_name",
    "load_config",
    "parse_delay_levels",
]

ENV_PREFIX = "REPUTD_"
CONFIG_ENV = "REPUTD_CONFIG"
DEFAULT_CONFIG_FILE = os.path.join("config", "reputd.yaml")  # relative to the current directory
# Names under the prefix that are not config keys (the CLI may read the config file's path from it),
# so the typo check must not reject them.
ENV_IGNORED = frozenset({CONFIG_ENV, "REPUTD_DEBUG", "REPUTD_CONFORMANCE_DIR", "REPUTD_FAILPOINT"})

CQ_STORE_UNIT_SIZE = CQ_UNIT_SIZE
ON_CORRUPTION_STOP, ON_CORRUPTION_SKIP_SEGMENT = "stop", "skip-segment"
BUILTIN_DISPATCHERS = ("consumequeue", "index")
ROOT_DIR_PLACEHOLDER = "{storePathRootDir}"

_JAVA_INT_MAX = 2**31 - 1
_PLACEHOLDER = re.compile(r"\{[A-Za-z_]\w*\}", re.ASCII)
_PLUGIN_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*", re.ASCII)
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
    delete_consume_queue_files_interval: int = 100
    enable_multi_dispatch: bool = False
    enable_lmq: bool = False
    max_transfer_bytes_on_message_in_memory: int = 256 * 1024
    max_transfer_count_on_message_in_memory: int = 32
    # DLedger CommitLog mode (daemon/dledgermode.py): the CommitLog is <root>/dledger-<selfId>/data
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


# the AWS SDK's own request timeout (3 s) is also how long a response may send nothing: a busy S3-compatible
# server (MinIO, moto, a gateway) preparing a 16 MiB range sent nothing for longer, and the backfill failed
DEFAULT_S3_REQUEST_TIMEOUT_SECONDS = 60


@dataclass(frozen=True, slots=True)
class BackfillConfig:
    """How `reputd backfill` cuts segments into tasks and reaches archives on S3 (empty: the standard AWS_*
    environment variables, as AWS tools read them)."""

    range_bytes: int = 64 * 1024 * 1024
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
    """The complete, validated configuration; ``source`` is the file it was loaded from, if any."""

    store: StoreConfig
    output: OutputConfig
    reput: ReputConfig
    dispatchers: tuple[DispatcherSpec, ...]
    metrics: MetricsConfig
    logging: LoggingConfig
    source: str | None
    backfill: BackfillConfig = BackfillConfig()


@functools.cache
def _camel_to_snake(name: str) -> str:
    return _CAMEL_TAIL.sub(r"\1_\2", _CAMEL_WORD.sub(r"\1_\2", name)).lower()


def env_var_name(section: str, key: str = "") -> str:
    """Variable overriding ``section.key``; ("store", "maxHashSlotNum") -> REPUTD_STORE_MAX_HASH_SLOT_NUM."""
    parts = [section.upper()] + ([_camel_to_snake(key).upper()] if key else [])
    return ENV_PREFIX + "_".join(parts)


Check = Callable[[Any], str | None]


def _in_range(low: int, high: int | None = None, why: str = "") -> Check:
    def check(value: int) -> str | None:
        if value < low:
            return f"{value} must be >= {low}"
        if high is not None and value > high:
            return f"{value} must be <= {high}{why}"
        return None

    return check


def _java_int(low: int) -> Check:
    return _in_range(low, _JAVA_INT_MAX, " (the broker holds it in a Java int)")


def _one_of(*choices: str) -> Check:
    def check(value: str) -> str | None:
        return None if value in choices else f"{value!r} is not one of: {', '.join(choices)}"

    return check


def _class_archive(value: str) -> str | None:
    if value in ("auto", "off") or os.path.isabs(value):
        return None
    return f"{value!r} is not auto, off or an absolute path"


def _non_empty(value: str) -> str | None:
    return None if value.strip() else "must not be empty"


def _cq_multiple(value: int) -> str | None:
    if value % CQ_STORE_UNIT_SIZE == 0:
        return None
    rounded = -(-value // CQ_STORE_UNIT_SIZE) * CQ_STORE_UNIT_SIZE
    return (
        f"{value} is not a multiple of {CQ_STORE_UNIT_SIZE} (the ConsumeQueue unit size); "
        f"the broker silently rounds it up to {rounded}, so write that"
    )


def _delay_levels(value: str) -> str | None:
    try:
        parse_delay_levels(value)
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class _Key:
    """One configuration key: where it lives, its kind and the checks its value must pass."""

    section: str
    name: str
    kind: str
    checks: tuple[Check, ...] = ()

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def attr(self) -> str:
        return _camel_to_snake(self.name)


_KINDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "int": (int, "an integer"),
    "bool": (bool, "a boolean"),
    "str": (str, "a string"),
    "path": (str, "a path"),
    "paths": (str, "a path or comma-separated paths"),
}
_STRING_KINDS = frozenset({"str", "path", "paths"})

_SECTION_CLASSES: dict[str, type] = {
    "store": StoreConfig,
    "output": OutputConfig,
    "reput": ReputConfig,
    "metrics": MetricsConfig,
    "logging": LoggingConfig,
    "backfill": BackfillConfig,
}

_KEY_LIST = (
    _Key("store", "storePathRootDir", "path"),
    _Key("store", "storePathCommitLog", "paths"),
    _Key("store", "mappedFileSizeCommitLog", "int", (_java_int(1),)),
    _Key("store", "mappedFileSizeConsumeQueue", "int", (_java_int(1), _cq_multiple)),
    _Key("store", "maxHashSlotNum", "int", (_java_int(1),)),
    _Key("store", "maxIndexNum", "int", (_java_int(2),)),
    _Key("store", "messageIndexEnable", "bool"),
    _Key("store", "maxMsgsNumBatch", "int", (_java_int(1),)),
    _Key("store", "maxMessageSize", "int", (_java_int(1),)),
    _Key("store", "messageDelayLevel", "str", (_delay_levels,)),
    _Key("store", "checkCRCOnRecover", "bool"),
    _Key("store", "flushIntervalConsumeQueue", "int", (_java_int(1),)),
    _Key("store", "flushConsumeQueueLeastPages", "int", (_java_int(0),)),
    _Key("store", "flushConsumeQueueThoroughInterval", "int", (_java_int(0),)),
    _Key("store", "cleanResourceInterval", "int", (_java_int(1),)),
    _Key("store", "deleteConsumeQueueFilesInterval", "int", (_java_int(0),)),
    _Key("store", "enableMultiDispatch", "bool"),
    _Key("store", "enableLmq", "bool"),
    _Key("store", "maxTransferBytesOnMessageInMemory", "int", (_java_int(1),)),
    _Key("store", "maxTransferCountOnMessageInMemory", "int", (_java_int(1),)),
    _Key("store", "enableDLegerCommitLog", "bool"),
    _Key("store", "dLegerSelfId", "str"),
    _Key("store", "dLegerGroup", "str"),
    _Key("store", "dLegerPeers", "str"),
    _Key("output", "dir", "path"),
    _Key("reput", "pollIntervalMs", "int", (_in_range(1),)),
    _Key("reput", "batchBytes", "int", (_in_range(1),)),
    _Key("reput", "onCorruption", "str", (_one_of(ON_CORRUPTION_STOP, ON_CORRUPTION_SKIP_SEGMENT),)),
    _Key("reput", "shutdownTimeoutMs", "int", (_in_range(1),)),
    _Key("metrics", "enabled", "bool"),
    _Key("metrics", "host", "str", (_non_empty,)),
    _Key("metrics", "port", "int", (_in_range(1, 65535),)),
    _Key("logging", "level", "str", (_one_of("debug", "info", "warning", "error"),)),
    _Key("logging", "format", "str", (_one_of("json", "console", "auto"),)),
    _Key("backfill", "rangeBytes", "int", (_in_range(1),)),
    _Key("backfill", "readBytes", "int", (_in_range(1024 * 1024, 1024**3),)),
    _Key("backfill", "s3Endpoint", "str"),
    _Key("backfill", "s3Region", "str"),
    _Key("backfill", "s3AccessKeyId", "str"),
    _Key("backfill", "s3SecretAccessKey", "str"),
    _Key("backfill", "s3RequestTimeoutSeconds", "int", (_in_range(1, 3600),)),
    _Key("backfill", "catalogBody", "bool"),
    _Key("backfill", "jvmClassArchive", "str", (_class_archive,)),
)
_KEYS: dict[tuple[str, str], _Key] = {(k.section, k.name): k for k in _KEY_LIST}
_DISPATCHERS_SECTION = "dispatchers"
_ENV_KEYS: dict[str, _Key] = {env_var_name(k.section, k.name): k for k in _KEY_LIST}
_DISPATCHERS_ENV = env_var_name(_DISPATCHERS_SECTION)

# MessageStoreConfig keys that govern only the broker's own runtime (flushing the CommitLog, HA, cleaning,
# transfer limits, pools): accepted under `store:` so a block copied from broker.conf loads, and ignored.
BROKER_RUNTIME_STORE_KEYS = frozenset({
    "accessMessageInMemoryMaxRatio", "autoMessageVersionOnTopicLen", "bitMapLengthConsumeQueueExt", "brokerRole",
    "cleanFileForciblyEnable", "commitCommitLogLeastPages",
    "commitCommitLogThoroughInterval", "commitIntervalCommitLog", "debugLockEnable", "defaultQueryMaxNum",
    "deleteCommitLogFilesInterval",
    "deleteWhen", "destroyMapedFileIntervalForcibly", "diskFallRecorded", "diskMaxUsedSpaceRatio",
    "duplicationEnable", "enableBatchPush", "enableScheduleAsyncDeliver", "enableScheduleMessageStats",
    "enabledAppendPropCRC", "fastFailIfNoBufferInStorePool", "fileReservedTime", "flushCommitLogLeastPages",
    "flushCommitLogThoroughInterval", "flushCommitLogTimed", "flushDelayOffsetInterval", "flushDiskType",
    "flushIntervalCommitLog", "flushLeastPagesWhenWarmMapedFile", "forceVerifyPropCRC", "haHousekeepingInterval",
    "haListenPort", "haMasterAddress", "haSendHeartbeatInterval", "haSlaveFallbehindMax", "haTransferBatchSize",
    "mappedFileSizeConsumeQueueExt", "maxLmqConsumeQueueNum", "maxTransferBytesOnMessageInDisk",
    "maxTransferCountOnMessageInDisk",
    "messageIndexSafe", "offsetCheckInSlave", "osPageCacheBusyTimeOutMills", "preferredLeaderId",
    "putMsgIndexHightWater", "recheckReputOffsetFromCq", "redeleteHangedFileInterval",
    "scheduleAsyncDeliverMaxPendingLimit", "scheduleAsyncDeliverMaxResendNum2Blocked", "slaveTimeout",
    "syncFlushTimeout", "transientStorePoolEnable", "transientStorePoolSize", "useReentrantLockWhenPutMessage",
    "warmMapedFileEnable",
})
# MessageStoreConfig settings that change what the broker writes or reads in ways reputd does not reproduce;
# accepted only at these (default) values, so they can never silently give different files.
UNSUPPORTED_STORE_SETTINGS: dict[str, Any] = {
    "enableConsumeQueueExt": False,
    "readOnlyCommitLogStorePaths": None,
}
_UNSUPPORTED_WHY = {
    "enableConsumeQueueExt": "ConsumeQueueExt files are not written by reputd",
    "readOnlyCommitLogStorePaths": "list those directories in storePathCommitLog instead",
}


def _broker_only(section: str, name: Any, value: Any, origin: str) -> bool:
    """Whether a store key is a recognised broker setting that reputd ignores; refuses unsupported values."""
    if section != "store" or not isinstance(name, str):
        return False
    if name in UNSUPPORTED_STORE_SETTINGS:
        default = UNSUPPORTED_STORE_SETTINGS[name]
        if value != default and value not in ("", [], "false"):
            raise _error(f"store.{name}", f"only {default!r} is supported: {_UNSUPPORTED_WHY[name]}", origin)
        return True
    if name in BROKER_RUNTIME_STORE_KEYS:
        if isinstance(value, Mapping | list | tuple):
            raise _error(f"store.{name}", f"expected a scalar broker setting, got {_describe(value)}", origin)
        return True
    return False


# string keys the broker leaves null by default: `null` in the file reads as unset
_NULL_AS_EMPTY = frozenset({"dLegerSelfId", "dLegerGroup", "dLegerPeers"})

# Defaults the dataclasses cannot carry because they depend on other values; None means "the store root".
_DERIVED_DEFAULTS: dict[tuple[str, str], Any] = {
    ("store", "storePathRootDir"): "./var/store",
    ("store", "storePathCommitLog"): ROOT_DIR_PLACEHOLDER + "/commitlog",
    ("output", "dir"): None,
}


def _check_key_table() -> None:
    for section, cls in _SECTION_CLASSES.items():
        attrs = {f.name for f in fields(cls)}
        named = {k.attr for k in _KEY_LIST if k.section == section}
        if attrs != named:
            raise RuntimeError(f"config key table out of step with {cls.__name__}: {sorted(attrs ^ named)}")
    if len(_ENV_KEYS) != len(_KEY_LIST):
        raise RuntimeError("two config keys map to the same environment variable")


_check_key_table()


class _Setting(NamedTuple):
    value: Any
    base_dir: str
    origin: str


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _error(key: str, message: str, origin: str) -> ConfigError:
    return ConfigError(key, f"{message} ({origin})" if origin else message)


def _validate(key: _Key, value: Any, origin: str) -> Any:
    expected, label = _KINDS[key.kind]
    wrong_type = not isinstance(value, expected) or (key.kind == "int" and isinstance(value, bool))
    if wrong_type:
        raise _error(key.dotted, f"expected {label}, got {_describe(value)}", origin)
    if key.kind in ("path", "paths") and not value.strip():
        raise _error(key.dotted, "must not be empty", origin)
    for check in key.checks:
        problem = check(value)
        if problem:
            raise _error(key.dotted, problem, origin)
    return value


def _suggest(word: str, candidates: list[str]) -> str:
    by_snake = {_camel_to_snake(c): c for c in candidates}
    if word in by_snake:
        return f"; did you mean {by_snake[word]!r}?"
    import difflib  # noqa: PLC0415 - only for a message about a mistyped key

    close = difflib.get_close_matches(word, candidates, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, set | frozenset):
        return frozenset(value)
    return value


def _parse_dispatchers(raw: Any, origin: str) -> tuple[DispatcherSpec, ...]:
    if not isinstance(raw, list | tuple) or not raw:
        raise _error(
            _DISPATCHERS_SECTION, f"expected a non-empty list of dispatchers, got {_describe(raw)}", origin
        )
    specs: list[DispatcherSpec] = []
    for index, item in enumerate(raw):
        key = f"{_DISPATCHERS_SECTION}[{index}]"
        name_key = key
        options: Any = {}
        if isinstance(item, Mapping):
            for extra in item:
                if extra not in ("name", "options"):
                    raise _error(
                        f"{key}.{extra}", "unknown key; a dispatcher entry has 'name' and 'options'", origin
                    )
            if "name" not in item:
                raise _error(f"{key}.name", "missing", origin)
            name_key = f"{key}.name"
            name = item["name"]
            options = {} if item.get("options") is None else item["options"]
            if not isinstance(options, Mapping):
                raise _error(f"{key}.options", f"expected a mapping, got {_describe(options)}", origin)
            if not all(isinstance(k, str) for k in options):
                raise _error(f"{key}.options", "option names must be strings", origin)
        elif isinstance(item, str):
            name = item
        else:
            raise _error(
                key,
                f"expected a dispatcher name or a mapping with name/options, got {_describe(item)}",
                origin,
            )
        if not isinstance(name, str):
            raise _error(name_key, f"expected a string, got {_describe(name)}", origin)
        if name not in BUILTIN_DISPATCHERS and not _PLUGIN_NAME.fullmatch(name):
            raise _error(
                name_key,
                f"{name!r} is neither a built-in dispatcher ({', '.join(BUILTIN_DISPATCHERS)}) "
                "nor a plug-in class written as package.module:Class",
                origin,
            )
        if name in BUILTIN_DISPATCHERS and any(s.name == name for s in specs):
            raise _error(name_key, f"{name!r} is listed twice; it would write the same files twice", origin)
        specs.append(DispatcherSpec(name, _freeze(options)))
    return tuple(specs)


def _split_names(raw: Any) -> Any:
    """Let an env var or CLI flag give dispatchers as 'consumequeue,index' instead of a YAML list."""
    if isinstance(raw, str):
        return [part.strip() for part in raw.split(",")]
    return raw


_strict_loader: type | None = None


def _loader() -> type:
    """PyYAML's safe loader, rejecting duplicate keys (which plain PyYAML silently resolves to the last one),
    on LibYAML's parser when PyYAML has it (most builds). Made on first use: importing PyYAML is a third of
    a query's start-up, and a query with a remembered config file (daemon/configmemo.py) does without it."""
    global _strict_loader  # noqa: PLW0603 - one class, made once
    if _strict_loader is None:
        import yaml  # noqa: PLC0415 - see above

        def construct_unique_mapping(loader, node) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = loader.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
            return loader.construct_mapping(node, deep=True)

        loader = type("StrictLoader", (getattr(yaml, "CSafeLoader", yaml.SafeLoader),), {})
        loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_unique_mapping)
        _strict_loader = loader
    return _strict_loader


def _read_yaml(source: str, *, memo: bool = False) -> Any:
    try:
        with open(source, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {source}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"config file {source} is not UTF-8 text: {exc}") from exc
    if memo:
        from daemon import configmemo  # noqa: PLC0415 - the query commands only

        found, data = configmemo.recall(source, text)
        if found:
            return data
    import yaml  # noqa: PLC0415 - see _loader

    try:
        data = yaml.load(text, Loader=_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = ": ".join(p for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p)
        raise ConfigError("", f"{where}: invalid YAML: {problem or exc}") from exc
    if memo:
        configmemo.remember(source, text, data)
    return data


class _Layers:
    """Accumulates validated settings; later layers replace earlier ones key by key."""

    def __init__(self, cwd: str) -> None:
        self.settings: dict[_Key, _Setting] = {}
        for key in _KEY_LIST:
            where = (key.section, key.name)
            if where in _DERIVED_DEFAULTS:
                default = _DERIVED_DEFAULTS[where]
            else:
                default = next(f.default for f in fields(_SECTION_CLASSES[key.section]) if f.name == key.attr)
            self.settings[key] = _Setting(default, cwd, "")
        self.dispatchers = tuple(DispatcherSpec(name, MappingProxyType({})) for name in BUILTIN_DISPATCHERS)
        # Plug-ins the config file names. A plug-in is code to import, so only the file (trusted input) may
        # name one; the environment and overrides may only choose among these and the built-ins.
        self.file_plugins: dict[str, DispatcherSpec] = {}

    def set(self, key: _Key, value: Any, base_dir: str, origin: str) -> None:
        self.settings[key] = _Setting(_validate(key, value, origin), base_dir, origin)

    def apply_file(self, data: Any, source: str) -> None:
        if data is None:
            return
        if not isinstance(data, Mapping):
            raise ConfigError(
                "", f"{source}: the top level must be a mapping of sections, got {_describe(data)}"
            )
        origin = f"in {source}"
        base_dir = os.path.dirname(source)
        sections = [*_SECTION_CLASSES, _DISPATCHERS_SECTION]
        for section, body in data.items():
            if section == _DISPATCHERS_SECTION:
                self.dispatchers = _parse_dispatchers(body, origin)
                self.file_plugins = {d.name: d for d in self.dispatchers if d.name not in BUILTIN_DISPATCHERS}
                continue
            if section not in _SECTION_CLASSES:
                owner = next((k.section for k in _KEY_LIST if k.name == section), None)
                hint = (
                    f"; {section!r} belongs under '{owner}:'" if owner else _suggest(str(section), sections)
                )
                raise _error(str(section), f"unknown section{hint}", origin)
            if body is None:
                continue
            if not isinstance(body, Mapping):
                raise _error(section, f"expected a mapping of keys, got {_describe(body)}", origin)
            for name, value in body.items():
                key = _KEYS.get((section, name))
                if key is None and _broker_only(section, name, value, origin):
                    continue
                if key is None:
                    known = [k.name for k in _KEY_LIST if k.section == section]
                    raise _error(f"{section}.{name}", f"unknown key{_suggest(str(name), known)}", origin)
                # the DLedger ids broker.conf leaves unset (Java null)
                self.set(key, "" if value is None and key.name in _NULL_AS_EMPTY else value, base_dir, origin)

    def apply_env(self, env: Mapping[str, str], cwd: str) -> None:
        for var in sorted(env):
            if not var.startswith(ENV_PREFIX) or var in ENV_IGNORED:
                continue
            raw = env[var]
            origin = f"from {var}"
            if var == _DISPATCHERS_ENV:
                self.dispatchers = self._known_plugins_only(
                    _parse_dispatchers(_split_names(_parse_env_yaml(var, var, raw)), origin), origin)
                continue
            key = _ENV_KEYS.get(var)
            if key is None:
                known = [*_ENV_KEYS, _DISPATCHERS_ENV]
                raise ConfigError(
                    var, f"environment variable names no configuration key{_suggest(var, known)}"
                )
            value = raw if key.kind in _STRING_KINDS else _parse_env_yaml(key.dotted, var, raw)
            self.set(key, value, cwd, origin)

    def apply_overrides(self, overrides: Mapping[str, Any], cwd: str) -> None:
        origin = "from overrides"
        for dotted, value in overrides.items():
            if value is None:
                continue
            if dotted == _DISPATCHERS_SECTION:
                self.dispatchers = self._known_plugins_only(_parse_dispatchers(_split_names(value), origin), origin)
                continue
            section, _, name = dotted.partition(".")
            key = _KEYS.get((section, name))
            if key is None:
                known = [k.dotted for k in _KEY_LIST] + [_DISPATCHERS_SECTION]
                raise ConfigError(dotted, f"unknown override key{_suggest(dotted, known)}")
            parsed = os.fspath(value) if isinstance(value, os.PathLike) else value
            if isinstance(value, str) and key.kind not in _STRING_KINDS:
                parsed = _parse_env_yaml(dotted, "override", value)
            self.set(key, parsed, cwd, origin)

    def _known_plugins_only(self, specs: tuple[DispatcherSpec, ...], origin: str) -> tuple[DispatcherSpec, ...]:
        """A dispatcher list from the environment or an override: built-ins, and plug-ins only as the config
        file names them (with the file's options). Anything else would let an environment variable or a
        flag make reputd import code, so it is refused (exit 2) and nothing is imported."""
        out = []
        for index, spec in enumerate(specs):
            if spec.name in BUILTIN_DISPATCHERS:
                out.append(spec)
                continue
            named = self.file_plugins.get(spec.name)
            if named is None:
                raise _error(
                    f"{_DISPATCHERS_SECTION}[{index}]",
                    f"plug-in {spec.name!r} is not named in the config file's dispatchers: list; a plug-in is "
                    "code to import, so only the config file may name one (here, only built-ins "
                    f"{', '.join(BUILTIN_DISPATCHERS)} and the file's plug-ins can be chosen)",
                    origin,
                )
            out.append(named)
        return tuple(out)

    def build(self, source: str | None) -> Config:
        kwargs: dict[str, dict[str, Any]] = {section: {} for section in _SECTION_CLASSES}
        for key, setting in self.settings.items():
            kwargs[key.section][key.attr] = setting.value
        root = self._path(_KEYS[("store", "storePathRootDir")], root=None)
        kwargs["store"]["store_path_root_dir"] = root
        commit_log = self._commit_log(_KEYS[("store", "storePathCommitLog")], root)
        kwargs["store"]["store_path_commit_log"] = commit_log
        out_key = _KEYS[("output", "dir")]
        kwargs["output"]["dir"] = root if self.settings[out_key].value is None else self._path(out_key, root)
        built = {section: cls(**kwargs[section]) for section, cls in _SECTION_CLASSES.items()}
        self._check_index_size(built["store"])
        self._check_dledger(built["store"])
        return Config(dispatchers=self.dispatchers, source=source, **built)

    def _check_dledger(self, store: StoreConfig) -> None:
        """DLedger mode needs dLegerSelfId (it names the data directory, dledger-<selfId>), and the node must be
        one of dLegerPeers (`id-host:port;...`, MemberState) when they are given."""
        if not store.enable_d_leger_commit_log:
            return
        self_key = _KEYS[("store", "dLegerSelfId")]
        if not store.d_leger_self_id.strip():
            raise _error(self_key.dotted, "must be set with enableDLegerCommitLog: true (the data path is "
                                          "<storePathRootDir>/dledger-<dLegerSelfId>/data)",
                         self.settings[self_key].origin)
        if store.d_leger_peers.strip():
            ids = [peer.split("-")[0].strip() for peer in store.d_leger_peers.split(";") if peer.strip()]
            if store.d_leger_self_id not in ids:
                raise _error(self_key.dotted, f"{store.d_leger_self_id!r} is not one of the dLegerPeers "
                                              f"({', '.join(ids) or 'none'})", self.settings[self_key].origin)

    def _check_index_size(self, store: StoreConfig) -> None:
        size = index_file_size(store.max_hash_slot_num, store.max_index_num)
        if size > _JAVA_INT_MAX:
            key = _KEYS[("store", "maxIndexNum")]
            raise _error(
                key.dotted,
                f"an IndexFile of {store.max_hash_slot_num} slots and {store.max_index_num} entries would be "
                f"{size} bytes, over the broker's 2 GiB file limit",
                self.settings[key].origin,
            )

    def _path(self, key: _Key, root: str | None, text: str | None = None) -> str:
        setting = self.settings[key]
        text = setting.value if text is None else text
        if root is not None:
            text = text.replace(ROOT_DIR_PLACEHOLDER, root)
        leftover = _PLACEHOLDER.search(text)
        if leftover:
            if root is None:
                allowed = "; no placeholders are substituted in this key"
            else:
                allowed = f"; only {ROOT_DIR_PLACEHOLDER} is substituted"
            raise _error(key.dotted, f"unknown placeholder {leftover[0]}{allowed}", setting.origin)
        return os.path.normpath(os.path.join(setting.base_dir, os.path.expanduser(text.strip())))

    def _commit_log(self, key: _Key, root: str) -> str:
        setting = self.settings[key]
        dirs: list[str] = []
        for part in setting.value.split(","):
            if not part.strip():
                raise _error(key.dotted, f"empty directory in {setting.value!r}", setting.origin)
            resolved = self._path(key, root, part)
            if resolved in dirs:
                raise _error(key.dotted, f"directory {resolved} is listed twice", setting.origin)
            dirs.append(resolved)
        return ",".join(dirs)


def _parse_env_yaml(key: str, var: str, raw: str) -> Any:
    import yaml  # noqa: PLC0415 - see _loader

    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"{raw!r} from {var} is not a valid YAML value: {exc}") from exc


def load_config(
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    memo: bool = False,
) -> Config:
    """Load and validate the configuration.

    ``env`` defaults to ``os.environ``; pass ``{}`` to ignore the environment. ``overrides`` maps dotted keys
    (``"store.storePathRootDir"``, or ``"dispatchers"``) to values and wins over everything; a None value
    means "not given", so CLI flags can be passed straight through. Relative paths in the file are resolved
    against the file's directory, all others (defaults included) against the current directory. ``memo``
    lets the file's parsed text come from daemon/configmemo.py (commands that import no plug-ins only).
    """
    cwd = os.getcwd()
    layers = _Layers(cwd)
    source = None
    if path is not None:
        source = os.path.abspath(os.path.expanduser(os.fspath(path)))
        layers.apply_file(_read_yaml(source, memo=memo), source)
    layers.apply_env(os.environ if env is None else env, cwd)
    if overrides:
        layers.apply_overrides(overrides, cwd)
    return layers.build(source)


def config_path(explicit: str | None, env: Mapping[str, str], cwd: str) -> tuple[str | None, str]:
    """Which config file a command reads, and why: `--config FILE`, else $REPUTD_CONFIG, else
    ./config/reputd.yaml when the current directory has one (a checkout, after `make run`), else none,
    which means the built-in defaults (the broker's own default sizes)."""
    if explicit:
        return explicit, "--config"
    if env.get(CONFIG_ENV):
        return env[CONFIG_ENV], f"from {CONFIG_ENV}"
    candidate = os.path.join(cwd, DEFAULT_CONFIG_FILE)
    if os.path.isfile(candidate):
        return candidate, f"{DEFAULT_CONFIG_FILE} in the current directory"
    return None, f"no --config, {CONFIG_ENV} or ./{DEFAULT_CONFIG_FILE}"


def default_config() -> Config:
    """All defaults, ignoring the environment; paths resolve against the current directory."""
    return load_config(None, env={})
