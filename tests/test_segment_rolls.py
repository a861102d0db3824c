"""`reputd run` at segment rolls under a per-record writer (issue 28 §3).

A broker writes each record with its own copy and pre-creates its next segment; around a roll the record
that ends a segment, its BLANK and the next segment's first record arrive back to back, and the reader
sees each at a different instant. Before: `zero TOTALSIZE ...` reported dozens of times per thousand rolls,
and `skip-segment` dropped the segments' tails. The writer here is tests/record_writer.py, in a process of
its own, with small segments so that a test sees thousands of rolls; a record it leaves unwritten is real
corruption and must still be reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import stress
from tests.record_writer import last_of_segment
from tests.test_daemon import REPUTD, clean_env, events, free_port, output_files, stop, wait_for

ROLL_SEGMENT = 16 * 1024
RATE = 8000  # records/s: about 125 rolls a second, slow enough for the daemon to stay at the head
WRITER = [sys.executable, str(Path(__file__).resolve().parent / "record_writer.py")]


class RollStore:
    """A store root for the per-record writer and the daemon's config (64 KiB segments by default)."""

    def __init__(self, tmp: Path, on_corruption: str):
        self.tmp = tmp
        self.log_dir = tmp / "store" / "commitlog"
        self.log_dir.mkdir(parents=True)
        self.port = free_port()
        self.config = tmp / "reputd.yaml"
        self.config.write_text(yaml.safe_dump({
            "store": {"storePathRootDir": str(tmp / "store"), "mappedFileSizeCommitLog": ROLL_SEGMENT,
                      "mappedFileSizeConsumeQueue": 6000, "maxHashSlotNum": 97, "maxIndexNum": 400},
            "output": {"dir": str(tmp / "out")},
            "reput": {"pollIntervalMs": 50, "onCorruption": on_corruption},
            "metrics": {"port": self.port}, "logging": {"level": "info", "format": "json"}}))

    def start(self) -> subprocess.Popen:
        """The daemon, its stdout to a file: a roll logs a line, more than a pipe holds unread."""
        with open(self.tmp / "run.out", "w") as out, open(self.tmp / "run.err", "w") as err:
            return subprocess.Popen([*REPUTD, "run", "--config", str(self.config)], env=clean_env(), stdout=out,
                                    stderr=err, text=True)

    def stop(self, proc: subprocess.Popen) -> tuple[int, str, str]:
        code = stop(proc)[0]
        return code, (self.tmp / "run.out").read_text(), (self.tmp / "run.err").read_text()

    def write(self, rolls: int, skip: tuple[int, ...] = ()) -> dict:
        args = [*WRITER, str(self.log_dir), str(ROLL_SEGMENT), str(rolls), str(RATE)]
        if skip:
            args += ["--skip", ",".join(map(str, skip))]
        done = subprocess.run(args, env=clean_env(), capture_output=True, text=True, timeout=600, check=True)
        return json.loads(done.stdout)

    def get(self, path: str) -> bytes:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return r.read()

    def health(self) -> dict:
        return json.loads(self.get("/healthz"))

    def metric_lines(self, prefix: str) -> dict[str, float]:
        out = {}
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith(prefix):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def rebuild(self) -> subprocess.CompletedProcess:
        return subprocess.run([*REPUTD, "rebuild", "--config", str(self.config), "--out", str(self.tmp / "reference")],
                              env=clean_env(), capture_output=True, text=True, timeout=300, check=False)


def test_thousands_of_rolls_under_a_per_record_writer_report_no_corruption(tmp_path):
    """skip-segment, so that a false verdict would also lose data: no corrupt record, no skipped byte, every
    roll followed, and the output equals a clean rebuild of the same CommitLog."""
    store = RollStore(tmp_path, "skip-segment")
    proc = store.start()
    try:
        wait_for(lambda: store.health()["status"] == "healthy", what="following the empty CommitLog")
        written = store.write(stress.scale(1000, 10000))
        wait_for(lambda: store.health().get("reputFromOffset") == written["end"], timeout=120, what="caught up")
        corrupt = store.metric_lines("reputd_corrupt_records_total")
        skipped = store.metric_lines("reputd_skipped_bytes_total")
    finally:
        code, out, err = store.stop(proc)
    logged = events(out)
    false = [e for e in logged if e["event"] in ("corrupt_commitlog", "segment_skipped")]
    rolled = sum(e["event"] == "segment_rolled" for e in logged)
    stress.report("segment_rolls", rolls=written["rolls"], records=written["records"], seconds=written["seconds"],
                  false_corruptions=sum(e["event"] == "corrupt_commitlog" for e in false))
    assert code == 0, err
    assert false == []
    assert set(corrupt.values()) == {0.0}
    assert set(skipped.values()) == {0.0}
    assert rolled == written["rolls"]
    rebuilt = store.rebuild()
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert output_files(tmp_path / "out") == output_files(tmp_path / "reference")


