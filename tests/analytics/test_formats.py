"""skan-analytics over the routing log's formats: Parquet (the writer contract) and JSON
Lines, mixed in one directory, with files still being written; the charts of a small
report; several brokers; the stream job counting every record.

The log files are written here (tests/analytics/routelog.py), in exactly the
contract's schema: no broker needed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess

import numpy as np
import pytest
from pyspark.sql import functions as F

from analytics import cli, logfiles, render, report, stream
from tests.analytics.routelog import record, write_jsonl, write_parquet
from tests.clients.scripts import ENV, script

# 2026-09-21 14:13:20 UTC: twenty seconds into a minute, so the first minute is partial.
T0 = 1_790_000_000_000_000


def small_log(directory) -> dict[str, int]:
    """6,295 messages to alpha (2 Skan + 1 HSP subscribers) over about 95 s, 3 to void
    (none), across a Parquet and a JSONL file; plus an open JSONL file (5 complete
    lines and a torn one) and an open Parquet file.  Returns the expected totals."""
    recs = [record(T0 + i * 15_000, "alpha", recipients={"skan": 2, "hsp": 1}, seq=str(i))
            for i in range(6295)]
    recs += [record(T0 + i * 1_000_000, "void", proto="hsp", lname="cd_2@host", user="svc")
             for i in range(3)]
    write_parquet(directory, recs[:4000], counter=1)
    write_jsonl(directory, recs[4000:], counter=2)
    late = [record(T0 + 200_000_000, "alpha", recipients={"skan": 1})] * 5
    write_jsonl(directory, late, counter=3, hidden=True, torn_tail='{"time_us":1')
    write_parquet(directory, late, counter=4, hidden=True)
    return {"messages": 6298, "bytes": 629_800, "deliveries": 6295 * 3, "undeliverable": 3,
            "groups": 2, "senders": 2}


def tick_labels(axis) -> list[str]:
    axis.figure.canvas.draw()
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text()]


@pytest.mark.spark
def test_report_reads_parquet_and_jsonl_and_says_what_it_left_out(spark, tmp_path):
    want = small_log(tmp_path / "log")
    inv = logfiles.scan([str(tmp_path / "log")])
    assert inv.files == {"parquet": 1, "jsonl": 1} and inv.single_broker()
    assert sorted((f.fmt, f.records) for f in inv.open_files) == [("jsonl", 5), ("parquet", None)]
    result = report.run(spark, str(tmp_path / "log"), str(tmp_path / "r"), quiet=True,
                        inventory=inv)
    assert {k: result.totals[k] for k in want} == want
    mix = {r[0]: r[1:] for r in result.tables["protocols"].rows}
    assert mix == {"skan": [6295, 629_500, 0, 12_590, 1_259_000],
                   "hsp": [3, 300, 3, 6295, 629_500]}
    assert dict(result.tables["fanout"].rows)["3-5"] == 6295
    [note] = result.notes
    assert "5 record(s)" in note and "1 Parquet file(s)" in note and "still being written" in note
    assert json.loads((tmp_path / "r" / "report.json").read_text())["notes"] == [note]
    page = (tmp_path / "r" / "report.html").read_text()
    assert 'class="note"' in page and "still being written" in page
    # Responsive page: the phone's width, views in columns as wide as the screen allows.
    assert '<meta name="viewport" content="width=device-width' in page
    assert "grid-template-columns: repeat(auto-fill" in page

    # The charts of this small report read right.
    figs = render.figures(result)
    undeliv = figs["undeliverable"].axes[0]
    labels = tick_labels(undeliv.xaxis)
    assert labels == sorted(set(labels), key=lambda s: int(s.replace(",", "")))  # no 0 0 1 1
    assert all(s.replace(",", "").isdigit() for s in labels), labels
    mix_ax = figs["protocols"].axes[0]
    ticks = tick_labels(mix_ax.yaxis)
    assert len(ticks) == len(set(ticks)) and all("," in t or len(t) <= 3 for t in ticks), ticks
    values = {t.get_text() for t in mix_ax.texts}
    assert {"6,295", "12,590", "3"} <= values, values
    # The legend is outside the plot area: no bar under it.
    fig = figs["protocols"]
    fig.canvas.draw()
    legend = mix_ax.get_legend().get_window_extent()
    assert legend.x0 >= mix_ax.get_window_extent().x1
    groups_ax = figs["groups_by_messages"].axes[0]
    assert "6,295" in {t.get_text() for t in groups_ax.texts}
    minute_ax = figs["per_minute"].axes[0]
    assert minute_ax.get_xlabel().startswith("time (UTC)")
    assert minute_ax.get_ylabel() == "per minute"
    assert "partial minute" in [t.get_text() for t in minute_ax.get_legend().get_texts()]
    assert all(":" in t for t in tick_labels(minute_ax.xaxis))  # HH:MM, not bare seconds


def test_value_labels_and_ticks_have_separators():
    # matplotlib hands numpy numbers to the formatter.
    assert render._number(np.int64(470378)) == "470,378"
    assert render._number(np.float64(1234.0)) == "1,234"
    assert render._number(2.5) == "2.50" and render._number(7) == "7"


def test_partial_minutes():
    m = dt.datetime(2026, 1, 1, 12, 0)
    rows = [[m], [m + dt.timedelta(minutes=1)], [m + dt.timedelta(minutes=2)]]
    s = dt.timedelta(seconds=1)
    assert render.partial_minutes(rows, m + 20 * s, m + 150 * s) == (True, True)
    assert render.partial_minutes(rows, m, m + 179.9 * s) == (False, False)


@pytest.mark.spark
def test_several_brokers_count_each_message_once(spark, tmp_path):
    # Broker 1 routed the messages (2 local copies each); broker 2 received
    # them from the backplane ("cluster") and delivered 1 copy each.
    msgs = [record(T0 + i, "g", recipients={"skan": 2}, seq=str(i)) for i in range(10)]
    forwarded = [{**r, "server": 2, "proto": "cluster", "recipients": {"hsp": 1},
                  "delivered": 1, "undeliverable": False} for r in msgs]
    lonely = record(T0 + 99, "g", seq="99")  # nobody anywhere
    # A recipient protocol the report does not know by name: counted all the same.
    odd = record(T0 + 200, "g", seq="200", recipients={"mqtt": 2})
    write_parquet(tmp_path / "b1", [*msgs, lonely, odd])
    write_jsonl(tmp_path / "b2", forwarded)
    dirs = [str(tmp_path / "b1"), str(tmp_path / "b2")]
    inv = logfiles.scan(dirs)
    assert inv.servers == {1, 2} and not inv.single_broker()
    result = report.compute(spark, dirs, inventory=inv)
    t = result.totals
    assert (t["messages"], t["deliveries"], t["undeliverable"]) == (12, 32, 1)
    assert dict(result.tables["fanout"].rows)["3-5"] == 10
    mix = {r[0]: r[4] for r in result.tables["protocols"].rows}
    assert mix == {"skan": 20, "hsp": 10, "mqtt": 2}
    assert [r[0] for r in result.tables["top_senders"].rows] == ["ab_1@host"]


def stream_totals(spark, out: str) -> dict[str, int]:
    df = spark.read.parquet(os.path.join(out, "by_group"))
    return {r["group"]: r["messages"] for r in
            df.groupBy("group").agg(F.sum("messages").alias("messages")).collect()}


@pytest.mark.spark
def test_stream_once_counts_every_record_and_prints_its_summary_last(spark, tmp_path, capsys):
    log = tmp_path / "log"
    write_parquet(log, [record(T0 + i * 1_000_000, "a") for i in range(30)], counter=1)
    write_jsonl(log, [record(T0 + 40_000_000, "b")], counter=2)
    args = ["stream", "--log-dir", str(log), "--checkpoint", str(tmp_path / "ck"),
            "--output", str(tmp_path / "out"), "--once"]
    assert cli.main(args, spark=spark) == 0
    # The default one-minute windows: every record, the newest window's too.
    assert stream_totals(spark, str(tmp_path / "out")) == {"a": 30, "b": 1}
    err = capsys.readouterr().err.splitlines()
    batches = [i for i, line in enumerate(err) if " batch " in line]
    done = [i for i, line in enumerate(err) if "stream: done" in line]
    assert batches and done and max(batches) < done[0], err
    assert "31 record(s) counted" in err[done[0]]
    # A later file (a record for a window already written): counted once, added.
    write_parquet(log, [record(T0 + 41_000_000, "b")], counter=3)
    assert cli.main(args, spark=spark) == 0
    assert stream_totals(spark, str(tmp_path / "out")) == {"a": 30, "b": 2}
    assert cli.main(args, spark=spark) == 0  # nothing new: nothing changes
    assert stream_totals(spark, str(tmp_path / "out")) == {"a": 30, "b": 2}


def test_stream_refuses_the_old_stateful_layout(tmp_path):
    (tmp_path / "ck" / "by_group" / "offsets").mkdir(parents=True)
    (tmp_path / "log").mkdir()
    with pytest.raises(stream.OldLayout, match="earlier skan-analytics"):
        stream.check_layout(str(tmp_path / "ck"), str(tmp_path / "out"))


@pytest.mark.spark
def test_the_command_leaves_no_spark_log_and_prints_the_note(tmp_path):
    small_log(tmp_path / "log")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run(
        [*script("skan-analytics"), "report", "--log-dir", str(tmp_path / "log"),
         "--out", str(tmp_path / "r"), "--master", "local[1]",
         "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.shuffle.partitions=1"],
        env={**ENV, "TMPDIR": str(scratch), "SPARK_LOCAL_IP": "127.0.0.1"},
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Spark's own log: " + str(scratch) in proc.stderr
    assert not list(scratch.glob("skan-analytics-spark-*.log"))
    assert "# report: note: Not included: 5 record(s)" in proc.stderr
    assert "Note: Not included" in proc.stdout
