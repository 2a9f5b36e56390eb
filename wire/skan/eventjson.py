"""The ``payload-json`` routing tag: a Hat JSON payload exactly, beside its Skan view.

Skan has no number, boolean or "JSON null payload" type, so the Skan view
of a JSON value (:mod:`wire.skan.jsonvalue`: numbers and booleans become
decimal DATA) reads back as strings.  A send whose payload the Skan view
cannot give back exactly carries the JSON text itself in the routing tag
``payload-json`` (DATA, compact UTF-8 JSON) beside ``msg``:

- Hat consumers (Eventer, Mariner, bridges, queries, replay) take the
  payload from the tag when it is present; Skan subscribers read ``msg``.
  When the two disagree (a Skan client may send both), each side gets its
  own: the tag for Hat, ``msg`` for Skan.
- The broker and the command-line clients attach the tag only when the
  Skan view is lossy (:func:`skan_view`): a payload of strings, objects,
  arrays and nested nulls travels as before, byte for byte.
- A value whose object keys cannot be Skan tags (empty, or over 255 bytes
  of UTF-8) has no HASH form: its Skan view is the JSON text as DATA, and
  the tag carries it exactly.

The text in a received tag is untrusted: :func:`loads_exact` parses it within
the decoder limits (:mod:`wire.boundedjson`).  Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Any

from wire import boundedjson
from wire.limits import MAX_PAYLOAD_ITEMS
from wire.skan.jsonvalue import JsonValueError, KeyNotTag, json_to_skan

PAYLOAD_JSON_TAG = b"payload-json"

# Compact separators: the tag roughly doubles a numeric payload on the wire,
# so no byte of it is spent on layout.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def exact_text(value: Any) -> bytes:
    """The compact UTF-8 JSON text of ``value`` (what the tag holds)."""
    try:
        return _ENCODER.encode(value).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise JsonValueError(f"payload: not a JSON value ({exc})") from None
    except UnicodeEncodeError:
        raise JsonValueError("payload: not valid Unicode (a lone surrogate)") from None


def lossless(value: Any) -> bool:
    """Whether the Skan view of ``value`` reads back as ``value`` itself.

    True when it holds only strings, objects, arrays and (nested) nulls; a
    number or boolean anywhere, or a top-level null (a JSON ``null`` payload,
    whose Skan view NULL reads back as no payload), needs the tag.
    Iterative, so depth costs no recursion.
    """
    if value is None:
        return False
    stack = [value]
    pop, push = stack.pop, stack.extend
    while stack:
        v = pop()
        t = type(v)
        if t is str or v is None:
            continue
        if t is dict:
            push(v.values())
        elif t is list or t is tuple:
            push(v)
        else:
            return False
    return True


def skan_view(value: Any, path: str = "payload") -> tuple[Any, bytes | None]:
    """(``msg``, ``payload-json`` text or None) for a JSON payload ``value``.

    The text is None when the Skan view alone gives ``value`` back.  Raises
    :class:`JsonValueError` for what is not JSON at all (non-finite floats,
    lone surrogates, other types).
    """
    try:
        msg = json_to_skan(value, path)
    except KeyNotTag:
        # No HASH can hold this object: Skan subscribers get the JSON text.
        text = exact_text(value)
        return text, text
    if lossless(value):
        return msg, None
    return msg, exact_text(value)


def loads_exact(raw: bytes) -> Any:
    """The JSON value of a received ``payload-json`` tag, parsed within the limits.

    Raises :class:`wire.errors.MalformedError` (not UTF-8, not JSON, lone
    surrogate) or :class:`wire.errors.LimitError` (items, depth, digits).
    """
    return boundedjson.loads(raw, what="payload-json", max_items=MAX_PAYLOAD_ITEMS)


__all__ = ["PAYLOAD_JSON_TAG", "exact_text", "loads_exact", "lossless", "skan_view"]
