"""The compiled Skan hot path against its pure-Python reference (differential tests).

The C decoder must accept exactly what the reference accepts and return
equal values; what it refuses it hands to the reference, which raises the
error.  Compared here on every recorded vector and on random, generated and
mutated input; ``disagreements()`` counts any input the C scanner refused but
the reference accepted and must stay 0.  The frame splitter likewise against
``framing.split``.  The last test runs the codec tests again in pure-Python
mode, so both implementations stay tested.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples
from tests.wire import skan_vectors as V
from wire.skan import FrameSplitter, FramingError, codec, encode, encode_frame, framing
from wire.skan.codec import Nested, SkanError, decode_header_py

PURE = codec.PURE_PYTHON

if not PURE:
    from wire.skan import _codec_speedups as _speedups

    decode_header_c = _speedups.decode_header
    split_c = _speedups.split


def test_implementation_matches_the_mode():
    """CI must notice a broker that silently runs without its compiled hot path."""
    if PURE:
        assert codec.IMPLEMENTATION == "python"
        assert codec.decode_header is decode_header_py
        assert framing.split_frames is framing.split
    else:
        assert codec.IMPLEMENTATION == "c", (
            "wire/skan/_codec_speedups is not built: run `pip install -e .` (or make venv)"
        )
        assert codec.decode_header is decode_header_c
        assert framing.split_frames is split_c


needs_c = pytest.mark.skipif(PURE, reason="SKAN_PURE_PYTHON=1: no compiled code to compare")


def _plain(value: Any) -> Any:
    if isinstance(value, Nested):
        return ("nested", value.type, value.start, value.stop)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _outcome(fn, *args) -> Any:
    try:
        return ("ok", _plain(fn(*args)))
    except SkanError as exc:
        return ("error", str(exc))
    except (TypeError, ValueError, IndexError) as exc:  # the reference's own argument errors
        return (type(exc).__name__, str(exc))


def assert_same(*args) -> None:
    before = _speedups.disagreements()
    c = _outcome(decode_header_c, *args)
    py = _outcome(decode_header_py, *args)
    assert c == py
    assert _speedups.disagreements() == before, f"C refused what the reference accepts: {args}"


def _vector_bytes() -> list[bytes]:
    out = [bytes.fromhex(v[2]) for v in V.VECTORS]
    out += [bytes.fromhex(v[1]) for v in V.NONCANONICAL_ACCEPT]
    out += [bytes.fromhex(v[1]) for v in V.MALFORMED]
    out += [bytes.fromhex(v[1]) for v in V.AMBIGUOUS]
    return out


VECTOR_BYTES = _vector_bytes()


@needs_c
@pytest.mark.parametrize("data", VECTOR_BYTES, ids=range(len(VECTOR_BYTES)))
def test_vectors_identical(data):
    assert_same(data)
    # The same message inside a frame, as the session decodes it.
    framed = len(data).to_bytes(4, "big") + data
    assert_same(framed, 4)
    assert_same(framed, 4, len(framed))
    # Every truncation of it.
    for cut in range(len(data)):
        assert_same(data[:cut])


@needs_c
def test_arguments_the_scanner_does_not_handle_go_to_the_reference():
    data = encode({"type": "send", "group": "g"})
    for args in ((bytearray(data),), (memoryview(data),), (data, -1), (data, 0, len(data) + 9),
                 (data, 3, 2), (data, 0, -1)):
        c = _outcome(decode_header_c, *args)
        py = _outcome(decode_header_py, *args)
        assert c == py
    assert decode_header_c(data, end=len(data)) == decode_header_py(data)
    assert decode_header_c(b"xx" + data, start=2) == decode_header_py(data)
    with pytest.raises(TypeError):
        decode_header_c(data, bogus=1)


@needs_c
def test_depth_limit_identical():
    for depth in (98, 99, 100, 101, 102, 150):
        deep = b"\x23\x00"
        for _ in range(depth - 1):
            deep = bytes((0x03,)) + len(deep).to_bytes(4, "big") + deep
        assert_same(b"Skan\x01a" + deep)


@needs_c
def test_large_nested_hash_duplicates():
    """Nested hashes past the pairwise-compare size use a set: duplicates still refused."""
    for n in (15, 16, 17, 40):
        inner = {f"k{i}": "v" for i in range(n)}
        data = encode({"msg": inner})
        assert_same(data)
        for dup in (0, n // 2, n - 1):
            bad = data.replace(f"\x03k{n - 1}".encode(), f"\x03k{dup}".encode()) if n < 100 \
                else data
            if f"k{n - 1}" != f"k{dup}" and len(f"k{dup}") == len(f"k{n - 1}"):
                assert _outcome(decode_header_py, bad)[0] == "error"
            assert_same(bad)


@needs_c
def test_common_values_are_equal_not_aliased_wrongly():
    data = encode({"type": "send", "to": "*", "instance": "*", "group": "send", "seq": "1"})
    header = decode_header_c(data)
    assert header == {b"type": b"send", b"to": b"*", b"instance": b"*", b"group": b"send",
                      b"seq": b"1"}


# ---- properties -----------------------------------------------------------

tags = st.binary(min_size=1, max_size=12) | st.sampled_from(
    [b"type", b"group", b"instance", b"to", b"from", b"seq", b"msg", b"repl", b"reply"]
)
leaves = st.none() | st.binary(max_size=300) | st.sampled_from([b"send", b"*", b"normal"])
values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(tags, children, max_size=20),
    max_leaves=40,
)
messages = st.dictionaries(tags, values, max_size=10)


@needs_c
@given(messages)
@settings(max_examples=examples(200), deadline=None)
def test_generated_messages_identical(message):
    data = encode(message)
    assert_same(data)
    assert_same(b"\x00\x00\x00\x00" + data, 4)


@needs_c
@given(st.binary(max_size=300))
@settings(max_examples=examples(2000), deadline=None)
def test_random_bytes_identical(data):
    assert_same(data)
    assert_same(b"Skan" + data)


def _mutations(data: bytes, draw) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        if not buf:
            break
        i = draw(st.integers(0, len(buf) - 1))
        if kind == "flip":
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            buf[i] = draw(st.sampled_from([0x00, 0x01, 0x02, 0x03, 0x04, 0x14, 0x21, 0x22, 0x23,
                                           0x24, 0x30, 0x41, 0x81, 0xFF]))
        elif kind == "cut":
            del buf[i:]
        elif kind == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=4))
        else:
            del buf[i]
    return bytes(buf)


@needs_c
@given(messages | st.sampled_from([V.wire_form(v[1]) for v in V.VECTORS
                                   if isinstance(v[1], dict)]), st.data())
@settings(max_examples=examples(600), deadline=None)
def test_mutated_messages_identical(message, data):
    mutated = _mutations(encode(message), data.draw)
    assert_same(mutated)


# ---- the item limit (wire.limits.MAX_ITEMS) --------------------------------


@contextlib.contextmanager
def item_limit(limit: int):
    """Both decoders with a small item limit, so the boundary is cheap to explore."""
    saved = codec.MAX_ITEMS
    codec.MAX_ITEMS = limit
    _speedups.setup(Nested, decode_header_py, codec.MAX_DEPTH, limit)
    try:
        yield
    finally:
        codec.MAX_ITEMS = saved
        _speedups.setup(Nested, decode_header_py, codec.MAX_DEPTH, saved)


@needs_c
def test_item_limit_boundaries_identical():
    with item_limit(12):
        for n in range(6, 16):
            assert_same(encode({"msg": [None] * n}))  # 1 + n items
            assert_same(encode({"a": "x", "msg": {f"k{i}": None for i in range(n)}, "b": "y"}))
            assert_same(encode({f"t{i}": "v" for i in range(n)}))  # n top-level items
            # Nested items first, then top-level DATA: counted as the reference counts.
            assert_same(encode({"msg": [None] * 9, **{f"t{i}": "v" for i in range(n)}}))
            assert_same(encode({"m": [[None] * 3] * 3, "n": [None] * n}))


@needs_c
def test_item_limit_at_full_size():
    limit = codec.MAX_ITEMS
    for n in (limit - 2, limit - 1, limit):
        assert_same(encode({"type": "send", "msg": [None] * n}))


@needs_c
@given(messages, st.integers(1, 40), st.data())
@settings(max_examples=examples(300), deadline=None)
def test_item_limit_identical_on_generated_and_mutated(message, limit, data):
    with item_limit(limit):
        encoded = encode(message)
        assert_same(encoded)
        assert_same(_mutations(encoded, data.draw))


# ---- decode_send: the header plus the session's send rule -----------------

LNAME = b"6745a2b1_1f@host"


def assert_same_send(data: bytes, lname: bytes | None) -> None:
    from broker.core.skan_handler import decode_send_py

    before = _speedups.disagreements()
    c = _outcome(_speedups.decode_send, data, 4, lname)
    py = _outcome(decode_send_py, data, 4, lname)
    assert c == py
    assert _speedups.disagreements() == before


SEND = {"type": "send", "group": "g", "instance": "*", "to": "*", "from": LNAME, "seq": "7",
        "msg": b"x" * 20}


@needs_c
def test_decode_send_identical_on_every_field_fault():
    framed = [encode_frame(SEND), encode_frame({**SEND, "repl": "a"}),
              encode_frame({**SEND, "reply": None}), encode_frame({**SEND, "msg": None}),
              encode_frame({**SEND, "msg": {"k": ["v", None]}})]
    for field in ("type", "group", "instance", "to", "from", "seq", "msg"):
        without = dict(SEND)
        del without[field]
        framed.append(encode_frame(without))
        for bad in (None, {"n": "x"}, ["x"], "other"):
            framed.append(encode_frame({**SEND, field: bad}))
    for data in framed:
        for lname in (LNAME, None, b"other", b""):
            assert_same_send(data, lname)
    _header, key = _speedups.decode_send(framed[1], 4, LNAME)
    assert key == (b"g", b"*", b"*", True)
    assert _speedups.decode_send(framed[0], 4, LNAME)[1] == (b"g", b"*", b"*", False)


@needs_c
def test_a_send_with_payload_json_has_no_key_in_both():
    """The payload-json tag is checked by the session off the hot path: no routing
    key from either decoder, whatever the tag holds; the header still has it."""
    for tag in (b"1", b"{bad", None, {"a": "1"}, b""):
        data = encode_frame({**SEND, "payload-json": tag})
        for lname in (LNAME, None):
            assert_same_send(data, lname)
        header, key = _speedups.decode_send(data, 4, LNAME)
        assert key is None and b"payload-json" in header
    # neighbours of the name are ordinary tags
    for name in ("payload-jso", "payload-json2", "payload-type"):
        data = encode_frame({**SEND, name: b"1"})
        assert_same_send(data, LNAME)
        assert _speedups.decode_send(data, 4, LNAME)[1] == (b"g", b"*", b"*", False)


@needs_c
@given(st.dictionaries(st.sampled_from([*sorted(SEND), "payload-json"]) | tags, values,
                       max_size=10)
       | st.builds(lambda extra: {**SEND, **extra}, messages), st.data())
@settings(max_examples=examples(300), deadline=None)
def test_decode_send_identical_on_generated_and_mutated(message, data):
    framed = encode_frame(message)
    assert_same_send(framed, LNAME)
    assert_same_send(b"\x00\x00\x00\x00" + _mutations(framed[4:], data.draw), LNAME)


# ---- frame splitter -------------------------------------------------------


@needs_c
@given(st.binary(max_size=200), st.integers(0, 300), st.data())
@settings(max_examples=examples(1000), deadline=None)
def test_split_identical_on_random_bytes(data, max_frame, draw):
    pos = draw.draw(st.integers(0, len(data)))
    assert split_c(data, pos, max_frame) == framing.split(data, pos, max_frame)


@needs_c
@given(st.lists(st.dictionaries(tags, leaves, max_size=4), min_size=1, max_size=5), st.data())
@settings(max_examples=examples(200), deadline=None)
def test_split_identical_on_frames(batch, data):
    stream = b"".join(encode_frame(m) for m in batch)
    cut = data.draw(st.integers(0, len(stream)))
    for chunk in (stream, stream[:cut], stream[cut:]):
        for limit in (4, 64, 1 << 20):
            assert split_c(chunk, 0, limit) == framing.split(chunk, 0, limit)


def test_splitter_errors_and_reassembly():
    """Holds in both modes: the FrameSplitter's contract on top of either split."""
    frames = [encode_frame({"n": str(i), "pad": "x" * i}) for i in range(50)]
    stream = b"".join(frames)
    splitter = FrameSplitter(1 << 20)
    got = []
    for i in range(0, len(stream), 7):
        got.extend(splitter.receive_data(stream[i:i + 7]))
    assert got == frames
    assert splitter.buffered == 0
    got = FrameSplitter(1 << 20).receive_data(bytearray(stream))
    assert got == frames and all(type(f) is bytes for f in got)
    with pytest.raises(FramingError, match="exceeds the limit of 10 bytes"):
        FrameSplitter(10).receive_data(frames[0] + b"\x00\x00\x00\x0b")
    with pytest.raises(FramingError, match="shorter than the 4-byte magic"):
        FrameSplitter(10).receive_data(b"\x00\x00\x00\x03Ska")


# ---- both modes -----------------------------------------------------------


@pytest.mark.skipif(PURE, reason="already running in pure-Python mode")
def test_codec_tests_pass_in_pure_python_mode():
    """The references stay tested: the codec, router and store tests again with
    SKAN_PURE_PYTHON=1 (the store's batch rows then come from runs.batch_row_py)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "SKAN_PURE_PYTHON": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "tests/wire/test_skan_codec.py", "tests/wire/test_skan_speedups.py",
         "tests/core/test_router.py", "tests/store/test_store.py",
         "tests/store/test_differential.py", "tests/store/test_speedups.py"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
