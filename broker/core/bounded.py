"""The broker's one rule for caches that peers can grow: bounded, cleared when full.

A peer that sends to ever new groups, instances or lnames must not grow a
cache without bound; clearing it when full (rather than evicting one entry
at a time) keeps a hit one dict lookup and a miss the cost of recomputing
one entry.  Each user states its limit and why next to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(dict, Generic[K, V]):  # type: ignore[type-arg]
    """A dict (``get`` and ``in`` as fast) whose :meth:`put` clears it when full.

    ``also``: containers kept in step with the cache (indexes over its keys,
    a set derived from its values), cleared with it.
    """

    __slots__ = ("_also", "limit")

    def __init__(self, limit: int, also: Iterable[Any] = ()) -> None:
        super().__init__()
        self.limit = limit
        self._also = tuple(also)

    def put(self, key: K, value: V) -> V:
        """Remember ``value`` for ``key`` (clearing everything first when full); returns it."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value

    def clear(self) -> None:
        super().clear()
        for other in self._also:
            other.clear()
