"""Reads and writes of the routing thread that keep the interpreter lock.

``read(fd, n)`` and ``write(fd, data)`` are ``os.read`` and ``os.write``
for non-blocking descriptors, compiled so that the routing thread does not
give up the GIL around a system call that cannot wait
(broker/serving/_held_io.c says why: each release lets a writer thread in,
and the routing thread then waits for the writer's Python).  Without the
extension (no compiler, or ``SKAN_PURE_PYTHON=1``) they are ``os.read``
and ``os.write`` themselves: the same results, the lock released.

Only for descriptors known to be non-blocking: trio's sockets are.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from wire.skan.codec import PURE_PYTHON

read: Callable[[int, int], bytes] = os.read
write: Callable[[int, bytes | bytearray | memoryview], int] = os.write
COMPILED = False
if not PURE_PYTHON:
    try:
        from broker.serving import _held_io
    except ImportError:  # pragma: no cover - built without a compiler
        pass
    else:
        read, write, COMPILED = _held_io.read_held, _held_io.write_held, True
