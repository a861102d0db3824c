"""The oracle of the time queries: a record-by-record scan of the CommitLog, and 4.9.3's
`getOffsetInQueueByTime` run over the scan's lists.

`scan_queues` reads every record once (the reader the rebuild uses) and lists, for each ConsumeQueue the
dispatch gives a unit (a record's own queue, and with multi-dispatch its LMQ queues, once each), the
messages in queue order with their store time, CommitLog offset, TAGS and tagsCode. `window` answers a time query from
those lists: the messages stored in [begin, end] that a tag subscription takes, ordered by (store time,
CommitLog offset), as `query time` orders them. `search_offset_493` is the broker's binary search written
plainly over a list of store times (one file: the lists here are single-file queues or are searched file by
file by the caller).
"""

from __future__ import annotations

from typing import NamedTuple

from daemon.config import Config
from daemon.engine.reading import make_reader, open_commit_log
from indexcore.commitlog import PROPERTY_TAGS
from indexcore.javahash import java_string_hash
from indexcore.readresult import ReadStatus


class Scanned(NamedTuple):
    store_timestamp: int
    commit_log_offset: int
    queue_offset: int
    tags: str | None
    tags_code: int


def scan_queues(config: Config) -> dict[tuple[str, int], list[Scanned]]:
    log = open_commit_log(config)
    reader = make_reader(config, log, 1 << 20)
    queues: dict[tuple[str, int], list[Scanned]] = {}
    offset = log.min_offset
    try:
        while True:
            result = reader.read(offset)
            b = result.batch
            mask = b.consume_queue_mask()
            targets: dict[int, list[tuple[str, int, int]]] = {}
            for j in range(len(b.multi_owner)):
                targets.setdefault(int(b.multi_owner[j]), []).append(
                    (b.topics[int(b.multi_topic_id[j])], int(b.multi_queue_id[j]), int(b.multi_queue_offset[j])))
            for i in range(len(b)):
                if not mask[i]:
                    continue
                phy = int(b.phy_offset[i])
                tags = log.read_record(phy, max_message_size=config.store.max_message_size).property_map().get(
                    PROPERTY_TAGS)
                for topic, qid, qo in [(b.topic_of(i), int(b.queue_id[i]), int(b.queue_offset[i])),
                                       *targets.get(i, [])]:
                    units = queues.setdefault((topic, qid), [])
                    if units and units[-1].commit_log_offset >= phy:
                        continue  # a queue a record names twice gets one unit (the put skips the repeat)
                    units.append(Scanned(int(b.store_timestamp[i]), phy, qo, tags, int(b.tags_code[i])))
            if result.status is not ReadStatus.OK and not result.rolled:
                break
            if result.next_offset == offset:
                break
            offset = result.next_offset
    finally:
        reader.close()
    return queues


def tags_of(expression: str | None) -> set[str] | None:
    """FilterAPI.buildSubscriptionData's tags (None: every message)."""
    if expression is None or expression in ("", "*"):
        return None
    return {t.strip("".join(chr(c) for c in range(0x21))) for t in expression.split("||")} - {""}


def java_int(tags_code: int) -> int:
    code = tags_code & 0xFFFFFFFF
    return code - (1 << 32) if code & 0x80000000 else code


def selected(queues: dict[tuple[str, int], list[Scanned]], topic: str, begin: int, end: int,
             queue_id: int | None = None, tags: str | None = None) -> list[Scanned]:
    """The messages a query must answer: stored in [begin, end], taken by the TAG subscription (the unit's
    tagsCode as a Java int among the tags' hashes, then the TAGS among the tags), in queue order."""
    wanted = tags_of(tags)
    codes = None if wanted is None else {java_string_hash(t) for t in wanted}
    out = []
    for (t, q), msgs in queues.items():
        if t != topic or (queue_id is not None and q != queue_id):
            continue
        for m in msgs:
            if not begin <= m.store_timestamp <= end:
                continue
            if codes is not None and (java_int(m.tags_code) not in codes or m.tags not in wanted):
                continue
            out.append(m)
    return out


def window(queues: dict[tuple[str, int], list[Scanned]], topic: str, begin: int, end: int,
           queue_id: int | None = None, tags: str | None = None) -> list[tuple[int, int]]:
    """(store time, CommitLog offset) of every message the query must answer, in its order."""
    return sorted((m.store_timestamp, m.commit_log_offset) for m in selected(queues, topic, begin, end, queue_id, tags))


def search_offset_493(times: list[int | None], timestamp: int, first: int = 0) -> int:
    """`ConsumeQueue.getOffsetInQueueByTime` within one file whose units have these store times (None: below
    the CommitLog's first offset), the units before `first` skipped (minLogicOffset); a unit index."""
    low, high = first, len(times) - 1
    target = left = right = -1
    left_value = right_value = -1
    while high >= low:
        mid = (low + high) // 2
        t = times[mid]
        if t is None:
            low, left = mid + 1, mid
            continue
        if t == timestamp:
            target = mid
            break
        if t > timestamp:
            high, right, right_value = mid - 1, mid, t
        else:
            low, left, left_value = mid + 1, mid, t
    if target != -1:
        return target
    if left_value == -1:
        return right
    if right_value == -1:
        return left
    return right if abs(timestamp - left_value) > abs(timestamp - right_value) else left
