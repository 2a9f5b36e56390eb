"""Cluster benchmark: brokers joined by a real nats-server, against one broker, in one run.

Prints, for 100-byte messages:
- single: 1->1 and 1->10 on one broker without a cluster (the reference);
- local, cluster on: the same on one broker of a two-broker cluster, with
  publishers and subscribers on that broker (the cost of cluster mode on
  broker-local traffic: every message is also published to NATS);
- cross: publishers on broker A, subscribers on broker B (through NATS).
Ratios are against ``single`` in the same run (the machine's speed moves by
2x between phases: only same-run ratios mean something).

    python -m bench.cluster_bench [--seconds 5]
"""

from __future__ import annotations

import argparse
import time

import trio

from bench.skan_load import BATCH, PAYLOAD, Broker, Result, raw_connect, send_frame, subscribe
from tests.cluster.natsproc import NatsCluster


async def flow(pub_addr: tuple[str, int], sub_addr: tuple[str, int], subscribers: int,
               seconds: float, label: str, warmup: float = 1.5) -> Result:
    """One publisher on ``pub_addr`` floods a group; subscribers on ``sub_addr`` count bytes."""
    group = f"cb-{subscribers}-{time.monotonic_ns()}"
    subs = [await subscribe(sub_addr, group) for _ in range(subscribers)]
    stream, lname = await raw_connect(pub_addr)
    frame = send_frame(lname, group, b"x" * PAYLOAD)
    received = [0] * subscribers
    out: dict[str, float] = {}

    async def publish() -> None:
        buf = frame * BATCH
        while True:
            await stream.send_all(buf)

    async def count(i: int, s: trio.SocketStream) -> None:
        while True:
            data = await s.receive_some(1 << 20)
            if not data:
                raise RuntimeError("a benchmark subscriber was closed (slow consumer?)")
            received[i] += len(data)

    await trio.sleep(0.5)  # the group's interest reaches NATS
    async with trio.open_nursery() as nursery:
        for i, s in enumerate(subs):
            nursery.start_soon(count, i, s)
        nursery.start_soon(publish)
        await trio.sleep(warmup)
        b0, t0 = sum(received), time.perf_counter()
        await trio.sleep(seconds)
        out["bytes"], out["dt"] = sum(received) - b0, time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    for s in [*subs, stream]:
        await s.aclose()
    deliveries = out["bytes"] / len(frame) / out["dt"]
    return Result(label, deliveries / subscribers, deliveries, out["dt"])


QUIET = "[log]\nenabled = false\n"


def cluster_config(server_id: int, url: str) -> str:
    return (f"[broker]\nserver_id = {server_id}\n[cluster]\nurl = \"{url}\"\n"
            "id_probe_timeout = 0.3\n" + QUIET)


async def main(seconds: float) -> None:
    rows: list[tuple[str, Result]] = []
    with Broker(QUIET) as single:
        addr = single.addr["skan"]
        rows.append(("single", await flow(addr, addr, 1, seconds, "1->1")))
        rows.append(("single", await flow(addr, addr, 10, seconds, "1->10")))
    with NatsCluster(1) as nats:
        url = nats.nodes[0].url
        with Broker(cluster_config(1, url)) as a, Broker(cluster_config(2, url)) as b:
            aa, ba = a.addr["skan"], b.addr["skan"]
            rows.append(("local", await flow(aa, aa, 1, seconds, "1->1")))
            rows.append(("local", await flow(aa, aa, 10, seconds, "1->10")))
            rows.append(("cross", await flow(aa, ba, 1, seconds, "1->1")))
            rows.append(("cross", await flow(aa, ba, 10, seconds, "1->10")))
    ref = {r.scenario: r.deliveries_per_s for kind, r in rows if kind == "single"}
    print(f"{'mode':<8}{'scenario':<8}{'deliveries/s':>16}{'vs single':>12}")
    for kind, r in rows:
        print(f"{kind:<8}{r.scenario:<8}{r.deliveries_per_s:>16,.0f}"
              f"{r.deliveries_per_s / ref[r.scenario]:>11.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    trio.run(main, parser.parse_args().seconds)
