"""The native Skan listener: framing, session semantics and byte-for-byte delivery."""

from __future__ import annotations

import logging
from typing import Any

import trio

from broker.core.queue import QueuedEndpoint
from broker.core.reasons import CloseReason, ErrorKind, Protocol
from broker.core.refusals import Refused
from broker.core.router import Routed, Router
from broker.core.skan_handler import SLICE_CHECK, InputSlices, SkanHandler, error_frame
from broker.serving.context import BrokerContext
from broker.serving.transport import (
    serve_protocol,
)
from wire.errors import FramingError, MalformedError
from wire.skan import FrameSplitter, encode_frame

log = logging.getLogger(__name__)

# What a connection over max_connections receives before it is closed (section 9).
TOO_MANY_CONNECTIONS = error_frame("too many connections")


class SkanEndpoint(QueuedEndpoint):
    """A Skan client: receives routed frames exactly as they were sent."""

    protocol = Protocol.SKAN

    def __init__(self, router: Router, queue_limit: int, policy: str, max_frame: int) -> None:
        super().__init__(router, queue_limit, policy)
        self.splitter = FrameSplitter(max_frame)
        self.session = SkanHandler(router, self)
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
                self.mark_congested()
        elif not self.enqueue(frame):
            self.not_sent(n)

    def encode_control(self, message: dict[str, Any]) -> bytes:
        return encode_frame(message)

    def partial_bytes(self) -> int:
        return self.splitter.buffered

    def on_bytes(self, data: bytes) -> bool:
        """Handle received bytes, at most one slice of frames; True when frames
        are left for another slice (the transport calls again with b"")."""
        inp = self.input
        if data:
            try:
                frames = self.splitter.receive_data(data)
            except FramingError as exc:
                self._fatal(ErrorKind.BAD_FRAME, str(exc))
                return False
            if len(frames) <= SLICE_CHECK and not inp.pending:
                # The common case, and every isolated message: a few frames
                # are one slice (InputSlices.take's own first case), handled
                # without queueing them.
                self._handle(frames)
                return False
            inp.add(frames)
        for frames in inp.take():
            if not self._handle(frames):
                return False
        return inp.pending

    def _handle(self, frames: list[bytes]) -> bool:
        """Apply ``frames`` in order; False once the connection is closing."""
        handle = self.session.handle
        for frame in frames:
            try:
                handle(frame)
            except MalformedError as exc:
                self._fatal(ErrorKind.MALFORMED, f"malformed message: {exc}")
                return False
            except Refused as rejected:
                self.router.counters.protocol_error(self.protocol, rejected.kind)
                self.enqueue(encode_frame(rejected.error_message()))
                if rejected.close:
                    self.closing = CloseReason.PROTOCOL_ERROR
                    return False
        self.opened = self.session.named
        return True

    def _fatal(self, kind: ErrorKind, reason: str) -> None:
        self.input.clear()
        self.router.counters.protocol_error(self.protocol, kind)
        self.enqueue(error_frame(reason))
        self.closing = CloseReason.PROTOCOL_ERROR


async def serve_skan(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    def new_endpoint() -> SkanEndpoint:
        b = ctx.config.broker  # as reloaded (SIGHUP): limits apply to new connections
        return SkanEndpoint(ctx.router, b.queue_limit, b.slow_consumer, b.max_frame)

    await serve_protocol(ctx, Protocol.SKAN, ctx.config.skan, new_endpoint,
                         refusal=TOO_MANY_CONNECTIONS, task_status=task_status)
