"""The catalog's rows, built a batch at a time in C and numpy (`daemon/backfill/catalog.py`), against the
same fields read one record at a time by `MessageRecord.decode`: every column of every row, over records
with IPv6 hosts, long (v2) topics, junk and repeated properties, malformed UTF-8, odd REAL_QID values and
several days."""

from __future__ import annotations

import collections
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import settings as settings_
from hypothesis import strategies as st

from daemon.backfill import catalog, catalogstage
from indexcore.batchdecode import CATALOG_FIELDS
from indexcore.commitlog import Host, MessageRecord, find_properties
from indexcore.msgid import create_offset_msg_id
from indexcore.reader import CommitLog, CommitLogReader, decode_segment
from indexcore.writer import CommitLogWriter, Message

SEGMENT = 1 << 20
NAMES = ["TAGS", "REAL_TOPIC", "REAL_QID", "KEYS", "UNIQ_KEY", "TAG", "ATAGS", "x", "DELAY"]
# "@@" becomes b"\xff\xfe" and "%%%" a truncated UTF-8 sequence before a space, after writing (properties
# are outside the body CRC), so that malformed text reaches every string column
VALUES = ["", " ", "a b", "  a  b ", "12", "-3", "+7", "007", "2147483647", "2147483648", "-2147483648",
          "9999999999", "99999999999", "标签", "x\x01y", "😀 😀", "k@@1 k2", "%%%k", "@@"]
MALFORMED = {b"@@": b"\xff\xfe", b"%%%": b"\xe6\x97 "}
JAVA_INT = re.compile(r"[+-]?[0-9]{1,10}")


def write_varied_store(root: Path, seed: int, n: int = 1500) -> None:
    rng = random.Random(seed)
    now = [1_700_000_000_000]

    def clock() -> int:
        now[0] += rng.choice([0, 1, 1000, 5 * 3_600_000])
        return now[0]

    store_host = Host(bytes(range(16)), 1234) if seed % 2 else Host(bytes([10, 0, 0, 1]), 10911)
    with CommitLogWriter(str(root), SEGMENT, clock=clock, allow_v2=True, store_host=store_host) as w:
        for _ in range(n):
            props = {rng.choice(NAMES): rng.choice(VALUES) for _ in range(rng.randrange(6))}
            if "DELAY" in props:
                props["DELAY"] = str(rng.randrange(1, 5))
            born = Host(bytes(range(16)), 5) if rng.random() < 0.3 else Host(bytes([1, 2, 3, 4]), 6)
            w.append(Message(rng.choice(["A", "B", "T" * 200, "标"]), rng.randrange(4), bytes(rng.randrange(50)),
                             props, born_host=born))
    for path in root.iterdir():
        data = path.read_bytes()
        for marker, raw in MALFORMED.items():
            data = data.replace(marker, raw)
        path.write_bytes(data)


# the properties the catalog reads, as the broker reads them (`find_properties`: the last non-empty value)
PROPERTIES = {b"TAGS": 0, b"KEYS": 1, b"UNIQ_KEY": 2, b"REAL_TOPIC": 3, b"REAL_QID": 4}


def text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode("utf-8", "replace")


def java_int(value: str | None) -> int | None:
    """Integer.parseInt of an optional sign and ASCII digits within int32; None for anything else."""
    if value is None or not JAVA_INT.fullmatch(value):
        return None
    number = int(value)
    return number if -(2**31) <= number < 2**31 else None


def expected_row(record: MessageRecord, tags_code: int) -> dict:
    tags, keys, uniq, real_topic, real_qid = find_properties(record.properties, PROPERTIES)
    return {
        "commitLogOffset": record.physical_offset, "msgSize": record.total_size, "queueId": record.queue_id,
        "queueOffset": record.queue_offset, "storeTime": record.store_timestamp, "bornTime": record.born_timestamp,
        "tags": text(tags), "tagsCode": tags_code, "sysFlag": record.sys_flag,
        "keys": None if keys is None else [k for k in text(keys).split(" ") if k], "uniqKey": text(uniq),
        "msgId": create_offset_msg_id(record.store_host, record.physical_offset),
        "realTopic": text(real_topic), "realQueueId": java_int(text(real_qid)),
        "bodySize": len(record.body), "body": record.body,
    }


