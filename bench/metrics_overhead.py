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
import time

import trio

from bench.onoff import compare, fan_out, in_process, parse_args, route_chunk
from bench.skan_load import Broker
from broker.core.router import Router
from broker.observability.latency import RouteLatency

ON = "[metrics]\nenabled = true\n"
OFF = "[metrics]\nenabled = false\n"


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


def chunk_cost(subscribers: int, metrics: bool, chunks: int = 20) -> float:
    """Best seconds per message over ``chunks`` 256 KiB chunks through the real routing path."""
    router = Router()
    if metrics:
        router.group_stats = {}
        router.latency = RouteLatency()
    pub, subs, chunk, per_chunk = fan_out(router, subscribers)
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
        route_chunk(router, pub, chunk)
        if latency is not None:
            latency.observe(time.perf_counter() - began, counters.msgs_in - before)
        best = min(best, time.perf_counter() - start)
    return best / per_chunk


async def _scrape(broker: Broker) -> None:
    if "metrics" in broker.addr:
        await scrape_every_second(broker.addr["metrics"])


async def main(args: argparse.Namespace) -> None:
    in_process("metrics", chunk_cost)
    if args.rounds:
        await compare("metrics", ON, OFF, args, background=_scrape)


if __name__ == "__main__":
    trio.run(main, parse_args(__doc__))
