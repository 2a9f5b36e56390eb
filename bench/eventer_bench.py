"""Eventer benchmark: Skan publishers -> broker -> one Eventer subscriber, events/s.

    python -m bench.eventer_bench                 # starts its own broker
    python -m bench.eventer_bench --seconds 10 --publishers 2 --decode

Target (issue 4, this 2-core machine): one Eventer subscriber receives at
least 100,000 events/s from Skan publishers.  The line also gives events per
second of broker CPU: when other processes compete for the two cores the
wall-clock rate drops with the broker's CPU share, the per-CPU-second rate
does not.

The subscriber must not be the bottleneck: it runs the real Chatter state
machine (envelope decoding, MsgEventsAck for every notification, so the
broker's flow control is in the loop) but counts events from the
MsgEventsNotify array count instead of decoding each event.  ``--decode``
adds a run with toolkit/eventer_client.py decoding every event (the client
library's own rate, not the broker's).
"""

from __future__ import annotations

import argparse
import pathlib
import time

import trio

from bench.skan_load import BATCH, PAYLOAD, Broker, raw_connect, send_frame
from toolkit.eventer_client import EventerClient
from wire.chatter import ChatterConnection, Envelope
from wire.chatter import sbs as chatter_sbs
from wire.eventer import InitReq
from wire.eventer import messages as m

GROUP = "evbench"


def array_count(data: bytes) -> int:
    """The element count an SBS Array starts with."""
    value = -1 if data[0] & 0x40 else 0
    for b in data:
        value = (value << 7) | (b & 0x7F)
        if b & 0x80:
            return value
    raise ValueError("truncated count")


class CountingSubscriber:
    """An Eventer client that acknowledges every notification and counts its events."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.chatter = ChatterConnection(envelope=Envelope.HATCHATTER, max_message=1 << 30)
        self.events = 0
        self.notifies = 0

    async def start(self) -> None:
        self.chatter.send("HatEventer.MsgInitReq", chatter_sbs.encode(
            "HatEventer.MsgInitReq", m.init_req_to_sbs(InitReq("bench/sub", None,
                                                               ((GROUP, "*"),)))),
            last=False)
        await self.stream.send_all(self.chatter.data_to_send())
        while True:
            msgs = self.chatter.receive_data(await self.stream.receive_some(65536))
            if msgs:
                assert msgs[0].type == "HatEventer.MsgInitRes"
                return

    async def run(self) -> None:
        while True:
            data = await self.stream.receive_some(1 << 20)
            if not data:
                raise RuntimeError("the broker closed the benchmark subscriber")
            for msg in self.chatter.receive_data(data):
                if msg.type == "HatEventer.MsgEventsNotify":
                    self.events += array_count(msg.data)
                    self.notifies += 1
                    if not msg.last:
                        self.chatter.send("HatEventer.MsgEventsAck", b"", conv=msg.conv)
            out = self.chatter.data_to_send()
            if out:
                await self.stream.send_all(out)


async def publish(addr: tuple[str, int]) -> None:
    stream, lname = await raw_connect(addr)
    buf = send_frame(lname, GROUP, b"x" * PAYLOAD) * BATCH
    while True:
        await stream.send_all(buf)


async def run_counting(broker: Broker, publishers: int, seconds: float) -> None:
    sub = CountingSubscriber(await trio.open_tcp_stream(*broker.addr["eventer"]))
    await sub.start()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sub.run)
        for _ in range(publishers):
            nursery.start_soon(publish, broker.addr["skan"])
        await trio.sleep(1.0)  # warm-up
        e0, n0, t0, c0 = sub.events, sub.notifies, time.perf_counter(), broker.cpu_seconds()
        await trio.sleep(seconds)
        e1, n1, t1, c1 = sub.events, sub.notifies, time.perf_counter(), broker.cpu_seconds()
        nursery.cancel_scope.cancel()
    dt = t1 - t0
    cpu = ""
    if c0 is not None and c1 is not None and c1 > c0:
        # Events per second of broker CPU: the broker's own cost, comparable
        # across runs when other processes compete for the two cores.
        cpu = (f", broker cpu {(c1 - c0) / dt:.0%}, "
               f"{(e1 - e0) / (c1 - c0):,.0f} events per broker CPU-second")
    print(f"{publishers} Skan publisher(s) -> 1 Eventer subscriber: "
          f"{(e1 - e0) / dt:,.0f} events/s in {(n1 - n0) / dt:,.0f} notifications/s "
          f"({(e1 - e0) / max(n1 - n0, 1):,.0f} events each){cpu}", flush=True)


async def run_decoding(broker: Broker, publishers: int, seconds: float) -> None:
    count = {"events": 0}
    async with EventerClient.connect(*broker.addr["eventer"], "bench/decode",
                                     subscriptions=[(GROUP, "*")]) as client:

        async def consume() -> None:
            async for batch in client:
                count["events"] += len(batch)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            for _ in range(publishers):
                nursery.start_soon(publish, broker.addr["skan"])
            await trio.sleep(1.0)
            e0, t0 = count["events"], time.perf_counter()
            await trio.sleep(seconds)
            e1, t1 = count["events"], time.perf_counter()
            nursery.cancel_scope.cancel()
    print(f"{publishers} Skan publisher(s) -> toolkit/eventer_client.py decoding every event: "
          f"{(e1 - e0) / (t1 - t0):,.0f} events/s", flush=True)


async def main(args: argparse.Namespace) -> None:
    config = pathlib.Path(args.config).read_text() if args.config else ""
    with Broker(config) as broker:
        print(f"broker at {broker.addr['eventer']}, {args.seconds:.0f}s per run, "
              f"{PAYLOAD}-byte messages", flush=True)
        await run_counting(broker, args.publishers, args.seconds)
    if args.decode:
        with Broker(config) as broker:
            await run_decoding(broker, args.publishers, args.seconds)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="TOML config for the broker this benchmark starts")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--publishers", type=int, default=1)
    p.add_argument("--decode", action="store_true",
                   help="also measure toolkit/eventer_client.py decoding every event")
    return p.parse_args()


if __name__ == "__main__":
    trio.run(main, parse_args())