def as_plain(row: dict) -> dict:
    for name in ("storeTime", "bornTime"):
        row[name] = int(row[name].timestamp() * 1000) if row[name] is not None else None
    return row


def test_every_catalog_column_is_what_a_record_by_record_reading_gives(tmp_path):
    rows = records = 0
    nulls = collections.Counter()
    for seed in (1, 2):
        root = tmp_path / f"store{seed}"
        write_varied_store(root, seed)
        log = CommitLog(str(root), SEGMENT)
        reader = CommitLogReader(log, batch_bytes=1 << 15, multi_flags=CATALOG_FIELDS)
        offset = log.min_offset
        try:
            while True:
                batch = reader.read(offset).batch
                if not len(batch):
                    break
                seg_start = offset - offset % SEGMENT
                image = (root / f"{seg_start:020d}").read_bytes()
                rows_, groups = catalog.catalog_window(batch, image, with_body=True)
                blob = rows_.serialize()
                got = {}
                assert [g[2] for g in groups] == [sum(g[3] for g in groups[:i]) for i in range(len(groups))]
                for topic, day, first, count, form in groups:
                    table = read_group(blob, True, form, first, count)
                    assert table.num_rows == count
                    assert table.schema == catalog.SCHEMA.append(catalog.BODY_FIELD)
                    for field, column in zip(table.schema, table.columns, strict=True):  # Parquet: `required`
                        assert field.nullable == (field.name in catalog.NULLABLE)
                        assert field.nullable or column.null_count == 0, field.name
                        nulls[field.name] += column.null_count
                    offsets = table.column("commitLogOffset").to_pylist()
                    assert offsets == sorted(offsets)  # CommitLog order within a group
                    for row in table.to_pylist():
                        got[row["commitLogOffset"]] = (topic, day, as_plain(row))
                assert len(got) == len(batch)
                for i, phy in enumerate(batch.phy_offset.tolist()):
                    record = MessageRecord.decode(image, phy - seg_start)
                    topic, day, row = got[phy]
                    assert (topic, day) == (record.topic, record.store_timestamp // 86_400_000)
                    assert row == expected_row(record, int(batch.tags_code[i])), phy
                    records += 1
                rows += sum(g[3] for g in groups)
                offset = reader.read(offset).next_offset
        finally:
            reader.close()
    assert rows == records == 3000
    assert {n for n, count in nulls.items() if count} == catalog.NULLABLE  # each may be null, and is in some row


def read_group(blob, with_body: bool, form=catalog.FULL_FORM, first: int = 0, rows: int | None = None) -> pa.Table:
    """Rows [first, first + rows) (all by default) of one staged message, read alone."""
    return next(catalogstage.read_groups([(None, blob, first, rows, form)], with_body))[0]


def decoded_window(records: list[tuple[Host, bytes]], topics: list[str] | None = None):
    """(batch, image) of records of topic T (or `topics`, one a record) with these store hosts and raw
    properties (anything but 0x02 inside a value), decoded as the backfill decodes a window."""
    image = bytearray()
    for i, (store_host, props) in enumerate(records):
        topic = "T" if topics is None else topics[i]
        image += MessageRecord(topic, 0, 0, i, len(image), 0, 1_700_000_000_000, Host(bytes([1, 2, 3, 4]), 5),
                               1_700_000_000_000, store_host, 0, 0, b"", props, 0).encode()
    image += bytes(64)  # then a zero TOTALSIZE: the end of the data
    batch = decode_segment(bytes(image), 0, segment_offset=0, segment_size=len(image), max_bytes=len(image),
                           multi_flags=CATALOG_FIELDS).batch
    assert len(batch) == len(records)
    return batch, bytes(image)


def catalog_of(properties: list[bytes], with_body: bool = False) -> pa.Table:
    """The catalog rows of records with these raw properties."""
    return catalog.catalog_table(*decoded_window([(STORE_HOSTS[0], p) for p in properties]), with_body)


@settings_(max_examples=300, deadline=None)
@given(st.lists(st.none() | st.binary(min_size=1, max_size=12).map(lambda b: b.replace(b"\x02", b" ")), max_size=8))
def test_keys_are_the_non_empty_tokens_of_the_decoded_value(values):
    """KEYS is split on spaces before it is decoded: the same tokens as decoding the whole value (malformed
    bytes replaced) and splitting it, since a space never lies inside a malformed sequence."""
    got = catalog_of([b"" if v is None else b"KEYS\x01" + v for v in values]).column("keys").combine_chunks()
    assert got.type == pa.list_(pa.string())
    assert got.to_pylist() == [None if v is None else [t for t in v.decode("utf-8", "replace").split(" ") if t]
                               for v in values]


def test_the_staged_keys_hold_no_byte_past_the_last_token():
    """The separators are not copied, so the token buffer is shorter than the values: only the bytes the
    tokens fill are handed on, or the unwritten rest reached the staged streams (different on every run)."""
    values = [b"k1 k2", b"  k3 ", None, b"k4"]
    keys = catalog_of([b"" if v is None else b"KEYS\x01" + v for v in values]).column("keys").chunk(0)
    assert keys.values.to_pylist() == ["k1", "k2", "k3", "k4"]
    assert keys.values.buffers()[2].size == len(b"k1k2k3k4")


def test_a_property_with_an_empty_value_is_no_property():
    """As the broker reads properties (`MessageDecoder.string2messageProperties` keeps a pair only with a
    non-empty name and value): an empty TAGS, KEYS, UNIQ_KEY, REAL_TOPIC or REAL_QID is null in the catalog,
    as when it is absent, and does not replace an earlier non-empty value of the same name."""
    table = catalog_of([
        b"TAGS\x01\x02KEYS\x01\x02UNIQ_KEY\x01\x02REAL_TOPIC\x01\x02REAL_QID\x01\x02",
        b"TAGS\x01a\x02TAGS\x01\x02REAL_TOPIC\x01t\x02REAL_TOPIC\x01\x02REAL_QID\x013\x02REAL_QID\x01",
        b"x\x01y",
    ])
    columns = ["tags", "tagsCode", "keys", "uniqKey", "realTopic", "realQueueId"]
    assert [tuple(row.values()) for row in table.select(columns).to_pylist()] == [
        (None, 0, None, None, None, None),
        ("a", 97, None, None, "t", 3),  # "a".hashCode() == 97: tags and tagsCode agree
        (None, 0, None, None, None, None),
    ]


_NAME_OR_JUNK = st.sampled_from(["TAGS", "REAL_TOPIC", "REAL_QID", "KEYS", "TAG", "ATAGS", "TAGS\x01", "x"])


@settings_(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(_NAME_OR_JUNK, st.text(alphabet="ab\x01\x02 标+-0123456789", max_size=6)),
                         max_size=5).map(lambda props: "".join(f"{k}\x01{v}\x02" for k, v in props))
                | st.text(alphabet="TAGS\x01\x02ab", max_size=20), max_size=8))
