"""What one wake-up per message costs, by event loop: the floor under a broker's
CPU per isolated message.

    python -m bench.wakeup_floor [--rate 10000] [--seconds 3] [--rounds 3]

One publisher writes one 100-byte message per write at ``--rate`` over
loopback TCP; a relay in this process reads each and writes it to a
subscriber (no routing: only the wake-up, the read and the write).  The
publisher and the subscriber run in another process, so they take nothing
from the relay's interpreter.  Relays, interleaved round by round:

- ``trio``: a trio task per connection (``wait_readable``, read, write),
  what a broker under ``trio.run`` pays per isolated message;
- ``host``: the broker's own HostLoop (broker/serving/hostloop.py) serving
  the socket, with trio as its guest and a 10 ms timer task running in it;
- ``bare``: a bare level-triggered epoll loop, no trio at all.

Prints the relay thread's CPU per message (median of the rounds) and the
latency the subscriber saw, with each relay's ratio to ``bare``.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import subprocess
import sys
import time

import trio

from broker.serving.hostloop import HostLoop

SIZE = 100  # bytes per message: an 8-byte send time, then padding


def load(port: int, rate: int, seconds: float) -> None:
    """The other process: publish at ``rate``, read everything back, print the
    latencies (µs) sorted as p50 and p99."""
    pub = socket.create_connection(("127.0.0.1", port))
    sub = socket.create_connection(("127.0.0.1", port))
    for s in (pub, sub):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sub.sendall(b"S")  # tells the relay which one is the subscriber
    pub.sendall(b"P")
    time.sleep(0.2)
    lat: list[int] = []
    buf = b""
    start = time.perf_counter()
    k = 0
    total = int(rate * seconds)
    sub.setblocking(False)
    while k < total or len(lat) < total:
        now = time.perf_counter()
        due = start + k / rate
        if k < total and now >= due:
            pub.send(time.perf_counter_ns().to_bytes(8, "big") + b"x" * (SIZE - 8))
            k += 1
            continue
        timeout = max(0.0, due - now) if k < total else 1.0
        if select.select([sub], [], [], timeout)[0]:
            data = sub.recv(1 << 16)
            if not data:
                break
            arrived = time.perf_counter_ns()
            buf += data
            while len(buf) >= SIZE:
                lat.append(arrived - int.from_bytes(buf[:8], "big"))
                buf = buf[SIZE:]
        elif k >= total:
            break
    pub.close()
    lat.sort()
    n = len(lat)
    print(n, lat[n // 2] / 1e3, lat[int(n * 0.99)] / 1e3, flush=True)
    sub.close()


def _accept_pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    got: dict[bytes, socket.socket] = {}
    while len(got) < 2:
        conn, _ = listener.accept()
        got[conn.recv(1)] = conn
    for conn in got.values():
        conn.setblocking(False)
    return got[b"P"], got[b"S"]


def relay_trio(pub: int, sub: int) -> None:
    async def main() -> None:
        while True:
            await trio.lowlevel.wait_readable(pub)
            data = os.read(pub, 1 << 16)
            if not data:
                return
            os.write(sub, data)

    trio.run(main)


def relay_host(pub: int, sub: int) -> None:
    host = HostLoop()

    def step() -> object:
        data = os.read(pub, 1 << 16)
        if not data:
            return b""
        os.write(sub, data)
        return None

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async def ticker() -> None:
                while True:
                    await trio.sleep(0.01)  # trio's own work goes on beside

            nursery.start_soon(ticker)
            await host.serve(pub, step)
            nursery.cancel_scope.cancel()

    host.run(main)


def relay_bare(pub: int, sub: int) -> None:
    ep = select.epoll()
    ep.register(pub, select.EPOLLIN)
    while True:
        ep.poll()
        data = os.read(pub, 1 << 16)
        if not data:
            return
        os.write(sub, data)


RELAYS = {"trio": relay_trio, "host": relay_host, "bare": relay_bare}


def one(relay: str, rate: int, seconds: float) -> tuple[float, float, float]:
    """(µs of relay CPU per message, p50 µs, p99 µs) of one round."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.wakeup_floor", "--load", str(port), "--rate", str(rate),
         "--seconds", str(seconds)], stdout=subprocess.PIPE, text=True)
    pub, sub = _accept_pair(listener)
    listener.close()
    cpu = time.thread_time()
    RELAYS[relay](pub.fileno(), sub.fileno())
    cpu = time.thread_time() - cpu
    sub.close()
    pub.close()
    out, _ = child.communicate(timeout=60)
    n, p50, p99 = out.split()
    return cpu / int(n) * 1e6, float(p50), float(p99)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load is not None:
        load(args.load, args.rate, args.seconds)
        return
    results: dict[str, list[tuple[float, float, float]]] = {r: [] for r in RELAYS}
    for r in range(args.rounds):
        order = list(RELAYS)[r % 3:] + list(RELAYS)[:r % 3]
        for relay in order:
            res = one(relay, args.rate, args.seconds)
            results[relay].append(res)
            print(f"  round {r + 1} {relay:<5} {res[0]:6.1f} µs CPU/msg  "
                  f"p50 {res[1]:6.0f} µs  p99 {res[2]:6.0f} µs", flush=True)
    med = {r: tuple(statistics.median(x[i] for x in v) for i in range(3))
           for r, v in results.items()}
    bare = med["bare"]
    print(f"\n{args.rate:,} msgs/s, one message per write, medians of {args.rounds} rounds:")
    print("| relay | CPU µs/msg | / bare | p50 µs | p99 µs |")
    print("|---|---:|---:|---:|---:|")
    for relay, (cpu, p50, p99) in med.items():
        print(f"| {relay} | {cpu:.1f} | {cpu / bare[0]:.2f}x | {p50:.0f} | {p99:.0f} |")


if __name__ == "__main__":
    main()
