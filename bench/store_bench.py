"""What the durable store costs and how fast it answers (docs/store.md).

    python -m bench.store_bench [--rounds 3] [--seconds 5] [--events 1000000] [--dir DIR]

1. Routing 1->1 and 1->10 through real broker processes with the store on
   and off, interleaved in the same run (target: on >= 0.9x off).
2. Bytes the broker process writes to disk per routed message with the
   store on and the routing log off (``/proc/PID/io`` write_bytes: WAL,
   checkpoints and fsyncs included, the page cache not counted).
3. A store of ``--events`` 100-byte events (built in process through the
   real router and writer): latency of a latest query and of a timeseries
   page (100 events, by type pattern, paged with lastEventId), then the
   store's start-up (open, check, continue the sessions) and a real broker
   process's start-up on that directory until it listens.  With ``--dir``
   the store is built there only when the directory holds none, and kept
   (to measure queries of one store with two versions of the code, or the
   first open of a store written by an older version).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import trio

from bench.onoff import compare
from bench.skan_load import PAYLOAD, Broker, throughput
from broker.core import events
from broker.core.router import Endpoint, Router
from broker.store import Store
from broker.store.retained_query import run_store_query
from wire import eventer as w

ROOT = pathlib.Path(__file__).resolve().parent.parent
ON = "[store]\nenabled = true\n"
OFF = "[store]\nenabled = false\n"
TYPES = 100  # distinct event types in the large store (group g0..g9, 10 instances each)


class _Sender(Endpoint):
    protocol = "bench"

    def deliver(self, frame, routed):  # pragma: no cover - never a recipient
        raise AssertionError


def _write_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("no write_bytes in /proc/PID/io")


async def bytes_per_message(seconds: float) -> None:
    config = ON + "[log]\nenabled = false\n"
    with Broker(config) as broker:
        assert broker.proc is not None
        before = _write_bytes(broker.proc.pid)
        result = await throughput(broker.addr["skan"], 1, 1, seconds, broker)
        # Let the writer commit the tail, then count.
        await trio.sleep(1.0)
        written = _write_bytes(broker.proc.pid) - before
    routed = result.msgs_per_s * seconds
    print(f"bytes written per routed message (store on, routing log off, {PAYLOAD}-byte "
          f"payload): {written / routed:,.0f} B ({written / 1e6:,.1f} MB for ~{routed:,.0f} "
          "messages, warm-up included in the bytes)")


def build_store(directory: str, n: int) -> None:
    router = Router()
    store = Store(directory, size=n, max_bytes=0, max_age=0.0, flush_interval=0.01)
    store.attach(router)
    sender = _Sender()
    router.attach(sender)
    started = time.perf_counter()
    payload = events.JsonPayload("x" * PAYLOAD)
    # One message per type and per routing batch of 100 (a mix of types, the
    # store's worst case: runs of one event); every 10th carries a source
    # timestamp.  Frames are built once per type and reused.
    templates = [
        events.send_for_event((f"g{t % 10}", f"dev{t // 10}"), payload, sender=sender.lname,
                              seq=t, source_timestamp=None if t % 10 else 1_700_000_000.0 + t)
        for t in range(TYPES)]
    for i in range(n):
        sent = templates[i % TYPES]
        router.route(sender, sent.frame, sent.header)
        if i % 100 == 99:
            router.end_batch()
        if i % 20_000 == 19_999:
            store.flush()
    router.end_batch()
    store.flush()
    elapsed = time.perf_counter() - started
    print(f"store of {n:,} events built in {elapsed:.1f}s ({n / elapsed:,.0f} routed+written/s, "
          f"{os.path.getsize(store.path) / n:,.0f} B/event on disk)")
    store.close()


def writer_cost(commits: int = 300, per_commit: int = 1000, batch: int = 250,
                size: int = 100_000, types: int = 1, profile: bool = False) -> float:
    """CPU the writer spends per routed 100-byte message, in process.

    ``types`` event types taking turns message by message (1: every routing
    batch is one run; 100: every run is one message, the worst case), routing
    batches of ``batch`` messages (a publisher's chunk),
    ``per_commit`` messages per commit (about what flush_interval gathers at
    100,000 messages/s), a full ring (``size``) so that every commit also
    evicts.  The commit runs in this thread, timed with its thread CPU clock
    (SQLite's work included, fsync waits not).  Returns microseconds per message.
    """
    directory = tempfile.mkdtemp(prefix="skan-store-writer-")
    try:
        router = Router()
        store = Store(directory, size=size, max_bytes=0, max_age=0.0, flush_interval=0.01)
        store.attach(router)
        sender = _Sender()
        router.attach(sender)
        sends = [events.send_for_event((f"g{t % 10}", f"dev{t // 10}"),
                                       events.JsonPayload("x" * PAYLOAD),
                                       sender=sender.lname, seq=t) for t in range(types)]

        def one_commit() -> float:
            for i in range(per_commit):
                sent = sends[i % types]
                router.route(sender, sent.frame, sent.header)
                if i % batch == batch - 1:
                    router.end_batch()
            router.end_batch()
            router.hand_over()
            started = time.thread_time()
            store.flush()
            return time.thread_time() - started

        for _ in range(size // per_commit + 20):  # fill the ring: eviction from now on
            one_commit()
        if profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
        cpu = sum(one_commit() for _ in range(commits))
        if profile:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return cpu / (commits * per_commit) * 1e6


def query_latency(directory: str, n: int, repeats: int = 50) -> None:
    started = time.perf_counter()
    store = Store(directory, size=n, max_bytes=0, max_age=0.0, flush_interval=0.01)
    print(f"store opened in {time.perf_counter() - started:.2f}s (a store written before the "
          "group indexes ended with the instance gets them rebuilt at its first open)")
    try:
        latest = w.QueryLatestParams((("g3", "*"),))
        t = []
        for _ in range(repeats):
            s = time.perf_counter()
            answer = run_store_query(latest, store, 1)
            t.append(time.perf_counter() - s)
        print(f"latest (('g3', '*'), {len(answer.entries)} types of {TYPES}): "
              f"median {statistics.median(t) * 1e3:.2f} ms")
        for label, types in (("one type", (("g3", "dev4"),)), ("a group", (("g3", "*"),)),
                             ("everything", None)):
            t, last = [], None
            for _ in range(repeats):
                params = w.QueryTimeseriesParams(types, order=w.Order.DESCENDING,
                                                 max_results=100, last_event_id=last)
                s = time.perf_counter()
                answer = run_store_query(params, store, 1)
                t.append(time.perf_counter() - s)
                # Page on; from the newest again once the type is exhausted.
                last = w.EventId(1, *answer.entries[-1][:2]) if answer.more_follows else None
            print(f"timeseries page of 100 ({label}, newest first, paged by lastEventId): "
                  f"median {statistics.median(t) * 1e3:.2f} ms, max {max(t) * 1e3:.2f} ms")
        t = []
        for _ in range(repeats):
            params = w.QueryTimeseriesParams((("g0", "*"),), order=w.Order.ASCENDING,
                                             order_by=w.OrderBy.SOURCE_TIMESTAMP,
                                             t_from=w.Timestamp.from_float(time.time() - 3600),
                                             max_results=100)
            s = time.perf_counter()
            run_store_query(params, store, 1)
            t.append(time.perf_counter() - s)
        print(f"timeseries page of 100 (the group whose events carry source timestamps, "
              "by source timestamp, with t_from): "
              f"median {statistics.median(t) * 1e3:.2f} ms")
    finally:
        store.close()


def startup(directory: str, n: int) -> None:
    started = time.perf_counter()
    store = Store(directory, size=n, max_bytes=0, max_age=0.0, flush_interval=0.01)
    store.attach(Router())
    opened = time.perf_counter() - started
    count = store.count
    store.close()
    print(f"store start-up with {count:,} events (open, SQLite quick_check, sessions): "
          f"{opened:.2f}s")
    work = pathlib.Path(tempfile.mkdtemp(prefix="skan-bench-"))
    try:
        (work / "broker.toml").write_text(
            f'[store]\ndir = "{directory}"\n[retention]\nsize = {n}\nmax_bytes = 0\n'
            "[log]\nenabled = false\n")
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "broker", "--config", str(work / "broker.toml"),
             "--skan-port", "0", "--hsp-port", "0", "--eventer-port", "0",
             "--mariner-port", "0", "--metrics-port", "0", "--log-level", "WARNING"],
            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=work)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        elapsed = time.perf_counter() - started
        proc.terminate()
        proc.wait(15)
        print(f"broker process start-up on that store until it listens: {elapsed:.2f}s "
              f"(first line: {line.decode().strip()!r})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="on/off routing rounds (0: skip)")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--scenarios", default="1-1,1-10")
    p.add_argument("--events", type=int, default=1_000_000,
                   help="events in the large store (0: skip queries and start-up)")
    p.add_argument("--writer", action="store_true",
                   help="only the writer's CPU per routed message (in process)")
    p.add_argument("--dir", default="",
                   help="keep the large store here (built only if the directory has none)")
    args = p.parse_args()
    if args.writer:
        # (messages per commit, per routing batch, types, ring size): the last
        # ring is cut inside a run at every commit (its eviction takes part of one).
        for per_commit, batch, types, size in ((1000, 250, 1, 100_000), (200, 50, 1, 100_000),
                                               (1000, 250, 100, 100_000),
                                               (4000, 4000, 1, 102_000)):
            costs = sorted(writer_cost(per_commit=per_commit, batch=batch, types=types,
                                       size=size, commits=300 if types == 1 else 100)
                           for _ in range(3))
            print(f"writer CPU per routed {PAYLOAD}-byte message ({types} types, {per_commit} "
                  f"per commit, batches of {batch}, full ring of {size}): "
                  f"{' / '.join(f'{c:.2f}' for c in costs)} us")
        return
    if args.rounds:
        trio.run(compare, "store", ON, OFF, args)
        print()
        trio.run(bytes_per_message, args.seconds)
        print()
    if args.events:
        directory = args.dir or tempfile.mkdtemp(prefix="skan-store-bench-")
        try:
            if not os.path.exists(os.path.join(directory, "store.sqlite3")):
                build_store(directory, args.events)
            query_latency(directory, args.events)
            startup(directory, args.events)
        finally:
            if not args.dir:
                shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
