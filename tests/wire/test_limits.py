"""Decoder limits (wire/limits.py): each refuses quickly, as a ProtocolError, never a traceback."""

from __future__ import annotations

import time

import pytest

from wire import boundedjson
from wire.chatter import ChatterConnection, Envelope, sbs
from wire.chatter.connection import MAX_HELD_AGE, MAX_OPEN_CONVERSATIONS
from wire.errors import LimitError, MalformedError, ProtocolError, RemoteProtocolError
from wire.eventer import (
    ClientConnection,
    ConversationExpired,
    InitReq,
    ServerConnection,
    Status,
)
from wire.eventer import messages as m
from wire.limits import (
    MAX_BATCH_ITEMS,
    MAX_DEPTH,
    MAX_INT_DIGITS,
    MAX_ITEMS,
    MAX_PAYLOAD_ITEMS,
    ItemBudget,
)
from wire.mariner import CLIENT, SERVER, MarinerConnection, encode_frame
from wire.skan import decode, decode_header, encode

HEADER = {"type": "send", "group": "g", "instance": "i", "to": "*", "from": "a", "seq": "1"}


def skan_with_msg(tylen: int, body: bytes) -> bytes:
    """A Skan message whose ``msg`` is a container of the given TyLen (32-bit length)."""
    return encode(HEADER) + b"\x03msg" + bytes((tylen,)) + len(body).to_bytes(4, "big") + body


def cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


# ---- Skan -------------------------------------------------------------------------


def test_skan_list_of_8_million_nulls_is_refused_quickly():
    # 8 MB, under max_frame: walking it item by item froze the broker for ~3 s.
    message = skan_with_msg(0x03, b"\x04" * 8_000_000)

    def refuse():
        with pytest.raises(LimitError, match=f"more than {MAX_ITEMS} items"):
            decode_header(message)

    assert cpu(refuse) < 0.5


def test_skan_hash_of_many_tags_is_refused():
    body = b"".join(bytes((3,)) + i.to_bytes(3, "big") + b"\x04" for i in range(MAX_ITEMS + 1))
    with pytest.raises(LimitError):
        decode_header(skan_with_msg(0x02, body))
    with pytest.raises(LimitError):
        decode(skan_with_msg(0x02, body))


def test_skan_top_level_tags_count_too():
    tags = b"".join(bytes((3,)) + i.to_bytes(3, "big") + b"\x04" for i in range(MAX_ITEMS + 1))
    with pytest.raises(LimitError):
        decode_header(b"Skan" + tags)


def test_skan_items_up_to_the_limit_are_accepted():
    n = MAX_ITEMS - len(HEADER) - 1  # the routing tags and msg itself count
    header = decode_header(skan_with_msg(0x03, b"\x04" * n))
    assert header[b"msg"].stop - header[b"msg"].start == n
    with pytest.raises(LimitError):
        decode_header(skan_with_msg(0x03, b"\x04" * (n + 1)))


def test_skan_depth_limit_is_a_limit_error():
    body = b"\x04"
    for _ in range(MAX_DEPTH + 1):
        body = b"\x03" + len(body).to_bytes(4, "big") + body
    with pytest.raises(LimitError, match="nesting deeper"):
        decode_header(encode(HEADER) + b"\x03msg" + body)


# ---- SBS ----------------------------------------------------------------------------


def test_sbs_arrays_are_charged_before_their_elements_are_walked():
    # An EventType (Array(String)) of MAX_ITEMS + 1 empty strings: one byte each.
    data = sbs.encode_integer(MAX_ITEMS + 1) + b"\x80" * (MAX_ITEMS + 1)

    def refuse():
        with pytest.raises(LimitError):
            sbs.decode("HatEventer.EventType", data)

    assert cpu(refuse) < 0.1
    ok = sbs.encode_integer(1000) + b"\x80" * 1000
    assert sbs.decode("HatEventer.EventType", ok) == [""] * 1000


def test_sbs_budget_is_shared_across_arrays_of_one_message():
    budget = ItemBudget(10)
    sbs.decode("HatEventer.EventType", sbs.encode_integer(6) + b"\x80" * 6, budget)
    with pytest.raises(LimitError):
        sbs.decode("HatEventer.EventType", sbs.encode_integer(6) + b"\x80" * 6, budget)


