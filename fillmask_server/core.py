"""The engine core: every decision of the engine, without threads, torch or a clock of its own.

After vLLM v1's scheduler: calls go in, outcomes come out. The engine's thread loops (``engine.py``)
call, under their one lock:

    submit(job)            -> Admission                  (the event loop)
    take_intake()          -> jobs to tokenize           (tokenizer stage)
    checked(verdicts)      -> outcomes (refusals)        (tokenizer stage)
    schedule(now)          -> Scheduled                  (model thread: the next batch, or how long to wait)
    schedule(now, start=False), start(ahead, now)        (a stage chooses the next batch while the model
                           -> Scheduled                   runs one; the model thread starts it)
    update_from_output(..) -> outcomes (failures)        (model thread, after the forward pass)
    decoded(outcomes, ..)  -> outcomes to hand over      (decode stage)
    withdraw / release / forget / stop_all               (the event loop; a dying engine)

It holds admission and the queue's fair share, the answer-memory ledger, the prices, the cost model
(``CostModel``, fitted online from the batches that ran), the torch thread count for each batch
(``tuning.ThreadTuner``, when it is the engine's to choose) and, through ``batching.BatchPolicy``,
the batch choice. Tests drive it with a fake clock (tests/test_core.py).

Invariants:

- A job's container is its state: ``self._jobs[state]`` holds exactly the live jobs in that state, in
  the order they entered it, and ``_move`` is the only place that changes a job's state (by
  ``jobs.advance``) and, in the same step, its container, the policy's view of the queue
  (``batching.Waiting``: the QUEUED jobs by connection, so that choosing a batch costs about the
  batch, not the queue; all of them but a batch chosen ahead), the owner's count of waiting requests
  and the answer-memory ledger. No second copy of the states is kept by hand.
- Whoever moves a job to DONE creates its outcome, so each accepted request gets exactly one.
- ``reserved`` bytes are taken when a job starts (moves to RUNNING) and given back only by ``release``
  (its answer has left the engine), whatever the job's end.

Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from . import intake
from .batching import BatchPolicy, Coefficients, Room, Waiting, footprint
from .jobs import Event, Expired, Failed, Job, Outcome, Rejected, State, Stopped, advance, can
from .tuning import ThreadTuner

WAITING = (State.TOKENIZING, State.QUEUED)  # a request in these states counts against the queue
STARTED = (State.RUNNING, State.DECODING)
ENGINE_STOPPED_RETRY_MS = 1000
INTAKE_BATCH = 256  # most requests the tokenizer stage takes in one call
SERVER_FAILED = "the server failed while handling this request; other requests are unaffected; you may send it again"
MODEL_FAILED = "the model failed on this request, also when run alone; other requests are unaffected"


class Admission(enum.Enum):
    """What ``submit`` made of a request (protocol.md §3 order of the checks, §6)."""

    ACCEPTED = "accepted"
    QUEUE_FULL = "queue_full"  # max_queue requests wait for the model
    QUEUE_SHARE = "queue_share"  # the queue is under pressure and this connection holds its share of it
    STOPPED = "engine_stopped"


@dataclass(frozen=True)
class AnswerMemory:
    """The answer budgets (protocol.md §12): bytes of answers per connection and in all, counting the
    answers the shell holds unsent (``unsent``, ``unsent_total``, read from the stage threads: each a
    single integer the event loop writes) and those the engine computes (reserved when a request
    starts, for its ``result_bytes``, until ``release``)."""

    per_connection: int = 1 << 62
    total: int = 1 << 62
    unsent: Callable[[object], int] = lambda owner: 0
    unsent_total: Callable[[], int] = lambda: 0


# --- the cost model ------------------------------------------------------------------------------------


class CostModel:
    """The forward pass's time fitted online as ``overhead + token·padded + row·rows`` (weighted least
    squares on relative error, older batches forgotten by ``forget`` per batch, no coefficient below
    zero and the overhead not above the fastest recent batch, both within the fit; then the overhead and
    the token price raised to a share of the prior's where below it), and the decode stage's time per
    byte of answer bound as a moving average.

    ``prior`` (the start-up calibration's fit, or the CPU defaults) is kept as a few pseudo-batches of
    small weight that are never forgotten: the fit stays defined when the server runs one shape only,
    and shapes it has not run are predicted from the prior's slope.
    """

    PRIOR_SHAPES = ((1, 16), (8, 128), (32, 1024))
    PRIOR_WEIGHT = 0.001  # each prior pseudo-batch weighs this many real batches
    # The fitted per-batch overhead and per-token price never go below these shares of the prior's.
    # Timings of a slow or busy machine are noisy, and a fit of no overhead made every batch of mixed
    # lengths look less efficient than its rows run alone; a fit of no token price made every request's
    # output (priced in tokens: byte / token) too large for any batch but its own. Either way the
    # server ran batches of one row. (The token price's floor is low: a small model's real price is far
    # below the CPU prior's; a prior of next to no token price is floored itself, in ``__init__``.)
    OVERHEAD_FLOOR = 0.5
    TOKEN_FLOOR = 0.01
    # ... but the overhead never above the fastest recent batch, which wins over its floor (every
    # coefficient is nonnegative, so no batch takes less than the overhead): a prior timed while a
    # neighbour was busy (two replicas calibrating at once) would otherwise keep a floor far above what
    # any batch takes, for good. The fastest batch is forgotten slowly (its bound grows by 1 / ``forget``
    # per batch), so a machine that became slower is followed too.

    def __init__(self, prior: Coefficients | None = None, forget: float = 0.98) -> None:
        self.prior = prior or Coefficients()
        self.forget = forget
        self._s = [[0.0] * 3 for _ in range(3)]  # sum of w·x·xᵀ over observed batches
        self._r = [0.0] * 3  # sum of w·x·y
        self._yy = 0.0  # sum of w·y²
        self._prior_s = [[0.0] * 3 for _ in range(3)]
        self._prior_r = [0.0] * 3
        self._prior_yy = 0.0
        for rows, padded in self.PRIOR_SHAPES:
            seconds = self.prior.overhead_s + self.prior.token_s * padded + self.prior.row_s * rows
            _accumulate(self._prior_s, self._prior_r, (1.0, padded, rows), seconds, self.PRIOR_WEIGHT)
            self._prior_yy += self.PRIOR_WEIGHT * 1.0  # w·y² with w = weight / y²
        self.batches = 0
        # A prior of no token price (or next to none: a calibration's degenerate fit) gives way to
        # TOKEN_FLOOR of TOKEN_FLOOR of the CPU defaults' price, from the start, as a fit would.
        self._token_floor = self.TOKEN_FLOOR * max(self.prior.token_s, self.TOKEN_FLOOR * Coefficients.token_s)
        self.coefficients = replace(self.prior, token_s=max(self.prior.token_s, self._token_floor))
        self._fastest_s = float("inf")  # the fastest recent batch, slowly forgotten (above)
        self._case = (0, 0, 0)  # which coefficients the last fit held at a bound (``_bounded_least_squares``)

    def observe_forward(self, rows: int, padded_tokens: int, seconds: float) -> None:
        """One forward pass of ``rows`` rows and ``padded_tokens`` padded tokens took ``seconds``."""
        if seconds <= 0 or rows < 1:
            return
        for row in self._s:
            for j in range(3):
                row[j] *= self.forget
        self._r = [value * self.forget for value in self._r]
        self._yy *= self.forget
        _accumulate(self._s, self._r, (1.0, padded_tokens, rows), seconds, 1.0)
        self._yy += 1.0
        self.batches += 1
        self._fastest_s = min(seconds, self._fastest_s / self.forget)
        s = [[a + b for a, b in zip(x, y, strict=True)] for x, y in zip(self._s, self._prior_s, strict=True)]
        r = [a + b for a, b in zip(self._r, self._prior_r, strict=True)]
        # The fastest batch bounds the overhead within the fit (a fact about the timings: the token and
        # the row price then take up what the overhead does not explain; an overhead cut to it after
        # the fit left every other batch predicted that much too fast). The floors are policy, which
        # keeps batching worth its while in the model: they raise a coefficient after the fit.
        high = [self._fastest_s, math.inf, math.inf]
        theta, self._case = _bounded_least_squares(s, r, self._yy + self._prior_yy, [0.0] * 3, high, self._case)
        overhead = max(theta[0], min(self.OVERHEAD_FLOOR * self.prior.overhead_s, self._fastest_s))
        token = max(theta[1], self._token_floor)
        self.coefficients = Coefficients(overhead, token, theta[2], self.coefficients.byte_s)

    def observe_decode(self, result_bytes: int, seconds: float) -> None:
        """The decode stage turned answers bounded by ``result_bytes`` into JSON in ``seconds``."""
        if result_bytes > 0 and seconds >= 0:
            old = self.coefficients
            self.coefficients = Coefficients(old.overhead_s, old.token_s, old.row_s,
                                             0.9 * old.byte_s + 0.1 * seconds / result_bytes)

    def forward_s(self, rows: int, padded_tokens: int) -> float:
        c = self.coefficients
        return c.overhead_s + c.token_s * padded_tokens + c.row_s * rows


def fit(samples: Iterable[tuple[int, int, float]], byte_s: float = Coefficients.byte_s) -> Coefficients | None:
    """Least-squares coefficients (relative error, none below zero) of ``(rows, padded, seconds)``
    samples: the start-up calibration's first fit. None when the samples do not determine them."""
    s = [[0.0] * 3 for _ in range(3)]
    r = [0.0] * 3
    yy = 0.0
    count = 0
    for rows, padded, seconds in samples:
        if seconds > 0:
            _accumulate(s, r, (1.0, padded, rows), seconds, 1.0)
            yy += 1.0
            count += 1
    theta = _bounded_least_squares(s, r, yy, [0.0] * 3, [math.inf] * 3)[0] if count >= 3 else None
    return None if theta is None else Coefficients(theta[0], theta[1], theta[2], byte_s)


def _accumulate(s: list[list[float]], r: list[float], x: tuple[float, float, float], y: float,
                weight: float) -> None:
    """Add one sample, weighted by ``weight / y²`` (the fit minimises relative error)."""
    w = weight / (y * y)
    for i in range(3):
        r[i] += w * x[i] * y
        for j in range(3):
            s[i][j] += w * x[i] * x[j]


#: ``_bounded_least_squares``' cases, per coefficient 0 (free), 1 (at its low bound) or 2 (at its high
#: one), fewest held first: the usual answers (within the bounds; one coefficient at a bound) come first.
_CASES = sorted(itertools.product(range(3), repeat=3), key=lambda case: sum(choice != 0 for choice in case))


def _bounded_least_squares(s: list[list[float]], r: list[float], yy: float, low: list[float], high: list[float],
                           first: tuple[int, ...] = (0, 0, 0)) -> tuple[list[float], tuple[int, ...]]:
    """argmin over ``low`` ≤ θ ≤ ``high`` of θᵀSθ − 2θᵀr (+ yy), for S positive semidefinite (three
    coefficients; ``high`` may be infinite; ``low`` finite).

    Each case holds some coefficients at a bound and solves for the others, fewest held first. The
    objective is convex, so the first case whose solution lies within the bounds and whose held
    coefficients would not lower it by moving inward (the gradient's sign: the KKT conditions) is the
    answer: one solve when the unconstrained minimum lies within the bounds, a few of two unknowns when
    one coefficient is held (it runs per batch). ``first`` is tried before the others: the case of the
    last answer, which the next batch's fit mostly shares. Where S is singular no case may pass that
    check; then the case within the bounds of the lowest objective is the answer (every coefficient at
    its low bound is always one). Returns the answer and its case."""
    n = len(r)
    best: tuple[float, list[float], tuple[int, ...]] | None = None
    for case in (first, *(case for case in _CASES if case != first)):
        if any(choice == 2 and high[i] == math.inf for i, choice in enumerate(case)):
            continue
        theta = [0.0 if choice == 0 else low[i] if choice == 1 else high[i] for i, choice in enumerate(case)]
        free = [i for i in range(n) if case[i] == 0]
        if free:
            held = [i for i in range(n) if case[i] != 0]
            solved = _solve([[s[i][j] for j in free] for i in free],
                            [r[i] - sum(s[i][j] * theta[j] for j in held) for i in free])
            if solved is None or any(not low[i] <= value <= high[i] for i, value in zip(free, solved, strict=True)):
                continue
            for i, value in zip(free, solved, strict=True):
                theta[i] = value
        pulls = [[s[i][j] * theta[j] for j in range(n)] for i in range(n)]
        gradient = [sum(pulls[i]) - r[i] for i in range(n)]
        slack = [1e-9 * (abs(r[i]) + sum(abs(pull) for pull in pulls[i])) for i in range(n)]
        if all(choice == 0 or (gradient[i] >= -slack[i] if choice == 1 else gradient[i] <= slack[i])
               for i, choice in enumerate(case)):
            return theta, case
        error = yy - 2 * sum(t * v for t, v in zip(theta, r, strict=True)) + sum(
            theta[i] * pull for i in range(n) for pull in pulls[i])
        if best is None or error < best[0]:
            best = (error, theta, case)
    assert best is not None  # (every coefficient at its low bound is always within the bounds)
    return best[1], best[2]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when ``a`` is (nearly) singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    if scale == 0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(m[i][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for i in range(col + 1, n):
            factor = m[i][col] / m[col][col]
            for j in range(col, n + 1):
                m[i][j] -= factor * m[col][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


# --- the core ----------------------------------------------------------------------------------------------


@dataclass
class Scheduled:
    """``schedule``'s answer: a batch to run now (maybe empty), outcomes to hand over, or a wait."""

    batch: list[Job] = field(default_factory=list)
    padded_tokens: int = 0
    predicted_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    wait_s: float = 0.0  # > 0: nothing was done; schedule again after this long (or on a wake-up)
    threads: int = 0  # torch threads for ``batch`` (``tuning.ThreadTuner``); 0: as they are, or not yet decided


class EngineCore:
    """Admission, the job containers, the ledgers, the cost model and the batch choice (see the module doc)."""

    def __init__(self, policy: BatchPolicy, max_queue: int, memory: AnswerMemory | None = None,
                 cost: CostModel | None = None, threads: ThreadTuner | None = None) -> None:
        self.policy = policy
        self.max_queue = max_queue
        self.memory = memory or AnswerMemory()
        self.cost = cost or CostModel()
        self.threads = threads  # None: the thread count is not the core's to choose
        self.accepting = True
        self._jobs: dict[State, dict[Job, None]] = {state: {} for state in State if state is not State.DONE}
        self._queue: Waiting[Job] = Waiting()  # the QUEUED jobs as the policy reads them (kept by ``_move``)
        self._waiting_by: dict[object, int] = {}  # owner -> its requests tokenizing or queued
        self._reserved: dict[object, int] = {}  # owner -> answer bytes reserved by its started requests
        self._reserved_total = 0
        self._intake_held = False  # the tokenizer stage holds the jobs it took (all TOKENIZING ones then)
        self._seconds_per_row = 0.01  # moving estimate, for retry_after_ms

    # --- what the states hold -----------------------------------------------------------------------

    def waiting(self) -> int:
        """Requests waiting for the model: being tokenized or in its queue."""
        return len(self._jobs[State.TOKENIZING]) + len(self._jobs[State.QUEUED])

    def runnable(self) -> int:
        return len(self._jobs[State.QUEUED])

    def started(self) -> int:
        return len(self._jobs[State.RUNNING]) + len(self._jobs[State.DECODING])

    def busy(self) -> bool:
        return bool(self.waiting() or self.started())

    def batch_ready(self) -> bool:
        """Whether the next batch may be chosen now, before the model is free (``schedule(start=False)``),
        at no loss: a full batch is queued or a round has batches left (waiting would not make it
        larger), and no queued request has a deadline (a batch chosen ahead starts later than it was
        chosen, and the time bound counts from choosing)."""
        return ((len(self._queue) >= self.policy.max_batch_size or self.policy.in_round())
                and self._queue.earliest_deadline() is None)

    def has_intake(self) -> bool:
        """New requests wait for the tokenizer stage."""
        return not self._intake_held and bool(self._jobs[State.TOKENIZING])

    def reserved_total(self) -> int:
        return self._reserved_total

    def retry_after_ms(self) -> int:
        """Estimate of how long the current queue takes to clear, for 503/504 answers: its rows at the
        recent time per row, or with ``--max-wait-ms`` that wait where it is longer (a batch that is
        not full waits for company up to that long, counted from its oldest request, which runs while
        earlier rows do)."""
        pending = self.waiting() + len(self._jobs[State.RUNNING])
        seconds = max(pending * self._seconds_per_row, self.policy.max_wait_s if pending else 0.0)
        return int(min(30_000, max(10, seconds * 1000)))

    # --- calls ---------------------------------------------------------------------------------------

    def submit(self, job: Job) -> Admission:
        """Accept ``job`` for the tokenizer stage, or say why not (nothing is kept then).

        A fair share of the queue: while half of ``max_queue`` or more waits, a connection may hold
        at most ``max_queue`` divided by (the connections waiting, itself included, plus one): the share
        of one more connection always stays free, so connections that send as fast as they can never
        fill the queue that a newcomer needs, even one that had the queue to itself.
        """
        if not self.accepting:
            return Admission.STOPPED
        waiting = self.waiting()
        if waiting >= self.max_queue:
            return Admission.QUEUE_FULL
        mine = self._waiting_by.get(job.owner, 0)
        if waiting * 2 >= self.max_queue:
            owners = len(self._waiting_by) + (0 if mine else 1)
            if mine >= max(1, self.max_queue // (owners + 1)):
                return Admission.QUEUE_SHARE
        if job.state is not State.TOKENIZING:
            raise ValueError("a new job starts TOKENIZING")
        self._jobs[State.TOKENIZING][job] = None
        self._waiting_by[job.owner] = mine + 1
        return Admission.ACCEPTED

    def take_intake(self, limit: int = INTAKE_BATCH) -> list[Job]:
        """The oldest new requests, for the tokenizer stage, which holds them until ``checked``."""
        self._intake_held = True
        taken: list[Job] = []
        for job in self._jobs[State.TOKENIZING]:
            if len(taken) >= limit:
                break
            taken.append(job)
        return taken

    def checked(self, verdicts: list[tuple[Job, intake.Checked | intake.Refusal | None]]) -> list[Outcome]:
        """The tokenizer stage's verdicts (None: its checks failed): queue the runnable jobs, answer the
        others. Jobs withdrawn meanwhile are skipped."""
        self._intake_held = False
        answers: list[Outcome] = []
        queued = 0
        for job, verdict in verdicts:
            if job.state is not State.TOKENIZING:
                continue  # withdrawn while it was being tokenized
            if isinstance(verdict, intake.Checked):
                job.input_ids, job.masks, job.target_ids = verdict.input_ids, verdict.masks, verdict.target_ids
                job.target_notes = verdict.target_notes
                job.n_tokens = len(verdict.input_ids)
                job.result_bytes = verdict.result_bytes
                self._move(job, Event.CHECKED)
                queued += 1
            elif isinstance(verdict, intake.Refusal):
                self._move(job, Event.REJECTED)
                answers.append(Rejected(job, verdict.code, verdict.message))
            else:
                self._move(job, Event.FAILED)
                answers.append(Failed(job, SERVER_FAILED))
        self.policy.arrived(queued)
        return answers

    def schedule(self, now: float, start: bool = True) -> Scheduled:
        """The next batch (moved to RUNNING, its answer memory reserved) and the expired requests'
        answers; or, when the policy waits for company, only ``wait_s``.

        With ``start=False`` the batch is chosen *ahead*, for when the model is free: its requests
        leave the policy's queue but stay QUEUED (a cancel, a closed connection or a drain may still
        take them out) until ``start``, which also picks its thread count: a batch chosen while a
        thread-count probe's last batch runs would otherwise run at the probe's count after its end."""
        if not self._queue:
            return Scheduled()
        coefficients = self.cost.coefficients
        wait = self.policy.wait_s(self._queue, now, coefficients)
        if wait > 0:
            return Scheduled(wait_s=wait)
        decision = self.policy.take(self._queue, now, self._room(), coefficients)
        outcomes: list[Outcome] = []
        for job in decision.expired:
            self._move(job, Event.EXPIRED)
        if decision.expired:
            retry = self.retry_after_ms()
            outcomes = [Expired(job, (now - job.arrival) * 1000, retry) for job in decision.expired]
        if start:
            for job in decision.batch:
                self._move(job, Event.BATCHED)
        threads = self._threads_for(decision.batch, now) if start else 0
        return Scheduled(decision.batch, decision.padded_tokens, decision.predicted_s, outcomes, threads=threads)

    def start(self, ahead: Scheduled, now: float) -> Scheduled:
        """Start a batch chosen ahead (``schedule(start=False)``) at ``now``: its requests still QUEUED
        move to RUNNING; those that left meanwhile (withdrawn) drop out of it, and their connections'
        fair shares are no longer charged for them."""
        batch = [job for job in ahead.batch if job.state is State.QUEUED]
        if len(batch) < len(ahead.batch):
            self.policy.untaken(job for job in ahead.batch if job.state is not State.QUEUED)
        for job in batch:
            self._move(job, Event.BATCHED)
        threads = self._threads_for(batch, now)
        if len(batch) == len(ahead.batch):
            return Scheduled(batch, ahead.padded_tokens, ahead.predicted_s, threads=threads)
        padded = footprint([job.n_tokens for job in batch], self.policy.pack_width)
        predicted = self.cost.coefficients.batch_s(len(batch), padded, sum(job.result_bytes for job in batch))
        return Scheduled(batch, padded, predicted if batch else 0.0, threads=threads)

    def _threads_for(self, batch: list[Job], now: float) -> int:
        """The thread count for ``batch``, starting now (0: none to run, or not the core's to choose)."""
        return self.threads.count(now) if self.threads is not None and batch else 0

    def update_from_output(self, batch: list[Job], padded_tokens: int, forwarded: list[int], failed: list[int],
                           seconds: float, now: float, passes: int = 1, threads: int = 0) -> list[Outcome]:
        """The model ran ``batch`` in ``seconds`` (``passes`` forward passes: more after a split) at
        ``threads`` torch threads (``Scheduled.threads``): ``forwarded`` indices go to the decode stage,
        ``failed`` ones are answered. Fits the cost model, with the batches of the thread count in use."""
        outcomes: list[Outcome] = []
        # ``seconds`` is the forward pass alone: the time spent choosing the batch (``schedule``) is the
        # requests' queue time, not the batch's, and the cost model prices forward passes only, as the
        # start-up calibration times them.
        started = now - seconds
        for job in batch:
            job.started = started
        for i in failed:
            if can(batch[i], Event.FAILED):
                self._move(batch[i], Event.FAILED)
                outcomes.append(Failed(batch[i], MODEL_FAILED))
        for i in forwarded:
            if can(batch[i], Event.FORWARDED):
                self._move(batch[i], Event.FORWARDED)
        whole = passes == 1 and not failed  # one pass of the whole batch: its time says what a batch costs
        in_use = True  # ran at the thread count in use (not a probe's, not a warm-up after a change)
        if self.threads is not None and threads:
            predicted = self.cost.forward_s(len(batch), padded_tokens)
            in_use = self.threads.ran(threads, seconds if whole else 0.0, predicted, now).fit
        if whole and in_use:
            self.cost.observe_forward(len(batch), padded_tokens, seconds)
        self.policy.batch_ran(seconds)
        # Its answers leave as soon as they are decoded: count their clients as coming back from now,
        # before the next batch is chosen (at hand-over time it would already be running).
        self.policy.answered(len(batch), now)
        self._seconds_per_row = 0.8 * self._seconds_per_row + 0.2 * (seconds / len(batch))
        return outcomes

    def decoded(self, outcomes: list[Outcome], result_bytes: int = 0, seconds: float = 0.0) -> list[Outcome]:
        """The decode stage's outcomes (``Result`` or ``Failed``) for DECODING jobs: move them to DONE.
        ``result_bytes`` (their answers' bounds) took ``seconds`` to decode: the price of output."""
        final: list[Outcome] = []
        for outcome in outcomes:
            if can(outcome.job, Event.DECODED):  # not when a dying engine answered it meanwhile
                self._move(outcome.job, Event.FAILED if isinstance(outcome, Failed) else Event.DECODED)
                final.append(outcome)
        if result_bytes:
            self.cost.observe_decode(result_bytes, seconds)
        return final

    def withdraw(self, job: Job) -> bool:
        """Take ``job`` out if the model does not have it yet; True when this call did it."""
        if not can(job, Event.WITHDRAWN):
            return False
        self._move(job, Event.WITHDRAWN)
        return True

    def withdraw_waiting(self) -> list[Job]:
        """Withdraw every job not yet on the model, oldest first."""
        jobs = [*self._jobs[State.TOKENIZING], *self._jobs[State.QUEUED]]
        for job in jobs:
            self._move(job, Event.WITHDRAWN)
        return jobs

    def release(self, jobs: Iterable[Job]) -> bool:
        """The answers of ``jobs`` have left the engine: give back the answer memory they reserved.
        True when any was freed (a request waiting for room may start)."""
        freed = 0
        for job in jobs:
            if job.reserved:
                left = self._reserved.get(job.owner, 0) - job.reserved
                if left > 0:
                    self._reserved[job.owner] = left
                else:
                    self._reserved.pop(job.owner, None)
                freed += job.reserved
                job.reserved = 0
        self._reserved_total -= freed
        return freed > 0

    def forget(self, owner: object) -> None:
        """``owner``'s connection closed: the batching policy drops what it remembers of it."""
        self.policy.forget(owner)

    def stop_all(self) -> list[Outcome]:
        """The engine is dying: refuse new work and answer every job it holds, those not yet on the
        model ``Stopped`` (503 ``engine_stopped``), the others ``Failed``."""
        self.accepting = False
        self._intake_held = False
        started = [job for state in STARTED for job in self._jobs[state]]
        for job in started:
            self._move(job, Event.FAILED)
        outcomes: list[Outcome] = [Failed(job, SERVER_FAILED) for job in started]
        outcomes += [Stopped(job, "engine_stopped", ENGINE_STOPPED_RETRY_MS) for job in self.withdraw_waiting()]
        return outcomes

    # --- the one place a job moves ---------------------------------------------------------------------

    def _move(self, job: Job, event: Event) -> None:
        """``jobs.advance``, and with it the job's container, its owner's count of waiting requests (the
        queue's fair share) and, when it starts, its answer-memory reservation."""
        before = job.state
        advance(job, event)
        del self._jobs[before][job]
        if job.state is not State.DONE:
            self._jobs[job.state][job] = None
        if before is State.QUEUED:
            self._queue.discard(job)  # (``BatchPolicy.take`` already took out those it batched or expired)
        elif job.state is State.QUEUED:
            self._queue.add(job)
        if before in WAITING and job.state not in WAITING:
            left = self._waiting_by.get(job.owner, 0) - 1
            if left > 0:
                self._waiting_by[job.owner] = left
            else:
                self._waiting_by.pop(job.owner, None)
        if job.state is State.RUNNING:
            job.reserved = job.result_bytes
            self._reserved[job.owner] = self._reserved.get(job.owner, 0) + job.reserved
            self._reserved_total += job.reserved

    def _room(self) -> Room:
        """The answer memory left, for the owners with queued requests."""
        memory = self.memory
        owners = self._queue.by_owner()
        used = {owner: self._reserved.get(owner, 0) + memory.unsent(owner) for owner in owners}
        return Room(memory.per_connection, memory.total, used, self._reserved_total + memory.unsent_total())
