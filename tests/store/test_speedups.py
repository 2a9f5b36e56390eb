"""The compiled batch_row (broker/_observer_speedups.c) against the pure-Python reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core import events
from broker.core.router import Router
from broker.store import batch_rows as runs
from tests.examples import examples
from tests.store.test_store import Clock, Sender

needs_c = pytest.mark.skipif(runs._batch_row_c is None,
                             reason="broker._observer_speedups not built (or SKAN_PURE_PYTHON=1)")


def test_observer_implementation_matches_the_mode():
    """CI must notice a broker that silently runs without its compiled observers."""
    from broker.observability.routelog import record
    from wire.skan.codec import PURE_PYTHON

    if PURE_PYTHON:
        assert runs._batch_row_c is None and runs._merge_rows_c is None and record._lines_c is None
    else:
        assert (runs.BATCH_ROW_IMPLEMENTATION == "c" and record._lines_c is not None
                and runs._merge_rows_c is not None), (
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
@settings(max_examples=examples(400), deadline=None)
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



# A queue as the store's writer sees it: routing batches (each queued as its
# row when it is one run, else as the list), with other operations between.
# A routing batch ends its session (end_batch: an independent publisher's
# write) or only hands over what it routed so far (hand_over: the session
# goes on, as between the slices of one large read).
segment = st.one_of(
    st.tuples(st.lists(message, min_size=1, max_size=4), st.booleans() | st.just(True)),
    st.sampled_from(["lost", "spool"]),
)
ROW = 4  # broker.store.writer.ROW: the row_kind argument


# Bounds low enough to bind on a queue of a few dozen small messages.
RUN_BOUNDS = {"max_run": st.sampled_from([2, 5, 4096]),
              "max_bytes": st.sampled_from([400, 3000, 1 << 20]),
              "max_span": st.sampled_from([0.25, 1.0])}


def queued(segments) -> list:
    """The writer's queue of ``segments`` (see :func:`queued_with_messages`)."""
    return queued_with_messages(segments)[0]


@needs_c
@settings(max_examples=examples(300), deadline=None)
@given(segments=st.lists(segment, min_size=1, max_size=30), **RUN_BOUNDS)
def test_compiled_merge_rows_equals_the_reference(segments, max_run, max_bytes, max_span):
    """Queued rows merged into runs, in C and in the reference, from every start."""
    ops = queued(segments)
    for start, op in enumerate(ops):
        if type(op) is not tuple or op[0] != ROW:
            continue
        for end in {start + 1, min(start + 3, len(ops)), len(ops)}:
            expected = runs.merge_rows_py(ops, start, end, ROW, max_run, max_bytes, max_span)
            got = runs._merge_rows_c(ops, start, end, ROW, max_run, max_bytes, max_span)
            assert repr(got) == repr(expected)  # NaN timestamps included


def test_merged_rows_decode_to_their_messages():
    """A run merged from independent publishers' rows (each its own session) holds
    every message with its EventId, in order, whichever implementation merged it."""
    ops = queued([([(("g", "1"), 20 + k, False, 1e-6)], True) for k in range(6)]
                 + [([(("g", "1"), 30, False, 1e-6)] * 3, True)])
    rows = [op[1] for op in ops]
    want = [(r[0], r[1] + m) for r in rows for m in range(r[2] - r[1] + 1)]
    merges = [runs.merge_rows_py]
    if runs._merge_rows_c is not None:
        merges.append(runs._merge_rows_c)
    for merge in merges:
        j, row, n = merge(ops, 0, len(ops), ROW, 4096, 1 << 20, 1.0)
        assert (j, n) == (len(ops), 9)
        assert row[13] is not None  # across sessions: the EventIds are kept
        # decode() takes the columns in RUN_COLUMNS order.
        got = list(runs.decode(row[:5] + row[9:13] + (row[7], row[13])))
        assert [(e[0], e[1]) for e, _ in got] == want
        frames = b"".join(op[1][12] for op in ops)
        assert b"".join(e[3] for e, _ in got) == frames


