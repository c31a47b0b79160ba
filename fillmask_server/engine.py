"""The engine: the stages between the connections and the model, each run by one thread.

    submit ──> [tokenizing] ──tokenizer stage──> [queue] ──model thread──> [decoding] ──decode stage──> deliver

- **Tokenizer stage** (``fillmask-intake``): takes every newly accepted request, tokenizes them in one
  call (the fast tokenizer releases the GIL) and makes the §3 checks that need tokens; a request that
  fails one is answered (``Rejected``), the others join the model's queue. The queue therefore holds
  only requests that can run.
- **Model thread** (``fillmask-model``): asks the batching policy for the next batch and runs the
  forward pass (``FillMaskModel.forward``): tensors in, top-k tensors out. Nothing else: no
  tokenizing, no strings, no JSON. Faults are isolated here: a batch the model fails on is retried in
  halves while the failure is out of memory and item by item otherwise, so only requests that fail
  alone get ``internal_error``.
- **Decode stage** (``fillmask-decode``): turns top-k tensors into the pipeline's predictions and
  serializes them (``decode.py``), while the model thread already runs the next batch.

The event loop only calls the cheap methods ``submit``, ``withdraw``, ``withdraw_all``, ``release``
and the counters; finished work reaches it as typed ``Outcome``\\ s through ``deliver``, called on a
stage thread under the engine's lock (the server makes it thread-safe and non-blocking with
``call_soon_threadsafe``).

Invariants: every job state change is ``jobs.advance`` under ``self._lock``, guarded by ``jobs.can``
where another thread may have moved the job first; whoever moves a job to DONE creates its outcome,
so each accepted request gets exactly one (protocol.md §8). If a stage thread ends abnormally, ``_die``
marks the engine not ``alive`` (``/readyz`` answers 503, ``submit`` refuses) and answers every request
it held: those not yet on the model ``Stopped`` (503 ``engine_stopped``), the others ``Failed``.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import intake
from .batching import BatchPolicy, Room
from .decode import SequenceDecoder, predictions_json
from .jobs import Event, Expired, Failed, Job, Outcome, Rejected, Result, State, Stopped, advance, can
from .model import FillMaskModel, Item, TopK

log = logging.getLogger(__name__)

Deliver = Callable[[list[Outcome]], None]
# (batch id, batch size, padded tokens, each request's queue wait in s, the batch's time on the model in s)
BatchObserver = Callable[[int, int, int, list[float], float], None]

WAITING = (State.TOKENIZING, State.QUEUED)  # a request in these states counts against the queue
ENGINE_STOPPED_RETRY_MS = 1000
HAND_OVER_S = 0.002  # the decode stage hands results over at least this often while it works on a batch
ROOM_RECHECK_S = 0.02  # how often the model thread looks again when every queued request waits for answer room
INTAKE_BATCH = 256  # most requests the tokenizer stage takes in one call
DECODE_BACKLOG = 2  # the model thread runs at most this many batches ahead of the decode stage
_SERVER_FAILED = "the server failed while handling this request; other requests are unaffected; you may send it again"
_MODEL_FAILED = "the model failed on this request, also when run alone; other requests are unaffected"


@dataclass
class EngineStats:
    """Counters read by tests and logs; each written by one stage thread only (reads may lag)."""

    batches: int = 0
    rows: int = 0
    expired: int = 0
    failed: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    busy_s: float = 0.0


class Admission(enum.Enum):
    """What ``submit`` made of a request (protocol.md §3 order of the checks, §6)."""

    ACCEPTED = "accepted"
    QUEUE_FULL = "queue_full"  # max_queue requests wait for the model
    QUEUE_SHARE = "queue_share"  # the queue is under pressure and this connection holds its share of it
    STOPPED = "engine_stopped"


@dataclass(frozen=True)
class AnswerMemory:
    """The answer budgets (protocol.md §12): bytes of answers per connection and in all, counting the
    answers the shell holds unsent (``unsent``, ``unsent_total``, read from the model thread: each a
    single integer the event loop writes) and those the engine computes (reserved when a request
    starts, for its ``result_bytes``, until ``release``)."""

    per_connection: int = 1 << 62
    total: int = 1 << 62
    unsent: Callable[[object], int] = lambda owner: 0
    unsent_total: Callable[[], int] = lambda: 0


@dataclass
class _Forwarded:
    """One batch between the model thread and the decode stage."""

    jobs: list[Job]
    groups: list[tuple[list[int], TopK]]  # item indices of ``jobs`` and their top-k (one group unless split)
    batch_id: int
    padded_tokens: int
    inference_ms: float


class Engine:
    """The three stages and the queues between them (see the module docstring)."""

    def __init__(self, model: FillMaskModel, policy: BatchPolicy, max_queue: int, max_masks: int,
                 deliver: Deliver, clock: Callable[[], float] = time.monotonic,
                 on_batch: BatchObserver | None = None, max_result_bytes: int = 1 << 62,
                 memory: AnswerMemory | None = None) -> None:
        self.model = model
        self.policy = policy
        self.max_queue = max_queue
        self.max_masks = max_masks
        self.max_result_bytes = max_result_bytes
        self.memory = memory or AnswerMemory()
        self.stats = EngineStats()
        self.decoder = SequenceDecoder(model.decode_tokenizer)
        self._deliver = deliver
        self._on_batch = on_batch
        self._clock = clock
        self._lock = threading.Lock()
        self._intake_wake = threading.Condition(self._lock)
        self._model_wake = threading.Condition(self._lock)
        self._decode_wake = threading.Condition(self._lock)
        self._tokenizing: deque[Job] = deque()  # accepted, not yet taken by the tokenizer stage
        self._intake: list[Job] = []  # taken by the tokenizer stage, being tokenized
        self._queue: deque[Job] = deque()  # runnable, waiting for a batch
        self._running: list[Job] = []  # the batch on the model
        self._decoding: deque[_Forwarded] = deque()
        self._decoding_jobs = 0
        self._batch_ids = itertools.count(1)
        self._paused = False
        self._stopping = False
        self._seconds_per_row = 0.01  # moving estimate, for retry_after_ms
        self._waiting_by: dict[object, int] = {}  # owner -> its requests tokenizing or queued
        self._reserved: dict[object, int] = {}  # owner -> answer bytes reserved by its started requests
        self._reserved_total = 0
        # Moving estimates of the engine's prices: seconds per padded token of a forward pass, seconds per
        # byte of predictions decoded. Their ratio turns a request's output into token-equivalents.
        self._token_s = 2e-5
        self._byte_s = 2e-8
        self._threads = [threading.Thread(target=self._guarded, args=(body,), name=name, daemon=True)
                         for name, body in (("fillmask-intake", self._intake_loop),
                                            ("fillmask-model", self._model_loop),
                                            ("fillmask-decode", self._decode_loop))]
        self.alive = False
        self.started_at = clock()

    # --- called from the event loop (cheap, never blocks on the model) -------------------------

    def start(self) -> None:
        self.alive = True
        self.started_at = self._clock()
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> Admission:
        """Accept ``job`` for the tokenizer stage, or say why not (nothing is kept then).

        A fair share of the queue: while more than half of ``max_queue`` waits, a connection may hold
        at most ``max_queue`` divided by (the connections waiting, itself included, plus one): the share
        of one more connection always stays free, so connections that send as fast as they can never
        fill the queue that a newcomer needs, even one that had the queue to itself.
        """
        with self._lock:
            if not self.alive:
                return Admission.STOPPED
            waiting = self._waiting_locked()
            if waiting >= self.max_queue:
                return Admission.QUEUE_FULL
            mine = self._waiting_by.get(job.owner, 0)
            if waiting * 2 >= self.max_queue:
                owners = len(self._waiting_by) + (0 if mine else 1)
                if mine >= max(1, self.max_queue // (owners + 1)):
                    return Admission.QUEUE_SHARE
            self._waiting_by[job.owner] = mine + 1
            self._tokenizing.append(job)
            self._intake_wake.notify()
        return Admission.ACCEPTED

    def release(self, jobs: list[Job]) -> None:
        """The answers of ``jobs`` have left the engine (queued for their socket, or dropped): give back
        the answer memory they reserved when they started."""
        with self._lock:
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
            if freed:
                self._model_wake.notify()

    def forget(self, owner: object) -> None:
        """``owner``'s connection closed: the batching policy drops what it remembers of it."""
        with self._lock:
            self.policy.forget(owner)

    def withdraw(self, job: Job) -> bool:
        """Take ``job`` out if the model does not have it yet; True when this call did it (the caller
        answers it: cancelled, 504, ...)."""
        with self._lock:
            return self._withdraw_locked(job)

    def withdraw_all(self, reason: str, retry_after_ms: int) -> list[Stopped]:
        """Withdraw every job not yet on the model (the drain ran out of time): their ``Stopped`` answers."""
        with self._lock:
            jobs = [job for job in (*self._tokenizing, *self._intake, *self._queue) if self._withdraw_locked(job)]
        return [Stopped(job, reason, retry_after_ms) for job in jobs]

    def queued(self) -> int:
        """Requests waiting for the model: being tokenized or in its queue."""
        with self._lock:
            return self._waiting_locked()

    def runnable(self) -> int:
        """Requests tokenized and checked, in the model's queue."""
        with self._lock:
            return len(self._queue)

    def started(self) -> int:
        """Requests on the model or being decoded."""
        with self._lock:
            return len(self._running) + self._decoding_jobs

    def busy(self) -> bool:
        """True while any accepted request has no outcome yet."""
        with self._lock:
            return bool(self._waiting_locked() or self._running or self._decoding_jobs)

    def retry_after_ms(self) -> int:
        """Estimate of how long the current queue takes to clear, for 503/504 answers."""
        with self._lock:
            return self._retry_after_ms_locked()

    def _retry_after_ms_locked(self) -> int:
        waiting = self._waiting_locked() + len(self._running)
        return int(min(30_000, max(10, waiting * self._seconds_per_row * 1000)))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the model thread between batches (requests are still tokenized and queued); for tests
        and maintenance."""
        with self._lock:
            self._paused = True
        try:
            yield
        finally:
            with self._lock:
                self._paused = False
                self._model_wake.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the threads after their current work; jobs still waiting stay unanswered (drain first)."""
        with self._lock:
            self._stopping = True
            for wake in (self._intake_wake, self._model_wake, self._decode_wake):
                wake.notify_all()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout)
        self.alive = False

    def _move(self, job: Job, event: Event) -> None:
        """``jobs.advance``, keeping each connection's count of waiting requests (the queue's fair share)."""
        was_waiting = job.state in WAITING
        advance(job, event)
        if was_waiting and job.state not in WAITING:
            left = self._waiting_by.get(job.owner, 0) - 1
            if left > 0:
                self._waiting_by[job.owner] = left
            else:
                self._waiting_by.pop(job.owner, None)

    def _room_locked(self) -> Room:
        """The answer memory left, for the owners with queued requests."""
        memory = self.memory
        owners = {job.owner for job in self._queue}
        used = {owner: self._reserved.get(owner, 0) + memory.unsent(owner) for owner in owners}
        return Room(memory.per_connection, memory.total, used, self._reserved_total + memory.unsent_total())

    def _hand_over_locked(self, outcomes: list[Outcome]) -> None:
        """Give outcomes to ``deliver`` before the lock that made them final is released, so that once
        ``busy()`` is False every outcome has been handed over (``deliver`` must not block)."""
        if outcomes:
            self._deliver(outcomes)

    def _waiting_locked(self) -> int:
        return len(self._tokenizing) + len(self._intake) + len(self._queue)

    def _withdraw_locked(self, job: Job) -> bool:
        if not can(job, Event.WITHDRAWN):
            return False
        waiting_in = self._tokenizing if job.state is State.TOKENIZING else self._queue
        self._move(job, Event.WITHDRAWN)
        with contextlib.suppress(ValueError):  # a job the tokenizer stage holds is in neither deque
            waiting_in.remove(job)
        return True

    # --- the stage threads --------------------------------------------------------------------------

    def _guarded(self, body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as exc:
            self._die(exc)

    def _intake_loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._tokenizing:
                    self._intake_wake.wait()
                if self._stopping:
                    return
                count = min(len(self._tokenizing), INTAKE_BATCH)
                self._intake = [self._tokenizing.popleft() for _ in range(count)]
                fresh = list(self._intake)
            try:
                self._check_all(fresh)
            finally:
                with self._lock:
                    self._intake = []

    def _check_all(self, fresh: list[Job]) -> None:
        """Tokenize and check ``fresh``; queue the runnable ones, answer the others."""
        token_ids = intake.tokenize_all(self.model, [job.request.text for job in fresh])
        verdicts: list[intake.Checked | intake.Refusal | None] = []
        for job, ids in zip(fresh, token_ids, strict=True):
            try:
                verdicts.append(intake.check(self.model, job.request, ids, self.max_masks, self.max_result_bytes))
            except Exception:  # a fault in one request's checks fails that request only
                log.exception("checking a new request failed; answering it internal_error")
                verdicts.append(None)
        answers: list[Outcome] = []
        with self._lock:
            for job, verdict in zip(fresh, verdicts, strict=True):
                if job.state is not State.TOKENIZING:
                    continue  # withdrawn while it was being tokenized
                if isinstance(verdict, intake.Checked):
                    job.input_ids, job.masks, job.target_ids = verdict.input_ids, verdict.masks, verdict.target_ids
                    job.target_notes = verdict.target_notes
                    job.n_tokens = len(verdict.input_ids)
                    job.result_bytes = verdict.result_bytes
                    job.cost = job.n_tokens + verdict.result_bytes * (self._byte_s / self._token_s)
                    self._move(job, Event.CHECKED)
                    self._queue.append(job)
                elif isinstance(verdict, intake.Refusal):
                    self._move(job, Event.REJECTED)
                    answers.append(Rejected(job, verdict.code, verdict.message))
                else:
                    self._move(job, Event.FAILED)
                    answers.append(Failed(job, _SERVER_FAILED))
            self.policy.arrived(len(fresh) - len(answers))
            self._hand_over_locked(answers)
            self._model_wake.notify()

    def _model_loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and (self._paused or not self._queue
                                              or len(self._decoding) >= DECODE_BACKLOG):
                    self._model_wake.wait()
                if self._stopping:
                    return
                now = self._clock()
                wait = self.policy.wait_s(self._queue, now)
                if wait > 0:
                    self._model_wake.wait(wait)
                    continue
                decision = self.policy.take(self._queue, now, self._room_locked())
                for job in decision.expired:
                    self._move(job, Event.EXPIRED)
                for job in decision.batch:
                    self._move(job, Event.BATCHED)
                    job.started = now
                    job.reserved = job.result_bytes
                    self._reserved[job.owner] = self._reserved.get(job.owner, 0) + job.reserved
                    self._reserved_total += job.reserved
                self._running = decision.batch
                if decision.expired:
                    retry = self._retry_after_ms_locked()
                    self.stats.expired += len(decision.expired)
                    self._hand_over_locked([Expired(job, (now - job.arrival) * 1000, retry)
                                            for job in decision.expired])
            if decision.batch:
                self._run_batch(decision.batch, decision.padded_tokens, now)
            elif not decision.expired:
                with self._lock:  # every queued request waits for answer room: look again soon
                    self._model_wake.wait(ROOM_RECHECK_S)

    def _run_batch(self, batch: list[Job], padded_tokens: int, started: float) -> None:
        """One forward pass (split on failure); hand what succeeded to the decode stage."""
        items = [Item(job.input_ids, job.request.top_k, job.target_ids) for job in batch]
        groups, failed_items = self._forward_all(items, list(range(len(items))))
        elapsed = self._clock() - started
        failed: list[Outcome] = []
        with self._lock:
            for i in failed_items:
                if can(batch[i], Event.FAILED):
                    self._move(batch[i], Event.FAILED)
                    failed.append(Failed(batch[i], _MODEL_FAILED))
            for indices, _ in groups:
                for i in indices:
                    if can(batch[i], Event.FORWARDED):
                        self._move(batch[i], Event.FORWARDED)
                        self._decoding_jobs += 1
            batch_id = next(self._batch_ids)
            self._decoding.append(_Forwarded(batch, groups, batch_id, padded_tokens, elapsed * 1000))
            self._running = []
            self.policy.batch_ran(elapsed)
            # Its answers leave as soon as they are decoded: count their clients as coming back from now,
            # before the next batch is chosen (at hand-over time it would already be running).
            self.policy.answered(len(batch), self._clock())
            self._seconds_per_row = 0.8 * self._seconds_per_row + 0.2 * (elapsed / len(batch))
            self._token_s = 0.9 * self._token_s + 0.1 * (elapsed / max(1, padded_tokens))
            self._hand_over_locked(failed)
            self._decode_wake.notify()
        stats = self.stats
        stats.batches += 1
        stats.rows += len(batch)
        stats.failed += len(failed)
        stats.busy_s += elapsed
        stats.batch_sizes[len(batch)] = stats.batch_sizes.get(len(batch), 0) + 1
        if self._on_batch is not None:
            try:
                self._on_batch(batch_id, len(batch), padded_tokens, [started - job.arrival for job in batch], elapsed)
            except Exception:
                log.exception("recording batch metrics failed")

    def _forward_all(self, items: list[Item], indices: list[int]) -> tuple[list[tuple[list[int], TopK]], list[int]]:
        """Top-k for ``indices`` of ``items``: (groups that succeeded, indices that failed alone).

        Out of memory splits the batch in halves, recursively down to single items, so a batch too
        big for the device still gets through in smaller pieces; any other failure retries item by
        item, so one bad input fails only itself. Raises no ``Exception``.
        """
        try:
            return [(indices, self.model.forward([items[i] for i in indices]))], []
        except Exception as exc:
            if len(indices) == 1:
                if _out_of_memory(exc):
                    log.error("out of memory on a single request of %d tokens; answering it internal_error",
                              len(items[indices[0]].input_ids))
                else:
                    log.exception("the model failed on a request; answering it internal_error")
                return [], indices
            if _out_of_memory(exc):
                log.warning("out of memory on a batch of %d; retrying it in halves", len(indices))
                half = len(indices) // 2
                parts = [indices[:half], indices[half:]]
            else:
                log.warning("a batch of %d failed (%s); retrying its requests one by one", len(indices),
                            type(exc).__name__)
                parts = [[i] for i in indices]
        groups: list[tuple[list[int], TopK]] = []
        failed: list[int] = []
        for part in parts:
            more_groups, more_failed = self._forward_all(items, part)
            groups += more_groups
            failed += more_failed
        return groups, failed

    def _decode_loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._decoding:
                    self._decode_wake.wait()
                if self._stopping:
                    return
                work = self._decoding[0]
            self._decode(work)
            with self._lock:
                self._decoding.popleft()
                self._model_wake.notify()

    def _decode(self, work: _Forwarded) -> None:
        """Each job's predictions as JSON, cheapest first, handed over in chunks of about ``HAND_OVER_S``
        of work: a light request that shares a batch with heavy ones does not wait for their strings.
        A job whose decoding fails gets ``Failed``; the others go on."""
        jobs = [(work.jobs[i], n, topk) for indices, topk in work.groups for n, i in enumerate(indices)]
        jobs.sort(key=lambda entry: entry[0].result_bytes)
        size = len(work.jobs)
        chunk: list[Outcome] = []
        started = chunk_started = time.perf_counter()
        decoded_bytes = 0
        for job, n, topk in jobs:
            try:
                item = Item(job.input_ids, job.request.top_k, job.target_ids)
                data = predictions_json(self.decoder, item, topk, n)
                decoded_bytes += job.result_bytes  # priced per byte of the bound that costs are made of
                chunk.append(Result(job, data, (job.started - job.arrival) * 1000, work.inference_ms, size,
                                    work.padded_tokens, work.batch_id))
            except Exception:
                log.exception("decoding a result failed; answering it internal_error")
                chunk.append(Failed(job, _SERVER_FAILED))
            if time.perf_counter() - chunk_started >= HAND_OVER_S:
                self._finish_decoded(chunk)
                chunk, chunk_started = [], time.perf_counter()
        self._finish_decoded(chunk)
        if decoded_bytes:
            self._byte_s = 0.9 * self._byte_s + 0.1 * ((time.perf_counter() - started) / decoded_bytes)

    def _finish_decoded(self, outcomes: list[Outcome]) -> None:
        if not outcomes:
            return
        with self._lock:
            for outcome in outcomes:
                if can(outcome.job, Event.DECODED):
                    self._move(outcome.job, Event.DECODED if isinstance(outcome, Result) else Event.FAILED)
                    self._decoding_jobs -= 1
            self._hand_over_locked(outcomes)

    def _die(self, exc: BaseException) -> None:
        """A stage thread is ending abnormally: refuse new work, stop the other stages, answer everything held."""
        log.critical("an engine thread stopped (%s); /readyz now answers 503 and requests get 503 engine_stopped",
                     type(exc).__name__, exc_info=exc)
        with self._lock:
            self.alive = False
            self._stopping = True
            for wake in (self._intake_wake, self._model_wake, self._decode_wake):
                wake.notify_all()
            waiting = [job for job in (*self._tokenizing, *self._intake, *self._queue)
                       if self._withdraw_locked(job)]
            started = [job for job in (*self._running, *(j for w in self._decoding for j in w.jobs))
                       if can(job, Event.FAILED)]
            for job in started:
                self._move(job, Event.FAILED)
            self._running = []
            self._decoding.clear()
            self._decoding_jobs = 0
            outcomes: list[Outcome] = [Failed(job, _SERVER_FAILED) for job in started]
            outcomes += [Stopped(job, "engine_stopped", ENGINE_STOPPED_RETRY_MS) for job in waiting]
            try:
                self._hand_over_locked(outcomes)
            except Exception:
                log.exception("answering the requests of the stopped engine failed")


def _out_of_memory(exc: BaseException) -> bool:
    """True for host or device out-of-memory errors (``MemoryError``, ``torch.OutOfMemoryError``)."""
    if isinstance(exc, MemoryError):
        return True
    import torch  # already loaded: the model runs on torch

    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, oom)
