"""The key table: every key a section takes, its kind, its check and its default, which validation, the
environment layer and docs/configuration.md (tools/config_reference.py) all read; and the broker.conf keys
accepted only to be ignored or only at their default."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from daemon.config.model import (
    CQ_STORE_UNIT_SIZE,
    ON_CORRUPTION_SKIP_SEGMENT,
    ON_CORRUPTION_STOP,
    ROOT_DIR_PLACEHOLDER,
    BackfillConfig,
    LoggingConfig,
    MetricsConfig,
    OutputConfig,
    ReputConfig,
    RetentionConfig,
    StoreConfig,
    _camel_to_snake,
    env_var_name,
)
from indexcore.dispatch import parse_delay_levels

_JAVA_INT_MAX = 2**31 - 1


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
    "retention": RetentionConfig,
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
    _Key("retention", "deleteFilesPerSecond", "int", (_in_range(0),)),
    _Key("retention", "deleteBytesPerSecond", "int", (_in_range(0),)),
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
    "deleteCommitLogFilesInterval", "deleteConsumeQueueFilesInterval",
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
