"""Section 11 with a REAL Hat component: hat-gateway 0.6.48 runs on the broker.

Its Modbus TCP master device polls a slave simulated with hat-drivers on
loopback (tests/peers/modbus_slave.py); nothing needs hardware.  A hat-event
0.9.44 client enables the device and the remote device, the gateway's events
(running, status, reads with their values) reach a Hat subscriber with their
JSON types and a Skan subscriber as the Skan view; a change in the slave is
reported; writes registered by a Hat client and sent by a Skan client
(``payload-json``, docs/eventer.md) reach the slave with their numbers; enable
toggling stops and restarts the device; and the gateway carries on after a
broker restart.  Both of hat-gateway's modes:

- direct (``event_server.eventer_server``): hat-gateway exits when its
  Eventer connection closes (it does so with hat-event-server too) and is
  restarted, as its supervisor would; it finds the device enabled in the
  broker's store and runs it without a new enable;
- through hat-monitor (``event_server.monitor_component``): a real
  hat-monitor 0.8.23, the broker announced in it by a component built with
  hat-monitor's own library (tests/peers/monitor_event_server.py, since the
  broker does not speak hat-monitor's protocol); the gateway reconnects to
  the restarted broker by itself.
"""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.hatpeer import PeerProcess
from tests.hatsystem import PREFIX, free_port, gateway, monitor_server
from tests.peerenv import EVENTER09_PEER, HAT_GATEWAY_PEER

pytestmark = [pytest.mark.trio, pytest.mark.peers]

SERVER_ID = 1
EVENT_GROUP = "event"  # hat-monitor group of the event server (the broker)


def t(*rest: str) -> list[str]:
    return [*PREFIX, *rest]


class HatObserver:
    """A hat-event 0.9.44 client subscribed to the gateway's own events."""

    def __init__(self, peer: PeerProcess) -> None:
        self.peer = peer
        self.seen: list[dict[str, Any]] = []

    async def wait(self, etype: list[str], payload: Any = None, *,
                   where: Callable[[dict], bool] | None = None,
                   timeout: float = 30.0) -> dict[str, Any]:
        """The first event (since the last wait) of ``etype`` whose payload is
        ``payload`` (or passes ``where``)."""
        with trio.move_on_after(timeout):
            while True:
                for i, e in enumerate(self.seen):
                    if e["type"] == etype and (
                            where(e) if where is not None else e["payload"] == payload):
                        del self.seen[:i + 1]
                        return e
                got = await self.peer.call("events", count=1, timeout=1.0, wait=10)
                self.seen += got["events"]
        raise AssertionError(f"no {etype} with {payload} within {timeout} s; "
                             f"seen: {self.seen[-10:]}")


async def register(peer: PeerProcess, etype: list[str], value: Any) -> None:
    res = await peer.call("register", events=[{"type": etype, "payload": {"json": value}}])
    assert res["events"] and res["events"][0]["payload"] == {"json": value}, res


async def skan_wait(client: SkanClient, instance: str, msg: Any, timeout: float = 20.0) -> None:
    """Until a Skan message of ``instance`` with ``msg`` arrives."""
    seen = []
    with trio.move_on_after(timeout):
        while True:
            m = await client.receive()
            if m.instance == instance and m.msg == msg:
                return
            seen.append((m.instance, m.msg))
    raise AssertionError(f"no Skan {instance} {msg}; seen {seen[-10:]}")


def read_value(value: int, cause: str) -> dict[str, Any]:
    return {"json": {"result": "SUCCESS", "value": value, "cause": cause}}


class HatSystem:
    """Broker + simulated slave + hat-gateway (+ hat-monitor), and clients."""

    def __init__(self, tmp: pathlib.Path, mode: str) -> None:
        self.tmp = tmp
        self.mode = mode
        self.eventer_port = free_port()
        self.broker_dir = tmp / "broker"
        self.broker_dir.mkdir()
        self.broker: BrokerProcess | None = None
        self.monitor = None
        self.gw = None

    def start_broker(self) -> BrokerProcess:
        self.broker = BrokerProcess(f"[broker]\nserver_id = {SERVER_ID}\n",
                                    ("--eventer-port", str(self.eventer_port)),
                                    workdir=self.broker_dir).start()
        return self.broker

    def gateway_conf(self) -> dict[str, Any]:
        if self.mode == "direct":
            return {"eventer_server": {"host": "127.0.0.1", "port": self.eventer_port}}
        assert self.monitor is not None
        return {"monitor_component": {"host": "127.0.0.1", "port": self.monitor.listen_port,
                                      "gateway_group": "gateway",
                                      "event_server_group": EVENT_GROUP}}


async def run_scenario(mode: str) -> None:
    with tempfile.TemporaryDirectory(prefix=f"hat-gateway-{mode}-") as tmpdir:
        tmp = pathlib.Path(tmpdir)
        system = HatSystem(tmp, mode)
        system.start_broker()
        slave_port = free_port()
        slave = await PeerProcess.start(HAT_GATEWAY_PEER, "modbus_slave.py", str(slave_port))
        announcer = None
        try:
            assert await slave.line(30) == {"listening": slave_port}
            if mode == "monitor":
                system.monitor = await trio.to_thread.run_sync(
                    monitor_server(tmp).start)
                announcer = await PeerProcess.start(
                    HAT_GATEWAY_PEER, "monitor_event_server.py",
                    str(system.monitor.listen_port), EVENT_GROUP, str(SERVER_ID),
                    str(system.eventer_port))
                assert await announcer.line(30) == {"connected": True}
            system.gw = await trio.to_thread.run_sync(
                gateway(tmp, system.gateway_conf(), slave_port).start)
            await scenario(system, slave)
        finally:
            if announcer is not None:
                announcer.process.kill()
                await announcer.process.wait()
            await slave.aclose()
            for proc in (system.gw, system.monitor):
                if proc is not None:
                    proc.stop()
            if system.broker is not None and system.broker.proc is not None:
                system.broker.stop()
        logs = "".join(system.broker.stderr_lines)
        assert "Traceback" not in logs, logs


