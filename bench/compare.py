"""The product against its anchors, in one interleaved run: throughput, latency, memory.

Every target (the Skan broker, Mosquitto, NATS, optionally a second Skan
broker from another checkout or in pure-Python mode) runs for the whole
benchmark; each scenario is run on every target in turn, the order rotating
from round to round, so drift on a shared machine hits all of them.  The
table reports medians and ratios taken within the same run: on a machine
whose absolute speed moves by 2x between phases, the ratios are the figures
that mean something.

Method (identical for every target): raw sockets, 100-byte payloads,
publishers write large buffers of identical pre-encoded frames, subscribers
count received bytes and divide by the size of one delivered frame.
"""

from __future__ import annotations

import errno
import gc
import os
import resource
import socket
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from bench.anchors import FrameMaker

PAYLOAD = 100  # bytes of payload per message
BATCH = 2000  # frames per publisher write

# name -> (groups, publishers per group, subscribers per group)
SCENARIOS: dict[str, tuple[int, int, int]] = {
    "1->1": (1, 1, 1),
    "1->10": (1, 1, 10),
    "10->1": (1, 10, 1),
    "100->100": (100, 1, 1),
}
# Idle connections opened for the memory figure, in batches of this many
# (each batch completes its handshakes before the next one connects, so the
# listen backlog never overflows).
IDLE_CONNECTIONS = 10_000
IDLE_BATCH = 500
# Latency traffic shapes: "latency" is one publisher writing bursts of
# rate/1000 messages every millisecond (10 at 10,000 msgs/s); "isolated" is
# ISOLATED_PUBLISHERS independent publishers taking turns, one message per
# write, evenly spaced (every 100 us at 10,000 msgs/s), as most real
# traffic arrives: each message costs the broker a wake-up of its own.
LATENCY_SHAPES = ("latency", "isolated")
ISOLATED_PUBLISHERS = 10


class Client(Protocol):
    name: str
    addr: tuple[str, int]

    async def publisher(self, group: str) -> tuple[trio.SocketStream, FrameMaker]: ...

    async def subscriber(self, group: str) -> trio.SocketStream: ...

    def delivered_size(self, group: str, published: bytes) -> int: ...

    def parser(self) -> Callable[[bytes], list[bytes]]: ...

    async def settle(self) -> None: ...

    def idle_handshake(self, i: int) -> tuple[bytes, Callable[[bytes], bool]]: ...


@attrs.define
class Target:
    name: str
    client: Client
    cpu_seconds: Callable[[], float | None]
    rss: Callable[[], int] | None


@attrs.define
class Rate:
    deliveries_per_s: float
    cpu: float | None  # broker CPU, fraction of one core

    @property
    def per_cpu_second(self) -> float | None:
        return self.deliveries_per_s / self.cpu if self.cpu else None


_unique = iter(range(1, 1 << 62))


async def flood(target: Target, groups: int, pubs: int, subs: int, seconds: float,
                warmup: float = 1.0) -> Rate:
    """Publishers flood their group; returns deliveries per second over the window."""
    # A previous case's publishers may have left megabytes in the kernel
    # that the server is still working through.
    await target.client.settle()
    run = next(_unique)
    names = [f"bench-{run:06d}-{g:03d}" for g in range(groups)]
    client = target.client
    sub_streams: list[trio.SocketStream] = []
    for name in names:
        sub_streams.extend([await client.subscriber(name) for _ in range(subs)])
    publishers: list[tuple[trio.SocketStream, bytes]] = []
    sizes: list[int] = []
    for name in names:
        for _ in range(pubs):
            stream, make = await client.publisher(name)
            frame = make(b"x" * PAYLOAD, 1)
            publishers.append((stream, frame * BATCH))
            sizes.append(client.delivered_size(name, frame))
    size = statistics.mean(sizes)
    received = [0]
    lost: list[str] = []

    async def publish(stream: trio.SocketStream, buf: bytes) -> None:
        try:
            while True:
                await stream.send_all(buf)
        except trio.BrokenResourceError:
            lost.append("publisher")

    async def count(stream: trio.SocketStream) -> None:
        while True:
            try:
                data = await stream.receive_some(1 << 20)
            except trio.BrokenResourceError:
                data = b""
            if not data:
                lost.append("subscriber")
                return
            received[0] += len(data)

    async with trio.open_nursery() as nursery:
        for s in sub_streams:
            nursery.start_soon(count, s)
        for stream, buf in publishers:
            nursery.start_soon(publish, stream, buf)
        await trio.sleep(warmup)
        b0, t0, c0 = received[0], time.perf_counter(), target.cpu_seconds()
        await trio.sleep(seconds)
        b1, t1, c1 = received[0], time.perf_counter(), target.cpu_seconds()
        nursery.cancel_scope.cancel()
    for s in sub_streams:
        await s.aclose()
    for s, _ in publishers:
        await s.aclose()
    if lost:
        print(f"  ({target.name}: the server closed {len(lost)} connection(s) during the run)")
    dt = t1 - t0
    cpu = (c1 - c0) / dt if c0 is not None and c1 is not None else None
    return Rate((b1 - b0) / size / dt, cpu)


