"""The ConsumeQueue half of verification (indexcore/verify.py says how): each batch's units, placed as
`ConsumeQueue.put_packed` places them, compared with the existing files of their queue, then the tails,
the files no unit reached and the queues the CommitLog gives no unit."""

from __future__ import annotations

import os

import numpy as np

from indexcore.consumequeue import (
    BLANK_UNIT,
    BLANK_UNIT_MSG_SIZE,
    CONSUME_QUEUE_DIR,
    CQ_UNIT_DTYPE,
    CQ_UNIT_SIZE,
    ConsumeQueueUnit,
    PutStats,
    QueueCursor,
    place_units,
)
from indexcore.dispatch import DispatchBatch
from indexcore.mappedfile import offset_to_file_name
from indexcore.queuestore import consume_queue_units
from indexcore.verify import (
    _QUEUE_FILE_NAME,
    CQ_FILE_EXTRA,
    CQ_FILE_MISSING,
    CQ_FILE_SIZE,
    CQ_QUEUE_MISSING,
    CQ_QUEUE_ORPHANED,
    CQ_UNIT_DANGLING,
    CQ_UNIT_EXTRA,
    CQ_UNIT_MISSING,
    CQ_UNIT_WRONG,
    STRAY_FILE,
    TAIL_SCAN_UNITS,
    Findings,
    MappedFiles,
    RecordLocator,
    _nonzero_rows,
    _unit_json,
    list_store_files,
    queue_mappings_limit,
    same_bytes,
)


class _Queue:
    """One queue as the verifier follows it: the put cursor and the files that exist."""

    __slots__ = ("cursor", "directory", "exists", "expected_files", "files", "queue_id", "rel", "topic")

    def __init__(self, root: str, topic: str, queue_id: int):
        self.topic = topic
        self.queue_id = queue_id
        self.directory = os.path.join(root, topic, str(queue_id))
        self.rel = f"{CONSUME_QUEUE_DIR}/{topic}/{queue_id}"
        self.exists = os.path.isdir(self.directory)
        self.files: dict[int, tuple[str, int]] = {}  # start -> (path, size)
        self.expected_files: set[int] = set()
        self.cursor = QueueCursor()

    def file_rel(self, start: int) -> str:
        return f"{self.rel}/{offset_to_file_name(start)}"


