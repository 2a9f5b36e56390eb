"""``skan-analytics report``: a batch job over the routing log.

Computes, with Spark, over every finished log file:

- totals (messages, bytes, deliveries, undeliverable, groups, senders, time span)
- top groups by messages and by bytes
- top senders (lname, protocol and user)
- fan-out distribution (how many copies each message was delivered as)
- protocol mix (what clients of each protocol sent and received)
- a per-minute time series
- undeliverable messages by group

then prints readable tables, writes one PNG chart per view (matplotlib, Agg)
and one self-contained HTML page with the charts embedded
(:mod:`analytics.render`).  The parsed log is cached once and every
view is a small aggregation over it, so the JSON is parsed a single time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from analytics.model import Report, Table
from analytics.schema import (
    cluster_wide,
    is_message,
    message_bytes,
    message_count,
    read_log,
    undeliverable_count,
)

DEFAULT_TOP = 10
# Fan-out buckets: (label, lowest, highest) copies per message.
FANOUT_BUCKETS = (
    ("0", 0, 0), ("1", 1, 1), ("2", 2, 2), ("3-5", 3, 5), ("6-10", 6, 10),
    ("11-50", 11, 50), ("51-100", 51, 100), ("101-1000", 101, 1000),
    (">1000", 1001, None),
)


def _traffic(df: DataFrame, *keys: str) -> DataFrame:
    return df.groupBy(*keys).agg(
        message_count().alias("messages"),
        message_bytes().alias("bytes"),
        F.sum("delivered").alias("deliveries"),
        undeliverable_count().alias("undeliverable"),
    )


def _rows(df: DataFrame, columns: list[str]) -> list[list[Any]]:
    return [[row[c] for c in columns] for row in df.select(*columns).collect()]


def fanout_buckets(counts: dict[int, int]) -> list[list[Any]]:
    rows = []
    for label, low, high in FANOUT_BUCKETS:
        n = sum(c for d, c in counts.items() if d >= low and (high is None or d <= high))
        rows.append([label, n])
    return rows


def _silent(line: str) -> None:
    pass


def compute(spark: SparkSession, log_dir: str | list[str], top: int = DEFAULT_TOP,
            progress: Callable[[str], None] = _silent) -> Report:
    """Run every aggregation; returns plain Python tables.  ``progress`` hears each step.

    Several log directories (a cluster's brokers): each message counts once,
    deliveries add up over the brokers (see analytics.schema.cluster_wide).
    """
    log = cluster_wide(read_log(spark, log_dir)).select(
        "time", "lname", "proto", "user", "group", "size", "recipients", "delivered",
        "undeliverable", "copies",
    ).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        t = log.agg(
            message_count().alias("messages"),
            message_bytes().alias("bytes"),
            F.sum("delivered").alias("deliveries"),
            undeliverable_count().alias("undeliverable"),
            F.countDistinct("group").alias("groups"),
            F.countDistinct("lname").alias("senders"),
            F.min("time").alias("first"),
            F.max("time").alias("last"),
        ).collect()[0].asDict()
        totals = {k: (v if v is not None else 0) for k, v in t.items()}
        progress(f"report: {totals['messages']:,} records read; aggregating")
        totals["first"], totals["last"] = t["first"], t["last"]
        tables: dict[str, Table] = {}

        groups = _traffic(log, "group")
        gcols = ["group", "messages", "bytes", "deliveries", "undeliverable"]
        tables["groups_by_messages"] = Table(
            f"Top {top} groups by messages", gcols,
            _rows(groups.orderBy(F.desc("messages"), "group").limit(top), gcols))
        tables["groups_by_bytes"] = Table(
            f"Top {top} groups by bytes", gcols,
            _rows(groups.orderBy(F.desc("bytes"), "group").limit(top), gcols))

        senders = _traffic(log.where(is_message() == 1), "lname", "proto", "user")
        scols = ["lname", "proto", "user", "messages", "bytes", "deliveries"]
        tables["top_senders"] = Table(
            f"Top {top} senders by messages", scols,
            _rows(senders.orderBy(F.desc("messages"), "lname").limit(top), scols))

        fan = {row["copies"]: row["count"] for row in
               log.where(is_message() == 1).groupBy("copies").count().collect()}
        tables["fanout"] = Table("Fan-out: copies delivered per message",
                                 ["copies", "messages"], fanout_buckets(fan))

        sent = {row["proto"]: row for row in
                _traffic(log.where(is_message() == 1), "proto").collect()}
        received = {
            row["protocol"]: row for row in
            log.select(F.explode("recipients").alias("protocol", "copies"), "size")
            .groupBy("protocol").agg(F.sum("copies").alias("deliveries"),
                                     F.sum(F.col("copies") * F.col("size")).alias("bytes_out"))
            .collect()
        }
        mix = []
        for proto in sorted(set(sent) | set(received)):
            s, r = sent.get(proto), received.get(proto)
            mix.append([proto, s["messages"] if s else 0, s["bytes"] if s else 0,
                        s["undeliverable"] if s else 0, r["deliveries"] if r else 0,
                        r["bytes_out"] if r else 0])
        tables["protocols"] = Table(
            "Protocol mix (sent by clients of the protocol / delivered to them)",
            ["protocol", "messages_in", "bytes_in", "undeliverable", "deliveries_out",
             "bytes_out"], mix)

        minutes = _traffic(log.withColumn("minute", F.date_trunc("minute", "time")), "minute")
        mcols = ["minute", "messages", "bytes", "deliveries", "undeliverable"]
        tables["per_minute"] = Table("Traffic per minute (UTC)", mcols,
                                     _rows(minutes.orderBy("minute"), mcols))

        undeliv = groups.where(F.col("undeliverable") > 0).withColumn(
            "rate", F.col("undeliverable") / F.col("messages"))
        ucols = ["group", "undeliverable", "messages", "rate"]
        tables["undeliverable"] = Table(
            f"Top {top} groups by undeliverable messages", ucols,
            _rows(undeliv.orderBy(F.desc("undeliverable"), "group").limit(top), ucols))
    finally:
        log.unpersist()
    shown = log_dir if isinstance(log_dir, str) else ", ".join(log_dir)
    return Report(log_dir=shown, totals=totals, tables=tables)


def run(spark: SparkSession, log_dir: str | list[str], out_dir: str, *,
        top: int = DEFAULT_TOP, quiet: bool = False,
        progress: Callable[[str], None] = _silent) -> Report:
    """Compute the report, print it (unless ``quiet``), write PNGs, HTML and JSON."""
    from analytics import render

    report = compute(spark, log_dir, top, progress)
    progress(f"report: writing charts and HTML to {out_dir}")
    os.makedirs(out_dir, exist_ok=True)
    report.charts = render.write_charts(report, out_dir)
    report.html = render.write_html(report, os.path.join(out_dir, "report.html"))
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report.to_json(), f, indent=1)
    if not quiet:
        print(render.text(report))
        print(f"\nHTML report: {report.html}")
    return report
