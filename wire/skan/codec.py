"""Skan wire codec: encoder, strict decoder and routing-header decoder.

Sans-IO: bytes in, Python values out.  A message is the 4-byte magic
``Skan`` followed by the body of the top-level HASH (which has no TyLen of its
own).  Values: dict <-> HASH, list <-> LIST, None <-> NULL, bytes/str <-> DATA,
int <-> DATA holding the decimal string.  The decoder returns DATA as bytes
and tags as bytes, because the wire cannot tell strings from blobs.

Decoders accept longer-than-needed length codes; encoders always use the
smallest.  Everything else that is not exactly as the format says is refused
with :class:`~wire.errors.MalformedError` (``SkanError`` here), whose reason
says what is wrong and at which byte offset of the message; a value that
cannot be encoded raises :class:`~wire.errors.LocalProtocolError`.
"""

from __future__ import annotations

import os
from typing import Any

from wire.errors import LimitError, LocalProtocolError, MalformedError
from wire.limits import MAX_DEPTH, MAX_ITEMS

MAGIC = b"Skan"

DATA = 0x01
HASH = 0x02
LIST = 0x03
NULL = 0x04
TYPE_MASK = 0x0F

LENGTH_32 = 0x00
LENGTH_16 = 0x10
LENGTH_8 = 0x20
LENGTH_MASK = 0xF0

# Nesting deeper than MAX_DEPTH is refused: the validator and the full
# decoder recurse once per level, and an attacker-chosen depth must not
# exhaust the Python stack.  A message with more than MAX_ITEMS items (every
# item at any depth, the routing tags included) is refused as soon as the
# walk counts one too many, so its cost stays bounded (wire/limits.py).

_TYPE_NAMES = {DATA: "DATA", HASH: "HASH", LIST: "LIST", NULL: "NULL"}


# The Skan codec's name for a malformed message (one class, see wire.errors).
SkanError = MalformedError


# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------


def _prefix(type_: int, n: int) -> bytes:
    if n <= 0xFF:
        return bytes((type_ | LENGTH_8, n))
    if n <= 0xFFFF:
        return bytes((type_ | LENGTH_16, n >> 8, n & 0xFF))
    if n <= 0xFFFFFFFF:
        return bytes((type_ | LENGTH_32,)) + n.to_bytes(4, "big")
    raise LocalProtocolError(f"item of {n} bytes is too long for a 32-bit length")


def _tag(key: Any) -> bytes:
    tag = key.encode() if isinstance(key, str) else bytes(key)
    if not 0 < len(tag) <= 255:
        raise LocalProtocolError(f"tag {key!r} must be 1 to 255 bytes long, not {len(tag)}")
    return tag


def _encode_hash_body(value: dict, out: list[bytes]) -> None:
    for key, item in value.items():
        tag = _tag(key)
        out.append(bytes((len(tag),)))
        out.append(tag)
        _encode_item(item, out)


def _encode_item(value: Any, out: list[bytes]) -> None:
    if value is None:
        out.append(b"\x04")
        return
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        out.append(_prefix(DATA, len(data)))
        out.append(data)
        return
    if isinstance(value, str):
        data = value.encode()
        out.append(_prefix(DATA, len(data)))
        out.append(data)
        return
    if isinstance(value, bool):
        raise LocalProtocolError("bool is not a Skan type (send 'true'/'false' or 1/0 explicitly)")
    if isinstance(value, int):
        data = str(value).encode()
        out.append(_prefix(DATA, len(data)))
        out.append(data)
        return
    if isinstance(value, dict):
        inner: list[bytes] = []
        _encode_hash_body(value, inner)
        body = b"".join(inner)
        out.append(_prefix(HASH, len(body)))
        out.append(body)
        return
    if isinstance(value, list | tuple):
        inner = []
        for item in value:
            _encode_item(item, inner)
        body = b"".join(inner)
        out.append(_prefix(LIST, len(body)))
        out.append(body)
        return
    raise LocalProtocolError(f"cannot encode {type(value).__name__} as a Skan item")


def encode(message: dict) -> bytes:
    """Encode a top-level hash as a message (magic included, no length prefix)."""
    if not isinstance(message, dict):
        raise LocalProtocolError("a Skan message is a hash (dict)")
    out = [MAGIC]
    _encode_hash_body(message, out)
    return b"".join(out)


def encode_item(value: Any) -> bytes:
    """Encode one item (TyLen, length, data) — e.g. a ``msg`` value on its own."""
    out: list[bytes] = []
    _encode_item(value, out)
    return b"".join(out)


def frame(message: bytes) -> bytes:
    """Prefix an encoded message with its 4-byte big-endian length."""
    return len(message).to_bytes(4, "big") + message


def encode_frame(message: dict) -> bytes:
    return frame(encode(message))


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------