@attrs.define
class Latency:
    p50: float  # ms
    p99: float  # ms
    samples: int
    cpu: float | None
    # How the slowest 1 % came: in how many stalls (see :func:`stalls`), and
    # the longest one's span in ms.
    stalls: int = 0
    longest_stall: float = 0.0


# Slow messages sent less than this apart belong to one stall.
STALL_GAP_NS = 5_000_000


def stalls(samples: list[tuple[int, int]], share: float = 0.01) -> list[tuple[int, int]]:
    """The stalls that hold the slowest ``share`` of ``samples`` ((sent, received)
    ns pairs): each (first send, last receipt) of a run of slow messages sent
    less than :data:`STALL_GAP_NS` apart, longest first.

    A machine that pauses now and then (a busy host, its other tenants) puts
    the tail into a few long stalls for every server; a server's own steady
    cost spreads it thin.  The count and the longest beside the p99 tell the
    two apart, and say how far a round was the machine's."""
    if not samples:
        return []
    slow = sorted(samples, key=lambda s: s[1] - s[0])[-max(1, int(len(samples) * share)):]
    slow.sort()
    runs: list[tuple[int, int]] = []
    first, last_sent, last_got = slow[0][0], slow[0][0], slow[0][1]
    for sent, got in slow[1:]:
        if sent - last_sent >= STALL_GAP_NS:
            runs.append((first, last_got))
            first, last_got = sent, got
        last_sent, last_got = sent, max(last_got, got)
    runs.append((first, last_got))
    return sorted(runs, key=lambda r: r[0] - r[1])


STAMP_DIGITS = 20  # a latency probe's send time: perf_counter_ns, right-aligned ASCII


def _stamp_template(make: FrameMaker, seq: int) -> tuple[bytes, bytes]:
    """The bytes of one latency probe before and after its 20-byte timestamp."""
    marker = b"T" * STAMP_DIGITS
    frame = make(marker + b"x" * (PAYLOAD - STAMP_DIGITS), seq)
    at = frame.find(marker)
    if at < 0 or frame.find(marker, at + 1) >= 0:
        raise RuntimeError("the probe's timestamp is not found once in its frame")
    return frame[:at], frame[at + STAMP_DIGITS:]


# Where the isolated probe's paced writes run.  A thread of the probe shares
# the interpreter with the receiver: when a stall leaves the receiver a
# backlog to parse, the two took turns on the GIL and on one CPU, and that
# wait was measured as the server's latency, more for a server whose
# frames cost the receiver more to parse (Skan's against NATS's MSG lines).
# A child process has an interpreter of its own (docs/performance.md,
# "What the CPUs did in a stall").  "thread" keeps the old way, to compare.
ISOLATED_SENDER = "process"


