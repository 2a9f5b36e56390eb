"""The generic bridges service: each bridge guarded on its own, runners looked up per protocol."""

from __future__ import annotations

import pytest
import trio

from broker.app.configured_bridges import RUNNERS, serve_bridges
from broker.core.router import Router
from broker.serving.config import BridgeSection, Config
from broker.serving.context import BrokerContext

pytestmark = pytest.mark.trio


async def test_a_crashing_bridge_is_restarted_and_never_stops_the_others(monkeypatch):
    calls = {"bad": 0, "good": 0}

    async def bad(ctx, cfg, status):
        calls["bad"] += 1
        raise RuntimeError("boom")

    async def good(ctx, cfg, status):
        calls["good"] += 1
        status.up = True
        await trio.sleep_forever()

    monkeypatch.setitem(RUNNERS, "hsp", bad)
    monkeypatch.setitem(RUNNERS, "mariner", good)
    monkeypatch.delitem(RUNNERS, "eventer")
    config = Config(bridges=(
        BridgeSection("hsp", "127.0.0.1:1", "g", backoff_max=0.05),
        BridgeSection("mariner", "127.0.0.1:2", "g"),
        BridgeSection("eventer", "127.0.0.1:3", "g"),
    ))
    ctx = BrokerContext(config=config, router=Router())
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_bridges, ctx)
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    status = {s.protocol: s for s in ctx.bridges}
    assert calls["bad"] >= 3 and calls["good"] == 1
    assert status["hsp"].last_error == "internal error: RuntimeError('boom')"
    assert status["hsp"].reconnects == calls["bad"] - 1 and not status["hsp"].up
    assert status["mariner"].up
    assert status["eventer"].last_error == "no bridge implementation for protocol 'eventer'"
