"""Giving freed memory back to the operating system, so that RSS falls once answers are gone.

glibc's malloc keeps what the process frees for reuse, and after each large block it frees it raises
the size from which blocks get their own mapping (the "dynamic mmap threshold", up to 32 MiB): large
answers then live in the heap, and the heap is rarely given back. So, on glibc only (elsewhere these
are no-ops):

- ``configure`` fixes that threshold at ``MMAP_THRESHOLD`` (which also turns the dynamic adjustment
  off): an answer of that size or more gets its own mapping, returned to the system when freed;
- ``trim`` returns the free memory at the top of the heap and in its free lists (``malloc_trim``);
  the server calls it a moment after connections close.

Process-wide: ``configure`` belongs to the process's start (``ws_server.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 - glibc has both; musl and others may not
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def configure() -> bool:
    """Fix glibc's mmap threshold; True when it was set."""
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim() -> None:
    """Return free heap memory to the system (a few milliseconds; call it off the hot path)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