# ---- JSON ---------------------------------------------------------------------------


def test_json_flat_array_over_the_item_limit_is_refused_before_parsing():
    text = "[" + "null," * 8_000_000 + "null]"

    def refuse():
        with pytest.raises(LimitError, match="items"):
            boundedjson.loads(text)

    assert cpu(refuse) < 1.0


def test_json_commas_inside_strings_do_not_count():
    text = '["' + "," * (3 * MAX_ITEMS) + '"]'
    assert boundedjson.loads(text) == ["," * (3 * MAX_ITEMS)]


def test_json_depth_is_refused_without_recursion():
    for depth in (MAX_DEPTH + 1, 50_000):
        with pytest.raises(LimitError, match="nested too deeply"):
            boundedjson.loads("[" * depth + "]" * depth)
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert boundedjson.loads(nested) is not None
    with pytest.raises(MalformedError):
        boundedjson.loads("[" * 500 + "}" * 500)


def test_json_brackets_inside_strings_do_not_nest():
    text = '["' + "[" * 5000 + '"]'
    assert boundedjson.loads(text) == ["[" * 5000]


def test_json_huge_integers_are_a_limit_error_not_a_value_error():
    with pytest.raises(LimitError, match="digits"):
        boundedjson.loads("1" * 10_000)
    with pytest.raises(LimitError):
        boundedjson.loads('{"a": -' + "9" * (MAX_INT_DIGITS + 1) + "}")
    assert boundedjson.loads("9" * MAX_INT_DIGITS) == int("9" * MAX_INT_DIGITS)


def test_json_non_finite_numbers_and_constants_are_refused():
    for text in ("1e999", "-1e999", "NaN", "Infinity", "[-Infinity]"):
        with pytest.raises(MalformedError):
            boundedjson.loads(text)


def test_json_lone_surrogates_are_refused_and_pairs_accepted():
    for text in ('"\\ud800"', '["x", {"\\udc00": 1}]', '"\\ud83d"'):
        with pytest.raises(MalformedError, match="surrogate"):
            boundedjson.loads(text)
    assert boundedjson.loads('"\\ud83d\\ude00"') == "\U0001f600"
    assert boundedjson.loads('"\\\\ud800"') == "\\ud800"  # an escaped backslash


def test_json_bytes_must_be_utf8():
    with pytest.raises(MalformedError, match="UTF-8"):
        boundedjson.loads(b'"\xed\xa0\x80"')  # a surrogate encoded as UTF-8


# ---- Eventer --------------------------------------------------------------------------


def opened():
    client = ClientConnection(InitReq("limits", subscriptions=(("a", "*"),)))
    server = ServerConnection()
    (req,) = server.receive_data(client.data_to_send())
    server.accept(req.conv, Status.OPERATIONAL)
    client.receive_data(server.data_to_send())
    return client, server


def register_raw(client: ClientConnection, payloads: list[str], last: bool = True) -> bytes:
    """A MsgRegisterReq whose json payloads are the given texts, unchecked."""
    events = [{"type": ["a", "b"], "sourceTimestamp": ("none", None),
               "payload": ("value", ("json", text))} for text in payloads]
    client.chatter.send_value("HatEventer.MsgRegisterReq", events, last=last)
    return client.data_to_send()


@pytest.mark.parametrize(
    ("payload", "error", "match"),
    [
        ("[" * 5000 + "]" * 5000, LimitError, "nested too deeply"),
        ("1" * 10_000, LimitError, "digits"),
        ('{"k": "\\udfff"}', MalformedError, "surrogate"),
        ("[" + "0," * MAX_ITEMS + "0]", LimitError, "items"),
        ("{nope", MalformedError, "not valid JSON"),
    ],
)
def test_eventer_json_payload_faults_are_protocol_errors(payload, error, match):
    client, server = opened()
    with pytest.raises(error, match=match):
        server.receive_data(register_raw(client, [payload]))


