"""`reputd verify`: broker-written stores verify clean, and each kind of damage is reported exactly.

Every damage is byte surgery on a copy of a conformance store; the expected finding is (kind, file,
position) with the position written as arithmetic on the layout constants, and nothing else may be found.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.cli.common import program
from daemon.commands.verify import MODE_CRASHED, MODE_REPUTD, MODE_STOPPED, VerifyReport, verify
from daemon.config import load_config
from daemon.engine.rebuild import rebuild
from indexcore.commitlog import BODY_CRC_OFFSET
from indexcore.consumequeue import BLANK_UNIT_MSG_SIZE, CQ_UNIT, CQ_UNIT_SIZE
from indexcore.dledger import ENTRY_HEADER_SIZE
from indexcore.errors import SizeMismatchError
from indexcore.indexfile import (
    HASH_SLOT,
    HASH_SLOT_SIZE,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    INDEX_HEADER_SIZE,
    IndexFile,
)
from indexcore.indeximage import IndexImage
from indexcore.javahash import index_key_hash
from indexcore.mappedfile import offset_to_file_name
from indexcore.verify import (
    COMMIT_LOG_CORRUPT,
    CQ_FILE_EXTRA,
    CQ_FILE_MISSING,
    CQ_FILE_SIZE,
    CQ_QUEUE_MISSING,
    CQ_QUEUE_ORPHANED,
    CQ_UNIT_DANGLING,
    CQ_UNIT_EXTRA,
    CQ_UNIT_MISSING,
    CQ_UNIT_WRONG,
    INDEX_CHAIN_BROKEN,
    INDEX_ENTRY_EXTRA,
    INDEX_ENTRY_MISSING,
    INDEX_ENTRY_WRONG,
    INDEX_FILE_EXTRA,
    INDEX_FILE_MISSING,
    INDEX_FILE_SIZE,
    INDEX_HEADER_WRONG,
    STRAY_FILE,
)
from indexcore.writer import Message
from tests.conformance import ConformanceStore, discover, store_writer

STORES = discover()
REPUTD = [sys.executable, "-m", "daemon.cli"]
_HEADER_INDEX_COUNT_AT = INDEX_HEADER_SIZE - 4  # the last header field


def copy_store(store: ConformanceStore, tmp: Path) -> tuple[Path, Path]:
    """The whole broker store (CommitLog, consumequeue/, index/, checkpoint, lock) and a config for it."""
    root = tmp / "store"
    shutil.copytree(store.store, root)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    config = tmp / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **store.store_settings()},
                                      "logging": {"level": "warning"}}))
    return root, config


def run_verify(config: Path, **kwargs) -> VerifyReport:
    return verify(load_config(config, env={}), **kwargs)


def found(report: VerifyReport) -> set[tuple[str, str, int | None]]:
    return {(f.kind, f.file, f.position) for f in report.findings}


def entries_at(store: ConformanceStore) -> int:
    return INDEX_HEADER_SIZE + HASH_SLOT_SIZE * store.store_settings()["maxHashSlotNum"]


@pytest.fixture(params=STORES, ids=[s.name for s in STORES])
def broker_store(request, tmp_path):
    store = request.param
    root, config = copy_store(store, tmp_path)
    return store, root, config


# --- clean stores ------------------------------------------------------------------------------------------

def test_conformance_stores_are_present():
    assert STORES, "no conformance store found"


def test_broker_written_store_verifies_clean(broker_store):
    """As the real 4.9.3 broker wrote it: consistent, every message, queue and IndexFile looked at."""
    store, root, config = broker_store
    report = run_verify(config)
    assert report.findings == []
    assert report.consistent
    assert report.mode == MODE_STOPPED
    assert report.messages == len(store.manifest["messages"])
    assert report.queues == len([p for p in (root / "consumequeue").glob("*/*") if p.is_dir()])
    assert report.index_files == len(list((root / "index").iterdir()))
    assert report.entries == sum(h["index_count"] - 1 for h in _index_headers(root, store))


def _index_headers(root: Path, store: ConformanceStore) -> list[dict]:
    out = []
    for p in sorted((root / "index").iterdir()):
        values = INDEX_HEADER.unpack(p.read_bytes()[:INDEX_HEADER_SIZE])
        out.append(dict(zip(("begin", "end", "begin_phy", "end_phy", "slots", "index_count"), values, strict=True)))
    return out


def test_reputd_rebuild_output_verifies_clean(broker_store, tmp_path):
    """reputd's own output directory (named by store time, not by the broker's clock) verifies too."""
    store, _root, config = broker_store
    out = tmp_path / "rebuilt"
    cfg = load_config(config, env={}, overrides={"output.dir": str(out)})
    rebuild(cfg)
    report = verify(cfg)
    assert report.findings == []
    assert report.mode == MODE_REPUTD
    assert report.messages == len(store.manifest["messages"])


def test_reputd_run_output_with_checkpoint_verifies_clean(broker_store, tmp_path):
    """`reputd run --until-caught-up` leaves reputd.checkpoint: its output verifies clean, frontier from it."""
    _, _, config = broker_store
    out = tmp_path / "daemon-out"
    res = subprocess.run([*REPUTD, "run", "--config", str(config), "--out", str(out), "--until-caught-up"],
                         capture_output=True, text=True, timeout=300,
                         env={**_clean_env(), "REPUTD_METRICS_ENABLED": "false"}, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "reputd.checkpoint").exists()
    report = verify(load_config(config, env={}, overrides={"output.dir": str(out)}))
    assert report.findings == []
    assert report.frontier is not None
    assert report.frontier.evidence["reputFromOffset"] == report.end_offset


def test_verify_from_a_record_boundary_is_clean(broker_store):
    """Starting in the middle: queues and IndexFiles are taken up where they stood at that offset, wherever
    it falls (on the first record of an IndexFile, the record after its last one, any record)."""
    store, root, config = broker_store
    offsets = sorted(m["phy_offset"] for m in store.manifest["messages"])
    starts = {offsets[len(offsets) // 3], offsets[-1], *offsets[:: max(1, len(offsets) // 12)]}
    for h in _index_headers(root, store):
        i = offsets.index(h["begin_phy"])
        starts |= {h["begin_phy"], offsets[min(i + 1, len(offsets) - 1)],
                   offsets[min(offsets.index(h["end_phy"]) + 1, len(offsets) - 1)]}
    for start in sorted(starts):
        report = run_verify(config, from_offset=start)
        assert report.findings == [], (start, [f.as_dict() for f in report.findings])
        assert report.messages == len([o for o in offsets if o >= start])


def test_commitlog_after_retention_verifies_clean(broker_store):
    """A broker deletes its oldest segments: what is left verifies from the oldest one left."""
    store, root, config = broker_store
    segments = sorted((root / store.log_dir).iterdir())
    for p in segments[:5]:
        p.unlink()
    report = run_verify(config)
    assert report.findings == []
    assert report.from_offset == int(segments[5].name)


# --- the in-memory image puts what the file puts -----------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 10_000)), min_size=1, max_size=60),
       cuts=st.lists(st.integers(1, 9), max_size=12), seed_ts=st.sampled_from([0, 1_700_000_000_000]))
def test_index_image_puts_what_the_index_file_puts(tmp_path, keys, cuts, seed_ts):
    """IndexImage (slots and header in memory, entries one window at a time, entry_base in the kernel) and a
    mapped IndexFile given the same puts in the same pieces hold the same bytes."""
    slots, index_num = 7, 40
    path = tmp_path / f"file-{len(list(tmp_path.iterdir()))}"
    real = IndexFile(str(path), slots, index_num, create=True, end_phy_offset=99 if seed_ts else 0,
                     end_timestamp=seed_ts)
    entries: dict[int, bytes] = {}

    def keep(image, first, n):
        window = image.window_entries(n).tobytes()
        for i in range(n):
            entries[first + i] = window[i * INDEX_ENTRY_SIZE : (i + 1) * INDEX_ENTRY_SIZE]

    image = IndexImage(slots, index_num, 99 if seed_ts else 0, seed_ts, keep, lambda _image: None)
    hashes = np.array([k for k, _ in keys], dtype=np.int64)
    phys = np.cumsum([d for _, d in keys]).astype(np.int64)
    ts = 1_700_000_000_000 + phys * 37
    i = 0
    for cut in [*cuts, len(keys)]:
        j = min(len(keys), i + cut)
        assert image.put_keys(hashes[i:j], phys[i:j], ts[i:j]) == real.put_keys(hashes[i:j], phys[i:j], ts[i:j])
        i = j
    real.close()
    data = path.read_bytes()
    base = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * slots
    assert data[:INDEX_HEADER_SIZE] == image.written_header().encode()
    assert data[INDEX_HEADER_SIZE:base] == image.slot_table().tobytes()
    for n, raw in entries.items():
        assert data[base + INDEX_ENTRY_SIZE * n : base + INDEX_ENTRY_SIZE * (n + 1)] == raw
    assert len(entries) == image.index_count - 1


def test_index_files_before_from_deleted_verifies_clean(broker_store):
    """The broker deletes IndexFiles that end below its oldest segment: verifying from where the first one
    left starts, that file was seeded by one not there (its first entry's time_diff counts from it)."""
    store, root, config = broker_store
    files = _index_files(root)
    keep = len(files) // 3
    headers = _index_headers(root, store)
    offsets = sorted(m["phy_offset"] for m in store.manifest["messages"])
    inside_deleted = next(o for o in offsets if o > (headers[keep - 1]["begin_phy"] + headers[keep]["begin_phy"]) // 2)
    for f in files[:keep]:
        f.unlink()
    for start in (headers[keep]["begin_phy"], inside_deleted):
        report = run_verify(config, from_offset=start)
        assert report.findings == [], (start, [f.as_dict() for f in report.findings])
        assert report.index_files == len(files) - keep


# --- damage, one kind at a time -----------------------------------------------------------------------------

def _rel(root: Path, p: Path) -> str:
    return str(p.relative_to(root))


def _patch(path: Path, position: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        f.write(data)


def _units(path: Path) -> list[tuple[int, int, int]]:
    data = path.read_bytes()
    return [CQ_UNIT.unpack_from(data, i) for i in range(0, len(data) - len(data) % CQ_UNIT_SIZE, CQ_UNIT_SIZE)]


def _real(unit: tuple[int, int, int]) -> bool:
    return unit[0] >= 0 and 0 < unit[1] < BLANK_UNIT_MSG_SIZE


def _queue_dirs(root: Path) -> list[Path]:
    """Queue directories, those with the most units first (the store's layout, not its names, picks them)."""
    dirs = [d for d in (root / "consumequeue").glob("*/*") if d.is_dir()]
    return sorted(dirs, key=lambda d: (-sum(_real(u) for f in d.iterdir() for u in _units(f)), str(d)))


def _files(queue: Path) -> list[Path]:
    return sorted(queue.iterdir())


def _real_units(f: Path) -> list[int]:
    """Positions (unit numbers) of the real units of a ConsumeQueue file, blanks and zeros left out."""
    return [i for i, u in enumerate(_units(f)) if _real(u)]


def _index_files(root: Path) -> list[Path]:
    return sorted((root / "index").iterdir())


def _index_count(f: Path) -> int:
    return INDEX_HEADER.unpack(f.read_bytes()[:INDEX_HEADER_SIZE])[5]


def _entry(path: Path, at: int, n: int) -> tuple[int, int, int, int]:
    return INDEX_ENTRY.unpack_from(path.read_bytes(), at + INDEX_ENTRY_SIZE * n)


def _last_unit(path: Path) -> int:
    return _real_units(path)[-1]


def damage_unit_zeroed(store, root):
    f = _files(_queue_dirs(root)[0])[0]
    n = _real_units(f)[2]
    _patch(f, n * CQ_UNIT_SIZE, bytes(CQ_UNIT_SIZE))
    return {(CQ_UNIT_MISSING, _rel(root, f), n * CQ_UNIT_SIZE)}


def damage_units_swapped(store, root):
    f = _files(_queue_dirs(root)[1])[0]
    n = _real_units(f)[5]
    data = f.read_bytes()
    a, b = n * CQ_UNIT_SIZE, (n + 1) * CQ_UNIT_SIZE
    _patch(f, a, data[b : b + CQ_UNIT_SIZE] + data[a:b])
    return {(CQ_UNIT_WRONG, _rel(root, f), a)}


def damage_queue_file_truncated(store, root):
    f = _files(_queue_dirs(root)[2])[0]
    keep = _real_units(f)[len(_real_units(f)) // 2] * CQ_UNIT_SIZE
    os.truncate(f, keep)
    return {(CQ_FILE_SIZE, _rel(root, f), keep)}


def damage_queue_file_extended(store, root):
    f = _files(_queue_dirs(root)[2])[0]
    size = f.stat().st_size
    with open(f, "ab") as out:
        out.write(bytes(CQ_UNIT_SIZE))
    return {(CQ_FILE_SIZE, _rel(root, f), size + CQ_UNIT_SIZE)}


def damage_extra_queue_file(store, root):
    last = _files(_queue_dirs(root)[0])[-1]
    extra = last.parent / offset_to_file_name(int(last.name) + last.stat().st_size)
    extra.write_bytes(bytes(last.stat().st_size))
    return {(CQ_FILE_EXTRA, _rel(root, extra), None)}


def damage_stray_files(store, root):
    queue = _queue_dirs(root)[0]
    (queue / "00000000000000000000.bak").write_bytes(b"x")
    (root / "index" / "notes.txt").write_bytes(b"x")
    return {(STRAY_FILE, _rel(root, queue / "00000000000000000000.bak"), None), (STRAY_FILE, "index/notes.txt", None)}


def damage_queue_file_missing(store, root):
    files = _files(_queue_dirs(root)[0])
    f = files[min(1, len(files) - 1)]
    f.unlink()
    return {(CQ_FILE_MISSING, _rel(root, f), 0)}


def damage_queue_missing(store, root):
    d = _queue_dirs(root)[-1]
    shutil.rmtree(d)
    return {(CQ_QUEUE_MISSING, _rel(root, d), None)}


def damage_queue_orphaned(store, root):
    source = _queue_dirs(root)[0]
    d = source.parent / str(max(int(q.name) for q in source.parent.iterdir()) + 100)
    shutil.copytree(source, d)
    return {(CQ_QUEUE_ORPHANED, _rel(root, d), None)}


def damage_unit_dangling(store, root):
    """A unit one byte off its record: no record starts there."""
    f = _files(_queue_dirs(root)[0])[0]
    n = _real_units(f)[3]
    phy, size, tags = _units(f)[n]
    _patch(f, n * CQ_UNIT_SIZE, CQ_UNIT.pack(phy + 1, size, tags))
    return {(CQ_UNIT_DANGLING, _rel(root, f), n * CQ_UNIT_SIZE)}


def damage_unit_tags_code(store, root):
    f = _files(_queue_dirs(root)[0])[0]
    n = _real_units(f)[4]
    phy, size, tags = _units(f)[n]
    _patch(f, n * CQ_UNIT_SIZE, CQ_UNIT.pack(phy, size, tags + 1))
    return {(CQ_UNIT_WRONG, _rel(root, f), n * CQ_UNIT_SIZE)}


def damage_unit_extra(store, root):
    """A copy of a queue's last unit written after it (it points at a record, just not one for that place)."""
    f = next(f for d in _queue_dirs(root) for f in _files(d)[-1:]
             if (_last_unit(f) + 2) * CQ_UNIT_SIZE <= f.stat().st_size)
    n = _last_unit(f)
    data = f.read_bytes()
    _patch(f, (n + 1) * CQ_UNIT_SIZE, data[n * CQ_UNIT_SIZE : (n + 1) * CQ_UNIT_SIZE])
    return {(CQ_UNIT_EXTRA, _rel(root, f), (n + 1) * CQ_UNIT_SIZE)}


def damage_index_entry_removed(store, root):
    files = _index_files(root)
    f = files[len(files) // 2]
    n = min(10, _index_count(f) - 1)
    at = entries_at(store) + INDEX_ENTRY_SIZE * n
    _patch(f, at, bytes(INDEX_ENTRY_SIZE))
    return {(INDEX_ENTRY_MISSING, _rel(root, f), at)}


def damage_index_entry_wrong(store, root):
    f = _index_files(root)[0]
    n = min(7, _index_count(f) - 1)
    kh, phy, diff, prev = _entry(f, entries_at(store), n)
    at = entries_at(store) + INDEX_ENTRY_SIZE * n
    _patch(f, at, INDEX_ENTRY.pack(kh, phy + 1, diff, prev))
    return {(INDEX_ENTRY_WRONG, _rel(root, f), at)}


def damage_chain_link_broken(store, root):
    base = entries_at(store)
    f, n = next((f, n) for f in _index_files(root) for n in range(1, _index_count(f)) if _entry(f, base, n)[3] != 0)
    kh, phy, diff, _ = _entry(f, base, n)
    _patch(f, base + INDEX_ENTRY_SIZE * n, INDEX_ENTRY.pack(kh, phy, diff, 0))
    return {(INDEX_CHAIN_BROKEN, _rel(root, f), base + INDEX_ENTRY_SIZE * n + 16)}


def damage_slot_broken(store, root):
    files = _index_files(root)
    f = files[-1]
    data = f.read_bytes()
    slot = next(s for s in range(store.store_settings()["maxHashSlotNum"])
                if HASH_SLOT.unpack_from(data, INDEX_HEADER_SIZE + HASH_SLOT_SIZE * s)[0] > 1)
    at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * slot
    _patch(f, at, HASH_SLOT.pack(HASH_SLOT.unpack_from(data, at)[0] - 1))
    return {(INDEX_CHAIN_BROKEN, _rel(root, f), at)}


def damage_header_count_off_by_one(store, root):
    files = _index_files(root)
    f = files[len(files) // 2]
    _patch(f, _HEADER_INDEX_COUNT_AT, (_index_count(f) + 1).to_bytes(4, "big"))
    return {(INDEX_HEADER_WRONG, _rel(root, f), _HEADER_INDEX_COUNT_AT)}


def damage_header_begin_timestamp(store, root):
    f = _index_files(root)[-1]
    begin = int.from_bytes(f.read_bytes()[:8], "big")
    _patch(f, 0, (begin - 1000).to_bytes(8, "big"))
    return {(INDEX_HEADER_WRONG, _rel(root, f), 0)}


def damage_index_file_missing(store, root):
    files = _index_files(root)
    files[len(files) // 2].unlink()
    return {(INDEX_FILE_MISSING, "index/", None)}


def damage_index_file_extra(store, root):
    files = _index_files(root)
    extra = root / "index" / str(int(files[-1].name) + 1)
    extra.write_bytes(bytes(files[-1].stat().st_size))
    return {(INDEX_FILE_EXTRA, _rel(root, extra), None)}


def damage_index_file_truncated(store, root):
    f = _index_files(root)[-1]
    keep = min(5000, f.stat().st_size // 2)
    os.truncate(f, keep)
    return {(INDEX_FILE_SIZE, _rel(root, f), keep)}


def damage_index_entry_extra(store, root):
    f = next(f for f in reversed(_index_files(root)) if _index_count(f) < store.store_settings()["maxIndexNum"])
    count = max(_index_count(f), 1)
    base = entries_at(store)
    _patch(f, base + INDEX_ENTRY_SIZE * count, INDEX_ENTRY.pack(*_entry(f, base, 1)))
    return {(INDEX_ENTRY_EXTRA, _rel(root, f), base + INDEX_ENTRY_SIZE * count)}


def damage_commitlog_record(store, root):
    """A record whose body no longer matches its CRC: reported where it is, nothing judged past it."""
    segment_size = store.store_settings()["mappedFileSizeCommitLog"]
    messages = sorted(store.manifest["messages"], key=lambda m: m["phy_offset"])
    m = next(m for m in messages[2 * len(messages) // 3 :] if m["body_length"] > 0)
    segment = store.segment_path(root, m["phy_offset"])
    pos = m["phy_offset"] % segment_size
    _patch(segment, pos + BODY_CRC_OFFSET, (0x1234567).to_bytes(4, "big"))
    # where the reput stops: the record, or in DLedger mode its entry (48 bytes before the message)
    return {(COMMIT_LOG_CORRUPT, _rel(root, segment), pos - (ENTRY_HEADER_SIZE if store.is_dledger else 0))}


DAMAGE = [damage_unit_zeroed, damage_units_swapped, damage_queue_file_truncated, damage_queue_file_extended,
          damage_extra_queue_file, damage_stray_files, damage_queue_file_missing, damage_queue_missing,
          damage_queue_orphaned, damage_unit_dangling, damage_unit_tags_code, damage_unit_extra,
          damage_index_entry_removed, damage_index_entry_wrong, damage_chain_link_broken, damage_slot_broken,
          damage_header_count_off_by_one, damage_header_begin_timestamp, damage_index_file_missing,
          damage_index_file_extra, damage_index_file_truncated, damage_index_entry_extra, damage_commitlog_record]


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__.removeprefix("damage_") for d in DAMAGE])
def test_damage_is_reported_exactly(broker_store, damage):
    """One damage, one finding: its kind, its file and the byte position of the damage, and nothing else."""
    store, root, config = broker_store
    expected = damage(store, root)
    report = run_verify(config)
    assert found(report) == expected
    assert not report.consistent
    assert report.repair is not None


def test_queue_files_beyond_the_mapping_limit_are_checked_alike(broker_store, monkeypatch):
    """With room for two queue files mapped at once (a store with more queues than half the descriptor
    limit, as an LMQ broker's), each batch re-maps what it meets: the same verdict and the same finding."""
    import indexcore.verify

    store, root, config = broker_store
    monkeypatch.setattr(indexcore.verify, "open_queue_files_limit", lambda: 2)
    assert run_verify(config).consistent
    expected = damage_units_swapped(store, root)
    assert found(run_verify(config)) == expected


def test_queue_mappings_stay_under_half_the_kernels_mapping_limit(tmp_path, monkeypatch):
    """A container's descriptor limit would allow more queue files mapped than vm.max_map_count: at most
    half of it, whichever is lower; unreadable, Linux's default is assumed."""
    import indexcore.verify

    monkeypatch.setattr(indexcore.verify, "open_queue_files_limit", lambda: 65536)
    sysctl = tmp_path / "max_map_count"
    sysctl.write_text("800\n")
    assert indexcore.verify.queue_mappings_limit(str(sysctl)) == 400
    unreadable = indexcore.verify.queue_mappings_limit(str(tmp_path / "absent"))
    assert unreadable == indexcore.verify.DEFAULT_MAX_MAP_COUNT // 2
    monkeypatch.setattr(indexcore.verify, "open_queue_files_limit", lambda: 300)
    assert indexcore.verify.queue_mappings_limit(str(sysctl)) == 300


def test_a_file_that_cannot_be_mapped_is_named(tmp_path, monkeypatch):
    """An mmap the kernel refuses (ENOMEM past vm.max_map_count) is an OSError naming the file."""
    import errno
    import mmap

    import indexcore.verify

    path = tmp_path / "00000000000000000000"
    path.write_bytes(bytes(40))

    def refuse(*_args, **_kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(OSError, match="with 0 files mapped") as info:
        indexcore.verify.MappedFiles(4).get(str(path))
    assert (info.value.errno, info.value.filename) == (errno.ENOMEM, str(path))


def test_swapped_units_name_both_queue_offsets(broker_store):
    store, root, config = broker_store
    ((_, file, position),) = damage_units_swapped(store, root)
    (finding,) = run_verify(config).findings
    queue_offset = (int(Path(file).name) + position) // CQ_UNIT_SIZE
    assert finding.count == 2
    assert finding.ranges == [[queue_offset, queue_offset + 2]]
    topic, queue_id = Path(file).parts[1:3]
    assert finding.details == {"topic": topic, "queueId": int(queue_id)}


def test_missing_index_entry_names_its_key(broker_store):
    """An entry missing from the index is reported with the topic#key a lookup would miss."""
    store, root, config = broker_store
    damage_index_entry_removed(store, root)
    (finding,) = run_verify(config).findings
    key = finding.examples[0]["key"]
    topic, _, value = key.partition("#")
    assert any(m["topic"] == topic and (value == m.get("uniq_key") or value in (m.get("keys") or "").split(" "))
               for m in store.manifest["messages"])


def test_extra_index_entry_names_the_key_it_holds(broker_store):
    """An extra entry is reported with the `topic#key` of the record it points at, matched by its hash."""
    store, root, config = broker_store
    damage_index_entry_extra(store, root)
    (finding,) = run_verify(config).findings
    example = finding.examples[0]
    assert example["expected"] is None
    assert index_key_hash(example["actualKey"]) == example["actual"]["keyHash"]


def test_unclean_exit_judges_up_to_the_frontier(broker_store):
    """Records the broker appended but never dispatched (it died first): a cleanly stopped store must have
    them dispatched; with `abort` left behind they lie past the frontier the files prove and are not judged,
    while damage behind that frontier still is."""
    store, root, config = broker_store
    clock = iter(range(max(m["store_timestamp"] for m in store.manifest["messages"]) + 60_000, 2**62, 7))
    with store_writer(store, root, clock=lambda: next(clock)) as w:
        queue = _queue_dirs(root)[0]
        for i in range(50):
            w.append(Message(queue.parent.name, int(queue.name), bytes(100), {"KEYS": f"late-{i}",
                                                                              "UNIQ_KEY": f"{i:032X}"}))
    stopped = run_verify(config)
    assert stopped.mode == MODE_STOPPED
    assert CQ_UNIT_MISSING in {f.kind for f in stopped.findings}
    assert INDEX_ENTRY_MISSING in {f.kind for f in stopped.findings}
    (root / "abort").write_bytes(b"")
    expected = damage_unit_zeroed(store, root)
    crashed = run_verify(config)
    assert crashed.mode == MODE_CRASHED
    assert found(crashed) == expected
    assert crashed.messages == len(store.manifest["messages"])
    assert any("past the dispatch frontier" in note for note in crashed.notes)


AFTER_FROM = [damage_index_entry_removed, damage_slot_broken, damage_header_count_off_by_one, damage_index_file_missing,
              damage_unit_extra, damage_index_entry_extra, damage_queue_orphaned]


@pytest.mark.parametrize("damage", AFTER_FROM, ids=[d.__name__.removeprefix("damage_") for d in AFTER_FROM])
def test_damage_after_from_is_reported_exactly(broker_store, damage):
    """Verifying from the start of the third IndexFile: damage past it is found as from the beginning."""
    store, root, config = broker_store
    start = _index_headers(root, store)[2]["begin_phy"]
    expected = damage(store, root)
    assert found(run_verify(config, from_offset=start)) == expected


def test_settings_other_than_the_brokers_are_named(broker_store):
    """A config whose IndexFile sizes are not the broker's: a configuration error naming a file and the
    sizes, as query and rebuild raise it, not a finding for every file."""
    _, root, config = broker_store
    cfg = load_config(config, env={"REPUTD_STORE_MAX_HASH_SLOT_NUM": "101"})
    with pytest.raises(SizeMismatchError, match=r"every IndexFile here is \d+ bytes; maxHashSlotNum 101") as e:
        verify(cfg)
    assert Path(e.value.path).parent == root / "index"


def test_damage_before_from_is_history(broker_store):
    """--from judges what follows the offset only."""
    store, root, config = broker_store
    damage_unit_zeroed(store, root)
    late = sorted(m["phy_offset"] for m in store.manifest["messages"])[-100]
    assert run_verify(config, from_offset=late).findings == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_byte_damage_names_the_damaged_file(tmp_path_factory, data):
    """A random byte of a random ConsumeQueue or IndexFile changed: at least one finding names that file."""
    store = data.draw(st.sampled_from(STORES))
    tmp = tmp_path_factory.mktemp("byte")
    root, config = copy_store(store, tmp)
    files = sorted(p for p in [*(root / "consumequeue").rglob("*"), *(root / "index").iterdir()] if p.is_file())
    target = data.draw(st.sampled_from(files))
    raw = bytearray(target.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] = data.draw(st.integers(0, 255).filter(lambda b: b != raw[at]))
    target.write_bytes(bytes(raw))
    report = run_verify(config)
    assert _rel(root, target) in {f.file for f in report.findings}, (target, at, found(report))


# --- the command line ---------------------------------------------------------------------------------------

def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*REPUTD, "verify", *args], capture_output=True, text=True, timeout=300, env=_clean_env(),
                          check=False)


def test_cli_help():
    res = cli("--help")
    assert res.returncode == 0
    assert "--from" in res.stdout
    assert "--json" in res.stdout


def test_cli_clean_store_exits_0(broker_store):
    _, _, config = broker_store
    res = cli("--config", str(config))
    assert res.returncode == 0, res.stderr
    assert "consistent" in res.stdout
    assert "Traceback" not in res.stderr


def test_cli_json_lists_findings_then_a_summary(broker_store):
    """--json: one object per finding, then the summary with the repair plan; exit 1."""
    store, root, config = broker_store
    ((_, zeroed, _),) = damage_unit_zeroed(store, root)
    damage_index_file_missing(store, root)
    res = cli("--config", str(config), "--json")
    assert res.returncode == 1, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    *findings, summary = lines
    assert {f["type"] for f in findings} == {"finding"}
    assert summary["type"] == "summary"
    assert {f["kind"] for f in findings} == {CQ_UNIT_MISSING, INDEX_FILE_MISSING}
    assert summary["consistent"] is False
    assert summary["findings"] == 2
    assert summary["byKind"] == {CQ_UNIT_MISSING: {"findings": 1, "count": 1},
                                 INDEX_FILE_MISSING: {"findings": 1, "count": 1}}
    repair = summary["repair"]
    assert repair["command"].startswith(f"{shlex.join(program())} rebuild --config ")
    targets = {r["to"] for r in repair["replace"]}
    assert targets == {str((root / zeroed).parent), str(root / "index")}


def test_cli_human_summary_per_kind(broker_store):
    store, root, config = broker_store
    damage_units_swapped(store, root)
    res = cli("--config", str(config))
    assert res.returncode == 1
    assert "cqUnitWrong: 1 finding, 2 in all" in res.stdout
    assert f"repair: {shlex.join(program())} rebuild" in res.stdout
    assert "Traceback" not in res.stderr


def test_cli_following_the_repair_plan_makes_the_store_consistent(broker_store):
    """Run the suggested rebuild, copy what it says where: the store then verifies clean."""
    store, root, config = broker_store
    damage_unit_zeroed(store, root)
    damage_index_entry_removed(store, root)
    summary = json.loads(cli("--config", str(config), "--json").stdout.splitlines()[-1])
    repair = summary["repair"]
    args = repair["command"].split()[1:]
    res = subprocess.run([*REPUTD, *args], capture_output=True, text=True, env=_clean_env(), timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    for r in repair["replace"]:
        shutil.rmtree(r["to"])
        shutil.copytree(r["from"], r["to"])
    for path in repair["remove"]:
        os.remove(path)
    assert cli("--config", str(config)).returncode == 0


@pytest.mark.parametrize(("args", "needle"), [
    (["--out", "/nonexistent/reputd-verify"], "/nonexistent/reputd-verify: no such output directory (--out)"),
    (["--store", "/nonexistent/reputd-store"], "/nonexistent/reputd-store: no such store root directory (--store)"),
    (["--from", "-5"], "is negative"),
])
def test_cli_wrong_paths_and_values_exit_2(broker_store, args, needle):
    _, _, config = broker_store
    res = cli("--config", str(config), *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert needle in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_missing_commitlog_directory_is_data_missing(broker_store):
    """A store root without its commitlog/: data missing (exit 1), as rebuild says it; a store root that
    does not exist is the usage error. In DLedger mode the data path comes from store.dLegerSelfId: without
    dledger-<selfId>/data the settings locate no log, a usage error (exit 2) naming the key and the path."""
    store, root, config = broker_store
    shutil.rmtree(root / store.log_dir)
    res = cli("--config", str(config))
    if store.is_dledger:
        assert res.returncode == 2
        assert (f"{root / store.log_dir}: no such directory: store.dLegerSelfId 'n0' names {root / 'dledger-n0'}, "
                "which holds no data/") in res.stderr
        return
    assert res.returncode == 1
    assert f"{root / 'commitlog'}: the store root {root} has no commitlog/ directory" in res.stderr


def test_cli_from_inside_a_record_exits_2(broker_store):
    store, _, config = broker_store
    inside = sorted(m["phy_offset"] for m in store.manifest["messages"])[10] + 7
    res = cli("--config", str(config), "--from", str(inside))
    assert res.returncode == 2
    assert "not the start of a record" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_missing_config_file_exits_2(tmp_path):
    res = cli("--config", str(tmp_path / "absent.yaml"))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr


def test_verify_writes_nothing(broker_store):
    """Read-only: no file of the store changes, none appears (not even a lock)."""
    _, root, config = broker_store
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}
    assert cli("--config", str(config)).returncode == 0
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")} == before


# --- a broker writing while verify runs (make stress) ------------------------------------------------------

REALBROKER = Path(os.environ.get("REPUTD_REALBROKER_DIR",
                                 Path(__file__).resolve().parents[2] / "shared" / "realbroker"))
LIVE_SETTINGS = {"mappedFileSizeCommitLog": 1048576, "mappedFileSizeConsumeQueue": 6000, "maxHashSlotNum": 97,
                 "maxIndexNum": 400}


def _live_writer_command(store: Path, messages: int, rate: int) -> list[str]:
    missing = [tool for tool in ("java", "javac") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found: the live broker test runs the real RocketMQ 4.9.3 store")
    if not (REALBROKER / "build.sh").is_file():
        pytest.skip(f"no RocketMQ 4.9.3 harness at {REALBROKER} (REPUTD_REALBROKER_DIR)")
    built = subprocess.run(["bash", str(REALBROKER / "build.sh")], capture_output=True, text=True, timeout=900,
                           check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    b = built.stdout.strip().splitlines()[-1]
    return ["java", "-Xms256m", "-Xmx512m", "-Duser.timezone=UTC", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            "--add-opens", "java.base/java.nio=ALL-UNNAMED", "--add-opens", "java.base/jdk.internal.ref=ALL-UNNAMED",
            "--add-opens", "java.base/sun.nio.ch=ALL-UNNAMED", "--add-exports", "java.base/sun.nio.ch=ALL-UNNAMED",
            "-cp", f"{b}/harness:{b}/classes:{b}/lib/*", "LiveWriter", "--store", str(store),
            "--messages", str(messages), "--rate", str(rate), "--seed", "11", "--ha-port", "0", "--linger-ms", "3000",
            "--commitlog-size", str(LIVE_SETTINGS["mappedFileSizeCommitLog"]),
            "--cq-size", str(LIVE_SETTINGS["mappedFileSizeConsumeQueue"]),
            "--hash-slots", str(LIVE_SETTINGS["maxHashSlotNum"]), "--index-num", str(LIVE_SETTINGS["maxIndexNum"])]


@pytest.mark.stress_only
def test_verify_while_the_real_broker_writes_finds_nothing(tmp_path):
    """The real 4.9.3 store writes (CommitLog, its own reput, ConsumeQueue, IndexFile rolls, scheduled deliveries,
    transactions) while verify runs again and again on its directory: no false positive, ever. Once the broker
    has stopped cleanly, the whole CommitLog is held to the files, and they verify clean too."""
    from daemon.commands.verify import MODE_RUNNING
    from tests.stress import report as stress_report
    from tests.stress import scale

    store = tmp_path / "store"
    messages = scale(6000, 30000)
    cmd = _live_writer_command(store, messages, int(os.environ.get("STRESS_VERIFY_RATE", "1500")))
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(store), **LIVE_SETTINGS},
                                      "logging": {"level": "warning"}}))
    with open(tmp_path / "writer.err", "w") as err:
        writer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert writer.stdout.readline().startswith("STARTED"), (tmp_path / "writer.err").read_text()[-3000:]
            runs, checked = 0, []
            while writer.poll() is None:
                report = run_verify(config)
                assert report.findings == [], [f.as_dict() for f in report.findings]
                runs += 1
                if report.mode == MODE_RUNNING:
                    checked.append(report.messages)
            out = writer.stdout.read()
        finally:
            if writer.poll() is None:
                writer.kill()
            writer.wait()
    assert writer.returncode == 0, (tmp_path / "writer.err").read_text()[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    final = run_verify(config)
    assert final.findings == []
    assert final.mode == MODE_STOPPED
    stress_report("verify live broker", runs=runs, runs_while_running=len(checked), messages_checked=checked,
                  messages_at_end=final.messages, writer=summary)
    assert len(checked) >= 3, f"only {len(checked)} of {runs} verify runs saw the broker running"
    assert max(checked) > 0
