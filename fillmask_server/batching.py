"""The batching policy: queue state, a clock reading and the cost model in, the next batch out. No I/O.

No threads, no torch, no real clock: the engine core calls it and tests call it with fake times and
fixed coefficients (tests/test_batching.py). The queue holds requests in arrival order; each has an
``owner`` (its connection). The rules:

- **Expired first.** Requests whose deadline has passed are removed and reported, never batched.
- **The cost model** (``Coefficients``, fitted by the engine core from the batches it ran): a batch of
  ``rows`` requests padded to ``padded`` tokens whose answers take ``out`` bytes costs
  ``overhead + token·padded + row·rows + byte·out`` seconds of engine time (forward pass and decode).
  A request's *own* work is what it adds to a batch without padding: ``token·n_tokens + row + byte·out``.
  A batch's **efficiency** is its requests' own work divided by its predicted time: what is not its
  requests' work is per-batch overhead and padding.
- **Cost for fairness.** A request costs its owner what it asks of the engine, in token-equivalents
  (``cost``): its tokens plus its output priced in tokens (``byte / token``).
- **Fair by cost** (start-time fair queuing). Each connection has a virtual time: the cost it has
  been served. The *fair order* gives each next place to the waiting connection with the lowest
  virtual time, counting the places it already got (ties: the connection served longest ago, a
  newcomer first; then the oldest request), which offers its oldest request. A connection that starts
  waiting starts at the later of its own virtual time and the system's (the lowest among those waiting
  after the last batch): no credit for having been away, no escaping its debt by leaving for a moment.
  The first request in fair order (the *head*) is always in the batch.
- **The batch with the best efficiency** (``growth == 0``, the default). For each candidate band
  (longest row ``W``, from the head's length up to ``AUTO_GROWTH`` x the shortest row), the batch
  takes, in fair order, each request of length at most ``W`` (and at least ``W / AUTO_GROWTH``) that
  does not lower the batch's efficiency and keeps it within the limits below. Of these candidate
  batches the one with the best efficiency runs (ties: more rows, then the narrower band). For equal
  requests that is the batch that serves the most requests per second of engine time; for mixed
  lengths it pads only where the padding costs less than another batch's overhead. Requests left out
  keep their places.
- **A fixed band** (``growth`` set, ``--max-length-ratio``: the user's choice wins). The batch takes,
  in fair order, each request that keeps its longest row at most ``growth`` x its shortest and keeps
  it within the limits below.
- **Limits.** At most ``max_batch_size`` requests and ``max_batch_tokens`` token-equivalents (padded
  tokens plus output); and a **predicted time** of at most ``max_batch_s``, by default the overhead
  divided by ``slack`` (a batch that long spends at most ``slack`` of its time on overhead, so cutting
  batches there costs at most that share of throughput; never below ``MIN_AUTO_BATCH_S``, nor below
  the predicted time of a full batch of plain requests (output within ``slack`` of it) as long as the
  longest waiting:
  the bound cuts output-heavy batches, never a batch of ordinary ones), and at
  most ``deadline_share`` of the time left to the tightest deadline waiting. So a light request that
  arrives while a heavy batch runs waits for at most one such bounded batch, never for one long batch
  of heavy output.
- **Tail bound.** A request *misses* a batch when the fair order offered it to that batch and it
  would have fitted the limits, but the band (its length) or the efficiency rule left it out. A
  request that has missed ``max_missed`` batches widens the band: it is in the next batch, whatever
  its length (at most ``max_batch_size`` of them, oldest first). So no request misses more than
  ``max_missed`` batches because of the cost model's choice; what can hold it longer are only the
  limits (a full batch, the time bound: capacity, shared fairly) and answer room (a connection that
  is not reading).
- **Room.** A request whose connection has no room left for answers (``Room``: answers unsent or
  being computed, per connection and in all) is not started; it keeps its place. A connection with
  nothing waiting always has room for one request, so nobody waits for room forever.
- **Waiting.** ``max_wait_s`` is one deadline per batch, counted from the arrival of the oldest
  queued request, never restarted by later arrivals. With ``max_wait_s == 0`` (the default) a batch
  starts as soon as the engine is free, whatever its size, with one exception:
- **Anticipation.** Answers just sent bring requests back: a client that keeps a few requests in
  flight sends its next one as soon as an answer arrives. So once a batch's forward pass is done
  (``answered``), while fewer requests are queued than a full batch and some of those answers have not
  yet been followed by an arrival (``arrived``), the next batch waits for them, until
  ``anticipate_share`` of the last batch's time (``batch_ran``) or ``anticipate_s``, whichever is
  shorter, has passed since the hand-over. An idle engine (nothing answered lately) never waits.

State: per connection with queued requests, its virtual time and the number of the batch that last
served it (``take`` updates them); each queued request's ``missed`` count (``take`` updates it); the
anticipation counters above. ``wait_s`` only reads.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

WIDTHS = 8  # candidate bands tried per batch (the distinct lengths in reach, evenly spread)
TIE = 1e-9  # efficiencies this close are equal (floating-point rounding must not split equal requests)
MIN_AUTO_BATCH_S = 0.005  # the automatic time bound is never below this (a fit may put the overhead near 0)
AUTO_GROWTH = 3.0  # the widest band the cost model may choose (longest ÷ shortest row) when none is set
REACH = 2  # the fair order is followed this many full batches deep


class Queued(Protocol):
    """What the policy reads (and, for ``missed``, writes) of a queued request."""

    arrival: float
    deadline: float | None
    n_tokens: int
    cost: float  # token-equivalents: n_tokens plus its output (see the module docstring)
    result_bytes: int  # room its answer may take (an upper bound)
    owner: object
    missed: int  # batches the cost model left it out of (the tail bound)


J = TypeVar("J", bound=Queued)


@dataclass(frozen=True)
class Coefficients:
    """The cost model: seconds of engine time for a batch (see the module docstring). The defaults are
    a prior for a CPU, used until the engine has measured its own."""

    overhead_s: float = 1e-3
    token_s: float = 2e-5
    row_s: float = 1e-4
    byte_s: float = 2e-8

    def batch_s(self, rows: int, padded: int, out_bytes: float) -> float:
        """Predicted engine time of a batch."""
        return self.overhead_s + self.token_s * padded + self.row_s * rows + self.byte_s * out_bytes

    def own_s(self, n_tokens: int, out_bytes: float) -> float:
        """A request's own work: what it adds to a batch, without padding."""
        return self.token_s * n_tokens + self.row_s + self.byte_s * out_bytes


