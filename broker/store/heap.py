"""Heap hints: large frames go back to the system when they are freed (glibc only).

In the store package because the store is what holds large frames longest
(its queue, its transactions); the broker applies the threshold at start
(broker/app/lifecycle.py).

Frames above 512 bytes are ``malloc``'d.  glibc serves requests above its
mmap threshold (128 KiB at start) with their own mappings, returned to the
system on ``free`` -- but each such ``free`` raises the threshold to the
freed size (up to 32 MiB), so after the first burst of 4 MiB frames later
ones come from the heap, whose free space is rarely given back: measured
(bench/store_bounds.py), 150 frames of 4 MiB left the broker's RSS 308 MiB
higher for good.  :func:`return_large_frames` fixes the threshold (fixing it
turns the dynamic raise off), so every frame of :data:`MMAP_THRESHOLD` or
more is a mapping of its own and is unmapped when the last reference goes;
:func:`trim` (``malloc_trim``) hands back free heap at the top and in the
middle of the arenas, called by the store's writer after it has let go of
many bytes.  Both do nothing where glibc is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from broker.core.queue import RECV_CHUNK

log = logging.getLogger(__name__)

# Allocations of at least this size get their own mapping; above it a
# frame costs one mmap, one munmap and its page faults, small beside
# copying it.  Above every buffer the broker allocates per read: a receive
# asks for RECV_CHUNK bytes and shrinks them to what arrived, and a
# threshold at or below that size mapped and unmapped memory for every
# read (at 256 KiB it made an isolated 100-byte message cost ~15 us more
# CPU and doubled p50; bench.run --scenarios isolated).
MMAP_THRESHOLD = 4 * RECV_CHUNK
# Free space at the top of the heap kept rather than returned on each
# free.  Fixing the mmap threshold also stops glibc raising this one with
# it (it stays at 128 KiB), and a heap whose top is cut back after each
# large read grows again, page fault by page fault, on the next.  Twice
# the mmap threshold, as glibc's own dynamic rule sets it; the store's
# writer still hands free heap back with trim() after large writes.
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
_M_MMAP_THRESHOLD = -3

_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name or "libc.so.6")
            libc.mallopt  # noqa: B018 - glibc has it, musl and macOS do not
            libc.malloc_trim  # noqa: B018
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


def return_large_frames() -> bool:
    """Fix glibc's mmap and trim thresholds (call once, at start)."""
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    ok = bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and ok
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD / M_TRIM_THRESHOLD) refused")
    return ok


def trim() -> None:
    """Give free heap memory back to the system (``malloc_trim(0)``; releases the GIL)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
