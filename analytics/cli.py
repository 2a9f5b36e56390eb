"""skan-analytics: the stream and report jobs over a routing-log directory.

    skan-analytics report --log-dir var/routing-log --out report/
    skan-analytics report --log-dir broker1/log --log-dir broker2/log --out report/
    skan-analytics stream --log-dir var/routing-log --checkpoint ckpt/ --output traffic/ --once
    spark-submit --master spark://host:7077 analytics/cli.py report --log-dir ...

Default master local[*]; --master picks another; under spark-submit the
master (and every other setting) comes from spark-submit unless --master is
given here too.  --conf key=value passes Spark settings.  See docs/analytics.md.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    # Run as a file (``spark-submit .../analytics/cli.py``): make the
    # project importable from its checkout.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from analytics import report, stream
from analytics.session import build_session


def _conf(values: list[str]) -> dict[str, str]:
    conf = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--conf {item!r}: expected key=value")
        conf[key] = value
    return conf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="skan-analytics", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-dir", required=True, action="append",
                        help="routing-log directory (any path Spark reads: file, hdfs://, "
                        "s3a://; a glob such as 'logs/w*'); repeat it for the brokers of a "
                        "cluster: each message counts once")
    common.add_argument("--master", help="Spark master (default local[*], or spark-submit's)")
    common.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="Spark setting, repeatable")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("stream", parents=[common], help="windowed traffic to Parquet, exactly once")
    s.add_argument("--checkpoint", required=True, help="checkpoint directory (keep it: restarts "
                   "resume from it without re-counting)")
    s.add_argument("--output", required=True, help="Parquet output directory")
    s.add_argument("--once", action="store_true",
                   help="process the files present now and exit (availableNow trigger)")
    s.add_argument("--window", default=stream.DEFAULT_WINDOW, help="window length (default "
                   f"{stream.DEFAULT_WINDOW!r})")
    s.add_argument("--watermark", default=stream.DEFAULT_WATERMARK,
                   help=f"allowed lateness (default {stream.DEFAULT_WATERMARK!r})")
    s.add_argument("--trigger", default=stream.DEFAULT_TRIGGER,
                   help="micro-batch interval when not --once "
                   f"(default {stream.DEFAULT_TRIGGER!r})")
    s.add_argument("--max-files-per-trigger", type=int, help="bound each micro-batch")

    r = sub.add_parser("report", parents=[common], help="tables, PNG charts and an HTML report")
    r.add_argument("--out", default="skan-report", help="output directory (default skan-report)")
    r.add_argument("--top", type=int, default=report.DEFAULT_TOP, help="rows in top-N tables")
    args = p.parse_args(argv)
    try:
        args.conf = _conf(args.conf)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None, spark: SparkSession | None = None) -> int:
    """Run one job; ``spark``: an existing session to use (and leave running)."""
    args = parse_args(argv)
    own = spark is None
    if spark is None:
        spark = build_session(f"skan-analytics-{args.command}", args.master, args.conf)
    try:
        if args.command == "stream":
            stream.run(spark, args.log_dir, args.checkpoint, args.output, window=args.window,
                       watermark=args.watermark, once=args.once, trigger=args.trigger,
                       max_files_per_trigger=args.max_files_per_trigger)
        else:
            report.run(spark, args.log_dir, args.out, top=args.top)
    except PySparkException as exc:
        print(f"skan-analytics: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if own:
            spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
