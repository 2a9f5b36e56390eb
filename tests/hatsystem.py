"""Real Hat system processes for tests: hat-event-server, hat-monitor, hat-gateway.

Each runs from its own cached virtualenv (tests/peerenv.py) on loopback ports,
with a JSON configuration written into a temporary directory.  ``HatProcess``
waits until the program listens on its port (or, for a program that only
dials out, until it is running) and stops it with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import time
from typing import Any

from tests.peerenv import HAT_GATEWAY_PEER, HAT_SERVER_PEER, peer_python
from tests.ports import listener_port as free_port

PEERS = pathlib.Path(__file__).resolve().parent / "peers"


def wait_listening(port: int, proc: subprocess.Popen, timeout: float, log: pathlib.Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited ({proc.returncode}) before listening:\n"
                               + log.read_text(errors="replace")[-3000:])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port} after {timeout} s:\n"
                       + log.read_text(errors="replace")[-3000:])


class HatProcess:
    """One Hat program (``python -m MODULE --conf FILE``) in ``workdir``."""

    def __init__(self, requirements: tuple[str, ...], module: str, conf: dict[str, Any],
                 workdir: pathlib.Path, name: str, listen_port: int | None = None) -> None:
        self.requirements = requirements
        self.module = module
        self.conf = conf
        self.workdir = workdir
        self.name = name
        self.listen_port = listen_port
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> HatProcess:
        exe = peer_python(self.requirements)
        conf_path = self.workdir / f"{self.name}.json"
        conf_path.write_text(json.dumps(self.conf))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(exe), "-m", self.module, "--conf", str(conf_path)],
                cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        if self.listen_port is not None:
            wait_listening(self.listen_port, self.proc, timeout, self.log)
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> HatProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def log_conf() -> dict[str, Any]:
    """Warnings and errors on stderr (the process log), nothing else."""
    return {"version": 1,
            "formatters": {"plain": {"format": "%(asctime)s %(name)s %(levelname)s %(message)s"}},
            "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain",
                                    "level": "INFO"}},
            "root": {"level": "INFO", "handlers": ["stderr"]},
            "disable_existing_loggers": False}


def event_server(workdir: pathlib.Path, server_id: int = 1,
                 monitor: dict[str, Any] | None = None) -> HatProcess:
    """hat-event-server 0.9.44 with the LMDB backend keeping latest and both
    timeseries orders of every event type."""
    port = free_port()
    conf: dict[str, Any] = {
        "type": "event", "log": log_conf(), "name": "event-server", "server_id": server_id,
        "backend": {
            "module": "hat.event.backends.lmdb", "db_path": str(workdir / "event.db"),
            "identifier": None, "flush_period": 0.05, "cleanup_period": 3600,
            "conditions": [], "latest": {"subscriptions": [["*"]]},
            "timeseries": [{"order_by": "TIMESTAMP", "subscriptions": [["*"]]},
                           {"order_by": "SOURCE_TIMESTAMP", "subscriptions": [["*"]]}]},
        "modules": [],
        "eventer_server": {"host": "127.0.0.1", "port": port},
    }
    if monitor is not None:
        conf["monitor_component"] = monitor
    return HatProcess(HAT_SERVER_PEER, "hat.event.server", conf, workdir, "event-server", port)


def monitor_server(workdir: pathlib.Path) -> HatProcess:
    """hat-monitor 0.8 alone (no parents, no UI), blessing every ready component."""
    port = free_port()
    conf = {"type": "monitor", "log": log_conf(), "default_algorithm": "BLESS_ALL",
            "group_algorithms": {},
            "server": {"host": "127.0.0.1", "port": port, "default_rank": 1},
            "master": {"host": "127.0.0.1", "port": free_port()},
            "slave": {"parents": [], "connect_timeout": 1, "connect_retry_count": 1,
                      "connect_retry_delay": 1}}
    return HatProcess(HAT_GATEWAY_PEER, "hat.monitor.server", conf, workdir, "monitor", port)


# The Modbus master device of the gateway tests: one remote device (id 1)
# with one holding register polled every 0.1 s.
GATEWAY_NAME = "gw"
DEVICE = "dev1"
PREFIX = ("gateway", "modbus_master", DEVICE)


def gateway(workdir: pathlib.Path, event_server_conf: dict[str, Any], slave_port: int,
            name: str = "gateway") -> HatProcess:
    """hat-gateway 0.6 with a Modbus TCP master device polling ``slave_port``.

    ``event_server_conf``: ``{"eventer_server": {...}}`` (direct) or
    ``{"monitor_component": {...}}`` (through hat-monitor).
    """
    device = {
        "module": "hat.gateway.devices.modbus.master", "name": DEVICE,
        "connection": {
            "modbus_type": "TCP",
            "transport": {"type": "TCP", "host": "127.0.0.1", "port": slave_port},
            "connect_timeout": 2, "connect_delay": 0.2, "request_timeout": 1,
            "request_delay": 0, "request_retry_immediate_count": 1,
            "request_retry_delayed_count": 1, "request_retry_delay": 0.2},
        "remote_devices": [{
            "device_id": 1, "timeout_poll_delay": 0.2,
            "data": [{"name": "value", "interval": 0.1, "data_type": "HOLDING_REGISTER",
                      "start_address": 0, "bit_offset": 0, "bit_count": 16}]}],
    }
    conf = {"type": "gateway", "log": log_conf(), "name": GATEWAY_NAME,
            "event_server": event_server_conf, "devices": [device]}
    return HatProcess(HAT_GATEWAY_PEER, "hat.gateway", conf, workdir, name)


__all__ = ["HAT_GATEWAY_PEER", "HatProcess", "event_server", "free_port", "gateway",
           "log_conf", "monitor_server"]
