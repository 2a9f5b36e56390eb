"""Peer JSON (Mariner messages, Eventer json payloads) parsed within the decoder limits.

:func:`loads` is ``json.loads`` with every peer fault turned into a
:class:`~wire.errors.MalformedError` (or :class:`~wire.errors.LimitError`)
and bounded cost:

- items (values and object members, :data:`wire.limits.MAX_ITEMS`) and
  nesting depth (:data:`wire.limits.MAX_DEPTH`) are checked on the text
  *before* it is parsed, with C-speed string operations only (count the
  commas and brackets outside strings; peel the innermost bracket pairs once
  per level), so neither a huge flat array nor deep nesting costs Python
  work per item, and RecursionError cannot happen;
- integers longer than :data:`wire.limits.MAX_INT_DIGITS` digits are refused
  (Python would raise ValueError past 4,300 digits, after quadratic work);
- numbers that overflow to infinity and the non-JSON constants NaN and
  Infinity are refused (they have no JSON or Skan form);
- strings holding lone surrogates (``"\\ud800"`` escapes, which no UTF-8 can
  carry) are refused, so nothing downstream meets a UnicodeEncodeError.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from wire.errors import LimitError, MalformedError
from wire.limits import MAX_DEPTH, MAX_INT_DIGITS, MAX_ITEMS, ItemBudget

# A JSON string literal (escapes included), written so the engine runs
# through plain characters without backtracking.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")
# An escape that may spell a surrogate; only then is the result searched.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_constant(name: str) -> Any:
    raise MalformedError(f"{name} is not valid JSON")


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise LimitError(f"an integer of {len(text.lstrip('-'))} digits exceeds the limit "
                         f"of {MAX_INT_DIGITS} digits")
    return int(text)


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise MalformedError(f"number {text[:40]!r} is out of range")
    return value


_DECODER = json.JSONDecoder(
    parse_int=_integer, parse_float=_number, parse_constant=_no_constant
)


def check_shape(
    text: str, budget: ItemBudget, max_depth: int, what: str, max_items: int | None = None
) -> None:
    """Refuse ``text`` if it has more items than ``budget`` allows (or than
    ``max_items`` on its own), or nests deeper than ``max_depth``.

    Cheap when the text is small or flat: the counts over the whole text are
    an upper bound, and only when they exceed a limit are strings removed to
    count exactly.
    """
    own = budget.left if max_items is None else min(budget.left, max_items)
    opens = text.count("[") + text.count("{")
    items = text.count(",") + opens + 1
    if items <= own and opens <= max_depth:
        budget.spend(items, what)
        return
    bare = _STRING.sub('""', text)
    opens = bare.count("[") + bare.count("{")
    items = bare.count(",") + opens + 1
    if max_items is not None and items > max_items:
        raise LimitError(f"{what} has more than {max_items} items")
    budget.spend(items, what)
    if opens <= max_depth:
        return
    brackets = _NOT_BRACKET.sub("", bare)
    for _ in range(max_depth):
        peeled = _INNERMOST.sub("", brackets)
        if not peeled:
            return
        if len(peeled) == len(brackets):
            raise MalformedError(f"{what} is not valid JSON: unbalanced brackets")
        brackets = peeled
    raise LimitError(f"{what} is nested too deeply (more than {max_depth} levels)")


def check_value(value: Any, max_items: int, max_depth: int, what: str) -> None:
    """Refuse an already parsed value with more than ``max_items`` values or
    deeper than ``max_depth`` levels; iterative, stops at the first excess.

    For a part of a larger message that was parsed whole (a Mariner event's
    payload), so that the Skan message built from it passes the same limits.
    """
    items = 0
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        items += 1
        if items > max_items:
            raise LimitError(f"{what} has more than {max_items} items")
        if isinstance(v, list):
            depth += 1
            if depth > max_depth:
                raise LimitError(f"{what} is nested too deeply (more than {max_depth} levels)")
            stack.extend((x, depth) for x in v)
        elif isinstance(v, dict):
            depth += 1
            if depth > max_depth:
                raise LimitError(f"{what} is nested too deeply (more than {max_depth} levels)")
            stack.extend((x, depth) for x in v.values())


def _has_surrogate(value: Any) -> bool:
    """Whether any string (or key) in a parsed value holds a surrogate; iterative."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return False


def loads(
    text: str | bytes,
    *,
    what: str = "JSON",
    budget: ItemBudget | None = None,
    max_depth: int = MAX_DEPTH,
    max_items: int | None = None,
) -> Any:
    """Parse peer JSON within the limits; MalformedError/LimitError on any fault.

    ``bytes`` must be UTF-8.  ``budget`` (default: MAX_ITEMS for this text
    alone) is charged for the text's items, so several texts of one message
    can share one budget; ``max_items`` bounds this text on its own too.
    """
    if isinstance(text, bytes | bytearray | memoryview):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedError(f"{what} is not UTF-8 (byte {exc.start})") from None
    if budget is None:
        budget = ItemBudget(MAX_ITEMS)
    check_shape(text, budget, max_depth, what, max_items)
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise MalformedError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # pragma: no cover - check_shape bounds the depth
        raise LimitError(f"{what} nests too deeply") from None
    if _SURROGATE_ESCAPE.search(text) and _has_surrogate(value):
        raise MalformedError(f"{what} holds a lone surrogate (not valid Unicode)")
    return value


__all__ = ["check_shape", "check_value", "loads"]
