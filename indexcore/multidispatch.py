"""Multi-dispatch: one CommitLog record, ConsumeQueue units in several queues (RocketMQ 4.9.3, LMQ).

With `enableMultiDispatch`, a record's INNER_MULTI_DISPATCH property names queues, comma-separated, and
INNER_MULTI_QUEUE_OFFSET (added by the broker when it appends the record) gives each one's queue offset,
in the same order. Besides its own unit, the record then gets one unit in each named queue: the same
commit_log_offset, msg_size and tags_code, at that queue offset (`ConsumeQueue.multiDispatchLmqQueue`).
With `enableLmq`, a name starting with `%LMQ%` is a Light Message Queue: queue id 0 whatever the record's
own; any other name (and every name without `enableLmq`) takes the record's queue id. The rules, as the
4.9.3 store applies them on dispatch:

* only records that get a unit of their own (NOT_TYPE and COMMIT_TYPE) are multi-dispatched;
* both properties must be present and not blank (`StringUtils.isBlank`: only Java whitespace);
* both are split as Java's `String.split(",")` splits: trailing empty pieces are dropped (`a,b,` is two
  names); when the two counts differ the broker logs an error and writes no extra unit;
* each unit goes through the queue's ordinary put, so a name repeated in one record gets one unit (the
  second is not past the queue's maxPhysicOffset), and a unit whose queue offset is behind the queue's
  end is skipped while one at offset 0 is appended wherever the queue ends (what 4.9.3 did after a
  restart, when it handed out LMQ offsets from 0 again).

Where the broker cannot go on, reputd stops with a typed error instead (the reput thread of 4.9.3
retries such a record forever): a record without properties while multi-dispatch is on (4.9.3 dereferences
the missing property map: apache/rocketmq#4136), and an offset that `Long.parseLong` rejects. Offsets are
also refused when negative or so large that their byte position overflows, and when written with other
than ASCII digits (Java would take any Unicode decimal digit; the broker only writes ASCII). A queue name
becomes a directory under `consumequeue/`, so the topic rules of `commitlog.check_topic` apply to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from indexcore import _kernels
from indexcore.commitlog import (
    MAX_TOPIC_NAME_BYTES,
    MESSAGE_MAGIC_CODE_V2,
    TRANSACTION_COMMIT_TYPE,
    TRANSACTION_NOT_TYPE,
    check_topic,
    transaction_type,
)
from indexcore.errors import CorruptRecordError

PROPERTY_INNER_MULTI_DISPATCH = "INNER_MULTI_DISPATCH"
PROPERTY_INNER_MULTI_QUEUE_OFFSET = "INNER_MULTI_QUEUE_OFFSET"
MULTI_DISPATCH_QUEUE_SPLITTER = ","
LMQ_PREFIX = "%LMQ%"
LMQ_QUEUE_ID = 0
CQ_UNIT_SIZE = 20
MAX_QUEUE_OFFSET = (2**63 - 1) // CQ_UNIT_SIZE  # a larger offset's byte position overflows a Java long
MULTI_DISPATCH_FIELD = "properties." + PROPERTY_INNER_MULTI_DISPATCH
MULTI_QUEUE_OFFSET_FIELD = "properties." + PROPERTY_INNER_MULTI_QUEUE_OFFSET

# Java's Character.isWhitespace, which StringUtils.isBlank applies to every char
JAVA_WHITESPACE = frozenset("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
                            "\u2008\u2009\u200a\u2028\u2029\u205f\u3000")

# the kernel's decode_window flags, and what it makes of a record (R_MULTI)
MULTI_DISPATCH = _kernels.MULTI_DISPATCH
MULTI_DISPATCH_LMQ = _kernels.MULTI_DISPATCH_LMQ
MULTI_NONE = _kernels.MULTI_NONE
MULTI_DISPATCHED = _kernels.MULTI_DISPATCHED
MULTI_COUNT_MISMATCH = _kernels.MULTI_COUNT_MISMATCH

# errors the kernel reports (continuing commitlog.RECORD_ERRORS)
ERR_MULTI_NO_PROPERTIES = _kernels.ERR_MULTI_NO_PROPERTIES
ERR_MULTI_QUEUE_OFFSET = _kernels.ERR_MULTI_QUEUE_OFFSET
OFFSET_NOT_A_NUMBER = _kernels.OFFSET_NOT_A_NUMBER
OFFSET_NEGATIVE = _kernels.OFFSET_NEGATIVE
OFFSET_TOO_LARGE = _kernels.OFFSET_TOO_LARGE
_OFFSET_WHY = {
    OFFSET_NOT_A_NUMBER: "not a decimal number (Long.parseLong fails, and RocketMQ 4.9.3's reput retries the "
                         "record forever)",
    OFFSET_NEGATIVE: "negative",
    OFFSET_TOO_LARGE: f"over {MAX_QUEUE_OFFSET}, where its byte position in the queue overflows",
}


def multi_dispatch_flags(enable_multi_dispatch: bool, enable_lmq: bool) -> int:
    """The kernel's flags for these two store settings (0: multi-dispatch off, nothing extracted)."""
    if not enable_multi_dispatch:
        return 0
    return MULTI_DISPATCH | (MULTI_DISPATCH_LMQ if enable_lmq else 0)


