"""A log line at most once per interval, with a count of the ones held back (pure).

What a remote party can repeat at will (malformed messages on the cluster
subjects, bad query answers) must not flood the broker's log: the counters
(``malformed`` in ``stats``) say how many there were, the log says what the
first of each interval was.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable


class RateLimitedLog:
    """``limited(reason)`` logs ``message % reason`` unless it logged less than
    ``interval`` seconds ago; the next line it writes says how many it held back."""

    def __init__(self, logger: logging.Logger, message: str, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.message = message
        self.interval = interval
        self.clock = clock
        self.last = -math.inf
        self.held_back = 0
        self.lines = 0

    def __call__(self, reason: str) -> None:
        now = self.clock()
        if now - self.last < self.interval:
            self.held_back += 1
            return
        if self.held_back:
            self.logger.warning(self.message + " (and %d more in the last %.0f s)",
                                reason, self.held_back, now - self.last)
        else:
            self.logger.warning(self.message, reason)
        self.last = now
        self.held_back = 0
        self.lines += 1
