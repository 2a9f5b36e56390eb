"""skan-analytics as a user meets it: path checks before Spark, progress, summary, charts.

The path checks run the real console script and must answer in about a
second (before any JVM starts), in one line, exit 1.
"""

from __future__ import annotations

import datetime as dt

import pytest

from analytics import cli
from analytics.render import minute_series, sender_label
from broker.serving.config import LogSection
from tests.clients.scripts import run

# A JVM start takes several seconds: an answer faster than this came before Spark.
BEFORE_SPARK_SECONDS = 4.0


def test_default_log_dir_is_the_brokers():
    assert LogSection().dir == cli.DEFAULT_LOG_DIR
    assert cli.parse_args(["report"]).log_dir == [LogSection().dir]


@pytest.mark.parametrize(("args", "needle"), [
    (["report", "--log-dir", "/no/such/dir"], "--log-dir /no/such/dir: no such directory"),
    (["stream", "--log-dir", "/no/such/dir", "--checkpoint", "c", "--output", "o"],
     "no such directory"),
    (["report", "--log-dir", "{log}", "--out", "/proc/x"], "--out /proc/x: cannot create"),
    (["report", "--log-dir", "{empty}"], "no routing-log files"),
    (["report", "--log-dir", "{file}"], "not a directory"),
    (["stream", "--log-dir", "{log}", "--checkpoint", "/proc/x", "--output", "o"],
     "--checkpoint /proc/x: cannot create"),
])
def test_bad_paths_are_one_line_before_spark(tmp_path, args, needle):
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "routelog-1-20260101T000000.000000Z-000001.jsonl").write_text("{}\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    args = [a.format(log=tmp_path / "log", empty=tmp_path / "empty", file=tmp_path / "file")
            for a in args]
    result = run("skan-analytics", *args)
    assert result.returncode == 1
    line = result.one_line_error()
    assert line.startswith("skan-analytics: ") and needle in line, line
    assert result.seconds < BEFORE_SPARK_SECONDS
    assert "starting Spark" not in result.stderr


def test_minutes_without_traffic_are_zero():
    t0 = dt.datetime(2026, 1, 1, 12, 0)
    rows = [[t0, 5, 50, 5, 0], [t0 + dt.timedelta(minutes=3), 2, 20, 1, 1]]
    filled = minute_series(rows)
    assert [r[0].minute for r in filled] == [0, 1, 2, 3]
    assert [r[1] for r in filled] == [5, 0, 0, 2]
    assert minute_series([]) == []


def test_sender_label_keeps_the_protocol():
    label = sender_label("6b01ecd1_2@a-very-long-host-name.example.com", "mariner")
    assert label.startswith("mariner  6b01ecd1_2@")
    assert len(label) < 40
    assert sender_label("6b01_2@h", "skan", "sensor-7") == "skan  sensor-7  6b01_2@h"


@pytest.mark.spark
def test_report_progress_and_summary_on_stderr(spark, tmp_path, capsys):
    from tests.analytics.test_analytics import run_broker

    work = tmp_path / "b"
    work.mkdir()
    run_broker(work, [("skan", "alpha", 3), ("hsp", "beta", 1)], "tick")
    assert cli.main(["report", "--log-dir", str(work / "log"), "--out", str(tmp_path / "r")],
                    spark=spark) == 0
    err = capsys.readouterr().err
    assert "# report: reading 1 file(s)" in err or "# report: reading" in err
    assert "records read" in err and "HTML:" in err
    summary = [line for line in err.splitlines() if "charts;" in line]
    assert summary and "messages" in summary[0] and "groups" in summary[0]
    assert "Traceback" not in err


@pytest.mark.spark
def test_stream_reports_each_micro_batch(spark, tmp_path, capsys):
    from tests.analytics.test_analytics import run_broker

    work = tmp_path / "b"
    work.mkdir()
    run_broker(work, [("skan", "alpha", 2)], "tick")
    assert cli.main(["stream", "--log-dir", str(work / "log"), "--checkpoint",
                     str(tmp_path / "ck"), "--output", str(tmp_path / "out"), "--once"],
                    spark=spark) == 0
    err = capsys.readouterr().err
    assert "# stream:" in err and "batch 0:" in err and "row(s)" in err, err
    assert "stream: done" in err
