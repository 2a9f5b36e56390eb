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

from analytics.logfiles import GLOBS, Inventory, scan

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

def _reader(reader, fmt: str):
    reader = reader.schema(LOG_SCHEMA).option("pathGlobFilter", GLOBS[fmt])
    if fmt == "jsonl":
        # PERMISSIVE: a line that is not a record becomes nulls and is filtered
        # out below rather than failing a long-running job.
        reader = reader.option("mode", "PERMISSIVE")
    return reader


def _load(reader, fmt: str, paths: list[str] | str) -> DataFrame:
    return reader.json(paths) if fmt == "jsonl" else reader.parquet(
        *([paths] if isinstance(paths, str) else paths))


def with_time(df: DataFrame) -> DataFrame:
    """Drop unreadable lines; add ``time`` (a timestamp) from ``time_us``."""
    return (df.where(F.col("time_us").isNotNull() & F.col("group").isNotNull())
            .withColumn("time", F.timestamp_micros("time_us")))


def read_log(spark: SparkSession, log_dir: str | list[str],
             inventory: Inventory | None = None) -> DataFrame:
    """The routing log as a batch DataFrame (with ``time``).

    ``log_dir``: one directory, a glob, or a list of them (one per broker of
    a cluster); see :func:`cluster_wide` for counting each message once.
    Parquet files are read by Spark's Parquet reader (column pruning, no
    parsing); JSON Lines files are read only when the listing
    (``inventory``, made here when not given) found some, or cannot tell.
    """
    paths = [log_dir] if isinstance(log_dir, str) else list(log_dir)
    inv = inventory if inventory is not None else scan(paths)
    frames = [_load(_reader(spark.read, fmt), fmt, paths) for fmt in inv.formats()]
    if not frames:  # nothing finished yet: an empty log of the right schema
        return with_time(spark.createDataFrame([], LOG_SCHEMA))
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return with_time(df)


def stream_log(spark: SparkSession, log_dir: str | list[str], fmt: str,
               max_files_per_trigger: int | None = None) -> DataFrame:
    """The files of one format as a streaming DataFrame: each new file is read once.

    Several directories: one glob (Spark's file stream source takes one path).
    """
    if not isinstance(log_dir, str):
        log_dir = log_dir[0] if len(log_dir) == 1 else "{" + ",".join(log_dir) + "}"
    reader = _reader(spark.readStream, fmt)
    if max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
    return with_time(_load(reader, fmt, log_dir))


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


def cluster_wide(df: DataFrame, single_broker: bool = False) -> DataFrame:
    """Batch only: ``copies`` (deliveries of the message on every broker, on
    its origin record) and ``undeliverable`` true only on the origin record of
    a message no broker delivered.

    ``single_broker``: the files show one broker wrote them all (see
    analytics.logfiles.Inventory.single_broker).  Then a message has one
    record and ``copies`` is its ``delivered``: no shuffle of the whole log
    to bring a message's records together.
    """
    origin = F.col("proto") != CLUSTER_PROTO
    if single_broker:
        return (df.withColumn("copies", F.when(origin, F.col("delivered")))
                .withColumn("undeliverable", origin & (F.col("delivered") == 0)))
    total = F.sum("delivered").over(Window.partitionBy(*MESSAGE_KEY))
    return (df.withColumn("copies", F.when(origin, total))
            .withColumn("undeliverable", origin & (F.col("copies") == 0)))


def undeliverable_count() -> Column:
    """Messages delivered to nobody, counted on their origin broker's record only."""
    return F.sum((F.col("undeliverable") & (F.col("proto") != CLUSTER_PROTO)).cast("long"))
