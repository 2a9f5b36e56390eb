"""``skan-analytics stream``: windowed traffic per group and per protocol, exactly once.

One streaming query over the log directory (both formats: a file source for
``routelog-*.parquet`` and one for ``routelog-*.jsonl``, unioned), with its
checkpoint in ``--checkpoint`` and two Parquet outputs under ``--output``:

``by_group``      window_start, window_end, group, messages, bytes, deliveries,
                  undeliverable, undeliverable_rate
``by_protocol``   window_start, window_end, protocol, messages_in, bytes_in,
                  undeliverable, undeliverable_rate (what clients of that
                  protocol sent), deliveries_out, bytes_out (copies the broker
                  delivered to clients of that protocol)

Each micro-batch (the files new since the last one) is aggregated on its own
and written as ``<output>/<view>/batch=<id>``: the rows are additive, a window
whose records came in two micro-batches has two rows, and a reader sums by
window and key.  So no record waits for a watermark and none is dropped as
late: ``--once`` counts every record of every complete file present, and a
file published late (a second broker's, a recovered one) is still counted.

Exactly once: the file sources record in the checkpoint which files each
micro-batch read; a batch re-run after a crash reads the same files and
replaces its own ``batch=<id>`` directory (written under a hidden name, then
renamed), so a restarted job neither skips nor re-counts a log file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import attrs
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery, StreamingQueryListener

from analytics.logfiles import FORMATS
from analytics.schema import (
    is_message,
    message_bytes,
    message_count,
    stream_log,
    undeliverable_count,
)

DEFAULT_WINDOW = "1 minute"
DEFAULT_TRIGGER = "30 seconds"
QUERY = "skan_traffic"
VIEWS = ("by_group", "by_protocol")
# Directory of the one query's checkpoint inside --checkpoint.
CHECKPOINT_NAME = "traffic"
BATCH_DIR = "batch={}"
# How long to wait, after the query ends, for its last progress event to
# reach the listener (Spark delivers them asynchronously).
LISTENER_DRAIN_SECONDS = 10.0


class OldLayout(ValueError):
    """A checkpoint or output of the earlier stateful job (two queries, append mode)."""


def _window_columns() -> list[Column]:
    return [F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end")]


def _rate(part: str, whole: str) -> Column:
    return F.when(F.col(whole) > 0, F.col(part) / F.col(whole)).otherwise(F.lit(0.0))


def by_group(events: DataFrame, window: str) -> DataFrame:
    agg = events.groupBy(F.window("time", window).alias("window"), "group").agg(
        message_count().alias("messages"),
        message_bytes().alias("bytes"),
        F.sum("delivered").alias("deliveries"),
        undeliverable_count().alias("undeliverable"),
    )
    return agg.select(*_window_columns(), "group", "messages", "bytes", "deliveries",
                      "undeliverable", _rate("undeliverable", "messages")
                      .alias("undeliverable_rate"))


def protocol_rows(events: DataFrame) -> DataFrame:
    """One row for the sender's protocol plus one per recipient protocol of each message."""
    zero = F.lit(0).cast("long")
    sent = F.struct(
        F.col("proto").alias("protocol"),
        is_message().alias("messages_in"),
        (is_message() * F.col("size")).alias("bytes_in"),
        (is_message() * F.col("undeliverable").cast("long")).alias("undeliverable"),
        zero.alias("deliveries_out"),
        zero.alias("bytes_out"),
    )
    received = F.transform(
        F.map_entries("recipients"),
        lambda e: F.struct(
            e["key"].alias("protocol"),
            zero.alias("messages_in"),
            zero.alias("bytes_in"),
            zero.alias("undeliverable"),
            e["value"].alias("deliveries_out"),
            (e["value"] * F.col("size")).alias("bytes_out"),
        ),
    )
    return events.select("time", F.explode(F.concat(F.array(sent), received)).alias("r")) \
        .select("time", "r.*")


def by_protocol(events: DataFrame, window: str) -> DataFrame:
    agg = protocol_rows(events).groupBy(F.window("time", window).alias("window"), "protocol") \
        .agg(*(F.sum(c).alias(c) for c in ("messages_in", "bytes_in", "undeliverable",
                                           "deliveries_out", "bytes_out")))
    return agg.select(*_window_columns(), "protocol", "messages_in", "bytes_in",
                      "undeliverable", _rate("undeliverable", "messages_in")
                      .alias("undeliverable_rate"), "deliveries_out", "bytes_out")


