"""What the driver checks in the outputs before Spark starts, and cleans after: an output that holds an
earlier range is refused, a catalog path that is not a catalog too, and a job's staged catalog files go."""

from __future__ import annotations

import contextlib
import os

import numpy as np
from pyarrow import fs

from daemon.backfill.catalog import catalog_filesystem
from daemon.backfill.plan import BackfillError
from daemon.backfill.source import S3Options
from indexcore.consumequeue import BLANK_UNIT_MSG_SIZE, CONSUME_QUEUE_DIR, CQ_UNIT_DTYPE, CQ_UNIT_SIZE
from indexcore.indexfile import FIRST_INDEX, INDEX_HEADER_SIZE, IndexHeader
from indexcore.indexservice import INDEX_DIR
from indexcore.mappedfile import list_queue_files

_SCAN_UNITS = (16, 4096)  # units read at a time looking for a queue's first real one: from the first, growing


def first_real_unit(directory: str) -> tuple[str, int] | None:
    """The file and CommitLog offset of a queue's first unit that is neither pre-blank nor unwritten: a few units
    read, then more at a time (a daemon's first file may hold a long blank head; a backfill's or rebuild's from
    offset 0 begins with a real unit, and 16,000 queues read 80 KB each when a read was 4,096 units)."""
    for _, path in list_queue_files(directory):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            at, units_at_a_time = 0, _SCAN_UNITS[0]
            while chunk := os.pread(fd, units_at_a_time * CQ_UNIT_SIZE, at):
                units = np.frombuffer(chunk, dtype=CQ_UNIT_DTYPE, count=len(chunk) // CQ_UNIT_SIZE)
                blank = ((units["commit_log_offset"] == 0) & (units["msg_size"] == BLANK_UNIT_MSG_SIZE)
                         & (units["tags_code"] == 0))
                real = np.flatnonzero(~blank & (units["msg_size"] > 0))
                if len(real):
                    return path, int(units["commit_log_offset"][real[0]])
                at += len(chunk)
                units_at_a_time = min(units_at_a_time * 4, _SCAN_UNITS[1])
        finally:
            os.close(fd)
    return None


def check_output_below(out: str, start: int) -> None:
    """Refuse, before Spark starts, an output that holds data below the backfill's first offset: an earlier
    backfill or run of a lower range (committing over it would be refused only after both Spark jobs)."""
    root = os.path.join(out, CONSUME_QUEUE_DIR)
    if os.path.isdir(root):
        for topic in sorted(os.listdir(root)):
            tdir = os.path.join(root, topic)
            if not os.path.isdir(tdir):
                continue
            for qid in sorted(os.listdir(tdir)):
                found = first_real_unit(os.path.join(tdir, qid)) if qid.isdigit() else None
                if found is not None and found[1] < start:
                    raise BackfillError(f"{found[0]}: the queue holds a unit for CommitLog offset {found[1]}, below "
                                        f"the backfill's first offset {start}: the output holds an earlier range; "
                                        f"backfill into an empty output, or continue this one with reputd rebuild")
    index_dir = os.path.join(out, INDEX_DIR)
    if os.path.isdir(index_dir):
        for name in sorted(os.listdir(index_dir)):
            path = os.path.join(index_dir, name)
            with open(path, "rb") as f:
                header = IndexHeader.decode(f.read(INDEX_HEADER_SIZE).ljust(INDEX_HEADER_SIZE, b"\0"))
            if header.index_count > FIRST_INDEX and header.begin_phy_offset < start:
                raise BackfillError(f"{path}: holds entries from CommitLog offset {header.begin_phy_offset}, below "
                                    f"the backfill's first offset {start}: the output holds an earlier range; "
                                    f"backfill into an empty output, or continue this one with reputd rebuild")


def open_catalog(catalog: str, s3: S3Options) -> tuple[tuple[int, int], ...]:
    """The CommitLog ranges a catalog holds already (none for a new one); a path that is not a catalog is
    refused before anything is written."""
    from daemon.backfill.catalog import LEGACY_PREFIX, MARKERS, covered_ranges  # noqa: PLC0415

    filesystem, path = catalog_filesystem(catalog, s3)
    info = filesystem.get_file_info(path)
    if info.type == fs.FileType.NotFound:
        return ()
    if info.type != fs.FileType.Directory:
        raise BackfillError(f"--catalog {catalog}: is a file, not a catalog directory")
    covered = covered_ranges(filesystem, path)
    entries = filesystem.get_file_info(fs.FileSelector(path))
    if covered and any(e.base_name.startswith(LEGACY_PREFIX) for e in entries):
        # its topic and date are directory names only: with this layout's files, every reader would see
        # different columns (or refuse), so it is not extended
        raise BackfillError(f"--catalog {catalog}: is in the topic=T/date=D/ layout of an earlier reputd, which "
                            f"this one does not extend: give a new --catalog path (and backfill the ranges named "
                            f"in {path.rstrip('/')}/{MARKERS}/ into it)")
    if not covered and entries:
        raise BackfillError(f"--catalog {catalog}: exists and is not a reputd catalog (it has no {MARKERS}/); "
                            f"give a new path or an earlier backfill's catalog")
    return tuple(covered)


def remove_catalog_staging(catalog: str, s3: S3Options, job_id: str) -> None:
    """The job's staged catalog files, and the staging directory when no other job stages there."""
    from daemon.backfill.catalog import STAGING  # noqa: PLC0415

    with contextlib.suppress(Exception):
        filesystem, path = catalog_filesystem(catalog, s3)
        staging = f"{path.rstrip('/')}/{STAGING}"
        filesystem.delete_dir(f"{staging}/{job_id}")
        if not filesystem.get_file_info(fs.FileSelector(staging)):
            filesystem.delete_dir(staging)
