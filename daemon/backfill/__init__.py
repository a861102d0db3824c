"""`reputd backfill`: consumequeue/ and index/ for a range of CommitLog segments, built with Spark.

The output is what `reputd rebuild` writes for the same segments and settings, byte for byte, whatever
the range size, partitions or executors; Spark only spreads the work:

    source   where segments are read: mapped local files, or S3/HDFS objects in ranges (pyarrow.fs)
    ranges   job 1: one task per byte range of a segment, staging its output as files (`stage`)
    plan     the driver's decisions: the chain of ranges (re-reads), what is dispatched, the IndexFiles
    writers  job 2: ConsumeQueue, IndexFile and catalog writers reading the staged runs, staging their files
    catalog  the Parquet catalog's rows and files
    commit   staged files linked into place without clobbering (merge into blank units)
    brokerwatch  the broker's `lock` in the output, watched for the whole job: a broker that takes it stops it
    job      `backfill()`: the driver's run from the config to the summary
    driver   Java detection, the Spark context, Spark's failures as one line
    phases   the two Spark jobs (decode, write) and the commit, the writers balanced over the tasks
    outputs  the checks of the output and the catalog before Spark starts, the catalog's staging removed
    interrupt  SIGINT/SIGTERM: one line, exit 130, nothing left running (in the commit: between two files)
    tasks    what the Python workers run (the decode, the writers), importing no more than they need
"""

import importlib

# what each public name is imported from, on first use: a Python worker imports this package to reach the
# task functions (`tasks`), and must not load the driver's Spark and planning code for it
_EXPORTS = {
    "BackfillError": "daemon.backfill.plan",
    "BackfillFailed": "daemon.backfill.plan",
    "BackfillSummary": "daemon.backfill.job",
    "BrokerLockTaken": "daemon.backfill.brokerwatch",
    "CommitInterrupted": "daemon.backfill.interrupt",
    "Fault": "daemon.backfill.writers",
    "InjectedFault": "daemon.backfill.writers",
    "backfill": "daemon.backfill.job",
    "check_java": "daemon.backfill.driver",
    "commit_log_dirs": "daemon.backfill.job",
    "create_context": "daemon.backfill.driver",
}
__all__ = ["BackfillError", "BackfillFailed", "BackfillSummary", "BrokerLockTaken", "CommitInterrupted", "Fault",
           "InjectedFault", "backfill", "check_java", "commit_log_dirs", "create_context"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
