"""Queries by store time: the messages of a topic (or one queue) stored in a time window, optionally of some
tags (`query time`), and how many of each tag (`--tag-counts`); a queue's offset for a time (`query offset`)
is daemon/commands/queuetime.py's.

Each queue's window is found by two binary searches over store times (`daemon.commands.queuetime`): its
first unit stored at or after the window's begin and its first after the end, O(log n) CommitLog reads;
only the units between are read further. The window is inclusive at both ends, in store time (the
broker's clock when it stored the message, STORETIMESTAMP, epoch milliseconds). A tag filter is a TAG
subscription's, as the broker applies it: the unit's tagsCode against the hashes of the subscribed tags
first (`DefaultMessageFilter.isMatchedByConsumeQueue`, no read), then the message's own TAGS against the
tags (the client's `PullAPIWrapper.processPullResult`).

Messages of several queues come ordered by store time, then CommitLog offset (the dashboard's order; for
one queue, its queue order). A cut after `count` messages is continued from the next message's store time
and CommitLog offset (`next`), so every message is printed once across the pages.

A queue whose times read go down (its broker's clock was stepped back) is read through, every unit's time
read (`scan_times`), and `QueueWindow.out_of_order` says where: the window's messages are then all found
wherever they lie in that queue. A step that no read of the search meets cannot be seen in O(log n) reads
(docs/query.md says what that means).
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterator
from typing import NamedTuple

from daemon.commands.query import (
    _check_output,
    _listing,
    _unit_fault,
    _unit_record,
    check_queue,
    is_removed,
    open_commit_log,
    topics,
)
from daemon.commands.queuetime import LogHeads, Probe, QueueTimes
from daemon.config import Config
from indexcore.commitlog import PROPERTY_TAGS, MessageRecord, find_properties
from indexcore.errors import StoreError, StoreLayoutError

SUB_ALL = "*"  # SubscriptionData.SUB_ALL
TAG_SEPARATOR = "||"  # FilterAPI.buildSubscriptionData splits on it
UNIT_CHUNK = 256  # units read from a ConsumeQueue file at a time
_JAVA_TRIM = "".join(chr(c) for c in range(0x21))  # String.trim removes every char <= ' '
_TAGS = {PROPERTY_TAGS.encode(): 0}


class TagFilter(NamedTuple):
    """A TAG subscription expression as `FilterAPI.buildSubscriptionData` reads it: the tags, and their Java
    hash codes (the broker's codeSet)."""

    expression: str
    tags: frozenset[str]
    codes: frozenset[int]

    def matches_code(self, tags_code: int) -> bool:
        """`codeSet.contains(tagsCode.intValue())`: the unit's tagsCode cut to a Java int."""
        code = tags_code & 0xFFFFFFFF
        return (code - (1 << 32) if code & 0x80000000 else code) in self.codes

    def matches_tag(self, tag: str | None) -> bool:
        return tag is not None and tag in self.tags


def tag_filter(expression: str | None) -> TagFilter | None:
    """None for every message (no expression, empty, or `*`); ValueError for one that names no tag (a
    broker subscription with it would match nothing)."""
    from indexcore.javahash import java_string_hash  # noqa: PLC0415 - only with --tags

    if expression is None or expression in ("", SUB_ALL):
        return None
    tags = frozenset(t.strip(_JAVA_TRIM) for t in expression.split(TAG_SEPARATOR)) - {""}
    if not tags:
        raise ValueError(f"--tags {expression!r} names no tag: give TAG, 'A || B', or '*' for every tag")
    return TagFilter(expression, tags, frozenset(java_string_hash(t) for t in tags))


class QueueWindow(NamedTuple):
    """One queue's part of a window: units [first, end) (under the premise; a queue read through lists the
    queue's bounds), its bounds, the CommitLog reads made for it, `out_of_order` (two units whose store
    times go down, when they were met: the queue was then read through), `removed`: units whose segments
    retention deleted and whose messages the window may have held (it begins at or before the oldest
    retained message), `damage`: what stopped the queue's search."""

    queue_id: int
    first: int
    end: int
    min_offset: int
    max_offset: int
    reads: int
    out_of_order: tuple[Probe, Probe] | None = None
    removed: int = 0
    damage: StoreError | None = None


class TimeQueryResult(NamedTuple):
    """The messages, ordered; `next`: (store time, CommitLog offset) of the first one past `count`, None when
    there is none; `damage`: the first damage met (the messages are those ordered before it)."""

    messages: list[MessageRecord]
    windows: list[QueueWindow]
    next: tuple[int, int] | None
    commit_log_min_offset: int
    damage: StoreError | None = None


class _OutOfOrder(Exception):
    """A queue's times went down inside its window: read it through."""

    def __init__(self, queue_id: int, pair: tuple[Probe, Probe]):
        super().__init__(queue_id)
        self.queue_id, self.pair = queue_id, pair


class _Damaged(Exception):
    def __init__(self, error: StoreError):
        super().__init__(str(error))
        self.error = error


def topic_queues(config: Config, topic: str, queue_id: int | None = None) -> list[int]:
    """The queue ids of `topic` in the output (only `queue_id`, checked, when given); StoreLayoutError naming
    what the output has when the topic or queue is not there."""
    if queue_id is not None:
        check_queue(config, topic, queue_id)
        return [queue_id]
    tdir = os.path.join(_check_output(config), topic)
    if not os.path.isdir(tdir):
        raise StoreLayoutError(tdir, f"no ConsumeQueue of topic {topic!r} here (topics: "
                                     f"{_listing(topics(config)) or 'none'})")
    return sorted(int(q) for q in os.listdir(tdir) if q.isdigit() and os.path.isdir(os.path.join(tdir, q)))


class _Search:
    """The queues of one query, their windows found, and each queue's messages in the window in order."""

    def __init__(self, config: Config, topic: str, queue_ids: list[int], begin: int, end: int, from_offset: int,
                 tags: TagFilter | None, scan: bool = False):
        self.config, self.topic, self.begin, self.end, self.tags = config, topic, begin, end, tags
        self.from_offset = from_offset
        self.log = open_commit_log(config)
        self.heads = LogHeads(self.log, config.store.max_message_size)
        root = os.path.join(config.output.dir, "consumequeue", topic)
        self.queues = {q: QueueTimes(config, os.path.join(root, str(q)), topic, q, self.log, self.heads)
                       for q in queue_ids}
        self.scanned: dict[int, list[Probe]] = {}  # queues read through: their window's units, in order
        self.passed: dict[int, int] = dict.fromkeys(queue_ids, 0)  # units in a window retention removed
        self.windows: dict[int, QueueWindow] = {}
        for q, qt in self.queues.items():
            self.windows[q] = self._window(qt, scan)

    def _window(self, qt: QueueTimes, scan: bool) -> QueueWindow:
        try:
            if scan:
                return self.read_through(qt, None)
            first = qt.lower_bound(self.begin, self.from_offset)
            end = qt.lower_bound(self.end + 1, lo=first)
            removed = qt.removed if first == qt.min_offset else 0
            if first < end:  # the first unit is read by the stream anyway: reading it now tells the order
                qt.probe(first)
            qt.gallop(first, -1)
            qt.gallop(end - 1, 1)
            pair = qt.out_of_order()
            if pair is not None:
                return self.read_through(qt, pair)
        except StoreError as e:
            return QueueWindow(qt.queue_id, qt.min_offset, qt.min_offset, qt.min_offset, qt.max_offset, qt.reads,
                               damage=e)
        finally:
            qt.close()  # its files are opened again when its window is read: a topic may have many queues
        return QueueWindow(qt.queue_id, first, end, qt.min_offset, qt.max_offset, qt.reads, None, removed)

    def read_through(self, qt: QueueTimes, pair: tuple[Probe, Probe] | None) -> QueueWindow:
        """Every unit's time read: the window's units wherever they lie in the queue, in (time, offset) order."""
        probes = qt.scan_times()
        key = (self.begin, self.from_offset)
        inside = [p for p in probes if p.store_timestamp is not None
                  and key <= (p.store_timestamp, p.unit.commit_log_offset) and p.store_timestamp <= self.end]
        self.scanned[qt.queue_id] = sorted(inside, key=lambda p: (p.store_timestamp, p.unit.commit_log_offset))
        # without the premise, a unit whose record retention deleted may hold any time
        w = QueueWindow(qt.queue_id, qt.min_offset, qt.max_offset, qt.min_offset, qt.max_offset, qt.reads, pair,
                        qt.removed)
        self.windows[qt.queue_id] = w
        return w

    def units(self, queue_id: int) -> Iterator[tuple[int, object]]:
        """(queue offset, unit) of the queue's window, in order; a unit whose tagsCode the filter refuses is
        left out unread."""
        w = self.windows[queue_id]
        if w.damage is not None:
            return
        tags = self.tags
        if queue_id in self.scanned:
            for p in self.scanned[queue_id]:
                if tags is None or tags.matches_code(p.unit.tags_code):
                    yield p.queue_offset, p.unit
            return
        qt = self.queues[queue_id]
        q = w.first
        while q < w.end:
            chunk = qt.units(q, min(UNIT_CHUNK, w.end - q))
            if not chunk:
                return
            for u in chunk:
                if tags is None or tags.matches_code(u.tags_code):
                    yield q, u
                q += 1

    def check_order(self, queue_id: int, q: int, t: int, last: tuple[int, int] | None) -> None:
        """A time outside the window, or lower than the one before, inside a window found by bisection: the
        premise broke in this queue."""
        if queue_id in self.scanned:
            return
        qt = self.queues[queue_id]
        if not self.begin <= t <= self.end or (last is not None and t < last[0]):
            here = qt.probes.get(q) or Probe(q, qt.unit(q), t)
            before = qt.probes.get(last[1]) if last is not None else None
            raise _OutOfOrder(queue_id, (before or here, here))

    def messages(self, queue_id: int) -> Iterator[tuple[int, int, MessageRecord]]:
        """(store time, CommitLog offset, record) of the queue's window after the filter."""
        qt, last = self.queues[queue_id], None
        for q, u in self.units(queue_id):
            if self.no_message(queue_id, u):
                continue
            damage = _unit_fault(self.config, self.log, qt, q, u)
            rec, damage = (None, damage) if damage is not None else _unit_record(self.config, self.log, qt, q, u)
            if damage is not None:
                raise _Damaged(damage)
            qt.probes.setdefault(q, Probe(q, u, rec.store_timestamp))
            self.check_order(queue_id, q, rec.store_timestamp, last)
            last = (rec.store_timestamp, q)
            if self.tags is None or self.tags.matches_tag(rec.property_map().get(PROPERTY_TAGS)):
                yield rec.store_timestamp, rec.physical_offset, rec

    def no_message(self, queue_id: int, u) -> bool:
        """A unit inside a window with no message to read: a blank one, or one whose segment retention deleted
        (counted: a queue's offsets can go back below the CommitLog's first offset after a retained unit)."""
        if QueueTimes.is_blank(u):
            return True
        if is_removed(self.log, u.commit_log_offset):
            self.passed[queue_id] += 1
            return True
        return False

    def tag_of(self, queue_id: int, q: int, u, last: tuple[int, int] | None) -> tuple[str | None, int]:
        """The TAGS of the unit's message read without its body, and its store time (-1: no message)."""
        qt = self.queues[queue_id]
        if self.no_message(queue_id, u):
            return None, -1
        head, data = qt.head(q, u)
        self.check_order(queue_id, q, head.store_timestamp, last)
        _, props = self.heads.topic_and_properties(u.commit_log_offset, head, data)
        raw = find_properties(props, _TAGS)[0]
        return (None if raw is None else raw.decode("utf-8", "replace")), head.store_timestamp

    def final_windows(self) -> list[QueueWindow]:
        """The windows by queue id, each with the units it passed over for retention counted in `removed`."""
        return [w._replace(removed=w.removed + self.passed[q], reads=self.queues[q].reads)
                for q, w in sorted(self.windows.items())]

    def close(self) -> None:
        for qt in self.queues.values():
            qt.close()
        self.heads.close()


def _search(config: Config, topic: str, queue_id: int | None, begin: int, end: int, from_offset: int,
            tags: TagFilter | None, scan: bool) -> _Search:
    queue_ids = topic_queues(config, topic, queue_id)
    return _Search(config, topic, queue_ids, begin, end, from_offset, tags, scan)


def query_time(config: Config, topic: str, begin: int, end: int, *, queue_id: int | None = None,
               tags: TagFilter | None = None, count: int = 32, from_offset: int = -1,
               scan: bool = False) -> TimeQueryResult:
    """The messages of `topic` (or of queue `queue_id`) stored in [begin, end], at most `count`, ordered by
    store time then CommitLog offset; with `from_offset`, those stored at `begin` below that CommitLog
    offset are left out (a continuation). `scan` reads every queue through instead of searching it."""
    search = _search(config, topic, queue_id, begin, end, from_offset, tags, scan)
    try:
        while True:
            taken: list[tuple[int, int, MessageRecord]] = []
            damage = None
            search.passed = dict.fromkeys(search.passed, 0)
            streams = [search.messages(q) for q in sorted(search.windows)]
            try:
                for item in heapq.merge(*streams, key=lambda m: (m[0], m[1])):
                    taken.append(item)
                    if len(taken) > count:
                        break
            except _OutOfOrder as e:  # read that queue through, and start again
                search.read_through(search.queues[e.queue_id], e.pair)
                continue
            except _Damaged as e:
                damage = e.error
            break
        damage = damage or next((w.damage for w in search.windows.values() if w.damage is not None), None)
        nxt = (taken[count][0], taken[count][1]) if len(taken) > count and damage is None else None
        return TimeQueryResult([m[2] for m in taken[:count]], search.final_windows(), nxt, search.log.min_offset,
                               damage)
    finally:
        search.close()


class TagCounts(NamedTuple):
    """How many messages of each tag a queue's window holds (`printMsgByQueue -f`), and how many have no
    tag (mqadmin leaves those out; here they are counted apart)."""

    queue_id: int | None
    tags: dict[str, int]
    untagged: int

    @property
    def messages(self) -> int:
        return sum(self.tags.values()) + self.untagged


class TagCountResult(NamedTuple):
    queues: list[TagCounts]
    windows: list[QueueWindow]
    commit_log_min_offset: int
    damage: StoreError | None = None

    @property
    def total(self) -> TagCounts:
        tags: dict[str, int] = {}
        for c in self.queues:
            for tag, n in c.tags.items():
                tags[tag] = tags.get(tag, 0) + n
        return TagCounts(None, tags, sum(c.untagged for c in self.queues))


def _is_blank_tag(tag: str | None) -> bool:
    """`StringUtils.isBlank`: None, empty or whitespace only (Character.isWhitespace)."""
    return tag is None or not tag.strip(" \t\n\x0b\x0c\r\x1c\x1d\x1e\x1f")


def tag_counts(config: Config, topic: str, begin: int, end: int, *, queue_id: int | None = None,
               tags: TagFilter | None = None, scan: bool = False) -> TagCountResult:
    """Per queue, how many messages of each tag were stored in [begin, end] (after the filter), read
    without their bodies."""
    search = _search(config, topic, queue_id, begin, end, -1, tags, scan)
    counted: list[TagCounts] = []
    damage = None
    try:
        for q in sorted(search.windows):
            while True:
                by_tag: dict[str, int] = {}
                untagged = 0
                last = None
                search.passed[q] = 0
                try:
                    for qo, u in search.units(q):
                        tag, t = search.tag_of(q, qo, u, last)
                        if t < 0:
                            continue
                        last = (t, qo)
                        if tags is not None and not tags.matches_tag(tag):
                            continue
                        if _is_blank_tag(tag):
                            untagged += 1
                        else:
                            by_tag[tag] = by_tag.get(tag, 0) + 1
                except _OutOfOrder as e:
                    search.read_through(search.queues[q], e.pair)
                    continue
                except StoreError as e:
                    damage = damage or e
                break
            counted.append(TagCounts(q, by_tag, untagged))
        damage = damage or next((w.damage for w in search.windows.values() if w.damage is not None), None)
        return TagCountResult(counted, search.final_windows(), search.log.min_offset, damage)
    finally:
        search.close()


__all__ = ["QueueWindow", "TagCountResult", "TagCounts", "TagFilter", "TimeQueryResult", "query_time", "tag_counts",
           "tag_filter", "topic_queues"]
