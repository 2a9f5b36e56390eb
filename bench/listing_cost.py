"""What GET /connections and /subscriptions cost a broker with many connections.

In process: a Router with N idle Skan endpoints (one subscription each), the
Listing answering its requests while a ticker task measures the longest
stretch the event loop went without a checkpoint (what other connections
would wait).  Figures in docs/metrics.md ("Bounded work").

    python -m bench.listing_cost              # N = 10,000 and 100,000
    python -m bench.listing_cost 1000 50000
"""

from __future__ import annotations

import sys
import time

import trio

from broker.core.queue import QueuedEndpoint
from broker.core.router import NORMAL, Router
from broker.observability.listing import Listing

TARGETS = ("/connections?sort=queue", "/connections?sort=msgs_out&offset=50",
           "/subscriptions", "/subscriptions?group=g5")


async def measure(n: int) -> None:
    router = Router()
    for i in range(n):
        ep = QueuedEndpoint(router, 16 << 20, "disconnect")
        ep.remote = f"10.0.{i // 250 % 250}.{i % 250}:{40000 + i % 20000}"
        router.attach(ep)
        ep.msgs_out = i * 7 % 1000
        router.subscribe(ep, f"g{i % 100}".encode(), b"*", NORMAL)
    listing = Listing(router)
    worst = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done:
            await trio.sleep(0)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.01)
        for target in TARGETS:
            worst = 0.0
            started = time.perf_counter()
            if target.startswith("/connections"):
                await listing.connections_json(target)
            else:
                await listing.subscriptions_json(target)
            total = time.perf_counter() - started
            print(f"{n:>7} connections  {target:<40} {total * 1e3:8.1f} ms  longest stretch "
                  f"without a checkpoint {worst * 1e3:6.1f} ms", flush=True)
        done = True


def main(argv: list[str]) -> None:
    for n in [int(a) for a in argv] or [10_000, 100_000]:
        trio.run(measure, n)


if __name__ == "__main__":
    main(sys.argv[1:])
