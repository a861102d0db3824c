"""`query time` and `query offset` against a record-by-record scan of the CommitLog (tests/timescan.py): on
every conformance store the real broker wrote (plain, LMQ, DLedger), on a 5.x CommitLog, and on generated
stores whose store times repeat and go back (a broker clock set back), as hypothesis properties over
windows, queues and tag filters."""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.commands.queuetime import query_offset
from daemon.commands.timequery import query_time, tag_counts, tag_filter
from daemon.config import load_config
from daemon.engine.rebuild import rebuild
from indexcore.consumequeue import CQ_UNIT_SIZE
from indexcore.writer import CommitLogWriter, Message
from tests.conformance import discover
from tests.test_rebuild_5x import SEGMENT as SEGMENT_5X
from tests.test_rebuild_5x import write_5x_log
from tests.timescan import scan_queues, search_offset_493, selected, window

CONFORMANCE = {s.name: s for s in discover()}
EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SEGMENT = 16 * 1024
CQ_FILE = 20 * CQ_UNIT_SIZE  # 20 units a file: queues of several files
TAGS = ("TagA", "TagB", "标签", "Aa", "BB", "")  # "Aa" and "BB" share a Java hash


def _config(tmp: Path, root: Path, out: Path, **store) -> object:
    path = tmp / "reputd.yaml"
    path.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **store}, "output": {"dir": str(out)},
                                    "logging": {"level": "warning"}}))
    return load_config(path, env={})


def conformance_config(tmp: Path, name: str):
    """The broker's own store, queried where it lies (every query opens files read-only)."""
    s = CONFORMANCE[name]
    return _config(tmp, s.store, s.store, **s.store_settings())


def store_5x(tmp: Path):
    write_5x_log(tmp, 3)
    config = _config(tmp, tmp, tmp / "out", mappedFileSizeCommitLog=SEGMENT_5X, mappedFileSizeConsumeQueue=200,
                     maxHashSlotNum=53, maxIndexNum=5000)
    rebuild(config)
    return config


def stepping_clock(rng: random.Random, steps: int):
    """Store times that repeat (0-30 ms apart) and, `steps` times, go back 20-400 ms (a clock set back)."""
    now = 1_800_000_000_000
    step_at = set(rng.sample(range(40, 560), steps))
    count = 0

    def clock() -> int:
        nonlocal now, count
        count += 1
        now += rng.choice((0, 0, 1, 2, 5, 30))
        if count in step_at:
            now -= rng.randint(20, 400)
        return now

    return clock


def generated_store(tmp: Path, seed: int, steps: int):
    rng = random.Random(seed)
    with CommitLogWriter(str(tmp / "store" / "commitlog"), SEGMENT, clock=stepping_clock(rng, steps)) as w:
        for i in range(600):
            props = {"TAGS": rng.choice(TAGS), "KEYS": f"k{i}"}
            if not props["TAGS"]:
                del props["TAGS"]
            w.append(Message(rng.choice(("TA", "TB")), rng.randrange(3), rng.randbytes(rng.randint(0, 300)), props))
    config = _config(tmp, tmp / "store", tmp / "out", mappedFileSizeCommitLog=SEGMENT,
                     mappedFileSizeConsumeQueue=CQ_FILE, maxHashSlotNum=31, maxIndexNum=2000)
    rebuild(config)
    return config


STORES = [*CONFORMANCE, "5x", "repeats"]


@pytest.fixture(scope="module", params=STORES)
def scanned(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param.replace("/", "_"))
    if request.param == "5x":
        config = store_5x(tmp)
    elif request.param == "repeats":
        config = generated_store(tmp, 11, 0)
    else:
        config = conformance_config(tmp, request.param)
    return Scanned(request.param, config, scan_queues(config))


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    config = generated_store(tmp_path_factory.mktemp("steps"), 5, 3)
    return Scanned("steps", config, scan_queues(config))