async def connect_clients(system: HatSystem):
    port = system.eventer_port
    observer = await PeerProcess.start(EVENTER09_PEER, "eventer09_client.py")
    assert (await observer.call("connect", port=port, name="test/observer",
                                subscriptions=[t("gateway", "*")]))["status"] == "operational"
    commander = await PeerProcess.start(EVENTER09_PEER, "eventer09_client.py")
    assert (await commander.call("connect", port=port, name="test/commander"))[
        "status"] == "operational"
    return HatObserver(observer), commander


async def scenario(system: HatSystem, slave: PeerProcess) -> None:
    assert system.broker is not None and system.gw is not None
    hat, commander = await connect_clients(system)
    async with SkanClient.connect(*system.broker.skan) as skan:
        await skan.subscribe("gateway")

        # Enabled by a Hat client: the device runs and connects to the slave.
        await register(commander, t("system", "enable"), True)
        await hat.wait(t("gateway", "running"), {"json": True})
        await hat.wait(t("gateway", "status"), {"json": "CONNECTED"})
        await register(commander, t("system", "remote_device", "1", "enable"), True)
        await hat.wait(t("gateway", "remote_device", "1", "status"), {"json": "CONNECTED"})
        await hat.wait(t("gateway", "remote_device", "1", "read", "value"),
                       read_value(0, "INTERROGATE"))

        # A change in the device: a number for Hat, the Skan view for Skan.
        assert await slave.call("set", data_type="HOLDING_REGISTER", address=0,
                                value=1234) == {"ok": True}
        await hat.wait(t("gateway", "remote_device", "1", "read", "value"),
                       read_value(1234, "CHANGE"))
        await skan_wait(skan, "modbus_master/dev1/gateway/remote_device/1/read/value",
                        {b"result": b"SUCCESS", b"value": b"1234", b"cause": b"CHANGE"})

        # A write from a Hat client reaches the slave, with its number.
        await register(commander, t("system", "remote_device", "1", "write", "value"),
                       {"request_id": "w1", "value": 4321})
        assert (await slave.call("writes"))["writes"] == [
            {"device_id": 1, "data_type": "HOLDING_REGISTER", "address": 0,
             "values": [4321]}]
        await hat.wait(t("gateway", "remote_device", "1", "write", "value"),
                       {"json": {"request_id": "w1", "result": "SUCCESS"}})

        # ... and from a Skan client, with the payload-json convention.
        await skan.send_event_json("gateway", {"request_id": "w2", "value": 555},
                                   instance="modbus_master/dev1/system/remote_device/1/"
                                            "write/value")
        assert (await slave.call("writes"))["writes"] == [
            {"device_id": 1, "data_type": "HOLDING_REGISTER", "address": 0,
             "values": [555]}]
        await hat.wait(t("gateway", "remote_device", "1", "write", "value"),
                       {"json": {"request_id": "w2", "result": "SUCCESS"}})
        await hat.wait(t("gateway", "remote_device", "1", "read", "value"),
                       read_value(555, "CHANGE"))

        # Enable toggling stops and restarts the device.
        await register(commander, t("system", "enable"), False)
        await hat.wait(t("gateway", "running"), {"json": False})
        await register(commander, t("system", "enable"), True)
        await hat.wait(t("gateway", "running"), {"json": True})
        await hat.wait(t("gateway", "status"), {"json": "CONNECTED"})
    await hat.peer.aclose()
    await commander.aclose()

    # A broker restart (same store, same port).
    await trio.to_thread.run_sync(system.broker.stop)
    if system.mode == "direct":
        # hat-gateway in direct mode exits with its Eventer connection (as
        # with hat-event-server); its supervisor starts it again.
        await trio.to_thread.run_sync(system.gw.proc.wait, 20)
    system.start_broker()
    hat, commander = await connect_clients(system)
    try:
        if system.mode == "direct":
            system.gw.proc = None
            await trio.to_thread.run_sync(system.gw.start)
            # No new enable: the gateway reads both enables back (latest queries).
            await hat.wait(t("gateway", "running"), {"json": True}, timeout=40)
            await hat.wait(t("gateway", "remote_device", "1", "read", "value"),
                           read_value(555, "INTERROGATE"))
        # (Through hat-monitor the gateway reconnects by itself, maybe before
        # these clients subscribed: a change in the device shows it runs.)
        assert await slave.call("set", data_type="HOLDING_REGISTER", address=0,
                                value=7) == {"ok": True}
        await hat.wait(t("gateway", "remote_device", "1", "read", "value"),
                       read_value(7, "CHANGE"), timeout=40)
    finally:
        await hat.peer.aclose()
        await commander.aclose()


async def test_hat_gateway_direct_on_the_broker():
    await run_scenario("direct")


async def test_hat_gateway_through_hat_monitor_on_the_broker():
    await run_scenario("monitor")
