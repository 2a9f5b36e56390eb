"""Blocking-socket peers for the listener fuzz tests (hypothesis drives them synchronously)."""

from __future__ import annotations

import socket
import time

from wire.skan import FrameSplitter, decode, encode_frame

# Seconds to wait for a fuzz connection's answers after sending (the broker
# closes on most hostile input at once; valid input leaves it open).
ANSWER_WAIT = 0.05


def send_stream(addr: tuple[str, int], chunks: list[bytes]) -> str:
    """Send ``chunks`` as separate writes on a new connection, half-close, read
    what comes back briefly.  Returns how it ended: "closed" (the broker closed
    the connection), "open" (it was still open when we gave up), or "reset"."""
    with socket.create_connection(addr, timeout=5) as sock:
        try:
            for chunk in chunks:
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return "reset"
        sock.settimeout(ANSWER_WAIT)
        try:
            while sock.recv(1 << 16):
                pass
        except TimeoutError:
            return "open"
        except OSError:
            return "reset"
        return "closed"


class SyncBystander:
    """A Skan pub/sub pair on blocking sockets: :meth:`check` proves routing works."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.pub = socket.create_connection(addr, timeout=5)
        self.sub = socket.create_connection(addr, timeout=5)
        self._splitter = FrameSplitter(1 << 20)
        self._frames: list[bytes] = []
        self.lname = self._call(self.pub, {"type": "getlname"})[b"lname"]
        self._call(self.sub, {"type": "getlname"})
        self.sub.sendall(encode_frame({"type": "subscribe", "group": "fuzz-bystander",
                                       "instance": "*"}))
        self._call(self.sub, {"type": "getlname"})
        self.seq = 0
        self.worst = 0.0

    def _call(self, sock: socket.socket, msg: dict) -> dict:
        sock.sendall(encode_frame(msg))
        splitter = FrameSplitter(1 << 20)
        while True:
            frames = splitter.receive_data(sock.recv(65536))
            if frames:
                return decode(frames[0][4:])

    def check(self, timeout: float = 5.0) -> float:
        """Send one message and wait for it; returns the round trip in seconds."""
        self.seq += 1
        seq = str(self.seq).encode()
        started = time.perf_counter()
        self.pub.sendall(encode_frame({"type": "send", "group": "fuzz-bystander",
                                       "instance": "*", "to": "*", "from": self.lname,
                                       "seq": seq, "msg": None}))
        self.sub.settimeout(timeout)
        while True:
            while self._frames:
                msg = decode(self._frames.pop(0)[4:])
                if msg.get(b"seq") == seq:
                    took = time.perf_counter() - started
                    self.worst = max(self.worst, took)
                    return took
            data = self.sub.recv(65536)
            if not data:
                raise ConnectionError("the broker closed the bystander's connection")
            self._frames.extend(self._splitter.receive_data(data))

    def close(self) -> None:
        self.pub.close()
        self.sub.close()