def test_catalog_properties_are_found_as_the_regular_expression_found_them(records):
    """TAGS, REAL_TOPIC and REAL_QID come from the one C pass: the same values (the last occurrence at the
    start or after a separator with a non-empty value, up to the next one; REAL_QID as Integer.parseInt of
    ASCII digits) as a regular expression over each record's properties, whatever the names, separators and
    values."""
    raw = [r.encode() for r in records]
    table = catalog_of(raw)
    for name, column in (("TAGS", "tags"), ("REAL_TOPIC", "realTopic"), ("REAL_QID", "realQueueId")):
        regex = re.compile(rb"(?s)^(?:.*\x02)?" + name.encode() + rb"\x01(?P<v>[^\x02]+)")
        found = [m and m.group("v").decode() for m in map(regex.match, raw)]
        expected = [java_int(v) for v in found] if column == "realQueueId" else found
        assert table.column(column).to_pylist() == expected


@settings_(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-30_000, 30_000) | st.integers(19_000, 19_003)),
                min_size=1, max_size=50))
def test_groups_number_the_rows_by_topic_then_day(rows):
    """The catalog's (topic, day) groups, counted when the batch's pairs are few and found by numpy's unique
    when its days span more: numbered in (topic, day) order, each with its topic, day and rows."""
    topic = np.array([t for t, _ in rows], dtype=np.int32)
    day = np.array([d for _, d in rows], dtype=np.int64)
    group, topics, days, counts = catalog._groups(topic, day, 4)
    pairs = sorted(set(rows))
    assert list(zip(topics.tolist(), days.tolist(), strict=True)) == pairs
    assert counts.tolist() == [rows.count(p) for p in pairs]
    assert [pairs[g] for g in group.tolist()] == rows


