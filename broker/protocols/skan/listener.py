"""The native Skan listener: framing, session semantics and byte-for-byte delivery."""

from __future__ import annotations

import logging
from typing import Any

import trio

from broker.core.queue import QueuedEndpoint
from broker.core.router import Routed, Router
from broker.core.session import InputSlices, SkanSession, error_frame
from broker.runtime.context import BrokerContext
from broker.runtime.transport import listener_address, open_listeners, run_connection
from wire.skan import FrameError, FrameSplitter, SkanError, encode_frame

log = logging.getLogger(__name__)


class SkanConnection(QueuedEndpoint):
    """A Skan client: receives routed frames exactly as they were sent."""

    protocol = "skan"

    def __init__(self, router: Router, queue_limit: int, policy: str, max_frame: int) -> None:
        super().__init__(router, queue_limit, policy)
        self.splitter = FrameSplitter(max_frame)
        self.session = SkanSession(router, self)
        # Frames received but not yet handled (bounded work per slice).
        self.input: InputSlices[bytes] = InputSlices()

    def deliver(self, frame: bytes, routed: Routed) -> None:
        # Inlined OutQueue.push: this runs once per recipient per message.
        q = self.queue
        n = len(frame)
        if q.size + n <= q.limit and not self.closed:
            q.items.append(frame)
            q.size += n
            self.msgs_out += 1
            self.bytes_out += n
            if q.waiting:
                q.waiting = False
                q.wakeup()
            if q.size > q.high and not self.congested:
                self.congested = True
                self.router.congested.append(self)
        else:
            self.enqueue(frame)

    def encode_control(self, message: dict[str, Any]) -> bytes:
        return encode_frame(message)

    def on_bytes(self, data: bytes) -> bool:
        """Handle received bytes, at most one slice of frames; True when frames
        are left for another slice (the transport calls again with b"")."""
        inp = self.input
        if data:
            try:
                inp.add(self.splitter.feed(data))
            except FrameError as exc:
                self._fatal("bad-frame", str(exc))
                return False
        handle = self.session.handle
        for frame in inp.take():
            try:
                rejected = handle(frame)
            except SkanError as exc:
                self._fatal("malformed", f"malformed message: {exc}")
                return False
            if rejected is not None:
                self.router.counters.protocol_error("skan", rejected.label)
                self.enqueue(encode_frame(rejected.error_message()))
                if rejected.close:
                    self.closing = "protocol-error"
                    return False
        return inp.pending

    def _fatal(self, kind: str, reason: str) -> None:
        self.input.clear()
        self.router.counters.protocol_error("skan", kind)
        self.enqueue(error_frame(reason))
        self.closing = "protocol-error"


async def serve_skan(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ctx.config
    listeners = await open_listeners(
        cfg.broker.host, cfg.skan.port, cfg.skan.tls_cert, cfg.skan.tls_key
    )

    async def handle(stream: trio.abc.Stream) -> None:
        ep = SkanConnection(
            ctx.router, cfg.broker.queue_limit, cfg.broker.slow_consumer, cfg.broker.max_frame
        )
        ctx.router.attach(ep)
        await run_connection(
            stream, ep, ep.on_bytes, ctx.router, ctx.connections,
            drain_timeout=cfg.broker.drain_timeout, grace=cfg.broker.slow_consumer_grace,
        )

    task_status.started([("skan", *listener_address(lst)) for lst in listeners])
    await ctx.serve(listeners, handle)
