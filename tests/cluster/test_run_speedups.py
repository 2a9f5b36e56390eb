"""The compiled batch_key and run_parts (broker/_observer_speedups.c) against their
pure-Python references (broker/cluster/subject_runs.py), and the cluster's pure tests
again with SKAN_PURE_PYTHON=1 (the references then run everywhere)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cluster import subject_runs as runs
from broker.core.router import Endpoint, Routed
from tests.examples import examples
from wire.skan.codec import PURE_PYTHON

needs_c = pytest.mark.skipif(runs._batch_key_c is None,
                             reason="broker._observer_speedups not built (or SKAN_PURE_PYTHON=1)")
OWN = 3


def test_implementation_matches_the_mode():
    """CI must notice a broker that silently runs without the compiled backplane scan."""
    if PURE_PYTHON:
        assert runs.RUN_SCAN_IMPLEMENTATION == "python" and runs._run_parts_c is None
    else:
        assert runs.RUN_SCAN_IMPLEMENTATION == "c", (
            "broker/_observer_speedups is not built (or is an older build): run `pip install -e .`")


sender = Endpoint()
keys = st.sampled_from([(b"g", b"1", b"*"), (b"g", b"1", b"*"), (b"g", b"2", b"*"),
                        (b"h", b"1", b"*"), (b"g", b"1", b"x@h/1")])
numbers = st.one_of(st.integers(0, 5), st.sampled_from([2**63 - 1, -2**63, 2**63, -2**64]))
message = st.fixed_dictionaries({
    "key": keys,
    "server": st.sampled_from([OWN, OWN, OWN, 4]),
    "session": st.one_of(st.just(7), numbers),
    "step": st.sampled_from([1, 1, 1, 0, 2]),  # instance after the previous one
    "size": st.integers(0, 300),
    "stamp": st.one_of(st.floats(allow_nan=True), st.just(1.5)),
    # Not what the router makes (the reference raises or the C code declines):
    "odd": st.sampled_from([None] * 12 + ["no-to", "header-list", "int-stamp", "bytearray",
                                          "server-float"]),
})


def build(messages: list[dict], first: int) -> list[Routed]:
    batch = []
    instance = first
    for m in messages:
        group, inst, to = m["key"]
        header: object = {b"group": group, b"instance": inst, b"to": to}
        frame: object = b"f" * m["size"]
        stamp: object = m["stamp"]
        server: object = m["server"]
        if m["odd"] == "no-to":
            del header[b"to"]  # type: ignore[attr-defined]
        elif m["odd"] == "header-list":
            header = [1]
        elif m["odd"] == "int-stamp":
            stamp = 5
        elif m["odd"] == "bytearray":
            frame = bytearray(frame)  # type: ignore[arg-type]
        elif m["odd"] == "server-float":
            server = float(OWN)
        batch.append(Routed(frame, header, sender, (), 0, m["session"], instance, stamp,
                            server))
        instance += m["step"]
    return batch


def outcome(fn, *args):
    try:
        return ("ok", repr(fn(*args)))  # repr: NaN stamps compare equal as bytes
    except Exception as exc:  # the reference raising: the C code must decline
        return ("raises", type(exc).__name__)


@needs_c
@settings(max_examples=examples(600), deadline=None)
@given(st.lists(message, min_size=1, max_size=8), st.one_of(st.just(0), numbers))
def test_compiled_batch_key_equals_the_reference(messages, first):
    batch = build(messages, first)
    expected = outcome(runs.batch_key_py, batch, OWN)
    got = runs._batch_key_c(batch, OWN)
    if got is NotImplemented:
        # Declined: only where the reference raises or meets what the router never makes.
        assert expected[0] == "raises" or any(m["odd"] for m in messages) or any(
            abs(v) >= 2**63 for r in (batch[0], batch[-1]) for v in (r.session, r.instance))
    else:
        assert ("ok", repr(got)) == expected
    assert outcome(runs.batch_key, batch, OWN) == expected


@needs_c
@settings(max_examples=examples(600), deadline=None)
@given(st.lists(message, min_size=1, max_size=8))
def test_compiled_run_parts_equals_the_reference(messages):
    batch = build(messages, 0)
    expected = outcome(runs.run_parts_py, batch)
    got = runs._run_parts_c(batch)
    if got is NotImplemented:
        assert any(m["odd"] in ("int-stamp", "bytearray") for m in messages)
    else:
        assert ("ok", repr(got)) == expected
    assert outcome(runs.run_parts, batch) == expected


@needs_c
def test_what_they_do_not_handle_is_left_to_the_reference():
    assert runs._batch_key_c([], OWN) is NotImplemented  # the reference raises
    assert runs._batch_key_c((), OWN) is NotImplemented  # not a list
    assert runs._batch_key_c([], "3") is NotImplemented
    assert runs._run_parts_c([]) is NotImplemented
    assert runs._run_parts_c(()) is NotImplemented


@needs_c
def test_a_batch_changed_during_the_scan_is_not_read_freed():
    """A server whose comparison empties the caller's list: the C loop reads its
    own copy.  (Reading the caller's list instead, it met freed messages: an
    AttributeError from a cleared one, or worse.)"""
    messages = [{"key": (b"g", b"1", b"*"), "server": OWN, "session": 7, "step": 1,
                 "size": 10, "stamp": 1.0, "odd": None}] * 50
    batch = build(messages, 0)

    class Clearing(int):
        def __eq__(self, other: object) -> bool:
            batch.clear()
            return int(self) == other

        __hash__ = int.__hash__

    for r in batch:
        r.server = Clearing(OWN)
    assert runs._batch_key_c(batch, OWN) == (b"g", b"1", b"*", True)
    assert batch == []


def test_batch_key_and_run_parts_on_a_plain_run():
    messages = [{"key": (b"g", b"1", b"*"), "server": OWN, "session": 7, "step": 1,
                 "size": 10 * i, "stamp": 1.5 + i, "odd": None} for i in range(3)]
    batch = build(messages, 4)
    assert runs.batch_key(batch, OWN) == (b"g", b"1", b"*", True)
    assert runs.batch_key(batch, OWN + 1) is None
    frames, ends, stamps, largest = runs.run_parts(batch)
    assert frames == [b"", b"f" * 10, b"f" * 20] and ends == [8, 26, 54] and largest == 20
    assert stamps == runs.pack_stamps([1.5, 2.5, 3.5])
    batch[2].instance += 1
    assert runs.batch_key(batch, OWN) == (b"g", b"1", b"*", False)
    batch[1].header = {b"group": b"h", b"instance": b"1", b"to": b"*"}
    assert runs.batch_key(batch, OWN) is None


@pytest.mark.skipif(PURE_PYTHON, reason="already running in pure-Python mode")
def test_cluster_pure_tests_pass_in_pure_python_mode():
    """The references stay tested: the backplane's pure tests with SKAN_PURE_PYTHON=1."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "tests/cluster/test_run_speedups.py", "tests/cluster/test_runs.py",
         "tests/cluster/test_inbound.py", "tests/cluster/test_backplane_property.py",
         "tests/cluster/test_interest.py"],
        cwd=root, env={**os.environ, "SKAN_PURE_PYTHON": "1"}, capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