@needs_c
def test_merge_rows_leaves_what_it_does_not_expect_to_the_reference():
    ops = queued([([(("g", "1"), 10, False, 0.0)], True)] * 3)
    bad = list(ops)
    bad[1] = (ROW, ops[1][1][:12], *ops[1][2:])  # a row missing a column
    assert runs._merge_rows_c(bad, 0, 3, ROW, 4096, 1 << 20, 1.0) is NotImplemented
    odd = list(ops)
    row = list(ops[2][1])
    row[9] = row[9][:-1]  # timestamps not 8 bytes a message
    odd[2] = (ROW, tuple(row), *ops[2][2:])
    assert runs._merge_rows_c(odd, 0, 3, ROW, 4096, 1 << 20, 1.0) is NotImplemented
    assert runs._merge_rows_c(ops, 3, 3, ROW, 4096, 1 << 20, 1.0) is NotImplemented
    assert runs._merge_rows_c((), 0, 1, ROW, 4096, 1 << 20, 1.0) is NotImplemented
    # Another operation ends a merge; it is not a malformed row.
    mixed = [ops[0], (0, 1, 2, 3), ops[1]]
    assert runs._merge_rows_c(mixed, 0, 3, ROW, 4096, 1 << 20, 1.0)[0] == 1


class QueueOnly:
    """The part of a StoreWriter that StoreWriter._queue_batch touches."""

    def __init__(self) -> None:
        self._open = None
        self._ops: list = []
        self._added_bytes = 0


def queued_with_messages(segments, open_runs: bool = False) -> tuple[list, list]:
    """A queue as the store's writer sees it, and the messages it holds (those
    not lost), in order: each routing batch queued as its row when it is one
    run (the reference's row), else as the list; with ``open_runs``, queued
    as the store queues it (StoreWriter._queue_batch: open runs)."""
    ops, queue, messages = queued_both_ways(segments)
    return (queue if open_runs else ops), messages


def queued_both_ways(segments) -> tuple[list, list, list]:
    """The same routing batches queued as rows (the reference) and as the store
    queues them, and the messages (see :func:`queued_with_messages`)."""
    from broker.store.writer import StoreWriter

    store = QueueOnly()
    clock = Clock()
    router = Router(clock=clock)
    sender = Sender()
    router.attach(sender)
    batches: list[list] = []
    router.local_observers.append(batches.append)
    ops: list = []
    messages: list = []
    for seg in segments:
        if isinstance(seg, str):
            store._open = None  # as every other operation the store queues
            store._ops.append((0, 1, 2, 3) if seg == "lost" else (1, "bridge", 1, 2, 0.5,
                                                                   b"frame"))
            ops.append(store._ops[-1])
            continue
        for i, ((group, instance), size, src, step) in enumerate(seg[0]):
            clock.now += step
            sent = events.send_for_event(
                (group, instance), events.JsonPayload("y" * size), sender=sender.lname, seq=i,
                source_timestamp=1_600_000_000.5 if src else None)
            router.route(sender, sent.frame, sent.header)
        router.end_batch() if seg[1] else router.hand_over()
        batch = batches.pop()
        messages += batch
        StoreWriter._queue_batch(store, batch)
        row = runs.batch_row_py(batch)
        ops.append(batch if row is None else
                   (ROW, row, batch[-1].timestamp, batch[-1].delivered, batch[-1].frame))
    return ops, store._ops, messages


def reference_runs(ops: list, max_run: int, max_bytes: int, max_span: float) -> list:
    """A queue's runs by the reference: each stretch of queued rows merged greedily
    by merge_rows_py, as (row, last timestamp, delivered, frame, session, events);
    other operations as they are ("list" for a routing batch not one run)."""
    out: list = []
    i = 0
    while i < len(ops):
        op = ops[i]
        if type(op) is tuple and op[0] == ROW:
            j, row, n = runs.merge_rows_py(ops, i, len(ops), ROW, max_run, max_bytes, max_span)
            last = ops[j - 1]
            out.append((row, last[2], last[3], last[4], last[1][0], n))
            i = j
        else:
            out.append("list" if type(op) is list else op)
            i += 1
    return out


@needs_c
@settings(max_examples=examples(300), deadline=None)
@given(segments=st.lists(segment, min_size=1, max_size=30), **RUN_BOUNDS)
def test_open_runs_equal_the_reference(segments, max_run, max_bytes, max_span):
    """Batches queued as the store queues them (into open runs, RunBuilder.add) give
    the runs merge_rows_py gives the same batches queued as rows: the same rows,
    byte for byte, with the same last message and count."""
    saved = runs.MAX_RUN, runs.MAX_RUN_BYTES, runs.MAX_RUN_SPAN
    runs.MAX_RUN, runs.MAX_RUN_BYTES, runs.MAX_RUN_SPAN = max_run, max_bytes, max_span
    try:
        ops, queue, _ = queued_both_ways(segments)
        expected = reference_runs(ops, max_run, max_bytes, max_span)
    finally:
        runs.MAX_RUN, runs.MAX_RUN_BYTES, runs.MAX_RUN_SPAN = saved
    got: list = []
    for op in queue:
        if type(op) is runs.RunBuilder:
            taken = op.take()
            assert taken is not None and taken[0] == writer_RUN
            got.append(taken[1:])
            assert op.take() is None  # handed over once
        else:
            got.append("list" if type(op) is list else op)
    assert repr(got) == repr(expected)  # NaN timestamps included


