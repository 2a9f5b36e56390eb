"""The run: how a broker's messages travel in NATS messages (pure).

A run is one NATS message (HPUB/HMSG) carrying consecutive messages of one
routing batch that share a subject: the same origin session, instances in
sequence.  Its header block names the origin,
``Skan-Run: server session first-instance count``; its payload is the
count's timestamps (8-byte little-endian IEEE 754 doubles, exact both ways)
followed by the Skan frames, unchanged (each carries its own length).
Message i of the run has EventId (server, session, first + i) and
timestamp i.  A lone message is a run of one.
"""

from __future__ import annotations

import struct

from wire import nats
from wire.skan.framing import split_frames

# A run's origin: "server session first-instance count".  (The name changed
# with the run format: a broker of an older release counts these messages as
# malformed instead of misreading them; every broker of a cluster must run
# the same release.)
ORIGIN_HEADER = b"Skan-Run"
_HEADER = b"NATS/1.0\r\nSkan-Run: %d %d %d %d\r\n\r\n"
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
# Room for a run's HPUB header block ("Skan-Run" and four numbers of at
# most 20 digits): a frame that does not fit max_payload with it is dropped.
HEADER_ROOM = 128


def parse_origin(headers: bytes) -> tuple[int, int, int, int]:
    """(server, session, first instance, count) from a run's header block."""
    if headers.startswith(_HEADER[:_ORIGIN_AT]):
        value = headers[_ORIGIN_AT:headers.find(b"\r", _ORIGIN_AT)]
    else:
        found = nats.parse_headers(headers).get(ORIGIN_HEADER)
        if found is None:
            raise ValueError("message without Skan-Run header")
        value = found
    parts = value.split()
    if len(parts) != 4 or not all(p.isdigit() and len(p) <= 20 for p in parts):
        raise ValueError("bad Skan-Run header")
    server, session, first, count = map(int, parts)
    if count < 1:
        raise ValueError("bad Skan-Run header")
    return server, session, first, count


def unpack_run(msg: nats.Msg) -> tuple[int, int, int, tuple[float, ...], list[bytes]]:
    """(server, session, first instance, timestamps, frames) of one run from NATS;
    ValueError (or a ProtocolError) when it is not a well-formed run."""
    if msg.headers is None:
        raise ValueError("message without Skan-Run header")
    server, session, first, count = parse_origin(msg.headers)
    payload = msg.payload
    at = STAMP * count
    if len(payload) < at:
        raise ValueError("run shorter than its timestamps")
    stamps = struct.unpack_from(f"<{count}d", payload)
    frames, stop, bad, _need = split_frames(payload, at, len(payload))
    if bad >= 0 or stop != len(payload) or len(frames) != count:
        raise ValueError(f"run of {count} messages does not hold {count} Skan frames")
    return server, session, first, stamps, frames


def encode_run(subject: bytes, server: int, session: int, first: int,
               stamps: list[float], frames: list[bytes], size: int) -> list[bytes]:
    """The parts of one run's HPUB (``size``: its frames' bytes plus timestamps)."""
    n = len(frames)
    block = _HEADER % (server, session, first, n)
    hlen = len(block)
    return [_HPUB % (subject, hlen, hlen + size), block,
            struct.pack(f"<{n}d", *stamps), *frames, _CRLF]
