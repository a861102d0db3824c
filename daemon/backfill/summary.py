"""What a backfill reports: a rebuild's summary plus where and how Spark ran it. Its own module so that the
job (`job.py`) and its phases (`phases.py`), which both fill it, need not import each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.engine.rebuild import RebuildSummary


@dataclass(slots=True)
class BackfillSummary(RebuildSummary):
    """A rebuild's summary plus where and how Spark ran it."""

    master: str = ""
    partitions: int = 0
    catalog: str | None = None
    ranges: int = 0
    reread_ranges: int = 0
    spark_jobs: int = 0
    bytes_read_remote: int = 0
    # what the Python tasks handed the JVM: each range's outcome and each writer's result, pickled (the JVM
    # hands them nothing: a task's work item is its partition's number, generated in its worker)
    bytes_to_jvm: int = 0
    staged_bytes: int = 0
    decode_task_seconds: float = 0.0
    write_task_seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    # the class-data archive the first local backfill saved as it ended (jvm.py): a one-off of seconds that
    # `seconds` and the rate leave out (phases["saveClassArchive"]), or None
    class_archive_saved: str | None = None

    @property
    def class_archive_seconds(self) -> float:
        return self.phases.get("saveClassArchive", 0.0)

    def as_dict(self) -> dict:
        return {
            **RebuildSummary.as_dict(self), "master": self.master, "partitions": self.partitions,
            "ranges": self.ranges, "rereadRanges": self.reread_ranges, "sparkJobs": self.spark_jobs,
            "bytesReadRemote": self.bytes_read_remote, "bytesToJvm": self.bytes_to_jvm,
            "stagedBytes": self.staged_bytes,
            "decodeTaskSeconds": round(self.decode_task_seconds, 3),
            "writeTaskSeconds": round(self.write_task_seconds, 3),
            "phaseSeconds": {k: round(v, 3) for k, v in self.phases.items()}, "catalog": self.catalog,
            "classArchiveSaved": self.class_archive_saved,
        }
