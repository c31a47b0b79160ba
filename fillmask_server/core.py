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
(``costmodel.CostModel``, fitted online from the batches that ran), the torch thread count for each batch
(``tuning.ThreadTuner``, when it is the engine's to choose) and, through ``batching.BatchPolicy``,
the batch choice; and with a tuner over layouts, the second look at the calibration's layout
(``layout.SecondLook``: the engine reports the CPU its other threads use, ``beside``). Tests drive it
with a fake clock (tests/test_core.py).

Invariants:

- A job's container is its state: ``self._jobs[state]`` holds exactly the live jobs in that state, in
  the order they entered it, and ``_move`` is the only place that changes a job's state (by
  ``jobs.advance``) and, in the same step, its container, the policy's view of the queue
  (``batching.Waiting``: the QUEUED jobs by connection, so that choosing a batch costs about the
  batch, not the queue; all of them but a batch chosen ahead), the owner's count of waiting requests
  and the answer-memory ledger. No second copy of the states is kept by hand.
- Whoever moves a job to DONE creates its outcome, so each accepted request gets exactly one: the
  core for what it ends (an answer, an expiry, a stop), the caller of ``withdraw`` and
  ``withdraw_waiting`` for a job it takes back (a ``cancelled`` or ``deadline_exceeded`` frame from
  the connection's session, an ``overloaded`` from a drain; a closed connection's, none: there is no
  one to answer).
- ``reserved`` bytes are taken when a job starts (moves to RUNNING) and given back only by ``release``
  (its answer has left the engine), whatever the job's end.

Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import intake
from .batching import BatchPolicy, Room, Waiting, footprint
from .costmodel import CostModel
from .jobs import Event, Expired, Failed, Job, Outcome, Rejected, State, Stopped, advance, can
from .layout import SecondLook
from .tuning import ThreadTuner, Verdict

WAITING = (State.TOKENIZING, State.QUEUED)  # a request in these states counts against the queue
STARTED = (State.RUNNING, State.DECODING)
AHEAD = (State.QUEUED, State.RUNNING)  # tokenized, and not yet through the model: what retry_after_ms prices
ENGINE_STOPPED_RETRY_MS = 1000
MAX_RETRY_AFTER_MS = 30_000  # the longest wait any retry_after_ms asks for (§6)
INTAKE_BATCH = 256  # most requests the tokenizer stage takes in one call
SERVER_FAILED = "the server failed while handling this request; other requests are unaffected; you may send it again"
MODEL_FAILED = "the model failed on this request, also when run alone; other requests are unaffected"
NOT_NUMBERS = ("the model's scores for this text are not numbers (NaN: its activations overflow on it, as in "
               "float16 on long texts, or its weights hold NaN); other requests are unaffected; a shorter text may "
               "be answered")


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
    unsent: Callable[[Any], int] = lambda owner: 0  # (an owner is the caller's: a session)
    unsent_total: Callable[[], int] = lambda: 0


# --- the core ----------------------------------------------------------------------------------------------


@dataclass
class Scheduled:
    """``schedule``'s answer: a batch to run now (maybe empty), outcomes to hand over, or a wait."""

    batch: list[Job] = field(default_factory=list)
    padded_tokens: int = 0
    predicted_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    wait_s: float = 0.0  # > 0: nothing was done; schedule again after this long (or on a wake-up)
    threads: int = 0  # the tuner's candidate for ``batch`` (a torch thread count or a layout's rank); 0: as they are


