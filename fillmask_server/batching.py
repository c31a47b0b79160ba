"""The batching policy: queue state, a clock reading and the cost model in, the next batch out. No I/O.

No threads, no torch, no real clock: the engine core calls it and tests call it with fake times and
fixed coefficients (tests/test_batching.py). The queue holds requests in arrival order; each has an
``owner`` (its connection). The engine core keeps it as a ``Waiting`` (each connection's requests,
updated as requests come and go), so that choosing a batch reads about the batch and the
connections, not the whole queue; a ``deque`` works too. The rules:

- **Expired first.** Requests whose deadline has passed are removed and reported, never batched.
- **The cost model** (``costmodel.Coefficients``, fitted by the engine core from the batches it ran): a batch of
  ``rows`` requests that occupies ``padded`` tokens (its ``footprint``: rows x widest row, padding
  included) and whose answers take ``out`` bytes costs
  ``overhead + token·padded + row·rows + byte·out`` seconds of engine time (forward pass and decode).
  A request's *own* work is what it adds to a batch without padding: ``token·n_tokens + row + byte·out``;
  what a batch takes beyond its requests' own work is per-batch overhead and padding.
- **Cost for fairness.** A request costs its owner what it asks of the engine: its own work at the
  cost model's current prices (its tokens, its row and its answer's bytes). The row counts: where a
  row costs as much as dozens of tokens (a small encoder), pricing tokens alone made a 60-token
  request look six times a 10-token one. What each connection was served is kept as tokens, rows
  and bytes and priced when compared, so a new fit reprices everyone's history alike (priced once
  when queued, a server's first requests, priced by a fit still far off, weighed thousands of times
  later ones, and their connections waited a second).
- **Fair by cost, within a tolerance.** Each connection's *share* is the cost it has been served
  lately: every request adds its own work, and what was served fades over about ``fair_horizon`` requests
  a waiting connection (by the requests served since the last fade: once a round, before its window
  is taken, so the order of a round's batches does not matter; with a fixed band, once a batch). The
  *fair order* gives each next place to the oldest request among the *eligible* connections: those
  whose share is at most ``1 + fair_tolerance`` times the least share among the connections waiting
  (counting the places they already got in this order). So no connection is offered a place while it
  has been served more than that over a connection still waiting (past the one request that crossed
  the line), and connections served alike run in arrival order. Strict fair queuing (tolerance 0)
  reorders alike clients by every small difference in what their requests cost: whoever falls behind
  misses a round, which raised the closed loop's p99 on mixed lengths by far. A connection that has used
  little lately (one that comes and goes) runs ahead of a backlog every time. A *newcomer* (no share
  kept: new, or forgotten when it closed) is given one when first seen, as much as the least-served
  connection waiting had: no credit for being new and no debt, so it runs within their band in
  arrival order, and a backlog runs ahead of it by at most the backlog's band. Reconnecting starts a
  connection afresh within the band, so a client that reconnects often takes more than the band's
  1 + ``fair_tolerance`` of the least-served connection's work, the more the more often it
  reconnects: several times as much when it reconnects every few dozen requests (README, "Cost model,
  tail bound and calibration", has a simulation's figures).
  The first request in fair order
  (the *head*) is always in the batch.
- **Rounds of neighbouring lengths** (``growth == 0``, the default). The cost model takes a *window*:
  the fair order's first ``max_batch_size`` requests, as long as their tokens fit
  ``max_batch_tokens`` and their own work (plus one overhead) the time limit below. It cuts the window,
  sorted by length, into batches of neighbouring lengths, where each cut saves more padding than the
  extra batch's overhead costs: the partition with the least predicted time in all (an exact dynamic
  program over the window's distinct lengths; no batch's longest row above ``AUTO_GROWTH`` x its
  shortest, none over the token budget). These batches are a *round*: they run back to back, in the
  fair order of their first requests (so the one holding the window's first request, the head,
  first), before anything else is taken. For equal requests a round is one full batch; on a machine
  where padding is dear and a batch cheap (a CPU) the lengths run apart, where a batch is dear (a
  GPU, a tiny model) they mix. Between a round's batches, requests that have left the queue
  (expired, withdrawn) drop out of it, and those whose connection has no answer room now go back to
  the fair order. A deadline the
  round would not keep by the rule a batch keeps (below: done within ``deadline_share`` of the time
  left; for a request outside the round at the round's predicted end, for one inside it at its own
  batch's) ends the round: the next window is formed at once, bounded by that deadline.
- **Packed rows** (``pack_width`` set: the model packs a batch's texts into shared rows, see
  ``layout``): a batch costs its ``footprint``, about its tokens whatever their lengths, so a round
  is its window whole: a cut would only add an overhead. The round's own bounds stay (the window's
  size, tokens and time limit); a window whose footprint is over ``max_batch_tokens`` (long texts
  that share no row) is cut as above.
- **One length a batch** (``one_length``: the model's answer for a text changes when it is padded,
  ``FillMaskModel.one_length``): the cut above puts each length in a batch of its own. A fixed band
  has no meaning there and is not used (``growth`` is 0 whatever was given): its tail bound would
  force requests of every length into one batch, which the engine would run as a pass per length,
  each with its overhead, at many times the batch's predicted time.
- **A fixed band** (``growth`` set, ``--max-length-ratio``: the user's choice wins). The batch takes,
  in fair order, each request that keeps its longest row at most ``growth`` x its shortest and keeps
  it within the limits below.
- **Limits.** At most ``max_batch_size`` requests and ``max_batch_tokens`` tokens, padding included
  (the ``footprint``, rows x the widest row: what the encoder's activations take). Either cap may be
  *automatic* (``auto_rows``, ``auto_tokens``; ``--max-batch-size 0``, ``--max-batch-tokens 0``): its
  default (64 rows, 8,192 tokens) times ``cap_scale``, how many default batches fit before the
  overhead falls to ``slack`` of a batch's time, between 1 and ``MAX_CAP_SCALE``, set once from the
  start-up calibration's fit, whose shapes vary rows and tokens apart (without a calibration,
  ``--calibration-s 0``, from the CPU prior, ``costmodel.Coefficients``' defaults). (Not from the online fit: a
  load of one shape, 64 short texts a batch, cannot tell the overhead from the row price, and a fit
  that put several times a batch's real overhead in it grew tiny's caps to the most on a CPU.) Where a batch
  is cheap beside its overhead (a GPU launching kernels) the caps grow; where a default batch already
  amortises it (a CPU) they stay. And a
  **predicted time** of at most ``max_batch_s``, by default the overhead
  divided by ``slack`` (a batch that long spends at most ``slack`` of its time on overhead, so cutting
  batches there costs at most that share of throughput; never below ``MIN_AUTO_BATCH_S``, nor below
  the predicted time of the fullest batch of plain requests as long as the longest waiting that
  ``max_batch_tokens`` admits (output within ``slack`` of it):
  the bound cuts output-heavy batches, never a batch of ordinary ones), and at
  most ``deadline_share`` of the time left to the tightest deadline waiting. So a light request that
  arrives while a heavy batch runs waits for at most one such bounded batch, never for one long batch
  of heavy output. (With the cost model the limit bounds a round's own work: a request that arrives
  while a round runs waits for that round's end, unless its deadline would pass first.) Output does
  not count against ``max_batch_tokens``: its time is the time bound's to bound, at the fitted byte
  price, and its memory the answer memory's. Counted there in token-equivalents, at the fitted ratio
  of the two prices, a model whose tokens cost almost nothing (ESM's small encoder) priced each
  request's output at thousands of tokens and ran batches of three.
- **Tail bound.** With the cost model, a request is served in the round its window takes it into:
  nothing that joins the queue after the window was taken runs before it (except when a deadline
  ends the round, above), and at most the window's other requests do; the cost model reorders
  requests only within a round. With a fixed band, a request *misses* a batch when the fair order
  offered it to that batch and it would have fitted the limits, but the band left it out. A request
  that has missed ``max_missed`` batches widens the band: it is in the next batch, whatever its
  length (at most ``max_batch_size`` of them, oldest first, within the token budget and the time
  bound: the first of them whatever its size; one left out is due for the batch after). Either way,
  what can hold a request longer are only the limits (a full batch, the time bound: capacity, shared
  fairly) and answer room (a connection that is not reading).
- **Room.** A request whose connection has no room left for answers (``Room``: answers unsent or
  being computed, per connection and in all) is not started; it keeps its place. A connection with
  no answer unsent or being computed always has room for one request, so nobody waits for room
  forever.
- **Waiting.** ``max_wait_s`` is one deadline per batch, counted from the arrival of the oldest
  queued request, never restarted by later arrivals. A request with a deadline is waited for at most
  ``deadline_share`` of its time (from its arrival to its deadline), and never so long that the batch
  formed now could not be done within ``deadline_share`` of the time then left (the rule a batch
  keeps, above): a wait that ended at the deadline itself left it expired before its batch could start.
  With ``max_wait_s == 0`` (the default) a batch starts as soon as the engine is free, whatever its
  size, with one exception:
- **Anticipation.** Answers just sent bring requests back: a client that keeps a few requests in
  flight sends its next one as soon as an answer arrives. So once a batch's forward pass is done
  (``answered``), while fewer requests are queued than a full batch and some of those answers have not
  yet been followed by an arrival (``arrived``), the next batch waits for them, until
  ``anticipate_share`` of the last batch's time (``batch_ran``) or ``anticipate_s``, whichever is
  shorter, has passed since the hand-over. An idle engine (nothing answered lately) never waits.

State: per connection, its share (``take`` adds to it and fades it; ``forget`` drops a closed
connection's); the current round's later batches; each queued request's
``missed`` count (``take`` updates it, with a fixed band); the anticipation counters above.
``wait_s`` only reads; it never waits while a round has batches left.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from .costmodel import Coefficients

TIE = 1e-9  # efficiencies this close are equal (floating-point rounding must not split equal requests)
MIN_AUTO_BATCH_S = 0.005  # the automatic time bound is never below this (a fit may put the overhead near 0)
DEFAULT_BATCH_ROWS = 64  # --max-batch-size's default, and the automatic caps' shape (below)
DEFAULT_BATCH_TOKENS = 8192  # --max-batch-tokens' default
MAX_CAP_SCALE = 8  # automatic caps grow to at most this many times the defaults (the activations' memory)
AUTO_GROWTH = 3.0  # the widest band the cost model may choose (longest ÷ shortest row) when none is set
FORGOTTEN = 1e-6  # rows: recent service below this is forgotten (as if new) when rescaling
RESCALE = 1e100  # the scale at which recent service is renormalised
ZERO = (0.0, 0.0, 0.0)  # served nothing: tokens, rows, answer bytes
MAX_FADE = 50.0  # e-folds: a fade past this forgets all the same (and exp() stays finite)
REACH = 2  # with a fixed band, the fair order is followed this many full batches deep


class Queued(Protocol):
    """What the policy reads (and, for ``missed``, writes) of a queued request."""

    arrival: float
    deadline: float | None
    n_tokens: int
    result_bytes: int  # room its answer may take (an upper bound)
    owner: object
    missed: int  # batches the fixed band left it out of (the tail bound; the cost model's rounds leave none out)


J = TypeVar("J", bound=Queued)


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
    ``per_owner`` and ``total``. An owner with nothing used fits any one request, even past ``total``:
    so one client that reads slowly never holds up the others, and the memory held stays within
    ``total`` plus one answer per owner (protocol.md §12)."""

    per_owner: int
    total: int
    used: dict[Any, int] = field(default_factory=dict)
    used_total: int = 0

    def fits(self, owner: Any, size: int) -> bool:
        used = self.used.get(owner, 0)
        return used == 0 or (used + size <= self.per_owner and self.used_total + size <= self.total)

    def take(self, owner: Any, size: int) -> None:
        self.used[owner] = self.used.get(owner, 0) + size
        self.used_total += size

    def copy(self) -> Room:
        return Room(self.per_owner, self.total, dict(self.used), self.used_total)


