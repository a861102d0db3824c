"""bench/paced_writer.py: what it writes is a CommitLog the broker could have written.

It must decode cleanly with `indexcore.reader` (every record, BLANKs where segments roll, queue offsets
contiguous per queue, PHYSICALOFFSET its position, a key per message), `reputd rebuild` of it must equal
`reputd run --until-caught-up` and `reputd run` following it live, and it must hold its rate.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from bench.paced_writer import PacedWriter
from indexcore.commitlog import BLANK_MAGIC_CODE, RECORD_PREFIX, MessageRecord
from indexcore.reader import CommitLog, CommitLogReader, ReadStatus
from tests.stress import report, scale
from tests.test_daemon import REPUTD, clean_env, free_port, output_files, wait_for

SEGMENT = 1 << 20


def write_config(tmp: Path, out: Path, port: int) -> Path:
    cfg = {"store": {"storePathRootDir": str(tmp / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": 20000, "maxHashSlotNum": 97, "maxIndexNum": 4000,
                     "flushIntervalConsumeQueue": 50, "flushConsumeQueueThoroughInterval": 300},
           "output": {"dir": str(out)}, "reput": {"pollIntervalMs": 50},
           "metrics": {"port": port}, "logging": {"level": "warning", "format": "json"}}
    path = tmp / f"reputd-{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def reputd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*REPUTD, *args], env=clean_env(), capture_output=True, text=True, timeout=timeout,
                          check=False)


def read_all(directory: str) -> tuple[list, object]:
    log = CommitLog(directory, SEGMENT)
    reader = CommitLogReader(log)
    batches, offset = [], log.min_offset
    try:
        while True:
            res = reader.read(offset)
            batches.append(res.batch)
            offset = res.next_offset
            if res.status is not ReadStatus.OK:
                return batches, res
    finally:
        reader.close()


def test_what_it_writes_decodes_cleanly(tmp_path):
    directory = str(tmp_path / "commitlog")
    with PacedWriter(directory, SEGMENT, queues=3, template_records=100, clock=iter(range(10**12, 10**13)).__next__
                     ) as w:
        for n in (1, 2, 97, 1000, scale(9000, 90000)):  # chunks across template wraps and segment rolls
            w.write(n)
        end, count, record_size = w.max_offset, w.count, w.record_size
        expected_next = w.queue_offsets()
    batches, last = read_all(directory)
    assert last.status is ReadStatus.END, last.error
    assert last.pending is None
    assert last.next_offset == end
    phy = [int(x) for b in batches for x in b.phy_offset]
    assert len(phy) == count
    # records back to back inside a segment, a BLANK of exactly the rest where one rolls
    segments = sorted(os.listdir(directory))
    assert len(segments) == -(-end // SEGMENT) >= 3
    for a, b in itertools.pairwise(phy):
        if b - a != record_size:
            assert b % SEGMENT == 0
            assert (a + record_size) // SEGMENT == b // SEGMENT - 1
            name = os.path.join(directory, segments[b // SEGMENT - 1])
            with open(name, "rb") as f:
                f.seek((a + record_size) % SEGMENT)
                total, magic = RECORD_PREFIX.unpack(f.read(RECORD_PREFIX.size))
            assert magic == BLANK_MAGIC_CODE
            assert total == SEGMENT - (a + record_size) % SEGMENT
    # queue offsets contiguous from 0 in every queue, the writer's next offsets right
    per_queue: dict[tuple[str, int], list[int]] = defaultdict(list)
    keys, uniq = set(), set()
    for b in batches:
        for i in range(len(b)):
            per_queue[(b.topic_of(i), int(b.queue_id[i]))].append(int(b.queue_offset[i]))
            keys.add(b.keys[i])
            uniq.add(b.uniq_key[i])
    assert {q: len(v) for q, v in per_queue.items()} == expected_next
    assert all(v == list(range(len(v))) for v in per_queue.values())
    assert len(keys) == len(uniq) == count  # a key and a UNIQ_KEY of its own per message
    # whole records, CRC checked, through the library's decoder; timestamps from the clock, in order
    log = CommitLog(directory, SEGMENT)
    stamps = []
    for offset in phy[:: max(1, count // 500)]:
        rec = log.read_record(offset, check_crc=True)
        assert isinstance(rec, MessageRecord)
        assert rec.physical_offset == offset
        assert rec.born_timestamp == rec.store_timestamp
        stamps.append(rec.store_timestamp)
    assert stamps == sorted(stamps)
    assert stamps[0] >= 10**12


def test_rebuild_equals_run_until_caught_up(tmp_path):
    with PacedWriter(str(tmp_path / "store" / "commitlog"), SEGMENT, queues=4) as w:
        for _ in range(scale(20, 100)):
            w.write(700)
    rebuilt, followed = tmp_path / "rebuilt", tmp_path / "run"
    res = reputd("rebuild", "--config", str(write_config(tmp_path, rebuilt, free_port())), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["messages"] == w.count
    res = reputd("run", "--config", str(write_config(tmp_path, followed, free_port())), "--until-caught-up")
    assert res.returncode == 0, res.stderr
    expected, actual = output_files(rebuilt), output_files(followed)
    assert sorted(actual) == sorted(expected)
    assert any(name.startswith("index/") for name in expected)
    assert all(actual[n] == expected[n] for n in expected)


def test_live_follow_at_rate_equals_rebuild(tmp_path):
    """`reputd run` following the paced writer, as the soak and the live benchmark do."""
    port = free_port()
    config = write_config(tmp_path, tmp_path / "live", port)
    w = PacedWriter(str(tmp_path / "store" / "commitlog"), SEGMENT, queues=4)
    proc = subprocess.Popen([*REPUTD, "run", "--config", str(config)], env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def health() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                return json.loads(r.read())

        wait_for(lambda: health()["status"] == "healthy", what="daemon up")
        figures = w.run(20_000, scale(3, 20))
        w.flush()
        wait_for(lambda: health()["checkpointOffset"] == w.max_offset, timeout=60, what="caught up")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        w.close()
    assert proc.returncode == 0, err
    assert figures["messages"] >= 0.95 * 20_000 * scale(3, 20)
    res = reputd("rebuild", "--config", str(write_config(tmp_path, tmp_path / "rebuilt", free_port())))
    assert res.returncode == 0, res.stderr
    expected, actual = output_files(tmp_path / "rebuilt"), output_files(tmp_path / "live")
    assert sorted(actual) == sorted(expected)
    assert all(actual[n] == expected[n] for n in expected)


@pytest.mark.parametrize("rate", [100_000])
def test_holds_100k_msgs_per_second_on_well_under_a_core(tmp_path, rate):
    seconds = scale(3, 30)
    with PacedWriter(str(tmp_path / "commitlog"), 64 << 20, queues=8) as w:
        figures = w.run(rate, seconds)
    report("paced_writer", rate=rate, **figures)
    assert figures["messages"] >= 0.98 * rate * seconds, figures
    assert figures["cpu_fraction"] < 0.5, figures
