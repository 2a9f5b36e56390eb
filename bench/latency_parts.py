"""Where a latency probe's time goes: the client's clock against the broker's.

    python -m bench.latency_parts [--config FILE] [--rate 10000] [--seconds 6]

The probe of ``bench.compare.probe`` (a publisher sending ``rate`` msgs/s in 1 ms
ticks, each message carrying its send time; a subscriber reading it back)
runs against a broker started through this module, which instruments it:
the trio run's wake-up from epoll (an Instrument), the start and end of
each routing slice, and the ``os.write`` that hands the subscriber its
bytes, each stamped with ``time.perf_counter_ns`` (CLOCK_MONOTONIC, the
same clock in both processes).  Every tick is then split into

    send->wake       the publisher's send until the broker's loop woke
    wake->slice      trio: the reader task resumed, the socket read
    slice->close     decoding and routing the tick's messages
    close->written   the direct write to the subscriber (it returns once
                     the kernel has queued the bytes and woken the reader;
                     when the kernel runs the woken subscriber on the
                     broker's core at once, the broker's write returns only
                     after it, and the next part is negative)
    written->client  until the subscriber's loop had read them

with p50/p90/p99 of each, and the share of the slowest 1 % of ticks that
overlapped one of the durable store's commits (and, for contrast, of the
fastest half).  The instrumentation costs a few microseconds per tick; use
it to see where the time goes, and ``python -m bench.run --scenarios
latency`` for the figures.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import trio

from bench.compare import STAMP_DIGITS

# The broker-side records: written by the instrumented broker at exit.
_RECORDS_ENV = "SKAN_LATENCY_PARTS_FILE"


def _instrument_and_run_broker(records: str) -> None:
    """Run the broker (its usual command line) with stamps at each step."""
    import re

    import broker.serving.transport as transport
    import broker.store.store as store_module
    from broker.app.cli import main

    ticks: list[tuple[int, int, int, int, int]] = []
    commits: list[tuple[int, int]] = []
    now: dict[str, int] = {}
    stamp = re.compile(rb" *(\d{12,%d})x" % STAMP_DIGITS)
    real_os = os

    class _Os:
        def __getattr__(self, name: str) -> object:
            return getattr(real_os, name)

        @staticmethod
        def write(fd: int, data: bytes) -> int:
            n = real_os.write(fd, data)
            done = time.perf_counter_ns()
            found = stamp.search(data)
            if found:
                ticks.append((int(found.group(1)), now.get("wake", 0), now.get("slice", 0),
                              now.get("close", 0), done))
            return n

    transport.os = _Os()  # type: ignore[assignment]
    open_slice, close_slice = transport.open_slice, transport.close_slice

    def opened(router):  # type: ignore[no-untyped-def]
        now["slice"] = time.perf_counter_ns()
        return open_slice(router)

    def closed(router, writes):  # type: ignore[no-untyped-def]
        now["close"] = time.perf_counter_ns()
        return close_slice(router, writes)

    transport.open_slice, transport.close_slice = opened, closed  # type: ignore[assignment]
    commit = store_module.Store._commit_queued

    def timed_commit(self):  # type: ignore[no-untyped-def]
        began = time.perf_counter_ns()
        try:
            return commit(self)
        finally:
            commits.append((began, time.perf_counter_ns()))

    store_module.Store._commit_queued = timed_commit  # type: ignore[method-assign]

    class Wake(trio.abc.Instrument):
        def after_io_wait(self, timeout: float) -> None:
            now["wake"] = time.perf_counter_ns()

    run = trio.run

    def instrumented_run(*args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs.setdefault("instruments", []).append(Wake())
        return run(*args, **kwargs)

    trio.run = instrumented_run  # type: ignore[assignment]
    try:
        main()
    finally:
        pathlib.Path(records).write_text(json.dumps({"ticks": ticks, "commits": commits}))


def _quantiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=100)
    return f"p50 {q[49]:7.1f}  p90 {q[89]:7.1f}  p99 {q[98]:7.1f} us"


def main(args: argparse.Namespace) -> None:
    from bench.compare import Target, probe
    from bench.skan_load import Broker, SkanClient

    config = pathlib.Path(args.config).read_text() if args.config else ""
    records = pathlib.Path(tempfile.mkdtemp(prefix="skan-parts-")) / "records.json"
    with Broker(config, module="bench.latency_parts",
                env={_RECORDS_ENV: str(records)}) as broker:
        received: dict[int, int] = {}  # a tick's send time -> when its first message was read
        target = Target("skan", SkanClient(broker), broker.cpu_seconds, None)
        trio.run(probe, target, args.rate, args.seconds,
                 lambda sent, got: received.setdefault(sent, got))
    deadline = time.monotonic() + 10
    while not records.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    data = json.loads(records.read_text())
    marks = {t[0]: t[1:] for t in data["ticks"]}
    rows = []
    for sent, got in received.items():
        if sent in marks:
            wake, sliced, close, written = marks[sent]
            rows.append(((got - sent) / 1e3, (wake - sent) / 1e3, (sliced - wake) / 1e3,
                         (close - sliced) / 1e3, (written - close) / 1e3, (got - written) / 1e3,
                         sent, got))
    if len(rows) < 100:
        raise SystemExit(f"only {len(rows)} ticks could be matched; is the broker routing?")
    rows.sort()
    print(f"{len(rows)} ticks of {max(1, args.rate // 1000)} messages, "
          f"load average {os.getloadavg()[0]:.2f}")
    names = ["total", "send->wake", "wake->slice", "slice->close", "close->written",
             "written->client"]
    for i, name in enumerate(names):
        print(f"  {name:<16} {_quantiles([r[i] for r in rows])}")
    commits = sorted(tuple(c) for c in data["commits"])
    if commits:
        starts = [c[0] for c in commits]

        def overlaps(t0: int, t1: int) -> bool:
            i = bisect.bisect_right(starts, t1) - 1
            return i >= 0 and commits[i][1] >= t0

        slow = rows[-max(1, len(rows) // 100):]
        fast = rows[: len(rows) // 2]
        share = sum(overlaps(r[6], r[7]) for r in slow) / len(slow)
        calm = sum(overlaps(r[6], r[7]) for r in fast) / len(fast)
        print(f"  store commits: {len(commits)}, mean "
              f"{statistics.mean((b - a) / 1e3 for a, b in commits):.0f} us; overlapping one: "
              f"{share:.0%} of the slowest 1 % of ticks, {calm:.0%} of the fastest half")


if __name__ == "__main__":
    records_file = os.environ.get(_RECORDS_ENV)
    if records_file:
        sys.argv[0] = "skan-broker"
        _instrument_and_run_broker(records_file)
    else:
        p = argparse.ArgumentParser(description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", help="TOML config for the broker")
        p.add_argument("--rate", type=int, default=10_000, help="msgs/s, in 1 ms ticks")
        p.add_argument("--seconds", type=float, default=6.0)
        main(p.parse_args())
