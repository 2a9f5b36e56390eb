"""The one Routed <-> Hat event mapping (broker/core/events.py) on the shared model."""

from __future__ import annotations

import json

import pytest

from broker.core import events
from broker.core.router import Routed
from broker.core.skan_handler import check_payload_json
from wire import hat
from wire.skan import decode, decode_header, encode_frame
from wire.skan.eventjson import PAYLOAD_JSON_TAG, loads_exact, lossless, skan_view


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


# ---- payload fidelity: the payload-json tag (BROKER-SPEC 3) -----------------------------


EXACT = [
    True, False, 1234, 1.5, -0.0, 1.0, 0, -7, 2**70, -(2**70), 1e-300, 123456789.123456,
    {"request_id": "w", "value": 1234},
    {"z": 1, "a": True, "m": [1, 2.0, None, "3", {"deep": [False]}]},
    [1, "1", True, "true", None, 2.5],
    {"": 1}, {"k" * 300: "long key"},
    {"only": ["strings", None, {"x": "y"}], "": "empty key"},
]
LOSSLESS = ["text", "1234", "true", {"a": "b", "l": ["x", None, {}]}, [], {}, ""]


def _exact_type(a, b) -> bool:
    """Equal with the same JSON types throughout (True != 1, 1.0 != 1), key order included."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_exact_type(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_exact_type, a, b))
    if isinstance(a, float):
        return a == b and str(a) == str(b)  # -0.0 stays -0.0
    return a == b


@pytest.mark.parametrize("value", [*EXACT, None], ids=repr)
def test_hat_json_payload_comes_back_exactly(value):
    message = events.send_for_event(("g", "i"), hat.JsonPayload(value), sender=b"x_1@h", seq=1)
    assert PAYLOAD_JSON_TAG in message.header
    # the frame is what travels: decode it again as any hop (store, cluster) does
    header = decode_header(message.frame, 4)
    assert header[PAYLOAD_JSON_TAG] == json.dumps(
        value, ensure_ascii=False, separators=(",", ":")).encode()
    payload = events.payload_from_routed(Routed(message.frame, header, None, (), 1, 1, 1, 1.0))
    assert isinstance(payload, hat.JsonPayload)
    assert _exact_type(payload.data, value)


@pytest.mark.parametrize("value", LOSSLESS, ids=repr)
def test_lossless_payloads_carry_no_tag(value):
    message = events.send_for_event(("g",), hat.JsonPayload(value), sender=b"x_1@h", seq=1)
    assert PAYLOAD_JSON_TAG not in message.header
    payload = events.payload_from_routed(_routed(message))
    assert _exact_type(payload.data, value)


def test_skan_view_stays_what_skan_subscribers_saw():
    msg, exact = skan_view({"n": 1, "ok": True, "f": 1.0, "l": [None, 2.5]})
    assert msg == {b"n": b"1", b"ok": b"true", b"f": b"1.0", b"l": [None, b"2.5"]}
    assert exact == b'{"n":1,"ok":true,"f":1.0,"l":[null,2.5]}'
    # a key that cannot be a Skan tag: the JSON text is the Skan view
    msg, exact = skan_view({"": 1})
    assert msg == exact == b'{"":1}'
    assert skan_view(None) == (None, b"null")
    assert lossless({"a": [None, "x"]}) and not lossless({"a": [None, 0]})


def test_a_null_payload_is_not_no_payload():
    message = events.send_for_event(("g",), hat.JsonPayload(None), sender=b"x_1@h", seq=1)
    assert message.header[b"msg"] is None
    assert events.payload_from_routed(_routed(message)) == hat.JsonPayload(None)
    message = events.send_for_event(("g",), None, sender=b"x_1@h", seq=1)
    assert PAYLOAD_JSON_TAG not in message.header
    assert events.payload_from_routed(_routed(message)) is None


def _skan_send(tags: dict, msg=b"view") -> Routed:
    frame = encode_frame({"type": "send", "from": "x_1@h", "to": "*", "group": "g",
                          "instance": "*", "seq": "5", **tags, "msg": msg})
    return Routed(frame, decode_header(frame, 4), None, (), 1, 1, 1, 1.0)


def test_tag_wins_for_hat_and_msg_for_skan():
    routed = _skan_send({"payload-json": b'{"value": 12, "on": false}'},
                        msg={b"value": b"something else"})
    assert events.payload_from_routed(routed) == hat.JsonPayload({"value": 12, "on": False})
    assert decode(routed.frame[4:])[b"msg"] == {b"value": b"something else"}


def test_a_bad_tag_falls_back_to_the_skan_view():
    # Skan sends are checked on entry; a frame that skipped the check (a foreign
    # cluster peer) must not give Hat consumers invalid JSON.
    for raw in (b"{nope", b"\xff", b"[" * 200 + b"]" * 200, b"1" * 200):
        routed = _skan_send({"payload-json": raw})
        assert events.payload_from_routed(routed) == hat.JsonPayload("view")


@pytest.mark.parametrize("tags, reason", [
    ({"payload-json": b"{nope"}, "is not a JSON payload"),
    ({"payload-json": b"\xff\xfe"}, "not UTF-8"),
    ({"payload-json": None}, "must be DATA"),
    ({"payload-json": {"a": b"1"}}, "must be DATA"),
    ({"payload-json": b"[" * 101 + b"]" * 101}, "nested too deeply"),
    ({"payload-json": b"9" * 101}, "digits"),
    ({"payload-json": b"1e400"}, "out of range"),
    ({"payload-json": b"NaN"}, "not valid JSON"),
    ({"payload-json": b'"\\ud800"'}, "surrogate"),
    ({"payload-json": b"1", "payload-type": b"blob"}, "exclude each other"),
])
def test_skan_send_tag_is_checked(tags, reason):
    assert reason in check_payload_json(_skan_send(tags).header)


def test_sound_tags_pass_the_check():
    for raw in (b"true", b"null", b' {"a" : [1, 2.0]} ', b"-0", str(2**70).encode()):
        assert check_payload_json(_skan_send({"payload-json": raw}).header) is None
        assert loads_exact(raw) == json.loads(raw)


def test_source_timestamp_is_read_back_exactly():
    for ts in (hat.Timestamp(1700000000, 123457), hat.Timestamp(-1, 750000),
               hat.Timestamp(4102444800, 999999), hat.Timestamp(0, 1),
               hat.Timestamp(253402300799, 1)):
        message = events.send_for_event(("g",), None, sender=b"x_1@h", seq=1,
                                        source_timestamp=ts)
        assert events.source_timestamp_exact(message.header) == ts
        assert events.event_from_routed(_routed(message), 1).source_timestamp == ts
    # other decimal forms (a Skan client's own tag) are read as float seconds
    assert events.source_timestamp_exact({events.SOURCE_TIMESTAMP_TAG: b"12.5"}) == \
        hat.Timestamp(12, 500000)
    assert events.source_timestamp_exact({events.SOURCE_TIMESTAMP_TAG: b"bogus"}) is None
