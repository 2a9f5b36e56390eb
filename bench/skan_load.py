"""Load generator for a live broker: pre-encoded frames out, delivered bytes counted.

The client must not be the bottleneck, so publishers write large buffers of
identical pre-encoded frames and subscribers only count received bytes
(deliveries = bytes / frame size).  Other benchmarks (HSP, Eventer, metrics
on/off, routing log on/off) reuse these pieces.
"""

from __future__ import annotations

import os
import pathlib
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import attrs
import trio

from bench.anchors import FrameMaker, proc_cpu_seconds, proc_rss, stop_server
from wire.skan import FrameSplitter, decode, decode_header, encode_frame, item_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAYLOAD = 100  # bytes of msg DATA per message
BATCH = 2000  # frames per publisher write


@attrs.define
class Result:
    scenario: str
    msgs_per_s: float
    deliveries_per_s: float
    seconds: float
    broker_cpu: float | None = None

    def line(self) -> str:
        cpu = f"  broker cpu {self.broker_cpu:.0%}" if self.broker_cpu is not None else ""
        return (f"{self.scenario:<8} {self.msgs_per_s:>12,.0f} msgs/s routed "
                f"{self.deliveries_per_s:>12,.0f} deliveries/s{cpu}")


class Broker:
    """Start ``python -m broker`` with a config, or point at a running one."""

    def __init__(self, config: str = "", address: tuple[str, int] | None = None,
                 root: pathlib.Path = ROOT, env: dict[str, str] | None = None,
                 module: str = "broker") -> None:
        self.config = config
        # What ``python -m`` runs: the broker, or a wrapper that instruments it.
        self.module = module
        self.address = address
        # The source tree the broker runs from: another checkout gives a
        # before/after comparison in one interleaved run.
        self.root = root
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.addr: dict[str, tuple[str, int]] = {}
        self.work: pathlib.Path | None = None

    def __enter__(self) -> Broker:
        if self.address:
            self.addr["skan"] = self.address
            return self
        work = self.work = pathlib.Path(tempfile.mkdtemp(prefix="skan-bench-"))
        (work / "broker.toml").write_text(self.config)
        env = {**os.environ, **self.env, "PYTHONPATH": str(self.root)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--config", str(work / "broker.toml"),
             "--skan-port", "0", "--hsp-port", "0", "--eventer-port", "0",
             "--mariner-port", "0", "--metrics-port", "0", "--log-dir", str(work / "log"),
             "--log-level", "WARNING"],
            stdout=subprocess.PIPE, bufsize=0, env=env, cwd=work,
        )
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        out = b""
        deadline = time.monotonic() + 30
        # Every 'listening' line is written in one flush once all listeners
        # are up: read until the skan line is in and nothing more follows.
        while time.monotonic() < deadline:
            done = b"listening skan" in out and out.endswith(b"\n")
            if not select.select([fd], [], [], 0.2 if done else 1.0)[0]:
                if done:
                    break
                if self.proc.poll() is not None:
                    raise RuntimeError("broker exited during start-up")
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("broker exited during start-up")
            out += chunk
        for line in out.decode().splitlines():
            if line.startswith("listening "):
                _, proto, hostport = line.split()
                host, _, port = hostport.rpartition(":")
                self.addr[proto] = (host, int(port))
        return self

    def cpu_seconds(self) -> float | None:
        if self.proc is None:
            return None
        return proc_cpu_seconds(self.proc.pid, children=True)

    def rss(self) -> int:
        assert self.proc is not None, "memory is measured on a broker this benchmark started"
        return proc_rss(self.proc.pid)

    def __exit__(self, *exc: object) -> None:
        stop_server(self.proc, self.work)


async def raw_connect(addr: tuple[str, int]) -> tuple[trio.SocketStream, bytes]:
    stream = await trio.open_tcp_stream(*addr)
    await stream.send_all(encode_frame({"type": "getlname"}))
    splitter = FrameSplitter(1 << 20)
    while True:
        frames = splitter.receive_data(await stream.receive_some(4096))
        if frames:
            return stream, decode(frames[0][4:])[b"lname"]


async def barrier(stream: trio.SocketStream) -> None:
    """getlname round trip: the broker has handled everything sent before it."""
    await stream.send_all(encode_frame({"type": "getlname"}))
    splitter = FrameSplitter(1 << 20)
    while not splitter.receive_data(await stream.receive_some(4096)):
        pass


def send_frame(lname: bytes, group: str, payload: bytes, seq: int = 1) -> bytes:
    return encode_frame({"type": "send", "from": lname, "to": "*", "group": group,
                         "instance": "*", "seq": str(seq), "msg": payload})