writer_RUN = 6  # broker.store.writer.RUN


@needs_c
def test_a_sealed_open_run_takes_no_more():
    batches = [route_batch([(("g", "1"), 10 + k, False, 1e-6)]) for k in range(3)]
    run = runs.new_run(writer_RUN)
    assert run.add(batches[0]) == len(batches[0][0].frame)
    run.seal()
    assert run.add(batches[1]) == -1
    assert (run.events, run.nbytes, run.sealed) == (1, len(batches[0][0].frame), True)
    taken = run.take()
    assert taken[-1] == 1 and taken[1][12] == batches[0][0].frame
    fresh = runs.new_run(writer_RUN)
    assert fresh.take() is None and fresh.add(batches[2]) == -1  # take() seals too
    odd = route_batch([(("g", "1"), 10, False, 0.0)])
    odd[0].timestamp = 5  # an int: not what the router makes
    assert runs.new_run(writer_RUN).add(odd) is NotImplemented
    assert runs.new_run(writer_RUN).add(()) is NotImplemented  # not a list


@needs_c
def test_a_runs_first_frame_is_lent_and_never_written_into():
    """A run's first batch of one message lends its frame as the frames column (no
    copy on the routing thread); the next batch gets a column of the run's own,
    and the routed frames, shared with their recipients, stay as they were."""
    routed = route_batch([(("g", "1"), size, False, 1e-6) for size in (300, 5, 40)])
    batches = [[message] for message in routed]  # one message a write
    frames = [message.frame for message in routed]
    copies = [bytes(bytearray(frame)) for frame in frames]
    alone = runs.new_run(writer_RUN)
    alone.add(batches[0])
    assert alone.take()[1][12] is frames[0]  # lent: the frame itself
    row = runs.batch_row(batches[0])
    assert row is not None and row[12] is frames[0]  # batch_row lends it too
    run = runs.new_run(writer_RUN)
    for batch in batches:
        assert run.add(batch) == len(batch[0].frame)
    taken = run.take()
    assert taken[1][12] == b"".join(copies)
    assert frames == copies


@settings(max_examples=examples(200), deadline=None)
@given(segments=st.lists(segment, min_size=1, max_size=30), open_runs=st.booleans())
def test_the_writer_stores_every_queued_message_in_runs_that_keep_the_rule(segments, open_runs):
    """The writer's whole path, queue to rows (_expand, then collect), with routing
    batches queued as rows or as lists: the rows decode to every message in
    routing order, and every run keeps the rule (one type, timestamps that do
    not go back, within the bounds, a message with a source timestamp alone)."""
    from broker.store import writer

    ops, messages = queued_with_messages(segments, open_runs)
    tx = writer.collect(writer._expand(ops), 0)
    got = []
    for row in tx.rows:
        decoded = [e for e, _ in runs.decode((*row[:5], *row[9:13], row[7], row[13]))]
        got += decoded
        assert {(e[5], e[6]) for e in decoded} == {(row[3], row[4])}
        ts = [e[2] for e in decoded]
        # (A NaN timestamp, a clock gone wrong, ends a run: it compares false.)
        assert len(ts) == 1 or (all(map(float.__le__, ts, ts[1:]))
                                and ts[-1] - ts[0] <= runs.MAX_RUN_SPAN)
        assert len(decoded) <= runs.MAX_RUN
        assert len(decoded) == 1 or row[8] <= runs.MAX_RUN_BYTES
        if row[7] is not None:
            assert len(decoded) == 1
    want = [(r.session, r.instance, r.timestamp, r.frame, r.delivered, r.header[b"group"],
             r.header[b"instance"]) for r in messages]
    assert repr(got) == repr(want)  # NaN timestamps included
    assert tx.new_events == len(messages)
    tagged = sum(events.SOURCE_TIMESTAMP_TAG in r.header for r in messages)
    assert sum(row[7] is not None for row in tx.rows) == tagged
