"""The batching policy: queue state and a clock reading in, the next batch out. No I/O.

No threads, no torch, no real clock: the engine calls it under its lock and tests call it with fake
times (tests/test_batching.py). The queue holds requests in arrival order; each has an ``owner`` (its
connection). The rules:

- **Expired first.** Requests whose deadline has passed are removed and reported, never batched.
- **Limits.** A batch holds at most ``max_batch_size`` requests and at most ``max_batch_tokens``
  *padded* tokens (rows x longest row). Its first request is always taken, even alone over budget.
- **Fair.** Each batch is built around one *lead* request: the oldest request of the connection that
  was served least recently (ties broken by the age of their oldest request). A connection that
  starts waiting ranks as served by the latest batch, so a steady trickle of new arrivals cannot
  overtake a connection with a backlog again and again.
  The other places are offered round-robin across connections in that same order. So a connection
  with a thousand queued requests cannot keep another connection's request waiting for more than one
  batch: that connection leads the next batch at the latest.
- **Little padding.** A batch only takes requests whose token counts stay within a band: longest row
  at most ``growth`` x the shortest. On a CPU a forward pass costs in proportion to the padded tokens,
  so several batches of similar lengths beat one batch padded to its longest row; requests left out
  keep their places and lead or join the next batches.
- **Waiting.** ``max_wait_s`` is one deadline per batch, counted from the arrival of the oldest
  queued request, never restarted by later arrivals. With ``max_wait_s == 0`` (the default) a batch
  starts as soon as the engine is free, whatever its size, with one exception:
- **Anticipation.** Answers just sent bring requests back: a client that keeps a few requests in
  flight sends its next one as soon as an answer arrives, a few milliseconds later. Started at once,
  the next batch would hold only what was already queued, and the clients answered by the batch before
  would wait a whole batch (batches of 32 closed-loop clients alternate around 16 and 16). So after
  answers are handed over (``answered``), while fewer requests are queued than a full batch and some
  of those answers have not yet been followed by an arrival (``arrived``), the next batch waits for
  them, until ``anticipate_share`` of the last batch's time (``batch_ran``) or ``anticipate_s``,
  whichever is shorter, has passed since the hand-over. So the wait never costs more than that share
  of a batch, and an idle engine (nothing answered lately) starts a request at once.

State: per connection with queued requests, the number of the batch that last served it, or the
batch before which it started waiting (``take`` updates it); the anticipation counters above.
``wait_s`` only reads.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    """What the policy reads of a queued request."""

    arrival: float
    deadline: float | None
    n_tokens: int
    owner: object


J = TypeVar("J", bound=Queued)


@dataclass
class Decision(Generic[J]):
    """What to do now: run ``batch`` (maybe empty), answer ``expired`` with 504."""

    batch: list[J] = field(default_factory=list)
    expired: list[J] = field(default_factory=list)
    padded_tokens: int = 0


@dataclass
class BatchPolicy:
    """Limits of one batch and the fairness memory; see the module docstring for the rules."""

    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float = 0.0
    growth: float = 1.5
    anticipate_s: float = 0.0
    anticipate_share: float = 0.3
    _last_served: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _batches: int = field(default=0, init=False, repr=False)
    _returning: int = field(default=0, init=False, repr=False)  # answers sent, not yet followed by an arrival
    _anticipate_until: float = field(default=float("-inf"), init=False, repr=False)
    _last_batch_s: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.max_batch_size < 1 or self.max_batch_tokens < 1 or self.max_wait_s < 0 or self.growth < 1
                or self.anticipate_s < 0 or not 0 <= self.anticipate_share <= 1):
            raise ValueError("batch limits must be positive")

    def answered(self, count: int, now: float) -> None:
        """``count`` answers were handed over at ``now``: their clients may send again soon."""
        if self.anticipate_s > 0 and count > 0:
            self._returning = min(self.max_batch_size, self._returning + count)
            self._anticipate_until = now + min(self.anticipate_s, self.anticipate_share * self._last_batch_s)

    def arrived(self, count: int) -> None:
        """``count`` new requests joined the queue."""
        self._returning = max(0, self._returning - count)

    def batch_ran(self, seconds: float) -> None:
        """The last batch took ``seconds`` on the model: what a wait for company is measured against."""
        self._last_batch_s = seconds

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

        Waiting only makes sense when a batch could still grow (fewer requests queued than a full
        batch) and there is something to wait for: the oldest request is younger than ``max_wait_s``,
        or answers just sent are expected to bring requests back (anticipation, see the module doc).
        """
        anticipating = self._returning > 0 and now < self._anticipate_until
        if not queue or (self.max_wait_s == 0 and not anticipating):
            return 0.0
        ready = list(queue)
        if len(ready) >= self.max_batch_size or len(self._select(ready)) < len(ready):
            return 0.0  # a full batch is already there
        wait_until = queue[0].arrival + self.max_wait_s if self.max_wait_s else now
        if anticipating:
            wait_until = max(wait_until, self._anticipate_until)
        deadlines = [job.deadline for job in queue if job.deadline is not None]
        if deadlines:  # never wait a request into its own deadline
            wait_until = min(wait_until, min(deadlines))
        return max(0.0, wait_until - now)

    def take(self, queue: deque[J], now: float) -> Decision[J]:
        """Remove the next batch from ``queue`` (after removing expired requests) and return it."""
        decision: Decision[J] = Decision(expired=self.expire(queue, now))
        ready = list(queue)
        for job in ready:  # a connection seen for the first time ranks as served by the latest batch
            self._last_served.setdefault(id(job.owner), self._batches)
        chosen = self._select(ready)
        if not chosen:
            return decision
        self._batches += 1
        taken = {id(job) for job in chosen}
        kept = [job for job in queue if id(job) not in taken]
        decision.batch = [job for job in queue if id(job) in taken]  # arrival order
        queue.clear()
        queue.extend(kept)
        decision.padded_tokens = len(chosen) * max(job.n_tokens for job in chosen)
        waiting = {id(job.owner) for job in kept}
        self._last_served = {owner: n for owner, n in self._last_served.items() if owner in waiting}
        for job in chosen:
            if id(job.owner) in waiting:
                self._last_served[id(job.owner)] = self._batches
        return decision

    def _select(self, ready: list[J]) -> list[J]:
        """The requests of the next batch, chosen from the queued requests in arrival order."""
        if not ready:
            return []
        by_owner: dict[int, list[J]] = {}
        for job in ready:
            by_owner.setdefault(id(job.owner), []).append(job)
        owners = sorted(by_owner, key=lambda o: (self._last_served.get(o, self._batches), by_owner[o][0].arrival))
        lead = by_owner[owners[0]][0]
        batch = [lead]
        shortest = longest = lead.n_tokens
        for job in _round_robin([by_owner[o] for o in owners]):
            if len(batch) == self.max_batch_size:
                break
            if job is lead:
                continue
            n = job.n_tokens
            low, high = min(shortest, n), max(longest, n)
            if high > self.growth * low or (len(batch) + 1) * high > self.max_batch_tokens:
                continue
            batch.append(job)
            shortest, longest = low, high
        return batch


def _round_robin(queues: list[list[J]]) -> list[J]:
    """First of each queue, then second of each, and so on."""
    out: list[J] = []
    depth = 0
    while True:
        layer = [q[depth] for q in queues if depth < len(q)]
        if not layer:
            return out
        out.extend(layer)
        depth += 1
