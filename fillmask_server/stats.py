"""Live figures for the ``stats`` frames (protocol.md §13): what happened in the last few seconds.

``LiveStats`` keeps two short rolling records, each bounded in length and in age: the results handed
to connections (their time and server-side latency) and the batches the model ran. A subscriber's
``stats`` frame covers the time since its previous one (``snapshot(since, now, ...)``), so each gets
its own window whatever its interval. Pure bookkeeping: the caller passes the clock readings and the
live values (queue depth, in flight, connections); nothing here touches the event loop or the engine.

Thread use: ``batch_ran`` is called on the engine's decode stage thread (as it takes a batch from the
model thread, before decoding it) and everything else on the event loop. A
batch is stamped and recorded under ``_lock``, and ``snapshot`` reads the batches under it: a batch
stamped before a snapshot's ``now`` is in that snapshot, one stamped after it in the next (stamped,
then recorded only after a snapshot had passed, it would have fallen between two windows and been in
none). The results are the event loop's alone.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KEEP_S = 30.0  # records older than this are dropped (a subscriber's window is at most 10 s)
KEEP_RESULTS = 20_000
KEEP_BATCHES = 2_000
MAX_BATCHES_PER_FRAME = 64


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch as the model ran it, stamped when the decode stage took it over."""

    finished: float
    batch_id: int
    size: int
    tokens: int
    seconds: float


class LiveStats:
    """Rolling records of results and batches; ``snapshot`` turns a window of them into a frame's fields."""

    def __init__(self) -> None:
        self._results: deque[tuple[float, float]] = deque(maxlen=KEEP_RESULTS)  # (time, latency ms)
        self._batches: deque[BatchRecord] = deque(maxlen=KEEP_BATCHES)
        self._lock = threading.Lock()

    def result(self, now: float, latency_ms: float) -> None:
        """A result was handed to its connection ``latency_ms`` after its request was read."""
        self._results.append((now, latency_ms))
        while self._results and self._results[0][0] < now - KEEP_S:
            self._results.popleft()

    def batch_ran(self, clock: Callable[[], float], batch_id: int, size: int, tokens: int, seconds: float) -> None:
        """A batch just ran: recorded as finished at ``clock()``, read under the lock (module doc)."""
        with self._lock:
            self._batches.append(BatchRecord(clock(), batch_id, size, tokens, seconds))

    def snapshot(self, since: float, now: float, queue_depth: int, in_flight: int, connections: int) -> dict[str, Any]:
        """The fields of one ``stats`` frame for the window (since, now]."""
        window = max(now - since, 1e-9)
        latencies = sorted(latency for t, latency in list(self._results) if since < t <= now)
        with self._lock:
            batches = [b for b in self._batches if since < b.finished <= now]
        busy = sum(min(b.seconds, b.finished - since) for b in batches)
        return {
            "window_s": round(window, 3),
            "queue_depth": queue_depth,
            "in_flight": in_flight,
            "connections": connections,
            "requests_per_s": round(len(latencies) / window, 1),
            "latency_ms": {"p50": _quantile(latencies, 0.50), "p99": _quantile(latencies, 0.99)},
            "batch_size": {"mean": round(sum(b.size for b in batches) / len(batches), 2) if batches else None,
                           "max": max((b.size for b in batches), default=None)},
            "engine_busy": round(min(1.0, busy / window), 3),
            "batches": [{"batch_id": b.batch_id, "size": b.size, "tokens": b.tokens,
                         "inference_ms": round(b.seconds * 1000, 3)} for b in batches[-MAX_BATCHES_PER_FRAME:]],
        }


def _quantile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank quantile of an ascending list, or None when it is empty."""
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return round(ordered[index], 3)