def _in_child(fn: Callable[[], None]) -> int:
    """Run ``fn`` in a forked child (it inherits the sockets); its pid.  The child
    runs only ``fn`` (writes and sleeps) and exits without cleanup."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()  # the parent only sees the exit status
        finally:
            os._exit(code)
    return pid


async def probe(target: Target, rate: int, seconds: float,
                on_sample: Callable[[int, int], None], shape: str = "latency") -> float | None:
    """The latency probe: ``rate`` msgs/s, each message carrying its send time, to
    one subscriber; ``on_sample(sent_ns, received_ns)`` for each message read back.
    ``shape`` (:data:`LATENCY_SHAPES`): bursts every 1 ms tick from one publisher,
    or isolated messages from :data:`ISOLATED_PUBLISHERS` publishers, one per
    write.  Returns the broker's CPU share meanwhile (None when unknown)."""
    client = target.client
    await client.settle()
    group = f"latency-{next(_unique):06d}"
    sub = await client.subscriber(group)
    npubs = ISOLATED_PUBLISHERS if shape == "isolated" else 1
    pubs = [await client.publisher(group) for _ in range(npubs)]
    parse = client.parser()
    per_tick = max(1, rate // 1000)
    # Frames are built before the clock is read: the timestamp goes into a
    # template (same length, same bytes around it), so the clients' encoders
    # -- a Python Skan encoder costs about 8 us a frame, a NATS PUB line
    # 0.5 us -- are not measured as broker latency.
    templates = [[_stamp_template(make, k) for k in range(per_tick)] for _, make in pubs]

    async def receive() -> None:
        while True:
            data = await sub.receive_some(1 << 16)
            if not data:
                return
            now = time.perf_counter_ns()
            for payload in parse(data):
                on_sample(int(payload[:STAMP_DIGITS]), now)

    async def bursts() -> None:
        pub = pubs[0][0]
        start = trio.current_time()
        tick = 0
        while trio.current_time() - start < seconds:
            tick += 1
            ts = str(time.perf_counter_ns()).rjust(STAMP_DIGITS).encode()
            await pub.send_all(b"".join([head + ts + tail for head, tail in templates[0]]))
            await trio.sleep_until(start + tick / 1000)

    def isolated() -> None:
        """The paced writes, in a child process (:func:`_in_child`): trio's timers
        tick in milliseconds, this paces in microseconds."""
        fds = [stream.socket.fileno() for stream, _ in pubs]
        interval = 1.0 / rate
        start = time.perf_counter()
        k = 0
        while True:
            due = start + k * interval
            now = time.perf_counter()
            if now - start >= seconds:
                return
            if due > now:
                time.sleep(due - now)
            head, tail = templates[k % npubs][0]
            data = head + str(time.perf_counter_ns()).rjust(STAMP_DIGITS).encode() + tail
            while data:
                try:
                    data = data[os.write(fds[k % npubs], data):]
                except BlockingIOError:  # the socket is trio's (non-blocking)
                    time.sleep(0.0001)
                except OSError as exc:
                    if exc.errno != errno.EINTR:
                        raise
            k += 1

    # The generator's own collector pauses would be measured as broker latency.
    gc.disable()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            c0 = target.cpu_seconds()
            start = trio.current_time()
            if shape == "isolated":
                if ISOLATED_SENDER == "process":
                    pid = _in_child(isolated)
                    _, status = await trio.to_thread.run_sync(os.waitpid, pid, 0)
                    if status:
                        raise RuntimeError(f"the probe's sender failed (wait status {status})")
                else:
                    await trio.to_thread.run_sync(isolated)
            else:
                await bursts()
            elapsed = trio.current_time() - start
            c1 = target.cpu_seconds()
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
    finally:
        gc.enable()
    await sub.aclose()
    for pub, _ in pubs:
        await pub.aclose()
    return (c1 - c0) / elapsed if c0 is not None and c1 is not None else None


async def latency(target: Target, rate: int, seconds: float, shape: str = "latency") -> Latency:
    """p50 and p99 of the probe (:func:`probe`), in milliseconds."""
    pairs: list[tuple[int, int]] = []
    cpu = await probe(target, rate, seconds, lambda sent, got: pairs.append((sent, got)), shape)
    q = statistics.quantiles([(got - sent) / 1e6 for sent, got in pairs], n=100)
    runs = stalls(pairs)
    return Latency(q[49], q[98], len(pairs), cpu, len(runs),
                   (runs[0][1] - runs[0][0]) / 1e6 if runs else 0.0)


def idle_memory(target: Target, count: int = IDLE_CONNECTIONS) -> float:
    """Resident bytes per idle connection: RSS growth with ``count`` connections open."""
    assert target.rss is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 1000), hard))
    time.sleep(0.5)
    before = target.rss()
    socks: list[socket.socket] = []
    try:
        for first in range(0, count, IDLE_BATCH):
            batch = []
            for i in range(first, min(count, first + IDLE_BATCH)):
                s = socket.create_connection(target.client.addr, timeout=30)
                hello, done = target.client.idle_handshake(i)
                s.sendall(hello)
                batch.append((s, done))
            for s, done in batch:
                data = b""
                while not done(data):
                    chunk = s.recv(65536)
                    if not chunk:
                        raise RuntimeError(f"{target.name} closed idle connection {len(socks)}")
                    data += chunk
                socks.append(s)
        time.sleep(1.0)
        after = target.rss()
    finally:
        for s in socks:
            s.close()
    return (after - before) / count


