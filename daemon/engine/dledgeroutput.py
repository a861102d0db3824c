"""A DLedger start without fence state: the output files themselves checked against the log.

The fence (`daemon.engine.dledgerfence`) is in every checkpoint a session writes, but not in a replay marker (a
derived start's first minute, a quarantine), nor where there is no checkpoint. Such a start checks that the
output's newest records are still in the log, and when they are not, cuts the output back as the fence's
repair does (docs/recovery.md, "Starts without fence state").
"""

from __future__ import annotations

import heapq
import os
import time

from daemon.config import Config
from daemon.engine.checkpoint import Checkpoint, CheckpointError, read_checkpoint, write_checkpoint
from daemon.engine.dledgerfence import (
    BUILT_IN,
    FENCE,
    DLedgerLogView,
    Entry,
    Repair,
    cut_states,
    parse_state,
    plugin_states,
    repair_truncation,
)
from daemon.ops.logs import get_logger
from indexcore import _failpoints
from indexcore.commitlog import MessageRecord
from indexcore.consumequeue import BLANK_UNIT_MSG_SIZE, CONSUME_QUEUE_DIR, CQ_UNIT, CQ_UNIT_SIZE, written_units
from indexcore.dledger import ENTRY_HEADER_SIZE
from indexcore.errors import StoreError
from indexcore.indexfile import FIRST_INDEX, IndexFile
from indexcore.indexservice import INDEX_DIR
from indexcore.mappedfile import offset_to_file_name


def repair_at_start(config: Config, metrics=None, log=None, first_offset: int | None = None) -> Repair | None:
    """Every DLedger start, before recovery: the fence's repair when the checkpoint has fence state, the
    output files checked otherwise (`repair_from_output`). None when nothing was cut."""
    if not config.store.enable_d_leger_commit_log:
        return None
    log = log or get_logger(component="recovery")
    try:
        checkpoint = read_checkpoint(config.output.dir)
    except CheckpointError:
        checkpoint = None  # recovery reports it; the files are checked as without one
    if checkpoint is not None and FENCE in checkpoint.dispatchers:
        try:
            if parse_state(checkpoint.dispatchers[FENCE])[0] is not None:
                return repair_truncation(config, metrics=metrics, log=log)
        except ValueError:
            pass
    return repair_from_output(config, checkpoint, first_offset, metrics, log)


def _queue_units_backward(directory: str, topic: str, queue_id: int):
    """A queue's units, newest first, as (phy, size, topic, queue_id, queue_offset); read lazily in chunks so
    that only the tail a check needs is read. Pre-blank units are passed over."""
    chunk = CQ_UNIT_SIZE * 256
    for name in sorted((n for n in os.listdir(directory) if n.isdigit()), reverse=True):
        path = os.path.join(directory, name)
        end = written_units(path) * CQ_UNIT_SIZE
        with open(path, "rb") as f:
            while end > 0:
                start = max(0, end - chunk)
                data = os.pread(f.fileno(), end - start, start)
                for at in range(len(data) - CQ_UNIT_SIZE, -1, -CQ_UNIT_SIZE):
                    phy, size, _ = CQ_UNIT.unpack_from(data, at)
                    if size != BLANK_UNIT_MSG_SIZE:
                        yield phy, size, topic, queue_id, (int(name) + start + at) // CQ_UNIT_SIZE
                end = start


def _output_units_backward(output_dir: str):
    """Every ConsumeQueue unit of the output, highest store offset first (each queue is in store order)."""
    root = os.path.join(output_dir, CONSUME_QUEUE_DIR)
    queues = []
    for topic in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for queue in sorted(os.listdir(os.path.join(root, topic))):
            if queue.isdigit():
                queues.append(_queue_units_backward(os.path.join(root, topic, queue), topic, int(queue)))
    return heapq.merge(*queues, key=lambda u: u[0], reverse=True)


def _message_at(view: DLedgerLogView, phy: int, size: int) -> tuple[Entry, MessageRecord] | None:
    """The entry at store offset `phy` and its message, when the log holds an entry of that message size there."""
    entry = view.at(phy - ENTRY_HEADER_SIZE)
    if entry is None or entry.size != size + ENTRY_HEADER_SIZE:
        return None
    start = entry.pos - entry.pos % view.size
    try:
        with open(os.path.join(view.data, offset_to_file_name(start)), "rb") as f:
            body = os.pread(f.fileno(), size, phy - start)
        record = MessageRecord.decode(body, check_crc=False)
    except (OSError, ValueError):
        return None
    return entry, record


def _unit_holds(view: DLedgerLogView, unit) -> Entry | None:
    """The entry when the log still holds the message a unit was written for: same position and size, and the
    same topic, queue and queue offset (an LMQ unit, in a queue the record names in its properties, by
    position and size only)."""
    phy, size, topic, queue_id, queue_offset = unit
    found = _message_at(view, phy, size)
    if found is None:
        return None
    entry, record = found
    if record.topic == topic and (record.queue_id != queue_id or record.queue_offset != queue_offset):
        return None
    return entry


