"""Where one routed message's time goes, in process (no sockets, no event loop).

    python -m bench.profile_route              # timings, then a cProfile of 1->1
    python -m bench.profile_route --profile 0  # timings only
    SKAN_PURE_PYTHON=1 python -m bench.profile_route   # the pure-Python reference

A publisher's 256 KiB chunk of 100-byte messages goes through the Skan
connection's ``on_bytes`` (splitter, header decoder, session checks, router,
delivery) exactly as the transport hands it over, with the per-message
observers a default broker runs: the durable store (its writer's work
included, run in the timing thread; the fsync wait is not CPU), the routing
log's line formatter (its writer thread is left out: it only joins and
writes) and the metrics' per-group counters.  Figures are the best of interleaved
repeats, in nanoseconds of CPU
(thread time, so other processes on a shared machine distort them less) per message.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from collections.abc import Callable

from bench.onoff import fan_out, route_chunk
from broker.core.router import Router
from broker.observability.routelog.record import RecordBuffer
from broker.store import Store
from wire.skan import FrameSplitter, codec, decode_header

CHUNKS = 20  # chunks per timing


def make_router(observers: bool) -> tuple[Router, Callable[[], None]]:
    """A router with a default broker's per-message observers (or none), and
    the store writer's work for one chunk (run in this thread, so it is timed)."""
    router = Router()
    if not observers:
        return router, lambda: None
    store = Store(tempfile.mkdtemp(prefix="profile-store-"), size=100_000, max_bytes=0,
                  max_age=0.0, flush_interval=0.0)
    store.attach(router)
    buffer = RecordBuffer(10_000, lambda: buffer.take(), router)
    router.observers.append(buffer.observe)
    router.group_stats = {}

    def commit() -> None:
        with store._lock:
            store._commit_queued()

    return router, commit


def route_cost(subscribers: int, observers: bool) -> Callable[[], float]:
    """A timer: seconds per routed message over ``CHUNKS`` chunks."""
    router, commit = make_router(observers)
    pub, subs, chunk, per_chunk = fan_out(router, subscribers)

    def timer() -> float:
        start = time.thread_time()
        for _ in range(CHUNKS):
            for conn in subs:
                conn.queue.take_all()
            route_chunk(router, pub, chunk)
            commit()
        return (time.thread_time() - start) / (CHUNKS * per_chunk)

    return timer


def parts_cost() -> dict[str, Callable[[], float]]:
    """Timers for the codec alone: the splitter and the header decoder."""
    router = Router()
    _pub, _subs, chunk, per_chunk = fan_out(router, 1)
    frame = FrameSplitter(1 << 20).receive_data(chunk)[0]

    def split() -> float:
        splitter = FrameSplitter(8 << 20)
        start = time.thread_time()
        for _ in range(CHUNKS):
            splitter.receive_data(chunk)
        return (time.thread_time() - start) / (CHUNKS * per_chunk)

    def header() -> float:
        n = CHUNKS * per_chunk
        start = time.thread_time()
        for _ in range(n):
            decode_header(frame, 4)
        return (time.thread_time() - start) / n

    return {"frame splitter": split, "decode_header": header}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--profile", type=int, default=1, help="cProfile the 1->1 case (0 = off)")
    args = p.parse_args()
    print(f"header decoder: {getattr(codec, 'IMPLEMENTATION', 'python')}")
    timers = {
        "1->1 routed, no observers": route_cost(1, False),
        "1->1 routed, observers on": route_cost(1, True),
        "1->10 routed, observers on": route_cost(10, True),
        **parts_cost(),
    }
    best = {name: float("inf") for name in timers}
    for _ in range(args.repeats):
        for name, timer in timers.items():
            best[name] = min(best[name], timer())
    for name, value in best.items():
        print(f"  {name:<28} {value * 1e9:8.0f} ns per message")
    if args.profile:
        timer = route_cost(1, True)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            timer()
        profiler.disable()
        print("\ncProfile of the 1->1 case with observers (5 x 20 chunks), by own time:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
