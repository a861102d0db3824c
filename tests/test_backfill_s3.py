"""Segments read where they live: an S3-compatible server (moto, started here as a subprocess on a free
port) serves the CommitLog, and the backfill reads it in ranges: the same rows and files as from disk."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from bench.moto_server import MotoServerError, start_moto_server
from daemon.backfill import backfill
from daemon.backfill.ranges import DecodeSettings, decode_range, plan_ranges
from daemon.backfill.source import LOCAL, S3, S3Options, SegmentDir, SegmentListing
from daemon.config import BackfillConfig
from daemon.engine.rebuild import rebuild
from indexcore.dispatch import DEFAULT_MESSAGE_DELAY_LEVEL
from tests.backfill_stores import write_forged_store
from tests.test_backfill import SEGMENT, assert_same_files, make_config, outputs

pytest.importorskip("moto")
fs = pytest.importorskip("pyarrow.fs")

BUCKET = "rocketmq-archive"
KEYS = {"AWS_ACCESS_KEY_ID": "reputd-test", "AWS_SECRET_ACCESS_KEY": "reputd-secret", "AWS_REGION": "eu-west-1"}


@pytest.fixture(scope="module")
def s3_server():
    try:
        proc, endpoint = start_moto_server()
    except MotoServerError as e:
        pytest.fail(str(e))
    yield endpoint
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def archived(s3_server, tmp_path_factory):
    """A forged store on local disk and the same segments uploaded to the S3 server."""
    root = tmp_path_factory.mktemp("s3store")
    results = write_forged_store(root / "store" / "commitlog", SEGMENT, 500)
    s3 = fs.S3FileSystem(access_key=KEYS["AWS_ACCESS_KEY_ID"], secret_key=KEYS["AWS_SECRET_ACCESS_KEY"],
                         region=KEYS["AWS_REGION"], endpoint_override=s3_server.split("://")[1], scheme="http",
                         allow_bucket_creation=True)
    s3.create_dir(BUCKET)
    for path in sorted((root / "store" / "commitlog").iterdir()):
        with s3.open_output_stream(f"{BUCKET}/broker-a/commitlog/{path.name}") as out:
            out.write(path.read_bytes())
    return root, results


def options(endpoint: str) -> S3Options:
    return S3Options(endpoint, KEYS["AWS_REGION"], KEYS["AWS_ACCESS_KEY_ID"], KEYS["AWS_SECRET_ACCESS_KEY"])


@pytest.mark.parametrize("range_bytes", [4099, SEGMENT])
def test_ranges_read_from_s3_give_the_rows_read_from_disk(s3_server, archived, range_bytes, tmp_path):
    """Each range task's staged files, reading 64 KiB at a time from S3 with read-ahead, equal those from the
    mapped local file; only the ranges' bytes (and the look-ahead) are fetched."""
    root, _ = archived
    s3 = options(s3_server)
    local = SegmentListing([SegmentDir(LOCAL, str(root / "store" / "commitlog"))], SEGMENT)
    remote = SegmentListing([SegmentDir(S3, f"{BUCKET}/broker-a/commitlog")], SEGMENT, s3)
    assert [s.start for s in remote.segments] == [s.start for s in local.segments]
    assert [s.written_successor for s in remote.segments] == [s.written_successor for s in local.segments]
    settings = DecodeSettings(SEGMENT, True, 64 * 1024, DEFAULT_MESSAGE_DELAY_LEVEL, 8192, 64 * 1024, True, True,
                              True, s3, stage_root=str(tmp_path / "local"))
    remote_settings = dataclasses.replace(settings, stage_root=str(tmp_path / "remote"))
    fetched = 0
    for a, b in zip(plan_ranges(local.segments, SEGMENT, 0, None, range_bytes),
                    plan_ranges(remote.segments, SEGMENT, 0, None, range_bytes), strict=True):
        assert b.location.startswith("s3://")
        (meta_a,) = list(decode_range(a, settings))
        (meta_b,) = list(decode_range(b, remote_settings))
        assert staged_files(meta_a) == staged_files(meta_b)
        assert (meta_a.first, meta_a.next_offset, meta_a.status, meta_a.records, meta_a.keys) == (
            meta_b.first, meta_b.next_offset, meta_b.status, meta_b.records, meta_b.keys)
        fetched += meta_b.bytes_read
    assert fetched > 0


