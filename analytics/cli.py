"""skan-analytics: the stream and report jobs over a routing-log directory.

    skan-analytics report --out report/            # the broker's default log directory
    skan-analytics report --log-dir /var/lib/skan/routing-log --out report/
    skan-analytics report --log-dir broker1/log --log-dir broker2/log --out report/
    skan-analytics stream --checkpoint ckpt/ --output traffic/ --once
    spark-submit --master spark://host:7077 analytics/cli.py report --log-dir ...

Default master local[*]; --master picks another; under spark-submit the
master (and every other setting) comes from spark-submit unless --master is
given here too.  --conf key=value passes Spark settings.  Progress and a
summary go to stderr; Spark's own logging is errors only unless --verbose.
See docs/analytics.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):
    # Run as a file (``spark-submit .../analytics/cli.py``): make the
    # project importable from its checkout.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from analytics import logfiles
from toolkit import cliutil

PROG = "skan-analytics"
# The broker's default [log] dir (broker/serving/config.py LogSection.dir); analytics
# imports nothing of the broker, tests/architecture/test_imports.py keeps the two equal.
DEFAULT_LOG_DIR = "var/routing-log"
DEFAULT_OUT = "skan-report"
LOG_FILES = " or ".join(logfiles.LOG_GLOBS)


def _conf(values: list[str]) -> dict[str, str]:
    conf = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--conf {item!r}: expected key=value")
        conf[key] = value
    return conf


def build_parser() -> cliutil.Parser:
    # Imported here so that --help and --version answer without starting Python's Spark bits.
    from analytics import report, stream

    p = cliutil.Parser(prog=PROG, description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-dir", action="append", metavar="DIR",
                        help="routing-log directory (any path Spark reads: file, hdfs://, "
                             "s3a://; a glob such as 'logs/w*'); repeat it for the brokers of "
                             "a cluster: each message counts once; the broker's "
                             f"(default: {DEFAULT_LOG_DIR})")
    common.add_argument("--master", help="Spark master (default local[*], or spark-submit's)")
    common.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="Spark setting, repeatable")
    common.add_argument("--verbose", action="store_true",
                        help="show Spark's own warnings and progress bar")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("stream", parents=[common],
                       help="windowed traffic to Parquet, exactly once")
    s.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="checkpoint directory (keep it: restarts resume from it without "
                        "re-counting)")
    s.add_argument("--output", required=True, metavar="DIR", help="Parquet output directory")
    s.add_argument("--once", action="store_true",
                   help="process the files present now and exit (availableNow trigger)")
    s.add_argument("--window", default=stream.DEFAULT_WINDOW, help="window length")
    # Accepted for old command lines: the job no longer holds windows back.
    s.add_argument("--watermark", help=argparse.SUPPRESS)
    s.add_argument("--trigger", default=stream.DEFAULT_TRIGGER,
                   help="micro-batch interval when not --once")
    s.add_argument("--max-files-per-trigger", type=cliutil.positive_int,
                   help="bound each micro-batch")

    r = sub.add_parser("report", parents=[common], help="tables, PNG charts and an HTML report")
    r.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help="output directory")
    r.add_argument("--top", type=cliutil.positive_int, default=report.DEFAULT_TOP,
                   help="rows in top-N tables")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.log_dir = args.log_dir or [DEFAULT_LOG_DIR]
    try:
        args.conf = _conf(args.conf)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    return args


# ---- up-front checks: one line and exit 1 before Spark starts ---------------------------


_local = logfiles.local_path


def check_log_dir(path: str, *, need_files: bool) -> int:
    """Number of complete log files (-1 for a remote path, not checked)."""
    local = _local(path)
    if local is None:
        return -1
    if not os.path.exists(local):
        raise cliutil.UserError(f"--log-dir {path}: no such directory (is the broker's "
                                "[log] dir elsewhere?)")
    if not os.path.isdir(local):
        raise cliutil.UserError(f"--log-dir {path}: not a directory")
    if not os.access(local, os.R_OK | os.X_OK):
        raise cliutil.UserError(f"--log-dir {path}: not readable")
    files = logfiles.scan([local], open_records=False).total
    if need_files and not files:
        raise cliutil.UserError(f"--log-dir {path}: no routing-log files ({LOG_FILES}) yet; "
                                "files appear once the broker rotates or stops")
    return files


def check_output_dir(flag: str, path: str) -> None:
    """``path`` must be a directory this process can create and write."""
    local = _local(path)
    if local is None:
        return
    try:
        os.makedirs(local, exist_ok=True)
    except OSError as exc:
        raise cliutil.UserError(f"{flag} {path}: cannot create: "
                                f"{cliutil.describe_os_error(exc)}") from None
    if not os.path.isdir(local):
        raise cliutil.UserError(f"{flag} {path}: not a directory")
    if not os.access(local, os.W_OK | os.X_OK):
        raise cliutil.UserError(f"{flag} {path}: not writable")


def check_log_dirs(paths: list[str], *, need_files: bool) -> int:
    """``check_log_dir`` for each --log-dir (a local glob: each directory it matches)."""
    import glob

    total, remote = 0, False
    for path in paths:
        local = _local(path)
        matched = [path]
        if local is not None and glob.has_magic(local):
            matched = sorted(glob.glob(local))
            if not matched:
                raise cliutil.UserError(f"--log-dir {path}: matches no directory")
        for one in matched:
            files = check_log_dir(one, need_files=need_files and len(paths) == 1
                                  and len(matched) == 1)
            remote = remote or files < 0
            total += max(files, 0)
    if need_files and not remote and not total:
        raise cliutil.UserError(f"--log-dir {', '.join(paths)}: no routing-log files "
                                f"({LOG_FILES}) yet; files appear once the broker rotates or "
                                "stops")
    return -1 if remote else total


def check_paths(args: argparse.Namespace) -> int:
    if args.command == "report":
        files = check_log_dirs(args.log_dir, need_files=True)
        check_output_dir("--out", args.out)
    else:
        files = check_log_dirs(args.log_dir, need_files=False)
        check_output_dir("--checkpoint", args.checkpoint)
        check_output_dir("--output", args.output)
        from analytics import stream

        try:
            stream.check_layout(args.checkpoint, args.output)
        except stream.OldLayout as exc:
            raise cliutil.UserError(str(exc)) from None
    return files


def progress(line: str) -> None:
    cliutil.note(line)


# ---- jobs ---------------------------------------------------------------------------------


def _run_report(spark: Any, args: argparse.Namespace, files: int) -> None:
    from analytics import report

    dirs = ", ".join(args.log_dir)
    where = f"{files} file(s) in {dirs}" if files >= 0 else dirs
    progress(f"report: reading {where}")
    started = time.monotonic()
    result = report.run(spark, args.log_dir, args.out, top=args.top, progress=progress,
                        inventory=logfiles.scan(args.log_dir))
    t = result.totals
    progress(f"report: {t['messages']:,} messages, {t['groups']:,} groups, "
             f"{t['senders']:,} senders, {t['undeliverable']:,} undeliverable; "
             f"{len(result.charts)} charts; {time.monotonic() - started:.1f}s; "
             f"HTML: {result.html}")
    for line in result.notes:
        progress(f"report: note: {line}")


def _run_stream(spark: Any, args: argparse.Namespace, files: int) -> None:
    from analytics import stream

    where = f"{files} file(s) now" if files >= 0 else "remote"
    mode = "the files present now, then exit" if args.once else f"every {args.trigger}"
    progress(f"stream: {', '.join(args.log_dir)} ({where}) -> {args.output}, {mode}; checkpoint "
             f"{args.checkpoint}")
    if args.watermark is not None:
        progress("stream: --watermark is no longer used: every record is counted, none is "
                 "held back or dropped as late (see docs/analytics.md)")
    totals = stream.add_progress_listener(spark, progress)
    stream.run(spark, args.log_dir, args.checkpoint, args.output, totals, window=args.window,
               once=args.once, trigger=args.trigger,
               max_files_per_trigger=args.max_files_per_trigger)
    progress(f"stream: done, {totals.batches} micro-batch(es), {totals.rows:,} record(s) "
             "counted")


def main(argv: list[str] | None = None, spark: Any = None) -> int:
    """Run one job; ``spark``: an existing session to use (and leave running)."""
    args = parse_args(argv)
    try:
        files = check_paths(args)
    except cliutil.UserError as exc:
        return cliutil.report(PROG, exc)
    try:
        from pyspark.errors import PySparkException
    except ImportError:
        return cliutil.report(PROG, cliutil.UserError(
            "PySpark is not installed: pip install 'skan-broker[analytics]'"))

    def spark_error(exc: BaseException) -> str | None:
        if isinstance(exc, PySparkException):
            return cliutil.tidy_reason(str(exc).strip().splitlines()[0])
        if isinstance(exc, RuntimeError) and str(exc).startswith("query "):
            return cliutil.tidy_reason(str(exc).splitlines()[0])
        return None

    own = spark is None
    jvm_log = None
    ok = False
    try:
        if spark is None:
            from analytics.session import build_session

            progress(f"starting Spark ({args.master or 'local[*]'})")
            spark = build_session(f"skan-analytics-{args.command}", args.master, args.conf,
                                  verbose=args.verbose)
            jvm_log = getattr(spark, "skan_jvm_log", None)
            if jvm_log:
                progress(f"Spark's own log: {jvm_log} (--verbose shows it here)")
        if args.command == "stream":
            _run_stream(spark, args, files)
        else:
            _run_report(spark, args, files)
        ok = True
    except BaseException as exc:
        return cliutil.report(PROG, exc, errors=spark_error)
    finally:
        if own and spark is not None:
            spark.stop()
        if jvm_log:
            # Kept when the run failed (Spark's own account of it), removed otherwise.
            if ok:
                with contextlib.suppress(OSError):
                    os.unlink(jvm_log)
            else:
                progress(f"Spark's own log kept: {jvm_log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
