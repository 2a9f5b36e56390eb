"""One place that builds the SparkSession for every job."""

from __future__ import annotations

import os
import tempfile

from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"
# Shuffle partitions on a local master unless --conf sets them: Spark's 200
# make every micro-batch of the stateful stream job run 200 tiny tasks (and
# a checkpoint keeps its partition count for life).  Clusters keep Spark's
# setting (spark-submit --conf, spark-defaults.conf).
LOCAL_SHUFFLE_PARTITIONS = "8"
# Spark's log level.  Without --verbose the driver JVM's stderr (start-up
# notices, warnings, the progress bar) goes to a file instead of the terminal:
# its start-up lines are printed before any log level can apply.
SPARK_LOG_LEVEL = "WARN"


def under_spark_submit() -> bool:
    """True when ``spark-submit`` launched this driver (it then owns the master)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def _jvm_log_file() -> tuple[int, str]:
    return tempfile.mkstemp(prefix="skan-analytics-spark-", suffix=".log")


def build_session(app_name: str, master: str | None = None,
                  conf: dict[str, str] | None = None, *, verbose: bool = False) -> SparkSession:
    """A SparkSession: ``master`` when given, else ``local[*]`` unless spark-submit chose.

    Times are handled in UTC (log times are Unix microseconds, and windows
    and report minutes must not depend on the machine's time zone).  Unless
    ``verbose``, the driver JVM writes its output to a temporary file (its
    path in ``spark.skan_jvm_log``) and shows no progress bar: the jobs print
    their own progress on stderr.
    """
    builder = SparkSession.builder.appName(app_name)
    if not master and not under_spark_submit():
        master = DEFAULT_MASTER
    if master:
        builder = builder.master(master)
        if master.startswith("local"):
            builder = builder.config("spark.sql.shuffle.partitions", LOCAL_SHUFFLE_PARTITIONS)
            # A local driver binds loopback: no "resolves to a loopback address" warning.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = builder.config("spark.sql.session.timeZone", "UTC")
    builder = builder.config("spark.ui.showConsoleProgress", "true" if verbose else "false")
    # Retention removes old routing-log files; a file listed and then removed
    # before it is read is skipped, not a failed job.
    builder = builder.config("spark.sql.files.ignoreMissingFiles", "true")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    if verbose or under_spark_submit():
        spark = builder.getOrCreate()
    else:
        # The JVM inherits file descriptor 2 when it starts: point it at a file
        # for that moment, then give this process its stderr back.
        log_fd, log_path = _jvm_log_file()
        saved = os.dup(2)
        try:
            os.dup2(log_fd, 2)
            spark = builder.getOrCreate()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(log_fd)
        spark.skan_jvm_log = log_path  # type: ignore[attr-defined]
    spark.sparkContext.setLogLevel(SPARK_LOG_LEVEL)
    return spark
