"""`reputd backfill`: consumequeue/ and index/ for a range of CommitLog segments, built with Spark.

The output is what `reputd rebuild` writes for the same segments and settings, byte for byte, whatever
the number of partitions or executors; Spark only spreads the work:

    rows     phase 1: one task per segment maps it and emits compact dispatch rows (RowChunk)
    plan     the driver's decisions: what is dispatched, IndexFile roll points and names (no Spark)
    writers  phases 2 and 3: pieces by queue and by IndexFile, and the tasks that write them
    commit   staging per task attempt, then link into place without clobbering (merge into blank units)
    job      the Spark session and stages, Java detection, Spark errors as one line
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
