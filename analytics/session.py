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
# Spark's own logging when not --verbose: errors only.  The JVM's start-up
# warnings (loopback host name, native Hadoop library) come from log4j before
# any setLogLevel call, so a log4j2 configuration is handed to the driver JVM.
QUIET_LEVEL = "ERROR"
VERBOSE_LEVEL = "WARN"
_QUIET_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = spark: %p %c{1}: %m%n
"""


def under_spark_submit() -> bool:
    """True when ``spark-submit`` launched this driver (it then owns the master)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def _quiet_log4j_file() -> str:
    fd, path = tempfile.mkstemp(prefix="skan-analytics-log4j2-", suffix=".properties")
    with os.fdopen(fd, "w") as f:
        f.write(_QUIET_LOG4J2)
    return path


def build_session(app_name: str, master: str | None = None,
                  conf: dict[str, str] | None = None, *, verbose: bool = False) -> SparkSession:
    """A SparkSession: ``master`` when given, else ``local[*]`` unless spark-submit chose.

    Times are handled in UTC (log times are Unix microseconds, and windows
    and report minutes must not depend on the machine's time zone).  Unless
    ``verbose``, Spark logs errors only and shows no console progress bar
    (the jobs print their own progress on stderr).
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
    path = None
    if not verbose and not under_spark_submit():
        path = _quiet_log4j_file()
        builder = builder.config("spark.driver.extraJavaOptions",
                                 f"-Dlog4j2.configurationFile=file:{path}")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    finally:
        if path is not None:
            os.unlink(path)  # log4j read it when the JVM started
    spark.sparkContext.setLogLevel(VERBOSE_LEVEL if verbose else QUIET_LEVEL)
    return spark
