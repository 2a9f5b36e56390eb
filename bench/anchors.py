"""Reference brokers for the comparison benchmark: Mosquitto (MQTT) and NATS.

Each anchor is the Debian package's server, started on a free port with a
throw-away configuration, and driven over raw sockets exactly like the Skan
broker: publishers write large buffers of identical pre-encoded frames
(MQTT QoS 0 PUBLISH; NATS ``PUB``), subscribers count received bytes and
divide by the size of one delivered frame.  No client library sits between
the benchmark and either server, so all three are measured the same way.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable

import trio

from tests.debian import ensure_binary

# Builds one publish frame from (payload, sequence number).
FrameMaker = Callable[[bytes, int], bytes]

def ensure_installed(package: str) -> str:
    """Path of an anchor's server binary (the Debian package, installed when missing).

    The same helper the tests use for their Debian peers; raises RuntimeError
    (the benchmark never silently drops an anchor) when it cannot be installed.
    """
    return ensure_binary(package, package)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up (status {proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server did not listen on port {port} within {timeout:.0f}s")


def stop_server(proc: subprocess.Popen | None, work: pathlib.Path | None) -> None:
    """SIGTERM (then SIGKILL after 15 s) a server this benchmark started; remove its files."""
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if work is not None:
        # A benchmark run logs gigabytes of routing records: never leave them behind.
        shutil.rmtree(work, ignore_errors=True)


class Server:
    """A subprocess server with CPU and memory readings from /proc."""

    name = "server"

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.work: pathlib.Path | None = None
        self.addr: tuple[str, int] = ("127.0.0.1", 0)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_seconds(self) -> float | None:
        if self.proc is None:
            return None
        return proc_cpu_seconds(self.proc.pid)

    def rss(self) -> int:
        return proc_rss(self.pid)

    def __exit__(self, *exc: object) -> None:
        stop_server(self.proc, self.work)


def proc_cpu_seconds(pid: int, children: bool = False) -> float:
    """User plus system CPU of a process, all threads included; with ``children``,
    also its child processes' (live ones and those it waited for): the broker's
    store writer process ([store] writer = "process") is part of its cost."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for kid in kids:
                try:
                    return_fields = pathlib.Path(f"/proc/{kid}/stat").read_text()
                except OSError:
                    continue
                kf = return_fields.rsplit(")", 1)[1].split()
                ticks += int(kf[11]) + int(kf[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def proc_rss(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Mosquitto(Server):
    name = "mosquitto"

    def __enter__(self) -> Mosquitto:
        binary = ensure_installed("mosquitto")
        self.work = pathlib.Path(tempfile.mkdtemp(prefix="skan-bench-mosquitto-"))
        os.chmod(self.work, 0o755)  # mosquitto drops root privileges before reading it
        port = free_port()
        conf = self.work / "mosquitto.conf"
        conf.write_text(
            f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            "log_dest none\nmax_connections -1\nset_tcp_nodelay true\n"
        )
        os.chmod(conf, 0o644)
        self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_listening(port, self.proc)
        self.addr = ("127.0.0.1", port)
        return self


class Nats(Server):
    name = "nats"

    def __enter__(self) -> Nats:
        binary = ensure_installed("nats-server")
        port = free_port()
        self.proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(port, self.proc)
        self.addr = ("127.0.0.1", port)
        return self


# --------------------------------------------------------------------------
# MQTT 3.1.1 over raw sockets (only what the benchmark sends and receives)
# --------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _mqtt_str(s: bytes) -> bytes:
    return len(s).to_bytes(2, "big") + s


def mqtt_connect(client_id: bytes) -> bytes:
    # Protocol name, level 4 (3.1.1), clean session, keep-alive 0 (off).
    body = _mqtt_str(b"MQTT") + b"\x04\x02\x00\x00" + _mqtt_str(client_id)
    return b"\x10" + _varint(len(body)) + body


def mqtt_subscribe(topic: bytes) -> bytes:
    body = b"\x00\x01" + _mqtt_str(topic) + b"\x00"  # packet id 1, QoS 0
    return b"\x82" + _varint(len(body)) + body


def mqtt_publish(topic: bytes, payload: bytes) -> bytes:
    """A QoS 0 PUBLISH: what the server forwards to a subscriber is the same bytes."""
    body = _mqtt_str(topic) + payload
    return b"\x30" + _varint(len(body)) + body


MQTT_PINGREQ = b"\xc0\x00"


class MqttParser:
    """Incremental MQTT packet splitter; returns PUBLISH payloads."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self.buf + data
        out = []
        pos = 0
        while len(buf) - pos >= 2:
            n = 0
            shift = 0
            i = pos + 1
            while True:
                if i >= len(buf):
                    self.buf = buf[pos:]
                    return out
                b = buf[i]
                n |= (b & 0x7F) << shift
                shift += 7
                i += 1
                if not b & 0x80:
                    break
            if i + n > len(buf):
                break
            if buf[pos] & 0xF0 == 0x30:
                tlen = int.from_bytes(buf[i:i + 2], "big")
                out.append(buf[i + 2 + tlen:i + n])
            pos = i + n
        self.buf = buf[pos:]
        return out


async def _read_exactly(stream: trio.SocketStream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await stream.receive_some(n - len(data))
        if not chunk:
            raise RuntimeError("server closed the connection during set-up")
        data += chunk
    return data


_client_ids = iter(range(1, 1 << 62))


class MqttClient:
    """Publisher/subscriber set-up on Mosquitto; frames for the load generator."""

    name = "mosquitto"

    def __init__(self, server: Server) -> None:
        self.addr = server.addr

    async def _connect(self) -> trio.SocketStream:
        stream = await trio.open_tcp_stream(*self.addr)
        await stream.send_all(mqtt_connect(b"bench-%d-%d" % (os.getpid(), next(_client_ids))))
        connack = await _read_exactly(stream, 4)
        if connack[0] != 0x20 or connack[3] != 0:
            raise RuntimeError(f"MQTT connection refused: {connack!r}")
        return stream

    async def publisher(self, group: str) -> tuple[trio.SocketStream, FrameMaker]:
        topic = group.encode()
        return await self._connect(), lambda payload, seq: mqtt_publish(topic, payload)

    async def subscriber(self, group: str) -> trio.SocketStream:
        stream = await self._connect()
        await stream.send_all(mqtt_subscribe(group.encode()))
        suback = await _read_exactly(stream, 5)
        if suback[0] != 0x90 or suback[4] & 0x80:
            raise RuntimeError(f"MQTT subscription refused: {suback!r}")
        return stream

    def delivered_size(self, group: str, published: bytes) -> int:
        return len(published)  # a QoS 0 PUBLISH is forwarded unchanged

    def parser(self) -> Callable[[bytes], list[bytes]]:
        return MqttParser().feed

    async def settle(self) -> None:
        await trio.sleep(1.0)

    def idle_handshake(self, i: int) -> tuple[bytes, Callable[[bytes], bool]]:
        """Bytes that make one connection a complete idle client, and when its reply is in."""
        return mqtt_connect(b"idle-%d-%d" % (os.getpid(), i)), lambda data: len(data) >= 4


# --------------------------------------------------------------------------
# NATS text protocol over raw sockets
# --------------------------------------------------------------------------

NATS_CONNECT = b'CONNECT {"verbose":false,"pedantic":false,"echo":false}\r\n'


def nats_pub(subject: bytes, payload: bytes) -> bytes:
    return b"PUB %s %d\r\n%s\r\n" % (subject, len(payload), payload)


def nats_msg_size(subject: bytes, sid: bytes, n: int) -> int:
    """Size of the MSG the server sends a subscriber for an n-byte payload."""
    return len(b"MSG %s %s %d\r\n" % (subject, sid, n)) + n + 2


class NatsParser:
    """Incremental splitter for server-to-client NATS traffic; returns MSG payloads."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self.buf + data
        out = []
        pos = 0
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            line = buf[pos:eol]
            if line.startswith(b"MSG "):
                n = int(line.rsplit(b" ", 1)[1])
                if eol + 2 + n + 2 > len(buf):
                    break
                out.append(buf[eol + 2:eol + 2 + n])
                pos = eol + 2 + n + 2
            else:
                pos = eol + 2
        self.buf = buf[pos:]
        return out


class NatsClient:
    name = "nats"

    def __init__(self, server: Server) -> None:
        self.addr = server.addr

    async def _connect(self) -> trio.SocketStream:
        stream = await trio.open_tcp_stream(*self.addr)
        await stream.send_all(NATS_CONNECT)
        await self._barrier(stream)
        return stream

    async def _barrier(self, stream: trio.SocketStream) -> None:
        """PING/PONG: the server has handled everything this connection sent before."""
        await stream.send_all(b"PING\r\n")
        data = b""
        while b"PONG\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                raise RuntimeError("NATS closed the connection during set-up")
            data += chunk
            if b"-ERR" in data:
                raise RuntimeError(f"NATS error: {data!r}")

    async def publisher(self, group: str) -> tuple[trio.SocketStream, FrameMaker]:
        subject = group.encode()
        return await self._connect(), lambda payload, seq: nats_pub(subject, payload)

    async def subscriber(self, group: str) -> trio.SocketStream:
        stream = await self._connect()
        await stream.send_all(b"SUB %s 1\r\n" % group.encode())
        await self._barrier(stream)
        return stream

    def delivered_size(self, group: str, published: bytes) -> int:
        payload = len(published) - len(published.split(b"\r\n", 1)[0]) - 4
        return nats_msg_size(group.encode(), b"1", payload)

    def parser(self) -> Callable[[bytes], list[bytes]]:
        return NatsParser().feed

    async def settle(self) -> None:
        await trio.sleep(1.0)

    def idle_handshake(self, i: int) -> tuple[bytes, Callable[[bytes], bool]]:
        # The PONG (after the server's INFO) proves CONNECT was handled.
        return NATS_CONNECT + b"PING\r\n", lambda data: b"PONG\r\n" in data
