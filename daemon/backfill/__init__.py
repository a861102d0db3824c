"""`reputd backfill`: consumequeue/ and index/ for a range of CommitLog segments, built with Spark.

The output is what `reputd rebuild` writes for the same segments and settings, byte for byte, whatever
the range size, partitions or executors; Spark only spreads the work:

    source   where segments are read: mapped local files, or S3/HDFS objects in ranges (pyarrow.fs)
    ranges   job 1: one task per byte range of a segment, emitting the output's bytes as Arrow rows
    plan     the driver's decisions: the chain of ranges (re-reads), what is dispatched, the IndexFiles
    writers  job 2: ConsumeQueue, IndexFile and catalog writers fed by Spark's shuffle, staging their files
    catalog  the Parquet catalog's rows and files
    commit   staged files linked into place without clobbering (merge into blank units)
    job      the Spark session and jobs, Java detection, Spark errors as one line
"""

from daemon.backfill.job import BackfillSummary, backfill, check_java, commit_log_dirs, create_session
from daemon.backfill.plan import BackfillError, BackfillFailed
from daemon.backfill.writers import Fault, InjectedFault

__all__ = [
    "BackfillError",
    "BackfillFailed",
    "BackfillSummary",
    "Fault",
    "InjectedFault",
    "backfill",
    "check_java",
    "commit_log_dirs",
    "create_session",
]
