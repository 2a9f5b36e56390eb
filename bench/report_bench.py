"""Benchmark: ``skan-analytics report`` over millions of records, JSONL vs Parquet, beside DuckDB.

    python -m bench.report_bench                        # 5,400,000 records, 2 rounds
    python -m bench.report_bench --records 1000000 --rounds 1
    python -m bench.report_bench --baseline none        # skip today's code
    python -m bench.report_bench --keep /tmp/rb          # keep the logs and reports

Traffic of issue 26 (bench/routelog_gen.py: 20 publishers over 50 groups, 8
subscribers, 100-byte payloads, ~88,000 msgs/s), the same records written as
JSON Lines (the broker's format, 64 MiB files) and as Parquet (the writer
contract: zstd, one file per 60 s).  Each round runs, interleaved (the
machine is shared: figures are noisy):

- ``skan-analytics report`` of the baseline code (``--baseline``, default the
  commit before this work: today's code path) on the JSONL files,
- ``skan-analytics report`` of this checkout on the Parquet files,
- the same on the JSONL files,
- DuckDB running the report's aggregations over the JSONL files and over
  the Parquet files (the reference a user compares with).

Each report is the real console command in a fresh process (JVM start
included: "report" column; the job alone, as the command's summary line
says: "job" column).  Every report's totals and per-group messages must
equal the generator's own counts, or the run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import duckdb

from bench import routelog_gen

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Today's code: the commit this work started from (analytics before Parquet).
DEFAULT_BASELINE = "70cdd7e"
TOTALS = ("messages", "bytes", "deliveries", "undeliverable", "groups", "senders")
DUCK_COLUMNS = (
    "{'time_us':'BIGINT','server':'BIGINT','lname':'VARCHAR','proto':'VARCHAR',"
    "'user':'VARCHAR','group':'VARCHAR','instance':'VARCHAR','to':'VARCHAR','seq':'VARCHAR',"
    "'size':'BIGINT','recipients':'MAP(VARCHAR, BIGINT)','delivered':'BIGINT',"
    "'undeliverable':'BOOLEAN'}"
)
# The report's views as DuckDB SQL over a view ``log`` (one broker: copies = delivered).
DUCK_QUERIES = (
    "SELECT count(*), sum(size), sum(delivered), sum(undeliverable::INT), "
    "count(DISTINCT \"group\"), count(DISTINCT lname), min(time_us), max(time_us) FROM log",
    "SELECT \"group\", count(*) m, sum(size) b, sum(delivered), sum(undeliverable::INT) "
    "FROM log GROUP BY 1 ORDER BY m DESC LIMIT 10",
    "SELECT \"group\", count(*) m, sum(size) b, sum(delivered), sum(undeliverable::INT) "
    "FROM log GROUP BY 1 ORDER BY b DESC LIMIT 10",
    "SELECT lname, proto, \"user\", count(*) m, sum(size), sum(delivered) FROM log "
    "GROUP BY ALL ORDER BY m DESC LIMIT 10",
    "SELECT delivered, count(*) FROM log GROUP BY 1",
    "SELECT proto, count(*), sum(size), sum(undeliverable::INT) FROM log GROUP BY 1",
    "SELECT k, sum(c), sum(c * size) FROM (SELECT unnest(map_keys(recipients)) k, "
    "unnest(map_values(recipients)) c, size FROM log) GROUP BY 1",
    "SELECT time_us // 60000000 m, count(*), sum(size), sum(delivered), "
    "sum(undeliverable::INT) FROM log GROUP BY 1 ORDER BY 1",
    "SELECT \"group\", sum(undeliverable::INT) u, count(*) FROM log GROUP BY 1 "
    "HAVING u > 0 ORDER BY u DESC LIMIT 10",
)


def baseline_tree(ref: str, into: pathlib.Path) -> pathlib.Path:
    """The project's packages at git ``ref``, extracted into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "analytics", "broker", "clients", "wire"],
        check=True, capture_output=True).stdout
    tar = into / "tree.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    tar.unlink()
    return into


def run_report(code: pathlib.Path, log_dir: pathlib.Path, out: pathlib.Path
               ) -> tuple[float, float | None, dict]:
    """``skan-analytics report`` of the code at ``code``: (wall s, job s, report.json)."""
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{ROOT}",
           "SPARK_LOCAL_IP": "127.0.0.1"}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "analytics.cli", "report", "--log-dir", str(log_dir),
         "--out", str(out)],
        env=env, cwd=str(out.parent), capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"report failed ({code}):\n{proc.stderr[-3000:]}")
    job = re.search(r"charts; ([0-9.]+)s;", proc.stderr)
    return wall, float(job.group(1)) if job else None, json.loads(
        (out / "report.json").read_text())


