"""The routing thread's reads and writes that keep the GIL (broker/serving/_held_io.c)
against os.read and os.write, their reference, on real sockets: data, end of input,
EAGAIN, errors, a signal during the call, and that the lock really is kept."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import threading
import time

import pytest

from broker.serving import heldio
from wire.skan.codec import PURE_PYTHON

compiled = pytest.mark.skipif(not heldio.COMPILED, reason="SKAN_PURE_PYTHON: os.read/os.write")


def test_the_extension_is_built_unless_pure_python_is_asked_for():
    assert heldio.COMPILED is not PURE_PYTHON


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("impl", ["held", "os"])
def test_the_same_results_as_os_read_and_write(pair, impl):
    read, write = (heldio.read, heldio.write) if impl == "held" else (os.read, os.write)
    a, b = pair
    for data in (b"x", b"\0" * 1000, bytes(range(256)) * 40):
        assert write(a.fileno(), data) == len(data)
        assert read(b.fileno(), 1 << 20) == data
    assert write(a.fileno(), memoryview(b"abcdef")[2:]) == 4
    assert write(a.fileno(), bytearray(b"gh")) == 2
    assert read(b.fileno(), 3) == b"cde"  # at most n
    assert read(b.fileno(), 100) == b"fgh"
    assert read(b.fileno(), 0) == b""
    with pytest.raises(BlockingIOError):  # nothing to read: EAGAIN
        read(b.fileno(), 100)
    a.shutdown(socket.SHUT_WR)
    assert read(b.fileno(), 100) == b""  # end of input
    with pytest.raises(OSError) as bad:
        read(10_000, 10)
    assert bad.value.errno == errno.EBADF
    with pytest.raises(OSError) as bad:
        write(10_000, b"x")
    assert bad.value.errno == errno.EBADF
    b.close()
    with pytest.raises(BrokenPipeError):
        write(a.fileno(), b"x" * 10)
    with pytest.raises(TypeError):
        write(a.fileno(), "text")
    with pytest.raises(OSError) as bad:
        read(-1, 10)
    assert bad.value.errno == errno.EBADF
    with pytest.raises(OverflowError):
        read(1 << 40, 10)


@compiled
def test_a_full_socket_gives_eagain_and_a_partial_write(pair):
    a, b = pair
    total = 0
    with pytest.raises(BlockingIOError):
        while True:
            total += heldio.write(a.fileno(), bytes([total % 251]) * 65536)
    assert total > 0
    # Read back through both of read's ways: the static buffer (n up to 256
    # KiB) and a buffer of n bytes of its own (larger n), in order.
    got = bytearray()
    for n in (1, 256 * 1024, 1 << 20, 300 * 1024):
        with contextlib.suppress(BlockingIOError):
            while len(got) < total:
                got += heldio.read(b.fileno(), n)
                if n == 1 and len(got) >= 10:
                    break
    expected = b"".join(bytes([k % 251]) * 65536 for k in range(0, total, 65536))
    assert len(got) == total and bytes(got) == expected[:total]


@compiled
def test_the_lock_is_kept_across_the_call(pair):
    """A thread waiting for the interpreter gets no turn inside held calls:
    10,000 reads and writes with the lock held let it run far less often than
    os.read / os.write, which release it around every call."""
    a, b = pair

    def turns(read, write) -> int:
        count = [0]
        stop = threading.Event()

        def other() -> None:
            while not stop.is_set():
                count[0] += 1
                time.sleep(0)  # give the lock back at once, ask again

        t = threading.Thread(target=other)
        t.start()
        time.sleep(0.01)
        count[0] = 0
        for _ in range(10_000):
            write(a.fileno(), b"z")
            read(b.fileno(), 10)
        got = count[0]
        stop.set()
        t.join()
        return got

    held = min(turns(heldio.read, heldio.write) for _ in range(3))
    released = max(turns(os.read, os.write) for _ in range(3))
    assert held * 5 < released, (held, released)


@compiled
def test_a_signal_during_a_held_read_runs_its_handler(pair):
    """EINTR: the handler runs (PEP 475) and its exception comes out of the call."""
    _, b = pair
    b.setblocking(True)  # the one way to be inside read() when the signal lands

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Interrupted):
            heldio.read(b.fileno(), 10)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