@pytest.fixture(scope="module")
def varied_window(tmp_path_factory):
    """One decoded window of a varied store (4 topics, v1 and v2 records, IPv4 and IPv6 hosts, bodies)."""
    root = tmp_path_factory.mktemp("varied")
    write_varied_store(root, 3, n=300)
    image = (root / f"{0:020d}").read_bytes()
    decoded = decode_segment(image, 0, segment_offset=0, segment_size=SEGMENT, max_bytes=len(image),
                             multi_flags=CATALOG_FIELDS)
    assert len(decoded.batch) > 250
    return decoded.batch, image


@settings_(max_examples=150, deadline=None)
@given(data=st.data())
def test_rows_built_in_groups_are_the_commitlog_order_rows_taken_group_by_group(varied_window, data):
    """The C pass reads the records in CommitLog order and puts each row in its group's place, each group's
    strings in a region of their own closed up at the end: the same table as all rows in CommitLog order
    then a stable sort by group, whatever the groups (empty ones too), for every column and the bodies."""
    batch, image = varied_window
    n = len(batch)
    groups = data.draw(st.integers(1, 12), label="groups")
    runs = data.draw(st.lists(st.tuples(st.integers(0, groups - 1), st.integers(1, 60)), min_size=1), label="runs")
    group = np.array([g for g, length in runs for _ in range(length)][:n], dtype=np.int32)
    group = np.resize(group, n)  # the runs repeated to the batch's length
    whole = catalog.catalog_table(batch, image, with_body=True)
    grouped = catalog.catalog_table(batch, image, True, group, groups)
    assert grouped.equals(whole.take(np.argsort(group, kind="stable")))


@pytest.mark.parametrize("groups", [3, 2600])
def test_a_batch_of_many_chunks_comes_out_grouped_as_a_stable_sort(tmp_path, groups):
    """Over a batch of several of the C pass's chunks (2048 rows), rows in chunks taken group by group, and with
    more groups than a chunk has rows, the batch taken whole: both the CommitLog order rows stably sorted by
    group, the groups' rows interleaved at random."""
    write_varied_store(tmp_path, 4, n=6000)
    image = (tmp_path / f"{0:020d}").read_bytes()
    batch = decode_segment(image, 0, segment_offset=0, segment_size=SEGMENT, max_bytes=len(image),
                           multi_flags=CATALOG_FIELDS).batch
    n = len(batch)
    assert n > max(groups, 2 * 2048)
    group = np.random.default_rng(groups).integers(0, groups, n).astype(np.int32)
    group[:groups] = np.arange(groups)  # every group has a row
    whole = catalog.catalog_table(batch, image, with_body=True)
    grouped = catalog.catalog_table(batch, image, True, group, groups)
    assert grouped.equals(whole.take(np.argsort(group, kind="stable")))


STORE_HOSTS = [Host(bytes([10, 0, 0, 1]), 10911), Host(bytes(range(16)), 1234), Host(bytes([10, 0, 0, 2]), 10911)]
STAGED_PROPERTIES = [b"", b"TAGS\x01a", b"REAL_TOPIC\x01X\x02REAL_QID\x013", b"REAL_QID\x01x", b"REAL_TOPIC\x01Y"]


@settings_(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(STORE_HOSTS) - 1), st.sampled_from(STAGED_PROPERTIES),
                          st.integers(0, 3)), min_size=1, max_size=40), st.booleans())