@dataclass
class Decision(Generic[J]):
    """What to do now: run ``batch`` (maybe empty), answer ``expired`` with 504."""

    batch: list[J] = field(default_factory=list)
    expired: list[J] = field(default_factory=list)
    padded_tokens: int = 0
    predicted_s: float = 0.0  # the cost model's time for ``batch``


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

    def copy(self) -> Room:
        return Room(self.per_owner, self.total, dict(self.used), self.used_total)


@dataclass
class _Candidate(Generic[J]):
    rows: list[J]
    longest: int
    own: float  # the rows' own work, seconds
    out_bytes: float
    output: float  # token-equivalents of output, for the token budget
    passed: list[J] = field(default_factory=list)  # left out by the band or the efficiency rule

    def predicted(self, cost: Coefficients) -> float:
        return cost.batch_s(len(self.rows), len(self.rows) * self.longest, self.out_bytes)

    def efficiency(self, cost: Coefficients) -> float:
        return self.own / self.predicted(cost)


@dataclass
class BatchPolicy:
    """Limits of one batch, the cost model's use, and the fairness memory; see the module docstring."""

    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float = 0.0
    growth: float = 0.0  # a fixed band (--max-length-ratio); 0: the cost model chooses, up to AUTO_GROWTH
    anticipate_s: float = 0.0
    anticipate_share: float = 0.3
    max_batch_s: float = 0.0  # 0: the overhead divided by ``slack``
    max_missed: int = 2
    slack: float = 0.05
    deadline_share: float = 0.5
    cost: Coefficients = field(default_factory=Coefficients)
    # Keyed by the owner object itself, never id(): an id is reused once its object is gone.
    _virtual: dict[Any, float] = field(default_factory=dict, init=False, repr=False)  # owner -> cost served
    _served_in: dict[Any, int] = field(default_factory=dict, init=False, repr=False)  # owner -> last batch number
    _system: float = field(default=0.0, init=False, repr=False)  # the system's virtual time
    _batches: int = field(default=0, init=False, repr=False)
    _returning: int = field(default=0, init=False, repr=False)  # answers sent, not yet followed by an arrival
    _anticipate_until: float = field(default=float("-inf"), init=False, repr=False)
    _last_batch_s: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.max_batch_size < 1 or self.max_batch_tokens < 1 or self.max_wait_s < 0
                or not (self.growth == 0 or self.growth >= 1)
                or self.anticipate_s < 0 or not 0 <= self.anticipate_share <= 1 or self.max_batch_s < 0
                or self.max_missed < 0 or not 0 < self.slack < 1 or not 0 < self.deadline_share <= 1):
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

    def time_limit(self, queue: deque[J] | list[J], now: float, cost: Coefficients | None = None) -> float:
        """The most predicted seconds a batch may take now (its first request is taken regardless)."""
        cost = cost or self.cost
        limit = self.max_batch_s
        if not limit:
            # A full batch of plain requests as long as the longest waiting is never cut: the bound is
            # for output-heavy batches (so a fit that puts the overhead near 0, on a slow or busy
            # machine, cannot shrink every batch to one row).
            longest = max((job.n_tokens for job in queue), default=0)
            plain = cost.batch_s(self.max_batch_size, self.max_batch_size * longest, 0.0) * (1 + self.slack)
            limit = max(MIN_AUTO_BATCH_S, cost.overhead_s / self.slack, plain)
        deadlines = [job.deadline for job in queue if job.deadline is not None]
        if deadlines:
            limit = min(limit, self.deadline_share * max(0.0, min(deadlines) - now))
        return limit

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

    def wait_s(self, queue: deque[J], now: float, cost: Coefficients | None = None) -> float:
        """Seconds to wait before forming the next batch; 0 means form it now.

        Waiting only makes sense when a batch could still grow (the batch the cost model would form now
        holds every queued request and fewer than a full batch) and there is something to wait for: the
        oldest request is younger than ``max_wait_s``, or answers just sent are expected to bring
        requests back (anticipation, see the module doc).
        """
        anticipating = self._returning > 0 and now < self._anticipate_until
        if not queue or (self.max_wait_s == 0 and not anticipating):
            return 0.0
        ready = list(queue)
        if len(ready) >= self.max_batch_size or len(self._pick(ready, now, None, cost or self.cost)[0]) < len(ready):
            return 0.0  # a full batch is already there
        wait_until = queue[0].arrival + self.max_wait_s if self.max_wait_s else now
        if anticipating:
            wait_until = max(wait_until, self._anticipate_until)
        deadlines = [job.deadline for job in queue if job.deadline is not None]
        if deadlines:  # never wait a request into its own deadline
            wait_until = min(wait_until, min(deadlines))
        return max(0.0, wait_until - now)

    def take(self, queue: deque[J], now: float, room: Room | None = None,
             cost: Coefficients | None = None) -> Decision[J]:
        """Remove the next batch from ``queue`` (after removing expired requests) and return it.

        ``room`` (optional) is the answer memory left; it is updated with what the batch reserves.
        ``cost`` (optional) is the cost model now; ``self.cost`` otherwise.
        """
        cost = cost or self.cost
        decision: Decision[J] = Decision(expired=self.expire(queue, now))
        chosen, passed = self._pick(list(queue), now, room, cost)
        if not chosen:
            return decision
        self._batches += 1
        taken = {id(job) for job in chosen}
        for job in passed:
            job.missed += 1
        kept = [job for job in queue if id(job) not in taken]
        decision.batch = [job for job in queue if id(job) in taken]  # arrival order
        queue.clear()
        queue.extend(kept)
        decision.padded_tokens = len(chosen) * max(job.n_tokens for job in chosen)
        decision.predicted_s = cost.batch_s(len(chosen), decision.padded_tokens,
                                            sum(job.result_bytes for job in chosen))
        virtual = {o: max(self._virtual.get(o, self._system), self._system) for o in {j.owner for j in chosen}}
        for job in decision.batch:
            virtual[job.owner] += job.cost
            if room is not None:
                room.take(job.owner, job.result_bytes)
        for owner, value in virtual.items():
            self._virtual[owner] = value
            self._served_in[owner] = self._batches
        waiting = {job.owner for job in kept}
        if waiting:
            self._system = max(self._system, min(self._virtual.get(o, self._system) for o in waiting))
        # Virtual times at or below the system's say nothing a newcomer's would not: forget them.
        for owner in [o for o, value in self._virtual.items() if value <= self._system and o not in waiting]:
            del self._virtual[owner]
            self._served_in.pop(owner, None)
        return decision

    # --- the choice -------------------------------------------------------------------------------------

    def _fair_order(self, ready: list[J], room: Room | None, depth: int) -> list[J]:
        """Up to ``depth`` requests in fair order (see the module doc), skipping connections without room."""
        by_owner: dict[Any, deque[J]] = {}
        for job in ready:
            by_owner.setdefault(job.owner, deque()).append(job)
        room = room.copy() if room is not None else None
        ties = itertools.count()
        heap = [(max(self._virtual.get(o, self._system), self._system), self._served_in.get(o, -1),
                 jobs[0].arrival, next(ties), o) for o, jobs in by_owner.items()]
        heapq.heapify(heap)
        order: list[J] = []
        while heap and len(order) < depth:
            virtual, served, _, _, owner = heapq.heappop(heap)
            jobs = by_owner[owner]
            job = jobs.popleft()
            if room is not None:
                if not room.fits(owner, job.result_bytes):
                    continue  # no room for this connection now: its requests keep their places
                room.take(owner, job.result_bytes)
            order.append(job)
            if jobs:
                heapq.heappush(heap, (virtual + job.cost, served, jobs[0].arrival, next(ties), owner))
        return order

    def _pick(self, ready: list[J], now: float, room: Room | None,
              cost: Coefficients) -> tuple[list[J], list[J]]:
        """The next batch's requests, and the requests it passed over (the tail bound's misses)."""
        if not ready:
            return [], []
        # The tail bound first: requests that have missed enough batches, oldest first, as room allows.
        trial = room.copy() if room is not None else None
        forced: list[J] = []
        for job in ready:
            if job.missed >= self.max_missed and len(forced) < self.max_batch_size:
                if trial is not None:
                    if not trial.fits(job.owner, job.result_bytes):
                        continue
                    trial.take(job.owner, job.result_bytes)
                forced.append(job)
        in_base = {id(job) for job in forced}
        order = self._fair_order([job for job in ready if id(job) not in in_base], trial,
                                 REACH * self.max_batch_size)
        if not order and not forced:
            return [], []
        base = ([order[0]] if order and len(forced) < self.max_batch_size else []) + forced  # the fair head leads
        rest = order[1:] if base and order and base[0] is order[0] else order
        limit = self.time_limit(ready, now, cost)
        fill = self._fill_band if self.growth else self._best_band
        return fill(base, rest, limit, cost)

    def _best_band(self, base: list[J], rest: list[J], limit: float,
                   cost: Coefficients) -> tuple[list[J], list[J]]:
        """The candidate band whose batch has the best efficiency (see the module doc)."""
        shortest = min(job.n_tokens for job in base)
        longest = max(job.n_tokens for job in base)
        reach = max(longest, int(AUTO_GROWTH * shortest))
        widths = sorted({longest, *(job.n_tokens for job in rest if longest < job.n_tokens <= reach)})
        if len(widths) > WIDTHS:
            step = (len(widths) - 1) / (WIDTHS - 1)
            widths = [widths[round(i * step)] for i in range(WIDTHS)]
        best: _Candidate[J] | None = None
        best_key: tuple[float, int, int] = (-1.0, 0, 0)
        for width in widths:
            candidate = self._fill(base, rest, width, limit, cost)
            key = (round(candidate.efficiency(cost), 9), len(candidate.rows), -width)
            if best is None or key > best_key:
                best, best_key = candidate, key
        assert best is not None
        return best.rows, best.passed

    def _fill_band(self, base: list[J], rest: list[J], limit: float,
                   cost: Coefficients) -> tuple[list[J], list[J]]:
        """``base``, then each request of ``rest`` (in fair order) within the fixed band and the limits;
        and the requests the band passed over."""
        batch = list(base)
        passed: list[J] = []
        shortest = base_low = min(job.n_tokens for job in base)
        longest = base_high = max(job.n_tokens for job in base)
        out_bytes = float(sum(job.result_bytes for job in base))
        output = sum(max(0.0, job.cost - job.n_tokens) for job in base)
        for job in rest:
            if len(batch) >= self.max_batch_size:
                break
            n = job.n_tokens
            low, high = min(shortest, n), max(longest, n)
            extra = max(0.0, job.cost - n)
            rows = len(batch) + 1
            if (rows * high + output + extra > self.max_batch_tokens
                    or cost.batch_s(rows, rows * high, out_bytes + job.result_bytes) > limit):
                continue
            if high > self.growth * low and not (base_low <= low and high <= base_high):
                passed.append(job)  # outside the band (a forced request may have widened it)
                continue
            batch.append(job)
            shortest, longest, output, out_bytes = low, high, output + extra, out_bytes + job.result_bytes
        return batch, passed

    def _fill(self, base: list[J], rest: list[J], width: int, limit: float, cost: Coefficients) -> _Candidate[J]:
        """The batch of band ``width``: ``base``, then each request of ``rest`` (in fair order) that fits.

        Plain arithmetic on locals: this runs for every candidate band under the engine's lock."""
        low = width / AUTO_GROWTH
        overhead, token_s, row_s, byte_s = cost.overhead_s, cost.token_s, cost.row_s, cost.byte_s
        rows = list(base)
        passed: list[J] = []
        longest = max(job.n_tokens for job in base)
        own = sum(cost.own_s(job.n_tokens, job.result_bytes) for job in base)
        out_bytes = float(sum(job.result_bytes for job in base))
        output = sum(max(0.0, job.cost - job.n_tokens) for job in base)
        count = len(rows)
        efficiency = own / (overhead + (token_s * longest + row_s) * count + byte_s * out_bytes)
        size, budget = self.max_batch_size, self.max_batch_tokens
        for job in rest:
            if count >= size:
                break
            n = job.n_tokens
            if n > width or n < low:
                passed.append(job)
                continue
            wide = n if n > longest else longest
            extra = job.cost - n
            more_output = output + (extra if extra > 0 else 0.0)
            if (count + 1) * wide + more_output > budget:
                continue
            more_bytes = out_bytes + job.result_bytes
            predicted = overhead + (token_s * wide + row_s) * (count + 1) + byte_s * more_bytes
            if predicted > limit:
                continue
            more_own = own + token_s * n + row_s + byte_s * job.result_bytes
            if more_own < efficiency * predicted * (1 - TIE):  # a tie (equal requests, no overhead) joins
                passed.append(job)
                continue
            rows.append(job)
            count += 1
            longest, own, out_bytes, output, efficiency = wide, more_own, more_bytes, more_output, more_own / predicted
        return _Candidate(rows, longest, own, out_bytes, output, passed)
