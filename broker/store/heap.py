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

log = logging.getLogger(__name__)

# Allocations of at least this size get their own mapping.  Below it
# (messages up to 128 KiB, every header and object) nothing changes; above
# it a frame costs one mmap and one munmap, small beside copying it.
MMAP_THRESHOLD = 256 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number

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
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (call once, at start)."""
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused")
    return ok


def trim() -> None:
    """Give free heap memory back to the system (``malloc_trim(0)``; releases the GIL)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
