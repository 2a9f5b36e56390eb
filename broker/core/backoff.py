"""Capped exponential backoff with one jitter rule (bridges, the cluster link, the routing log).

Each wait is the current delay times a factor drawn uniformly from
``[1 - JITTER, 1 + JITTER]``; the delay then doubles, up to the cap.
``reset()`` starts over (after a connection that worked, or a step that
succeeded).  The jitter spreads the reconnects of many brokers or bridges
that lost the same peer at the same moment; +-20 % keeps every wait within
a predictable band around the configured figures.
"""

from __future__ import annotations

import random
from collections.abc import Callable

JITTER = 0.2


class Backoff:
    """The delays of one retry loop: ``wait()`` gives the next and doubles the delay."""

    __slots__ = ("_random", "cap", "delay", "first")

    def __init__(self, first: float, cap: float,
                 rand: Callable[[], float] = random.random) -> None:
        self.first = first
        self.cap = cap
        # Before jitter: what the next wait is about (for log lines).
        self.delay = first
        self._random = rand

    def wait(self) -> float:
        """The next wait in seconds (jittered); the delay after it doubles, capped."""
        seconds = self.delay * (1.0 - JITTER + 2.0 * JITTER * self._random())
        self.delay = min(self.delay * 2, self.cap)
        return seconds

    def reset(self) -> None:
        self.delay = self.first