def test_a_staged_group_reads_back_as_its_rows(records, with_body):
    """A staged group leaves out its msgIds when its records share a store host and the real columns when
    no row of the batch has them; `read_group` makes them again: the same rows as `catalog_table`'s, whatever
    the hosts (two in a group, IPv6), the groups and the properties."""
    batch, image = decoded_window([(STORE_HOSTS[host], props) for host, props, _ in records])
    groups = min(4, len(records))  # the C pass takes no more groups than rows
    group = np.array([g % groups for _, _, g in records], dtype=np.int32)
    whole = catalog.catalog_table(batch, image, with_body, group, groups)
    staged, forms = catalog._catalog_rows(batch, image, with_body, group, groups, staged=True)
    rows = staged.to_batches()[0]
    hosts_of = [{STORE_HOSTS[h] for (h, _, _), g_ in zip(records, group.tolist(), strict=True) if g_ == g}
                for g in range(groups)]
    real = whole.column("realTopic").null_count < len(records) or whole.column("realQueueId").null_count < len(records)
    at = 0
    for g, count in enumerate(np.bincount(group, minlength=groups).tolist()):
        if count:
            host, real_staged = forms[g]
            assert real_staged == real
            assert (host is None) == any(len(h) > 1 for h in hosts_of)  # msgIds staged when any group has two
            got = read_group(rows.serialize(), with_body, forms[g], at, count)
            assert got.equals(whole.slice(at, count)), g
        at += count


@settings_(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), max_size=20), st.sampled_from(STORE_HOSTS))
def test_msg_ids_are_the_offset_msg_ids(offsets, host):
    got = catalog.msg_id_array(np.array(offsets, dtype=np.int64), host.address + host.port.to_bytes(4, "big"))
    assert got.to_pylist() == [create_offset_msg_id(host, o) for o in offsets]


@settings_(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(STAGED_PROPERTIES)), min_size=1, max_size=30),
       st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_messages_read_together_are_the_messages_read_one_by_one(records, cuts):
    """`read_groups` reads consecutive pieces of one form as one table, each window's message read once for
    every group (`parsed`): the same rows, in order, as `read_group` gives piece by piece, whatever the forms'
    sequence (msgIds staged or not, real columns staged or not) and the groups of each window."""
    windows = []
    at = 0
    for length in cuts * len(records):
        part = records[at % len(records) : at % len(records) + length]
        at += length
        if not part or len(windows) >= 12:
            break
        batch, image = decoded_window([(STORE_HOSTS[host], props) for host, props in part],
                                      topics=[f"t{i % 3}" for i in range(len(part))])
        rows, groups = catalog.catalog_window(batch, image, with_body=False)
        windows.append((rows.serialize(), groups))
    parsed = {}
    for topic in ("t0", "t1", "t2"):
        pieces, expected = [], []
        for key, (blob, groups) in enumerate(windows):
            for topic_, _, first, count, form in groups:
                if topic_ == topic:
                    pieces.append((key, blob, first, count, form))
                    expected.append(read_group(blob, False, form, first, count))
        read = list(catalogstage.read_groups(iter(pieces), with_body=False, parsed=parsed))
        got = [table for table, _ in read]
        assert len(got) <= len(pieces)
        if pieces:
            assert pa.concat_tables(got).equals(pa.concat_tables(expected))
            assert set(pa.concat_tables(got).column("commitLogOffset").to_pylist()) == {
                o for e in expected for o in e.column("commitLogOffset").to_pylist()}
    assert len(parsed) == len(windows)  # each message read once


def test_a_groups_share_of_a_message_is_its_rows_share_of_its_bytes():
    """A writer's row group is bounded in bytes too (ROW_GROUP_BYTES, with bodies): each group's slice of a
    window's message counts its rows' share of the message, not the whole message its buffers belong to
    (counted whole, a group of a few rows in each window would end a row group every few windows)."""
    topics = [f"t{i % 5}" for i in range(400)]
    windows = []
    for _ in range(6):
        batch, image = decoded_window([(STORE_HOSTS[0], b"KEYS\x01k%d" % i) for i in range(400)], topics=topics)
        rows, groups = catalog.catalog_window(batch, image, with_body=True)
        windows.append((rows.serialize(), groups))
    for blob, groups in windows:
        shares = [size for g in groups for _, size in catalogstage.read_groups([(None, blob, g[2], g[3], g[4])], True)]
        assert len(blob) - len(groups) <= sum(shares) <= len(blob)