def _index_top(config: Config, output_dir: str) -> tuple[int, int] | None:
    """(end_phy_offset, end_timestamp) of the newest IndexFile holding a key: the last record indexed."""
    directory = os.path.join(output_dir, INDEX_DIR)
    names = sorted(n for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []
    store = config.store
    for name in reversed(names):
        try:
            f = IndexFile(os.path.join(directory, name), store.max_hash_slot_num, store.max_index_num, readonly=True)
        except (StoreError, OSError, ValueError):  # a damaged file is recovery's to report and quarantine
            return None
        try:
            if f.index_count > FIRST_INDEX:
                return f.header.end_phy_offset, f.header.end_timestamp
        finally:
            f.close()
    return None


def output_cut(config: Config, output_dir: str, view: DLedgerLogView) -> tuple[int, int] | None:
    """Without fence state: whether the output's newest records are still in the log. The newest ConsumeQueue
    unit must find its message at its position (same size, topic, queue and queue offset) and the last record
    indexed its message with the IndexFile header's store timestamp. When they do, None. Otherwise (top, cut):
    the highest store offset the output holds and the end of the newest entry whose unit still finds its
    message, walking the units down (the first DLedger offset when none does). Records of the plain CommitLog
    below dividedCommitlogOffset are never cut."""
    first = view.first_offset()
    if first is None:
        return None

    def plain(phy: int) -> bool:
        return phy - ENTRY_HEADER_SIZE < first

    units = _output_units_backward(output_dir)
    top_unit = next(units, None)
    indexed = _index_top(config, output_dir)
    unit_ok = top_unit is None or plain(top_unit[0]) or _unit_holds(view, top_unit) is not None
    index_ok = True
    if indexed is not None and not plain(indexed[0]):
        found = view.at(indexed[0] - ENTRY_HEADER_SIZE)
        held = None if found is None else _message_at(view, indexed[0], found.size - ENTRY_HEADER_SIZE)
        index_ok = held is not None and held[1].store_timestamp == indexed[1]
    if unit_ok and index_ok:
        return None
    top = max(top_unit[0] if top_unit is not None else 0, indexed[0] if indexed is not None else 0)
    cut = first
    unit = top_unit
    while unit is not None and not plain(unit[0]):
        entry = _unit_holds(view, unit)
        if entry is not None:
            cut = entry.end
            break
        unit = next(units, None)
    return top, cut


def repair_from_output(config: Config, checkpoint: Checkpoint | None,
                       first_offset: int | None, metrics, log) -> Repair | None:
    """The repair without fence state: the output's newest records checked against the log (`output_cut`). The
    new checkpoint is at the cut, or at the old checkpoint's offset when lower: below a replay marker every
    dispatcher holds all records, above it they may not, so states are only derived below it; without a
    checkpoint, at the store's first offset (everything is dispatched again, as by a clean rebuild)."""
    out = config.output.dir
    view = DLedgerLogView(config.store)
    found = output_cut(config, out, view)
    if found is None:
        return None
    top, cut = found
    if checkpoint is not None:
        bound = checkpoint.reput_from_offset
    else:
        bound = first_offset if first_offset is not None else view.first_offset()
    offset = min(cut, bound)
    names = {spec.name for spec in config.dispatchers}
    if not config.store.message_index_enable:
        names.discard("index")
    states = cut_states(config, out, view, offset, names, log)
    if checkpoint is not None:
        states.update(plugin_states(checkpoint.dispatchers))
    write_checkpoint(out, Checkpoint(offset, states, int(time.time() * 1000)))
    _failpoints.reached("dledger.after_repair_checkpoint")
    gone_pos = top - ENTRY_HEADER_SIZE
    old_offset = checkpoint.reput_from_offset if checkpoint is not None else None
    log.warning("dledger_truncation_repaired", dispatched_entry=None, dispatched_term=None, dispatched_pos=gone_pos,
                now_at_pos=None, shared_entry=None, reput_from_offset=offset, old_reput_from_offset=old_offset,
                found_by="output files",
                detail="the output holds records no longer in the DLedger log (a new leader cut them) and no "
                       "checkpoint named the last entry dispatched: the output is cut back to the newest record "
                       "still in the log and the new entries dispatched")
    if metrics is not None:
        metrics.dledger_truncations.inc()
        metrics.dledger_truncated_bytes.inc(max(0, top - offset))
    return Repair(None, None, None, offset, old_offset if old_offset is not None else offset)


def cut_after_quarantine(config: Config, first_offset: int, log) -> None:
    """A start that repaired a cut and then quarantined a damaged output file: the quarantine's replay marker
    replaced the repair's checkpoint, so recovery would no longer cut the files back, and under a marker each
    dispatcher passes over the units it holds, the cut entries' among them. The output is cut back to the
    store's first offset instead, as a repair under a replay marker at the first offset does: everything in
    the log is dispatched again. Plug-ins lose their states with the marker (`plugins_not_cut` names them)."""
    names = {spec.name for spec in config.dispatchers}
    if not config.store.message_index_enable:
        names.discard("index")
    states = cut_states(config, config.output.dir, DLedgerLogView(config.store), first_offset, names, log)
    write_checkpoint(config.output.dir, Checkpoint(first_offset, states, int(time.time() * 1000)))
    log.warning("dledger_truncation_repaired_again", reput_from_offset=first_offset,
                detail="a damaged output file was quarantined after the repair of a cut: the output is cut back "
                       "to the store's first offset and the whole log dispatched again")


def plugins_not_cut(repair: Repair | None, dispatchers, checkpoint: Checkpoint | None, log) -> list[str]:
    """After a repair, the plug-ins recovery cannot cut back (no `recover`, or no state in the checkpoint to call
    it with): they may still hold results of cut entries, and the operator is told. They see the new entries
    from the repair's offset, or from their `resume_offset` when lower."""
    if repair is None:
        return []
    states = checkpoint.dispatchers if checkpoint is not None else {}
    names = [d.name for d in dispatchers
             if d.name not in BUILT_IN and not (hasattr(d, "recover") and d.name in states)]
    for name in names:
        log.warning("dledger_truncation_plugin_not_cut", dispatcher=name, reput_from_offset=repair.reput_from_offset,
                    old_reput_from_offset=repair.old_offset,
                    detail="this plug-in has no recover() (or no checkpoint state to call it with): results it "
                           "holds for entries the new leader cut are not removed; it is given the new entries "
                           "from reput_from_offset")
    return names
