"""The run: how a broker's messages travel in NATS messages (pure).

A run is one NATS message (HPUB/HMSG) carrying consecutive messages of one
routing batch that share a subject: the same origin session, instances in
sequence, one sender's user.  Its header block names the origin and the
user claim (:mod:`broker.cluster.claims`),
``Skan-Run: server session first-instance count claim``; its payload is the
count's timestamps (8-byte little-endian IEEE 754 doubles, exact both ways)
followed by the Skan frames, unchanged (each carries its own length).
Message i of the run has EventId (server, session, first + i) and
timestamp i.  A lone message is a run of one.

Decoding is bounded and strict (NATS input is untrusted): every number is
at most 19 digits and below 2**63 (Hat's int64 EventId parts), the count is
at least 1 and no more than the payload can hold, every timestamp is finite
and within [0, 2**49); anything else is a
:class:`wire.errors.MalformedError`.
"""

from __future__ import annotations

import struct
from itertools import accumulate
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from broker.cluster import claims
from wire import nats
from wire.errors import LimitError, MalformedError
from wire.skan.codec import PURE_PYTHON
from wire.skan.framing import split_frames

if TYPE_CHECKING:
    from broker.core.router import Routed

# A run's origin: "server session first-instance count".  (The name changed
# with the run format: a broker of an older release counts these messages as
# malformed instead of misreading them; every broker of a cluster must run
# the same release.)
ORIGIN_HEADER = b"Skan-Run"
_HEADER = b"NATS/1.0\r\nSkan-Run: %d %d %d %d %s\r\n\r\n"
_ORIGIN_AT = len(b"NATS/1.0\r\nSkan-Run: ")
_HPUB = b"HPUB %s %d %d\r\n"
_CRLF = b"\r\n"
STAMP = 8  # bytes of one timestamp in a run's payload
# Payload bytes (frames plus timestamps) of one run at most.  Large enough
# that 100-byte messages travel about 400 to a NATS message (NATS's and the
# parsers' per-message costs then vanish per Skan message), small enough to
# stay far below NATS's max_payload (1 MiB by default) and to keep routing
# one run on the receiving broker well under a millisecond.  A larger frame
# travels as a run of one.
RUN_BYTES = 64 * 1024
# Room for a run's HPUB header block ("Skan-Run", four numbers of at most
# 20 digits and the user claim): a frame that does not fit max_payload with
# it is dropped.
HEADER_ROOM = 128 + claims.MAX_CLAIM
# Largest number a run header may carry (EventId parts are Hat's int64).
INT64_LIMIT = 2**63
# Timestamps a run may carry: seconds since the epoch, finite, below 2**49
# (a forged 1e308, inf or NaN would break every reader downstream).  Checked
# on the bytes, in one C call per run: a little-endian double is in
# [0, 2**49) exactly when its top byte (sign and the high exponent bits) is
# at most 0x42 (so -0.0 is refused too).
MAX_TIMESTAMP = 2.0**49
_STAMP_TOP_OK = bytes(range(0x43))
# Smallest Skan frame: its 4-byte length prefix and the 4-byte magic.
MIN_FRAME = 8


def parse_origin(headers: bytes) -> tuple[int, int, int, int, bytes]:
    """(server, session, first instance, count, user claim) from a run's header
    block; MalformedError when it is not one :func:`encode_run` writes."""
    if headers.startswith(_HEADER[:_ORIGIN_AT]):
        value = headers[_ORIGIN_AT:headers.find(b"\r", _ORIGIN_AT)]
    else:
        found = nats.parse_headers(headers).get(ORIGIN_HEADER)
        if found is None:
            raise MalformedError("message without Skan-Run header")
        value = found
    parts = value.split()
    if len(parts) != 5 or not all(p.isdigit() and len(p) <= 19 for p in parts[:4]):
        raise MalformedError("bad Skan-Run header")
    server, session, first, count = map(int, parts[:4])
    if count < 1 or max(server, session, first + count) >= INT64_LIMIT:
        raise MalformedError("bad Skan-Run header (a number out of range)")
    return server, session, first, count, claims.check(parts[4])


def unpack_run(msg: nats.Msg, max_frame: int
               ) -> tuple[int, int, int, tuple[float, ...], list[bytes], bytes]:
    """(server, session, first instance, timestamps, frames, user claim) of one
    run from NATS; MalformedError when it is not a well-formed run, LimitError
    when a frame is over ``max_frame`` (as a client's frame would be)."""
    if msg.headers is None:
        raise MalformedError("message without Skan-Run header")
    server, session, first, count, claim = parse_origin(msg.headers)
    payload = msg.payload
    at = STAMP * count
    if len(payload) < (STAMP + MIN_FRAME) * count:
        raise MalformedError(f"run of {count} messages shorter than {count} timestamps and frames")
    if payload[STAMP - 1:at:STAMP].translate(None, _STAMP_TOP_OK):
        raise MalformedError("run with a timestamp out of range (negative, not finite, "
                             "or past 2**49)")
    stamps = struct.unpack_from(f"<{count}d", payload)
    frames, stop, bad, _need = split_frames(payload, at, max_frame)
    if bad > max_frame and stop + 4 + bad <= len(payload):
        raise LimitError(f"run holds a frame of {bad} bytes, over max_frame ({max_frame})")
    if bad >= 0 or stop != len(payload) or len(frames) != count:
        raise MalformedError(f"run of {count} messages does not hold {count} Skan frames")
    return server, session, first, stamps, frames, claim


