"""bridge_route (broker/serving/bridge_runner.py): a bridge's refusals are logged
once per kind, then only counted, and raised for the bridge to answer."""

from __future__ import annotations

import hashlib
import logging

import pytest

from broker.core.auth import Authenticator, Permissions, User
from broker.core.inject import build_send
from broker.core.refusals import FrameTooLarge, NotPermitted
from broker.core.router import Endpoint, Routed, Router
from broker.serving.bridge_runner import BridgeStatus, bridge_route


class Sink(Endpoint):
    protocol = "hsp-bridge"

    def deliver(self, frame: bytes, routed: Routed) -> None:
        pass


def test_each_kind_logged_once_then_counted_and_raised(caplog):
    router = Router(hostname="t", max_frame=200)
    perms = Permissions("b", ["telemetry"], [])
    router.enforcer.auth = Authenticator(
        [User("b", hashlib.sha256(b"t").digest(), perms, None)], allow_anonymous=False)
    ep = Sink()
    router.attach(ep)
    router.enforcer.login_bridge(ep, "b")
    status = BridgeStatus("bridge-1", "hsp", "127.0.0.1:1")
    big = build_send(ep.lname, b"telemetry", b"i", 1, b"x" * 300)
    caplog.set_level(logging.WARNING, logger="broker.serving.bridge_runner")
    for _ in range(3):
        with pytest.raises(FrameTooLarge):
            bridge_route(router, ep, big, status)
        with pytest.raises(NotPermitted):
            bridge_route(router, ep, build_send(ep.lname, b"cmd", b"i", 2, None), status)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["bridge bridge-1"] * 2
    assert status.received == 0 and "may not send" in status.last_error
    assert router.counters.permission_denied == {"hsp-bridge:publish": 3}
    assert router.counters.errors == {"hsp-bridge:too-large": 3}
    bridge_route(router, ep, build_send(ep.lname, b"telemetry", b"i", 3, None), status)
    assert status.received == 1 and router.counters.msgs_in == 1
