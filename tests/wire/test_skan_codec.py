"""Skan codec against the recorded vectors, plus hypothesis properties."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples
from tests.wire import skan_vectors as V
from wire.errors import FramingError, LocalProtocolError
from wire.skan import (
    FrameSplitter,
    SkanError,
    decode,
    decode_header,
    encode,
    encode_frame,
    item_bytes,
)
from wire.skan.codec import Nested


@pytest.mark.parametrize(("desc", "value", "hexstr"), V.VECTORS, ids=[v[0] for v in V.VECTORS])
def test_vectors_encode_exact(desc, value, hexstr):
    assert encode(value).hex() == hexstr


@pytest.mark.parametrize(("desc", "value", "hexstr"), V.VECTORS, ids=[v[0] for v in V.VECTORS])
def test_vectors_decode_exact(desc, value, hexstr):
    assert decode(bytes.fromhex(hexstr)) == V.wire_form(value)


@pytest.mark.parametrize(
    ("desc", "hexstr", "value"), V.NONCANONICAL_ACCEPT, ids=[v[0] for v in V.NONCANONICAL_ACCEPT]
)
def test_noncanonical_accepted_but_never_emitted(desc, hexstr, value):
    assert decode(bytes.fromhex(hexstr)) == V.wire_form(value)
    assert encode(value).hex() != hexstr


@pytest.mark.parametrize(("desc", "hexstr"), V.MALFORMED, ids=[v[0] for v in V.MALFORMED])
def test_malformed_rejected(desc, hexstr):
    with pytest.raises(SkanError):
        decode(bytes.fromhex(hexstr))
    with pytest.raises(SkanError):
        decode_header(bytes.fromhex(hexstr))


# The broker's decisions on the AMBIGUOUS vectors (BROKER-SPEC section 1).
AMBIGUOUS_DECISIONS = {
    "empty top-level hash (magic only)": {},
    "NULL with LENGTH_8 code, no length byte (TyLen 0x24)": {b"a": None},
    "NULL with LENGTH_8 code followed by a 0x00 length byte": SkanError,
    "length-code bits 0x40 set: TyLen 0x61 (DATA)": SkanError,
    "length-code bits 0x80 set: TyLen 0x81 (DATA, 4-byte length under mask 0x30)": SkanError,
    "duplicate tag in one hash": SkanError,
    "invalid UTF-8 in a tag": {b"\xff\xfe": b"a"},
}


@pytest.mark.parametrize(("desc", "hexstr", "note"), V.AMBIGUOUS, ids=[v[0] for v in V.AMBIGUOUS])
def test_ambiguous_decisions(desc, hexstr, note):
    expected = AMBIGUOUS_DECISIONS[desc]
    data = bytes.fromhex(hexstr)
    if expected is SkanError:
        with pytest.raises(SkanError):
            decode(data)
        with pytest.raises(SkanError):
            decode_header(data)
    else:
        assert decode(data) == expected
        assert decode_header(data) == expected


def test_null_with_length_code_16_and_32_is_null():
    assert decode(bytes.fromhex("536b616e" "0161" "14")) == {b"a": None}
    assert decode(bytes.fromhex("536b616e" "0161" "24" "0162" "04")) == {b"a": None, b"b": None}
    with pytest.raises(SkanError, match="length code"):
        decode(bytes.fromhex("536b616e" "0161" "34"))
    with pytest.raises(SkanError, match="length code"):
        decode(bytes.fromhex("536b616e" "0161" "44"))


def test_error_messages_say_what_and_where():
    with pytest.raises(SkanError, match=r"bad magic"):
        decode(b"Skab\x01a\x21\x01b")
    with pytest.raises(SkanError, match=r"zero tag length at offset 4"):
        decode(bytes.fromhex("536b616e" "00" "2101" "61"))
    with pytest.raises(SkanError, match=r"unknown item type 0x05 at offset 6"):
        decode(bytes.fromhex("536b616e" "0162" "2501" "31"))
    with pytest.raises(SkanError, match=r"duplicate tag b'a'"):
        decode(bytes.fromhex("536b616e" "0161" "2101" "31" "0161" "2101" "32"))


@pytest.mark.parametrize(("desc", "value", "hexstr"), V.FRAMES, ids=[v[0] for v in V.FRAMES])
def test_frames(desc, value, hexstr):
    values = value if isinstance(value, list) else [value]
    assert b"".join(encode_frame(v) for v in values).hex() == hexstr
    data = bytes.fromhex(hexstr)
    # Feed byte by byte: the splitter must reassemble across any boundary.
    splitter = FrameSplitter(max_frame=1 << 20)
    frames = []
    for i in range(len(data)):
        frames.extend(splitter.receive_data(data[i : i + 1]))
    assert [decode(f[4:]) for f in frames] == [V.wire_form(v) for v in values]
    assert splitter.buffered == 0


@pytest.mark.parametrize(
    ("desc", "hexstr"), V.MALFORMED_FRAMES, ids=[v[0] for v in V.MALFORMED_FRAMES]
)
def test_malformed_frames(desc, hexstr):
    splitter = FrameSplitter(max_frame=8 << 20)
    data = bytes.fromhex(hexstr)
    try:
        frames = splitter.receive_data(data)
    except FramingError:
        return  # refused at the length prefix: the connection is closed
    # Otherwise the frame is incomplete (EOF will close it) or complete but bad.
    for f in frames:
        with pytest.raises(SkanError):
            decode_header(f, 4)
    if not frames:
        assert splitter.buffered == len(data)


def test_absurd_length_refused_without_buffering():
    splitter = FrameSplitter(max_frame=8 << 20)
    with pytest.raises(FramingError, match="exceeds the limit"):
        splitter.receive_data(b"\xff\xff\xff\xff" + b"Skan")
    assert splitter.buffered == 0


def test_decode_header_keeps_msg_opaque_and_validated():
    value = {"type": "send", "msg": {"k": ["a", None, {"x": "y"}]}, "seq": 5}
    data = encode(value)
    header = decode_header(data)
    assert header[b"type"] == b"send"
    assert isinstance(header[b"msg"], Nested)
    assert item_bytes(data, header, b"msg") == V.wire_form(value["msg"])
    bad = bytearray(data)
    bad[data.index(b"\x01x") - 1] = 0x2F  # corrupt a TyLen deep inside msg
    with pytest.raises(SkanError):
        decode_header(bytes(bad))


def test_depth_limit():
    deep = b"\x23\x00"
    for _ in range(200):
        deep = bytes((0x03,)) + len(deep).to_bytes(4, "big") + deep
    with pytest.raises(SkanError, match="nesting deeper"):
        decode(b"Skan\x01a" + deep)


def test_encode_rejects_what_the_wire_cannot_carry():
    # Encoding faults are ours, not the peer's: LocalProtocolError.
    with pytest.raises(LocalProtocolError):
        encode({"": "x"})
    with pytest.raises(LocalProtocolError):
        encode({"t" * 256: "x"})
    with pytest.raises(LocalProtocolError):
        encode({"a": True})
    with pytest.raises(LocalProtocolError):
        encode({"a": 1.5})


# ---- properties -----------------------------------------------------------

tags = st.binary(min_size=1, max_size=20)
leaves = st.none() | st.binary(max_size=300)
values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(tags, children, max_size=5),
    max_leaves=30,
)
messages = st.dictionaries(tags, values, max_size=8)


@given(messages)
@settings(max_examples=examples(300), deadline=None)
def test_roundtrip(message):
    data = encode(message)
    assert decode(data) == message
    header = decode_header(data)
    assert {k: item_bytes(data, header, k) for k in header} == message


@given(st.binary(max_size=200))
@settings(max_examples=examples(1000), deadline=None)
def test_decoder_fails_only_with_codec_error(data):
    for candidate in (data, b"Skan" + data):
        for fn in (decode, decode_header):
            with contextlib.suppress(SkanError):
                fn(candidate)


@given(messages, st.data())
@settings(max_examples=examples(200), deadline=None)
def test_mutations_fail_only_with_codec_error(message, data):
    raw = bytearray(encode(message))
    if len(raw) > 4:
        i = data.draw(st.integers(4, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    for fn in (decode, decode_header):
        with contextlib.suppress(SkanError):
            fn(bytes(raw))


@given(st.lists(messages, min_size=1, max_size=5), st.lists(st.integers(1, 50), max_size=20))
@settings(max_examples=examples(100), deadline=None)
def test_splitter_any_chunking(msgs, cuts):
    stream = b"".join(encode_frame(m) for m in msgs)
    splitter = FrameSplitter(max_frame=1 << 20)
    got, pos = [], 0
    for c in cuts:
        got += splitter.receive_data(stream[pos : pos + c])
        pos += c
    got += splitter.receive_data(stream[pos:])
    assert [decode(f[4:]) for f in got] == msgs