def test_backfill_from_s3_writes_the_rebuilds_files(spark, s3_server, archived, tmp_path, monkeypatch):
    """`--segments s3://bucket/prefix`, endpoint and credentials from the AWS_* environment: the files of a
    rebuild of the same segments on disk."""
    root, results = archived
    rebuild(make_config(tmp_path, "reference", root / "store"))
    for k, v in {**KEYS, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(k, v)
    config = make_config(tmp_path, "bf", Path("/nonexistent"), backfill={"rangeBytes": 50_000, "readBytes": 1 << 20})
    summary = backfill(config, spark=spark, segments=f"s3://{BUCKET}/broker-a/commitlog", partitions=2)
    assert summary.messages == len(results)
    assert_same_files(outputs(tmp_path / "bf"), outputs(tmp_path / "reference"))


class StallingProxy:
    """A TCP proxy in front of the S3 server that holds back each ranged GET's response for `stall` seconds
    before its first byte, as a busy server preparing a large range does."""

    def __init__(self, upstream: str, stall: float):
        self.upstream = upstream.split("://", 1)[1].rsplit(":", 1)
        self.stall = stall
        self.ranged_gets = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection((self.upstream[0], int(self.upstream[1])))
            ranged = threading.Event()
            threading.Thread(target=self._pump, args=(client, upstream, ranged, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, ranged, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, ranged: threading.Event, requests: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if requests and data.startswith(b"GET ") and b"\r\nrange:" in data.lower():
                    self.ranged_gets += 1
                    ranged.set()
                elif not requests and ranged.is_set():
                    time.sleep(self.stall)
                    ranged.clear()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._server.close()


@pytest.fixture
def slow_server(s3_server):
    proxy = StallingProxy(s3_server, stall=4.0)
    yield proxy
    proxy.close()


def staged_files(outcome) -> dict[str, bytes]:
    """What a decode task staged, by file name."""
    return {p.name: p.read_bytes() for p in sorted(Path(outcome.stage_dir).iterdir())}


def _first_range(root: Path, listed_by: S3Options, read_by: S3Options):
    """The staged files and outcome of the first range task, listed through one server and read through
    another."""
    listing = SegmentListing([SegmentDir(S3, f"{BUCKET}/broker-a/commitlog")], SEGMENT, listed_by)
    task = plan_ranges(listing.segments, SEGMENT, 0, None, SEGMENT)[0]
    settings = DecodeSettings(SEGMENT, True, 64 * 1024, DEFAULT_MESSAGE_DELAY_LEVEL, 8192, 1 << 20, True, True,
                              True, read_by, stage_root=tempfile.mkdtemp(dir=root))
    (outcome,) = list(decode_range(task, settings))
    return staged_files(outcome), (outcome.first, outcome.next_offset, outcome.status, outcome.records, outcome.keys)


def test_a_server_that_sends_nothing_for_seconds_is_waited_for(slow_server, s3_server, archived):
    """Ranged reads whose responses start 4 s late (longer than the AWS SDK's own 3 s): with a 2 s request
    timeout every attempt fails; with the
    default `backfill.s3RequestTimeoutSeconds` the rows are those read without the proxy."""
    root, _ = archived
    direct = options(s3_server)
    impatient = dataclasses.replace(options(slow_server.endpoint), request_timeout=2)
    with pytest.raises(OSError, match=r"(?i)timeout"):
        _first_range(root, direct, impatient)
    assert slow_server.ranged_gets >= 1
    before = slow_server.ranged_gets
    patient = options(slow_server.endpoint)
    assert patient.request_timeout == BackfillConfig().s3_request_timeout_seconds == 60
    rows, outcome = _first_range(root, direct, patient)
    assert slow_server.ranged_gets > before
    assert (rows, outcome) == _first_range(root, direct, direct)
    assert len(rows) > 1


def test_the_request_timeout_comes_from_the_config(tmp_path):
    config = make_config(tmp_path, "out", tmp_path, backfill={"s3RequestTimeoutSeconds": 7})
    assert S3Options.resolve(config.backfill, {}).request_timeout == 7


def test_s3_ranges_request_their_own_bytes_and_count_every_one(s3_server, tmp_path):
    """2 MiB ranges of an 8 MiB segment read 512 KiB at a time, with a 512 KiB look-ahead (256 KiB messages):
    the requests add up to at most 1.05x the ranges' bytes (each range read ahead a whole read past its end
    and threw it away, and the look-ahead was read whole), and `bytes_read` counts every byte requested."""
    segment, mib = 8 << 20, 1 << 20
    write_forged_store(tmp_path / "commitlog", segment, 700, big_every=3, big_body=20_000)
    s3 = fs.S3FileSystem(access_key=KEYS["AWS_ACCESS_KEY_ID"], secret_key=KEYS["AWS_SECRET_ACCESS_KEY"],
                         region=KEYS["AWS_REGION"], endpoint_override=s3_server.split("://")[1], scheme="http",
                         allow_bucket_creation=True)
    s3.create_dir(f"{BUCKET}-tail")
    for path in sorted((tmp_path / "commitlog").iterdir()):
        with s3.open_output_stream(f"{BUCKET}-tail/commitlog/{path.name}") as out:
            out.write(path.read_bytes())
    settings = DecodeSettings(segment, True, mib // 4, DEFAULT_MESSAGE_DELAY_LEVEL, 256 * 1024, 512 * 1024, True, False,
                              False, options(s3_server), stage_root=str(tmp_path / "stage"))
    listing = SegmentListing([SegmentDir(S3, f"{BUCKET}-tail/commitlog")], segment, options(s3_server))
    tasks = plan_ranges(listing.segments, segment, 0, None, 2 * mib)
    requested = 0
    for task in tasks:
        (outcome,) = list(decode_range(task, settings))
        requested += outcome.bytes_read
    ranges = sum(t.end - t.begin for t in tasks)
    assert 0 < requested <= 1.05 * ranges, (requested, ranges)
