"""The batching policy, pure: queue state and a clock reading in, the next batch out.

No threads, no torch, no real clock: the engine calls it under its lock and tests call it with fake
times (tests/test_batching.py). The rules (protocol.md §6, issue "core server"):

- Requests are taken in arrival order; the batch stops at ``max_batch_size`` requests or when the
  next request would push the *padded* token count (rows x longest row) over ``max_batch_tokens``.
  The first request is always taken, even if it alone is over the token budget.
- Requests whose deadline has passed are removed and reported as expired, never batched.
- A request not yet tokenized (``n_tokens is None``) ends the batch: requests behind it wait, so
  that order is kept.
- ``max_wait_s`` is one deadline per batch, counted from the arrival of the oldest queued request,
  never restarted by later arrivals. With ``max_wait_s == 0`` a batch starts as soon as the engine
  is free, whatever its size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    """What the policy reads of a queued request."""

    arrival: float
    deadline: float | None
    n_tokens: int | None


J = TypeVar("J", bound=Queued)


@dataclass
class Decision(Generic[J]):
    """What to do now: run ``batch`` (maybe empty), answer ``expired`` with 504."""

    batch: list[J] = field(default_factory=list)
    expired: list[J] = field(default_factory=list)
    padded_tokens: int = 0


@dataclass(frozen=True)
class BatchPolicy:
    """Limits of one batch; see the module docstring for the rules."""

    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_batch_tokens < 1 or self.max_wait_s < 0:
            raise ValueError("batch limits must be positive")

    def expire(self, queue: deque[J], now: float) -> list[J]:
        """Remove and return every queued request whose deadline is at or before ``now``."""
        if not any(job.deadline is not None and job.deadline <= now for job in queue):
            return []
        keep: list[J] = []
        expired: list[J] = []
        for job in queue:
            (expired if job.deadline is not None and job.deadline <= now else keep).append(job)
        queue.clear()
        queue.extend(keep)
        return expired

    def wait_s(self, queue: deque[J], now: float) -> float:
        """Seconds to wait before forming the next batch; 0 means form it now.

        Waiting only makes sense when a batch could still grow: with ``max_wait_s`` set, the queue not
        yet holding a full batch, and the oldest request younger than ``max_wait_s``.
        """
        if not queue or self.max_wait_s == 0 or len(queue) >= self.max_batch_size:
            return 0.0
        if self._fill(queue)[1] < len(queue):
            return 0.0  # the token budget is already full
        return max(0.0, queue[0].arrival + self.max_wait_s - now)

    def take(self, queue: deque[J], now: float) -> Decision[J]:
        """Pop the next batch off the front of ``queue`` (after dropping expired requests)."""
        decision: Decision[J] = Decision(expired=self.expire(queue, now))
        padded, count = self._fill(queue)
        decision.batch = [queue.popleft() for _ in range(count)]
        decision.padded_tokens = padded
        return decision

    def _fill(self, queue: deque[J]) -> tuple[int, int]:
        """(padded tokens, number of requests) of the batch the front of ``queue`` would make."""
        longest = 0
        count = 0
        for job in queue:
            if count == self.max_batch_size or job.n_tokens is None:
                break
            candidate = max(longest, job.n_tokens)
            if count and candidate * (count + 1) > self.max_batch_tokens:
                break
            longest = candidate
            count += 1
        return longest * count, count
