"""Benchmark: ``skan-analytics report`` over 1,000,000 routing-log records (target < 60 s).

    python -m bench.report_bench                    # 1,000,000 records, temp dir
    python -m bench.report_bench --records 200000 --keep /tmp/rl

The records are made by the broker's own code: a real router with endpoints
of every protocol routes synthetic traffic (a few hundred groups, Zipf-like
popularity, fan-out 0..50, some directed and undeliverable messages) over a
simulated hour, the routing log's RecordBuffer formats it, and the log files
are written with the log's own file layer (64 MiB rotation).  Then the report
runs in a fresh local[*] Spark session, timed end to end (session start-up
included) and with the JVM already up.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import shutil
import tempfile
import time

from analytics import report
from analytics.session import build_session
from broker.core.router import MEONLY, NORMAL, PROMISC, Endpoint, Routed, Router
from broker.observability.routelog.files import LogDirectory
from broker.observability.routelog.record import RecordBuffer
from wire.skan import decode_header, encode_frame

PROTOCOLS = ("skan", "hsp", "eventer", "mariner")
ROTATE_BYTES = 64 << 20


class Client(Endpoint):
    def __init__(self, protocol: str) -> None:
        super().__init__()
        self.protocol = protocol

    def deliver(self, frame: bytes, routed: Routed) -> None:
        pass


class Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def generate(log_dir: str, records: int, *, seconds: float = 3600.0, seed: int = 7) -> int:
    """Write ``records`` routing-log records into ``log_dir``; returns bytes written."""
    rnd = random.Random(seed)
    clock = Clock(1_750_000_000.0)
    router = Router(hostname="bench", clock=clock)
    clients = [Client(rnd.choice(PROTOCOLS)) for _ in range(300)]
    for c in clients:
        router.attach(c)
    groups = [f"group-{i:03d}".encode() for i in range(400)]
    for g in groups:
        for c in rnd.sample(clients, min(len(clients), int(rnd.paretovariate(1.2)) % 50)):
            router.subscribe(c, g, b"*", rnd.choice((NORMAL, NORMAL, NORMAL, MEONLY, PROMISC)))
    senders = clients[:120]
    weights = [1.0 / (i + 1) for i in range(len(groups))]  # Zipf-like group popularity
    frames: dict[tuple[bytes, bytes, int], tuple[bytes, dict]] = {}
    directory = LogDirectory(log_dir, 1)
    directory.open()
    written = 0
    current = directory.new_file()

    def flush() -> None:
        nonlocal current, written
        data = "".join(buf.take()).encode()
        if current.size and current.size + len(data) > ROTATE_BYTES:
            current.finish()
            current = directory.new_file()
        current.write(data)
        written += len(data)

    buf = RecordBuffer(4096, flush)
    router.observers.append(buf.observe)
    step = seconds / records
    picks = rnd.choices(range(len(groups)), weights, k=records)
    sender_picks = rnd.choices(range(len(senders)), [1.0 / (i + 3) for i in range(len(senders))],
                               k=records)
    for i in range(records):
        clock.now += step
        sender = senders[sender_picks[i]]
        group = groups[picks[i]]
        to = b"*" if i % 17 else clients[(i * 7) % len(clients)].lname
        size = 40 + (i % 5) * 60
        key = (sender.lname, group + b"\0" + to, size)
        cached = frames.get(key)
        if cached is None:
            frame = encode_frame({"type": "send", "from": sender.lname, "to": to, "group": group,
                                  "instance": b"*", "seq": b"1", "msg": b"x" * size})
            cached = frames[key] = (frame, decode_header(frame, 4))
        frame, header = cached
        header = {**header, b"seq": str(i).encode()}
        router.route(sender, frame, header)
        router.end_batch()
    flush()
    current.finish()
    directory.close()
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--keep", help="write the logs and report here and keep them")
    args = p.parse_args()
    work = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="skan-report-bench-"))
    log_dir = work / "log"
    if log_dir.exists():
        shutil.rmtree(log_dir)
    t0 = time.perf_counter()
    size = generate(str(log_dir), args.records)
    t1 = time.perf_counter()
    print(f"generated {args.records:,} records ({size / 1e6:.0f} MB) in {t1 - t0:.1f} s")
    t2 = time.perf_counter()
    spark = build_session("skan-report-bench")
    result = report.run(spark, str(log_dir), str(work / "report"), quiet=True)
    t3 = time.perf_counter()
    assert result.totals["messages"] == args.records, result.totals
    print(f"report (incl. Spark start-up): {t3 - t2:.1f} s  -> {work / 'report'}")
    t4 = time.perf_counter()
    report.run(spark, str(log_dir), str(work / "report2"), quiet=True)
    t5 = time.perf_counter()
    print(f"report (JVM already up):       {t5 - t4:.1f} s")
    spark.stop()
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