class ConsumeQueueCheck:
    """Follows the ConsumeQueue dispatch of each batch and compares every unit with the existing files.

    `from_offset` > 0 starts in the middle of the store's history: a queue met for the first time continues
    at its record's queue offset, the files before it are history and not judged. With `live`, what lies past
    the dispatched frontier (units after a queue's last expected one) is the broker's work in progress and is
    not judged either.
    """

    def __init__(self, root: str, file_size: int, findings: Findings, locate: RecordLocator, *,
                 from_offset: int = 0, live: bool = False, frontier: int | None = None):
        self.root = os.path.join(root, CONSUME_QUEUE_DIR)
        self.file_size = file_size
        self.findings = findings
        self.locate = locate
        self.from_offset = from_offset
        self.live = live
        self.frontier = frontier
        self.queues: dict[tuple[str, int], _Queue] = {}
        self.maps = MappedFiles(queue_mappings_limit())  # an LMQ store's thousands of queues
        self.stats = PutStats()
        self.units = 0
        self.spread = (0, 0)  # (queues, units) of the last batch, as `ConsumeQueueDispatcher.spread`
        self.files_checked = 0

    # --- the stream -------------------------------------------------------------------------------------

    def check(self, batch: DispatchBatch) -> None:
        queues, units = 0, self.units
        for group in consume_queue_units(batch):
            queues += 1
            q = self.queues.get((group.topic, group.queue_id))
            if q is None:
                q = self._open_queue(group.topic, group.queue_id, int(group.queue_offset[0]))
            self.units += len(group.units)
            for p in place_units(q.cursor, group.queue_offset, group.ends, self.file_size, self.stats,
                                 group.one_streak):
                q.expected_files.add(p.file_start)
                if p.blanks:
                    at = p.logical - p.blanks * CQ_UNIT_SIZE
                    self._compare(q, p.file_start, at, np.frombuffer(BLANK_UNIT * p.blanks, dtype=np.uint8))
                if p.last > p.first:
                    self._compare(q, p.file_start, p.logical, group.units[p.first : p.last].view(np.uint8))
        self.spread = (queues, self.units - units)

    def _open_queue(self, topic: str, queue_id: int, first_queue_offset: int) -> _Queue:
        q = self.queues[(topic, queue_id)] = _Queue(self.root, topic, queue_id)
        self._list_files(q)
        if self.from_offset > 0 and q.files:
            # the queue's history is not read: its next unit goes where its record's queue offset says
            expect = first_queue_offset * CQ_UNIT_SIZE
            q.cursor = QueueCursor(expect - expect % self.file_size, expect)
        return q

    def _list_files(self, q: _Queue) -> None:
        if not q.exists:
            return
        for name, path, size in list_store_files(q.directory, _QUEUE_FILE_NAME, self.file_size, self.live,
                                                 self.findings, q.rel):
            q.files[int(name)] = (path, size)
            if size != self.file_size:
                self.findings.add(CQ_FILE_SIZE, f"{q.rel}/{name}", size, expectedSize=self.file_size,
                                  actualSize=size, topic=q.topic, queueId=q.queue_id).range_name = "queueOffsetsLost"

    def _compare(self, q: _Queue, file_start: int, logical: int, expected: np.ndarray) -> None:
        n = len(expected) // CQ_UNIT_SIZE
        first = logical // CQ_UNIT_SIZE
        pos = logical - file_start
        held = q.files.get(file_start)
        if held is None:
            if q.exists:
                f = self.findings.get(CQ_FILE_MISSING, q.file_rel(file_start), pos, topic=q.topic, queueId=q.queue_id,
                                      range_name="queueOffsets")
            else:
                f = self.findings.get(CQ_QUEUE_MISSING, q.rel, None, topic=q.topic, queueId=q.queue_id,
                                      range_name="queueOffsets")
            f.add(first, n)
            return
        path, size = held
        fit = max(0, min(n, (size - pos) // CQ_UNIT_SIZE))
        if fit < n:
            self.findings.get(CQ_FILE_SIZE, q.file_rel(file_start), size).add(first + fit, n - fit)
        if fit == 0:
            return
        actual = self.maps.view(path, pos, fit * CQ_UNIT_SIZE)
        want = expected[: fit * CQ_UNIT_SIZE]
        if not same_bytes(actual, want):
            a, w = actual.reshape(-1, CQ_UNIT_SIZE), want.reshape(-1, CQ_UNIT_SIZE)
            for r in np.flatnonzero((a != w).any(axis=1)).tolist():
                self._unit_differs(q, file_start, pos + r * CQ_UNIT_SIZE, first + r, a[r], w[r])
        self.maps.done_with(path, pos, pos + fit * CQ_UNIT_SIZE)

    def _unit_differs(self, q: _Queue, file_start: int, pos: int, queue_offset: int, actual: np.ndarray,
                      expected: np.ndarray | None) -> None:
        if not actual.any():
            kind = CQ_UNIT_MISSING
        else:
            u = ConsumeQueueUnit.decode(actual.tobytes())
            if not self.locate.is_record(u.commit_log_offset, u.msg_size):
                kind = CQ_UNIT_DANGLING
            else:
                kind = CQ_UNIT_WRONG if expected is not None else CQ_UNIT_EXTRA
        example = {"queueOffset": queue_offset, "position": pos,
                   "expected": None if expected is None else _unit_json(expected),
                   "actual": _unit_json(actual) if actual.any() else None}
        f = self.findings.get(kind, q.file_rel(file_start), pos, key=q.rel, topic=q.topic, queueId=q.queue_id,
                              range_name="queueOffsets")
        f.add(queue_offset, 1, example)

    # --- after the stream ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """What lies past each queue's expected end, queues the CommitLog gave nothing, stray files."""
        for q in self.queues.values():
            self.files_checked += len(q.files)
            self._check_tail(q)
        self._check_untouched()
        self.maps.close()

    def _check_tail(self, q: _Queue) -> None:
        if not q.expected_files:
            return
        first_expected, last_expected = min(q.expected_files), max(q.expected_files)
        for start, (path, size) in sorted(q.files.items()):
            if start < first_expected:
                if self.from_offset == 0:  # with the whole history read, nothing comes before the first file
                    self._extra_file(q, start, path, size, 0)
            elif start == last_expected:
                if not self.live:
                    self._scan_extra_units(q, start, path, size, q.cursor.write_offset - start)
            elif start > last_expected and not self.live:
                self._extra_file(q, start, path, size, 0)
        for start in q.expected_files:  # a file created by a put that wrote nothing in it
            if start not in q.files and q.exists:
                self.findings.get(CQ_FILE_MISSING, q.file_rel(start), 0, topic=q.topic, queueId=q.queue_id,
                                  range_name="queueOffsets")

    def _extra_file(self, q: _Queue, start: int, path: str, size: int, pos: int) -> None:
        if not self._scan_extra_units(q, start, path, size, pos):
            self.findings.add(CQ_FILE_EXTRA, q.file_rel(start), None, topic=q.topic, queueId=q.queue_id)

    def _scan_extra_units(self, q: _Queue, start: int, path: str, size: int, pos: int) -> bool:
        """Report the units written from `pos` on, reading until a stretch of TAIL_SCAN_UNITS is all zero.
        Whether any was found."""
        found = False
        end = size - size % CQ_UNIT_SIZE
        while pos < end:
            n = min(TAIL_SCAN_UNITS * CQ_UNIT_SIZE, end - pos)
            data = self.maps.view(path, pos, n)
            rows = _nonzero_rows(data, CQ_UNIT_SIZE)
            for r in rows.tolist():
                at = pos + r * CQ_UNIT_SIZE
                self._unit_differs(q, start, at, (start + at) // CQ_UNIT_SIZE, data[r * CQ_UNIT_SIZE:
                                                                                    (r + 1) * CQ_UNIT_SIZE], None)
            self.maps.done_with(path, pos, pos + n)
            if len(rows) == 0:
                break
            found = True
            pos += n
        return found

    def _check_untouched(self) -> None:
        if not os.path.isdir(self.root):
            return
        for topic in sorted(os.listdir(self.root)):
            tdir = os.path.join(self.root, topic)
            if not os.path.isdir(tdir):
                self.findings.add(STRAY_FILE, f"{CONSUME_QUEUE_DIR}/{topic}", None)
                continue
            for name in sorted(os.listdir(tdir)):
                if not name.isdigit() or not os.path.isdir(os.path.join(tdir, name)):
                    self.findings.add(STRAY_FILE, f"{CONSUME_QUEUE_DIR}/{topic}/{name}", None)
                    continue
                if (topic, int(name)) not in self.queues:
                    self._check_orphan(topic, int(name))

    def _check_orphan(self, topic: str, queue_id: int) -> None:
        q = _Queue(self.root, topic, queue_id)
        self._list_files(q)
        self.files_checked += len(q.files)
        if not q.files:
            return
        _, (path, size) = max(q.files.items())
        units = 0
        last_phy = -1
        if size >= CQ_UNIT_SIZE:
            data = self.maps.get(path)
            u = np.frombuffer(data, dtype=CQ_UNIT_DTYPE, count=size // CQ_UNIT_SIZE)
            real = (u["commit_log_offset"] >= 0) & (u["msg_size"] > 0) & (u["msg_size"] != BLANK_UNIT_MSG_SIZE)
            units = int(np.count_nonzero(real))
            if units:
                last_phy = int(u["commit_log_offset"][np.flatnonzero(real)[-1]])
        if self.from_offset == 0 and not self.live:
            orphaned = True  # every queue the CommitLog implies was met
        else:
            orphaned = last_phy >= self.from_offset and (self.frontier is None or last_phy < self.frontier)
        if orphaned:
            self.findings.add(CQ_QUEUE_ORPHANED, q.rel, None, topic=topic, queueId=queue_id, files=len(q.files),
                              unitsInLastFile=units)