# --------------------------------------------------------------------------
# The run and its table
# --------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _fmt_rate(v: float | None) -> str:
    return f"{v:,.0f}" if v is not None else "-"


async def run(targets: list[Target], scenarios: list[str], rounds: int, seconds: float,
              rate: int, latency_seconds: float, memory: bool) -> dict[str, Any]:
    """Run everything interleaved; print progress and the final table; return the medians."""
    names = [t.name for t in targets]
    rates: dict[tuple[str, str], list[Rate]] = {}
    lats: dict[tuple[str, str], list[Latency]] = {}
    mem: dict[str, float] = {}
    # Latency first, on brokers that have not routed anything yet: right after
    # a throughput case a Skan broker is still busy with its aftermath (the
    # routing-log backlog, closed connections), which would be measured as
    # latency.  Each later case starts with the target's settle().
    # Memory after latency (10,000 connections opening and closing are work
    # too) and before the throughput cases (whose garbage the heap would reuse).
    phases = [s for s in scenarios if s in LATENCY_SHAPES] + ["memory"] * memory \
        + [s for s in scenarios if s not in LATENCY_SHAPES]
    for scenario in phases:
        if scenario == "memory":
            for t in targets:
                if t.rss is not None:
                    mem[t.name] = idle_memory(t)
                    print(f"  memory  {t.name:<12} {mem[t.name] / 1024:8.1f} KB per idle "
                          f"connection ({IDLE_CONNECTIONS:,} connections)", flush=True)
            continue
        for r in range(rounds):
            order = targets[r % len(targets):] + targets[:r % len(targets)]
            if scenario in LATENCY_SHAPES:
                for t in order:
                    lat = await latency(t, rate, latency_seconds, scenario)
                    lats.setdefault((scenario, t.name), []).append(lat)
                    print(f"  round {r + 1} {scenario:<8} {t.name:<12} p50 {lat.p50:.3f} ms "
                          f"p99 {lat.p99:.3f} ms  cpu {lat.cpu or 0:.0%}  slowest 1 % in "
                          f"{lat.stalls} stall(s), longest {lat.longest_stall:.1f} ms", flush=True)
                continue
            groups, pubs, subs = SCENARIOS[scenario]
            for t in order:
                res = await flood(t, groups, pubs, subs, seconds)
                rates.setdefault((scenario, t.name), []).append(res)
                print(f"  round {r + 1} {scenario:<8} {t.name:<12} "
                      f"{res.deliveries_per_s:>12,.0f} deliveries/s  cpu {res.cpu or 0:.0%}",
                      flush=True)
    return _table(names, scenarios, rates, lats, mem, rate)


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _table(names: list[str], scenarios: list[str], rates: dict[tuple[str, str], list[Rate]],
           lats: dict[tuple[str, str], list[Latency]], mem: dict[str, float], rate: int
           ) -> dict[str, Any]:
    anchors = [a for a in ("mosquitto", "nats") if a in names]
    products = [n for n in names if n not in anchors]
    summary: dict[str, Any] = {}
    head = ["scenario"] + names + [f"{p}/{a}" for p in products for a in anchors]
    rows = [head]
    for per_cpu in (False, True):
        for scenario in scenarios:
            if scenario in LATENCY_SHAPES:
                continue
            med = {n: _median([x.per_cpu_second if per_cpu else x.deliveries_per_s
                               for x in rates.get((scenario, n), [])]) for n in names}
            label = f"{scenario} {'per CPU-s' if per_cpu else 'deliv/s'}"
            summary[label] = med
            rows.append([label] + [_fmt_rate(med[n]) for n in names]
                        + [_ratio(med[p], med[a]) for p in products for a in anchors])
    for shape in LATENCY_SHAPES:
        if not any(k[0] == shape for k in lats):
            continue
        kind = "bursts" if shape == "latency" else "isolated"
        for q in ("p50", "p99", "cpu"):
            med = {n: _median([getattr(x, q) for x in lats.get((shape, n), [])]) for n in names}
            if q == "cpu":
                # Broker CPU per message (all its threads): share of a core / rate.
                med = {n: None if v is None else v / rate * 1e6 for n, v in med.items()}
                label = f"{kind} CPU us/msg @{rate // 1000}k/s"
                cells = [f"{med[n]:.1f}" if med[n] is not None else "-" for n in names]
            else:
                label = f"{kind} {q} ms @{rate // 1000}k/s"
                cells = [f"{med[n]:.3f}" if med[n] is not None else "-" for n in names]
            summary[label] = med
            rows.append([label] + cells
                        + [_ratio(med[p], med[a]) for p in products for a in anchors])
    if mem:
        label = f"KB per idle conn ({IDLE_CONNECTIONS // 1000}k)"
        med = {n: mem.get(n) for n in names}
        summary[label] = med
        rows.append([label] + [f"{med[n] / 1024:.1f}" if med[n] is not None else "-"
                               for n in names]
                    + [_ratio(med[p], med[a]) for p in products for a in anchors])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    print()
    for i, row in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) if j == 0 else c.rjust(w)
                                for j, (c, w) in enumerate(zip(row, widths, strict=True)))
              + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print("\nRatios are product/anchor within this run (throughput: higher is better; "
          "latency and memory: lower is better).")
    summary["paired"] = _paired(products, lats, rate)
    return summary


