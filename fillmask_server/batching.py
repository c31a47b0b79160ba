"""The batching policy, pure: queue state and a clock reading in, the next batch out.

No threads, no torch, no real clock: the engine calls it under its lock and tests call it with fake
times (tests/test_batching.py). The queue holds requests in arrival order; each has an ``owner`` (its
connection). The rules:

- **Expired first.** Requests whose deadline has passed are removed and reported, never batched.
- **Limits.** A batch holds at most ``max_batch_size`` requests and at most ``max_batch_tokens``
  *padded* tokens (rows x longest row). Its first request is always taken, even alone over budget.
- **Fair.** Connections are served round-robin: the oldest waiting request of every connection
  (connections ordered by that request's age) enters the batch before any second request of any
  connection. One connection with a thousand queued requests therefore cannot delay another
  connection's request by more than one batch (unless more than ``max_batch_size`` connections wait).
- **Little padding.** The remaining places go first to requests no longer than the batch's longest
  row (they add no padding to the others), oldest first, then to longer requests in increasing
  length while the longest row grows by at most ``growth`` x. Requests left out keep their places.
- **Tokenized only.** A request not yet tokenized (``n_tokens is None``) waits for the next batch.
- **Waiting.** ``max_wait_s`` is one deadline per batch, counted from the arrival of the oldest
  queued request, never restarted by later arrivals. With ``max_wait_s == 0`` a batch starts as
  soon as the engine is free, whatever its size.

Every request is served after a bounded number of batches: the oldest request of the oldest
connection is always in the next batch, so each batch serves the head of the queue.
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
    owner: object


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
    growth: float = 1.5

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_batch_tokens < 1 or self.max_wait_s < 0 or self.growth < 1:
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

        Waiting only makes sense when a batch could still grow: with ``max_wait_s`` set, fewer
        tokenized requests queued than a full batch, and the oldest request younger than ``max_wait_s``.
        """
        if not queue or self.max_wait_s == 0:
            return 0.0
        ready = [job for job in queue if job.n_tokens is not None]
        if len(ready) >= self.max_batch_size or len(self._select(ready)) < len(ready):
            return 0.0  # a full batch is already there
        return max(0.0, queue[0].arrival + self.max_wait_s - now)

    def take(self, queue: deque[J], now: float) -> Decision[J]:
        """Remove the next batch from ``queue`` (after removing expired requests) and return it."""
        decision: Decision[J] = Decision(expired=self.expire(queue, now))
        chosen = self._select([job for job in queue if job.n_tokens is not None])
        if not chosen:
            return decision
        taken = {id(job) for job in chosen}
        kept = [job for job in queue if id(job) not in taken]
        decision.batch = [job for job in queue if id(job) in taken]  # arrival order
        queue.clear()
        queue.extend(kept)
        decision.padded_tokens = len(chosen) * max(job.n_tokens or 0 for job in chosen)
        return decision

    def _select(self, ready: list[J]) -> list[J]:
        """The requests of the next batch, from tokenized requests in arrival order."""
        if not ready:
            return []
        heads: list[J] = []
        rest: list[J] = []
        owners: set[int] = set()
        for job in ready:
            key = id(job.owner)
            if key in owners:
                rest.append(job)
            else:
                owners.add(key)
                heads.append(job)
        batch: list[J] = []
        longest = 0
        skipped_head = False
        for job in heads:  # fairness: every connection's oldest request first
            if len(batch) == self.max_batch_size:
                return batch
            if self._fits(len(batch), longest, job):
                batch.append(job)
                longest = max(longest, job.n_tokens or 0)
            else:
                skipped_head = True
        if skipped_head:
            return batch  # no second request of anyone ahead of a connection still waiting
        for job in rest:  # free riders: no longer than the longest row, oldest first
            if len(batch) == self.max_batch_size:
                return batch
            if (job.n_tokens or 0) <= longest and self._fits(len(batch), longest, job):
                batch.append(job)
        limit = longest * self.growth
        for job in sorted((j for j in rest if (j.n_tokens or 0) > longest), key=lambda j: j.n_tokens or 0):
            if len(batch) == self.max_batch_size or (job.n_tokens or 0) > limit:
                break
            if not self._fits(len(batch), longest, job):
                break
            batch.append(job)
            longest = job.n_tokens or 0
        return batch

    def _fits(self, count: int, longest: int, job: J) -> bool:
        """Whether ``job`` may join a batch of ``count`` rows padded to ``longest`` tokens."""
        return count == 0 or (count + 1) * max(longest, job.n_tokens or 0) <= self.max_batch_tokens
