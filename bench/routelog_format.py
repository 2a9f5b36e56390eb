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

``--flood SECONDS``: a real broker with the default configuration (Parquet
log, store, metrics) under a 1->1 flood at full rate; prints the rate and
the routing log's counters from the metrics endpoint (dropped records,
gate closes, the largest queue and lag seen, sampled every 0.5 s).
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
import urllib.request

import trio

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


def _metrics(addr: tuple[str, int]) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r"^(skan_routelog_[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


async def flood(seconds: float, config: str = "") -> None:
    from bench.skan_load import Broker, throughput

    with Broker(config) as broker:
        addr = broker.addr["metrics"]
        peak = {"skan_routelog_queued_records": 0.0, "skan_routelog_lag_seconds": 0.0}

        async def sample() -> None:
            while True:
                m = await trio.to_thread.run_sync(_metrics, addr)
                for k in peak:
                    peak[k] = max(peak[k], m.get(k, 0.0))
                await trio.sleep(0.5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            result = await throughput(broker.addr["skan"], 1, 1, seconds, broker)
            await trio.sleep(2.0)
            nursery.cancel_scope.cancel()
        m = _metrics(addr)
        # Complete files so far (rotate_seconds in --config makes some): bytes per record.
        import pyarrow.parquet as pq

        assert broker.work is not None
        done = [p for p in (broker.work / "log").glob("routelog-*.parquet")]
        nbytes = sum(p.stat().st_size for p in done)
        nrec = sum(pq.ParquetFile(p).metadata.num_rows for p in done)
    print(f"1->1 flood, {seconds:.0f} s, default configuration: {result.msgs_per_s:,.0f} msgs/s; "
          f"routing log: {m.get('skan_routelog_records_total', 0):,.0f} records, dropped "
          f"{m.get('skan_routelog_dropped_records_total', 0):,.0f}, gate closes "
          f"{m.get('skan_routelog_backpressure_closes_total', 0):,.0f}, peak queue "
          f"{peak['skan_routelog_queued_records']:,.0f} records, peak lag "
          f"{peak['skan_routelog_lag_seconds']:.2f} s; complete files: {len(done)}, "
          f"{nrec:,} records, {nbytes / max(1, nrec):.2f} bytes/record")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--flood", type=float, default=0.0, metavar="SECONDS")
    ap.add_argument("--config", default="", help="TOML for the flood's broker")
    args = ap.parse_args()
    if args.flood:
        trio.run(flood, args.flood, args.config.replace("\\n", "\n"))
        return
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