class EngineCore:
    """Admission, the job containers, the ledgers, the cost model and the batch choice (see the module doc)."""

    def __init__(self, policy: BatchPolicy, max_queue: int, memory: AnswerMemory | None = None,
                 cost: CostModel | None = None, threads: ThreadTuner | None = None,
                 second_look: SecondLook | None = None) -> None:
        if second_look is not None and threads is None:
            raise ValueError("a second look at the layout needs the tuner that switches layouts")
        self.policy = policy
        self.max_queue = max_queue
        self.memory = memory or AnswerMemory()
        self.cost = cost or CostModel()
        self.threads = threads  # None: the thread count is not the core's to choose
        self.second_look = second_look  # None: no second look (or none to take: no tuner over layouts)
        self.probe_ended: Verdict | None = None  # the probe the last ``update_from_output`` ended, if any
        self.accepting = True
        self._jobs: dict[State, dict[Job, None]] = {state: {} for state in State if state is not State.DONE}
        self._queue: Waiting[Job] = Waiting()  # the QUEUED jobs as the policy reads them (kept by ``_move``)
        self._waiting_by: dict[object, int] = {}  # owner -> its requests tokenizing or queued
        self._reserved: dict[object, int] = {}  # owner -> answer bytes reserved by its started requests
        self._reserved_total = 0
        self._intake_held = False  # the tokenizer stage holds the jobs it took (all TOKENIZING ones then)
        # The tokens and answer bytes of the AHEAD jobs (kept by ``_move``), and a request's of the last
        # batch, for what is still being tokenized: what ``retry_after_ms`` prices.
        self._ahead_tokens = 0
        self._ahead_bytes = 0
        self._last_request = (16.0, 0.0)
        self._seconds_per_row = 0.01  # the recent batches' time per row (a moving average): the other estimate

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
        at no loss: a full batch is queued, or a round has batches left (its next batch, of any size, is
        already cut: waiting would not make it larger), and no queued request has a deadline (a batch
        chosen ahead starts later than it was chosen, and the time bound counts from choosing)."""
        return ((len(self._queue) >= self.policy.max_batch_size or self.policy.in_round())
                and self._queue.earliest_deadline() is None)

    def has_intake(self) -> bool:
        """New requests wait for the tokenizer stage."""
        return not self._intake_held and bool(self._jobs[State.TOKENIZING])

    def reserved_total(self) -> int:
        return self._reserved_total

    def retry_after_ms(self) -> int:
        """Estimate of how long the requests waiting or running take to clear, for overload answers (429,
        503, 504), 10 to 30,000 ms: the lower of two estimates that each run high in their own case, or
        with ``--max-wait-ms`` that wait where it is longer (a batch that is not full waits for company
        up to that long, counted from its oldest request, which runs while earlier rows do).

        - The cost model's time for them as full batches run them: one overhead a batch of
          ``max_batch_size`` rows or ``max_batch_tokens`` tokens, and each request's tokens, row and
          answer bytes (one still being tokenized priced as a request of the last batch). High while
          the online fit puts what lone requests cost beyond its overhead into the token price.
        - Their rows at the recent batches' time per row (a moving average, of the batches that ran on
          their layout's threads: not a lone request that woke a quiet team). High after lone
          requests, each a batch of its own: alone it told clients to wait up to 30 s for a queue
          that cleared in about 2, and every call on their connections waits that out (§6)."""
        known = len(self._jobs[State.QUEUED]) + len(self._jobs[State.RUNNING])
        pending = known + len(self._jobs[State.TOKENIZING])
        if not pending:
            return 10
        tokens_each, bytes_each = self._last_request
        unknown = pending - known
        tokens = self._ahead_tokens + unknown * tokens_each
        out = self._ahead_bytes + unknown * bytes_each
        batches = max(-(-pending // self.policy.max_batch_size), -(-int(tokens) // self.policy.max_batch_tokens))
        c = self.cost.coefficients
        priced = batches * c.overhead_s + tokens * c.token_s + pending * c.row_s + out * c.byte_s
        seconds = max(min(priced, pending * self._seconds_per_row), self.policy.max_wait_s)
        return int(min(MAX_RETRY_AFTER_MS, max(10, seconds * 1000)))

    # --- calls ---------------------------------------------------------------------------------------

    def submit(self, job: Job) -> Admission:
        """Accept ``job`` for the tokenizer stage, or say why not (nothing is kept then).

        A fair share of the queue: while half of ``max_queue`` or more waits, a connection may hold
        at most ``max_queue`` divided by (the connections waiting, itself included, plus one), and one
        that already has requests waiting may not take the places the share of one more connection
        needs (``max_queue`` divided by those connections plus two). So the share of one more
        connection always stays free, even while connections that came earlier hold more than their
        shares have since become (each newcomer shrinks them, but takes nothing already accepted):
        connections that send as fast as they can never fill the queue that a newcomer needs.
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
            if mine and self.max_queue - waiting - 1 < max(1, self.max_queue // (owners + 2)):
                return Admission.QUEUE_SHARE  # the room kept for one more connection
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
                           seconds: float, now: float, passes: int = 1, threads: int = 0,
                           typical: bool = True) -> list[Outcome]:
        """The model ran ``batch`` in ``seconds`` (``passes`` forward passes: more after a split) at
        ``threads`` (``Scheduled.threads``: a torch thread count, or a layout's rank, see ``tuning.py``):
        ``forwarded`` indices go to the decode stage,
        ``failed`` ones are answered. Fits the cost model, with the batches of the thread count in use.
        ``typical`` False: the batch ran on other threads than that layout's (a lone request after a
        quiet spell, ``layout.QuietLone``), or woke the team that rule keeps asleep: its time says
        nothing to the tuner or the cost model (the tuner counts it, untimed, as it does a split
        batch, so that a probe under light load still ends)."""
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
        self.probe_ended = None
        if self.threads is not None and threads:  # an atypical batch counts for a probe, untimed
            predicted = self.cost.forward_s(len(batch), padded_tokens)
            ran = self.threads.ran(threads, seconds if whole and typical else 0.0, predicted, now, len(batch))
            in_use, self.probe_ended = ran.fit, ran.verdict
        if self.threads is not None and self.second_look is not None:
            look = self.second_look.ran(len(batch), seconds, now, self.threads.current)
            if look is not None:
                self.threads.adopt(look.chosen, now)
        if whole and in_use and typical:
            self.cost.observe_forward(len(batch), padded_tokens, seconds)
        self.policy.batch_ran(seconds)
        # Its answers leave as soon as they are decoded: count their clients as coming back from now,
        # before the next batch is chosen (at hand-over time it would already be running).
        self.policy.answered(len(batch), now)
        if batch:
            self._last_request = (sum(job.n_tokens for job in batch) / len(batch),
                                  sum(job.result_bytes for job in batch) / len(batch))
        if batch and typical:  # (a lone request that woke a quiet team says nothing of a queue's rows)
            self._seconds_per_row = 0.8 * self._seconds_per_row + 0.2 * (seconds / len(batch))
        return outcomes

    @property
    def measures_beside(self) -> bool:
        """Whether the second look still wants the CPU used beside the forward pass (``beside``)."""
        return self.second_look is not None and self.second_look.measuring

    def beside(self, cpu_s: float) -> None:
        """The event loop or a stage thread used ``cpu_s`` seconds of CPU since it last said so (the
        model thread and the parts' helpers never say: theirs is the forward pass)."""
        if self.second_look is not None:
            self.second_look.cpu(cpu_s)

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
        if (before in AHEAD) is not (job.state in AHEAD):
            sign = 1 if job.state in AHEAD else -1
            self._ahead_tokens += sign * job.n_tokens
            self._ahead_bytes += sign * job.result_bytes
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
