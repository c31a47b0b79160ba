"""The batching policy: queue state and a clock reading in, the next batch out. No I/O.

No threads, no torch, no real clock: the engine calls it under its lock and tests call it with fake
times (tests/test_batching.py). The queue holds requests in arrival order; each has an ``owner`` (its
connection). The rules:

- **Expired first.** Requests whose deadline has passed are removed and reported, never batched.
- **Cost.** A request costs what it asks of the engine, in token-equivalents (``cost``): its tokens
  for the encoder plus its output (its result's size bound, which the decode stage turns into
  strings and JSON) at the engine's measured price of a result byte in tokens.
- **Limits.** A batch holds at most ``max_batch_size`` requests and at most ``max_batch_tokens``
  token-equivalents: its *padded* tokens (rows x longest row) plus its requests' output. Its first
  request is always taken, even alone over budget.
- **Room.** A request whose connection has no room left for answers (``Room``: answers unsent or
  being computed, per connection and in all) is not started; it keeps its place. A connection with
  nothing waiting always has room for one request, so nobody waits for room forever.
- **Fair by cost** (start-time fair queuing). Each connection has a virtual time: the cost it has
  been served. Each place of a batch goes to the waiting connection with the lowest virtual time,
  counting what this batch already gives it (ties: the connection served longest ago, a newcomer
  first; then the oldest request), which offers its oldest request that fits. A connection that
  starts waiting starts at the later of its own virtual time and the system's (the lowest among
  those waiting after the last batch): no credit for having been away, and no escaping its debt by
  leaving the queue for a moment. So connections share the engine's time, not its request count:
  heavy requests cost their owner more of its share, and a light request of another connection is in
  the next batch, or the one after if the next cannot hold its length.
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
  would wait a whole batch (batches of 32 closed-loop clients alternate around 16 and 16). So once a
  batch's forward pass is done (``answered``: its answers leave as soon as they are decoded), while
  fewer requests are queued than a full batch and some
  of those answers have not yet been followed by an arrival (``arrived``), the next batch waits for
  them, until ``anticipate_share`` of the last batch's time (``batch_ran``) or ``anticipate_s``,
  whichever is shorter, has passed since the hand-over. So the wait never costs more than that share
  of a batch, and an idle engine (nothing answered lately) starts a request at once.

State: per connection with queued requests, its virtual time and the number of the batch that last
served it (``take`` updates them); the anticipation counters above. ``wait_s`` only reads.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar


class Queued(Protocol):
    """What the policy reads of a queued request."""

    arrival: float
    deadline: float | None
    n_tokens: int
    cost: float  # token-equivalents: n_tokens plus its output (see the module docstring)
    result_bytes: int  # room its answer may take (an upper bound)
    owner: object


J = TypeVar("J", bound=Queued)


@dataclass
class Decision(Generic[J]):
    """What to do now: run ``batch`` (maybe empty), answer ``expired`` with 504."""

    batch: list[J] = field(default_factory=list)
    expired: list[J] = field(default_factory=list)
    padded_tokens: int = 0


@dataclass
class Room:
    """Answer memory left for one batch decision: ``used`` bytes per owner and in all, against
    ``per_owner`` and ``total``. An owner with nothing used fits any one request."""

    per_owner: int
    total: int
    used: dict[Any, int] = field(default_factory=dict)
    used_total: int = 0

    def fits(self, owner: Any, size: int) -> bool:
        used = self.used.get(owner, 0)
        return ((used == 0 or used + size <= self.per_owner)
                and (self.used_total == 0 or self.used_total + size <= self.total))

    def take(self, owner: Any, size: int) -> None:
        self.used[owner] = self.used.get(owner, 0) + size
        self.used_total += size


@dataclass
class BatchPolicy:
    """Limits of one batch and the fairness memory; see the module docstring for the rules."""

    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float = 0.0
    growth: float = 1.5
    anticipate_s: float = 0.0
    anticipate_share: float = 0.3
    # Keyed by the owner object itself, never id(): an id is reused once its object is gone.
    _virtual: dict[Any, float] = field(default_factory=dict, init=False, repr=False)  # owner -> cost served
    _served_in: dict[Any, int] = field(default_factory=dict, init=False, repr=False)  # owner -> last batch number
    _system: float = field(default=0.0, init=False, repr=False)  # the system's virtual time
    _batches: int = field(default=0, init=False, repr=False)
    _returning: int = field(default=0, init=False, repr=False)  # answers sent, not yet followed by an arrival
    _anticipate_until: float = field(default=float("-inf"), init=False, repr=False)
    _last_batch_s: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.max_batch_size < 1 or self.max_batch_tokens < 1 or self.max_wait_s < 0 or self.growth < 1
                or self.anticipate_s < 0 or not 0 <= self.anticipate_share <= 1):
            raise ValueError("batch limits must be positive")

    def answered(self, count: int, now: float) -> None:
        """``count`` answers are on their way out at ``now``: their clients may send again soon."""
        if self.anticipate_s > 0 and count > 0:
            self._returning = min(self.max_batch_size, self._returning + count)
            self._anticipate_until = now + min(self.anticipate_s, self.anticipate_share * self._last_batch_s)

    def arrived(self, count: int) -> None:
        """``count`` new requests joined the queue."""
        self._returning = max(0, self._returning - count)

    def forget(self, owner: Any) -> None:
        """``owner`` (a connection) is gone: drop what the policy remembers of it."""
        self._virtual.pop(owner, None)
        self._served_in.pop(owner, None)

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

    def take(self, queue: deque[J], now: float, room: Room | None = None) -> Decision[J]:
        """Remove the next batch from ``queue`` (after removing expired requests) and return it.

        ``room`` (optional) is the answer memory left; it is updated with what the batch reserves.
        """
        decision: Decision[J] = Decision(expired=self.expire(queue, now))
        ready = list(queue)
        chosen, charged = self._pick(ready, room)
        if not chosen:
            return decision
        self._batches += 1
        taken = {id(job) for job in chosen}
        kept = [job for job in queue if id(job) not in taken]
        decision.batch = [job for job in queue if id(job) in taken]  # arrival order
        queue.clear()
        queue.extend(kept)
        decision.padded_tokens = len(chosen) * max(job.n_tokens for job in chosen)
        for owner, virtual in charged.items():
            self._virtual[owner] = virtual
            self._served_in[owner] = self._batches
        waiting = {job.owner for job in kept}
        if waiting:
            self._system = max(self._system, min(self._virtual.get(o, self._system) for o in waiting))
        # Virtual times at or below the system's say nothing a newcomer's would not: forget them.
        for owner in [o for o, virtual in self._virtual.items() if virtual <= self._system and o not in waiting]:
            del self._virtual[owner]
            self._served_in.pop(owner, None)
        return decision

    def _select(self, ready: list[J]) -> list[J]:
        """The requests the next batch would hold (no room limit): for ``wait_s``."""
        return self._pick(ready, None)[0]

    def _pick(self, ready: list[J], room: Room | None) -> tuple[list[J], dict[Any, float]]:
        """The next batch's requests, and each served owner's virtual time after it (see the module doc)."""
        if not ready:
            return [], {}
        by_owner: dict[Any, deque[J]] = {}
        for job in ready:
            by_owner.setdefault(job.owner, deque()).append(job)
        virtual = {o: max(self._virtual.get(o, self._system), self._system) for o in by_owner}

        def rank(owner: Any) -> tuple[float, int, float]:
            return virtual[owner], self._served_in.get(owner, -1), by_owner[owner][0].arrival

        batch: list[J] = []
        shortest = longest = 0
        output = 0.0
        charged: dict[Any, float] = {}
        candidates = set(by_owner)
        while candidates and len(batch) < self.max_batch_size:
            owner = min(candidates, key=rank)
            job = by_owner[owner].popleft()
            if not by_owner[owner]:
                candidates.discard(owner)
            n = job.n_tokens
            low, high = (n, n) if not batch else (min(shortest, n), max(longest, n))
            extra = max(0.0, job.cost - n)
            if batch and (high > self.growth * low
                          or (len(batch) + 1) * high + output + extra > self.max_batch_tokens):
                continue
            if room is not None and not room.fits(owner, job.result_bytes):
                candidates.discard(owner)  # no room for this connection now: its requests keep their places
                continue
            if room is not None:
                room.take(owner, job.result_bytes)
            batch.append(job)
            shortest, longest, output = low, high, output + extra
            virtual[owner] += job.cost
            charged[owner] = virtual[owner]
        return batch, charged