async def subscribe(addr: tuple[str, int], group: str) -> trio.SocketStream:
    stream, _ = await raw_connect(addr)
    await stream.send_all(encode_frame({"type": "subscribe", "group": group, "instance": "*"}))
    await barrier(stream)
    return stream


async def throughput(addr: tuple[str, int], publishers: int, subscribers: int,
                     seconds: float, broker: Broker | None = None, warmup: float = 1.0,
                     label: str | None = None) -> Result:
    """Publishers flood one group; subscribers count bytes.  Returns measured rates."""
    group = f"bench-{publishers}-{subscribers}-{time.monotonic_ns()}"
    subs = [await subscribe(addr, group) for _ in range(subscribers)]
    pubs = [await raw_connect(addr) for _ in range(publishers)]
    frame_size = len(send_frame(pubs[0][1], group, b"x" * PAYLOAD))
    received = [0] * subscribers
    window: dict[str, float] = {}

    async def publish(stream: trio.SocketStream, lname: bytes) -> None:
        buf = send_frame(lname, group, b"x" * PAYLOAD) * BATCH
        while True:
            await stream.send_all(buf)

    async def count(i: int, stream: trio.SocketStream) -> None:
        while True:
            data = await stream.receive_some(1 << 20)
            if not data:
                raise RuntimeError("broker closed a benchmark subscriber (slow consumer?)")
            received[i] += len(data)

    async with trio.open_nursery() as nursery:
        for i, s in enumerate(subs):
            nursery.start_soon(count, i, s)
        for stream, lname in pubs:
            nursery.start_soon(publish, stream, lname)
        await trio.sleep(warmup)
        b0, t0 = sum(received), time.perf_counter()
        c0 = broker.cpu_seconds() if broker else None
        await trio.sleep(seconds)
        b1, t1 = sum(received), time.perf_counter()
        c1 = broker.cpu_seconds() if broker else None
        window["dt"] = t1 - t0
        nursery.cancel_scope.cancel()
    for s in subs:
        await s.aclose()
    for s, _ in pubs:
        await s.aclose()
    deliveries = (b1 - b0) / frame_size / window["dt"]
    cpu = (c1 - c0) / window["dt"] if c0 is not None and c1 is not None else None
    return Result(label or f"{publishers}->{subscribers}", deliveries / subscribers, deliveries,
                  window["dt"], cpu)


async def stats(stream: trio.SocketStream) -> dict[bytes, object]:
    await stream.send_all(encode_frame({"type": "stats"}))
    splitter = FrameSplitter(1 << 20)
    while True:
        frames = splitter.receive_data(await stream.receive_some(65536))
        if frames:
            return decode(frames[0][4:])[b"stats"]


async def settle(addr: tuple[str, int], quiet: float = 0.5, timeout: float = 30.0) -> None:
    """Wait until the broker routes nothing for ``quiet`` seconds.

    After a throughput scenario the kernel still holds megabytes the closed
    publishers sent; the broker routes them for a while, and a latency
    measurement taken meanwhile would measure that backlog, not latency.
    """
    stream, _ = await raw_connect(addr)
    with trio.move_on_after(timeout):
        last = (await stats(stream))[b"messages_in"]
        while True:
            await trio.sleep(quiet)
            now = (await stats(stream))[b"messages_in"]
            if now == last:
                break
            last = now
    await stream.aclose()


def _frames_done(data: bytes) -> bool:
    return len(data) >= 4 and len(data) >= 4 + int.from_bytes(data[:4], "big")


class SkanClient:
    """The Skan side of the comparison benchmark (same interface as the anchors' clients)."""

    name = "skan"

    def __init__(self, broker: Broker, name: str = "skan") -> None:
        self.addr = broker.addr["skan"]
        self.name = name

    async def publisher(self, group: str) -> tuple[trio.SocketStream, FrameMaker]:
        stream, lname = await raw_connect(self.addr)
        return stream, lambda payload, seq: send_frame(lname, group, payload, seq)

    async def subscriber(self, group: str) -> trio.SocketStream:
        return await subscribe(self.addr, group)

    def delivered_size(self, group: str, published: bytes) -> int:
        return len(published)  # forwarded byte-for-byte

    def parser(self) -> Callable[[bytes], list[bytes]]:
        splitter = FrameSplitter(1 << 20)

        # The compiled header scanner: the full Python decoder costs about
        # 10 us a frame, CPU the latency probe's client would take from the
        # broker on a two-core machine (a NATS MSG line parses in 0.8 us).
        def feed(data: bytes) -> list[bytes]:
            return [item_bytes(f, decode_header(f, 4), b"msg")
                    for f in splitter.receive_data(data)]

        return feed

    async def settle(self) -> None:
        await settle(self.addr)

    def idle_handshake(self, i: int) -> tuple[bytes, Callable[[bytes], bool]]:
        return encode_frame({"type": "getlname"}), _frames_done
