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
    assert subjects.message_subject(b"g", b"1", b"*") == b"sk.g.1._"
    assert subjects.owner(b"5f_1abc@host/7") == b"7"
    assert subjects.owner(b"5f_1abc@host") is None
    assert subjects.message_subject(b"g", b"*", b"5f_1@h/7") == b"sk.g.%2A.b7"
    assert subjects.message_subject(b"g", b"1", b"5f_1@h") == b"sk.g.1.x"
    assert subjects.group_interest(b"a.b") == b"sk.a%2Eb.>"
    assert subjects.own_interest(3) == b"sk.*.*.b3"
