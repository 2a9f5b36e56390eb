"""The compiled batch_row (broker/_observer_speedups.c) against the pure-Python reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core import events
from broker.core.router import Router
from broker.store import batch_rows as runs
from tests.store.test_store import Clock, Sender

needs_c = pytest.mark.skipif(runs._batch_row_c is None,
                             reason="broker._observer_speedups not built (or SKAN_PURE_PYTHON=1)")


def test_observer_implementation_matches_the_mode():
    """CI must notice a broker that silently runs without its compiled observers."""
    from broker.observability.routelog import record
    from wire.skan.codec import PURE_PYTHON

    if PURE_PYTHON:
        assert runs._batch_row_c is None and record._lines_c is None
    else:
        assert runs.BATCH_ROW_IMPLEMENTATION == "c" and record._lines_c is not None, (
            "broker/_observer_speedups is not built: run `pip install -e .` (or make venv)")


message = st.tuples(
    st.sampled_from([("g", "1"), ("g", "1"), ("g", "1"), ("g", "2"), ("h", "1")]),
    st.integers(0, 400),  # payload size
    st.booleans() | st.just(False),  # source timestamp
    st.sampled_from([0.0, 0.0, 1e-6, 0.3, -0.1, float("nan")]),  # clock step
)


def route_batch(messages, remote_at: int | None = None) -> list:
    clock = Clock()
    router = Router(clock=clock)
    sender = Sender()
    router.attach(sender)
    batch = []
    for i, ((group, instance), size, src, step) in enumerate(messages):
        clock.now += step
        sent = events.send_for_event(
            (group, instance), events.JsonPayload("x" * size), sender=sender.lname, seq=i,
            source_timestamp=1_600_000_000.5 if src else None)
        origin = (9, 1, 1, 1.0) if i == remote_at else None
        routed = router.route(sender, sent.frame, sent.header, origin=origin)
        if origin is None:
            batch.append(routed)
    return batch


@needs_c
@settings(max_examples=400, deadline=None)
@given(messages=st.lists(message, min_size=1, max_size=12),
       remote_at=st.one_of(st.none(), st.integers(0, 11)),
       max_run=st.sampled_from([3, 8, 4096]), max_bytes=st.sampled_from([300, 2000, 1 << 20]),
       max_span=st.sampled_from([0.5, 1.0]))
def test_compiled_batch_row_equals_the_reference(messages, remote_at, max_run, max_bytes,
                                                 max_span):
    batch = route_batch(messages, remote_at)
    if not batch:
        return
    saved = runs.MAX_RUN, runs.MAX_RUN_BYTES, runs.MAX_RUN_SPAN
    runs.MAX_RUN, runs.MAX_RUN_BYTES, runs.MAX_RUN_SPAN = max_run, max_bytes, max_span
    try:
        expected = runs.batch_row_py(batch)
    finally:
        runs.MAX_RUN, runs.MAX_RUN_BYTES, runs.MAX_RUN_SPAN = saved
    got = runs._batch_row_c(batch, events.SOURCE_TIMESTAMP_TAG, max_run, max_bytes, max_span)
    assert repr(got) == repr(expected)  # equal, NaN timestamps included


@needs_c
def test_what_it_does_not_handle_is_left_to_the_reference():
    batch = route_batch([(("g", "1"), 10, False, 0.0)] * 3)
    batch[1].timestamp = 5  # an int: not what the router makes
    assert runs._batch_row_c(batch, events.SOURCE_TIMESTAMP_TAG, 10, 1 << 20, 1.0) \
        is NotImplemented
    assert runs.batch_row(batch) == runs.batch_row_py(batch)
    assert runs._batch_row_c((), b"x", 1, 1, 1.0) is NotImplemented  # not a list

