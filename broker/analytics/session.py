"""One place that builds the SparkSession for every job."""

from __future__ import annotations

import os

from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"


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
    if master:
        builder = builder.master(master)
    elif not under_spark_submit():
        builder = builder.master(DEFAULT_MASTER)
    builder = builder.config("spark.sql.session.timeZone", "UTC")
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark
