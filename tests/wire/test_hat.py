"""The one Hat event model (wire/hat.py): shared by both codecs, crossing protocols."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from wire import eventer as ew
from wire import hat
from wire import mariner as mw
from wire.chatter import sbs
from wire.eventer import messages as em


def test_both_codecs_use_the_one_model():
    for name in ("Event", "EventId", "Timestamp", "BinaryPayload", "JsonPayload",
                 "SbsPayload"):
        assert getattr(ew, name) is getattr(hat, name)
        assert getattr(mw, name) is getattr(hat, name)


def test_event_ids_and_timestamps_are_ordered():
    assert hat.EventId(1, 2, 3) < hat.EventId(1, 3, 0) < hat.EventId(2, 0, 0)
    assert hat.Timestamp(1, 999999) < hat.Timestamp(2, 0)
    assert hat.Timestamp.from_float(-0.25) == hat.Timestamp(-1, 750000)
    assert hat.Timestamp(-1, 750000).to_float() == -0.25


def test_sbs_payload_routes_as_named_binary_and_back():
    p = hat.SbsPayload("Mod", "T", b"\x01")
    binary = p.to_binary()
    assert binary == hat.BinaryPayload("sbs:Mod.T", b"\x01")
    assert hat.sbs_payload(binary) == p
    assert hat.SbsPayload(None, "T", b"").to_binary().type == "sbs:T"
    assert hat.sbs_payload(hat.BinaryPayload("sbs:T", b"")) == hat.SbsPayload(None, "T", b"")
    assert hat.sbs_payload(hat.BinaryPayload("png", b"")) is None


def _eventer_round_trip(event: hat.Event) -> hat.Event:
    return em.event_from_sbs(sbs.decode("HatEventer.Event", ew.encode_event(event)))


def _mariner_round_trip(event: hat.Event) -> hat.Event:
    body = mw.encode_events_body([mw.encode_event(event)])
    msg = mw.decode_message(body)
    assert isinstance(msg, mw.Events)
    return msg.events[0]


payloads = st.one_of(
    st.none(),
    st.builds(hat.JsonPayload, st.recursive(
        st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)),
    st.builds(hat.BinaryPayload, st.text(max_size=6), st.binary(max_size=16)),
    st.builds(hat.SbsPayload, st.none() | st.text("ab", min_size=1, max_size=3),
              st.text("xy", min_size=1, max_size=3), st.binary(max_size=8)),
)
timestamps = st.builds(hat.Timestamp, st.integers(0, 2**40), st.integers(0, 999_999))
events = st.builds(
    hat.Event,
    st.builds(hat.EventId, st.integers(0, 2**31), st.integers(0, 2**40),
              st.integers(0, 2**40)),
    st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=4).map(tuple),
    timestamps, st.none() | timestamps, payloads,
)


@given(events)
def test_one_event_crosses_both_protocols(event):
    """Each codec keeps the event, except what its protocol cannot carry (wire/hat.py)."""
    via_mariner = _mariner_round_trip(event)
    via_eventer = _eventer_round_trip(event)
    p = event.payload
    if isinstance(p, hat.BinaryPayload):
        # Mariner has no binary type name; Eventer keeps it.
        assert via_mariner == attrs_evolve(event, hat.BinaryPayload("", p.data))
        assert via_eventer == event
    elif isinstance(p, hat.SbsPayload):
        # Eventer has no SBS kind: it carries the named binary form.
        assert via_mariner == event
        assert via_eventer == attrs_evolve(event, p.to_binary())
    else:
        assert via_mariner == event
        assert via_eventer == event


def attrs_evolve(event: hat.Event, payload: hat.Payload) -> hat.Event:
    return hat.Event(event.id, event.type, event.timestamp, event.source_timestamp, payload)
