"""Hat timestamps: float seconds <-> (s, us), the one rounding every adapter uses."""

from __future__ import annotations

import math


def split_timestamp(t: float) -> tuple[int, int]:
    """Float seconds -> Hat's (s, us) with us in 0..999999 (rounded to the microsecond)."""
    s = math.floor(t)
    us = round((t - s) * 1_000_000)
    if us >= 1_000_000:
        return s + 1, us - 1_000_000
    return s, us


def join_timestamp(s: int, us: int) -> float:
    return s + us / 1_000_000