def pack_stamps(stamps: list[float]) -> bytes:
    """Timestamps as a run's payload carries them."""
    return struct.pack(f"<{len(stamps)}d", *stamps)


def encode_run(subject: bytes, server: int, session: int, first: int,
               stamps: bytes, frames: list[bytes], size: int,
               claim: bytes = claims.FULL) -> list[bytes]:
    """The parts of one run's HPUB (``stamps``: the frames' timestamps packed by
    :func:`pack_stamps`; ``size``: the frames' bytes plus timestamps; ``claim``:
    the sender's user, :mod:`broker.cluster.claims`)."""
    block = _HEADER % (server, session, first, len(frames), claim)
    hlen = len(block)
    return [_HPUB % (subject, hlen, hlen + size), block, stamps, *frames, _CRLF]


# ---- what the publishing broker's backplane reads of a batch --------------
#
# batch_key and run_parts run once per routing batch on the publishing
# broker (Backplane.observe).  broker/_observer_speedups.c does each in one C loop;
# the functions below are the references and the fallback (SKAN_PURE_PYTHON=1,
# no compiler, or anything the C code leaves to them by returning
# NotImplemented); tests/cluster/test_run_speedups.py holds the two to each
# other on random batches.

_SERVER = attrgetter("server")
_SENDER = attrgetter("sender")
_HEADER_OF = attrgetter("header")
_FRAME = attrgetter("frame")
_TIMESTAMP = attrgetter("timestamp")
_KEY = itemgetter(b"group", b"instance", b"to")


def batch_key_py(batch: list[Routed], server: int) -> tuple[bytes, bytes, bytes, bool] | None:
    """(group, instance, to, one run) when every message of a non-empty batch
    entered broker ``server`` and has that routing key (to the subject's
    precision: the reply flag is not part of it); ``one run``: one session,
    consecutive instances, one sender (a run carries one user claim).  None
    for any other batch."""
    if list(map(_SERVER, batch)).count(server) != len(batch):
        return None
    keys = list(map(_KEY, map(_HEADER_OF, batch)))
    key = keys[0]
    if keys.count(key) != len(keys):
        return None
    head, last = batch[0], batch[-1]
    senders = list(map(_SENDER, batch))
    one_run = (senders.count(head.sender) == len(batch) and last.session == head.session
               and last.instance - head.instance == len(batch) - 1)
    return (*key, one_run)


def run_parts_py(batch: list[Routed]) -> tuple[list[bytes], list[int], bytes, int]:
    """(frames, ends, stamps, largest) of a non-empty batch: ``ends[i]`` the
    run payload bytes (frames plus timestamps) up to message i, ``stamps``
    the timestamps packed (:func:`pack_stamps`), ``largest`` the longest frame."""
    frames = list(map(_FRAME, batch))
    lens = list(map(len, frames))
    ends = list(accumulate(map(STAMP.__add__, lens)))
    return frames, ends, pack_stamps(list(map(_TIMESTAMP, batch))), max(lens)


RUN_SCAN_IMPLEMENTATION = "python"
_batch_key_c: Any = None
_run_parts_c: Any = None
if not PURE_PYTHON:
    try:
        from broker._observer_speedups import batch_key as _batch_key_c
        from broker._observer_speedups import run_parts as _run_parts_c
    except ImportError:  # pragma: no cover - built without a compiler (or an older build)
        _batch_key_c = _run_parts_c = None
    else:
        RUN_SCAN_IMPLEMENTATION = "c"


def batch_key(batch: list[Routed], server: int) -> tuple[bytes, bytes, bytes, bool] | None:
    """See :func:`batch_key_py` (compiled when built)."""
    if _batch_key_c is not None:
        found = _batch_key_c(batch, server)
        if found is not NotImplemented:
            return found
    return batch_key_py(batch, server)


def run_parts(batch: list[Routed]) -> tuple[list[bytes], list[int], bytes, int]:
    """See :func:`run_parts_py` (compiled when built)."""
    if _run_parts_c is not None:
        found = _run_parts_c(batch)
        if found is not NotImplemented:
            return found
    return run_parts_py(batch)
