"""The shared receive buffer: linear reassembly for every framing (Skan, 1+m, HSP)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples
from wire import hsp
from wire.buffer import ReceiveBuffer
from wire.chatter.framing import FrameSplitter as ChatterSplitter
from wire.errors import FramingError, ProtocolError
from wire.lenprefix import encode_frame as lp_frame
from wire.mariner.framing import FrameSplitter as MarinerSplitter
from wire.skan import FrameSplitter, encode_frame

MiB = 1 << 20


def _dribble(receive, data: bytes, step: int) -> list:
    out = []
    for i in range(0, len(data), step):
        out += receive(data[i : i + step])
    return out


# ---- linear cost ------------------------------------------------------------------


@pytest.mark.parametrize("step", [256, 4096, 256 * 1024])
def test_skan_reassembly_copies_each_byte_a_bounded_number_of_times(step):
    frame = encode_frame({"type": "send", "msg": b"x" * (8 * MiB - 100)})
    splitter = FrameSplitter(8 * MiB)
    assert _dribble(splitter.receive_data, frame, step) == [frame]
    # The old splitter re-joined the partial frame on every read: an 8 MiB
    # frame in 256 KiB reads copied ~130 MiB, in 256-byte reads ~130 GiB.
    assert splitter.copied <= 3 * len(frame)
    assert splitter.buffered == 0


@pytest.mark.parametrize("splitter_class", [ChatterSplitter, MarinerSplitter])
def test_lenprefix_reassembly_is_linear(splitter_class):
    body = b"y" * (4 * MiB)
    splitter = splitter_class(8 * MiB)
    assert _dribble(splitter.receive_data, lp_frame(body), 4096) == [body]
    assert splitter.copied <= 3 * len(body) + 16


def test_dribbled_4_mib_frame_costs_little_cpu():
    """4 MiB in 256-byte writes (16,384 reads): ~5 s of CPU before, milliseconds now.

    The bound is loose (a shared, slow machine must pass it; the linear
    splitters take ~20 ms) but a quadratic splitter cannot: it copies ~32 GiB
    for this input (1.3 s here for the old Skan splitter alone).
    """
    frame = encode_frame({"msg": b"z" * (4 * MiB)})
    for make, receive in (
        (lambda: FrameSplitter(8 * MiB), "receive_data"),
        (lambda: ChatterSplitter(8 * MiB), "receive_data"),
        (lambda: hsp.Decoder(8 * MiB), "receive_data"),
    ):
        target = make()
        data = frame if not isinstance(target, hsp.Decoder) else hsp.encode(
            hsp.Data.make(1, frame)
        )
        if isinstance(target, ChatterSplitter):
            data = lp_frame(frame)
        start = time.process_time()
        got = _dribble(getattr(target, receive), data, 256)
        assert len(got) == 1
        assert time.process_time() - start < 0.5


def test_hsp_decoder_is_linear_through_the_shared_buffer():
    payload = b"p" * (4 * MiB)
    data = hsp.encode(hsp.DataAck.make(9, 1, payload))
    dec = hsp.Decoder(8 * MiB)
    [ev] = _dribble(dec.receive_data, data, 1000)
    assert ev.payload == payload
    assert dec._rx.copied <= 3 * len(data)


# ---- behaviour ------------------------------------------------------------------


def test_many_small_frames_in_one_read_are_sliced_without_buffering():
    frames = [encode_frame({"seq": str(i)}) for i in range(1000)]
    splitter = FrameSplitter(1 << 20)
    assert splitter.receive_data(b"".join(frames)) == frames
    assert splitter.copied == 0


def test_oversized_length_is_refused_before_its_body_is_buffered():
    splitter = FrameSplitter(100)
    splitter.receive_data(b"\x00\x00")
    with pytest.raises(FramingError, match="exceeds the limit of 100") as info:
        splitter.receive_data(b"\x7f\xff")
    assert isinstance(info.value, ProtocolError)
    assert not isinstance(info.value, ValueError)
    assert splitter.buffered == 0


def test_measure_errors_carry_the_stream_offset():
    dec = hsp.Decoder()
    with pytest.raises(FramingError) as info:
        dec.receive_data(b"\x03\x04\x03\xee")
    assert info.value.offset == 3
    assert [type(e) for e in info.value.events] == [hsp.Ping, hsp.Pong, hsp.Ping]


def test_skip_discards_across_reads():
    rx = ReceiveBuffer()

    def measure(buf: bytes, pos: int, size: int) -> int:
        return 1  # one-byte messages

    spans = []
    for buf, start, stop in rx.messages(b"abc", measure):
        spans.append(buf[start:stop])
        if buf[start:stop] == b"a":
            rx.skip(4)  # drop "bc" now and "de" of the next read
    assert spans == [b"a"]
    assert [b[s:e] for b, s, e in rx.messages(b"defg", measure)] == [b"f", b"g"]
    assert rx.offset == 7


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.binary(max_size=300), max_size=12),
    st.lists(st.integers(1, 400), min_size=1, max_size=8),
)
def test_every_framing_is_independent_of_how_the_stream_is_cut(bodies, cuts):
    skan = [encode_frame({"b": b}) for b in bodies]
    hsp_events = [hsp.Data.make(1, b) for b in bodies]
    cases = [
        (FrameSplitter(1 << 20), b"".join(skan), skan),
        (ChatterSplitter(1 << 20), b"".join(lp_frame(b) for b in bodies), bodies),
        (MarinerSplitter(1 << 20), b"".join(lp_frame(b, 8) for b in bodies), bodies),
        (hsp.Decoder(1 << 20), b"".join(hsp.encode(e) for e in hsp_events), hsp_events),
    ]
    for target, stream, expected in cases:
        got = []
        pos = i = 0
        while pos < len(stream):
            step = cuts[i % len(cuts)]
            got += target.receive_data(stream[pos : pos + step])
            pos += step
            i += 1
        assert got == expected
        assert target.buffered == 0
