"""The SBS schemas of Chatter and Eventer, and bounded encode/decode through hat-sbs.

The schemas live as ``.sbs`` text beside this module (Hat, HatPing,
HatChatter, HatEventer) and are compiled once into one hat-sbs repository.

Decoding input from a peer is guarded by :func:`validate`, a walk over the
encoded bytes that builds no values: hat-sbs's C decoder pre-allocates an
Array from its announced count (six bytes announcing 2**31 elements stall
the process for seconds) and silently wraps integers wider than 64 bits.
The walk refuses counts larger than the bytes that remain, integers outside
int64, unknown Choice indices, truncation and trailing bytes, so the C
decoder only ever sees well-formed data; and it refuses a message whose
arrays hold more than :data:`wire.limits.MAX_ITEMS` elements in total
(charged per array from its announced count, before its elements are walked).
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from wire.errors import LocalProtocolError, MalformedError
from wire.limits import MAX_ITEMS, ItemBudget

if TYPE_CHECKING:
    from hat.sbs import common as sbs_common

SCHEMA_FILES = ("hat.sbs", "hat_ping.sbs", "hat_chatter.sbs", "hat_eventer.sbs")

# An SBS Integer of int64 takes at most 10 bytes (7 bits per byte).
MAX_INT_BYTES = 10
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# Nesting bound for compiling validators (the schemas nest fewer than 10
# levels; this only guards the Python stack against a recursive schema).
MAX_DEPTH = 64
# Arrays whose elements can take zero bytes (Array(None)) cannot be bounded
# by the remaining length; none exist in these schemas, this caps them anyway.
MAX_EMPTY_ELEMENTS = 65_536


# Bytes that are not a valid encoding of the expected SBS type (one class, see wire.errors).
SbsError = MalformedError


def schema_texts() -> list[str]:
    """The ``.sbs`` texts beside this module, in SCHEMA_FILES order."""
    root = importlib.resources.files(__package__) / "schemas"
    return [(root / name).read_text("utf-8") for name in SCHEMA_FILES]


class _Schemas:
    """The schemas compiled by hat-sbs: its type references and its serializer.

    Built on first use (:func:`_schemas`), not at import: importing hat-sbs
    (its PEG parser, hat.json with jsonschema) and parsing the four schemas
    take about 0.45 s, which every broker start paid although most brokers
    never see a Chatter peer.
    """

    def __init__(self) -> None:
        from hat import sbs
        from hat.sbs import common, evaluator, parser

        self.common = common
        self.refs: dict[sbs_common.Ref, Any] = evaluator.evaluate_modules(
            [parser.parse(text) for text in schema_texts()]
        )
        self.serializer = sbs.DefaultSerializer
        self.simple: dict[type, Validator] = {
            common.NoneType: _skip_none,
            common.BooleanType: _skip_boolean,
            common.IntegerType: _skip_integer,
            common.FloatType: _skip_float,
            common.StringType: _skip_string,
            common.BytesType: _skip_bytes,
        }

    def key(self, name: str) -> sbs_common.Ref:
        """``Module.Type`` as hat-sbs's reference (defined or not)."""
        module, _, tname = name.partition(".")
        return self.common.Ref(module, tname)

    def ref(self, name: str) -> sbs_common.Ref:
        ref = self.key(name)
        if ref not in self.refs:
            raise SbsError(f"unknown SBS type {name!r}")
        return ref


@functools.cache
def _schemas() -> _Schemas:
    return _Schemas()


def compile_schemas() -> None:
    """Compile the schemas now (the first encode or decode would): a server
    calls this in a worker thread once it is up, so its first Chatter peer
    does not hold the thread that routes for everyone else (0.2-0.3 s)."""
    _schemas()


def known(name: str) -> bool:
    """Whether ``Module.Type`` is defined in the schemas."""
    schemas = _schemas()
    return schemas.key(name) in schemas.refs


def encode(name: str, value: Any) -> bytes:
    """Encode ``value`` as the SBS type ``Module.Type``."""
    try:
        schemas = _schemas()
        return schemas.serializer.encode(schemas.refs, schemas.ref(name), value)
    except Exception as exc:  # hat-sbs raises assorted types for bad values
        raise LocalProtocolError(f"cannot encode {name}: {type(exc).__name__}: {exc}") from None


def decode(name: str, data: bytes, budget: ItemBudget | None = None) -> Any:
    """Decode peer input as ``Module.Type``; :class:`SbsError` if it is not exactly that.

    ``budget`` (default: a fresh one of MAX_ITEMS) is charged for every array element.
    """
    validate(name, data, budget)
    try:
        schemas = _schemas()
        return schemas.serializer.decode(schemas.refs, schemas.ref(name), data)
    except Exception as exc:  # pragma: no cover - validate() accepted it
        raise SbsError(f"cannot decode {name}: {type(exc).__name__}: {exc}") from None


