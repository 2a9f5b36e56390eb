"""A bystander pub/sub pair: proves a hostile or heavy client does not disturb others.

The publisher sends one small message every ``1/rate`` seconds carrying its
send time; the subscriber records each arrival.  Figures (latency
percentiles, the largest gap between two arrivals, messages lost) are taken
over a window the test opens with :meth:`Bystander.measure`.

The pair runs in the test process, whose heap after a thousand tests holds
some 200,000 objects: a full collection of it took 140-280 ms (measured
with ``gc.callbacks`` over the suite), which is the size of a failed bound
seen in CI (a 254 ms stall with a p99 of 7.7 ms).  So the window freezes
what the process held before it (``gc.freeze``), and :class:`Figures`
carries the client's own longest collection in the window, so a stall of
the measuring client is never read as one of the broker.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from tests.rawskan import RawSkan
from wire.skan import FrameSplitter, decode, encode_frame

GROUP = "bystander"


@attrs.define
class Figures:
    sent: int
    received: int
    lost: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    largest_gap_ms: float
    # The measuring client's own longest garbage collection in the window.
    client_gc_ms: float = 0.0

    def line(self) -> str:
        return (f"sent={self.sent} received={self.received} lost={self.lost} "
                f"p50={self.p50_ms:.2f}ms p99={self.p99_ms:.2f}ms max={self.max_ms:.1f}ms "
                f"largest_gap={self.largest_gap_ms:.1f}ms client_gc={self.client_gc_ms:.1f}ms")


@attrs.define
class Bystander:
    rate: float
    # Two pairs in one test need a group each (a pair would count the other's
    # messages with the same seq as its own arrivals).
    group: str = GROUP
    # seq -> send time, and seq -> arrival time, for the messages of the window
    sent_at: dict[int, float] = attrs.Factory(dict)
    arrived: dict[int, float] = attrs.Factory(dict)
    measuring: bool = False
    sending: bool = True
    # The client's own collections in the window (seconds), and when the
    # current one started.
    gc_pauses: list[float] = attrs.Factory(list)
    _gc_started: float = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_pauses.append(time.perf_counter() - self._gc_started)

    @asynccontextmanager
    async def measure(self) -> AsyncIterator[None]:
        """Record the messages sent inside the block (and their arrivals, after it too)."""
        self.sent_at.clear()
        self.arrived.clear()
        self.gc_pauses.clear()
        # What the process held before the window is not the window's
        # garbage: collect it once now, then keep it out of collections.
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._on_gc)
        self.measuring = True
        try:
            yield
        finally:
            self.measuring = False
            gc.callbacks.remove(self._on_gc)
            gc.unfreeze()

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait until every message of the window arrived (or the timeout passed)."""
        with trio.move_on_after(timeout):
            while len(self.arrived) < len(self.sent_at):
                await trio.sleep(0.02)

    def figures(self) -> Figures:
        lat = sorted((self.arrived[s] - t) * 1000 for s, t in self.sent_at.items()
                     if s in self.arrived)
        times = sorted(self.arrived[s] for s in self.sent_at if s in self.arrived)
        # Gaps between arrivals, and before the first one (from the window's
        # first send), so a broker frozen from the start shows as a gap too.
        first_sent = min(self.sent_at.values(), default=0.0)
        gaps = [b - a for a, b in zip([first_sent, *times], times, strict=False)]
        if not lat:
            return Figures(len(self.sent_at), 0, len(self.sent_at), 0, 0, 0, 0)
        return Figures(
            sent=len(self.sent_at),
            received=len(lat),
            lost=len(self.sent_at) - len(lat),
            p50_ms=statistics.median(lat),
            p99_ms=lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            max_ms=lat[-1],
            largest_gap_ms=max(gaps, default=0.0) * 1000,
            client_gc_ms=max(self.gc_pauses, default=0.0) * 1000,
        )

    async def _publish(self, pub: RawSkan, lname: bytes) -> None:
        seq = 0
        interval = 1.0 / self.rate
        next_at = time.perf_counter()
        while self.sending:
            seq += 1
            now = time.perf_counter()
            if self.measuring:
                self.sent_at[seq] = now
            await pub.send_bytes(encode_frame({
                "type": "send", "group": self.group, "instance": "*", "to": "*",
                "from": lname, "seq": str(seq), "msg": b"x" * 32,
            }))
            next_at += interval
            await trio.sleep(max(0.0, next_at - time.perf_counter()))

    async def _subscribe_loop(self, sub: RawSkan) -> None:
        splitter = FrameSplitter(1 << 20)
        # Frames already read by the barrier (none expected) are ignored.
        while True:
            data = await sub.stream.receive_some(65536)
            if not data:
                return
            now = time.perf_counter()
            for frame in splitter.receive_data(data):
                msg = decode(frame[4:])
                seq = msg.get(b"seq")
                if seq is not None and msg.get(b"group") == self.group.encode():
                    n = int(seq)
                    if n in self.sent_at:
                        self.arrived[n] = now


@asynccontextmanager
async def bystander(addr: tuple[str, int], rate: float = 200.0,
                    group: str = GROUP) -> AsyncIterator[Bystander]:
    """Run a bystander pair on a Skan listener for the duration of the block."""
    b = Bystander(rate, group)
    pub = await RawSkan.open(addr)
    sub = await RawSkan.open(addr)
    try:
        lname = await pub.getlname()
        await sub.getlname()
        await sub.send({"type": "subscribe", "group": group, "instance": "*"})
        await sub.getlname()  # barrier: the subscription is in place
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b._subscribe_loop, sub)
            nursery.start_soon(b._publish, pub, lname)
            await trio.sleep(0.3)  # warm up
            yield b
            b.sending = False
            nursery.cancel_scope.cancel()
    finally:
        await pub.aclose()
        await sub.aclose()


def load_factor() -> float:
    """How oversubscribed the machine is (1-minute load average per CPU, at least 1).

    Latency bounds are the targets on an idle machine; on a shared, busy one
    the broker waits for a CPU too, so the tests scale their bounds by this
    (the figures before the isolation work were 100-1000 times the targets,
    so a scaled bound still catches a regression).
    """
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def tracebacks(lines: list[str]) -> list[str]:
    """Log lines of a broker that show a traceback (none is allowed for peer faults)."""
    return [line for line in lines if "Traceback" in line]