@settings_(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**62), max_size=30), max_size=4),
       st.lists(st.tuples(st.integers(0, 2**62), st.integers(0, 2**62)), max_size=4))
def test_uncovered_rows_are_those_outside_every_covered_range(chunks, covered):
    """An appending backfill leaves out the rows of a staged group the catalog holds already: the rows whose
    commitLogOffset lies outside every [from, to) the catalog's markers name, whatever the table's chunks."""
    table = pa.Table.from_batches([pa.record_batch([pa.array(c, pa.int64())], names=["commitLogOffset"])
                                   for c in chunks], schema=pa.schema([("commitLogOffset", pa.int64())]))
    skip = min(1, table.num_rows)
    table = table.slice(skip)  # an offset into the first chunk, as a slice has
    offsets = [o for c in chunks for o in c][skip:]
    expected = [all(not lo <= o < hi for lo, hi in covered) for o in offsets]
    assert catalog.uncovered(table, covered).tolist() == expected


def test_an_appending_catalog_writer_does_not_import_pandas():
    """Array.to_numpy imports pandas (0.4 CPU-s in every worker): the rows an append leaves out are found
    without it."""
    import subprocess
    import sys

    code = ("import sys, pyarrow as pa\n"
            "from daemon.backfill import catalog\n"
            "import numpy as np\n"
            "offsets = pa.Array.from_buffers(pa.int64(), 3, [None, pa.py_buffer(np.array([1, 5, 9], np.int64))])\n"
            "t = pa.Table.from_arrays([offsets], names=['commitLogOffset'])  # not pa.array: it imports pandas\n"
            "assert catalog.uncovered(t, [(4, 6)]).tolist() == [True, False, True]\n"
            "print('pandas' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_staged_messages_read_back_whatever_the_sequence_of_schemas(tmp_path):
    """Each window's message is written straight from its buffers, one stream writer per schema: every message
    read at its offset and length is the batch written, however the windows' forms alternate."""
    path = str(tmp_path / "catalog.data")
    out = catalogstage.StagedMessages(path)
    written = []
    for i, (host, props) in enumerate([(0, b""), (1, b"REAL_TOPIC\x01X\x02REAL_QID\x013"), (0, b"TAGS\x01a"),
                                       (2, b""), (1, b"REAL_QID\x01x")] * 2):
        batch, image = decoded_window([(STORE_HOSTS[host], props), (STORE_HOSTS[(host + i) % 3], b"")] * (i + 1))
        rows, groups = catalog.catalog_window(batch, image, with_body=i % 2 == 0)
        written.append((out.write(rows), rows, groups[0][4], i % 2 == 0))
    out.close()
    data = (tmp_path / "catalog.data").read_bytes()
    assert len({r.schema for _, r, _, _ in written}) > 1
    for (at, length), rows, form, with_body in written:
        got = pa.ipc.read_record_batch(pa.py_buffer(data[at : at + length]), catalog.staged_schema(with_body, form))
        assert got.equals(rows)
        assert data[at : at + length] == rows.serialize().to_pybytes()


def test_a_writer_reads_messages_again_past_the_ones_it_keeps(monkeypatch):
    """Past PARSED_MESSAGES kept, a message is read again for each group that needs it: the same rows."""
    monkeypatch.setattr(catalogstage, "PARSED_MESSAGES", 1)
    windows = []
    for w in range(3):
        batch, image = decoded_window([(STORE_HOSTS[w % 2], b"TAGS\x01a")] * 7, topics=["a", "b"] * 3 + ["a"])
        rows, groups = catalog.catalog_window(batch, image, with_body=False)
        windows.append((rows.serialize(), groups))
    parsed = {}
    for topic in ("a", "b"):
        pieces = [(k, blob, g[2], g[3], g[4])
                  for k, (blob, groups) in enumerate(windows) for g in groups if g[0] == topic]
        got = pa.concat_tables([t for t, _ in catalogstage.read_groups(pieces, False, parsed)])
        expected = pa.concat_tables([read_group(blob, False, form, first, count)
                                     for _, blob, first, count, form in pieces])
        assert got.equals(expected)
        assert got.num_rows == 12 if topic == "a" else 9
    assert list(parsed) == [0]
