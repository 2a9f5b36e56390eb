"""Routing a run from NATS in one pass (pure: no trio, no I/O).

A run (:mod:`broker.cluster.runs`) is, almost always, one publisher's
consecutive messages on one routing key: what the origin broker routed from
one read of one connection.  :func:`route_run` routes such a run with
C-level passes over its frames and one recipient lookup, instead of one
:meth:`Router.route` call (and its per-message Python work) per frame.
Every frame is still decoded and checked (NATS input is untrusted, and the
subject was only a pre-filter): a run whose frames are not all well-formed
sends from one lname with one routing key is left to the caller's
frame-by-frame path, untouched.

It does what :meth:`Router.route` does for a message with an origin,
through the router's public surface: the cached recipient set
(:meth:`Router.recipients`), each recipient's ``deliver``, the counters and
the per-group statistics.  The run's ``Routed`` messages go to
``router.observers`` right away, as one list (after :meth:`Router.hand_over`
of what the batch routed before, so observers keep routing order; the
backplane, which would only find them not to be its own, is skipped), and
never to ``local_observers``: they did not enter this broker.  Batched
endpoints (Eventer, Mariner) are flushed at the end of the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any

from broker.core.router import Endpoint, Routed, RouteKey, Router
from broker.core.session import decode_send
from wire.errors import ProtocolError
from wire.skan import decode_header

_HEADER = itemgetter(0)
_KEY = itemgetter(1)

# decode_send(frame, start, lname) -> (header, routing key or None): the C
# decoder the Skan session uses (its Python reference under SKAN_PURE_PYTHON).
Decoder = Callable[[bytes, int, bytes | None], tuple[dict[bytes, Any], RouteKey | None]]


def run_key(frames: Sequence[bytes], decode: Decoder = decode_send
            ) -> tuple[bytes, list[dict[bytes, Any]], RouteKey] | None:
    """(lname, headers, key) when every frame is a well-formed send from one
    lname (the first frame's ``from``) with one routing key; else None."""
    try:
        lname = decode_header(frames[0], 4).get(b"from")
        if type(lname) is not bytes:
            return None
        pairs = list(map(decode, frames, repeat(4), repeat(lname)))
    except ProtocolError:
        return None  # the frame-by-frame path counts what is malformed
    keys = list(map(_KEY, pairs))
    key = keys[0]
    if key is None or keys.count(key) != len(keys):
        return None
    return lname, list(map(_HEADER, pairs)), key


def route_run(router: Router, sender: Endpoint, frames: list[bytes],
              headers: list[dict[bytes, Any]], key: RouteKey,
              origin: tuple[int, int, int], stamps: Sequence[float],
              skip: Callable[[list[Routed]], None] | None = None) -> list[Routed]:
    """Route ``frames`` (one routing key ``key``, decoded ``headers``) to this
    broker's endpoints, with EventIds (server, session, first + i) from
    ``origin`` = (server, session, first) and the origin's timestamps.
    ``skip``: an observer not to give the run (the backplane, which never
    sends back out what NATS brought)."""
    recips = router.recipients(*key)
    n = len(frames)
    server, session, first = origin
    delivered = len(recips)  # the sender (from NATS) is never a local recipient
    routed = list(map(Routed, frames, headers, repeat(sender, n), repeat(recips, n),
                      repeat(delivered, n), repeat(session, n), range(first, first + n),
                      stamps, repeat(server, n)))
    batched = []
    for ep in recips:
        list(map(ep.deliver, frames, routed))
        if ep.batched:
            batched.append(ep)
    size = sum(map(len, frames))
    c = router.counters
    c.msgs_in += n
    c.bytes_in += size
    sender.msgs_in += n
    sender.bytes_in += size
    if delivered:
        c.msgs_out += n * delivered
        c.bytes_out += size * delivered
    else:
        c.undeliverable += n
    gstats = router.group_stats
    if gstats is not None:
        gs = gstats.get(key[0])
        if gs is None:
            gs = gstats[key[0]] = [0, 0]
        gs[0] += n
        gs[1] += n * delivered
    router.hand_over()  # what this batch routed before the run, first
    for observer in router.observers:
        if observer != skip:  # bound methods: equal, not identical
            observer(routed)
    for ep in batched:
        if not ep.closed:
            ep.flush()
    return routed
