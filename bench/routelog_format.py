"""The routing log's formats side by side: bytes per record, routing-thread and writer CPU.

    python -m bench.routelog_format [--records 1000000]

Traffic of issue 26 built in process through the real router: 20
publishers over 50 groups, 8 subscribers on every group, 100-byte
payloads, seqs counting per publisher, routing batches of 16.  For each
format: the observer's CPU per record (on the routing thread: the compiled
line formatting, or the compiled column append), the writer's CPU per
record (JSON Lines: join and encode; Parquet: Arrow arrays of the buffers
and zstd row groups of :data:`ROW_GROUP_ROWS`), and the bytes per record
of the finished file (a real :class:`RoutingLog` writing to a temporary
directory; the file is read back and counted).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from broker.core.router import NORMAL, Endpoint, Router
from broker.observability.routelog.columns import ColumnBuffer
from broker.observability.routelog.files import LogDirectory
from broker.observability.routelog.parquet import ROW_GROUP_ROWS
from broker.observability.routelog.record import RecordBuffer
from broker.observability.routelog.writer import RoutingLog
from wire.skan import decode_header, encode_frame


class Sink(Endpoint):
    protocol = "skan"

    def deliver(self, frame, routed):
        pass


def traffic(n: int, batch: int = 16) -> list[list]:
    router = Router(hostname="bench")
    pubs = [Sink() for _ in range(20)]
    subs = [Sink() for _ in range(8)]
    for ep in pubs + subs:
        router.attach(ep)
    for g in range(50):
        for s in subs:
            router.subscribe(s, f"g{g}".encode(), b"*", NORMAL)
    seqs = [0] * 20
    batches, current = [], []
    for i in range(n):
        p = (i * 7) % 20
        g = (i * 13) % 50
        seqs[p] += 1
        frame = encode_frame({"type": "send", "from": pubs[p].lname, "to": "*",
                              "group": f"g{g}", "instance": "*", "seq": str(seqs[p]),
                              "msg": b"x" * 100})
        current.append(router.route(pubs[p], frame, decode_header(frame, 4)))
        if len(current) == batch:
            batches.append(current)
            current = []
    if current:
        batches.append(current)
    return batches


def measure(fmt: str, batches: list[list], n: int) -> tuple[float, float, float]:
    work = tempfile.mkdtemp(prefix="skan-logfmt-")
    d = LogDirectory(work, 1)
    d.open()
    rl = RoutingLog(d, rotate_bytes=1 << 40, rotate_seconds=1e9, queue_records=1 << 30,
                    format=fmt)
    kind = ColumnBuffer if fmt == "parquet" else RecordBuffer
    taken = []
    buf = kind(4096, lambda: taken.append(buf.take()))
    c0 = time.process_time()
    for b in batches:
        buf.observe(b)
    if buf.pending():
        taken.append(buf.take())
    observe_cpu = time.process_time() - c0
    # The writer's work, in this thread: what its thread does per hand-off.
    c0 = time.process_time()
    for t in taken:
        if fmt == "parquet":
            rl._take_rows(t)
        else:
            rl._write(t)
    rl._finish()
    writer_cpu = time.process_time() - c0
    size = sum(os.path.getsize(os.path.join(work, f)) for f in os.listdir(work)
               if f.startswith("routelog-"))
    d.close()
    return observe_cpu / n * 1e6, writer_cpu / n * 1e6, size / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    args = ap.parse_args()
    batches = traffic(args.records)
    print(f"{args.records:,} records (20 publishers, 50 groups, 8 subscribers, 100-byte "
          f"payloads); Parquet row groups of {ROW_GROUP_ROWS:,}")
    print("| format | bytes/record | observer CPU us/record (routing thread) | "
          "writer CPU us/record |")
    print("|---|---|---|---|")
    for fmt in ("parquet", "jsonl"):
        obs, wr, size = measure(fmt, batches, args.records)
        print(f"| {fmt} | {size:.2f} | {obs:.2f} | {wr:.2f} |")


if __name__ == "__main__":
    main()