def check(result: dict, expected: dict, what: str) -> None:
    totals = result["totals"]
    wrong = {k: (totals[k], expected[k]) for k in TOTALS if totals[k] != expected[k]}
    top = result["tables"]["groups_by_messages"]["rows"]
    wrong.update({g: (m, expected["per_group"][g]) for g, m, *_ in top
                  if m != expected["per_group"][g]})
    if wrong:
        raise SystemExit(f"{what}: totals differ from the generated counts: {wrong}")


def run_duckdb(files: str, fmt: str) -> float:
    con = duckdb.connect()
    source = (f"read_parquet('{files}')" if fmt == "parquet" else
              f"read_json('{files}', format='newline_delimited', columns={DUCK_COLUMNS})")
    con.execute(f"CREATE VIEW log AS SELECT * FROM {source}")
    started = time.perf_counter()
    for q in DUCK_QUERIES:
        con.execute(q).fetchall()
    elapsed = time.perf_counter() - started
    con.close()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=5_400_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--baseline", default=DEFAULT_BASELINE,
                   help="git ref of today's code for the JSONL baseline ('none': skip)")
    p.add_argument("--keep", help="write the logs and reports here and keep them")
    args = p.parse_args()
    work = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="skan-report-bench-"))
    try:
        bench(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def bench(args: argparse.Namespace, work: pathlib.Path) -> None:
    logs = work / "log"
    if logs.exists():
        shutil.rmtree(logs)
    t0 = time.perf_counter()
    sizes = routelog_gen.generate(str(logs), args.records)
    expected = routelog_gen.expected(args.records)
    print(f"generated {args.records:,} records in {time.perf_counter() - t0:.1f} s: "
          f"JSONL {sizes['jsonl'] / 1e6:,.0f} MB, Parquet {sizes['parquet'] / 1e6:,.1f} MB",
          flush=True)
    baseline = None
    if args.baseline != "none":
        baseline = baseline_tree(args.baseline, work / "baseline")
    runs: list[tuple[str, str, pathlib.Path]] = []
    if baseline is not None:
        runs.append((f"JSONL, today's code ({args.baseline})", "jsonl", baseline))
    runs += [("Parquet, this code", "parquet", ROOT), ("JSONL, this code", "jsonl", ROOT)]
    times: dict[str, list[tuple[float, float | None]]] = {name: [] for name, _, _ in runs}
    duck: dict[str, list[float]] = {"jsonl": [], "parquet": []}
    for r in range(args.rounds):
        for name, fmt, code in runs:
            out = work / f"report-{r}-{fmt}-{len(times[name])}-{code.name}"
            wall, job, result = run_report(code, logs / fmt, out)
            check(result, expected, name)
            times[name].append((wall, job))
            print(f"round {r + 1}: {name}: report {wall:.1f} s (job {job} s), totals equal",
                  flush=True)
            shutil.rmtree(out)
        for fmt in ("jsonl", "parquet"):
            duck[fmt].append(run_duckdb(str(logs / fmt / f"routelog-*.{fmt}"), fmt))
            print(f"round {r + 1}: DuckDB {fmt}: {duck[fmt][-1]:.1f} s", flush=True)
    n = args.records
    print(f"\n{n:,} records, {args.rounds} round(s), medians; load average "
          f"{os.getloadavg()[0]:.1f}")
    head = (f"{'format, code':<34} {'bytes/rec':>9} {'report s':>9} {'job s':>7} "
            f"{'records/s':>10} {'DuckDB s':>9}")
    print(head)
    print("-" * len(head))
    rates = {}
    for name, fmt, _ in runs:
        wall = statistics.median(t[0] for t in times[name])
        jobs = [t[1] for t in times[name] if t[1] is not None]
        job = f"{statistics.median(jobs):.1f}" if jobs else "-"
        rates[name] = n / wall
        print(f"{name:<34} {sizes[fmt] / n:>9.1f} {wall:>9.1f} {job:>7} {n / wall:>10,.0f} "
              f"{statistics.median(duck[fmt]):>9.1f}")
    if baseline is not None:
        base = rates[runs[0][0]]
        for name, _, _ in runs[1:]:
            print(f"{name}: {rates[name] / base:.1f}x today's records/s")


if __name__ == "__main__":
    main()
