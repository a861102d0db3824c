"""`reputd verify`: does a store's ConsumeQueue and IndexFile hold what its CommitLog implies?

One pass over the CommitLog with the rebuild's reader, each batch followed through the ConsumeQueue and
index dispatch rules and compared with the existing files (indexcore.verify). Everything is opened
read-only and no lock is taken, so a broker's store can be verified while the broker runs.

What has to be dispatched already depends on who writes the directory:

* a broker store whose broker stopped cleanly (no `abort`, the `lock` not held): the whole CommitLog,
  since a 4.9.3 broker leaves `abort` behind unless its reput had caught up;
* a running broker (`lock` held), a broker that did not exit cleanly (`abort`), or reputd's output:
  up to the dispatch frontier the files themselves prove, as the broker's recovery reads it: the end of
  the newest unit over all ConsumeQueues (where a restarted broker resumes its reput), the record at the
  newest IndexFile's endPhyOffset, the store times the broker's `checkpoint` says were flushed
  (logicsMsgTimestamp, indexMsgTimestamp) and reputd's `reputFromOffset`. Past it, a missing unit or
  entry is work in progress, not a difference. Where a writer may still be at work (the broker's `lock`
  or reputd's `reputd.lock` held, an `abort` left, a reputd output whose checkpoint stops short of its
  files), the last record before it is left out of the index comparison, since a writer puts a record's
  units before its keys, and a note says so; a finished output is judged to its last record.

Before any of that, the settings: ConsumeQueue files or IndexFiles all of one size that is not the
configured one mean a config that is not the broker's (SizeMismatchError, exit 2, as query and rebuild
say it), not a store whose every file is damaged. An output with neither `consumequeue/` nor `index/`
beside a CommitLog that holds data is one finding, `outputMissing`, not "consistent".
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from daemon.commands.frontier import Frontier, _read_broker_checkpoint, _same_dir, dispatch_frontier
from daemon.config import Config
from daemon.engine.checkpoint import CheckpointError, read_checkpoint
from daemon.engine.dledgermode import open_commit_log, reput_offset
from daemon.engine.readahead import ReadAhead
from daemon.engine.reading import make_reader
from daemon.engine.rebuild import REBUILD_BATCH_BYTES, widen_thin_batches, written_end_of
from daemon.engine.sizes import check_output_sizes, check_store_root_sizes
from daemon.ops.outlock import BROKER_ABORT_FILE, lock_held, writer_holding
from indexcore.commitlog import PROPERTY_KEYS, PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX
from indexcore.consumequeue import CONSUME_QUEUE_DIR
from indexcore.dispatch import index_keys_of
from indexcore.dledgerlog import DLedgerLog
from indexcore.errors import StoreError
from indexcore.indexcheck import IndexCheck
from indexcore.indexfile import index_file_size
from indexcore.indexservice import INDEX_DIR
from indexcore.mappedfile import offset_to_file_name
from indexcore.queuecheck import ConsumeQueueCheck
from indexcore.reader import CommitLog, ReadStatus
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
    INDEX_FILE_SIZE,
    OUTPUT_MISSING,
    STRAY_FILE,
    Finding,
    Findings,
    RecordLocator,
)

ABORT_FILE = BROKER_ABORT_FILE
LOCK_FILE = "lock"
_CQ_KINDS = {CQ_UNIT_MISSING, CQ_UNIT_WRONG, CQ_UNIT_DANGLING, CQ_UNIT_EXTRA, CQ_FILE_MISSING, CQ_FILE_EXTRA,
             CQ_FILE_SIZE, CQ_QUEUE_MISSING}

MODE_STOPPED = "broker store, stopped cleanly: the whole CommitLog must be dispatched"
MODE_RUNNING = "broker store, broker running: checked up to its dispatch frontier"
MODE_CRASHED = "broker store, last exit not clean (abort file): checked up to its dispatch frontier"
MODE_REPUTD = "reputd output: checked up to its dispatch frontier"
MODE_COMPLETE = "completed to the CommitLog's end by handoff: the whole CommitLog must be dispatched"


class VerifyUsageError(Exception):
    """What to verify is not there (exit 2): nothing was checked."""


@dataclass(slots=True)
class VerifyReport:
    directory: str
    mode: str
    from_offset: int
    end_offset: int = 0
    messages: int = 0
    seconds: float = 0.0
    frontier: Frontier | None = None
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    queues: int = 0
    queue_files: int = 0
    units: int = 0
    index_files: int = 0
    entries: int = 0  # what the CommitLog implies up to where it was checked, judged or not
    entries_not_judged: int = 0  # the newest record's, where a writer may be between its units and its keys
    repair: dict | None = None

    @property
    def consistent(self) -> bool:
        return not self.findings

    @property
    def msgs_per_second(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0

    def by_kind(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for f in self.findings:
            k = out.setdefault(f.kind, {"findings": 0, "count": 0})
            k["findings"] += 1
            k["count"] += f.count
        return out

    def summary(self) -> dict:
        return {
            "type": "summary", "consistent": self.consistent, "findings": len(self.findings),
            "byKind": self.by_kind(), "directory": self.directory, "mode": self.mode,
            "fromOffset": self.from_offset, "endOffset": self.end_offset,
            "frontierOffset": None if self.frontier is None else self.frontier.offset,
            "frontierEvidence": None if self.frontier is None else self.frontier.evidence,
            "messages": self.messages, "seconds": round(self.seconds, 3), "msgsPerSecond": round(self.msgs_per_second),
            "queues": self.queues, "queueFiles": self.queue_files, "units": self.units,
            "indexFiles": self.index_files, "indexEntries": self.entries,
            "indexEntriesNotJudged": self.entries_not_judged, "notes": self.notes, "repair": self.repair,
        }


def _newest_record_left_out(out: str, mode: str, checkpoint, frontier: Frontier | None) -> str | None:
    """Why the index comparison leaves out the last record before the frontier (a writer may be between
    its units and its keys), or None when the output is finished and it is judged like every other."""
    if mode == MODE_RUNNING:
        return "the broker is running (its lock is held)"
    if mode == MODE_CRASHED:
        return "the broker did not stop cleanly (abort file): it may have stopped between a record's units and its keys"
    if mode != MODE_REPUTD:
        return None
    holder = writer_holding(out)
    if holder is not None:
        return f"a reputd writer is running on this output ({holder})"
    if checkpoint is None:
        return "no reputd.checkpoint says the output was finished"
    if frontier is not None and checkpoint.reput_from_offset < frontier.offset:
        return (f"reputd.checkpoint ({checkpoint.reput_from_offset}) stops before the files' end: a writer stopped "
                "without its final checkpoint")
    return None


def _n(count: int, one: str, many: str | None = None) -> str:
    return f"{count:,} {one if count == 1 else many or one + 's'}"


def verify(config: Config, *, from_offset: int | None = None,
           progress: Callable[[int, int, int], None] | None = None,
           rebuild_command: Callable[[str], str] | None = None, complete: bool = False) -> VerifyReport:
    """Compare the output directory's consumequeue/ and index/ with what the CommitLog implies.
    `rebuild_command(out)`: the command line of a rebuild into `out`, for the repair plan (the CLI's
    options that chose the config and store). `complete`: the caller has just completed the output to the
    CommitLog's end with nothing writing (`reputd handoff`), so the whole CommitLog must be dispatched,
    whoever wrote the files."""
    store = config.store
    out = config.output.dir
    if not os.path.isdir(out):
        raise VerifyUsageError(f"{out}: no such output directory (output.dir)")
    names = {d.name for d in config.dispatchers}
    check_output_sizes(out, store, queues="consumequeue" in names,
                       index="index" in names and store.message_index_enable)
    check_store_root_sizes(config)
    started = time.perf_counter()
    notes: list[str] = []
    broker_store = _same_dir(out, store.store_path_root_dir)
    try:
        checkpoint = read_checkpoint(out)
    except CheckpointError as e:
        checkpoint = None
        notes.append(f"reputd checkpoint not used: {e}")
    reputd_output = checkpoint is not None or not broker_store or os.path.exists(os.path.join(out, "reputd.checkpoint"))
    if complete:
        mode = MODE_COMPLETE
    elif reputd_output:
        mode = MODE_REPUTD
    elif lock_held(os.path.join(out, LOCK_FILE)):
        mode = MODE_RUNNING
    elif os.path.exists(os.path.join(out, ABORT_FILE)):
        mode = MODE_CRASHED
    else:
        mode = MODE_STOPPED
    live = mode not in (MODE_STOPPED, MODE_COMPLETE)
    commit_log = open_commit_log(store, follow=live)
    from_offset = reput_offset(commit_log, from_offset)
    if commit_log.short_newest is not None:
        path, size = commit_log.short_newest
        notes.append(f"{path} is {size} bytes, not mappedFileSizeCommitLog {store.mapped_file_size_commit_log}: not "
                     "read (a writer creating it, or cut short: `rebuild` and `run` refuse it once it stays short)")
    start = commit_log.min_offset if from_offset is None else from_offset
    if from_offset is not None and from_offset < commit_log.min_offset:
        notes.append(f"--from {from_offset} is below the oldest CommitLog segment: verified from "
                     f"{commit_log.min_offset}")
        start = commit_log.min_offset
    report = VerifyReport(out, mode, start)
    frontier = None
    if live:
        frontier = dispatch_frontier(out, commit_log, None if reputd_output else _read_broker_checkpoint(out),
                                     checkpoint.reput_from_offset if checkpoint is not None else None)
        report.frontier = frontier
    used = [sub for sub, on in ((CONSUME_QUEUE_DIR, "consumequeue" in names),
                                (INDEX_DIR, "index" in names and store.message_index_enable)) if on]
    if used and not any(os.path.isdir(os.path.join(out, sub)) for sub in used):
        written = written_end_of(commit_log)
        # nothing dispatched where a CommitLog has data: not consistent, whoever writes it; unless no record is
        # readable there (bytes that are no CommitLog), which the pass below reports as a rebuild would
        if written > start and _readable_at(config, commit_log, start):
            findings = Findings()
            findings.add(OUTPUT_MISSING, ".", None, missing=[f"{sub}/" for sub in used], commitLogData=[start, written])
            report.findings = list(findings)
            report.end_offset = start
            held = " and no ".join(f"{sub}/" for sub in used)
            report.notes = [*notes, f"{out} holds no {held}, and the CommitLog holds data [{start}, {written}): is "
                                    f"{out} the directory to verify?"]
            report.seconds = time.perf_counter() - started
            report.repair = repair_plan(config, report, rebuild_command)
            return report
    left_out = _newest_record_left_out(out, mode, checkpoint, frontier) if live else None

    def read_size(phy: int) -> int | None:
        try:
            return commit_log.read_record(phy, check_crc=False, max_message_size=store.max_message_size).total_size
        except (StoreError, OSError, ValueError):
            return None

    def store_timestamp_at(phy: int) -> int | None:
        try:
            return commit_log.read_record(phy, check_crc=False, max_message_size=store.max_message_size).store_timestamp
        except (StoreError, OSError, ValueError):
            return None

    def keys_at(phy: int) -> list[str]:
        try:
            rec = commit_log.read_record(phy, check_crc=False, max_message_size=store.max_message_size)
        except (StoreError, OSError, ValueError):
            return []
        props = rec.property_map()
        return index_keys_of(rec.topic, props.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX), props.get(PROPERTY_KEYS))

    findings = Findings()
    locate = RecordLocator(read_size)
    frontier_offset = None if frontier is None else frontier.offset
    cq = ConsumeQueueCheck(out, store.mapped_file_size_consume_queue, findings, locate, from_offset=start,
                           live=live, frontier=frontier_offset) if "consumequeue" in names else None
    index = None
    if not store.message_index_enable:
        notes.append("messageIndexEnable is false: IndexFiles not checked")
    if "index" in names and store.message_index_enable:
        index = IndexCheck(out, store.max_hash_slot_num, store.max_index_num, findings, live=left_out is not None,
                           frontier=frontier_offset, keys_at=keys_at)
        if start > 0:
            index.start_at(start, store_timestamp_at)
    reader = make_reader(config, commit_log, max(config.reput.batch_bytes, REBUILD_BATCH_BYTES))
    ahead = ReadAhead(reader, start)
    target = commit_log.max_offset
    offset = start
    try:
        for result in ahead:
            batch = result.batch
            stop = False
            if frontier is not None and len(batch):
                n_cq = frontier.cut(batch, index=False)
                n_index = frontier.cut(batch, index=left_out is not None)
                if n_cq < len(batch):
                    notes.append(f"the CommitLog goes on past the dispatch frontier at {int(batch.phy_offset[n_cq])}: "
                                 "not dispatched yet, not judged")
                    stop = True
            else:
                n_cq = n_index = len(batch)
            locate.batch = batch
            if cq is not None and n_cq:
                cq.check(batch if n_cq == len(batch) else batch.head(n_cq, int(batch.phy_offset[n_cq])))
                widen_thin_batches(reader, cq.spread)
            if index is not None and n_index:
                index.check(batch if n_index == len(batch) else batch.head(n_index, int(batch.phy_offset[n_index])))
            if index is not None and n_index < n_cq:  # counted as the index holds them, though not judged
                left = np.zeros(len(batch), dtype=bool)
                left[n_index:n_cq] = batch.index_mask()[n_index:n_cq]
                report.entries_not_judged += int(np.count_nonzero(left[batch.key_owner]))
            report.messages += n_cq
            offset = result.next_offset if n_cq == len(batch) else int(batch.phy_offset[n_cq])
            if progress is not None:
                progress(offset - start, target - start, report.messages)
            if stop or result.status is ReadStatus.END:
                if result.status is ReadStatus.END and result.pending is not None:
                    notes.append(f"stopped before an incomplete record at the end of the CommitLog: {result.pending}")
                break
            if result.status is ReadStatus.CORRUPT:
                if offset == start and from_offset is not None and from_offset == start:
                    raise VerifyUsageError(f"--from {from_offset} is not the start of a record: {result.error}")
                if frontier is not None and offset >= frontier.offset:
                    notes.append(f"an unreadable record past the dispatch frontier, not judged: {result.error}")
                else:
                    _corrupt(findings, commit_log, offset, result.error)
                # past the damage nothing is dispatched (a broker's recovery ends its CommitLog there): not judged
                if cq is not None:
                    cq.live, cq.frontier = True, offset
                if index is not None:
                    index.live, index.frontier = True, offset
                break
        report.end_offset = offset
        locate.batch = None
        if cq is not None:
            cq.finish()
            report.queues, report.queue_files, report.units = len(cq.queues), cq.files_checked, cq.units
        if index is not None:
            index.finish()
            report.index_files, report.entries = index.files_checked(), index.entries + report.entries_not_judged
    finally:
        ahead.close()
        reader.close()
    report.findings = list(findings)
    if left_out is not None and index is not None and frontier is not None and report.end_offset >= frontier.offset:
        notes.append(f"the newest record's {_n(report.entries_not_judged, 'index entry', 'index entries')} (the "
                     f"record ending at {frontier.offset}) were not judged: {left_out}")
    for sub, used in ((CONSUME_QUEUE_DIR, cq is not None), (INDEX_DIR, index is not None)):
        if used and not os.path.isdir(os.path.join(out, sub)):
            notes.insert(0, f"{os.path.join(out, sub)} does not exist: is {out} the directory to verify?")
    sizes = {}
    for f in report.findings:
        if f.kind in (CQ_FILE_SIZE, INDEX_FILE_SIZE):
            sizes.setdefault(f.kind, set()).add(f.details["actualSize"])
    if report.queue_files and len(sizes.get(CQ_FILE_SIZE, ())) == 1 and sum(
            f.kind == CQ_FILE_SIZE for f in report.findings) == report.queue_files:
        notes.insert(0, f"every ConsumeQueue file is {next(iter(sizes[CQ_FILE_SIZE]))} bytes, not "
                        f"mappedFileSizeConsumeQueue {store.mapped_file_size_consume_queue}: the config's sizes must "
                        "be the broker's")
    if report.index_files and len(sizes.get(INDEX_FILE_SIZE, ())) == 1 and sum(
            f.kind == INDEX_FILE_SIZE for f in report.findings) == report.index_files:
        notes.insert(0, f"every IndexFile is {next(iter(sizes[INDEX_FILE_SIZE]))} bytes, not the "
                        f"{index_file_size(store.max_hash_slot_num, store.max_index_num)} that maxHashSlotNum "
                        f"{store.max_hash_slot_num} and maxIndexNum {store.max_index_num} give: the config's sizes "
                        "must be the broker's")
    if _unreadable_from_start(report):
        notes.append(f"no record can be read at the CommitLog's first offset {start} (see {COMMIT_LOG_CORRUPT}): a "
                     "rebuild stops there too, so there is nothing to rebuild until the segment is repaired or "
                     "restored")
    report.notes = notes
    report.seconds = time.perf_counter() - started
    report.repair = repair_plan(config, report, rebuild_command)
    return report


def _readable_at(config: Config, commit_log: CommitLog, offset: int) -> bool:
    """Whether the CommitLog's reader reads anything at `offset` (a record, a BLANK, the end): False when the
    first record there is corrupt."""
    reader = make_reader(config, commit_log, config.reput.batch_bytes)
    try:
        result = reader.read(offset)
    finally:
        reader.close()
    return result.status is not ReadStatus.CORRUPT or result.next_offset > offset


def _unreadable_from_start(report: VerifyReport) -> bool:
    """The only finding is a corrupt record where the pass started: nothing before it to rebuild."""
    return bool(report.findings) and all(f.kind == COMMIT_LOG_CORRUPT and f.details.get("offset") == report.from_offset
                                         for f in report.findings)


def _corrupt(findings: Findings, commit_log: CommitLog, offset: int, error: Exception | None) -> None:
    segment = commit_log.segment_start(offset)
    path = commit_log.find_segment(offset)
    rel = os.path.basename(path) if path else offset_to_file_name(segment)
    where = commit_log.dir_label(offset) if isinstance(commit_log, DLedgerLog) else "commitlog"
    findings.add(COMMIT_LOG_CORRUPT, f"{where}/{rel}", offset - segment, offset=offset, error=str(error))


def repair_plan(config: Config, report: VerifyReport,
                rebuild_command: Callable[[str], str] | None = None) -> dict | None:
    """What to run and what to copy where to make the files what the CommitLog implies. The command is
    `rebuild_command(dir)` (the CLI's: with the options that chose the config and store), by default the
    config file's rebuild; every path in it is quoted for a shell."""
    if report.consistent or _unreadable_from_start(report):
        return None
    if rebuild_command is None:
        def rebuild_command(into: str) -> str:
            return shlex.join(["reputd", "rebuild", *(["--config", config.source] if config.source else []),
                               "--out", into])
    out = report.directory
    if any(f.kind == OUTPUT_MISSING for f in report.findings):
        return {"command": rebuild_command(out), "rebuiltDir": out, "stop": None, "replace": [], "remove": [],
                "note": "or, if the files are elsewhere, verify with --out naming that directory"}
    new = os.path.join(os.path.dirname(os.path.abspath(out)) or ".", "reputd-rebuilt")
    queues = sorted({f"{CONSUME_QUEUE_DIR}/{f.details['topic']}/{f.details['queueId']}" for f in report.findings
                     if f.kind in _CQ_KINDS})
    orphaned = sorted(f.file for f in report.findings if f.kind == CQ_QUEUE_ORPHANED)
    stray = sorted(f.file for f in report.findings if f.kind == STRAY_FILE)
    index = any(f.kind.startswith("index") for f in report.findings)
    corrupt = [f for f in report.findings if f.kind == COMMIT_LOG_CORRUPT]
    plan: dict = {"command": rebuild_command(new), "rebuiltDir": new,
                  "stop": "the broker" if report.mode != MODE_REPUTD else "reputd run",
                  "replace": [], "remove": [os.path.join(out, p) for p in orphaned + stray]}
    plan["replace"] = [{"from": os.path.join(new, q), "to": os.path.join(out, q)} for q in queues]
    if index:
        plan["replace"].append({"from": os.path.join(new, INDEX_DIR), "to": os.path.join(out, INDEX_DIR),
                                "note": "the whole directory: rebuilt IndexFiles are named by store time"})
    if report.mode == MODE_REPUTD and os.path.exists(os.path.join(out, "reputd.checkpoint")):
        plan["remove"].append(os.path.join(out, "reputd.checkpoint"))
    if corrupt:
        plan["note"] = ("the CommitLog is damaged: a rebuild stops at the same record, so what follows it cannot "
                        "be rebuilt until the segment is repaired or restored")
    return plan


__all__ = ["VerifyReport", "VerifyUsageError", "dispatch_frontier", "lock_held", "repair_plan", "verify"]
