"""Mariner benchmark: Skan -> Mariner fan-out, last_event_id replay, broker-to-broker bridge.

    python -m bench.mariner_load                       # every scenario, 5 s each
    python -m bench.mariner_load --scenarios replay --retained 100000

- fanout-N: one Skan publisher floods a group with 100-byte messages; N
  Mariner clients subscribed to it count the events they receive.
- replay: the retention store is filled with ``--retained`` messages, then
  one client connects with a ``last_event_id`` older than all of them and
  the time until the last replayed event arrives is measured.
- bridge: broker A's Mariner listener feeds broker B's Mariner bridge; a
  Skan publisher floods A, a Skan subscriber on B counts deliveries.

Clients only frame-split and count (``{"id":`` occurrences per events
message), so they are not the bottleneck for the broker under test.
"""

from __future__ import annotations

import argparse
import json
import time

import trio

from bench.skan_load import (
    BATCH,
    PAYLOAD,
    Broker,
    barrier,
    raw_connect,
    send_frame,
    subscribe,
)
from wire.mariner import FrameSplitter, encode_frame

EVENT_MARK = b'{"id":'


class MarinerStream:
    """A raw Mariner connection that only counts the events it receives."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.splitter = FrameSplitter(1 << 30)
        self.early = 0  # events that arrived with the pong

    async def aclose(self) -> None:
        await self.stream.aclose()


async def mariner_connect(addr: tuple[str, int], pattern: list[str],
                          last_event_id: dict[str, int] | None = None) -> MarinerStream:
    conn = MarinerStream(await trio.open_tcp_stream(*addr))
    init = {"type": "init", "client_id": "bench", "client_token": None,
            "last_event_id": last_event_id, "subscriptions": [pattern]}
    await conn.stream.send_all(encode_frame(json.dumps(init).encode())
                               + encode_frame(b'{"type": "ping"}'))
    while True:  # until the pong: init has been applied
        bodies = conn.splitter.receive_data(await conn.stream.receive_some(4096))
        conn.early += sum(b.count(EVENT_MARK) for b in bodies)
        if b'{"type":"pong"}' in bodies:
            return conn


async def count_events(conn: MarinerStream, counter: list[int], i: int) -> None:
    counter[i] += conn.early
    stream, splitter = conn.stream, conn.splitter
    while True:
        data = await stream.receive_some(1 << 20)
        if not data:
            raise RuntimeError("broker closed a benchmark Mariner client (slow consumer?)")
        for body in splitter.receive_data(data):
            counter[i] += body.count(EVENT_MARK)


async def flood(addr: tuple[str, int], group: str) -> None:
    stream, lname = await raw_connect(addr)
    buf = send_frame(lname, group, b"x" * PAYLOAD) * BATCH
    while True:
        await stream.send_all(buf)


async def measure(counter: list[int], seconds: float, warmup: float = 1.0) -> float:
    await trio.sleep(warmup)
    n0, t0 = sum(counter), time.perf_counter()
    await trio.sleep(seconds)
    return (sum(counter) - n0) / (time.perf_counter() - t0)


async def fanout(broker: Broker, clients: int, seconds: float) -> None:
    group = f"mfan-{time.monotonic_ns()}"
    streams = [await mariner_connect(broker.addr["mariner"], [group, "*"])
               for _ in range(clients)]
    counter = [0] * clients
    async with trio.open_nursery() as nursery:
        for i, s in enumerate(streams):
            nursery.start_soon(count_events, s, counter, i)
        nursery.start_soon(flood, broker.addr["skan"], group)
        c0 = broker.cpu_seconds()
        rate = await measure(counter, seconds)
        c1 = broker.cpu_seconds()
        nursery.cancel_scope.cancel()
    for s in streams:
        await s.aclose()
    cpu = ""
    if c0 is not None and c1 is not None:
        # The machine may be shared: events per broker CPU-second does not depend on that.
        used = (c1 - c0) / (seconds + 1)
        cpu = f"  broker cpu {used:.0%} = {rate / max(used, 1e-9):,.0f} events/cpu-s"
    print(f"fanout-{clients:<3} {rate / clients:>12,.0f} msgs/s routed "
          f"{rate:>12,.0f} events/s delivered to Mariner{cpu}", flush=True)


async def replay(broker: Broker, retained: int) -> None:
    group = f"mrep-{time.monotonic_ns()}"
    stream, lname = await raw_connect(broker.addr["skan"])
    frame = send_frame(lname, group, b"x" * PAYLOAD)
    sent = 0
    while sent < retained:
        n = min(BATCH, retained - sent)
        await stream.send_all(frame * n)
        sent += n
    await barrier(stream)
    start = time.perf_counter()
    client = await mariner_connect(broker.addr["mariner"], [group, "*"],
                                   {"server": 1, "session": 0, "instance": 0})
    counter = [0]
    with trio.move_on_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(count_events, client, counter, 0)
            while counter[0] < retained:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    took = time.perf_counter() - start
    print(f"replay    {counter[0]:>12,} events in {took:.2f}s = {counter[0] / took:,.0f} events/s",
          flush=True)
    await client.aclose()
    await stream.aclose()


async def bridge(seconds: float) -> None:
    with Broker("[retention]\nsize = 1000\n") as upstream:
        port = upstream.addr["mariner"][1]
        config = (f'[[bridges]]\nprotocol = "mariner"\naddress = "127.0.0.1:{port}"\n'
                  'group = "mbridge"\nbackoff_initial = 0.1\n')
        with Broker(config) as down:
            sub = await subscribe(down.addr["skan"], "mbridge")
            await trio.sleep(1.0)  # the bridge connects and subscribes upstream
            frame_size = len(send_frame(b"x" * 20, "mbridge", b"x" * PAYLOAD))
            counter = [0]

            async def count() -> None:
                while True:
                    counter[0] += len(await sub.receive_some(1 << 20))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(count)
                nursery.start_soon(flood, upstream.addr["skan"], "mbridge")
                rate = await measure(counter, seconds) / frame_size
                nursery.cancel_scope.cancel()
    print(f"bridge    {rate:>12,.0f} msgs/s  Skan -> broker A -> Mariner -> broker B -> Skan "
          "(approx.: lnames differ in length)", flush=True)


async def main(args: argparse.Namespace) -> None:
    names = args.scenarios.split(",")
    print(f"{args.seconds:.0f}s per scenario, {PAYLOAD}-byte messages", flush=True)
    fanouts = [n for n in names if n.startswith("fanout-")]
    if fanouts:
        with Broker() as broker:
            for name in fanouts:
                await fanout(broker, int(name.split("-")[1]), args.seconds)
    if "replay" in names:
        # A broker of its own: nothing else may enter (and evict from) the retention store.
        with Broker(f"[retention]\nsize = {max(args.retained, 100_000)}\n") as broker:
            await replay(broker, args.retained)
    if "bridge" in names:
        await bridge(args.seconds)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--retained", type=int, default=100_000)
    p.add_argument("--scenarios", default="fanout-1,fanout-10,replay,bridge")
    return p.parse_args()


if __name__ == "__main__":
    trio.run(main, parse_args())
