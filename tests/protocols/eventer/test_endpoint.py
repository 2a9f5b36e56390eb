"""EventerEndpoint flow control and slow-consumer policy on a real router (no sockets)."""

from __future__ import annotations

import attrs

from broker.core.retention import RetentionStore
from broker.core.router import Router
from broker.protocols.eventer.listener import EventerEndpoint, EventerService
from broker.protocols.skan.listener import SkanEndpoint
from broker.serving.config import Config
from broker.serving.context import BrokerContext
from wire.eventer import ClientConnection, EventsNotified, InitReq, InitResult, Status
from wire.skan import encode_frame


class Publisher:
    """A real Skan connection endpoint (no socket) that publishes one routing batch per call."""

    def __init__(self, router: Router) -> None:
        self.ep = SkanEndpoint(router, 1 << 20, "disconnect", 1 << 20)
        router.attach(self.ep)
        self.ep.on_bytes(encode_frame({"type": "getlname"}))
        self.router = router

    def send(self, group: str, msg: bytes, n: int = 1) -> None:
        self.ep.on_bytes(b"".join(encode_frame({
            "type": "send", "group": group, "instance": "*", "to": "*",
            "from": self.ep.lname, "seq": str(i), "msg": msg}) for i in range(n)))
        self.router.end_batch()


def setup(policy: str = "disconnect", queue_limit: int = 64 * 1024, credit: int = 2):
    config = Config()
    config = attrs.evolve(config, broker=attrs.evolve(config.broker, queue_limit=queue_limit,
                                                      max_frame=queue_limit))
    ctx = BrokerContext(config=config, router=Router())
    store = RetentionStore(1000)
    store.attach(ctx.router)
    ctx.retention = store
    service = EventerService(ctx)
    ep = EventerEndpoint(service, ctx.router, queue_limit, policy, queue_limit,
                         notify_credit=credit)
    killed: list[str] = []
    ep.kill = lambda reason: (killed.append(reason), ctx.router.detach(ep, reason))
    ctx.router.attach(ep)
    client = ClientConnection(InitReq("unit", subscriptions=(("g", "*"),)))
    ep.on_bytes(client.data_to_send())
    assert client.receive_data(ep.queue.take_all()) == [InitResult(Status.OPERATIONAL, None)]
    return ctx, service, ep, client, Publisher(ctx.router), killed


def test_batches_wait_for_credit_and_flow_on_acks():
    _, _, ep, client, pub, _ = setup(credit=2)
    for _ in range(5):
        pub.send("g", b"x", n=3)
    notes = client.receive_data(ep.queue.take_all())
    assert [len(n.events) for n in notes] == [3, 3]
    assert len(ep.backlog) == 3 and ep.proto.credit == 0
    client.ack(notes[0].ack_conv)
    ep.on_bytes(client.data_to_send())
    (more,) = client.receive_data(ep.queue.take_all())
    assert isinstance(more, EventsNotified) and len(more.events) == 3
    # each notify holds one session, sessions increase
    sessions = [n.events[0].id.session for n in [*notes, more]]
    assert sessions == sorted(set(sessions))
    assert len(ep.backlog) == 2


def test_backlog_beyond_the_queue_limit_disconnects():
    ctx, _, _ep, _, pub, killed = setup(queue_limit=4096, credit=1)
    for _ in range(200):
        pub.send("g", b"y" * 40)
        if killed:
            break
    assert killed == ["slow-consumer"]
    assert ctx.router.counters.slow_consumer_disconnects == 1
    # Nothing was taken from its queue: nothing counts as sent (the queued
    # notification, the backlog and the batch that did not fit are discarded).
    assert ctx.router.counters.msgs_out == 0 and _ep.msgs_out == 0


def test_backlog_beyond_the_queue_limit_drops_with_drop_policy():
    ctx, _, ep, _, pub, killed = setup(policy="drop", queue_limit=4096, credit=1)
    for _ in range(200):
        pub.send("g", b"z" * 40)
    assert killed == []
    assert ep.dropped > 0 and ctx.router.counters.dropped == ep.dropped
    # Dropped events are not counted out.
    assert ctx.router.counters.msgs_out == ep.msgs_out == 200 - ep.dropped
    assert ep.backlog_bytes <= 4096


def test_stopping_status_reaches_open_connections():
    _, service, ep, client, _, _ = setup()
    service.stopping()
    assert [type(e).__name__ for e in client.receive_data(ep.queue.take_all())] == [
        "StatusChanged"]
    assert client.status is Status.STOPPING
    # registrations now fail
    conv = client.register([], with_response=True)
    ep.on_bytes(client.data_to_send())
    (res,) = client.receive_data(ep.queue.take_all())
    assert res.conv == conv and res.events is None