def _paired(products: list[str], lats: dict[tuple[str, str], list[Latency]], rate: int
            ) -> dict[str, list[float]]:
    """Print and return each round's own ratio of a latency figure to its reference.

    The pairs: each product over NATS, and the default ``skan`` over each
    ``skan-noX`` broker (what feature X costs: on / off).  A round's pair was
    measured minutes apart at most, so these ratios move less with the
    machine's phase than the ratio of the medians in the table above;
    their median is printed beside them.
    """
    pairs = [(p, "nats") for p in products] + [
        ("skan", p) for p in products if p.startswith("skan-no")]
    out: dict[str, list[float]] = {}
    lines = []
    for shape in LATENCY_SHAPES:
        kind = "bursts" if shape == "latency" else "isolated"
        for q in ("p99", "cpu"):
            for a, b in pairs:
                xs, ys = lats.get((shape, a), []), lats.get((shape, b), [])
                ratios = [getattr(x, q) / getattr(y, q) for x, y in zip(xs, ys, strict=False)
                          if getattr(x, q) and getattr(y, q)]
                if not ratios:
                    continue
                label = f"{kind} {q if q == 'p99' else 'CPU'} {a}/{b}"
                out[label] = ratios
                lines.append(f"  {label:<40} " + " ".join(f"{r:.2f}" for r in ratios)
                             + f"  (median {statistics.median(ratios):.2f}x)")
    if lines:
        print(f"\nPer-round ratios at {rate:,} msgs/s (each round's pair measured in turn):")
        print("\n".join(lines))
    return out
