"""How many inputs a property test tries: a share of its full count in ``make test``.

The property and differential tests name their full count
(``@settings(max_examples=examples(300))``).  ``make test`` runs a quarter of
it, at least 50 (or the full count when that is smaller), so the suite stays
inside CI's time; ``make fuzz`` sets ``SKAN_FUZZ=long`` and runs every
property test at its full count, beside the fuzz suite's long profile
(tests/fuzz/conftest.py).
"""

from __future__ import annotations

import os

LONG = os.environ.get("SKAN_FUZZ") == "long"
# make test's share of a full count: with a quarter the 54 property tests
# outside tests/fuzz take 37 s against 101 s at full counts, and the
# pure-Python re-run of the codec tests 10 s against 26 s (2-core machine).
SHARE = 4
# Fewer than this many inputs rarely reach a generator's larger shapes.
FLOOR = 50


def examples(full: int) -> int:
    """``full`` under ``SKAN_FUZZ=long``; otherwise a quarter of it, at least FLOOR."""
    if LONG:
        return full
    return max(full // SHARE, min(full, FLOOR))
