"""Hypothesis profiles of the fuzz suite and its end-of-run summary.

``make test`` runs the suite briefly (profile ``fuzz-short``: a few dozen
inputs per target, seconds in all).  ``make fuzz`` sets ``SKAN_FUZZ=long``
(profile ``fuzz-long``: ``SKAN_FUZZ_EXAMPLES`` inputs per target, default
2000, minutes in all) and prints what was tried and found.
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, Verbosity, settings

from tests.examples import LONG

_checks = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
           HealthCheck.function_scoped_fixture]
# The short run is deterministic (same inputs every run, no example database)
# so `make test` cannot pass or fail by luck; the long run explores afresh.
settings.register_profile(
    "fuzz-short", max_examples=30, deadline=None, suppress_health_check=_checks,
    print_blob=True, derandomize=True, database=None,
)
settings.register_profile(
    "fuzz-long", max_examples=int(os.environ.get("SKAN_FUZZ_EXAMPLES", "2000")),
    deadline=None, suppress_health_check=_checks, print_blob=True,
    verbosity=Verbosity.normal,
)
PROFILE = "fuzz-long" if LONG else "fuzz-short"

# target -> what happened to its inputs ("inputs", "closed by broker", ...),
# filled by the tests and printed at the end of the run.
TALLY: dict[str, Counter] = {}
FINDINGS: list[str] = []


def tally(target: str, what: str, n: int = 1) -> None:
    TALLY.setdefault(target, Counter())[what] += n


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not TALLY:
        return
    tr = terminalreporter
    tr.section(f"fuzz summary (profile {PROFILE})")
    for target in sorted(TALLY):
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(TALLY[target].items()))
        tr.write_line(f"{target:<22} {counts}")
    if FINDINGS:
        tr.write_line(f"findings ({len(FINDINGS)}):")
        for line in FINDINGS:
            tr.write_line(f"  {line}")
    else:
        tr.write_line("findings: none")