class Waiting(Generic[J]):
    """The queue as the policy reads it: the requests in queue order, each connection's in order, their
    lengths and deadlines, kept up to date as requests join and leave, so that choosing a batch costs
    about its own size and the connections', not the queue's length.

    ``take`` accepts a ``Waiting`` as its queue: the engine core keeps one beside its queue (``add`` as a
    request joins, ``discard`` as it leaves). A ``deque`` works too (the tests, simulations): ``take``
    builds a ``Waiting`` of it each time and writes the result back. Invariant: ``place`` grows in
    queue order; a connection is in ``by_owner`` while it has a request here.
    """

    __slots__ = ("_by_owner", "_deadlined", "_jobs", "_lengths", "_next")

    def __init__(self, jobs: Iterable[J] = ()) -> None:
        self._jobs: dict[int, tuple[int, J]] = {}  # id(job) -> (its place, it), in queue order
        self._by_owner: dict[Any, dict[int, J]] = {}  # owner -> its requests (by id), in queue order
        self._lengths: dict[int, int] = {}  # n_tokens -> how many requests here have it
        self._deadlined: dict[int, J] = {}  # the requests with a deadline
        self._next = 0
        for job in jobs:
            self.add(job)

    def add(self, job: J) -> None:
        """``job`` joins the end of the queue."""
        key = id(job)
        self._jobs[key] = (self._next, job)
        self._next += 1
        owned = self._by_owner.get(job.owner)
        if owned is None:
            self._by_owner[job.owner] = {key: job}
        else:
            owned[key] = job
        n = job.n_tokens
        self._lengths[n] = self._lengths.get(n, 0) + 1
        if job.deadline is not None:
            self._deadlined[key] = job

    def discard(self, job: J) -> None:
        """``job`` leaves the queue (nothing happens if it is not in it)."""
        key = id(job)
        if self._jobs.pop(key, None) is None:
            return
        owned = self._by_owner[job.owner]
        del owned[key]
        if not owned:
            del self._by_owner[job.owner]
        n = job.n_tokens
        left = self._lengths[n] - 1
        if left:
            self._lengths[n] = left
        else:
            del self._lengths[n]
        if job.deadline is not None:
            del self._deadlined[key]

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job: object) -> bool:
        return id(job) in self._jobs

    def __iter__(self) -> Iterator[J]:
        return (job for _, job in self._jobs.values())

    def place(self, job: J) -> int:
        """Where ``job`` stands in the queue (only the order of places means anything)."""
        return self._jobs[id(job)][0]

    def first(self) -> J:
        """The oldest request (the queue must not be empty)."""
        return next(iter(self._jobs.values()))[1]

    def owners(self) -> list[Any]:
        """The connections waiting, the one with the oldest request first."""
        by_owner, jobs = self._by_owner, self._jobs
        return sorted(by_owner, key=lambda owner: jobs[next(iter(by_owner[owner]))][0])

    def by_owner(self) -> dict[Any, dict[int, J]]:
        """Each waiting connection's requests in queue order (read only)."""
        return self._by_owner

    def longest(self) -> int:
        return max(self._lengths, default=0)

    def deadlined(self) -> Iterable[J]:
        """The requests with a deadline (in no particular order)."""
        return self._deadlined.values()

    def earliest_deadline(self) -> float | None:
        return min((job.deadline for job in self._deadlined.values()), default=None)  # type: ignore[type-var]

    def expired(self, now: float) -> list[J]:
        """The requests whose deadline is at or before ``now``, in queue order."""
        expired = [job for job in self._deadlined.values() if job.deadline is not None and job.deadline <= now]
        return sorted(expired, key=self.place) if len(expired) > 1 else expired


