"""The engine: one thread that owns the model and turns the shared queue into batches.

Every connection's requests meet in one queue; the engine thread alone runs the model. The event
loop never runs model code: it only calls the cheap, lock-protected methods ``submit``, ``cancel``,
``expire`` and ``discard``, and receives finished frames through the ``deliver`` callback (which the
server makes thread-safe with ``loop.call_soon_threadsafe``).

Invariant (protocol.md §8): a job leaves the QUEUED state exactly once, under ``self._lock``, and
only the caller that made that transition produces its terminal frame. The engine thread moves
QUEUED → RUNNING → DONE (result or error) or QUEUED → DONE (504, tokenizer check failed); the loop
moves QUEUED → DONE by cancel, deadline timer, disconnect or shutdown. Whoever loses a race sees a
state other than QUEUED and does nothing.

Faults (protocol.md §7, §9): a batch the model fails on is retried, split in halves while the failure
is out of memory and item by item otherwise, so only requests that fail alone get ``internal_error``.
Any other exception while handling a batch fails that batch's requests and the loop goes on. If the
thread still ends abnormally, ``_die`` marks the engine not ``alive`` (so ``/readyz`` answers 503 and
``submit`` refuses) and answers every request it held: running ones ``internal_error``, queued ones
``overloaded`` 503 ``engine_stopped``. Nothing is left hanging.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .batching import BatchPolicy
from .model import FillMaskModel, Item, TargetError
from .protocol import FillMaskRequest, encode_error, encode_overloaded, encode_result

log = logging.getLogger(__name__)


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class Job:
    """One accepted request on its way through the engine. ``owner`` is the connection, opaque here."""

    request: FillMaskRequest
    owner: Any
    arrival: float
    deadline: float | None = None
    state: State = State.QUEUED
    input_ids: list[int] | None = None
    n_tokens: int | None = None
    target_ids: tuple[int, ...] | None = None
    timer: Any = None  # the loop's deadline timer handle, owned by the server


Deliver = Callable[[list[tuple[Job, bytes]]], None]
# (batch size, padded tokens, each request's queue wait in s, the batch's time on the model in s)
BatchObserver = Callable[[int, int, list[float], float], None]


@dataclass
class EngineStats:
    """Counters read by tests and logs; written only by the engine thread (reads may lag)."""

    batches: int = 0
    rows: int = 0
    expired: int = 0
    failed: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    busy_s: float = 0.0


class Engine:
    """Owns the queue and the model thread. ``deliver`` is called on the engine thread."""

    def __init__(self, model: FillMaskModel, policy: BatchPolicy, max_queue: int, max_masks: int,
                 deliver: Deliver, clock: Callable[[], float] = time.monotonic,
                 on_batch: BatchObserver | None = None) -> None:
        self.model = model
        self.policy = policy
        self.max_queue = max_queue
        self.max_masks = max_masks
        self.stats = EngineStats()
        self._deliver = deliver
        self._on_batch = on_batch
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[Job] = deque()
        self._untokenized: list[Job] = []
        self._running = 0
        self._batch: list[Job] = []  # the batch the thread is running, for _die
        self._paused = False
        self._stopping = False
        self._seconds_per_row = 0.01  # moving estimate, for retry_after_ms
        self._thread = threading.Thread(target=self._run, name="fillmask-engine", daemon=True)
        self.alive = False
        self.started_at = clock()

    # --- called from the event loop (cheap, never blocks on the model) -------------------------

    def start(self) -> None:
        self.alive = True
        self.started_at = self._clock()
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (and nothing queued) when the queue already holds ``max_queue`` jobs."""
        with self._lock:
            if len(self._queue) >= self.max_queue or not self.alive:
                return False
            self._queue.append(job)
            self._untokenized.append(job)
            self._wake.notify()
        return True

    def cancel(self, job: Job) -> bool:
        """Remove ``job`` if still queued; True when this call did it (the caller answers it)."""
        with self._lock:
            return self._remove_locked(job)

    expire = cancel  # the loop's deadline timer: same transition, the caller answers 504

    def discard(self, jobs: list[Job]) -> int:
        """Remove every still-queued job of ``jobs`` (their connection closed); returns how many."""
        doomed = {id(job) for job in jobs if job.state is State.QUEUED}
        if not doomed:
            return 0
        with self._lock:
            kept = [job for job in self._queue if id(job) not in doomed]
            removed = len(self._queue) - len(kept)
            for job in self._queue:
                if id(job) in doomed:
                    job.state = State.DONE
            self._queue = deque(kept)
            self._untokenized = [job for job in self._untokenized if job.state is State.QUEUED]
        return removed

    def drain_queue(self) -> list[Job]:
        """Remove and return every queued job (shutdown timeout); the caller answers them."""
        with self._lock:
            jobs = list(self._queue)
            for job in jobs:
                job.state = State.DONE
            self._queue.clear()
            self._untokenized.clear()
        return jobs

    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def busy(self) -> bool:
        """True while any job is queued or running."""
        with self._lock:
            return bool(self._queue) or self._running > 0

    def retry_after_ms(self) -> int:
        """Estimate of how long the current queue takes to clear, for 503/504 answers."""
        with self._lock:
            waiting = len(self._queue) + self._running
        return int(min(30_000, max(10, waiting * self._seconds_per_row * 1000)))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between batches (requests stay queued); for tests and maintenance."""
        with self._lock:
            self._paused = True
        try:
            yield
        finally:
            with self._lock:
                self._paused = False
                self._wake.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after its current batch; queued jobs stay unanswered (drain first)."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.alive = False

    def _remove_locked(self, job: Job) -> bool:
        if job.state is not State.QUEUED:
            return False
        job.state = State.DONE
        self._queue.remove(job)
        # An untokenized job is in ``_untokenized``, unless the engine thread has just taken it for
        # ``_intake`` (which then skips it: its state is no longer QUEUED).
        if job.n_tokens is None and job in self._untokenized:
            self._untokenized.remove(job)
        return True

    # --- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and (self._paused or not self._queue):
                        self._wake.wait()
                    if self._stopping:
                        return
                    fresh, self._untokenized = self._untokenized, []
                if fresh:
                    try:
                        self._intake(fresh)
                    except Exception:
                        log.exception("checking %d new requests failed; answering them internal_error", len(fresh))
                        self._fail(fresh)
                with self._lock:
                    if self._paused or self._stopping:
                        continue
                    now = self._clock()
                    wait = self.policy.wait_s(self._queue, now)
                    if wait > 0 and not self._untokenized:
                        self._wake.wait(wait)
                        continue
                    decision = self.policy.take(self._queue, now)
                    for job in decision.expired:
                        job.state = State.DONE
                    for job in decision.batch:
                        job.state = State.RUNNING
                    self._running = len(decision.batch)
                    self._batch = decision.batch
                if decision.expired:
                    self._answer_expired(decision.expired, now)
                if decision.batch:
                    self._run_guarded(decision.batch, decision.padded_tokens, now)
                with self._lock:
                    self._running = 0
                    self._batch = []
        except BaseException as exc:
            self._die(exc)

    def _run_guarded(self, batch: list[Job], padded_tokens: int, started: float) -> None:
        """Run one batch; whatever goes wrong outside the model fails this batch only."""
        try:
            self._run_batch(batch, padded_tokens, started)
        except Exception:
            log.exception("a batch of %d failed outside the model; answering its requests internal_error", len(batch))
            self._fail(batch)
            return
        if self._on_batch is not None:
            try:
                self._on_batch(len(batch), padded_tokens, [started - job.arrival for job in batch],
                               self._clock() - started)
            except Exception:
                log.exception("recording batch metrics failed")

    def _fail(self, jobs: list[Job]) -> None:
        """Answer ``internal_error`` to each job still running, or still queued and untokenized."""
        failed: list[Job] = []
        with self._lock:
            for job in jobs:
                if job.state is State.RUNNING or (job.state is State.QUEUED and job.n_tokens is None):
                    if job.state is State.QUEUED:
                        self._queue.remove(job)
                        if job in self._untokenized:
                            self._untokenized.remove(job)
                    job.state = State.DONE
                    failed.append(job)
        self.stats.failed += len(failed)
        if failed:
            self._deliver([(job, encode_error(job.request.id, "internal_error", _SERVER_FAILED)) for job in failed])

    def _die(self, exc: BaseException) -> None:
        """The thread is ending abnormally: refuse new work and answer every request still held."""
        log.critical("the engine thread stopped (%s); /readyz now answers 503 and requests get 503 engine_stopped",
                     type(exc).__name__, exc_info=exc)
        with self._lock:
            self.alive = False
            running = [job for job in self._batch if job.state is State.RUNNING]
            queued = list(self._queue)
            for job in (*running, *queued):
                job.state = State.DONE
            self._queue.clear()
            self._untokenized.clear()
            self._batch = []
            self._running = 0
        frames = [(job, encode_error(job.request.id, "internal_error", _SERVER_FAILED)) for job in running]
        frames += [(job, encode_overloaded(job.request.id, 503, "engine_stopped", ENGINE_STOPPED_RETRY_MS))
                   for job in queued]
        if frames:
            try:
                self._deliver(frames)
            except Exception:
                log.exception("answering the requests of the stopped engine failed")

    def _intake(self, jobs: list[Job]) -> None:
        """Tokenize new jobs in one call; answer those that fail the model-side checks of §3."""
        texts = [job.request.text for job in jobs]
        try:
            all_ids = self.model.tokenize(texts)
        except Exception:
            log.exception("tokenizer failed on a batch of %d texts; retrying one by one", len(texts))
            all_ids = [self._tokenize_one(text) for text in texts]
        rejected: list[tuple[Job, bytes]] = []
        for job, ids in zip(jobs, all_ids, strict=True):
            try:
                frame = self._check(job, ids)
            except Exception:  # a fault in one request's checks fails that request only
                log.exception("checking a new request failed; answering it internal_error")
                frame = encode_error(job.request.id, "internal_error", _SERVER_FAILED)
            with self._lock:
                if job.state is not State.QUEUED:
                    continue
                if frame is not None:
                    job.state = State.DONE
                    self._queue.remove(job)
                    rejected.append((job, frame))
                else:
                    job.input_ids = ids
                    job.n_tokens = len(ids)
        if rejected:
            self._deliver(rejected)

    def _tokenize_one(self, text: str) -> list[int] | None:
        try:
            return self.model.tokenize([text])[0]
        except Exception:
            return None

    def _check(self, job: Job, ids: list[int] | None) -> bytes | None:
        """The error frame for a request the tokenizer rejects, or None when it may run."""
        request = job.request
        if ids is None:
            return encode_error(request.id, "invalid_field", "the text could not be tokenized; send plain text")
        if len(ids) > self.model.max_tokens:
            return encode_error(request.id, "text_too_long", f"the text is {len(ids)} tokens long; this model "
                                f"accepts at most {self.model.max_tokens}; shorten it")
        masks = ids.count(self.model.mask_token_id)
        if masks == 0:
            return encode_error(request.id, "no_mask", f"the text has no {self.model.mask_token} token after "
                                f"tokenizing; write {self.model.mask_token} exactly, with spaces around it")
        if masks > self.max_masks:
            return encode_error(request.id, "too_many_masks", f"the text has {masks} mask tokens; the limit is "
                                f"{self.max_masks}")
        if request.targets is not None:
            try:
                job.target_ids = self.model.target_ids(request.targets)
            except TargetError as exc:
                return encode_error(request.id, "invalid_targets", f"{exc}; use words from the vocabulary")
        return None

    def _answer_expired(self, jobs: list[Job], now: float) -> None:
        retry = self.retry_after_ms()
        self.stats.expired += len(jobs)
        self._deliver([(job, encode_overloaded(job.request.id, 504, "deadline_exceeded", retry,
                                               (now - job.arrival) * 1000)) for job in jobs])

    def _run_batch(self, batch: list[Job], padded_tokens: int, started: float) -> None:
        items = [Item(job.input_ids or [], job.request.top_k, job.target_ids) for job in batch]
        outputs = self._predict_all(items)
        elapsed = self._clock() - started
        inference_ms = elapsed * 1000
        frames: list[tuple[Job, bytes]] = []
        for job, output in zip(batch, outputs, strict=True):
            if isinstance(output, Exception):
                self.stats.failed += 1
                frame = encode_error(job.request.id, "internal_error", "the model failed on this request, also "
                                     "when run alone; other requests are unaffected")
            else:
                frame = encode_result(job.request.id, output, (started - job.arrival) * 1000, inference_ms,
                                      len(batch), padded_tokens, self.stats.batches + 1)
            frames.append((job, frame))
        with self._lock:
            for job in batch:
                job.state = State.DONE
            self._seconds_per_row = 0.8 * self._seconds_per_row + 0.2 * (elapsed / len(batch))
        stats = self.stats
        stats.batches += 1
        stats.rows += len(batch)
        stats.busy_s += elapsed
        stats.batch_sizes[len(batch)] = stats.batch_sizes.get(len(batch), 0) + 1
        self._deliver(frames)

    def _predict_all(self, items: list[Item]) -> list[Any]:
        """One prediction per item, or the exception of an item that failed alone; raises no ``Exception``.

        Out of memory splits the batch in halves, recursively down to single items, so a batch too
        big for the device still gets through in smaller pieces; any other failure retries item by
        item, so one bad input fails only itself.
        """
        try:
            return self.model.predict(items)
        except Exception as exc:
            if len(items) == 1:
                if _out_of_memory(exc):
                    log.error("out of memory on a single request of %d tokens; answering it internal_error",
                              len(items[0].input_ids))
                else:
                    log.exception("the model failed on a request; answering it internal_error")
                return [exc]
            if _out_of_memory(exc):
                log.warning("out of memory on a batch of %d; retrying it in halves", len(items))
                half = len(items) // 2
                return self._predict_all(items[:half]) + self._predict_all(items[half:])
            log.warning("a batch of %d failed (%s); retrying its requests one by one", len(items), type(exc).__name__)
            return [self._predict_all([item])[0] for item in items]


ENGINE_STOPPED_RETRY_MS = 1000
_SERVER_FAILED = "the server failed while handling this request; other requests are unaffected; you may send it again"


def _out_of_memory(exc: BaseException) -> bool:
    """True for host or device out-of-memory errors (``MemoryError``, ``torch.OutOfMemoryError``)."""
    if isinstance(exc, MemoryError):
        return True
    import torch  # already loaded: the model runs on torch

    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, oom)