def validate(name: str, data: bytes, budget: ItemBudget | None = None) -> None:
    """Check that ``data`` is exactly one well-formed encoding of ``Module.Type``."""
    check = _VALIDATORS.get(name)
    if check is None:
        schemas = _schemas()
        check = _VALIDATORS[name] = _compile(schemas, schemas.refs[schemas.ref(name)], 0)
    if budget is None:
        budget = ItemBudget(MAX_ITEMS)
    try:
        end = check(data, 0, budget)
    except IndexError:
        raise SbsError(f"{name}: truncated") from None
    if end != len(data):
        raise SbsError(f"{name}: {len(data) - end} trailing bytes after the value")


# (data, pos, budget) -> position after the value.
Validator = Callable[[bytes, int, ItemBudget], int]
# Validators compiled from the schemas, per type name: one closure per
# schema node, so a walk costs no type dispatch per value.
_VALIDATORS: dict[str, Validator] = {}


def _int(data: bytes, pos: int) -> tuple[int, int]:
    """One Integer at ``pos``: (value, position after it).  IndexError when truncated."""
    b = data[pos]
    if b & 0x80:  # one byte: the common case
        return ((b & 0x7F) - 128 if b & 0x40 else b & 0x7F), pos + 1
    start = pos
    value = -1 if b & 0x40 else 0
    while True:
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


def _skip_none(data: bytes, pos: int, budget: ItemBudget) -> int:
    return pos


def _skip_boolean(data: bytes, pos: int, budget: ItemBudget) -> int:
    if pos >= len(data):
        raise SbsError(f"truncated Boolean at byte {pos}")
    return pos + 1


def _skip_integer(data: bytes, pos: int, budget: ItemBudget) -> int:
    return _int(data, pos)[1]


def _skip_float(data: bytes, pos: int, budget: ItemBudget) -> int:
    if pos + 8 > len(data):
        raise SbsError(f"truncated Float at byte {pos}")
    return pos + 8


def _skip_bytes(data: bytes, pos: int, budget: ItemBudget) -> int:
    n, body = _int(data, pos)
    end = body + n
    if n < 0 or end > len(data):
        raise SbsError(f"String/Bytes of length {n} at byte {pos} overruns the data")
    return end


def _skip_string(data: bytes, pos: int, budget: ItemBudget) -> int:
    n, body = _int(data, pos)
    end = body + n
    if n < 0 or end > len(data):
        raise SbsError(f"String/Bytes of length {n} at byte {pos} overruns the data")
    try:
        data[body:end].decode("utf-8")
    except UnicodeDecodeError:
        raise SbsError(f"String at byte {pos} is not UTF-8") from None
    return end



def _compile(schemas: _Schemas, t: Any, depth: int) -> Validator:
    if depth > MAX_DEPTH:
        raise SbsError("schema nested too deeply")
    common = schemas.common
    while isinstance(t, common.Ref):
        t = schemas.refs[t]
    simple = schemas.simple.get(type(t))
    if simple is not None:
        return simple
    if isinstance(t, common.ArrayType):
        element = _compile(schemas, t.t, depth + 1)
        spare = MAX_EMPTY_ELEMENTS if _may_be_empty(schemas, t.t) else 0

        def skip_array(data: bytes, pos: int, budget: ItemBudget) -> int:
            n, p = _int(data, pos)
            if n < 0 or n > max(len(data) - p, spare):
                raise SbsError(f"Array count {n} at byte {pos} exceeds the remaining data")
            budget.spend(n, f"SBS data (array at byte {pos})")
            for _ in range(n):
                p = element(data, p, budget)
            return p

        return skip_array
    if isinstance(t, common.RecordType):
        fields = [_compile(schemas, et, depth + 1) for _, et in t.entries]

        def skip_record(data: bytes, pos: int, budget: ItemBudget) -> int:
            for field in fields:
                pos = field(data, pos, budget)
            return pos

        return skip_record
    if isinstance(t, common.ChoiceType):
        options = [_compile(schemas, et, depth + 1) for _, et in t.entries]

        def skip_choice(data: bytes, pos: int, budget: ItemBudget) -> int:
            idx, p = _int(data, pos)
            if not 0 <= idx < len(options):
                raise SbsError(f"Choice index {idx} at byte {pos} is out of range")
            return options[idx](data, p, budget)

        return skip_choice
    raise SbsError(f"unsupported SBS type {t!r}")  # pragma: no cover


def _may_be_empty(schemas: _Schemas, t: Any) -> bool:
    common = schemas.common
    while isinstance(t, common.Ref):
        t = schemas.refs[t]
    if isinstance(t, common.NoneType):
        return True
    if isinstance(t, common.RecordType):
        return all(_may_be_empty(schemas, et) for _, et in t.entries)
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
