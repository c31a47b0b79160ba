"""Memory: giving freed memory back to the operating system, so that RSS falls once answers are gone,
and keeping Python's cyclic garbage collector off what start-up made.

glibc's malloc keeps what the process frees for reuse. ``trim`` (``malloc_trim``) returns the free
memory of every arena to the system, including free pages in the middle of a heap; the server calls
it a moment after connections close. On other C libraries it is a no-op.

glibc's mmap threshold is deliberately left alone. Fixing it low (so that every large block gets its
own mapping, given back at once when freed) was tried: RSS after the memory scenario of
``scripts/reliability.py`` was about the same, but every activation tensor of a forward pass then
came from a fresh mapping that the kernel zeroes page by page, and the forward pass in the server
slowed by about a third (docs/performance-log.md, "The allocator").

Start-up (the imports of torch and transformers, the tokenizer, the model) leaves hundreds of
thousands of objects that live as long as the process. Each full (oldest-generation) collection
walks every one of them while holding the GIL, so every thread waits: the event loop, the model
thread between operators, the decode thread. Serving triggers full collections steadily when
connections come and go (each leaves reference cycles that outlive the young generations).
``freeze_start_up_heap`` collects once and then moves what is left out of the collector's sight
(``gc.freeze``), so a full collection walks only what serving made. What start-up made is never
collected afterwards; it is meant to live until exit anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - glibc has it; musl and others may not
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def trim() -> None:
    """Return free heap memory to the system (a few milliseconds; call it off the hot path)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


_frozen = 0  # what the last ``freeze_start_up_heap`` froze (``frozen_objects``)


def freeze_start_up_heap() -> int:
    """Collect, then exempt every object alive now from later collections (``gc.freeze``); call it
    once, when start-up is done and before serving. Returns how many objects are now exempt."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()
    return _frozen


def frozen_objects() -> int:
    """How many objects ``freeze_start_up_heap`` froze (0 before it ran), counted once then: CPython's
    ``gc.get_freeze_count`` walks the whole frozen list, hundreds of thousands of objects, holding the
    GIL, and a ``/metrics`` scrape that called it stalled every connection for as long."""
    return _frozen
