"""A feature's cost end to end: the same scenarios with the feature on and off.

Shared by the metrics and routing-log overhead benchmarks.  Rounds alternate
the order (on/off, then off/on) so drift on a shared machine hits both
sides; the summary is the median per case, both as a rate and per broker
CPU-second (which stays meaningful when other jobs share the cores).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Awaitable, Callable

import trio

from bench.skan_load import PAYLOAD, Broker, send_frame, throughput
from broker.core.router import Router
from broker.protocols.skan.listener import SkanEndpoint
from wire.skan import encode_frame

SCENARIOS = {"1-1": (1, 1), "1-10": (1, 10)}


Background = Callable[[Broker], Awaitable[None]]


async def run_case(config: str, scenario: str, seconds: float,
                   background: Background | None = None) -> tuple[float, float]:
    """(rate, rate per broker CPU-second) of one scenario on a fresh broker.

    ``background(broker)`` runs alongside the traffic (e.g. a scraper).
    """
    pubs, subs = SCENARIOS[scenario]
    with Broker(config) as broker:
        async with trio.open_nursery() as nursery:
            if background is not None:
                nursery.start_soon(background, broker)
            result = await throughput(broker.addr["skan"], pubs, subs, seconds, broker)
            nursery.cancel_scope.cancel()
    rate = result.msgs_per_s if scenario == "1-1" else result.deliveries_per_s
    return rate, rate / result.broker_cpu if result.broker_cpu else float("nan")


async def compare(feature: str, on: str, off: str, args: argparse.Namespace,
                  background: Background | None = None) -> None:
    """Run every scenario ``args.rounds`` times with config ``on`` and ``off``; print medians."""
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    print(f"{args.rounds} rounds, {args.seconds:.0f}s per case, 100-byte messages")
    for r in range(args.rounds):
        for scenario in args.scenarios.split(","):
            order = (("on", on), ("off", off)) if r % 2 == 0 else (("off", off), ("on", on))
            for name, config in order:
                rate, per_cpu = await run_case(config, scenario, args.seconds, background)
                results.setdefault((scenario, name), []).append((rate, per_cpu))
                print(f"  round {r + 1} {scenario:<5} {feature} {name:<3} {rate:>12,.0f}/s "
                      f"{per_cpu:>12,.0f} per broker CPU-second", flush=True)
    print()
    for scenario in args.scenarios.split(","):
        unit = "msgs/s" if scenario == "1-1" else "deliveries/s"
        for i, what in ((0, unit), (1, "per CPU-s")):
            on_rate = statistics.median(r[i] for r in results[(scenario, "on")])
            off_rate = statistics.median(r[i] for r in results[(scenario, "off")])
            print(f"{scenario:<5} {what:<13} {feature} off {off_rate:>12,.0f}   "
                  f"on {on_rate:>12,.0f}   cost {(off_rate - on_rate) / off_rate:+.1%}")


def fan_out(router: Router, subscribers: int) -> tuple[
    SkanEndpoint, list[SkanEndpoint], bytes, int
]:
    """A publisher and ``subscribers`` subscribers of group "bench" on ``router``, in process.

    Returns them with one 256 KiB chunk of the publisher's 100-byte messages
    and the number of messages in it, for timing the real routing path.
    """
    limit = 1 << 30  # never the bottleneck: queues are emptied between chunks

    def connection() -> SkanEndpoint:
        conn = SkanEndpoint(router, limit, "drop", 8 << 20)
        router.attach(conn)
        conn.on_bytes(encode_frame({"type": "getlname"}))
        return conn

    pub = connection()
    subs = [connection() for _ in range(subscribers)]
    for sub in subs:
        sub.on_bytes(encode_frame({"type": "subscribe", "group": "bench", "instance": "*"}))
    frame = send_frame(pub.lname, "bench", b"x" * PAYLOAD)
    per_chunk = (256 * 1024) // len(frame)
    return pub, subs, frame * per_chunk, per_chunk


def route_chunk(router: Router, pub: SkanEndpoint, chunk: bytes) -> None:
    """Route one received chunk as the transport does: slice after slice, each its own batch."""
    more = pub.on_bytes(chunk)
    router.end_batch()
    while more:
        more = pub.on_bytes(b"")
        router.end_batch()


def in_process(feature: str, chunk_cost: Callable[[int, bool], float], rounds: int = 15,
               note: str = "") -> None:
    """Per-message cost of one routed chunk with the feature off and on (best of rounds)."""
    print(f"in-process, per message (best of interleaved runs{note}):")
    for scenario, (_, subs) in SCENARIOS.items():
        on, off = [], []
        for _ in range(rounds):
            off.append(chunk_cost(subs, False))
            on.append(chunk_cost(subs, True))
        b_off, b_on = min(off), min(on)
        print(f"  {scenario:<5} {feature} off {b_off * 1e9:7.0f} ns   on {b_on * 1e9:7.0f} ns   "
              f"cost {(b_on - b_off) / b_off:+.1%}")


def parse_args(description: str | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="0 = in-process figures only")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--scenarios", default="1-1,1-10")
    return p.parse_args()
