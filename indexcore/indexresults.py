"""What `IndexService` (indexcore/indexservice.py) hands back: a key query's offsets (`QueryOffsetResult`,
or `IndexQueryDamaged` with the offsets found before damage), a put's statistics, where a build resumes
(`IndexResume`) and what a truncation removed (`TruncateReport`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from dataclasses import field as data_field

from indexcore.errors import CorruptEntryError


@dataclass(frozen=True, slots=True)
class QueryOffsetResult:
    """`QueryOffsetResult`: candidate offsets (hash matches only), newest first, file by file; `sources`
    gives the IndexFile path and entry number each came from."""

    phy_offsets: list[int]
    index_last_update_timestamp: int
    index_last_update_phy_offset: int
    sources: list[tuple[str, int]] = data_field(default_factory=list)


class IndexQueryDamaged(CorruptEntryError):
    """A query that met a damaged IndexFile (`IndexFile.select_phy_offsets`): the damage, and in `partial`
    the candidates found before it, which are still right."""

    def __init__(self, damage: CorruptEntryError, partial: QueryOffsetResult):
        super().__init__(damage.path, damage.entry, damage.field, damage.detail)
        self.partial = partial

    def __reduce__(self):
        return (IndexQueryDamaged, (CorruptEntryError(self.path, self.entry, self.field, self.detail), self.partial))


@dataclass(frozen=True, slots=True)
class TruncateReport:
    """What `truncate_to` did, for the log."""

    name: str | None  # the newest file kept, None when the state was None
    files_deleted: tuple[str, ...]
    entries_removed: int
    slots_restored: int

    def as_dict(self) -> dict:
        return {**asdict(self), "files_deleted": list(self.files_deleted)}


@dataclass(frozen=True, slots=True)
class IndexResume:
    """Where indexing goes on: records below `phy_offset` are indexed already; of the record at it, the
    first `keys_put` keys are (0: it was not dispatched yet). A record whose keys were all put is left
    out altogether, so it does not create the file that follows a full one: the next record does, as it
    did in the run that indexed it."""

    phy_offset: int
    keys_put: int = 0


@dataclass(slots=True)
class IndexStats:
    """What one `build_index` call did."""

    keys_put: int = 0
    files_created: int = 0
