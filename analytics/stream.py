"""``skan-analytics stream``: windowed traffic per group and per protocol, exactly once.

Two streaming queries over the log directory, each with its own checkpoint
under ``--checkpoint`` and its own Parquet output under ``--output``:

``by_group``      window_start, window_end, group, messages, bytes, deliveries,
                  undeliverable, undeliverable_rate
``by_protocol``   window_start, window_end, protocol, messages_in, bytes_in,
                  undeliverable, undeliverable_rate (what clients of that
                  protocol sent), deliveries_out, bytes_out (copies the broker
                  delivered to clients of that protocol)

Exactly once: the file source records in the checkpoint which files each
micro-batch read and the Parquet sink commits each batch's files in its
``_spark_metadata`` log, so a restarted job (after a crash or a ``--once``
run) neither skips nor re-counts a log file.  Read the output with Spark
(``spark.read.parquet(output/by_group)``), which honours that log.

Windows are emitted in append mode once the watermark (the newest record
time seen minus ``--watermark``) passes their end: the newest windows wait
for later traffic (or the next run) before they are written.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import attrs
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery, StreamingQueryListener

from analytics.schema import (
    is_message,
    message_bytes,
    message_count,
    stream_log,
    undeliverable_count,
)

DEFAULT_WINDOW = "1 minute"
DEFAULT_WATERMARK = "1 minute"
DEFAULT_TRIGGER = "30 seconds"
QUERIES = ("by_group", "by_protocol")


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


def start(
    spark: SparkSession,
    log_dir: str | list[str],
    checkpoint: str,
    output: str,
    *,
    window: str = DEFAULT_WINDOW,
    watermark: str = DEFAULT_WATERMARK,
    once: bool = False,
    trigger: str = DEFAULT_TRIGGER,
    max_files_per_trigger: int | None = None,
) -> list[StreamingQuery]:
    """Start both queries; with ``once`` they process what is there and stop (availableNow)."""
    queries = []
    for name, build in (("by_group", by_group), ("by_protocol", by_protocol)):
        events = stream_log(spark, log_dir, max_files_per_trigger).withWatermark("time", watermark)
        writer = (
            build(events, window).writeStream.queryName(f"skan_{name}")
            .format("parquet").outputMode("append")
            .option("path", os.path.join(output, name))
            .option("checkpointLocation", os.path.join(checkpoint, name))
        )
        writer = writer.trigger(availableNow=True) if once else writer.trigger(
            processingTime=trigger)
        queries.append(writer.start())
    return queries


@attrs.define
class StreamTotals:
    """Micro-batches completed and input rows read, over both queries."""

    batches: int = 0
    rows: int = 0


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

    spark.streams.addListener(Progress())
    return totals


def run(spark: SparkSession, log_dir: str | list[str], checkpoint: str, output: str,
        **kwargs: Any) -> None:
    """Run until stopped (or, with ``once=True``, until the available files are done)."""
    queries = start(spark, log_dir, checkpoint, output, **kwargs)
    try:
        if kwargs.get("once"):
            for q in queries:
                q.awaitTermination()
        else:
            spark.streams.awaitAnyTermination()
    finally:
        for q in queries:
            if q.isActive:
                q.stop()
    for q in queries:
        if q.exception() is not None:
            raise RuntimeError(f"query {q.name} failed: {q.exception()}")
