"""Cost of the routing log: the foundation 1->1 and 1->10 rates with [log] enabled and disabled.

    python -m bench.routelog_overhead                  # 3 rounds of 5 s per case
    python -m bench.routelog_overhead --rounds 5 --seconds 8
    python -m bench.routelog_overhead --rounds 0       # in-process part only

First, in-process and free of socket noise: the transport's per-chunk work
(split, decode, route, queue, end the batch) on 256 KiB chunks of 100-byte
messages, with and without the routing log attached (its observer formats
every record; its writer thread writes them to a temporary directory).  The
time counted runs until the writer has written every record, so the thread's
share of the GIL is included.  Best of interleaved runs.

Then end to end: each round starts one broker with the log on and one with it
off and runs both scenarios on each, alternating, so machine noise (other
jobs on this 2-core box) hits both sides alike.  Prints the median of the
rounds, as a rate and as a rate per broker CPU-second (far less sensitive to
other load), and the drop; the target is at most 25 %.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import trio

from bench.skan_load import PAYLOAD, Broker, send_frame, throughput
from broker.routelog.files import LogDirectory
from broker.routelog.writer import RoutingLog
from broker.router import Router
from broker.skan_listener import SkanConnection
from wire.skan import encode_frame

ON = "[log]\nenabled = true\n"
OFF = "[log]\nenabled = false\n"
SCENARIOS = {"1-1": (1, 1), "1-10": (1, 10)}


def chunk_cost(subscribers: int, log: bool, chunks: int = 40) -> float:
    """Seconds per message for ``chunks`` 256 KiB chunks, writer caught up at the end."""
    router = Router()
    limit = 1 << 30
    routelog = None
    if log:
        directory = LogDirectory(tempfile.mkdtemp(prefix="skan-routelog-bench-"), 1)
        directory.open()
        routelog = RoutingLog(directory, rotate_bytes=64 << 20, rotate_seconds=60.0,
                              queue_records=200_000)
        routelog.attach(router)
        routelog.start()

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
    start = time.perf_counter()
    for _ in range(chunks):
        for conn in (pub, *subs):
            conn.queue.take_all()
        pub.on_bytes(chunk)
        router.end_batch()
    if routelog is not None:
        routelog.handoff()
        while routelog.queued:
            time.sleep(0.0005)
    elapsed = time.perf_counter() - start
    if routelog is not None:
        routelog.stop()
        routelog.join()
    return elapsed / (chunks * per_chunk)


def in_process(rounds: int = 7) -> None:
    print("in-process, per message (best of interleaved runs, writer caught up):")
    for scenario, (_, subs) in SCENARIOS.items():
        on, off = [], []
        for _ in range(rounds):
            off.append(chunk_cost(subs, False))
            on.append(chunk_cost(subs, True))
        b_off, b_on = min(off), min(on)
        print(f"  {scenario:<5} log off {b_off * 1e9:7.0f} ns   on {b_on * 1e9:7.0f} ns   "
              f"rate drop {1 - b_off / b_on:.1%}")


async def run_case(config: str, scenario: str, seconds: float) -> tuple[float, float]:
    pubs, subs = SCENARIOS[scenario]
    with Broker(config) as broker:
        result = await throughput(broker.addr["skan"], pubs, subs, seconds, broker)
    rate = result.msgs_per_s if scenario == "1-1" else result.deliveries_per_s
    return rate, rate / result.broker_cpu if result.broker_cpu else float("nan")


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
                print(f"  round {r + 1} {scenario:<5} log {name:<3} {rate:>12,.0f}/s "
                      f"{per_cpu:>12,.0f} per broker CPU-second", flush=True)
    print()
    for scenario in args.scenarios.split(","):
        unit = "msgs/s" if scenario == "1-1" else "deliveries/s"
        for i, what in ((0, unit), (1, "per CPU-s")):
            on = statistics.median(r[i] for r in results[(scenario, "on")])
            off = statistics.median(r[i] for r in results[(scenario, "off")])
            print(f"{scenario:<5} {what:<13} log off {off:>12,.0f}   on {on:>12,.0f}   "
                  f"drop {(off - on) / off:+.1%}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--scenarios", default="1-1,1-10")
    return p.parse_args()


if __name__ == "__main__":
    trio.run(main, parse_args())
