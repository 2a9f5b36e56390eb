"""One place that builds the SparkSession for every job."""

from __future__ import annotations

import os

from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"
# Shuffle partitions on a local master unless --conf sets them: Spark's 200
# make every micro-batch of the stateful stream job run 200 tiny tasks (and
# a checkpoint keeps its partition count for life).  Clusters keep Spark's
# setting (spark-submit --conf, spark-defaults.conf).
LOCAL_SHUFFLE_PARTITIONS = "8"


def under_spark_submit() -> bool:
    """True when ``spark-submit`` launched this driver (it then owns the master)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def build_session(app_name: str, master: str | None = None,
                  conf: dict[str, str] | None = None) -> SparkSession:
    """A SparkSession: ``master`` when given, else ``local[*]`` unless spark-submit chose.

    Times are handled in UTC (log times are Unix microseconds, and windows
    and report minutes must not depend on the machine's time zone).
    """
    builder = SparkSession.builder.appName(app_name)
    if not master and not under_spark_submit():
        master = DEFAULT_MASTER
    if master:
        builder = builder.master(master)
        if master.startswith("local"):
            builder = builder.config("spark.sql.shuffle.partitions", LOCAL_SHUFFLE_PARTITIONS)
    builder = builder.config("spark.sql.session.timeZone", "UTC")
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark
