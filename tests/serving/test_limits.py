"""Listener limits of BROKER-SPEC section 9 over real sockets, each with a bystander pair.

max_connections (broker-wide and per listener) with every protocol's refusal,
handshake_timeout, frame_timeout, the descriptor limit raised at start (and
max_connections fitted to it), and accept() running out of descriptors.
Every test checks that a bystander publisher/subscriber pair keeps routing.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import time
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from broker.app import lifecycle as app
from broker.serving.config import ConfigError, from_mapping
from tests.brokerproc import BrokerProcess
from tests.rawskan import RawSkan
from wire.skan import decode, encode_frame

GROUP = "bystander"


class Bystander:
    """A publisher and a subscriber on one group: proves routing goes on undisturbed."""

    def __init__(self, pub: RawSkan, sub: RawSkan, lname: bytes) -> None:
        self.pub = pub
        self.sub = sub
        self.lname = lname
        self.seq = 0

    @classmethod
    async def open(cls, addr: tuple[str, int]) -> Bystander:
        pub, sub = await RawSkan.open(addr), await RawSkan.open(addr)
        lname = await pub.getlname()
        await sub.getlname()
        await sub.send({"type": "subscribe", "group": GROUP, "instance": "*"})
        await sub.getlname()  # barrier: the subscription is in place
        return cls(pub, sub, lname)

    async def check(self, timeout: float = 2.0) -> float:
        """Route one message through the pair; return how long it took."""
        self.seq += 1
        started = time.monotonic()
        await self.pub.send({"type": "send", "group": GROUP, "instance": "i", "to": "*",
                             "from": self.lname, "seq": self.seq, "msg": "ping"})
        got = await self.sub.message(timeout)
        assert got[b"seq"] == str(self.seq).encode()
        return time.monotonic() - started

    async def aclose(self) -> None:
        await self.pub.aclose()
        await self.sub.aclose()


async def http_get(addr: tuple[str, int], path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(*addr)
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
                              .encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
        await stream.aclose()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def metric_samples(addr: tuple[str, int]) -> dict[tuple[str, tuple], float]:
    status, body = await http_get(addr, "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def wait_eof(stream: trio.SocketStream, timeout: float) -> bytes:
    """Read until the broker closes; return everything it sent."""
    data = b""
    with trio.fail_after(timeout):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return data
            if not chunk:
                return data
            data += chunk


def config(**broker: Any) -> str:
    lines = ["[broker]"] + [f"{k} = {json.dumps(v)}" for k, v in broker.items()]
    return "\n".join(lines) + "\n[log]\nenabled = false\n"


# ---- handshake_timeout ---------------------------------------------------------------------


async def test_silent_connections_are_closed_after_the_handshake_timeout():
    with BrokerProcess(config(handshake_timeout=1.0)) as broker:
        bystander = await Bystander.open(broker.skan)
        silent: list[tuple[str, trio.SocketStream, float]] = []
        for proto, n in (("skan", 500), ("hsp", 20), ("eventer", 20), ("mariner", 20)):
            for _ in range(n):
                silent.append((proto, await trio.open_tcp_stream(*broker.addr[proto]),
                               time.monotonic()))
        # While they sit there, routing is undisturbed.
        assert await bystander.check() < 1.0
        lifetimes: dict[str, list[float]] = {}

        async def closed(proto: str, stream: trio.SocketStream, opened: float) -> None:
            await wait_eof(stream, 10.0)
            lifetimes.setdefault(proto, []).append(time.monotonic() - opened)

        async with trio.open_nursery() as nursery:
            for item in silent:
                nursery.start_soon(closed, *item)
        for proto, n in (("skan", 500), ("hsp", 20), ("eventer", 20), ("mariner", 20)):
            assert len(lifetimes[proto]) == n
            assert min(lifetimes[proto]) >= 0.9, proto
            assert max(lifetimes[proto]) < 6.0, proto
        # The bystander completed its handshake long ago and is still served.
        assert await bystander.check() < 1.0
        samples = await metric_samples(broker.addr["metrics"])
        for proto, n in (("skan", 500), ("hsp", 20), ("eventer", 20), ("mariner", 20)):
            assert sample(samples, "skan_protocol_errors_total", protocol=proto,
                          reason="handshake-timeout") == n
            assert sample(samples, "skan_connections_closed_total", protocol=proto,
                          reason="handshake-timeout") == n
        await bystander.aclose()
    assert not any("Traceback" in line for line in broker.stderr_lines)


# ---- frame_timeout ----------------------------------------------------------------------


async def test_a_trickled_frame_is_closed_after_the_frame_timeout():
    with BrokerProcess(config(frame_timeout=1.0)) as broker:
        bystander = await Bystander.open(broker.skan)
        slow = await RawSkan.open(broker.skan)
        await slow.getlname()
        # A frame announcing 1000 bytes, then one byte every 0.2 s.
        await slow.send_bytes((1000).to_bytes(4, "big") + b"Skan")
        started = time.monotonic()

        async def trickle() -> None:
            try:
                while True:
                    await trio.sleep(0.2)
                    await slow.send_bytes(b"\x00")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            await wait_eof(slow.stream, 10.0)
            lifetime = time.monotonic() - started
            nursery.cancel_scope.cancel()
        assert 0.9 <= lifetime < 4.0
        assert await bystander.check() < 1.0
        samples = await metric_samples(broker.addr["metrics"])
        assert sample(samples, "skan_protocol_errors_total", protocol="skan",
                      reason="frame-timeout") == 1
        await bystander.aclose()


async def test_frames_that_each_complete_in_time_are_never_cut():
    """A peer always in the middle of some frame, but each done within the timeout, stays."""
    with BrokerProcess(config(frame_timeout=1.0)) as broker:
        client = await RawSkan.open(broker.skan)
        await client.getlname()
        frame = encode_frame({"type": "getlname", "seq": "1"})
        half = len(frame) // 2
        # Every write completes one frame and begins the next, for 3 s in all.
        await client.send_bytes(frame[:half])
        for _ in range(8):
            await trio.sleep(0.4)
            await client.send_bytes(frame[half:] + frame[:half])
            assert b"lname" in await client.message()
        await client.send_bytes(frame[half:])
        assert b"lname" in await client.message()
        await client.aclose()


# ---- max_connections ------------------------------------------------------------------


async def test_max_connections_refuses_with_each_protocols_refusal():
    cfg = config(max_connections=8) + "[skan]\nmax_connections = 4\n"
    with BrokerProcess(cfg) as broker:
        bystander = await Bystander.open(broker.skan)  # 2 Skan connections
        others = [await RawSkan.open(broker.skan) for _ in range(2)]
        for c in others:
            await c.getlname()
        # Skan listener full (4): the 5th gets the error frame, then the close.
        refused = await RawSkan.open(broker.skan)
        assert await refused.expect_closed() == [
            {b"type": b"error", b"error": b"too many connections"}]
        # The broker has room for 4 more connections of other protocols.
        hsp = [await trio.open_tcp_stream(*broker.addr["hsp"]) for _ in range(4)]
        await trio.sleep(0.2)
        # HSP: the Skan error frame as DATA Type 1, then the close.
        data = await wait_eof(await trio.open_tcp_stream(*broker.addr["hsp"]), 5.0)
        assert decode(data[3 + 4:]) == {b"type": b"error", b"error": b"too many connections"}
        # Mariner: its error message, then the close.
        data = await wait_eof(await trio.open_tcp_stream(*broker.addr["mariner"]), 5.0)
        m = data[0]
        body = json.loads(data[1 + m:])
        assert body == {"type": "error", "error": "too many connections"}
        # Eventer has no message for it before MsgInitReq: closed.
        assert await wait_eof(await trio.open_tcp_stream(*broker.addr["eventer"]), 5.0) == b""
        assert await bystander.check() < 1.0
        # A slot freed is a slot available again.
        await hsp.pop().aclose()
        await trio.sleep(0.3)
        again = await RawSkan.open(broker.skan)  # Skan itself is still full...
        assert await again.expect_closed() != []
        mariner = await trio.open_tcp_stream(*broker.addr["mariner"])  # ...Mariner is not
        with trio.move_on_after(0.5):
            assert await mariner.receive_some(100) != b""
            raise AssertionError("the freed slot was not given to a new connection")
        samples = await metric_samples(broker.addr["metrics"])
        refusals = {(proto, reason): sample(samples, "skan_connections_refused_total",
                                            protocol=proto, reason=reason)
                    for proto in ("skan", "hsp", "eventer", "mariner")
                    for reason in ("broker-limit", "listener-limit")}
        assert refusals == {
            ("skan", "broker-limit"): 0, ("skan", "listener-limit"): 2,
            ("hsp", "broker-limit"): 1, ("hsp", "listener-limit"): 0,
            ("eventer", "broker-limit"): 1, ("eventer", "listener-limit"): 0,
            ("mariner", "broker-limit"): 1, ("mariner", "listener-limit"): 0,
        }
        await bystander.aclose()


# ---- descriptors ---------------------------------------------------------------------------


def _limits_of(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        lines = f.readlines()
    for line in lines:
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no 'Max open files' line")


def test_the_soft_descriptor_limit_is_raised_to_the_hard_limit_at_start():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 512:
        pytest.skip("needs a finite hard descriptor limit of at least 512")

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    with BrokerProcess(config(), preexec_fn=low_soft_limit) as broker:
        assert broker.proc is not None
        assert _limits_of(broker.proc.pid) == (hard, hard)


async def test_max_connections_is_fitted_to_a_low_hard_limit_and_healthz_keeps_answering():
    def low_hard_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (230, 230))

    with BrokerProcess(config(), preexec_fn=low_hard_limit) as broker:
        # 230 descriptors minus the reserve of 100: 130 client connections.
        assert any("lowered to 130" in line for line in broker.stderr_lines)
        bystander = await Bystander.open(broker.skan)
        clients = [await trio.open_tcp_stream(*broker.skan) for _ in range(140)]
        await trio.sleep(0.5)
        assert (await http_get(broker.addr["metrics"], "/healthz"))[0] == 200
        assert await bystander.check() < 1.0
        samples = await metric_samples(broker.addr["metrics"])
        assert sample(samples, "skan_connections_refused_total", protocol="skan",
                      reason="broker-limit") == 140 + 2 - 130
        for c in clients:
            await c.aclose()
        await bystander.aclose()
    assert not any("Traceback" in line for line in broker.stderr_lines)


async def test_running_out_of_descriptors_is_logged_once_and_clients_keep_being_served(
        caplog, tmp_path):
    caplog.set_level(logging.INFO)
    ports = {s: {"port": 0} for s in ("skan", "hsp", "eventer", "mariner", "metrics")}
    # The store's directory in the test's own (the default is relative: var/store).
    cfg = from_mapping({**ports, "log": {"enabled": False, "dir": str(tmp_path / "log")},
                        "store": {"dir": str(tmp_path / "store")}})
    stop = trio.Event()
    ctx_out: list = []
    addrs: dict[str, tuple[str, int]] = {}

    def ready(lines: list[str]) -> None:
        for line in lines:
            _, proto, hostport = line.split()
            host, _, port = hostport.rpartition(":")
            addrs[proto] = (host, int(port))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: app.run(cfg, ready=ready, stop=stop, ctx_out=ctx_out))
        while "skan" not in addrs:
            await trio.sleep(0.01)
        router = ctx_out[0].router
        bystander = await Bystander.open(addrs["skan"])
        # Sockets made now, connected once no descriptor is left for accept().
        socks = [trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(5)]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        fillers: list[int] = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
        try:
            while True:
                try:
                    fillers.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    break
            for s in socks:
                await s.connect(addrs["skan"])
            streams = [trio.SocketStream(s) for s in socks]
            for s in streams:
                await s.send_all(encode_frame({"type": "getlname"}))
            await trio.sleep(1.5)
            # Existing clients are served all along.
            assert await bystander.check() < 1.0
            assert router.counters.accept_errors >= 5
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        # Descriptors are back: the waiting connections are accepted and answered.
        for s in streams:
            with trio.fail_after(5):
                data = await s.receive_some(65536)
            assert b"lname" in data
        failures = [r for r in caplog.records if "accept failed" in r.getMessage()]
        assert len(failures) == 1
        assert all(r.exc_info is None for r in caplog.records)
        for s in streams:
            await s.aclose()
        await bystander.aclose()
        stop.set()


# ---- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(("table", "key"), [
    ({"broker": {"max_connections": 0}}, "broker.max_connections"),
    ({"broker": {"handshake_timeout": 0}}, "broker.handshake_timeout"),
    ({"broker": {"frame_timeout": -1.0}}, "broker.frame_timeout"),
    ({"skan": {"max_connections": 0}}, "skan.max_connections"),
    ({"mariner": {"max_connections": "many"}}, "mariner.max_connections"),
])
def test_limit_keys_are_validated_with_the_key_named(table, key):
    with pytest.raises(ConfigError) as info:
        from_mapping(table)
    assert info.value.key == key


def test_limit_defaults_follow_the_spec():
    cfg = from_mapping({})
    assert cfg.broker.max_connections == 10_000
    assert cfg.broker.handshake_timeout == 10.0
    assert cfg.broker.frame_timeout == 30.0
    assert cfg.skan.max_connections is None
    assert from_mapping({"hsp": {"max_connections": 5}}).hsp.max_connections == 5