def _item_header(buf: bytes, pos: int, end: int, base: int) -> tuple[int, int, int]:
    """Read TyLen (+ length) at ``pos``; return (type, data_start, data_end)."""
    if pos >= end:
        raise SkanError(f"item missing at offset {pos - base}")
    tylen = buf[pos]
    type_ = tylen & TYPE_MASK
    code = tylen & LENGTH_MASK
    if type_ not in _TYPE_NAMES:
        raise SkanError(f"unknown item type 0x{type_:02x} at offset {pos - base}")
    if code not in (LENGTH_8, LENGTH_16, LENGTH_32):
        raise SkanError(f"invalid length code 0x{code:02x} at offset {pos - base}")
    if type_ == NULL:
        # NULL has no length field, whatever length code the TyLen carries.
        return NULL, pos + 1, pos + 1
    if code == LENGTH_8:
        if pos + 2 > end:
            raise SkanError(f"8-bit length truncated at offset {pos - base}")
        n = buf[pos + 1]
        start = pos + 2
    elif code == LENGTH_16:
        if pos + 3 > end:
            raise SkanError(f"16-bit length truncated at offset {pos - base}")
        n = (buf[pos + 1] << 8) | buf[pos + 2]
        start = pos + 3
    else:
        if pos + 5 > end:
            raise SkanError(f"32-bit length truncated at offset {pos - base}")
        n = int.from_bytes(buf[pos + 1 : pos + 5], "big")
        start = pos + 5
    stop = start + n
    if stop > end:
        raise SkanError(
            f"{_TYPE_NAMES[type_]} of {n} bytes at offset {pos - base} overruns its container "
            f"by {stop - end} bytes"
        )
    return type_, start, stop


def _too_many(pos: int, base: int) -> LimitError:
    return LimitError(f"more than {MAX_ITEMS} items (at offset {pos - base})",
                      offset=pos - base)


def _validate(
    buf: bytes, type_: int, start: int, stop: int, base: int, depth: int, items: int
) -> int:
    """Check a HASH or LIST body without building Python objects.

    ``items`` counts the items seen so far in the message; returns the new count.
    """
    if depth > MAX_DEPTH:
        raise LimitError(f"nesting deeper than {MAX_DEPTH} levels at offset {start - base}",
                         offset=start - base)
    pos = start
    if type_ == LIST:
        while pos < stop:
            items += 1
            if items > MAX_ITEMS:
                raise _too_many(pos, base)
            t, s, e = _item_header(buf, pos, stop, base)
            if t in (HASH, LIST):
                items = _validate(buf, t, s, e, base, depth + 1, items)
            pos = e
        return items
    seen: set[bytes] = set()
    while pos < stop:
        items += 1
        if items > MAX_ITEMS:
            raise _too_many(pos, base)
        taglen = buf[pos]
        if taglen == 0:
            raise SkanError(f"zero tag length at offset {pos - base}")
        tag_end = pos + 1 + taglen
        if tag_end > stop:
            raise SkanError(f"tag of {taglen} bytes at offset {pos - base} overruns its hash")
        tag = buf[pos + 1 : tag_end]
        if tag in seen:
            raise SkanError(f"duplicate tag {tag!r} at offset {pos - base}")
        seen.add(tag)
        t, s, e = _item_header(buf, tag_end, stop, base)
        if t in (HASH, LIST):
            items = _validate(buf, t, s, e, base, depth + 1, items)
        pos = e
    return items


def _materialise(buf: bytes, type_: int, start: int, stop: int) -> Any:
    """Build Python values for an already-validated item body."""
    if type_ == DATA:
        return buf[start:stop]
    if type_ == NULL:
        return None
    pos = start
    if type_ == LIST:
        items = []
        while pos < stop:
            t, s, e = _item_header(buf, pos, stop, 0)
            items.append(_materialise(buf, t, s, e))
            pos = e
        return items
    result = {}
    while pos < stop:
        taglen = buf[pos]
        tag_end = pos + 1 + taglen
        t, s, e = _item_header(buf, tag_end, stop, 0)
        result[buf[pos + 1 : tag_end]] = _materialise(buf, t, s, e)
        pos = e
    return result


def _check_magic(buf: bytes, start: int, end: int) -> None:
    if end - start < 4:
        raise SkanError(f"message of {end - start} bytes is shorter than the 4-byte magic")
    if buf[start : start + 4] != MAGIC:
        raise SkanError(f"bad magic {bytes(buf[start:start + 4])!r} (expected b'Skan')")


def decode(message: bytes) -> dict[bytes, Any]:
    """Strictly decode a whole message (magic included, no length prefix)."""
    buf = bytes(message)
    _check_magic(buf, 0, len(buf))
    _validate(buf, HASH, 4, len(buf), 0, 0, 0)
    return _materialise(buf, HASH, 4, len(buf))


