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
(:mod:`analytics.render`).  The log is read once (see :func:`compute`):
Parquet column by column, JSON Lines parsed once.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from analytics import logfiles
from analytics.model import Report, Table
from analytics.schema import CLUSTER_PROTO, cluster_wide, is_message, read_log

DEFAULT_TOP = 10
# Fan-out buckets: (label, lowest, highest) copies per message.
FANOUT_BUCKETS = (
    ("0", 0, 0), ("1", 1, 1), ("2", 2, 2), ("3-5", 3, 5), ("6-10", 6, 10),
    ("11-50", 11, 50), ("51-100", 51, 100), ("101-1000", 101, 1000),
    (">1000", 1001, None),
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


# How the views are computed, in two passes over the log at most and two
# Spark jobs, whatever the number of views (each job costs scheduling time):
#
# 1. one aggregation of the records by (group, sender, copies, minute): a row
#    per combination, typically thousands for millions of records (at worst
#    one per record); then GROUPING SETS over those rows give every view
#    but one (a row per set and key), and a rank per set keeps only what the
#    report shows (the top rows of the group and sender sets, each row of
#    the small sets): that, and a row count per set, is what is collected;
# 2. only when a recipients map names a protocol outside KNOWN_PROTOCOLS
#    (pass 1 sums the copies delivered to each known protocol and counts
#    the other entries): the recipients maps, exploded and summed per
#    protocol (a map is not a grouping key Spark hashes cheaply).
#
# Each set's id is grouping_id() over KEYS: bit i set = KEYS[i] not grouped
# (KEYS in the order the sets first name them, as Spark requires).
KEYS = ("group", "lname", "proto", "user", "copies", "minute")
SETS = {
    "group": ("group",),
    "sender": ("lname", "proto", "user"),
    "copies": ("copies",),
    "minute": ("minute",),
    "proto": ("proto",),
    "lname": ("lname",),
}
# Sets collected whole: a row per fan-out value, minute or protocol.
WHOLE = ("copies", "minute", "proto")
MINUTE_US = 60_000_000
# Recipient protocols summed in pass 1 (the broker's client protocols and its
# cluster backplane): a log whose recipients name only these needs no pass 2.
# Any other name is counted in pass 1 ("unknown") and then pass 2 runs: the
# list is a shortcut, never a limit.
KNOWN_PROTOCOLS = ("skan", "hsp", "eventer", "mariner", "cluster")


def _gid(keys: tuple[str, ...]) -> int:
    return sum(1 << (len(KEYS) - 1 - i) for i, k in enumerate(KEYS) if k not in keys)


def fine(log: DataFrame) -> DataFrame:
    """Pass 1: the records summed per (group, sender, copies, minute).

    Also the copies (and their bytes) delivered to each protocol of
    KNOWN_PROTOCOLS, and ``unknown``: recipients entries of any other
    protocol (then pass 2 is needed).
    """
    msg = is_message()
    rcpt = {p: F.coalesce(F.col("recipients")[p], F.lit(0).cast("long")) for p in KNOWN_PROTOCOLS}
    known_entries = sum((F.col("recipients")[p].isNotNull().cast("int") for p in KNOWN_PROTOCOLS),
                        F.lit(0))
    return log.groupBy(
        "group", "lname", "proto", "user", "copies",
        # A minute number (integer division is cheaper than date_trunc per record).
        F.floor(F.col("time_us") / MINUTE_US).alias("minute"),
    ).agg(
        F.sum(msg).alias("messages"),
        F.sum(msg * F.col("size")).alias("bytes"),
        F.sum("delivered").alias("deliveries"),
        F.sum((F.col("undeliverable") & (msg == 1)).cast("long")).alias("undeliverable"),
        F.count(F.lit(1)).alias("records"),
        F.min("time_us").alias("first_us"),
        F.max("time_us").alias("last_us"),
        *(F.sum(c).alias(f"to_{p}") for p, c in rcpt.items()),
        *(F.sum(c * F.col("size")).alias(f"to_{p}_bytes") for p, c in rcpt.items()),
        F.sum(F.coalesce(F.size("recipients"), F.lit(0)) - known_entries).alias("unknown"),
    )


def aggregate(rows: DataFrame) -> DataFrame:
    """Every view's grouping over the pass-1 rows: a row per set and key, with
    ``gid`` naming the set (see SETS)."""
    view = f"skan_report_{id(rows)}"
    rows.createOrReplaceTempView(view)
    sets = ", ".join("(" + ", ".join(f"`{k}`" for k in keys) + ")" for keys in SETS.values())
    cols = ", ".join(f"`{k}`" for k in KEYS)
    sums = ", ".join(f"SUM({c}) AS {c}" for c in (
        "messages", "bytes", "deliveries", "undeliverable", "records", "unknown",
        *(f"to_{p}" for p in KNOWN_PROTOCOLS), *(f"to_{p}_bytes" for p in KNOWN_PROTOCOLS)))
    try:
        return rows.sparkSession.sql(
            f"SELECT grouping_id({cols}) AS gid, {cols}, {sums}, "
            "MIN(first_us) AS first_us, MAX(last_us) AS last_us "
            f"FROM {view} GROUP BY GROUPING SETS ({sets})")
    finally:
        rows.sparkSession.catalog.dropTempView(view)


def shown(agg: DataFrame, top: int) -> DataFrame:
    """The rows of ``agg`` the report shows, each with ``n``, its set's row count."""
    by_set = Window.partitionBy("gid")
    key = [F.col(k).asc_nulls_first() for k in ("group", "lname", "proto", "user")]
    # Records another broker forwarded (proto "cluster") rank after every sender.
    forwarded = (F.col("proto") == CLUSTER_PROTO).cast("int").asc_nulls_first()
    rank_m = F.row_number().over(by_set.orderBy(forwarded, F.desc("messages"), *key))
    rank_b = F.row_number().over(by_set.orderBy(F.desc("bytes"), *key))
    rank_u = F.row_number().over(by_set.orderBy(F.desc("undeliverable"), *key))
    whole = F.col("gid").isin([_gid(SETS[name]) for name in WHOLE])
    return (agg.withColumn("n", F.count(F.lit(1)).over(by_set))
            .withColumn("rank_m", rank_m).withColumn("rank_b", rank_b)
            .withColumn("rank_u", rank_u)
            .where(whole | (F.col("rank_m") <= top) | (F.col("rank_b") <= top)
                   | ((F.col("rank_u") <= top) & (F.col("undeliverable") > 0))))


def delivered_per_protocol(log: DataFrame) -> dict[str, list[int]]:
    """Pass 2: {protocol: [copies delivered to its clients, their bytes]}."""
    rows = (log.select(F.explode("recipients").alias("protocol", "copies"), "size")
            .groupBy("protocol").agg(F.sum("copies").alias("deliveries"),
                                     F.sum(F.col("copies") * F.col("size")).alias("bytes_out"))
            .collect())
    return {r["protocol"]: [r["deliveries"], r["bytes_out"]] for r in rows}


def _minute(number: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1) + dt.timedelta(minutes=number)


def _time(us: int | None) -> dt.datetime | None:
    return None if us is None else dt.datetime(1970, 1, 1) + dt.timedelta(microseconds=us)


def compute(spark: SparkSession, log_dir: str | list[str], top: int = DEFAULT_TOP,
            progress: Callable[[str], None] = _silent,
            inventory: logfiles.Inventory | None = None) -> Report:
    """Run every aggregation; returns plain Python tables.  ``progress`` hears each step.

    Several log directories (a cluster's brokers): each message counts once,
    deliveries add up over the brokers (see analytics.schema.cluster_wide);
    that costs a shuffle of the whole log, so it runs only when the file
    names show more than one broker (or cannot be listed).

    Nothing is cached: pass 1 is the only pass over the log unless a
    recipients map names a protocol outside KNOWN_PROTOCOLS, and its result
    is collected once.
    """
    paths = [log_dir] if isinstance(log_dir, str) else list(log_dir)
    inv = inventory if inventory is not None else logfiles.scan(paths)
    notes = []
    left_out = logfiles.left_out_note(inv)
    if left_out:
        notes.append(left_out)
    if not inv.remote:
        read = ", ".join(f"{inv.files[f]} {f}" for f in inv.formats())
        how = ("one broker" if inv.single_broker()
               else f"{len(inv.servers)} brokers: each message counted once")
        progress(f"report: files: {read or 'none'} ({how})")
    log = cluster_wide(read_log(spark, paths, inv), single_broker=inv.single_broker())
    rows = shown(aggregate(fine(log)), top).collect()
    whole = [r for r in rows if r["gid"] == _gid(SETS["minute"])]
    progress(f"report: {sum(r['records'] for r in whole):,} records read; aggregating")
    if any(r["unknown"] for r in whole):
        received = delivered_per_protocol(log)
    else:
        received = {p: [sum(r[f"to_{p}"] for r in whole),
                        sum(r[f"to_{p}_bytes"] for r in whole)] for p in KNOWN_PROTOCOLS}
        received = {p: v for p, v in received.items() if v[0]}
    sets: dict[str, list[Any]] = {name: [] for name in SETS}
    names = {_gid(keys): name for name, keys in SETS.items()}
    for r in rows:
        sets[names[r["gid"]]].append(r)
    minutes = sorted(sets["minute"], key=lambda r: r["minute"])
    totals: dict[str, Any] = {
        k: sum(r[k] or 0 for r in minutes)
        for k in ("messages", "bytes", "deliveries", "undeliverable", "records")}
    totals["groups"] = sets["group"][0]["n"] if sets["group"] else 0
    totals["senders"] = sets["lname"][0]["n"] if sets["lname"] else 0
    totals["first"] = _time(min((r["first_us"] for r in minutes), default=None))
    totals["last"] = _time(max((r["last_us"] for r in minutes), default=None))
    tables: dict[str, Table] = {}

    def ranked(name: str, rank: str) -> list[Any]:
        return sorted((r for r in sets[name] if r[rank] <= top), key=lambda r: r[rank])

    gcols = ["group", "messages", "bytes", "deliveries", "undeliverable"]
    tables["groups_by_messages"] = Table(
        f"Top {top} groups by messages", gcols,
        [[r[c] for c in gcols] for r in ranked("group", "rank_m")])
    tables["groups_by_bytes"] = Table(
        f"Top {top} groups by bytes", gcols,
        [[r[c] for c in gcols] for r in ranked("group", "rank_b")])
    # A sender's records forwarded by other brokers (proto "cluster") are not its messages.
    scols = ["lname", "proto", "user", "messages", "bytes", "deliveries"]
    tables["top_senders"] = Table(
        f"Top {top} senders by messages", scols,
        [[r[c] for c in scols] for r in ranked("sender", "rank_m")
         if r["proto"] != CLUSTER_PROTO])
    fan = {r["copies"]: r["messages"] for r in sets["copies"] if r["copies"] is not None}
    tables["fanout"] = Table("Fan-out: copies delivered per message",
                             ["copies", "messages"], fanout_buckets(fan))
    sent = {r["proto"]: r for r in sets["proto"] if r["proto"] != CLUSTER_PROTO}
    mix = []
    for proto in sorted(set(sent) | set(received)):
        s, rc = sent.get(proto), received.get(proto)
        mix.append([proto, s["messages"] if s else 0, s["bytes"] if s else 0,
                    s["undeliverable"] if s else 0, rc[0] if rc else 0, rc[1] if rc else 0])
    tables["protocols"] = Table(
        "Protocol mix (sent by clients of the protocol / delivered to them)",
        ["protocol", "messages_in", "bytes_in", "undeliverable", "deliveries_out",
         "bytes_out"], mix)
    mcols = ["minute", "messages", "bytes", "deliveries", "undeliverable"]
    tables["per_minute"] = Table("Traffic per minute (UTC)", mcols,
                                 [[_minute(r["minute"])] + [r[c] for c in mcols[1:]]
                                  for r in minutes])
    ucols = ["group", "undeliverable", "messages", "rate"]
    tables["undeliverable"] = Table(
        f"Top {top} groups by undeliverable messages", ucols,
        [[r["group"], r["undeliverable"], r["messages"], r["undeliverable"] / r["messages"]]
         for r in ranked("group", "rank_u") if r["undeliverable"] > 0])
    where = log_dir if isinstance(log_dir, str) else ", ".join(log_dir)
    return Report(log_dir=where, totals=totals, tables=tables, notes=notes)


def run(spark: SparkSession, log_dir: str | list[str], out_dir: str, *,
        top: int = DEFAULT_TOP, quiet: bool = False,
        progress: Callable[[str], None] = _silent,
        inventory: logfiles.Inventory | None = None) -> Report:
    """Compute the report, print it (unless ``quiet``), write PNGs, HTML and JSON."""
    from analytics import render

    report = compute(spark, log_dir, top, progress, inventory)
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
