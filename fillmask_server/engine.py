"""The engine: the stages between the connections and the model, each run by one thread.

    submit ──> [tokenizing] ──tokenizer stage──> [queue] ──model thread──> [decoding] ──decode stage──> deliver

- **Tokenizer stage** (``fillmask-intake``): takes every newly accepted request, tokenizes them in one
  call (the fast tokenizer releases the GIL) and makes the §3 checks that need tokens; a request that
  fails one is answered (``Rejected``), the others join the model's queue. The queue therefore holds
  only requests that can run.
- **Model thread** (``fillmask-model``): asks the core for the next batch (or takes the one the other
  stages chose for it while it ran the last, ``_prepare_locked``) and runs the forward pass
  (``FillMaskModel.forward``, one call into torch): token ids in, top-k tensors out, at the torch thread
  count the core gives it (``FillMaskModel.set_threads``, called on this thread, which runs every
  forward pass but a batch's other parts; then
  ``on_threads``, e.g. the server's switch interval for that count). With ``forward_parts`` above 1
  (CPU), a batch of several items runs as up to that many parts side by side (``parts.py``): the first
  on this thread, the others on helper threads (``fillmask-part-N``) that run only the model, the
  parts sharing all their threads (``part_threads`` each when the batch fills every part); a batch of
  one item runs whole, on all of them, but on the fewer threads of ``quiet`` (``layout.QuietLone``,
  measured by the calibration, then by these passes) when they are the team it was timed against
  and the model thread's last pass on all of them ended long enough ago for the team to have gone
  quiet: on the rule's count in use (the team where it is the faster), or, now and then
  (``layout.QuietLone.probe_gap``), on another count to time it. Each such pass that did not fail
  gives the rule its time, and the rule may choose again.
  Nothing else: no tokenizing, no strings, no JSON. Faults are isolated here: a batch the model
  fails on is retried in halves while the failure is out of memory and item by item otherwise, so
  only requests that fail alone get ``internal_error``.
- **Decode stage** (``fillmask-decode``): records each batch handed over (the ``on_batch`` metrics
  and live figures, which the model thread is spared), then turns top-k tensors into the pipeline's
  predictions and serializes them (``decode.py``), cheapest first across the batches handed over,
  while the model thread already runs the next batch (at most ``DECODE_BACKLOG`` batches ahead).

Every decision (admission, fair share, answer memory, prices, the cost model, the batch choice, which
job is where) is the thread-free ``core.EngineCore``'s; this module keeps only the three loops, the
out-of-memory split, the hand-over of outcomes, and, for the second look at the layout
(``layout.SecondLook``), the CPU time that the event loop and the two stages report as they call
in. The event loop only calls the cheap methods ``submit``, ``withdraw``, ``withdraw_all``,
``forget``, ``release`` and the counters; finished work reaches it as typed ``Outcome``\\ s through
``deliver``, called on a stage thread just after it released the engine's lock (the server makes it
thread-safe and non-blocking with ``call_soon_threadsafe``). Not under the lock: waking the event loop
is a system call, after which the stage thread waits for the GIL, and the event loop, which holds the
GIL, blocked on the engine lock meanwhile (docs/performance-log.md, "Parts timed as a busy server
runs them, and the engine lock held across a wake-up").

Invariants: every call into the core is made under ``self._lock``; the outcomes it returns are queued
under that lock (``_hand_over_locked``) and delivered by the thread that queued them as it releases it
(``_handing_over``), and ``busy()`` counts a delivery under way, so once ``busy()`` is False every
outcome has been delivered. If a stage thread ends abnormally, ``_die`` marks the engine not ``alive``
(``/readyz`` answers 503, ``submit`` refuses) and answers every request it held (``EngineCore.stop_all``).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import intake
from .batching import BatchPolicy
from .core import (
    INTAKE_BATCH,
    NOT_NUMBERS,
    SERVER_FAILED,
    Admission,
    AnswerMemory,
    EngineCore,
    Scheduled,
)
from .costmodel import CostModel
from .decode import SequenceDecoder, predictions_json
from .items import Item, TopK
from .jobs import Failed, Job, Outcome, Result, Stopped
from .layout import Layout, QuietLone, SecondLook, words
from .model import FillMaskModel
from .parts import PartRunner, plan
from .tuning import WINS_TO_SWITCH, ThreadTuner

__all__ = ["Engine", "EngineStats"]

log = logging.getLogger(__name__)

Deliver = Callable[[list[Outcome]], None]
# (batch id, batch size, padded tokens, each request's queue wait in s, the batch's time on the model in s)
BatchObserver = Callable[[int, int, int, list[float], float], None]

HAND_OVER_S = 0.002  # the decode stage hands results over at least this often while it works on a batch
ROOM_RECHECK_S = 0.02  # how often the model thread looks again when every queued request waits for answer room
DECODE_BACKLOG = 2  # the model thread runs at most this many batches ahead of the decode stage


@dataclass
class EngineStats:
    """Counters read by tests and logs; each written under the engine's lock, or by one stage thread only
    (reads may lag)."""

    batches: int = 0
    rows: int = 0
    expired: int = 0
    failed: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    busy_s: float = 0.0
    quiet_lone: int = 0  # lone requests run on fewer threads after a quiet spell (``layout.QuietLone``)


@dataclass
class _Forwarded:
    """One batch between the model thread and the decode stage."""

    jobs: list[Job]
    groups: list[tuple[list[int], TopK]]  # item indices of ``jobs`` and their top-k (one group unless split)
    batch_id: int
    padded_tokens: int
    inference_ms: float


class Engine:
    """The three stage threads around one ``EngineCore`` (see the module docstring)."""

    def __init__(self, model: FillMaskModel, policy: BatchPolicy, max_queue: int, max_masks: int,
                 deliver: Deliver, clock: Callable[[], float] = time.monotonic,
                 on_batch: BatchObserver | None = None, max_result_bytes: int = 1 << 62,
                 memory: AnswerMemory | None = None, cost: CostModel | None = None,
                 threads: ThreadTuner | None = None, on_threads: Callable[[int], None] | None = None,
                 forward_parts: int = 1, part_threads: int = 0, layouts: list[Layout] | None = None,
                 second_look: SecondLook | None = None, quiet: QuietLone | None = None) -> None:
        self.model = model
        on_cpu = model.device.type == "cpu"
        if threads is not None and forward_parts > 1 and layouts is None:
            raise ValueError("a thread tuner with parts needs the layouts its candidates stand for")
        if second_look is not None and (second_look.layouts != layouts or not on_cpu):
            raise ValueError("a second look needs the layouts the tuner's candidates stand for, on a CPU")
        # With ``layouts`` (CPU), the tuner's candidates are their ranks from 1: layouts[rank - 1] is
        # (all the threads, parts) of the batches it gives that rank.
        self._layouts = layouts if on_cpu and threads is not None else None
        self._fixed_parts = forward_parts if on_cpu else 1  # (parts only share CPU cores)
        # Each part's threads; in one pass without a tuner, the model thread's count (0: as it finds them).
        self._part_threads = part_threads
        self._quiet = quiet if on_cpu else None  # a lone request after the team's quiet (``layout.QuietLone``)
        self._team_ran_at = -math.inf  # when the model thread's last pass on all of the rule's team ended
        self._runner: PartRunner[tuple[list[tuple[list[int], TopK]], list[int]]] | None = None
        self._on_threads = on_threads  # called on the model thread after each change of the torch thread count
        self.core = EngineCore(policy, max_queue, memory, cost, threads, second_look)
        self._cpu_marks: dict[int, float] = {}  # thread id -> its CPU time when it last told the core
        # The model thread's count now (0: unknown, set at the first batch).
        self._threads_set = threads.current if threads is not None and self._layouts is None else 0
        self.policy = policy
        self.max_masks = max_masks
        self.max_result_bytes = max_result_bytes
        self.stats = EngineStats()
        self.decoder = SequenceDecoder(model.decode_tokenizer)
        self.not_numbers = 0  # texts whose scores were not numbers (the first is logged as a warning; /metrics)
        self._deliver = deliver
        self._on_batch = on_batch
        self._clock = clock
        self._lock = threading.Lock()
        self._intake_wake = threading.Condition(self._lock)
        self._model_wake = threading.Condition(self._lock)
        self._decode_wake = threading.Condition(self._lock)
        self._decoding: deque[_Forwarded] = deque()  # the hand-over from the model thread to the decode stage
        self._outbox: list[Outcome] = []  # outcomes made final under the lock, delivered once it is released
        self._delivering = 0  # deliveries under way outside the lock (``busy``)
        self._undecoded = 0  # batches handed over whose jobs are not all decoded yet (DECODE_BACKLOG)
        self._batch_ids = itertools.count(1)
        self._paused = False
        self._stopping = False
        self._forwarding = False  # the model thread is in a forward pass (outside the lock)
        self._next: Scheduled | None = None  # its next batch, chosen by another stage meanwhile (``_prepare_locked``)
        self._threads = [threading.Thread(target=self._guarded, args=(body,), name=name, daemon=True)
                         for name, body in (("fillmask-intake", self._intake_loop),
                                            ("fillmask-model", self._model_loop),
                                            ("fillmask-decode", self._decode_loop))]
        self.alive = False
        self.faulted = False  # a stage thread ended abnormally (``_die``); ``stop`` leaves it False
        self.started_at = clock()

    # --- called from the event loop (cheap, never blocks on the model) -------------------------

    def start(self) -> None:
        self.alive = True
        self.started_at = self._clock()
        most = max((parts for _, parts in self._layouts), default=1) if self._layouts else self._fixed_parts
        if most > 1:
            self._runner = PartRunner(most - 1, max(1, self._part_threads), self.model.set_threads,
                                      on_start=name_os_thread)
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> Admission:
        """Accept ``job`` for the tokenizer stage, or say why not (``EngineCore.submit``)."""
        with self._lock:
            if not self.alive or self._stopping:  # (``stop`` clears ``alive`` only once its threads end)
                return Admission.STOPPED
            self._count_cpu_locked()
            admission = self.core.submit(job)
            if admission is Admission.ACCEPTED:
                self._intake_wake.notify()
        return admission

    def release(self, jobs: list[Job]) -> None:
        """The answers of ``jobs`` have left the engine (queued for their socket, or dropped): give back
        the answer memory they reserved when they started."""
        with self._lock:
            if self.core.release(jobs):
                self._model_wake.notify()

    def forget(self, owner: object) -> None:
        """``owner``'s connection closed: the batching policy drops what it remembers of it."""
        with self._lock:
            self.core.forget(owner)

    def withdraw(self, job: Job) -> bool:
        """Take ``job`` out if the model does not have it yet; True when this call did it (the caller
        answers it: cancelled, 504, ...)."""
        with self._lock:
            return self.core.withdraw(job)

    def withdraw_all(self, reason: str, retry_after_ms: int) -> list[Stopped]:
        """Withdraw every job not yet on the model (the drain ran out of time): their ``Stopped`` answers."""
        with self._lock:
            jobs = self.core.withdraw_waiting()
        return [Stopped(job, reason, retry_after_ms) for job in jobs]

    def queued(self) -> int:
        """Requests waiting for the model: being tokenized or in its queue."""
        with self._lock:
            return self.core.waiting()

    def runnable(self) -> int:
        """Requests tokenized and checked, in the model's queue."""
        with self._lock:
            return self.core.runnable()

    def started(self) -> int:
        """Requests on the model or being decoded."""
        with self._lock:
            return self.core.started()

    def busy(self) -> bool:
        """True while any accepted request has no outcome yet, or one is still being delivered."""
        with self._lock:
            return self.core.busy() or self._delivering > 0 or bool(self._outbox)

    def retry_after_ms(self) -> int:
        """Estimate of how long the current queue takes to clear, for overload answers (429, 503, 504)."""
        with self._lock:
            return self.core.retry_after_ms()

    @property
    def _reserved_total(self) -> int:
        """Answer bytes reserved by started requests (read by tests, without the lock: one integer)."""
        return self.core.reserved_total()

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
        if self._runner is not None:
            self._runner.close(timeout)
        self.alive = False

    @property
    def quiet(self) -> QuietLone | None:
        """The rule for a lone request after the team's quiet (``layout.QuietLone``), or None: not
        timed, or not on a CPU. Changed only on the model thread."""
        return self._quiet

    @property
    def forward_parts(self) -> int:
        """The parts a batch of several texts runs in now (1: one pass): the tuner's layout, or the fixed one."""
        return self.layout(self.core.threads.current)[1] if self._layouts and self.core.threads else self._fixed_parts

    def layout(self, threads: int) -> Layout:
        """(all the threads, parts) of a batch the core gives ``threads``: with ``layouts``, its rank's;
        else that count in the fixed layout, or without one (0) the fixed layout's own (``part_threads``;
        0: as they are). A server built around a model it did not load (``FillMaskServer(config,
        model)``) thus runs on its config's count, which no load set."""
        if self._layouts is not None and threads:
            return self._layouts[threads - 1]
        if self._fixed_parts > 1:
            return max(1, self._part_threads) * self._fixed_parts, self._fixed_parts
        return threads or self._part_threads, 1

    @property
    def ended(self) -> bool:
        """Every stage thread (and part helper) has returned (after ``stop``): nothing of this engine
        touches the model."""
        return not any(thread.is_alive() for thread in self._threads) and (self._runner is None or self._runner.ended)

    def _count_cpu_locked(self) -> None:
        """While the second look measures (``layout.SecondLook``), tell the core the CPU time the calling
        thread used since its last call: the event loop (from ``submit``) and the tokenizer and decode
        stages (each time they hand work back). The model thread and the parts' helpers never call
        it. A thread's first call only marks where it starts."""
        if not self.core.measures_beside:
            return
        now = time.thread_time()
        last = self._cpu_marks.get(ident := threading.get_ident(), now)
        self._cpu_marks[ident] = now
        self.core.beside(now - last)

    def _hand_over_locked(self, outcomes: list[Outcome]) -> None:
        """Queue outcomes the core made final under the lock; ``_handing_over`` delivers them."""
        self._outbox.extend(outcomes)

    @contextlib.contextmanager
    def _handing_over(self) -> Iterator[None]:
        """The engine lock, for a block that may make outcomes final (``_hand_over_locked``): once the
        lock is released, this thread gives them to ``deliver`` in one call (``deliver`` must not block),
        and ``busy()`` stays True until it has, also when the block raised after queueing some. (Were a
        block to wait on a condition after queueing, another thread's block could take them: each is
        delivered once, by whoever takes it.)"""
        outcomes: list[Outcome] = []
        try:
            with self._lock:
                try:
                    yield
                finally:
                    outcomes, self._outbox = self._outbox, []
                    self._delivering += bool(outcomes)
        finally:  # (also where the block raised after queueing: its outcomes still go, then the exception)
            if outcomes:
                try:
                    self._deliver(outcomes)
                finally:
                    with self._lock:
                        self._delivering -= 1

    # --- the stage threads --------------------------------------------------------------------------

    def _guarded(self, body: Callable[[], None]) -> None:
        name_os_thread(threading.current_thread().name)
        try:
            body()
        except BaseException as exc:
            self._die(exc)

    def _intake_loop(self) -> None:
        with self._lock:
            self._count_cpu_locked()  # (this thread's first call: where its CPU time starts)
        while True:
            with self._lock:
                while not self._stopping and not self.core.has_intake():
                    self._intake_wake.wait()
                if self._stopping:
                    return
                fresh = self.core.take_intake(INTAKE_BATCH)
            verdicts: list[intake.Checked | intake.Refusal | None] = [None] * len(fresh)
            try:
                verdicts = self._check_all(fresh)
            finally:
                with self._handing_over():
                    self._count_cpu_locked()
                    self._hand_over_locked(self.core.checked(list(zip(fresh, verdicts, strict=True))))
                    self._prepare_locked()
                    self._model_wake.notify()

    def _check_all(self, fresh: list[Job]) -> list[intake.Checked | intake.Refusal | None]:
        """Tokenize and check ``fresh``: each one's verdict, None where its checks failed."""
        token_ids = intake.tokenize_all(self.model, [job.request.text for job in fresh])
        verdicts: list[intake.Checked | intake.Refusal | None] = []
        for job, ids in zip(fresh, token_ids, strict=True):
            try:
                verdicts.append(intake.check(self.model, job.request, ids, self.max_masks, self.max_result_bytes))
            except BaseException as exc:  # a fault in one request's checks fails that request only
                if not intake.request_fault(exc):
                    raise
                log.exception("checking a new request failed; answering it internal_error")
                verdicts.append(None)
        return verdicts

    def _model_loop(self) -> None:
        while True:
            with self._handing_over():
                while not self._stopping and (self._paused or not (self._next or self.core.runnable())
                                              or self._undecoded >= DECODE_BACKLOG):
                    self._model_wake.wait()
                if self._stopping:
                    return
                ahead, self._next = self._next, None
                scheduled = self._schedule_locked() if ahead is None else self.core.start(ahead, self._clock())
                if ahead is not None and not scheduled.batch:
                    continue  # every request of the batch chosen ahead was withdrawn meanwhile
                if scheduled.wait_s > 0:
                    self._model_wake.wait(scheduled.wait_s)
                    continue
                self._forwarding = bool(scheduled.batch)
            if scheduled.batch:  # timed from here: choosing the batch is not its forward pass (§4 inference_ms)
                self._run_batch(scheduled.batch, scheduled.padded_tokens, self._clock(), scheduled.threads)
            elif not scheduled.outcomes:
                with self._lock:  # every queued request waits for answer room: look again soon
                    self._model_wake.wait(ROOM_RECHECK_S)

    def _schedule_locked(self, start: bool = True) -> Scheduled:
        """``EngineCore.schedule`` now, its expired requests' answers handed over."""
        scheduled = self.core.schedule(self._clock(), start)
        self.stats.expired += len(scheduled.outcomes)
        self._hand_over_locked(scheduled.outcomes)
        return scheduled

    def _prepare_locked(self) -> None:
        """Choose the model thread's next batch while it runs a forward pass, on the stage calling this,
        so that the model thread, the one that limits a small model's throughput, goes from one forward
        pass to the next without choosing. Only when waiting would change nothing
        (``EngineCore.batch_ready``: a full batch queued or a round under way, no deadline waiting). The
        chosen requests stay QUEUED until the model thread starts them (``EngineCore.start``), so a
        cancel, a closed connection or a drain still takes them out as it would any queued request. A
        request that arrives meanwhile runs after that batch whatever its fair share: one batch more
        at most (a full one, or the round's next, which it would have waited for anyway)."""
        if (self._forwarding and self._next is None and not self._paused and not self._stopping
                and self.core.batch_ready()):
            scheduled = self._schedule_locked(start=False)
            if scheduled.batch:
                self._next = scheduled

    def _run_batch(self, batch: list[Job], padded_tokens: int, started: float, threads: int = 0) -> None:
        """One forward pass (split on failure; in parts side by side with ``forward_parts``) at
        ``threads`` torch threads (0: as they are); hand what succeeded to the decode stage."""
        items = [Item(job.input_ids, job.request.top_k, job.target_ids) for job in batch]
        runner = self._runner
        total, most = self.layout(threads)
        parts, count = plan([len(item.input_ids) for item in items], total, most if runner is not None else 1)
        layout_count, quiet, quiet_s = count, self._quiet, started - self._team_ran_at
        ruled = quiet is not None and count > 0 and quiet.applies(len(items), count, quiet_s)
        if ruled and quiet is not None:  # a lone request after the team's quiet: maybe fewer threads
            count = quiet.threads_for(len(items), count, quiet_s)
        # A batch the rule moved, and one that wakes the team the rule keeps asleep (a probe, or a batch of
        # several texts), say nothing of the layout in use to the tuner's timings or the cost model
        # (``EngineCore.update_from_output``'s ``typical``).
        moved = count != layout_count
        woken = (quiet is not None and count >= quiet.team and quiet_s >= quiet.after_s
                 and quiet.threads < quiet.team)
        if moved:
            self.stats.quiet_lone += 1
        if count and count != self._threads_set:
            self.model.set_threads(count)
            # (untuned, the first batch's count is the one the server set everything else for at start:
            # only a change of count is news to it)
            told = self._threads_set or self._layouts is not None
            self._threads_set = count
            if self._on_threads is not None and told:
                self._on_threads(count)
        forward_at = self._clock()  # (the rule compares forward passes alone, as the calibration timed them)
        if runner is None or len(parts) == 1:
            groups, failed_items = self._forward_all(items, parts[0])
        else:
            done = runner.run([functools.partial(self._forward_all, items, part) for part in parts], count)
            groups = [group for part_groups, _ in done for group in part_groups]
            failed_items = [i for _, part_failed in done for i in part_failed]
        passes = len(groups) + len(failed_items) - (len(parts) - 1)  # the parts of a batch are one pass
        finished = self._clock()
        elapsed = finished - started
        if quiet is not None and count >= quiet.team:
            self._team_ran_at = finished
        forwarded = [i for indices, _ in groups for i in indices]
        said: list[str] = []  # the lines this batch's rules and probes make, logged once the lock is released
        with self._handing_over():
            if ruled and not failed_items and quiet is not None:  # timed for the rule, at the calibration's length
                cost = self.core.cost
                scale = cost.forward_s(1, padded_tokens) / max(1e-9, cost.forward_s(1, quiet.tokens))
                if (line := quiet.ran(count, finished - forward_at, scale)) is not None:
                    said.append(line)
            in_use = self.core.threads.current if self.core.threads is not None else 0
            looking = self.core.measures_beside
            failed = self.core.update_from_output(batch, padded_tokens, forwarded, failed_items, elapsed, finished,
                                                  passes=passes, threads=threads, typical=not (moved or woken))
            look = self.core.second_look
            made = look.done if looking and look is not None else None  # (made by this batch)
            # A probe's switch (the look, if this batch made it, came after it: its ``before``).
            probed = made.before if made is not None else self.core.threads.current if self.core.threads else 0
            if (verdict := self.core.probe_ended) is not None:
                said.append(verdict.line(self._words))
            if probed != in_use:
                said.append(f"torch threads {self._words(in_use)} -> {self._words(probed)}: batches so won "
                            f"{WINS_TO_SWITCH} probes in a row against the cost model while serving (tuning.py: a "
                            "larger count, or a wider team, must be faster; a smaller one as fast)")
            if made is not None and look is not None:
                said.append(made.line(look.layouts))
            self._forwarding = False
            # Counted before any of the batch's answers is handed over: whoever has an answer sees its batch.
            stats = self.stats
            stats.batches += 1
            stats.rows += len(batch)
            stats.failed += len(failed)
            stats.busy_s += elapsed
            stats.batch_sizes[len(batch)] = stats.batch_sizes.get(len(batch), 0) + 1
            batch_id = next(self._batch_ids)
            self._decoding.append(_Forwarded(batch, groups, batch_id, padded_tokens, elapsed * 1000))
            self._undecoded += 1
            self._hand_over_locked(failed)
            self._decode_wake.notify()
        for line in said:  # (not under the lock: a log handler may block, on a pipe nobody reads, say)
            log.info("%s", line)

    def _words(self, threads: int) -> str:
        """``2`` or ``2 in 2 parts``: the layout of the tuner's ``threads``, for the log."""
        return words(self.layout(threads))

    def _forward_all(self, items: list[Item], indices: list[int]) -> tuple[list[tuple[list[int], TopK]], list[int]]:
        """Top-k for ``indices`` of ``items``: (groups that succeeded, indices that failed alone).

        Out of memory splits the batch in halves, recursively down to single items, so a batch too
        big for the device still gets through in smaller pieces; any other failure retries item by
        item, so one bad input fails only itself. Raises no ``Exception`` but ``DeviceLost``: after an
        error that leaves the device unusable (``_device_lost``) every later pass would fail too, so
        the engine stops (``_die``) and the server drains and exits for its supervisor to restart it.
        """
        if self.model.one_length and len({len(items[i].input_ids) for i in indices}) > 1:
            return self._forward_each_length(items, indices)
        try:
            return [(indices, self.model.forward([items[i] for i in indices]))], []
        except Exception as exc:
            if _device_lost(exc):
                raise DeviceLost(_line_with(exc, _DEVICE_LOST_WORDS)) from exc
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

    def _forward_each_length(self, items: list[Item], indices: list[int]) -> tuple[list[tuple[list[int], TopK]],
                                                                                 list[int]]:
        """``_forward_all`` for a model whose answers padding would change (``FillMaskModel.one_length``): a
        pass for each length among ``indices``, in the order of each length's first item. The batching
        policy forms one-length batches for such a model (``BatchPolicy.one_length``); should a batch
        ever hold more, each text's answer is still the one it gets alone."""
        by_length: dict[int, list[int]] = {}
        for i in indices:
            by_length.setdefault(len(items[i].input_ids), []).append(i)
        groups: list[tuple[list[int], TopK]] = []
        failed: list[int] = []
        for same in by_length.values():
            more_groups, more_failed = self._forward_all(items, same)
            groups += more_groups
            failed += more_failed
        return groups, failed

    def _decode_loop(self) -> None:
        """Decode the jobs of every batch handed over, cheapest first across batches, in chunks of about
        ``HAND_OVER_S`` of work: a light request never waits for a heavy neighbour's strings, whether
        they share its batch or came in the batch before. The heap is this thread's alone."""
        heap: list[tuple[int, int, Job, int, TopK, _Forwarded]] = []
        left: dict[int, int] = {}  # batch id -> its jobs still in the heap
        order = itertools.count()
        with self._lock:
            self._count_cpu_locked()  # (this thread's first call: where its CPU time starts)
        while True:
            with self._lock:
                while not self._stopping and not self._decoding and not heap:
                    self._decode_wake.wait()
                stopping = self._stopping
                taken = list(self._decoding) if stopping else self._take_handed_over_locked(heap, left, order)
            self._observe(taken)  # the batches the model ran are counted, even those a stop leaves undecoded
            if stopping:
                return
            self._decode_chunk(heap, left)

    def _observe(self, batches: list[_Forwarded]) -> None:
        """Record the batches the model ran (metrics, live figures) here, before their answers are decoded:
        the model thread, the busiest, does none of it."""
        if self._on_batch is None:
            return
        for work in batches:
            try:
                self._on_batch(work.batch_id, len(work.jobs), work.padded_tokens,
                               [job.started - job.arrival for job in work.jobs], work.inference_ms / 1000)
            except Exception:
                log.exception("recording batch metrics failed")

    def _take_handed_over_locked(self, heap: list[tuple[int, int, Job, int, TopK, _Forwarded]], left: dict[int, int],
                                 order: Iterator[int]) -> list[_Forwarded]:
        """Move the batches the model thread handed over into the decode stage's heap; returns them."""
        done = 0
        taken: list[_Forwarded] = []
        while self._decoding:
            work = self._decoding.popleft()
            taken.append(work)
            entries = [(work.jobs[i], n, topk) for indices, topk in work.groups for n, i in enumerate(indices)]
            for job, n, topk in entries:
                heapq.heappush(heap, (job.result_bytes, next(order), job, n, topk, work))
            if entries:
                left[work.batch_id] = len(entries)
            else:
                done += 1  # every job of it failed on the model
        if done:
            self._undecoded -= done
            self._model_wake.notify()
        return taken

    def _decode_chunk(self, heap: list[tuple[int, int, Job, int, TopK, _Forwarded]], left: dict[int, int]) -> None:
        """Predictions as JSON for the cheapest jobs of ``heap``, about ``HAND_OVER_S`` of work, handed
        over together. A job whose decoding fails gets ``Failed``; the others go on."""
        chunk: list[Outcome] = []
        started = time.perf_counter()
        decoded_bytes = 0
        finished = 0
        while heap and (not chunk or time.perf_counter() - started < HAND_OVER_S):
            _, _, job, n, topk, work = heapq.heappop(heap)
            try:
                item = Item(job.input_ids, job.request.top_k, job.target_ids)
                if topk.numbers(n, item):
                    data = predictions_json(self.decoder, item, topk, n)
                    decoded_bytes += job.result_bytes  # priced per byte of the bound that costs are made of
                    chunk.append(Result(job, data, (job.started - job.arrival) * 1000, work.inference_ms,
                                        len(work.jobs), work.padded_tokens, work.batch_id))
                else:
                    log.log(logging.DEBUG if self.not_numbers else logging.WARNING,
                            "the model's scores for a text of %d tokens are not numbers (NaN); answering it "
                            "internal_error (the next such texts are logged at DEBUG)", len(job.input_ids))
                    self.not_numbers += 1
                    chunk.append(Failed(job, NOT_NUMBERS))
            except BaseException as exc:
                if not intake.request_fault(exc):
                    raise
                log.exception("decoding a result failed; answering it internal_error")
                chunk.append(Failed(job, SERVER_FAILED))
            left[work.batch_id] -= 1
            if not left[work.batch_id]:
                del left[work.batch_id]
                finished += 1
        seconds = time.perf_counter() - started
        with self._handing_over():
            self._count_cpu_locked()
            self._hand_over_locked(self.core.decoded(chunk, decoded_bytes, seconds))
            self._prepare_locked()
            if finished:
                self._undecoded -= finished
                self._model_wake.notify()

    def _die(self, exc: BaseException) -> None:
        """A stage thread is ending abnormally: refuse new work, stop the other stages, answer everything held."""
        log.critical("an engine thread stopped (%s); /readyz now answers 503 and requests get 503 engine_stopped",
                     type(exc).__name__, exc_info=exc)
        stranded: list[_Forwarded] = []
        try:
            with self._handing_over():
                self.alive = False
                self.faulted = True
                self._stopping = True
                for wake in (self._intake_wake, self._model_wake, self._decode_wake):
                    wake.notify_all()
                stranded = list(self._decoding)
                self._decoding.clear()
                self._undecoded = 0
                self._next = None
                self._hand_over_locked(self.core.stop_all())
        except Exception:
            log.exception("answering the requests of the stopped engine failed")
        self._observe(stranded)  # batches the model ran and the decode stage never took: counted all the same


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (at most 15 bytes kept) in the kernel too, where ``top -H``,
    ``ps -L`` and per-thread CPU figures (/proc/PID/task/TID/comm) see it; threads it starts later
    inherit it (the model thread's torch workers show as ``fillmask-model``). Linux only; elsewhere,
    or if /proc is not writable, nothing happens."""
    with contextlib.suppress(OSError), open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
        comm.write(name[:15])


#: Out of memory in the words of torch's allocators, for the errors that carry no type of their own: the
#: CPU allocator's failure is a plain RuntimeError, and TorchScript's interpreter raises any error in a
#: graph (a CUDA out-of-memory too) again as a RuntimeError that quotes it.
_OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "cublas_status_alloc_failed")
#: Errors after which a CUDA context is unusable (every later call fails): asynchronous faults.
_DEVICE_LOST_WORDS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                      "an illegal instruction was encountered", "uncorrectable ecc error", "misaligned address")


class DeviceLost(RuntimeError):
    """The model's device failed for good (``_device_lost``): the model thread ends."""


def _out_of_memory(exc: BaseException) -> bool:
    """True for host or device out-of-memory errors: ``MemoryError``, ``torch.OutOfMemoryError``, or a
    RuntimeError in an allocator's words (``_OUT_OF_MEMORY_WORDS``)."""
    if isinstance(exc, MemoryError):
        return True
    import torch  # already loaded: the model runs on torch

    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    if isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and any(words in str(exc).lower() for words in _OUT_OF_MEMORY_WORDS)


def _device_lost(exc: BaseException) -> bool:
    """True for a RuntimeError that leaves a CUDA device unusable (``_DEVICE_LOST_WORDS``)."""
    return isinstance(exc, RuntimeError) and not _out_of_memory(exc) and any(
        words in str(exc).lower() for words in _DEVICE_LOST_WORDS)


def _line_with(exc: BaseException, words: tuple[str, ...]) -> str:
    """The first line of ``exc``'s message that holds one of ``words`` (TorchScript's interpreter quotes
    the real error below a line of its own), else its first line."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return next((line.strip() for line in lines if any(word in line.lower() for word in words)), lines[0])