class Nested:
    """A HASH or LIST value in a routing header, validated but not materialised."""

    __slots__ = ("start", "stop", "type")

    def __init__(self, type_: int, start: int, stop: int) -> None:
        self.type = type_
        self.start = start
        self.stop = stop

    def __repr__(self) -> str:
        return f"Nested({_TYPE_NAMES[self.type]}, {self.start}, {self.stop})"


def decode_header(buf: bytes, start: int = 0, end: int | None = None) -> dict[bytes, Any]:
    """Decode the top-level hash of the message in ``buf[start:end]``.

    DATA values come back as bytes and NULL as None; HASH and LIST values are
    fully validated but returned as :class:`Nested` markers holding their
    position, so an opaque ``msg`` costs no Python objects.  Offsets are
    relative to ``buf`` so callers can slice out the raw bytes.  This is the
    router's hot path: it is written out flat on purpose.
    """
    if end is None:
        end = len(buf)
    if end - start < 4 or buf[start : start + 4] != MAGIC:
        _check_magic(buf, start, end)
    header: dict[bytes, Any] = {}
    count = 0
    # Items below the top level (inside HASH/LIST values), for MAX_ITEMS.
    nested = 0
    pos = start + 4
    while pos < end:
        taglen = buf[pos]
        tag_end = pos + 1 + taglen
        if taglen == 0 or tag_end >= end:
            _bad_tag(buf, pos, start, end)
        count += 1
        if count > MAX_ITEMS:
            raise _too_many(pos, start)
        if buf[tag_end] == 0x21 and tag_end + 2 <= end:
            # DATA with an 8-bit length: by far the most common case.
            s = tag_end + 2
            e = s + buf[tag_end + 1]
            if e > end:
                raise SkanError(
                    f"DATA of {e - s} bytes at offset {tag_end - start} overruns its container "
                    f"by {e - end} bytes"
                )
            header[buf[pos + 1 : tag_end]] = buf[s:e]
        else:
            t, s, e = _item_header(buf, tag_end, end, start)
            if t == DATA:
                value: Any = buf[s:e]
            elif t == NULL:
                value = None
            else:
                nested = _validate(buf, t, s, e, start, 1, count + nested) - count
                value = Nested(t, s, e)
            header[buf[pos + 1 : tag_end]] = value
        pos = e
    if count != len(header):
        _find_duplicate(buf, start, end)
    return header


def _bad_tag(buf: bytes, pos: int, start: int, end: int) -> None:
    taglen = buf[pos]
    if taglen == 0:
        raise SkanError(f"zero tag length at offset {pos - start}")
    if pos + 1 + taglen > end:
        raise SkanError(f"tag of {taglen} bytes at offset {pos - start} overruns the message")
    raise SkanError(f"tag {bytes(buf[pos + 1 : pos + 1 + taglen])!r} at offset {pos - start} "
                    "has no item")


def _find_duplicate(buf: bytes, start: int, end: int) -> None:
    """Slow path: say which tag of an already-scanned hash is duplicated."""
    seen: set[bytes] = set()
    pos = start + 4
    while pos < end:
        tag_end = pos + 1 + buf[pos]
        tag = buf[pos + 1 : tag_end]
        if tag in seen:
            raise SkanError(f"duplicate tag {tag!r} at offset {pos - start}")
        seen.add(tag)
        pos = _item_header(buf, tag_end, end, start)[2]
    raise AssertionError("no duplicate found")  # pragma: no cover


def item_bytes(buf: bytes, header: dict[bytes, Any], tag: bytes) -> Any:
    """Materialise one header value (e.g. ``msg``) into Python values on demand."""
    value = header.get(tag)
    if isinstance(value, Nested):
        return _materialise(buf, value.type, value.start, value.stop)
    return value


# --------------------------------------------------------------------------
# Compiled hot path
# --------------------------------------------------------------------------

# The functions above are the reference.  ``wire/skan/_codec_speedups.c`` (built by
# ``pip install -e .``) replaces ``decode_header`` with a C scanner that
# accepts exactly the same input and hands anything it refuses back to the
# reference, so errors are identical.  SKAN_PURE_PYTHON=1 keeps the reference
# (the test suite runs the codec tests both ways).  IMPLEMENTATION says which
# one is in use: "c" or "python".
PURE_PYTHON = os.environ.get("SKAN_PURE_PYTHON", "") not in ("", "0")
decode_header_py = decode_header
IMPLEMENTATION = "python"
if not PURE_PYTHON:
    try:
        import wire.skan._codec_speedups as _speedups
    except ImportError:  # not built (no C compiler): the reference serves
        pass
    else:
        _speedups.setup(Nested, decode_header_py, MAX_DEPTH, MAX_ITEMS)
        decode_header = _speedups.decode_header  # type: ignore[assignment]
        IMPLEMENTATION = "c"