def multi_dispatch_error(code: int, piece: int = 0, why: int = 0, *_: int) -> CorruptRecordError:
    """The typed error of a kernel code `ERR_MULTI_*`."""
    if code == ERR_MULTI_NO_PROPERTIES:
        return CorruptRecordError("properties", "none, and enableMultiDispatch is set: RocketMQ 4.9.3's reput "
                                                "fails on such a record (NullPointerException, fixed in 4.9.4 by "
                                                "apache/rocketmq#4136) and never dispatches past it")
    if code == ERR_MULTI_QUEUE_OFFSET:
        return CorruptRecordError(MULTI_QUEUE_OFFSET_FIELD, f"offset #{piece} is {_OFFSET_WHY[why]}")
    raise ValueError(f"not a multi-dispatch error code: {code}")


def check_queue_name(raw: bytes) -> str:
    """A multi-dispatch queue name, refused as a topic would be: it becomes `consumequeue/{name}/`."""
    try:
        return check_topic(raw, MESSAGE_MAGIC_CODE_V2)
    except CorruptRecordError as e:
        raise CorruptRecordError(MULTI_DISPATCH_FIELD, f"queue name: {e.detail}") from None


def java_split(text: str, separator: str = MULTI_DISPATCH_QUEUE_SPLITTER) -> list[str]:
    """`String.split` with a one-character separator: trailing empty strings are dropped."""
    pieces = text.split(separator)
    while pieces and not pieces[-1]:
        pieces.pop()
    return pieces


def java_is_blank(text: str | None) -> bool:
    """`StringUtils.isBlank`: None, empty, or only Java whitespace."""
    return text is None or all(c in JAVA_WHITESPACE for c in text)


def parse_queue_offset(text: str) -> int:
    """`Long.parseLong` of an INNER_MULTI_QUEUE_OFFSET piece, ASCII digits only, in [0, MAX_QUEUE_OFFSET];
    ValueError (with the reason) otherwise."""
    digits = text[1:] if text[:1] in "+-" else text
    if not digits or not (digits.isascii() and digits.isdigit()):
        raise ValueError(_OFFSET_WHY[OFFSET_NOT_A_NUMBER])
    value = int(text)
    if value < 0:
        raise ValueError(_OFFSET_WHY[OFFSET_NEGATIVE])
    if value > MAX_QUEUE_OFFSET:
        raise ValueError(_OFFSET_WHY[OFFSET_TOO_LARGE])
    return value


class MultiDispatchTarget(NamedTuple):
    """One extra unit of a record: the queue it goes to and its offset there."""

    topic: str
    queue_id: int
    queue_offset: int


def multi_dispatch_targets(properties: Mapping[str, str] | None, sys_flag: int, queue_id: int, *,
                           enable_lmq: bool) -> list[MultiDispatchTarget] | None:
    """The extra units the 4.9.3 store writes for one record with multi-dispatch on, record by record
    (the kernel does the same for a whole window; tests hold the two to each other).

    `properties` is the parsed property map, None when the record's properties are empty (a non-empty
    string can parse to an empty map, which is not the same to the broker). Returns [] for a record
    without targets and None where the counts of names and offsets differ; raises CorruptRecordError
    where the broker cannot go on (see the module docstring). Names are not checked here."""
    if transaction_type(sys_flag) not in (TRANSACTION_NOT_TYPE, TRANSACTION_COMMIT_TYPE):
        return []
    if properties is None:
        raise multi_dispatch_error(ERR_MULTI_NO_PROPERTIES)
    names = properties.get(PROPERTY_INNER_MULTI_DISPATCH)
    offsets = properties.get(PROPERTY_INNER_MULTI_QUEUE_OFFSET)
    if java_is_blank(names) or java_is_blank(offsets):
        return []
    names_list, offsets_list = java_split(names), java_split(offsets)
    if len(names_list) != len(offsets_list):
        return None
    out = []
    for i, (name, text) in enumerate(zip(names_list, offsets_list, strict=True)):
        try:
            offset = parse_queue_offset(text)
        except ValueError as e:
            raise CorruptRecordError(MULTI_QUEUE_OFFSET_FIELD, f"offset #{i} is {e}") from None
        lmq = enable_lmq and name.startswith(LMQ_PREFIX)
        out.append(MultiDispatchTarget(name, LMQ_QUEUE_ID if lmq else queue_id, offset))
    return out


__all__ = [
    "LMQ_PREFIX",
    "LMQ_QUEUE_ID",
    "MAX_QUEUE_OFFSET",
    "MAX_TOPIC_NAME_BYTES",
    "MULTI_DISPATCH_FIELD",
    "MULTI_QUEUE_OFFSET_FIELD",
    "PROPERTY_INNER_MULTI_DISPATCH",
    "PROPERTY_INNER_MULTI_QUEUE_OFFSET",
    "MultiDispatchTarget",
    "check_queue_name",
    "java_is_blank",
    "java_split",
    "multi_dispatch_error",
    "multi_dispatch_flags",
    "multi_dispatch_targets",
    "parse_queue_offset",
]
