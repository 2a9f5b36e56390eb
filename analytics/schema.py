"""The routing-log record schema as Spark reads it (see broker/observability/routelog/record.py).

An explicit schema: no inference pass over the files, and a streaming source
requires one anyway.  Kept free of broker imports so the driver of a cluster
run needs only this package and PySpark.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, SparkSession, Window
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
    StructField("server", LongType()),
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


def read_log(spark: SparkSession, log_dir: str | list[str]) -> DataFrame:
    """The routing log as a batch DataFrame (with ``time``).

    ``log_dir``: one directory, a glob, or a list of them (one per broker of
    a cluster); see :func:`cluster_wide` for counting each message once.
    """
    paths = [log_dir] if isinstance(log_dir, str) else list(log_dir)
    return with_time(_json_reader(spark.read).json(paths))


def stream_log(spark: SparkSession, log_dir: str | list[str],
               max_files_per_trigger: int | None = None) -> DataFrame:
    """The routing log as a streaming DataFrame: each new file is read once.

    Several directories: one glob (Spark's file stream source takes one path).
    """
    if not isinstance(log_dir, str):
        log_dir = log_dir[0] if len(log_dir) == 1 else "{" + ",".join(log_dir) + "}"
    reader = _json_reader(spark.readStream)
    if max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
    return with_time(reader.json(log_dir))


# -- a cluster's logs: each message once -------------------------------------
#
# A message is logged by the broker it entered, with its sender's protocol,
# and again by every broker that received it from the NATS backplane, with
# sender protocol "cluster" (and that broker's local deliveries).  So a
# message counts once, from the record whose proto is not "cluster", while
# deliveries add up over all records.

CLUSTER_PROTO = "cluster"
# The records of one message on every broker share these: the origin
# broker's timestamp and the sender's lname travel with the message.
MESSAGE_KEY = ("time_us", "lname", "seq", "group", "instance", "to")


def is_message() -> Column:
    """1 for the record that counts the message (its origin broker's), else 0."""
    return (F.col("proto") != CLUSTER_PROTO).cast("long")


def message_count() -> Column:
    return F.sum(is_message())


def message_bytes() -> Column:
    return F.sum(is_message() * F.col("size"))


def cluster_wide(df: DataFrame) -> DataFrame:
    """Batch only: ``copies`` (deliveries of the message on every broker, on
    its origin record) and ``undeliverable`` true only on the origin record of
    a message no broker delivered.  A single broker's log is unchanged."""
    total = F.sum("delivered").over(Window.partitionBy(*MESSAGE_KEY))
    origin = F.col("proto") != CLUSTER_PROTO
    return (df.withColumn("copies", F.when(origin, total))
            .withColumn("undeliverable", origin & (F.col("copies") == 0)))


def undeliverable_count() -> Column:
    """Messages delivered to nobody, counted on their origin broker's record only."""
    return F.sum((F.col("undeliverable") & (F.col("proto") != CLUSTER_PROTO)).cast("long"))