def check_layout(checkpoint: str, output: str) -> None:
    """Refuse the earlier job's checkpoint/output: resuming it would count everything again.

    Only local paths are checked (``file://`` or plain).
    """
    from analytics.logfiles import local_path

    ck, out = local_path(checkpoint), local_path(output)
    old = [p for p in (
        ck and os.path.join(ck, "by_group", "offsets"),
        out and os.path.join(out, "by_group", "_spark_metadata"),
    ) if p and os.path.exists(p)]
    if old:
        raise OldLayout(
            f"{old[0]}: written by an earlier skan-analytics stream job (append mode with a "
            "watermark); its windows are not additive with this version's: use a new "
            "--checkpoint and --output (or remove both)")


def _hadoop_fs(spark: SparkSession, path: str) -> tuple[Any, Any]:
    jvm = spark.sparkContext._jvm
    p = jvm.org.apache.hadoop.fs.Path(path)
    return p.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), p


def write_batch(df: DataFrame, path: str) -> None:
    """Write ``df`` to ``path`` as a whole: under a hidden name, then renamed.

    A re-run of the batch (after a crash) replaces what an earlier attempt left.
    """
    spark = df.sparkSession
    parent, name = os.path.split(path.rstrip("/"))
    tmp = os.path.join(parent, f"_tmp-{name}")
    fs, tmp_path = _hadoop_fs(spark, tmp)
    _, final = _hadoop_fs(spark, path)
    df.write.mode("overwrite").parquet(tmp)
    if fs.exists(final):
        fs.delete(final, True)
    if not fs.rename(tmp_path, final):
        raise RuntimeError(f"query {QUERY} failed: cannot rename {tmp} to {path}")


def events(spark: SparkSession, log_dir: str | list[str],
           max_files_per_trigger: int | None = None) -> DataFrame:
    """Both formats' file sources, unioned (always both, so that a checkpoint
    made when the directory held only JSONL files stays valid once Parquet
    files appear)."""
    frames = [stream_log(spark, log_dir, fmt, max_files_per_trigger) for fmt in FORMATS]
    return frames[0].unionByName(frames[1])


def start(
    spark: SparkSession,
    log_dir: str | list[str],
    checkpoint: str,
    output: str,
    *,
    window: str = DEFAULT_WINDOW,
    once: bool = False,
    trigger: str = DEFAULT_TRIGGER,
    max_files_per_trigger: int | None = None,
) -> StreamingQuery:
    """Start the query; with ``once`` it processes what is there and stops (availableNow)."""
    check_layout(checkpoint, output)

    def batch(df: DataFrame, batch_id: int) -> None:
        # The micro-batch feeds both views: read (and for JSONL, parsed) once.
        df = df.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            for name, build in (("by_group", by_group), ("by_protocol", by_protocol)):
                write_batch(build(df, window).coalesce(1),
                            os.path.join(output, name, BATCH_DIR.format(batch_id)))
        finally:
            df.unpersist()

    writer = (
        events(spark, log_dir, max_files_per_trigger).writeStream.queryName(QUERY)
        .foreachBatch(batch)
        .option("checkpointLocation", os.path.join(checkpoint, CHECKPOINT_NAME))
    )
    writer = writer.trigger(availableNow=True) if once else writer.trigger(
        processingTime=trigger)
    return writer.start()


@attrs.define
class StreamTotals:
    """Micro-batches completed and input rows (records) read."""

    batches: int = 0
    rows: int = 0
    # Set once the query's end has reached the listener (after its last progress event).
    ended: threading.Event = attrs.Factory(threading.Event)


def add_progress_listener(spark: SparkSession, report: Callable[[str], None]) -> StreamTotals:
    """Report each micro-batch of this job's queries through ``report`` (one line each)."""
    totals = StreamTotals()

    class Progress(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            report(f"stream: query {event.name} started")

        def onQueryProgress(self, event: Any) -> None:
            p = event.progress
            totals.batches += 1
            totals.rows += p.numInputRows
            rate = p.processedRowsPerSecond
            report(f"stream: {p.name} batch {p.batchId}: {p.numInputRows:,} row(s)"
                   + (f", {rate:,.0f} rows/s" if rate else ""))

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            if event.exception:
                report(f"stream: query {event.id} failed: {event.exception.splitlines()[0]}")
            totals.ended.set()

    spark.streams.addListener(Progress())
    return totals


def run(spark: SparkSession, log_dir: str | list[str], checkpoint: str, output: str,
        totals: StreamTotals | None = None, **kwargs: Any) -> None:
    """Run until stopped (or, with ``once=True``, until the available files are done).

    ``totals``: the listener's (:func:`add_progress_listener`); when given,
    return only once the listener has heard the query end, so that every
    micro-batch's progress line is out before the caller's summary.
    """
    query = start(spark, log_dir, checkpoint, output, **kwargs)
    try:
        query.awaitTermination()
    finally:
        if query.isActive:
            query.stop()
        if totals is not None:
            totals.ended.wait(LISTENER_DRAIN_SECONDS)
    if query.exception() is not None:
        raise RuntimeError(f"query {query.name} failed: {query.exception()}")