def test_a_record_left_unwritten_before_a_roll_is_still_reported(tmp_path):
    """The writer leaves the last record of its 40th segment unwritten and goes on for hundreds of rolls: a
    zero TOTALSIZE before the end of a segment with a successor, damage for good. onCorruption: stop reports
    it once, at its offset, and stays degraded there; the offline rebuild refuses the same bytes."""
    store = RollStore(tmp_path, "stop")
    victim = last_of_segment(ROLL_SEGMENT, 40, str(tmp_path / "scratch"))
    proc = store.start()
    try:
        wait_for(lambda: store.health()["status"] == "healthy", what="following the empty CommitLog")
        written = store.write(300, skip=(victim,))
        (hole,) = written["skipped"]
        assert hole // ROLL_SEGMENT == 40
        wait_for(lambda: store.health()["status"] == "degraded", what="the hole reported")
        health = store.health()
        corrupt = store.metric_lines('reputd_corrupt_records_total{reason="total_size"}')
    finally:
        code, out, err = store.stop(proc)
    assert code == 0, err
    assert health["reputFromOffset"] == hole
    assert str(hole) in health["reason"]
    assert list(corrupt.values()) == [1.0]
    reported = [e for e in events(out) if e["event"] == "corrupt_commitlog"]
    assert [(e["offset"], e["reason"]) for e in reported] == [(hole, "total_size")]
    assert "before the end of a segment that has a successor" in reported[0]["error"]
    rebuilt = store.rebuild()
    assert rebuilt.returncode == 1
    assert str(hole) in rebuilt.stderr


@pytest.mark.stress_only
def test_the_real_broker_rolling_64_kib_segments_raises_no_false_corruption(tmp_path):
    """The real 4.9.3 store (LiveWriter: DefaultMessageStore with AllocateMappedFileService pre-creating the
    next segments) at 64 KiB segments, thousands of rolls, followed by `reputd run` under skip-segment: no
    corrupt record, no skipped byte, and ConsumeQueue files identical to the broker's own."""
    from tests.test_realbroker_live import java_build, java_command, same_files

    build = java_build()
    store, out, port = tmp_path / "store", tmp_path / "out", free_port()
    sizes = {"mappedFileSizeCommitLog": 65536, "mappedFileSizeConsumeQueue": 6000, "maxHashSlotNum": 97,
             "maxIndexNum": 400}
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(store), **sizes}, "output": {"dir": str(out)},
                                      "reput": {"pollIntervalMs": 50, "onCorruption": "skip-segment"},
                                      "metrics": {"port": port}, "logging": {"level": "info", "format": "json"}}))
    messages = 40000  # about 2,500 rolls
    with open(tmp_path / "writer.log", "w") as writer_log:
        writer = subprocess.Popen([*java_command(build), "LiveWriter", "--store", str(store), "--messages",
                                   str(messages), "--rate", "3000", "--seed", "7", "--ha-port", "0",
                                   "--commitlog-size", "65536", "--cq-size", "6000", "--hash-slots", "97",
                                   "--index-num", "400"], stdout=subprocess.PIPE, stderr=writer_log, text=True)
        try:
            assert writer.stdout.readline().startswith("STARTED"), "LiveWriter did not start"
            with open(tmp_path / "run.out", "w") as run_out:
                proc = subprocess.Popen([*REPUTD, "run", "--config", str(config)], env=clean_env(), stdout=run_out,
                                        stderr=subprocess.STDOUT, text=True)
            try:
                summary = json.loads(writer.communicate(timeout=600)[0].strip().splitlines()[-1])
                assert writer.returncode == 0
                end = summary["max_phy_offset"]

                def caught_up() -> bool:
                    import urllib.request

                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                        return json.loads(r.read())["reputFromOffset"] == end

                wait_for(caught_up, timeout=120, what="caught up with the broker")
            finally:
                code = stop(proc)[0]
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
    logged = events((tmp_path / "run.out").read_text())
    false = [e for e in logged if e["event"] in ("corrupt_commitlog", "segment_skipped")]
    rolls = sum(e["event"] == "segment_rolled" for e in logged)
    cq_same, cq_total, _, _, differ = same_files(store, out)
    stress.report("segment_rolls_real_broker", messages=messages, rolls=rolls, false_corruptions=len(false),
                  consumequeue_identical=f"{cq_same}/{cq_total}")
    assert code == 0
    assert false == []
    assert rolls >= summary["commitlog_files"] - 2
    assert (cq_same, differ[:1]) == (cq_total, [])
