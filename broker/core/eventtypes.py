"""Hat event types and patterns: the one home of their rules (BROKER-SPEC 3, 4).

- (group G, instance I) <-> event type ``(G, *I.split("/"))``; instance ``*``
  <-> ``(G,)`` (:func:`event_type`, :func:`group_instance`).
- A pattern matches an event type segment by segment: ``?`` one segment,
  ``*`` any rest; ``*`` may only be the last segment (:func:`pattern_problem`,
  checked for every pattern a peer can send: Eventer subscriptions and
  queries, Mariner init, bridge subscriptions).
- The group a pattern can reach is its first segment, unless that is a
  wildcard (:func:`pattern_group`): the router's pattern index, the cluster's
  interest, permission checks and the store's query plans all ask it here.

Pure: segments are ``bytes`` on the routing side and ``str`` on the Hat side;
the functions that take patterns accept either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from wire.errors import LocalProtocolError

# The one definition of the wildcards (bytes for the router, text for Hat).
STAR = b"*"
ANY_ONE = b"?"
_WILDCARDS = frozenset((STAR, ANY_ONE, STAR.decode(), ANY_ONE.decode()))
_STARS = frozenset((STAR, STAR.decode()))

Seg = TypeVar("Seg", bytes, str)


class MappingError(LocalProtocolError):
    """An event cannot be expressed as a Skan message (or the reverse).

    Of the wire error family (:mod:`wire.errors`): a peer's event this side
    cannot encode; adapters answer it with their protocol's refusal."""


def event_type(group: bytes, instance: bytes) -> tuple[bytes, ...]:
    """Skan (group, instance) -> Hat event type: ``(G, *I.split("/"))``; "*" -> ``(G,)``."""
    if instance == STAR:
        return (group,)
    return (group, *instance.split(b"/"))


def hat_event_type(group: bytes, instance: bytes) -> tuple[str, ...]:
    """The Hat event type of (group, instance) as text (what Eventer and Mariner carry)."""
    return tuple(seg.decode("utf-8", errors="replace") for seg in event_type(group, instance))


def group_instance(etype: Sequence[str]) -> tuple[str, str]:
    """Event type -> (group, instance); ``(G,)`` -> (G, "*").  The inverse of :func:`event_type`."""
    if not etype or not etype[0]:
        raise MappingError("an event type needs at least a non-empty first segment (the group)")
    if len(etype) == 1:
        return etype[0], "*"
    return etype[0], "/".join(etype[1:])


def matches(pattern: tuple[bytes, ...], etype: tuple[bytes, ...]) -> bool:
    """Hat event-type pattern match: ``*`` (last) matches any rest, ``?`` one segment."""
    n = len(etype)
    for i, seg in enumerate(pattern):
        if seg == STAR:
            return True
        if i >= n:
            return False
        if seg != b"?" and seg != etype[i]:
            return False
    return len(pattern) == n


def pattern_group(pattern: Sequence[Seg]) -> Seg | None:
    """The one group a pattern can reach, or None when it may reach any group
    (a wildcard first segment; the empty pattern, which matches nothing, is
    given as None too, so indexes and interest stay on the safe side)."""
    if not pattern or pattern[0] in _WILDCARDS:
        return None
    return pattern[0]


def pattern_problem(pattern: Sequence[bytes | str]) -> str | None:
    """Why an event-type pattern a peer sent is not valid, or None: ``*`` only last."""
    if any(seg in _STARS for seg in pattern[:-1]):
        shown = [s.decode(errors="replace") if isinstance(s, bytes) else s for s in pattern]
        return f"event-type pattern {shown!r}: '*' may only be the last segment"
    return None
