"""Every listener of a real broker process fed grammar-aware, mutated input over TCP.

Each input goes out on a fresh connection (in the pieces a peer's writes
would make), then a bystander pub/sub pair must still route a message, and
at the end the broker must still be running with no "Traceback" in its log:
peer faults are counted protocol errors with one log line.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.brokerproc import BrokerProcess
from tests.fuzz import grammar
from tests.fuzz.conftest import FINDINGS, PROFILE, tally
from tests.fuzz.syncpeer import SyncBystander, send_stream

# A round trip slower than this after a fuzz input means that input stalled
# the broker (generous: the machine may be busy).
BYSTANDER_SECONDS = 2.0


@pytest.fixture(scope="module")
def fuzzed():
    config = '[broker]\nmax_frame = 1048576\nqueue_limit = 4194304\n' \
             '[eventer]\nping_delay = 5.0\n'
    with BrokerProcess(config) as proc:
        bystander = SyncBystander(proc.skan)
        yield proc, bystander
        bystander.close()
        alive = proc.proc is not None and proc.proc.poll() is None
    assert alive, "the broker died under fuzzing:\n" + "".join(proc.stderr_lines[-40:])


def _tracebacks(target: str, lines: list[str]) -> list[int]:
    """Indexes of traceback lines in a slice of the broker's log (each is a finding)."""
    # One per logged traceback: nested ones of an exception group start with "|".
    traces = [i for i, line in enumerate(lines)
              if "Traceback" in line and not line.lstrip().startswith("|")]
    for i in traces:
        FINDINGS.append(f"{target}: broker log: " + "".join(lines[max(0, i - 2) : i + 16]))
    tally(target, "tracebacks in log", len(traces))
    return traces


@st.composite
def chunked(draw: st.DrawFn, streams: st.SearchStrategy[bytes]) -> list[bytes]:
    data = draw(streams)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def _run(fuzzed, listener: str, chunks: list[bytes]) -> None:
    proc, bystander = fuzzed
    target = f"listener {listener}"
    ended = send_stream(proc.addr[listener], chunks)
    tally(target, "inputs")
    tally(target, ended)
    try:
        took = bystander.check()
    except Exception as exc:
        FINDINGS.append(f"{target}: bystander failed ({exc}) after {b''.join(chunks)[:200]!r}")
        raise
    if took > BYSTANDER_SECONDS:
        FINDINGS.append(f"{target}: bystander took {took:.2f}s after {b''.join(chunks)[:200]!r}")
    assert took <= BYSTANDER_SECONDS


@pytest.mark.parametrize("listener", sorted(grammar.STREAMS))
def test_listener(fuzzed, listener):
    proc, _ = fuzzed
    before = len(proc.stderr_lines)

    @settings.get_profile(PROFILE)  # type: ignore[misc]
    @given(chunked(grammar.STREAMS[listener]))
    def fuzz(chunks):
        _run(fuzzed, listener, chunks)

    fuzz()
    lines = proc.stderr_lines[before:]
    traces = _tracebacks(f"listener {listener}", lines)
    assert not traces, "".join(lines[max(0, traces[0] - 2) : traces[0] + 30])
