"""Cost of metrics: the foundation 1->1 and 1->10 rates with [metrics] enabled and disabled.

    python -m bench.metrics_overhead                  # 3 rounds of 5 s per case
    python -m bench.metrics_overhead --rounds 5 --seconds 8
    python -m bench.metrics_overhead --rounds 0       # in-process part only

First, in-process and free of socket noise: the transport's per-chunk work
(split, decode, route, queue, end the batch) on 256 KiB chunks of 100-byte
messages, with the metrics bookkeeping (per-group counts, one latency
observation per chunk) on and off, interleaved; best of many runs.

Then end to end: each round starts one broker with metrics on and one with
metrics off and runs both scenarios on each, alternating, so machine noise
(other jobs on this 2-core box) hits both sides alike.  With metrics on, the
benchmark also scrapes /metrics every second, as a Prometheus would.
Prints the median of the rounds and the overhead; the target is at most 10 %.
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio

from bench.skan_load import PAYLOAD, Broker, send_frame, throughput
from broker.latency import RouteLatency
from broker.router import Router
from broker.skan_listener import SkanConnection
from wire.skan import encode_frame

ON = "[metrics]\nenabled = true\n"
OFF = "[metrics]\nenabled = false\n"
SCENARIOS = {"1-1": (1, 1), "1-10": (1, 10)}


async def scrape_every_second(addr: tuple[str, int]) -> None:
    request = b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n"
    stream = await trio.open_tcp_stream(*addr)
    while True:
        await stream.send_all(request)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += await stream.receive_some(65536)
        head, body = buf.split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += await stream.receive_some(65536)
        await trio.sleep(1.0)


async def run_case(config: str, scenario: str, seconds: float) -> tuple[float, float]:
    """(rate, rate per broker CPU-second): the second is far less sensitive to other load."""
    pubs, subs = SCENARIOS[scenario]
    with Broker(config) as broker:
        async with trio.open_nursery() as nursery:
            if "metrics" in broker.addr:
                nursery.start_soon(scrape_every_second, broker.addr["metrics"])
            result = await throughput(broker.addr["skan"], pubs, subs, seconds, broker)
            nursery.cancel_scope.cancel()
    rate = result.msgs_per_s if scenario == "1-1" else result.deliveries_per_s
    return rate, rate / result.broker_cpu if result.broker_cpu else float("nan")


def chunk_cost(subscribers: int, metrics: bool, chunks: int = 20) -> float:
    """Best seconds per message over ``chunks`` 256 KiB chunks through the real routing path."""
    router = Router()
    if metrics:
        router.group_stats = {}
        router.latency = RouteLatency()
    limit = 1 << 30

    def connection() -> SkanConnection:
        conn = SkanConnection(router, limit, "drop", 8 << 20)
        router.attach(conn)
        conn.on_bytes(encode_frame({"type": "getlname"}))
        return conn

    pub = connection()
    subs = [connection() for _ in range(subscribers)]
    for sub in subs:
        sub.on_bytes(encode_frame({"type": "subscribe", "group": "bench", "instance": "*"}))
    frame = send_frame(pub.lname, "bench", b"x" * PAYLOAD)
    per_chunk = (256 * 1024) // len(frame)
    chunk = frame * per_chunk
    counters = router.counters
    best = float("inf")
    for _ in range(chunks):
        for conn in (pub, *subs):
            conn.queue.take_all()
        start = time.perf_counter()
        latency = router.latency
        if latency is not None:
            before = counters.msgs_in
            began = time.perf_counter()
        pub.on_bytes(chunk)
        router.end_batch()
        if latency is not None:
            latency.observe(time.perf_counter() - began, counters.msgs_in - before)
        best = min(best, time.perf_counter() - start)
    return best / per_chunk


def in_process(rounds: int = 15) -> None:
    print("in-process, per message (best of interleaved runs):")
    for scenario, (_, subs) in SCENARIOS.items():
        on, off = [], []
        for _ in range(rounds):
            off.append(chunk_cost(subs, False))
            on.append(chunk_cost(subs, True))
        b_off, b_on = min(off), min(on)
        print(f"  {scenario:<5} metrics off {b_off * 1e9:7.0f} ns   on {b_on * 1e9:7.0f} ns   "
              f"overhead {(b_on - b_off) / b_off:+.1%}")


async def main(args: argparse.Namespace) -> None:
    in_process()
    if not args.rounds:
        return
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    print(f"{args.rounds} rounds, {args.seconds:.0f}s per case, 100-byte messages")
    for r in range(args.rounds):
        for scenario in args.scenarios.split(","):
            order = (("on", ON), ("off", OFF)) if r % 2 == 0 else (("off", OFF), ("on", ON))
            for name, config in order:
                rate, per_cpu = await run_case(config, scenario, args.seconds)
                results.setdefault((scenario, name), []).append((rate, per_cpu))
                print(f"  round {r + 1} {scenario:<5} metrics {name:<3} {rate:>12,.0f}/s "
                      f"{per_cpu:>12,.0f} per broker CPU-second", flush=True)
    print()
    for scenario in args.scenarios.split(","):
        unit = "msgs/s" if scenario == "1-1" else "deliveries/s"
        for i, what in ((0, unit), (1, "per CPU-s")):
            on = statistics.median(r[i] for r in results[(scenario, "on")])
            off = statistics.median(r[i] for r in results[(scenario, "off")])
            print(f"{scenario:<5} {what:<13} metrics off {off:>12,.0f}   on {on:>12,.0f}   "
                  f"overhead {(off - on) / off:+.1%}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--scenarios", default="1-1,1-10")
    return p.parse_args()


if __name__ == "__main__":
    trio.run(main, parse_args())
