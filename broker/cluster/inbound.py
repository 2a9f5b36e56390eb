"""Decoding a run from NATS for routing in one pass (pure: no trio, no I/O).

A run (:mod:`broker.cluster.subject_runs`) is, almost always, one publisher's
consecutive messages on one routing key: what the origin broker routed from
one read of one connection.  :func:`run_key` decodes such a run and finds
its one routing key; :meth:`Router.route_run` then routes it with C-level
passes over its frames and one recipient lookup, instead of one
:meth:`Router.route` call (and its per-message Python work) per frame.
Every frame is still decoded and checked (NATS input is untrusted, and the
subject was only a pre-filter): a run whose frames are not all well-formed
sends from one lname with one routing key is left to the caller's
frame-by-frame path, untouched.  So is a run of sends carrying the
``payload-json`` tag (exact Hat payloads): the decoder gives them no key
(the Skan session checks the tag off its hot path), and the frame-by-frame
path routes them with the same frames and EventIds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any

from broker.core.router import RouteKey
from broker.core.skan_handler import decode_send
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
