"""Live figures for the ``stats`` frames (protocol.md §13): what happened since a subscriber's last frame.

``LiveStats`` keeps running totals, never a list of everything: the results handed to connections
(a count, and a histogram of their server-side latencies in buckets 1% wide, kept as the buckets
that were used: a few hundred at most in practice) and the batches the model
ran (a count, their rows, their seconds, the last ``MAX_BATCHES_PER_FRAME`` of them, and the largest
batch since any point). A subscriber keeps a ``Mark`` (the totals when its window began) and its frame is
the difference between the totals now and its mark (``snapshot``), so each subscriber gets its own
window, whatever its interval, whatever the rate: every result and every batch is in exactly one frame
of each subscriber, however many there are in a window (a record of the last N results once left
most of a 10-s window out at a few thousand results a second). The latency quantiles are exact to the
histogram's 1% buckets. Pure bookkeeping: the caller passes the clock readings and the live values
(queue depth, in flight, connections); nothing here touches the event loop or the engine.

Thread use: ``batch_ran`` is called on the engine's decode stage thread (as it takes a batch from the
model thread, before decoding it) and everything else on the event loop. Batches are counted and read
under ``_lock``: a batch counted before a mark is in the window that ends there, one counted after it in
the next, so none falls between two windows. The results are the event loop's alone.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_BATCHES_PER_FRAME = 64
LOWEST_MS = 0.01  # the first latency bucket holds everything up to this
BUCKET_RATIO = 1.01  # each latency bucket is 1% wider than the one before
BUCKETS = math.ceil(math.log(1e9) / math.log(BUCKET_RATIO))  # up to 10^9 x LOWEST_MS (about 2.8 hours)
_PER_LOG = 1 / math.log(BUCKET_RATIO)


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch as the model ran it, numbered in the order the decode stage took them over."""

    number: int
    batch_id: int
    size: int
    tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Mark:
    """Where a window begins: the time, and the running totals then."""

    time: float
    results: int
    latencies: Mapping[int, int]  # results per latency bucket used so far (never changed once marked)
    batches: int
    rows: int
    busy_s: float


def latency_bucket(latency_ms: float) -> int:
    """The histogram bucket of a latency: bucket i holds [LOWEST_MS x RATIO^i, LOWEST_MS x RATIO^(i+1)),
    bucket 0 everything below its top, the last everything above its bottom."""
    if latency_ms <= LOWEST_MS:
        return 0
    return min(BUCKETS - 1, int(math.log(latency_ms / LOWEST_MS) * _PER_LOG))


def bucket_value(bucket: int) -> float:
    """The value a bucket stands for: its geometric middle (within half a bucket of any latency in it)."""
    return float(LOWEST_MS * BUCKET_RATIO ** (bucket + 0.5))


class LiveStats:
    """Running totals of results and batches; ``snapshot`` turns the change since a ``Mark`` into a frame."""

    def __init__(self) -> None:
        self._results = 0
        self._latencies: dict[int, int] = {}
        self._lock = threading.Lock()
        self._batches = 0
        self._rows = 0
        self._busy_s = 0.0
        self._recent: deque[BatchRecord] = deque(maxlen=MAX_BATCHES_PER_FRAME)
        # (number, size) of each batch larger than every batch after it: the largest batch after any
        # number is the first entry past it. Sizes fall strictly along it, so it stays short.
        self._largest: deque[tuple[int, int]] = deque()

    def result(self, latency_ms: float) -> None:
        """A result was handed to its connection ``latency_ms`` after its request was read."""
        self._results += 1
        bucket = latency_bucket(latency_ms)
        self._latencies[bucket] = self._latencies.get(bucket, 0) + 1

    def batch_ran(self, batch_id: int, size: int, tokens: int, seconds: float) -> None:
        """A batch just ran (module doc: counted under the lock)."""
        with self._lock:
            self._batches += 1
            self._rows += size
            self._busy_s += seconds
            self._recent.append(BatchRecord(self._batches, batch_id, size, tokens, seconds))
            while self._largest and self._largest[-1][1] <= size:
                self._largest.pop()
            self._largest.append((self._batches, size))

    def mark(self, now: float) -> Mark:
        """The totals at ``now``: where a window that begins now starts."""
        with self._lock:
            return Mark(now, self._results, dict(self._latencies), self._batches, self._rows, self._busy_s)

    def snapshot(self, since: Mark, now: float, queue_depth: int, in_flight: int,
                 connections: int) -> tuple[dict[str, Any], Mark]:
        """The fields of one ``stats`` frame for the window from ``since`` to ``now``, and the mark where
        the next window begins."""
        with self._lock:
            end = Mark(now, self._results, dict(self._latencies), self._batches, self._rows, self._busy_s)
            batches = [b for b in self._recent if b.number > since.batches]
            largest = next((size for number, size in self._largest if number > since.batches), None)
        window = max(now - since.time, 1e-9)
        results = end.results - since.results
        counts = sorted((bucket, count - since.latencies.get(bucket, 0)) for bucket, count in end.latencies.items()
                        ) if results else []
        ran = end.batches - since.batches
        frame = {
            "window_s": round(window, 3),
            "queue_depth": queue_depth,
            "in_flight": in_flight,
            "connections": connections,
            "requests_per_s": round(results / window, 1),
            "latency_ms": {"p50": _quantile(counts, results, 0.50), "p99": _quantile(counts, results, 0.99)},
            "batch_size": {"mean": round((end.rows - since.rows) / ran, 2) if ran else None,
                           "max": largest if ran else None},
            "engine_busy": round(min(1.0, (end.busy_s - since.busy_s) / window), 3),
            "batches": [{"batch_id": b.batch_id, "size": b.size, "tokens": b.tokens,
                         "inference_ms": round(b.seconds * 1000, 3)} for b in batches],
        }
        return frame, end


def _quantile(counts: list[tuple[int, int]], total: int, q: float) -> float | None:
    """The nearest-rank quantile of ``total`` latencies counted per bucket (``(bucket, count)`` in
    bucket order; the value is their bucket's), or None when there are none."""
    if not total:
        return None
    rank = min(total, max(1, math.ceil(q * total)))
    seen = 0
    for bucket, count in counts:
        seen += count
        if seen >= rank:
            return round(bucket_value(bucket), 3)
    raise AssertionError("the counts add up to fewer than their total")
