"""What the slowest messages overlapped: the latency probe against a broker whose
writers stamp their work.

    python -m bench.isolated_tail [--shape isolated|latency] [--config FILE]
                                  [--rate 10000] [--seconds 5]

The probe of ``bench.compare.probe`` (``isolated``: ten publishers taking turns,
one message per write; ``latency``: bursts every millisecond) runs against a
broker started through this module, which wraps, with
``time.perf_counter_ns`` stamps (CLOCK_MONOTONIC, the probe's clock too):

    gcN           the collector's passes, by generation
    store:collect the writer building a transaction's rows (Python, the GIL)
    store:insert  its multi-row INSERTs
    store:commit  a whole flush (collect, inserts, eviction, COMMIT and its
                  fsync, the WAL check)
    log:take      the routing-log writer turning a hand-off into Arrow columns
    log:rowgroup  ... and encoding a Parquet row group: the Arrow table of
                  its hand-offs (log:table), the encoding (log:encode)
    trio:tick     a trio tick run by the host loop (broker/serving/hostloop.py)
    loop:step     a read routed from the host loop, when it took 0.2 ms or more
                  (and loop:step/cpu, the routing thread's CPU in it)

For each kind it prints how often it ran and how long it took, then the
share of the slowest 1 % of messages (from send to read back) whose flight
overlapped one, beside the same share for messages at or below the median.
A kind that overlaps the slow messages far more often than the fast ones is
where the tail comes from; one that overlaps both alike is merely frequent.
The stamps cost well under a microsecond per wrapped call (a few hundred
calls a second).  docs/performance.md, "Isolated messages: where a wake-up
goes", has what it found.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable

import trio

# The broker-side stamps: written by the instrumented broker at exit.
_EVENTS_ENV = "SKAN_ISOLATED_TAIL_FILE"


def _instrument_and_run_broker(events_file: str) -> None:
    """Run the broker (its usual command line) with its writers' work stamped."""
    import atexit
    import gc
    import resource
    import time

    import broker.store.writer as store_writer
    from broker.app.cli import main
    from broker.observability.routelog import parquet as routelog_parquet
    from broker.observability.routelog.writer import RoutingLog

    stamp = time.perf_counter_ns
    events: list[tuple[str, int, int]] = []
    # Of the host-loop steps of 0.2 ms or more: how many the kernel preempted,
    # how many slept (waited for the interpreter), and their page faults.
    step_counts = collections.Counter[str]()
    gc_start = [0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = stamp()
        else:
            events.append((f"gc{info['generation']}", gc_start[0], stamp()))

    gc.callbacks.append(on_gc)

    def wrap(owner: object, name: str, kind: str) -> None:
        inner = getattr(owner, name)

        def stamped(*args: object, **kwargs: object) -> object:
            began, cpu = stamp(), time.thread_time_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                ended = stamp()
                events.append((kind, began, ended))
                # The thread's own CPU in that time ("kind/cpu", from its start).
                events.append((kind + "/cpu", began, began + time.thread_time_ns() - cpu))

        setattr(owner, name, stamped)

    # Module functions are looked up at call time, methods on the class.
    wrap(store_writer, "collect", "store:collect")
    wrap(store_writer, "insert_runs", "store:insert")
    wrap(store_writer, "upsert_latest", "store:insert")
    wrap(store_writer.StoreWriter, "_commit_queued", "store:commit")
    wrap(RoutingLog, "_take_rows", "log:take")
    wrap(RoutingLog, "_write_row_group", "log:rowgroup")
    wrap(routelog_parquet, "columns_to_table", "log:table")
    wrap(routelog_parquet.ParquetEncoder, "row_group", "log:encode")

    # The main thread's own work: trio's guest ticks, and host-loop steps
    # (reads routed from the loop) of 0.2 ms or more.
    from broker.serving.hostloop import HostLoop

    call_soon = HostLoop._call_soon_threadsafe

    def stamped_call_soon(self: HostLoop, fn: Callable[[], object]) -> None:
        def tick() -> None:
            began = stamp()
            try:
                fn()
            finally:
                events.append(("trio:tick", began, stamp()))

        call_soon(self, tick)

    HostLoop._call_soon_threadsafe = stamped_call_soon  # type: ignore[method-assign]
    serve = HostLoop.serve

    async def stamped_serve(self: HostLoop, fd: int, step: Callable[[], object]) -> object:
        def timed() -> object:
            began, cpu = stamp(), time.thread_time_ns()
            ru = resource.getrusage(resource.RUSAGE_THREAD)
            try:
                return step()
            finally:
                ended = stamp()
                if ended - began >= 200_000:
                    after = resource.getrusage(resource.RUSAGE_THREAD)
                    events.append(("loop:step", began, ended))
                    # Its CPU: a long step with little of it waited (for a
                    # core, or for the interpreter), one with as much worked.
                    events.append(("loop:step/cpu", began,
                                   began + time.thread_time_ns() - cpu))
                    step_counts["steps"] += 1
                    step_counts["preempted"] += after.ru_nivcsw > ru.ru_nivcsw
                    step_counts["slept"] += after.ru_nvcsw > ru.ru_nvcsw
                    step_counts["page faults"] += after.ru_minflt - ru.ru_minflt

        return await serve(self, fd, timed)

    HostLoop.serve = stamped_serve  # type: ignore[method-assign]

    def save() -> None:
        pathlib.Path(events_file).write_text(
            "".join(f"{kind} {began} {ended}\n" for kind, began, ended in events)
            + "".join(f"count:{name.replace(' ', '_')} 0 {n}\n"
                      for name, n in step_counts.items()))

    atexit.register(save)
    sys.argv[0] = "skan-broker"
    main()


def overlaps(samples: list[tuple[int, int]], events: list[tuple[str, int, int]]
             ) -> collections.Counter:
    """How many of ``samples`` (sent, received) overlapped each kind of event."""
    by_kind: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for kind, began, ended in events:
        by_kind[kind].append((began, ended))
    hits: collections.Counter = collections.Counter()
    for kind, spans in by_kind.items():
        spans.sort()
        starts = [b for b, _ in spans]
        for sent, got in samples:
            # Spans that began before the message was read back; the last
            # few are the only ones that can still be running at ``sent``.
            i = bisect.bisect_left(starts, got)
            if any(ended > sent for _, ended in spans[max(0, i - 8):i]):
                hits[kind] += 1
    return hits


async def run(args: argparse.Namespace) -> None:
    from bench.compare import Target, probe
    from bench.skan_load import Broker, SkanClient

    config = pathlib.Path(args.config).read_text() if args.config else ""
    events_file = os.path.join(tempfile.mkdtemp(prefix="skan-tail-"), "events.txt")
    samples: list[tuple[int, int]] = []
    with Broker(config, module="bench.isolated_tail",
                env={_EVENTS_ENV: events_file}) as broker:
        target = Target("skan", SkanClient(broker, "skan"), broker.cpu_seconds, None)
        await probe(target, args.rate, 1.0, lambda s, g: None, args.shape)  # warm-up
        cpu = await probe(target, args.rate, args.seconds,
                          lambda sent, got: samples.append((sent, got)), args.shape)
    first = samples[0][0] - 10_000_000
    events = []
    counts: dict[str, int] = {}
    for line in pathlib.Path(events_file).read_text().splitlines():
        kind, began, ended = line.split()
        if kind.startswith("count:"):
            counts[kind[6:].replace("_", " ")] = int(ended)
        elif int(ended) >= first:
            events.append((kind, int(began), int(ended)))
    latency = sorted((got - sent, sent, got) for sent, got in samples)
    n = len(latency)

    def ms(q: float) -> float:
        return latency[min(n - 1, int(q * n))][0] / 1e6

    print(f"{args.shape}, {args.rate} msgs/s, {n} messages: p50 {ms(0.5):.3f} ms, "
          f"p90 {ms(0.9):.3f}, p99 {ms(0.99):.3f}, p99.9 {ms(0.999):.3f}; "
          f"broker CPU {cpu * 1e6 / args.rate if cpu else float('nan'):.1f} us/msg")
    durations: dict[str, list[float]] = collections.defaultdict(list)
    for kind, began, ended in events:
        durations[kind].append((ended - began) / 1e6)
    slow = [(s, g) for _, s, g in latency[int(0.99 * n):]]
    fast = [(s, g) for _, s, g in latency[:n // 2]]
    hit_slow, hit_fast = overlaps(slow, events), overlaps(fast, events)
    print(f"{'kind':<14} {'runs':>6} {'p50 ms':>8} {'max ms':>8}   slowest 1% overlapped"
          f"   fastest 50% overlapped")
    for kind in sorted(durations):
        d = sorted(durations[kind])
        print(f"{kind:<14} {len(d):>6} {d[len(d) // 2]:>8.3f} {d[-1]:>8.2f}   "
              f"{hit_slow[kind] / len(slow):>20.0%}   {hit_fast[kind] / len(fast):>22.0%}")
    if counts:
        print("host-loop steps of 0.2 ms or more (the whole run): "
              + ", ".join(f"{name} {n}" for name, n in counts.items()))
    episodes(slow, events)


def episodes(slow: list[tuple[int, int]], events: list[tuple[str, int, int]],
             gap_ns: int = 3_000_000, show: int = 10) -> None:
    """The slowest messages as stalls (sent within ``gap_ns`` of each other), the
    largest first, each with what the broker was doing meanwhile."""
    eps: list[list] = []
    for sent, got in sorted(slow):
        if eps and sent - eps[-1][1] < gap_ns:
            eps[-1][1] = sent
            eps[-1][2] = max(eps[-1][2], got)
            eps[-1][3] += 1
        else:
            eps.append([sent, sent, got, 1])
    print(f"\n{len(slow)} slowest messages in {len(eps)} stalls; the largest:")
    first = min(e[0] for e in eps)
    for began, _last, ended, count in sorted(eps, key=lambda e: -e[3])[:show]:
        during = sorted({f"{k} {(e - b) / 1e6:.2f}" for k, b, e in events
                         if b < ended and e > began - 1_000_000})
        print(f"  +{(began - first) / 1e9:7.3f} s  {count:>3} msgs  {(ended - began) / 1e6:6.2f} ms"
              f"  {', '.join(during[:6]) or '-'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("isolated", "latency"), default="isolated")
    p.add_argument("--config", help="TOML config for the broker")
    p.add_argument("--rate", type=int, default=10_000)
    p.add_argument("--seconds", type=float, default=5.0)
    trio.run(run, p.parse_args())


if __name__ == "__main__":
    events_env = os.environ.get(_EVENTS_ENV)
    if events_env:
        _instrument_and_run_broker(events_env)
    else:
        main()
