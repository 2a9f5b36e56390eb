"""Every decoder fed grammar-aware, mutated input, split at random points.

A decoder may only refuse its input with its protocol's documented error;
any other exception (RecursionError, ValueError from int(), UnicodeError,
IndexError, ...) is a finding: in the broker it would be a traceback
instead of a counted protocol error.
"""

from __future__ import annotations

import contextlib
import itertools
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.queue import QueuedEndpoint
from broker.core.refusals import Refused
from broker.core.router import Router
from broker.core.skan_handler import SkanHandler
from broker.observability import http as metrics_http
from tests.fuzz import grammar
from tests.fuzz.conftest import FINDINGS, PROFILE, tally
from wire import hsp
from wire import mariner as mw
from wire.errors import RemoteProtocolError
from wire.eventer import ServerConnection
from wire.skan import FrameSplitter, decode, encode_frame

MAX = 1 << 20
# One decoder call on a few KiB of input; far above it is a per-message CPU
# problem (the hardening issue's many-items and quadratic-reassembly cases).
SLOW_SECONDS = 2.0


def http_exchange(chunks: list[bytes]) -> None:
    """Feed the metrics endpoint's sans-IO HTTP side and answer every request."""
    conn = metrics_http.ServerConnection()
    for chunk in chunks:
        conn.receive_data(chunk)
        while not conn.closed:
            item = conn.next_request()
            if item is None:
                break
            conn.send_reply(metrics_http.answer(item, lambda: b"skan_up 1\n"))


@st.composite
def chunked(draw: st.DrawFn, streams: st.SearchStrategy[bytes]) -> list[bytes]:
    """A stream cut into the pieces a peer's writes would arrive in."""
    data = draw(streams)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=4)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def _feed(target: str, chunks: list[bytes], step, allowed: tuple[type[BaseException], ...]):
    tally(target, "inputs")
    started = time.perf_counter()
    try:
        for chunk in chunks:
            step(chunk)
    except allowed:
        tally(target, "refused")
    except Exception as exc:
        FINDINGS.append(f"{target}: {type(exc).__name__}: {exc} on {b''.join(chunks)[:200]!r}")
        raise
    elapsed = time.perf_counter() - started
    assert elapsed < SLOW_SECONDS, f"{target} took {elapsed:.2f}s"


class _Sink(QueuedEndpoint):
    def encode_control(self, message):
        return encode_frame(message)


@settings.get_profile(PROFILE)  # type: ignore[misc]
@given(chunked(grammar.skan_streams))
def test_skan_framing_codec_and_session(chunks):
    """Frames, then the routing header and the whole message, then the session
    semantics against a real router (subscribe, send, stats...)."""
    splitter = FrameSplitter(MAX)
    router = Router(max_subscriptions=50, max_frame=MAX)
    ep = _Sink(router, 1 << 24, "drop")
    router.attach(ep)
    peer = _Sink(router, 1 << 24, "drop")
    router.attach(peer)
    router.subscribe(peer, b"g", b"*", 2)
    session = SkanHandler(router, ep)

    def step(chunk: bytes) -> None:
        for frame in splitter.receive_data(chunk):
            with contextlib.suppress(RemoteProtocolError):
                decode(frame[4:])
            # A refusal is the session's answer (a Skan error frame), not a finding.
            with contextlib.suppress(Refused):
                session.handle(frame)
        router.end_batch()

    _feed("decoder skan", chunks, step, (RemoteProtocolError,))


@settings.get_profile(PROFILE)  # type: ignore[misc]
@given(chunked(grammar.hsp_streams))
def test_hsp_connection(chunks):
    conn = hsp.HSPConnection(MAX)
    _feed("decoder hsp", chunks, conn.receive_data, (RemoteProtocolError,))


@settings.get_profile(PROFILE)  # type: ignore[misc]
@given(chunked(grammar.eventer_streams()))
def test_eventer_server_connection(chunks):
    conn = ServerConnection(max_message=MAX)

    def step(chunk: bytes) -> None:
        conn.receive_data(chunk, 0.0)

    _feed("decoder eventer", chunks, step, (RemoteProtocolError,))


@settings.get_profile(PROFILE)  # type: ignore[misc]
@given(chunked(grammar.mariner_streams))
def test_mariner_server_connection(chunks):
    conn = mw.MarinerConnection(mw.SERVER, MAX)
    _feed("decoder mariner", chunks, conn.receive_data, (RemoteProtocolError,))


@settings.get_profile(PROFILE)  # type: ignore[misc]
@given(chunked(grammar.http_streams))
def test_http_request_reader(chunks):
    _feed("decoder http", [b"".join(chunks)], lambda _: http_exchange(chunks), ())
