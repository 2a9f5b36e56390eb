"""The SBS schemas of Chatter and Eventer, and bounded encode/decode through hat-sbs.

The schemas live as ``.sbs`` text beside this module (Hat, HatPing,
HatChatter, HatEventer) and are compiled once into one hat-sbs repository.

Decoding input from a peer is guarded by :func:`validate`, a walk over the
encoded bytes that builds no values: hat-sbs's C decoder pre-allocates an
Array from its announced count (six bytes announcing 2**31 elements stall
the process for seconds) and silently wraps integers wider than 64 bits.
The walk refuses counts larger than the bytes that remain, integers outside
int64, unknown Choice indices, truncation and trailing bytes, so the C
decoder only ever sees well-formed data.
"""

from __future__ import annotations

import importlib.resources
from typing import Any

from hat import sbs
from hat.sbs import common as sbs_common
from hat.sbs import evaluator as sbs_evaluator
from hat.sbs import parser as sbs_parser

SCHEMA_FILES = ("hat.sbs", "hat_ping.sbs", "hat_chatter.sbs", "hat_eventer.sbs")

# An SBS Integer of int64 takes at most 10 bytes (7 bits per byte).
MAX_INT_BYTES = 10
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# Nesting bound for the walk (the schemas nest fewer than 10 levels; a
# recursive type cannot exist in them, this only guards the Python stack).
MAX_DEPTH = 64
# Arrays whose elements can take zero bytes (Array(None)) cannot be bounded
# by the remaining length; none exist in these schemas, this caps them anyway.
MAX_EMPTY_ELEMENTS = 65_536


class SbsError(ValueError):
    """Bytes that are not a valid encoding of the expected SBS type."""


def _schema_texts() -> list[str]:
    root = importlib.resources.files(__package__) / "schemas"
    return [(root / name).read_text("utf-8") for name in SCHEMA_FILES]


_TEXTS = _schema_texts()
REPO = sbs.Repository(*_TEXTS)
_REFS: dict[sbs_common.Ref, Any] = sbs_evaluator.evaluate_modules(
    [sbs_parser.parse(text) for text in _TEXTS]
)


def _ref(name: str) -> sbs_common.Ref:
    module, _, tname = name.partition(".")
    ref = sbs_common.Ref(module, tname)
    if ref not in _REFS:
        raise SbsError(f"unknown SBS type {name!r}")
    return ref


def known(name: str) -> bool:
    """Whether ``Module.Type`` is defined in the schemas."""
    module, _, tname = name.partition(".")
    return sbs_common.Ref(module, tname) in _REFS


def encode(name: str, value: Any) -> bytes:
    """Encode ``value`` as the SBS type ``Module.Type``."""
    try:
        return REPO.encode(name, value)
    except Exception as exc:  # hat-sbs raises assorted types for bad values
        raise SbsError(f"cannot encode {name}: {type(exc).__name__}: {exc}") from None


def decode(name: str, data: bytes) -> Any:
    """Decode peer input as ``Module.Type``; :class:`SbsError` if it is not exactly that."""
    validate(name, data)
    try:
        return REPO.decode(name, data)
    except Exception as exc:  # pragma: no cover - validate() accepted it
        raise SbsError(f"cannot decode {name}: {type(exc).__name__}: {exc}") from None


def validate(name: str, data: bytes) -> None:
    """Check that ``data`` is exactly one well-formed encoding of ``Module.Type``."""
    end = _walk(_REFS[_ref(name)], data, 0, 0)
    if end != len(data):
        raise SbsError(f"{name}: {len(data) - end} trailing bytes after the value")


def _int(data: bytes, pos: int) -> tuple[int, int]:
    size = len(data)
    start = pos
    if pos >= size:
        raise SbsError(f"truncated Integer at byte {pos}")
    value = -1 if data[pos] & 0x40 else 0
    while True:
        if pos >= size:
            raise SbsError(f"truncated Integer at byte {start}")
        b = data[pos]
        value = (value << 7) | (b & 0x7F)
        pos += 1
        if b & 0x80:
            break
        if pos - start >= MAX_INT_BYTES:
            raise SbsError(f"Integer at byte {start} is wider than 64 bits")
    if not INT64_MIN <= value <= INT64_MAX:
        raise SbsError(f"Integer at byte {start} does not fit 64 bits")
    return value, pos


def _walk(t: Any, data: bytes, pos: int, depth: int) -> int:
    if depth > MAX_DEPTH:
        raise SbsError("value nested too deeply")
    while isinstance(t, sbs_common.Ref):
        t = _REFS[t]
    size = len(data)
    if isinstance(t, sbs_common.NoneType):
        return pos
    if isinstance(t, sbs_common.BooleanType):
        if pos >= size:
            raise SbsError(f"truncated Boolean at byte {pos}")
        return pos + 1
    if isinstance(t, sbs_common.IntegerType):
        return _int(data, pos)[1]
    if isinstance(t, sbs_common.FloatType):
        if pos + 8 > size:
            raise SbsError(f"truncated Float at byte {pos}")
        return pos + 8
    if isinstance(t, sbs_common.StringType | sbs_common.BytesType):
        n, body = _int(data, pos)
        if n < 0 or body + n > size:
            raise SbsError(f"String/Bytes of length {n} at byte {pos} overruns the data")
        if isinstance(t, sbs_common.StringType):
            try:
                data[body : body + n].decode("utf-8")
            except UnicodeDecodeError:
                raise SbsError(f"String at byte {pos} is not UTF-8") from None
        return body + n
    if isinstance(t, sbs_common.ArrayType):
        n, pos2 = _int(data, pos)
        if n < 0 or n > max(size - pos2, MAX_EMPTY_ELEMENTS if _may_be_empty(t.t) else 0):
            raise SbsError(f"Array count {n} at byte {pos} exceeds the remaining data")
        for _ in range(n):
            pos2 = _walk(t.t, data, pos2, depth + 1)
        return pos2
    if isinstance(t, sbs_common.RecordType):
        for _, et in t.entries:
            pos = _walk(et, data, pos, depth + 1)
        return pos
    if isinstance(t, sbs_common.ChoiceType):
        idx, pos2 = _int(data, pos)
        if not 0 <= idx < len(t.entries):
            raise SbsError(f"Choice index {idx} at byte {pos} is out of range")
        return _walk(t.entries[idx][1], data, pos2, depth + 1)
    raise SbsError(f"unsupported SBS type {t!r}")  # pragma: no cover


def _may_be_empty(t: Any) -> bool:
    while isinstance(t, sbs_common.Ref):
        t = _REFS[t]
    if isinstance(t, sbs_common.NoneType):
        return True
    if isinstance(t, sbs_common.RecordType):
        return all(_may_be_empty(et) for _, et in t.entries)
    return False


def encode_integer(value: int) -> bytes:
    """SBS Integer encoding (7 bits per byte, big-endian, 0x80 marks the last byte).

    Used to assemble an Array from already-encoded elements (its count is an
    Integer followed by the elements); equal to ``encode("...Integer", v)``.
    """
    out = [(value & 0x7F) | 0x80]
    while not (-64 <= value <= 63):
        value >>= 7
        out.append(value & 0x7F)
    return bytes(reversed(out))


def encode_array(encoded_elements: list[bytes]) -> bytes:
    """An SBS Array from its elements' encodings (count, then the elements)."""
    return encode_integer(len(encoded_elements)) + b"".join(encoded_elements)