def test_eventer_payloads_of_one_message_share_one_budget():
    client, server = opened()
    third = "[" + "0," * (MAX_ITEMS // 3) + "0]"
    with pytest.raises(LimitError):
        server.receive_data(register_raw(client, [third] * 4))
    client, server = opened()
    (req,) = server.receive_data(register_raw(client, [third] * 2))
    assert len(req.events) == 2


def test_eventer_client_accepts_a_batch_larger_than_a_request():
    """A notify carries a whole routing batch: the client side allows MAX_BATCH_ITEMS."""
    client, server = opened()
    big = m.JsonPayload([0] * (MAX_ITEMS // 2))
    events = [m.Event(m.EventId(1, 1, i), ("a", "b"), m.Timestamp(1, 0), None, big)
              for i in range(4)]
    server.notify([m.encode_event(e) for e in events], now=0.0)
    (notified,) = client.receive_data(server.data_to_send())
    assert len(notified.events) == 4
    assert 4 * MAX_ITEMS // 2 < MAX_BATCH_ITEMS


def test_requests_that_keep_the_token_are_protocol_errors():
    client, server = opened()
    client.chatter.send_value(
        "HatEventer.MsgQueryReq", m.query_params_to_sbs(m.QueryLatestParams(None)),
        last=False, token=False,
    )
    with pytest.raises(RemoteProtocolError, match="keeps the conversation token"):
        server.receive_data(client.data_to_send())


def test_ping_that_keeps_the_token_is_a_protocol_error():
    client, server = opened()
    client.chatter.send("HatChatter.Ping", b"", last=False, token=False)
    with pytest.raises(RemoteProtocolError, match="keeps the conversation token"):
        server.receive_data(client.data_to_send())


# ---- conversations a peer never closes -------------------------------------------


def ack_opening(client: ClientConnection) -> None:
    """MsgEventsAck as a new conversation with last=false: one the server never ends."""
    client.chatter.send_value("HatEventer.MsgEventsAck", None, last=False)


def test_200000_abandoned_conversations_close_the_connection_within_the_bound():
    client, server = opened()
    refused = None
    for _ in range(200):  # 200 reads of 1,000 conversations each
        for _ in range(1000):
            ack_opening(client)
        try:
            server.receive_data(client.data_to_send(), now=0.0)
        except LimitError as exc:
            refused = exc
            break
        assert server.chatter.open_conversations <= MAX_OPEN_CONVERSATIONS + 1000 + 1
    assert refused is not None and "conversations open" in str(refused)
    assert isinstance(refused, ProtocolError)
    assert server.chatter.open_conversations <= MAX_OPEN_CONVERSATIONS + 1000 + 1


def test_abandoned_conversations_expire_as_peer_faults():
    client, server = opened()
    ack_opening(client)
    server.receive_data(client.data_to_send(), now=10.0)
    assert server.chatter.open_conversations == 1
    assert server.next_deadline() == 10.0 + MAX_HELD_AGE
    assert server.check_timeouts(10.0 + MAX_HELD_AGE - 1) == []
    (expired,) = server.check_timeouts(10.0 + MAX_HELD_AGE)
    assert isinstance(expired, ConversationExpired) and expired.kind == "peer"
    assert server.chatter.open_conversations == 0


def test_ack_with_last_false_on_a_notify_is_forgotten_after_the_age():
    client, server = opened()
    conv = server.notify([], now=0.0)
    (notified,) = client.receive_data(server.data_to_send())
    client.chatter.send_value("HatEventer.MsgEventsAck", None, conv=notified.ack_conv,
                              last=False)
    server.receive_data(client.data_to_send(), now=1.0)
    assert conv not in server.unacked and server.credit == server.notify_credit
    (expired,) = server.check_timeouts(1.0 + MAX_HELD_AGE)
    assert expired.kind == "peer"
    assert server.chatter.open_conversations == 0


def test_conversation_the_peer_keeps_expires_after_the_conversation_timeout():
    chatter = ChatterConnection(timeout=5.0)
    peer = ChatterConnection(envelope=Envelope.HATCHATTER)
    peer.send_value("HatEventer.MsgEventsAck", None, last=False, token=False)
    chatter.receive_data(peer.data_to_send(), now=0.0)
    assert chatter.next_deadline() == 5.0
    assert len(chatter.check_timeouts(5.0)) == 1


# ---- Mariner ------------------------------------------------------------------------


def test_mariner_huge_integer_is_a_protocol_error():
    conn = MarinerConnection(SERVER, 1 << 20)
    body = b'{"type": "init", "client_id": "c", "client_token": null, "last_event_id": ' \
        b'{"server": ' + b"1" * 10_000 + b', "session": 1, "instance": 1}, "subscriptions": []}'
    with pytest.raises(LimitError, match="digits"):
        conn.receive_data(encode_frame(body))


def test_mariner_server_counts_items_per_message_and_client_per_batch():
    subs = b"[" + b",".join([b'["a"]'] * (MAX_ITEMS // 2)) + b"]"
    init = (b'{"type": "init", "client_id": "c", "client_token": null, '
            b'"last_event_id": null, "subscriptions": ' + subs + b"}")
    with pytest.raises(LimitError):
        MarinerConnection(SERVER, 8 << 20).receive_data(encode_frame(init))
    event = (b'{"id": {"server": 1, "session": 1, "instance": 1}, "type": ["a"], '
             b'"timestamp": {"s": 1, "us": 0}, "source_timestamp": null, "payload": null}')
    batch = b'{"type": "events", "events": [' + b",".join([event] * 20_000) + b"]}"
    client = MarinerConnection(CLIENT, 8 << 20)
    client.initialised = True
    (msg,) = client.receive_data(encode_frame(batch))
    assert len(msg.events) == 20_000
    with pytest.raises(LimitError):
        MarinerConnection(SERVER, 8 << 20).receive_data(encode_frame(batch))


def test_acknowledged_notifications_leave_no_bookkeeping_behind():
    """Every notify used to stay in the server's waiting table after its ack."""
    client, server = opened()
    for i in range(100):
        server.notify([], now=float(i))
        for ev in client.receive_data(server.data_to_send(), float(i)):
            client.ack(ev.ack_conv)
        server.receive_data(client.data_to_send(), float(i))
    assert server.credit == server.notify_credit
    assert server.chatter.open_conversations == 0
    assert server.next_deadline() is None
    assert not server._waiting


# ---- what passes one protocol fits the Skan message built from it --------------------


def _as_skan(value):
    if isinstance(value, list):
        return [_as_skan(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_skan(v) for k, v in value.items()}
    return None if value is None else str(value)


def test_largest_and_deepest_accepted_payloads_become_valid_skan_messages():
    flat = "[" + "0," * (MAX_PAYLOAD_ITEMS - 2) + "0]"
    deep = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    for text in (flat, deep):
        value = boundedjson.loads(text, max_items=MAX_PAYLOAD_ITEMS)
        tags = {t: "x" for t in ("type", "from", "to", "group", "instance", "seq",
                                 "payload-type", "source-timestamp", "hsp-type")}
        decode_header(encode({**tags, "msg": _as_skan(value)}))
    with pytest.raises(LimitError):
        boundedjson.loads("[" + "0," * (MAX_PAYLOAD_ITEMS - 1) + "0]",
                          max_items=MAX_PAYLOAD_ITEMS)


def _mariner_event(payload: str) -> bytes:
    return (b'{"type": "events", "events": [{"id": {"server": 1, "session": 1, "instance": 1}, '
            b'"type": ["a"], "timestamp": {"s": 1, "us": 0}, "source_timestamp": null, '
            b'"payload": {"type": "json", "data": ' + payload.encode() + b"}}]}")


def test_mariner_payload_alone_must_fit_a_skan_message():
    client = MarinerConnection(CLIENT, 8 << 20)
    client.initialised = True
    (msg,) = client.receive_data(encode_frame(_mariner_event("[" * MAX_DEPTH + "]" * MAX_DEPTH)))
    assert msg.events[0].payload is not None
    with pytest.raises(LimitError, match="nested too deeply"):
        client.receive_data(encode_frame(_mariner_event("[" * 103 + "]" * 103)))
    client = MarinerConnection(CLIENT, 8 << 20)
    client.initialised = True
    with pytest.raises(LimitError, match="items"):
        client.receive_data(encode_frame(_mariner_event("[" + "0," * MAX_PAYLOAD_ITEMS + "0]")))