class Scanned(tuple):
    """(config, the scan's queues) of a store, shown by its name in a failing example."""

    def __new__(cls, name: str, config, queues):
        self = super().__new__(cls, (config, queues))
        self.name = name
        return self

    def __repr__(self) -> str:
        return f"<store {self.name}>"


def colliding(tag: str) -> str:
    """Another string with the tag's Java hash ("Aa" -> "BB"): the unit's tagsCode passes, the tag does not."""
    return tag[:-2] + chr(ord(tag[-2]) + 1) + chr(ord(tag[-1]) - 31) if len(tag) >= 2 and ord(tag[-1]) >= 31 else tag


@st.composite
def queries(draw, queues):
    """A topic, a window around its store times (often exactly on one), a queue or all, a tag filter."""
    topic = draw(st.sampled_from(sorted({t for t, _ in queues})))
    msgs = [m for (t, _), ms in queues.items() if t == topic for m in ms]
    times = sorted(m.store_timestamp for m in msgs)
    edge = st.one_of(st.sampled_from(times), st.integers(times[0] - 5, times[-1] + 5))
    begin, end = sorted((draw(edge), draw(edge)))
    queue_id = draw(st.one_of(st.none(), st.sampled_from(sorted({q for t, q in queues if t == topic}))))
    tags = sorted({m.tags for m in msgs if m.tags})
    filters = [None, "*"]
    if tags:
        a, b = draw(st.sampled_from(tags)), draw(st.sampled_from(tags))
        filters += [a, f" {a} || {b} ", f"{a}||", colliding(a)]
    return topic, begin, end, queue_id, draw(st.sampled_from(filters))


def answered(config, topic, begin, end, queue_id, tags, **kw):
    result = query_time(config, topic, begin, end, queue_id=queue_id, tags=tag_filter(tags), count=10**9, **kw)
    assert result.damage is None
    assert result.next is None
    return result, [(m.store_timestamp, m.physical_offset) for m in result.messages]


@EXAMPLES
@given(data=st.data())
def test_a_time_window_answers_what_a_scan_of_the_commitlog_finds(scanned, data):
    """Every message stored in the window (inclusive) that the TAG subscription takes, by (store time, CommitLog
    offset): the same list as the scan's, on the broker's stores and on stores whose times repeat."""
    config, queues = scanned
    topic, begin, end, queue_id, tags = data.draw(queries(queues))
    result, got = answered(config, topic, begin, end, queue_id, tags)
    assert got == window(queues, topic, begin, end, queue_id, tags)
    assert all(w.out_of_order is None for w in result.windows)


