"""The routing-log record schema as Spark reads it (see broker/observability/routelog/record.py).

An explicit schema: no inference pass over the files, and a streaming source
requires one anyway.  Kept free of broker imports so the driver of a cluster
run needs only this package and PySpark.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

LOG_SCHEMA = StructType([
    StructField("time_us", LongType()),
    StructField("lname", StringType()),
    StructField("proto", StringType()),
    StructField("user", StringType()),
    StructField("group", StringType()),
    StructField("instance", StringType()),
    StructField("to", StringType()),
    StructField("seq", StringType()),
    StructField("size", LongType()),
    StructField("recipients", MapType(StringType(), LongType())),
    StructField("delivered", LongType()),
    StructField("undeliverable", BooleanType()),
])

# Only finished log files: the writer's hidden temporary files start with a
# dot (which Spark skips anyway) and other files in the directory are ignored.
LOG_GLOB = "routelog-*.jsonl"


def _json_reader(reader):
    # PERMISSIVE: a line that is not a record becomes nulls and is filtered
    # out below rather than failing a long-running job.
    return (reader.schema(LOG_SCHEMA).option("pathGlobFilter", LOG_GLOB)
            .option("mode", "PERMISSIVE"))


def with_time(df: DataFrame) -> DataFrame:
    """Drop unreadable lines; add ``time`` (a timestamp) from ``time_us``."""
    return (df.where(F.col("time_us").isNotNull() & F.col("group").isNotNull())
            .withColumn("time", F.timestamp_micros("time_us")))


def read_log(spark: SparkSession, log_dir: str) -> DataFrame:
    """The routing log as a batch DataFrame (with ``time``)."""
    return with_time(_json_reader(spark.read).json(log_dir))


def stream_log(spark: SparkSession, log_dir: str, max_files_per_trigger: int | None = None
               ) -> DataFrame:
    """The routing log as a streaming DataFrame: each new file is read once."""
    reader = _json_reader(spark.readStream)
    if max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
    return with_time(reader.json(log_dir))


def undeliverable_count() -> Column:
    return F.sum(F.col("undeliverable").cast("long"))
