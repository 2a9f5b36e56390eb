"""The slow-consumer disconnect log's rate limit (broker/serving/transport.py), fake clock."""

from __future__ import annotations

import logging

from broker.core.router import Router
from broker.protocols.skan.listener import SkanEndpoint
from broker.serving.transport import SLOW_LOG_BURST, SLOW_LOG_INTERVAL, SlowConsumerLog


def test_one_line_each_up_to_the_burst_then_the_count_of_those_held_back(caplog):
    now = [0.0]
    slow_log = SlowConsumerLog(clock=lambda: now[0])
    router = Router()
    ep = SkanEndpoint(router, 1 << 22, "disconnect", 1 << 20)
    router.attach(ep)
    ep.unsent = (7, 7000)
    caplog.set_level(logging.WARNING, logger="broker.serving.transport")
    for _ in range(SLOW_LOG_BURST + 5):
        slow_log(ep)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == SLOW_LOG_BURST
    assert ep.lname.decode() in lines[0] and "held 7 frames (7000 bytes;" in lines[0]
    now[0] += SLOW_LOG_INTERVAL
    slow_log(ep)
    last = caplog.records[-1].getMessage()
    assert len(caplog.records) == SLOW_LOG_BURST + 1
    assert last.endswith("(5 more not logged before this one)")
