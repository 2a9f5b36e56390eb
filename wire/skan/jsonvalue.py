"""JSON value -> Skan value, the one place this direction of the mapping lives.

Object -> HASH, array -> LIST, null -> NULL, string -> DATA (UTF-8), numbers
-> DATA holding the decimal text, booleans -> DATA "true" / "false".  Skan
has no number type: integers travel as decimal strings.  Used by the broker
(Eventer/Mariner payloads) and by the command-line clients (``--json``), so
both agree byte for byte.  Pure: no I/O.
"""

from __future__ import annotations

import json
import math
from typing import Any

# A Skan tag is one length byte then the tag bytes.
MAX_TAG = 255


class JsonValueError(ValueError):
    """The JSON value cannot be expressed as a Skan value (the message says where)."""


class KeyNotTag(JsonValueError):
    """An object key cannot be a Skan tag (empty, or over MAX_TAG bytes of UTF-8)."""


def _utf8(text: str, path: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # JSON escapes can spell lone surrogates ("\ud800"), which UTF-8 cannot carry.
        raise JsonValueError(f"{path}: not valid Unicode (a lone surrogate)") from None


def json_to_skan(value: Any, path: str = "payload") -> Any:
    """JSON value -> Skan value: object->HASH, array->LIST, null->NULL, scalars->DATA."""
    if value is None:
        return None
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, float):
        if not math.isfinite(value):
            raise JsonValueError(f"{path}: {value} has no JSON representation")
        return json.dumps(value).encode()
    if isinstance(value, str):
        return _utf8(value, path)
    if isinstance(value, list | tuple):
        return [json_to_skan(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            tag = _utf8(str(k), path)
            if not 0 < len(tag) <= MAX_TAG:
                raise KeyNotTag(
                    f"{path}: key {k!r} cannot be a Skan tag (1 to {MAX_TAG} bytes of UTF-8)"
                )
            out[tag] = json_to_skan(v, f"{path}.{k}")
        return out
    raise JsonValueError(f"{path}: {type(value).__name__} is not a JSON value")
