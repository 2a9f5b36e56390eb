"""lnames: every endpoint's name, unique for the broker's lifetime and unguessable (1, 7)."""

from __future__ import annotations

import secrets
import socket
import time

# Random bits in every lname (BROKER-SPEC section 7): 64 bits make guessing
# another connection's lname (to forge a reply to it) hopeless.
LNAME_RANDOM_BYTES = 8

class LnameFactory:
    """lnames in the msgq format ``%x_%x@%s``: hex time, then the hex counter
    followed by 16 hex digits from :mod:`secrets`, then the host.

    The counter alone makes every lname unique for the broker's lifetime; the
    random suffix makes it unguessable.
    """

    def __init__(self, host: str | None = None) -> None:
        self._host = host or socket.gethostname() or "localhost"
        self._counter = 0

    def __call__(self) -> bytes:
        self._counter += 1
        rand = secrets.token_hex(LNAME_RANDOM_BYTES)
        return f"{int(time.time()):x}_{self._counter:x}{rand}@{self._host}".encode()
