"""The one Routed <-> Hat event mapping (broker/core/events.py) on the shared model."""

from __future__ import annotations

from broker.core import events
from broker.core.router import Routed
from wire import hat


def _routed(message: events.Injected, timestamp: float = 1700000000.25) -> Routed:
    return Routed(message.frame, message.header, None, (), 1, 9, 4, timestamp)


def test_an_event_survives_send_and_back():
    source = hat.Timestamp(1700000000, 123456)
    message = events.send_for_event(("g", "a", "b"), hat.JsonPayload({"k": ["v", None]}),
                                    sender=b"x_1@h", seq=1, source_timestamp=source)
    assert message.header[events.SOURCE_TIMESTAMP_TAG] == b"1700000000.123456"
    event = events.event_from_routed(_routed(message), 3)
    assert event == hat.Event(hat.EventId(3, 9, 4), ("g", "a", "b"),
                              hat.Timestamp(1700000000, 250000), source,
                              hat.JsonPayload({"k": ["v", None]}))


def test_sbs_payload_is_routed_as_named_binary():
    message = events.send_for_event(("g",), hat.SbsPayload("M", "T", b"\x00\xff"),
                                    sender=b"x_1@h", seq=1)
    assert message.header[events.PAYLOAD_TYPE_TAG] == b"sbs:M.T"
    assert message.header[b"instance"] == b"*"
    event = events.event_from_routed(_routed(message), 1)
    assert event.payload == hat.BinaryPayload("sbs:M.T", b"\x00\xff")
    assert hat.sbs_payload(event.payload) == hat.SbsPayload("M", "T", b"\x00\xff")


def test_source_timestamp_formats_alike_from_both_forms():
    for ts in (hat.Timestamp(-1, 750000), hat.Timestamp(0, 1), hat.Timestamp(12, 500000)):
        assert events.format_timestamp(ts) == events.format_timestamp(ts.to_float())
    assert events.format_timestamp(hat.Timestamp(-1, 750000)) == b"-0.250000"
