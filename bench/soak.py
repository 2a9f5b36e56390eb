"""Soak benchmark: mixed traffic with connection and subscription churn, RSS watched.

    python -m bench.soak                 # 10 minutes
    python -m bench.soak --seconds 60    # shorter

Starts a broker (or uses ``--broker HOST:PORT`` plus ``--pid``) and runs, all
at once for the whole duration:

- steady pub/sub: publishers at a fixed rate into a few groups, broadcast
  and directed, instance "*" and named instances, read by subscribers;
- connection churn: Skan, HSP and Mariner clients that connect, open their
  protocol, subscribe, send a little and disconnect, over and over;
- subscription churn: one client subscribing and unsubscribing ever-new
  (group, instance) pairs, so leaked subscription state would accumulate;
- a ``stats`` request every second.

Every 10 s it prints the broker's RSS, messages routed, live connections
and subscriptions.  The first sample after the warm-up (10 % of the run,
at least 20 s; the retention ring fills then) is the baseline; the run
fails (exit status 1) if RSS ends more than ``--max-growth`` MiB above it
or subscriptions/connections did not return to their steady level.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import random
import sys
import time

import trio

from bench.skan_load import Broker, raw_connect, subscribe
from wire import hsp
from wire import mariner as mw
from wire.skan import FrameSplitter, decode, encode_frame

# Bound on RSS growth after the warm-up.  Steady traffic with bounded state
# (a full retention ring, bounded queues, churned connections and
# subscriptions all released) must not grow; allocator noise and the
# interpreter's caches stay well under this.
MAX_GROWTH_MIB = 48.0
SAMPLE_EVERY = 10.0
GROUPS = [f"soak{i}" for i in range(4)]
CONFIG = "[retention]\nsize = 20000\n"


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def _drain(stream: trio.abc.Stream) -> None:
    try:
        while await stream.receive_some(1 << 16):
            pass
    except trio.BrokenResourceError:
        pass


async def steady(addr: tuple[str, int], rate: float, counts: dict[str, int]) -> None:
    """Publishers at ``rate`` msgs/s in total over the groups; subscribers read."""
    async with trio.open_nursery() as nursery:
        subs = []
        for group in GROUPS:
            stream = await subscribe(addr, group)
            subs.append(stream)
            nursery.start_soon(_drain, stream)
        pub, lname = await raw_connect(addr)
        nursery.start_soon(_drain, pub)
        _, target = await raw_connect(addr)  # a directed target that never subscribes
        payload = b"x" * 200
        interval = 10 / rate
        for seq in itertools.count(1):
            frames = []
            for i in range(10):
                group = GROUPS[(seq + i) % len(GROUPS)]
                frames.append(encode_frame({
                    "type": "send", "from": lname, "group": group,
                    "instance": random.choice(["*", "a", "b/c"]),
                    "to": target if i == 9 else "*", "seq": str(seq), "msg": payload,
                }))
            await pub.send_all(b"".join(frames))
            counts["sent"] += 10
            await trio.sleep(interval)


async def skan_churn(addr: tuple[str, int], counts: dict[str, int]) -> None:
    while True:
        stream, lname = await raw_connect(addr)
        subs = [encode_frame({"type": "subscribe", "group": random.choice(GROUPS),
                              "instance": str(random.randrange(100))}) for _ in range(5)]
        await stream.send_all(b"".join(subs) + encode_frame({
            "type": "send", "from": lname, "group": GROUPS[0], "instance": "*", "to": "*",
            "seq": "1", "msg": b"churn"}))
        await stream.aclose()
        counts["skan connections"] += 1
        await trio.sleep(0.01)


async def hsp_churn(addr: tuple[str, int], counts: dict[str, int]) -> None:
    getlname = hsp.encode(hsp.DataAck.make(1, 1, encode_frame({"type": "getlname"})[4:]))
    while True:
        stream = await trio.open_tcp_stream(*addr)
        sub = encode_frame({"type": "subscribe", "group": GROUPS[1], "instance": "*"})[4:]
        await stream.send_all(getlname + hsp.encode(hsp.Data.make(1, sub)))
        await stream.receive_some(4096)
        await stream.aclose()
        counts["hsp connections"] += 1
        await trio.sleep(0.02)


async def mariner_churn(addr: tuple[str, int], counts: dict[str, int]) -> None:
    init = mw.encode_frame(json.dumps({
        "type": "init", "client_id": "soak", "client_token": None, "last_event_id": None,
        "subscriptions": [[GROUPS[2], "*"]],
    }).encode())
    while True:
        stream = await trio.open_tcp_stream(*addr)
        await stream.send_all(init)
        with trio.move_on_after(0.05):
            await stream.receive_some(1 << 16)
        await stream.aclose()
        counts["mariner connections"] += 1
        await trio.sleep(0.02)


async def subscription_churn(addr: tuple[str, int], counts: dict[str, int]) -> None:
    stream, _ = await raw_connect(addr)
    for n in itertools.count():
        pairs = [(f"churn{n}-{i}", f"i{i}") for i in range(50)]
        await stream.send_all(b"".join(
            encode_frame({"type": "subscribe", "group": g, "instance": i}) for g, i in pairs
        ) + b"".join(
            encode_frame({"type": "unsubscribe", "group": g, "instance": i}) for g, i in pairs
        ))
        counts["subscribe/unsubscribe pairs"] += len(pairs)
        await trio.sleep(0.01)


class StatsReader:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.splitter = FrameSplitter(1 << 20)

    async def stats(self) -> dict:
        await self.stream.send_all(encode_frame({"type": "stats"}))
        while True:
            frames = self.splitter.receive_data(await self.stream.receive_some(1 << 16))
            for frame in frames:
                msg = decode(frame[4:])
                if b"stats" in msg:
                    return msg[b"stats"]


async def soak(args: argparse.Namespace, broker: Broker, pid: int) -> int:
    addr = broker.addr["skan"]
    counts: dict[str, int] = dict.fromkeys(
        ["sent", "skan connections", "hsp connections", "mariner connections",
         "subscribe/unsubscribe pairs"], 0)
    warmup = max(20.0, args.seconds * 0.1)
    baseline: float | None = None
    started = time.monotonic()
    failures: list[str] = []
    async with trio.open_nursery() as nursery:
        reader = StatsReader((await raw_connect(addr))[0])
        nursery.start_soon(steady, addr, args.rate, counts)
        nursery.start_soon(skan_churn, addr, counts)
        nursery.start_soon(subscription_churn, addr, counts)
        if "hsp" in broker.addr:
            nursery.start_soon(hsp_churn, broker.addr["hsp"], counts)
        if "mariner" in broker.addr:
            nursery.start_soon(mariner_churn, broker.addr["mariner"], counts)
        steady_subs = None
        next_sample = started + SAMPLE_EVERY
        print(f"{'t':>6} {'RSS MiB':>8} {'routed':>10} {'conns':>6} {'subs':>6}  churn")
        while True:
            await trio.sleep(max(0.0, min(1.0, next_sample - time.monotonic())))
            stats = await reader.stats()
            now = time.monotonic()
            if now < next_sample:
                continue
            next_sample += SAMPLE_EVERY
            rss = rss_mib(pid)
            t = now - started
            conns = sum(int(v) for v in stats[b"connections"].values())
            subs = int(stats[b"subscriptions"])
            print(f"{t:6.0f} {rss:8.1f} {int(stats[b'messages_in']):10d} {conns:6d} "
                  f"{subs:6d}  " + ", ".join(f"{k} {v}" for k, v in counts.items()),
                  flush=True)
            if baseline is None and t >= warmup:
                baseline = rss
                steady_subs = subs
                print(f"baseline after warm-up: {baseline:.1f} MiB "
                      f"(bound: +{args.max_growth:.0f} MiB)", flush=True)
            if t >= args.seconds:
                break
        nursery.cancel_scope.cancel()
    assert baseline is not None
    final = rss_mib(pid)
    growth = final - baseline
    print(f"RSS baseline {baseline:.1f} MiB, final {final:.1f} MiB, "
          f"growth {growth:+.1f} MiB (bound {args.max_growth:.0f} MiB)")
    if growth > args.max_growth:
        failures.append(f"RSS grew {growth:.1f} MiB after the warm-up")
    # Churned subscriptions must all be gone again (allow the churn in flight).
    if steady_subs is not None and subs > steady_subs + 200:
        failures.append(f"subscriptions grew from {steady_subs} to {subs}")
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=600.0, help="run length (default 600)")
    p.add_argument("--rate", type=float, default=2000.0,
                   help="steady publish rate, msgs/s (default 2000)")
    p.add_argument("--max-growth", type=float, default=MAX_GROWTH_MIB,
                   help=f"allowed RSS growth after the warm-up, MiB (default {MAX_GROWTH_MIB})")
    p.add_argument("--broker", help="HOST:PORT of a running broker's Skan listener")
    p.add_argument("--pid", type=int, help="its process id (with --broker), for RSS")
    args = p.parse_args(argv)
    if args.broker and not args.pid:
        p.error("--broker needs --pid (the RSS is read from /proc)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.broker:
        host, _, port = args.broker.rpartition(":")
        with Broker(address=(host, int(port))) as broker:
            return trio.run(soak, args, broker, args.pid)
    with Broker(CONFIG) as broker:
        assert broker.proc is not None
        print(f"broker pid {broker.proc.pid}, listening on "
              + ", ".join(f"{k} {h}:{p}" for k, (h, p) in sorted(broker.addr.items())))
        return trio.run(soak, args, broker, broker.proc.pid)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
