"""Subject escaping and the interest subjects (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.cluster import subjects

SAFE = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-%#")


def test_escape():
    assert subjects.escape(b"chat") == b"chat"
    assert subjects.escape(b"a.b") == b"a%2Eb"
    assert subjects.escape(b"*") == b"%2A"
    assert subjects.escape(b"") == b"%"
    long = subjects.escape(b"x" * 300)
    assert long.startswith(b"#") and len(long) == 33


@given(st.binary(max_size=250))
def test_escaped_tokens_are_single_safe_tokens(token):
    out = subjects.escape(token)
    assert out and set(out) <= SAFE and len(out) <= subjects.MAX_TOKEN


@given(st.binary(min_size=1, max_size=60), st.binary(min_size=1, max_size=60))
def test_escape_is_injective_below_the_hash_limit(a, b):
    if a != b:
        assert subjects.escape(a) != subjects.escape(b)


def test_message_subject_and_owner():
    assert subjects.message_subject(2, b"g", b"1", b"*") == b"sk.2.g.1._"
    assert subjects.owner(b"5f_1abc@host/7") == b"7"
    assert subjects.owner(b"5f_1abc@host") is None
    assert subjects.message_subject(2, b"g", b"*", b"5f_1@h/7") == b"sk.2.g.%2A.b7"
    assert subjects.message_subject(2, b"g", b"1", b"5f_1@h") == b"sk.2.g.1.x"
    assert subjects.group_interest(b"a.b") == b"sk.*.a%2Eb.>"
    assert subjects.own_interest(3) == b"sk.*.*.*.b3"
    assert subjects.publisher(b"sk.2.g.1._") == b"2"
    assert subjects.publisher(b"sk.x.g.1._") is None


def test_owns_checks_the_lname_host_part():
    assert subjects.owns(b"5f_1abc@host/7", b"7")
    assert not subjects.owns(b"5f_1abc@host/17", b"7")
    assert not subjects.owns(b"5f_1abc@host/7x", b"7")
    assert not subjects.owns(b"5f_1abc/7", b"7")  # no host part
    assert not subjects.owns(b"/7", b"7")
    assert subjects.control_sender(b"skc.hb.12", subjects.HEARTBEAT) == 12
    assert subjects.control_sender(b"skc.hb.1e9", subjects.HEARTBEAT) is None
    assert subjects.control_sender(b"skc.hb." + b"9" * 25, subjects.HEARTBEAT) is None