def cap_scale(cost: Coefficients, slack: float, max_batch_s: float = 0.0) -> float:
    """How many times the default batch (``DEFAULT_BATCH_ROWS`` rows, ``DEFAULT_BATCH_TOKENS`` tokens)
    a batch may hold before the per-batch overhead falls to ``slack`` of its time (or, with a time
    bound set, ``max_batch_s``, before it reaches that bound): at least 1, at most ``MAX_CAP_SCALE``.
    Where a batch is cheap beside its overhead (a GPU launching kernels), the caps grow; where the
    default batch already amortises it (a CPU), they stay."""
    work = cost.token_s * DEFAULT_BATCH_TOKENS + cost.row_s * DEFAULT_BATCH_ROWS
    room = (max_batch_s or cost.overhead_s / slack) - cost.overhead_s
    if work <= 0:
        return float(MAX_CAP_SCALE)
    return min(float(MAX_CAP_SCALE), max(1.0, room / work))


def _waiting(queue: Waiting[J] | Iterable[J]) -> Waiting[J]:
    return queue if isinstance(queue, Waiting) else Waiting(queue)


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
    fair_tolerance: float = 0.5  # a connection is eligible while served at most 1 + this x the least
    fair_horizon: int = 32  # requests a connection over which what it was served fades (see the docstring)
    pack_width: int = 0  # the model packs texts into rows of up to this many tokens (``layout``); 0: it pads
    one_length: bool = False  # padding changes the model's answers: one length a batch (see the module doc)
    auto_rows: bool = False  # ``max_batch_size`` is set by ``follow_cost`` (``cap_scale``); its value is the floor
    auto_tokens: bool = False  # the same for ``max_batch_tokens``
    # Keyed by the owner object itself, never id(): an id is reused once its object is gone.
    # owner -> [tokens, rows, answer bytes] served lately, times _fade_scale (priced when compared: _price)
    _recent: dict[Any, list[float]] = field(default_factory=dict, init=False, repr=False)
    _fade_scale: float = field(default=1.0, init=False, repr=False)
    _unfaded: int = field(default=0, init=False, repr=False)  # requests served since the last fade
    _returning: int = field(default=0, init=False, repr=False)  # answers sent, not yet followed by an arrival
    _anticipate_until: float = field(default=float("-inf"), init=False, repr=False)
    _last_batch_s: float = field(default=0.0, init=False, repr=False)
    _plan: list[list[Any]] = field(default_factory=list, init=False, repr=False)  # the round's later batches
    _floor: tuple[int, int] = field(default=(0, 0), init=False, repr=False)  # the caps as given (automatic: floors)

    def __post_init__(self) -> None:
        if (self.max_batch_size < 1 or self.max_batch_tokens < 1 or self.max_wait_s < 0
                or not (self.growth == 0 or self.growth >= 1)
                or self.anticipate_s < 0 or not 0 <= self.anticipate_share <= 1 or self.max_batch_s < 0
                or self.max_missed < 0 or not 0 <= self.fair_tolerance < math.inf or self.fair_horizon < 1
                or not 0 < self.slack < 1 or not 0 < self.deadline_share <= 1 or self.pack_width < 0):
            raise ValueError("batch limits must be positive")
        self._floor = (self.max_batch_size, self.max_batch_tokens)
        if self.one_length:
            self.growth = 0.0  # (rounds of one length: see the module doc)

    def follow_cost(self, cost: Coefficients) -> None:
        """Set the automatic caps (``auto_rows``, ``auto_tokens``) from ``cost``: each floor times
        ``cap_scale``. The server calls it once, with the start-up calibration's fit, or the CPU prior
        without one (see the module doc)."""
        if self.auto_rows or self.auto_tokens:
            scale = cap_scale(cost, self.slack, self.max_batch_s)
            rows, tokens = self._floor
            if self.auto_rows:
                self.max_batch_size = max(rows, int(rows * scale))
            if self.auto_tokens:
                self.max_batch_tokens = max(tokens, int(tokens * scale))

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
        self._recent.pop(owner, None)
        self._plan = [kept for group in self._plan if (kept := [job for job in group if job.owner is not owner])]

    def untaken(self, jobs: Iterable[J]) -> None:
        """``jobs``, of the batch ``take`` returned last, will not run (withdrawn before it started: a
        batch chosen ahead): take back what ``take`` charged their connections' shares for them, so a
        connection whose client cancelled is not served later for work it never got. (No ``take`` runs
        between that one and this call, so the fade's scale is the one they were charged at.)"""
        scale = self._fade_scale
        for job in jobs:
            self._unfaded = max(0, self._unfaded - 1)
            served = self._recent.get(job.owner)
            if served is not None:  # (a closed connection is forgotten already)
                served[0] = max(0.0, served[0] - job.n_tokens * scale)
                served[1] = max(0.0, served[1] - scale)
                served[2] = max(0.0, served[2] - job.result_bytes * scale)

    def in_round(self) -> bool:
        """A round has batches left to run (the cost model's; never with a fixed band)."""
        return bool(self._plan)

    def batch_ran(self, seconds: float) -> None:
        """The last batch took ``seconds`` on the model: what a wait for company is measured against."""
        self._last_batch_s = seconds

    def time_limit(self, queue: Waiting[J] | Iterable[J], now: float, cost: Coefficients | None = None) -> float:
        """The most predicted seconds a batch may take now (its first request is taken regardless)."""
        cost = cost or self.cost
        waiting = _waiting(queue)
        limit = self.max_batch_s
        if not limit:
            # The fullest batch of plain requests as long as the longest waiting that the token budget
            # admits is never cut: the bound is for output-heavy batches (so a fit that puts the
            # overhead near 0, on a slow or busy machine, cannot shrink every batch to one row), and
            # output, which the token budget does not count, gets no more time than such a batch.
            longest = waiting.longest()
            rows = min(self.max_batch_size, max(1, self.max_batch_tokens // max(1, longest)))
            plain = cost.batch_s(rows, rows * longest, 0.0) * (1 + self.slack)
            limit = max(MIN_AUTO_BATCH_S, cost.overhead_s / self.slack, plain)
        earliest = waiting.earliest_deadline()
        if earliest is not None:
            limit = min(limit, self.deadline_share * max(0.0, earliest - now))
        return limit

    def wait_s(self, queue: Waiting[J] | deque[J], now: float, cost: Coefficients | None = None) -> float:
        """Seconds to wait before forming the next batch; 0 means form it now.

        Waiting only makes sense when a batch could still grow (the batch the cost model would form now
        holds every queued request and fewer than a full batch) and there is something to wait for: the
        oldest request is younger than ``max_wait_s``, or answers just sent are expected to bring
        requests back (anticipation, see the module doc).
        """
        anticipating = self._returning > 0 and now < self._anticipate_until
        if not queue or (self.max_wait_s == 0 and not anticipating):
            return 0.0
        waiting = _waiting(queue)
        if len(waiting) >= self.max_batch_size or self._planned(waiting, None):
            return 0.0  # a full batch is already there, or the rest of a round
        cost = cost or self.cost
        formed = (self._pick(waiting, now, None, cost, [])[0] if self.growth
                  else self._window(waiting, self.time_limit(waiting, now, cost), None, cost))
        if len(formed) < len(waiting):
            return 0.0
        wait_until = waiting.first().arrival + self.max_wait_s if self.max_wait_s else now
        if anticipating:
            wait_until = max(wait_until, self._anticipate_until)
        deadlines = [(job.arrival, job.deadline) for job in waiting.deadlined() if job.deadline is not None]
        if deadlines:  # never wait a request into its own deadline (the module doc)
            batch_s = _predicted(formed, cost, self.pack_width)
            wait_until = min(wait_until, *(min(arrival + self.deadline_share * (deadline - arrival),
                                                deadline - batch_s / self.deadline_share)
                                            for arrival, deadline in deadlines))
        return max(0.0, wait_until - now)

    def take(self, queue: Waiting[J] | deque[J], now: float, room: Room | None = None,
             cost: Coefficients | None = None) -> Decision[J]:
        """Remove the next batch from ``queue`` (after removing expired requests) and return it.

        ``queue`` is a ``Waiting`` (kept by its owner as requests come and go) or a ``deque``, read
        into one (and written back). ``room`` (optional) is the answer memory left; it is updated
        with what the batch reserves. ``cost`` (optional) is the cost model now; ``self.cost`` otherwise.
        """
        cost = cost or self.cost
        waiting = _waiting(queue)
        expired = waiting.expired(now)
        for job in expired:
            waiting.discard(job)
        decision: Decision[J] = Decision(expired=expired)
        planned = [] if self.growth else self._planned(waiting, room)
        if not planned:
            self._fade(len(waiting.by_owner()))  # once a round, before its window (with a fixed band, once a batch)
        self._welcome(waiting, cost)
        chosen, passed, plan = self._pick(waiting, now, room, cost, planned)
        if chosen:
            self._plan = plan
            for job in passed:
                job.missed += 1
            decision.batch = sorted(chosen, key=waiting.place)  # arrival order
            for job in decision.batch:
                waiting.discard(job)
        if not isinstance(queue, Waiting) and (expired or chosen):  # (a deque: written back)
            queue.clear()
            queue.extend(waiting)
        if not chosen:
            return decision  # (a round whose requests all lack answer room now keeps its plan)
        decision.padded_tokens = footprint([job.n_tokens for job in chosen], self.pack_width)
        decision.predicted_s = _predicted(chosen, cost, tokens=decision.padded_tokens)
        scale, recent = self._fade_scale, self._recent
        for job in decision.batch:
            served = recent[job.owner]  # (every waiting connection was welcomed)
            served[0] += job.n_tokens * scale
            served[1] += scale
            served[2] += job.result_bytes * scale
            if room is not None:
                room.take(job.owner, job.result_bytes)
        self._unfaded += len(chosen)
        return decision

    # --- the choice -------------------------------------------------------------------------------------

    def _fair_order(self, ready: Waiting[J] | list[J], room: Room | None, depth: int, cost: Coefficients) -> list[J]:
        """Up to ``depth`` requests in fair order (see the module doc), skipping connections without room.

        Invariant: the bar only rises during a pass (shares only grow, and a connection that leaves,
        with nothing left or no room, can only raise the least share), so a connection once eligible
        stays so until its own share passes the bar. (This runs before every new round, on the model
        thread and, choosing the next batch ahead, on the stages that hand it work: written for speed,
        one loop, no calls per place but the heaps'; and first ``_arrival_order``, the common case's
        shortcut.)
        """
        queue = _waiting(ready)
        share = self._shares(queue.by_owner(), cost)
        tolerance = 1 + self.fair_tolerance
        shortcut = _arrival_order(queue, room, depth, share, tolerance * min(share.values(), default=0.0), cost)
        if shortcut is not None:
            return shortcut
        place = queue.place
        by_owner = {owner: deque(owned.values()) for owner, owned in queue.by_owner().items()}  # (copies)
        room = room.copy() if room is not None else None
        token_s, row_s, byte_s = cost.token_s, cost.row_s, cost.byte_s  # (own_s, inlined)
        push, pop = heapq.heappush, heapq.heappop
        order: list[J] = []
        ties = itertools.count()
        lowest = [(share[owner], next(ties), owner) for owner in by_owner]  # lazy: stale entries skipped
        heapq.heapify(lowest)
        pending = list(lowest)  # not yet eligible, by share
        eligible: list[tuple[int, int, Any]] = []  # by the place of the connection's oldest request
        while by_owner and len(order) < depth:
            top = lowest[0]
            while top[2] not in by_owner or top[0] != share[top[2]]:
                pop(lowest)
                top = lowest[0]
            bar = tolerance * top[0]
            while pending and pending[0][0] <= bar:
                owner = pop(pending)[2]
                waiting = by_owner.get(owner)
                if waiting is not None:
                    push(eligible, (place(waiting[0]), next(ties), owner))
            owner = pop(eligible)[2]
            # Its oldest request takes the next place, room permitting.
            waiting = by_owner[owner]
            job = waiting.popleft()
            if room is not None:
                if not room.fits(owner, job.result_bytes):
                    del by_owner[owner]  # no room for this connection now: its requests keep their places
                    continue
                room.take(owner, job.result_bytes)
            order.append(job)
            served = share[owner] = share[owner] + (token_s * job.n_tokens + row_s + byte_s * job.result_bytes)
            if not waiting:
                del by_owner[owner]
                continue
            push(lowest, (served, next(ties), owner))
            if served <= bar:
                push(eligible, (place(waiting[0]), next(ties), owner))
            else:
                push(pending, (served, next(ties), owner))
        return order

    def _pick(self, waiting: Waiting[J], now: float, room: Room | None, cost: Coefficients,
              planned: list[list[J]]) -> tuple[list[J], list[J], list[list[J]]]:
        """The next batch's requests, the requests it passed over (the tail bound's misses) and, with
        the cost model, the rest of its round (the batches planned after it); ``planned`` is what is
        left of the current round (``_planned``; nothing with a fixed band)."""
        if not waiting:
            return [], [], []
        if not self.growth:
            if planned and not self._deadline_before_round_ends(waiting, planned, now, cost):
                return planned[0], [], planned[1:]
            groups = self._round(waiting, now, room, cost)
            return (groups[0], [], groups[1:]) if groups else ([], [], [])
        ready = list(waiting)
        limit = self.time_limit(waiting, now, cost)
        # The tail bound first: requests that have missed enough batches, oldest first, as room and the
        # limits allow (the first of them whatever its size, as any batch's first request).
        trial = room.copy() if room is not None else None
        forced: list[J] = []
        for job in ready:
            if job.missed >= self.max_missed and len(forced) < self.max_batch_size:
                if forced and not self._within_limits(forced, job, limit, cost):
                    continue
                if trial is not None:
                    if not trial.fits(job.owner, job.result_bytes):
                        continue
                    trial.take(job.owner, job.result_bytes)
                forced.append(job)
        in_base = {id(job) for job in forced}
        order = self._fair_order([job for job in ready if id(job) not in in_base], trial,
                                 REACH * self.max_batch_size, cost)
        if not order and not forced:
            return [], [], []
        leads = (bool(order) and len(forced) < self.max_batch_size
                 and (not forced or self._within_limits(forced, order[0], limit, cost)))
        base = ([order[0]] if leads else []) + forced  # the fair head leads (else it is offered with the rest)
        rest = order[1:] if base and order and base[0] is order[0] else order
        batch, passed = self._fill_band(base, rest, limit, cost)
        return batch, passed, []

    def _within_limits(self, group: list[J], job: J, limit: float, cost: Coefficients) -> bool:
        """Whether ``group`` with ``job`` keeps a batch's token budget (rows x the widest row) and time
        ``limit``, as ``_fill_band`` checks each request it adds."""
        rows, high = len(group) + 1, max([job.n_tokens, *(member.n_tokens for member in group)])
        return (rows * high <= self.max_batch_tokens
                and cost.batch_s(rows, rows * high, job.result_bytes + sum(m.result_bytes for m in group)) <= limit)

    def _welcome(self, waiting: Waiting[J], cost: Coefficients) -> None:
        """Keep a share for each waiting connection that has none (a newcomer: new, or forgotten when it
        closed), fixed when it is first seen: as much as the least-served connection waiting has been
        served (no credit for being new, and no debt: it runs within their band, in arrival order).
        The connections are ordered (oldest request first, which settles ties) only when one is new."""
        fresh = [owner for owner in waiting.by_owner() if owner not in self._recent]
        if fresh:
            least = self._least(waiting.owners(), cost)
            for owner in fresh:
                self._recent[owner] = list(least)

    def _least(self, owners: Iterable[Any], cost: Coefficients) -> list[float] | tuple[float, ...]:
        """What the least-served of ``owners`` that have a share kept was served (nothing if none has)."""
        kept = [self._recent[owner] for owner in owners if owner in self._recent]
        return min(kept, key=lambda served: self._price(served, cost), default=ZERO)

    def _shares(self, owners: Iterable[Any], cost: Coefficients) -> dict[Any, float]:
        """Each waiting connection's share (see the module doc): what it was served lately, priced now
        (so a new fit reprices everyone's history alike). A newcomer not yet welcomed (``wait_s`` reads
        before ``take`` welcomes) counts as ``_welcome`` would keep it."""
        owners = list(owners)
        least = self._price(self._least(owners, cost), cost)
        return {owner: self._price(self._recent[owner], cost) if owner in self._recent else least
                for owner in owners}

    def _price(self, served: list[float] | tuple[float, ...], cost: Coefficients) -> float:
        """Seconds of engine time for what was served (tokens, rows, answer bytes), faded."""
        return (cost.token_s * served[0] + cost.row_s * served[1] + cost.byte_s * served[2]) / self._fade_scale

    def _fade(self, waiting: int) -> None:
        """Age what every connection was served by the requests served since the last fade, over about
        ``fair_horizon`` requests for each of the ``waiting`` connections. Done once a round, before its
        window is taken, so the order of a round's batches does not matter. Stored scaled by ``_fade_scale``
        (which grows instead of every value fading), so this costs the same however many are open."""
        if not self._unfaded:
            return
        self._fade_scale *= math.exp(min(MAX_FADE, self._unfaded / (self.fair_horizon * max(1, waiting))))
        self._unfaded = 0
        if self._fade_scale > RESCALE:
            self._recent = {o: [x / self._fade_scale for x in v] for o, v in self._recent.items()
                            if v[1] / self._fade_scale >= FORGOTTEN}
            self._fade_scale = 1.0

    def _planned(self, ready: Waiting[J] | list[J], room: Room | None) -> list[list[J]]:
        """What is left of the current round: its batches, less the requests no longer queued (expired,
        withdrawn) and those whose connection has no room now (they go back to the fair order)."""
        if not self._plan:
            return []
        queued = _waiting(ready)
        trial = room.copy() if room is not None else None
        groups: list[list[J]] = []
        for group in self._plan:
            kept: list[J] = []
            for job in group:
                if job not in queued:
                    continue
                if trial is not None:
                    if not trial.fits(job.owner, job.result_bytes):
                        continue
                    trial.take(job.owner, job.result_bytes)
                kept.append(job)
            if kept:
                groups.append(kept)
        return groups

    def _deadline_before_round_ends(self, waiting: Waiting[J], planned: list[list[J]], now: float,
                                    cost: Coefficients) -> bool:
        """Whether the round keeps a deadline from the rule a batch keeps (done within ``deadline_share``
        of the time left): for a request outside the round, the round's predicted rest; for one inside
        it, the predicted end of its own batch. When it does not, the round is given up and a new window
        formed, bounded by the tightest deadline (the time limit)."""
        inside = {id(job) for group in planned for job in group}
        outside = [job.deadline for job in waiting.deadlined() if job.deadline is not None and id(job) not in inside]
        if not outside and not any(job.deadline is not None for group in planned for job in group):
            return False
        end = 0.0
        for group in planned:
            end += _predicted(group, cost, self.pack_width)
            if any(job.deadline is not None and self.deadline_share * (job.deadline - now) < end for job in group):
                return True
        return bool(outside) and self.deadline_share * (min(outside) - now) < end

    def _window(self, ready: Waiting[J], limit: float, room: Room | None, cost: Coefficients) -> list[J]:
        """The next round's requests: the fair order's first ``max_batch_size``, as long as their tokens
        fit ``max_batch_tokens`` and their own work (plus one overhead) ``limit``, the time
        limit. The first is always in."""
        window: list[J] = []
        tokens, seconds = 0.0, cost.overhead_s
        token_s, row_s, byte_s = cost.token_s, cost.row_s, cost.byte_s  # (own_s, inlined)
        for job in self._fair_order(ready, room, self.max_batch_size, cost):  # (it works on a copy of the room)
            more_tokens = tokens + job.n_tokens
            more_seconds = seconds + (token_s * job.n_tokens + row_s + byte_s * job.result_bytes)
            if window and (more_tokens > self.max_batch_tokens or more_seconds > limit):
                break
            window.append(job)
            tokens, seconds = more_tokens, more_seconds
        return window

    def _round(self, ready: Waiting[J] | list[J], now: float, room: Room | None,
               cost: Coefficients) -> list[list[J]]:
        """The window cut into batches of neighbouring lengths at the least predicted time in all (see
        the module doc), in the fair order of their first requests (the head's batch first)."""
        waiting = _waiting(ready)
        limit = self.time_limit(waiting, now, cost)
        window = self._window(waiting, limit, room, cost)
        if not window:
            return []
        groups = self._cut(window, cost)
        if len(window) > 1 and sum(_predicted(group, cost, self.pack_width) for group in groups) > limit:
            # The cuts' overheads and padding took the round over the time limit: the longest prefix of
            # the window (in fair order) whose round keeps within it (a round's time only grows with
            # its requests), and at least the head.
            low, high = 1, len(window) - 1
            best = self._cut(window[:1], cost)
            while low <= high:
                middle = (low + high) // 2
                trial = self._cut(window[:middle], cost)
                if sum(_predicted(group, cost, self.pack_width) for group in trial) <= limit:
                    best, low = trial, middle + 1
                else:
                    high = middle - 1
            groups = best
        return groups

    def _cut(self, window: list[J], cost: Coefficients) -> list[list[J]]:
        """``window`` cut by the dynamic program (see ``_round``), the head's batch first; each batch in
        window order, the batches by their first request's place in it. A model that packs its rows
        takes the window whole: there a batch costs its tokens, not its longest row, and a cut would
        only add an overhead."""
        if self.pack_width and footprint([job.n_tokens for job in window], self.pack_width) <= self.max_batch_tokens:
            return [list(window)]  # (past the budget, the cut below keeps every batch within it)
        classes: dict[int, list[J]] = {}
        for job in window:
            members = classes.get(job.n_tokens)
            if members is None:
                members = classes[job.n_tokens] = []
            members.append(job)
        lengths = sorted(classes)
        # Per length class: rows, bytes of output.
        rows = [len(classes[n]) for n in lengths]
        out = [float(sum(job.result_bytes for job in classes[n])) for n in lengths]
        m = len(lengths)
        best = [0.0] + [float("inf")] * m  # best[j]: least time for the classes before j
        cut = [0] * (m + 1)
        budget = self.max_batch_tokens
        for j in range(1, m + 1):
            longest = lengths[j - 1]
            bar = best[j]
            count, out_bytes = 0, 0.0
            for i in range(j - 1, -1, -1):  # the batch of classes i .. j-1, longest lengths[j - 1]
                count, out_bytes = count + rows[i], out_bytes + out[i]
                if i < j - 1 and (self.one_length or longest > AUTO_GROWTH * lengths[i] or count * longest > budget):
                    break
                total = best[i] + cost.batch_s(count, count * longest, out_bytes)
                if total < bar * (1 - TIE):
                    bar, cut[j] = total, i
            best[j] = bar
        batch_of: dict[int, int] = {}  # length -> its batch
        j, batches = m, 0
        while j > 0:
            i = cut[j]
            for n in lengths[i:j]:
                batch_of[n] = batches
            batches, j = batches + 1, i
        groups: list[list[J]] = [[] for _ in range(batches)]
        first = [0] * batches  # each batch's first place in the window
        for place, job in enumerate(window):  # in window order, so each batch keeps it
            batch = batch_of[job.n_tokens]
            if not groups[batch]:
                first[batch] = place
            groups[batch].append(job)
        return [groups[b] for b in sorted(range(batches), key=first.__getitem__)]

    def _fill_band(self, base: list[J], rest: list[J], limit: float,
                   cost: Coefficients) -> tuple[list[J], list[J]]:
        """``base``, then each request of ``rest`` (in fair order) within the fixed band and the limits;
        and the requests the band passed over."""
        batch = list(base)
        passed: list[J] = []
        shortest = base_low = min(job.n_tokens for job in base)
        longest = base_high = max(job.n_tokens for job in base)
        out_bytes = float(sum(job.result_bytes for job in base))
        for job in rest:
            if len(batch) >= self.max_batch_size:
                break
            n = job.n_tokens
            low, high = min(shortest, n), max(longest, n)
            rows = len(batch) + 1
            if (rows * high > self.max_batch_tokens
                    or cost.batch_s(rows, rows * high, out_bytes + job.result_bytes) > limit):
                continue
            if high > self.growth * low and not (base_low <= low and high <= base_high):
                passed.append(job)  # outside the band (a forced request may have widened it)
                continue
            batch.append(job)
            shortest, longest, out_bytes = low, high, out_bytes + job.result_bytes
        return batch, passed


def _arrival_order(queue: Waiting[J], room: Room | None, depth: int, share: dict[Any, float], bar: float,
                   cost: Coefficients) -> list[J] | None:
    """The fair order when it is the arrival order, or None when that is not sure.

    It is when every connection among the first ``depth`` requests stays eligible through the whole
    pass, its share plus all it gets in it at most ``bar`` (the least share's band at the start; the
    bar only rises), and every one of them fits ``room``: then the oldest request among the eligible
    is always the oldest of all. Checked on that prefix alone, with a margin for rounding: a
    connection whose requests all come after it gets no place either way.
    """
    token_s, row_s, byte_s = cost.token_s, cost.row_s, cost.byte_s
    bar *= 1 - 1e-9
    added: dict[Any, float] = {}
    order: list[J] = []
    room = room.copy() if room is not None else None
    for job in queue:
        if len(order) >= depth:
            break
        owner = job.owner
        more = added.get(owner, 0.0) + (token_s * job.n_tokens + row_s + byte_s * job.result_bytes)
        if share[owner] + more > bar:
            return None
        added[owner] = more
        if room is not None:
            if not room.fits(owner, job.result_bytes):
                return None
            room.take(owner, job.result_bytes)
        order.append(job)
    return order


def _predicted(group: list[Any], cost: Coefficients, pack_width: int = 0, tokens: int | None = None) -> float:
    """The cost model's time for one batch of ``group`` (its ``footprint``, or ``tokens`` when the
    caller has laid the batch out already)."""
    if tokens is None:
        tokens = footprint([job.n_tokens for job in group], pack_width)
    return cost.batch_s(len(group), tokens, sum(job.result_bytes for job in group))


def layout(lengths: Sequence[int], pack_width: int) -> list[list[int]] | None:
    """How a batch of texts of ``lengths`` tokens is laid out for the forward pass: None for one padded
    row per text, else rows of packed texts (each row a list of indices into ``lengths``).

    Texts are packed longest first, each into the first row it fits, in rows of at most ``pack_width``
    tokens or the longest text, whichever is more; they are packed only when that takes fewer tokens
    (rows x the widest row) than padding does, so a batch of equal lengths stays padded. Invariant:
    every index is in exactly one row, and each row holds at most ``max(pack_width, longest)`` tokens.
    """
    if not pack_width or len(lengths) < 2:
        return None
    longest = max(lengths)
    capacity = max(pack_width, longest)
    rows: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
        n = lengths[i]
        for r, filled in enumerate(used):
            if filled + n <= capacity:
                rows[r].append(i)
                used[r] = filled + n
                break
        else:
            rows.append([i])
            used.append(n)
    if len(rows) * max(used) >= len(lengths) * longest:
        return None
    return rows


def footprint(lengths: Sequence[int], pack_width: int = 0) -> int:
    """The tokens a batch of texts of ``lengths`` occupies in the forward pass, padding included: rows
    x the widest row of its ``layout``."""
    rows = layout(lengths, pack_width)
    if rows is None:
        return len(lengths) * max(lengths, default=0)
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)