@EXAMPLES
@given(data=st.data(), count=st.integers(1, 7))
def test_pages_continued_from_next_give_each_message_once(scanned, data, count):
    """Cut after `count` messages and continued from `next` (store time, CommitLog offset), page after page
    (at most about 12 pages: a window of a whole store cut after every message took 9 s)."""
    config, queues = scanned
    topic, begin, end, queue_id, tags = data.draw(queries(queues))
    expected = window(queues, topic, begin, end, queue_id, tags)
    count = max(count, len(expected) // 12)
    got, start, from_offset = [], begin, -1
    for _ in range(len(expected) // count + 2):
        page = query_time(config, topic, start, end, queue_id=queue_id, tags=tag_filter(tags), count=count,
                          from_offset=from_offset)
        got += [(m.store_timestamp, m.physical_offset) for m in page.messages]
        if page.next is None:
            break
        start, from_offset = page.next
    assert got == expected


@EXAMPLES
@given(data=st.data())
def test_tag_counts_are_the_scans_counts(scanned, data):
    config, queues = scanned
    topic, begin, end, queue_id, tags = data.draw(queries(queues))
    result = tag_counts(config, topic, begin, end, queue_id=queue_id, tags=tag_filter(tags))
    assert result.damage is None
    for counts in result.queues:
        msgs = selected(queues, topic, begin, end, counts.queue_id, tags)
        expected = collections.Counter(m.tags for m in msgs if m.tags and m.tags.strip())
        assert (counts.tags, counts.untagged) == (dict(expected), len(msgs) - sum(expected.values()))


def brokers_offset(config, msgs, timestamp: int) -> int:
    """4.9.3's answer from the scan's list of a queue's messages: the file (the first whose last unit is
    stored at or after the time, else the last), then its binary search."""
    per_file = config.store.mapped_file_size_consume_queue // CQ_UNIT_SIZE
    by_offset = {m.queue_offset: m.store_timestamp for m in msgs}
    first, last = min(by_offset), max(by_offset)
    starts = list(range(first - first % per_file, last + 1, per_file))
    chosen = next((s for s in starts[:-1] if by_offset[s + per_file - 1] >= timestamp), starts[-1])
    times = [by_offset.get(q) for q in range(chosen, min(chosen + per_file, last + 1))]
    return chosen + search_offset_493(times, timestamp, max(first - chosen, 0))


@EXAMPLES
@given(data=st.data())
def test_query_offset_is_the_brokers_search_over_the_scans_times(scanned, data):
    config, queues = scanned
    (topic, queue_id), msgs = data.draw(st.sampled_from(sorted(queues.items())))
    times = [m.store_timestamp for m in msgs]
    timestamp = data.draw(st.one_of(st.sampled_from(times), st.integers(min(times) - 5, max(times) + 5)))
    got = query_offset(config, topic, queue_id, timestamp)
    assert got.queue_offset == brokers_offset(config, msgs, timestamp)
    assert got.first_at_or_after == next((m.queue_offset for m in msgs if m.store_timestamp >= timestamp),
                                         msgs[-1].queue_offset + 1)
    assert got.out_of_order is None


def lived_twice(times: list[int], t: int) -> bool:
    """Whether `t` splits the queue's times other than once: some message stored at or after `t` comes before
    one stored before it (a window edge at a time the broker's clock went through twice)."""
    seen_later = False
    for x in times:
        if x >= t:
            seen_later = True
        elif seen_later:
            return True
    return False


@EXAMPLES
@given(data=st.data())
def test_a_clock_set_back_is_read_through_when_met_and_leaves_nothing_wrong(stepped, data):
    """With store times going back: every answer is part of the scan's, in order; a queue's part is all of it
    when neither window edge falls in a time the clock went through twice in that queue, or when the searches
    met the step (the queue is then read through, and its window says where); `scan` always answers all."""
    config, queues = stepped
    topic, begin, end, queue_id, tags = data.draw(queries(queues))
    result, got = answered(config, topic, begin, end, queue_id, tags)
    assert got == sorted(got)
    for w in result.windows:
        expected = window(queues, topic, begin, end, w.queue_id, tags)
        mine = [(m.store_timestamp, m.physical_offset) for m in result.messages if m.queue_id == w.queue_id]
        assert set(mine) <= set(expected)
        times = [m.store_timestamp for m in queues[(topic, w.queue_id)]]
        if w.out_of_order is not None or not any(lived_twice(times, t) for t in (begin, end + 1)):
            assert mine == expected
    assert answered(config, topic, begin, end, queue_id, tags, scan=True)[1] == window(queues, topic, begin, end,
                                                                                       queue_id, tags)


def test_a_step_the_search_meets_is_read_through_and_named(stepped):
    """A window over the whole store holds every step: the queues' times go down inside it, so each queue is
    read through, and the window names the two units it saw out of order."""
    config, queues = stepped
    msgs = queues[("TA", 0)]
    result, got = answered(config, "TA", msgs[0].store_timestamp, max(m.store_timestamp for m in msgs), 0, None)
    assert got == window(queues, "TA", msgs[0].store_timestamp, max(m.store_timestamp for m in msgs), 0)
    (w,) = result.windows
    a, b = w.out_of_order
    assert a.queue_offset < b.queue_offset
    assert a.store_timestamp > b.store_timestamp
