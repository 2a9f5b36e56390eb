"""The slow-consumer policy's bookkeeping on a real router and real Skan endpoints (no sockets)."""

from __future__ import annotations

import pytest

from broker.core.queue import MIN_QUEUE_LIMIT
from broker.core.router import Router
from broker.protocols.skan.listener import SkanEndpoint
from wire.skan import encode_frame

FRAME = 1000


def endpoint(router: Router, policy: str, queue_limit: int = 1 << 22) -> SkanEndpoint:
    ep = SkanEndpoint(router, queue_limit, policy, 1 << 20)
    router.attach(ep)
    ep.on_bytes(encode_frame({"type": "getlname"}))
    ep.queue.take_all()
    return ep


def send(router: Router, pub: SkanEndpoint, n: int) -> None:
    more = pub.on_bytes(b"".join(encode_frame({
        "type": "send", "group": "g", "instance": "*", "to": "*", "from": pub.lname,
        "seq": str(i), "msg": "x" * FRAME}) for i in range(n)))
    while more:  # the handler bounds its work per slice
        more = pub.on_bytes(b"")
    router.end_batch()


@pytest.mark.parametrize("policy", ["disconnect", "drop"])
def test_frames_never_sent_leave_messages_out(policy):
    router = Router()
    pub = endpoint(router, "disconnect")
    slow = endpoint(router, policy, MIN_QUEUE_LIMIT)
    fast = endpoint(router, policy)
    killed: list[str] = []
    slow.kill = lambda reason: (killed.append(reason), router.detach(slow, reason))
    for ep in (slow, fast):
        ep.on_bytes(encode_frame({"type": "subscribe", "group": "g", "instance": "*"}))
        ep.queue.take_all()
    n = 3 * MIN_QUEUE_LIMIT // FRAME  # three times what the slow queue holds
    sent_to_fast = fast_bytes = 0
    for _ in range(n // 100):
        send(router, pub, 100)
        sent_to_fast += len(fast.queue.items)
        fast_bytes += fast.queue.size
        fast.queue.take_all()  # the fast one reads everything
    c = router.counters
    if policy == "disconnect":
        assert killed == ["slow-consumer"] and c.slow_consumer_disconnects == 1
        # Its queue was discarded at once, and nothing of it counts as sent.
        assert slow.queue.size == 0 and slow.unsent[0] > 0
        assert c.msgs_out == sent_to_fast and slow.msgs_out == 0
        assert c.bytes_out == fast_bytes and slow.bytes_out == 0
    else:
        # Still connected: what it holds is counted (it will be sent), the drops are not.
        assert killed == [] and c.dropped > 0
        assert c.msgs_out == sent_to_fast + len(slow.queue.items)
        assert c.bytes_out == fast_bytes + slow.queue.size
        assert slow.msgs_out + slow.dropped == n // 100 * 100
