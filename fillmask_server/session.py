"""One connection's conversation, sans I/O: frames and outcomes in, answer frames out.

A ``Session`` holds the rules of protocol.md §3, §5, §6, §7 and §8 for one peer, like h11's
``Connection``: it never touches a socket, an event loop or a thread. The websockets shell feeds it
each incoming message (``receive``), each outcome the engine produced for one of its jobs
(``on_outcome``) and the clock (``expire``), and sends the ``Answer``\\ s it returns. It reaches the
engine only through the narrow ``Scheduler`` interface, so tests drive it with a stand-in.

Admission order (stated in protocol.md §3), for each frame read:

1. a frame that cannot be read as a request, or whose ``id`` is missing or invalid → ``error`` with
   ``id`` null (or the frame's valid id);
2. a valid ``id`` already in flight on this connection → ``duplicate_id``, *whatever else is wrong with
   the frame* (answering, say, ``invalid_top_k`` under that id would read as the in-flight request's
   answer); a ``cancel`` for an id in flight is the exception: it is what cancels;
3. other field errors of the frame → ``error`` under its id;
4. ``too_many_inflight``; 5. the server is draining → 503 ``shutting_down``; 6. the engine stopped →
   503 ``engine_stopped``; 7. the queue is full → 503 ``queue_full``; 8. the queue is half full or more
   and this connection holds its fair share of it → 429 ``queue_share``; otherwise the request is
   accepted.

Invariants:

- ``inflight`` maps each accepted id to its job until the job's terminal answer is produced; an answer
  is produced only for a job that is ``inflight`` under its id, and removes it, so a job is answered
  at most once. An outcome for a job that is not in flight raises ``DoubleAnswer`` (a server bug, never
  sent): "exactly one terminal frame" is checked here, at the point of delivery.
- After ``close`` nothing is answered: jobs the engine still had are withdrawn, and outcomes still due
  for the others (already on the model) are recognised and dropped, once each.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fillmask_client.wire import CLOSE_POLICY_VIOLATION

from .core import ENGINE_STOPPED_RETRY_MS, MAX_RETRY_AFTER_MS, Admission
from .jobs import Expired, Failed, Job, Outcome, Rejected, Result, Stopped
from .protocol import (
    RESENDER_REASON,
    CancelRequest,
    FillMaskRequest,
    Limits,
    ProtocolError,
    RequestId,
    StatsSubscription,
    encode_cancelled,
    encode_error,
    encode_overloaded,
    encode_result,
    parse_frame,
)

SHUTTING_DOWN_RETRY_MS = 1000  # retry_after_ms of the 503 shutting_down answers (§6)
# Back-off (§6, §12). A refusal that arrives before the retry_after_ms this connection was last told is
# "early", unless it comes within EARLY_GRACE_S of the first refusal of a burst (a burst: refusals with
# less than QUIET_S between them; a refusal after the client waited as told starts one too, since a
# client that held its requests back sends them together), since those requests were on their way
# before the client could know.
# Each early refusal is told twice what the connection was last told (a refusal after waiting as told
# starts over from the engine's estimate); EARLY_RESENDS_LIMIT early refusals within EARLY_WINDOW_S close
# the connection with 1008.
EARLY_GRACE_S = 0.2
QUIET_S = 1.0
EARLY_RESENDS_LIMIT = 200
EARLY_WINDOW_S = 10.0
POLICY_VIOLATION = CLOSE_POLICY_VIOLATION  # the close code of §12's policy violations


class Scheduler(Protocol):
    """What a session needs of the engine."""

    alive: bool

    def submit(self, job: Job) -> Admission: ...

    def withdraw(self, job: Job) -> bool: ...

    def retry_after_ms(self) -> int: ...


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class Answer:
    """One frame for the client, and how the metrics count it (``fillmask_requests_total``, §11)."""

    frame: bytes
    outcome: str  # result, error, overloaded or cancelled
    code: str = ""  # the error code or the overloaded reason


class DoubleAnswer(RuntimeError):
    """A second terminal answer for one request: a bug in the server, never sent to the client."""


class Session:
    """The protocol state of one connection (see the module docstring). ``peer`` is the shell's handle."""

    def __init__(self, limits: Limits, scheduler: Scheduler, max_inflight: int,
                 clock: Callable[[], float], peer: Any = None) -> None:
        self.limits = limits
        self.scheduler = scheduler
        self.max_inflight = max_inflight
        self.clock = clock
        self.peer = peer
        self.inflight: dict[RequestId, Job] = {}
        self.draining = False
        self.closed = False
        self.stats_interval_ms: int | None = None  # set while the client subscribes to stats frames (§13)
        self.close_request: tuple[int, str] | None = None  # set when the session wants the connection closed
        self._told_ms = 0  # the retry_after_ms this connection was last told
        self._burst_start = self._last_refusal = float("-inf")
        self._wait_until = float("-inf")  # the time this connection was last told to wait until
        self._early: deque[float] = deque()  # times of early refusals within EARLY_WINDOW_S
        self._deadlines: list[tuple[float, int, Job]] = []
        self._order = itertools.count()
        self._orphans: set[Job] = set()  # jobs still on the model when the connection closed (by identity)

    # --- input: one message from the client ----------------------------------------------------------

    def receive(self, data: str | bytes) -> list[Answer]:
        """Handle one incoming message; the answers to send now (none for an accepted request). Once
        closed, none: messages read before the client's close frame but handled after it (websockets'
        queue) are discarded, as its requests were (§8)."""
        if self.closed:
            return []
        parsed = parse_frame(data, self.limits)
        if isinstance(parsed, StatsSubscription):
            self.stats_interval_ms = parsed.interval_ms
            return []
        if isinstance(parsed, CancelRequest):
            return self._cancel(parsed.id)
        if parsed.id is not None and parsed.id in self.inflight:
            return [_error(parsed.id, "duplicate_id", "a request with this id is still in flight on this "
                           "connection; use a new id, or wait for its answer")]
        if isinstance(parsed, ProtocolError):
            return [_error(parsed.id, parsed.code, parsed.message)]
        return self._admit(parsed)

    def _admit(self, request: FillMaskRequest) -> list[Answer]:
        if len(self.inflight) >= self.max_inflight:
            return [_error(request.id, "too_many_inflight", f"this connection already has {len(self.inflight)} "
                           "requests in flight, the most allowed; wait for answers before sending more")]
        if self.draining:
            return [_overloaded(request.id, 503, "shutting_down", SHUTTING_DOWN_RETRY_MS)]
        if not self.scheduler.alive:
            return [_overloaded(request.id, 503, "engine_stopped", ENGINE_STOPPED_RETRY_MS)]
        now = self.clock()
        deadline = None if request.deadline_ms is None else now + request.deadline_ms / 1000
        job = Job(request, self, now, deadline)
        admission = self.scheduler.submit(job)
        if admission is Admission.STOPPED:
            return [_overloaded(request.id, 503, "engine_stopped", ENGINE_STOPPED_RETRY_MS)]
        if admission is not Admission.ACCEPTED:
            status = 503 if admission is Admission.QUEUE_FULL else 429
            return [_overloaded(request.id, status, admission.value, self._back_off(now))]
        self.inflight[request.id] = job
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, next(self._order), job))
        return []

    def _back_off(self, now: float) -> int:
        """The retry_after_ms of an overload refusal (§6), at most 30 s and never below the engine's
        estimate: the estimate once the client waited as it was last told; twice what it was last told
        for an early resend (see ``EARLY_GRACE_S``); what it was last told for a request of a burst's
        first moments. And the 1008 close (§12) of a client that keeps resending early.

        Early is measured against the *last* answer, as §6 says: a client that waits as that answer
        said has waited as told, even where an earlier answer told it to wait longer."""
        estimate = self.scheduler.retry_after_ms()
        waited = now >= self._wait_until
        if waited or now - self._last_refusal > QUIET_S:
            self._burst_start = now  # a new burst: once the client waited as told, or after a quiet spell
        self._last_refusal = now
        if waited:
            retry = estimate
        elif now - self._burst_start > EARLY_GRACE_S:
            retry = max(estimate, 2 * self._told_ms)
            self._early.append(now)
            while self._early and self._early[0] < now - EARLY_WINDOW_S:
                self._early.popleft()
            if len(self._early) >= EARLY_RESENDS_LIMIT and self.close_request is None:
                self.close_request = (POLICY_VIOLATION, RESENDER_REASON)
        else:  # on its way before the client could know
            retry = max(estimate, self._told_ms)
        retry = min(MAX_RETRY_AFTER_MS, retry)
        self._told_ms = retry
        self._wait_until = now + retry / 1000
        return retry

    def _cancel(self, request_id: RequestId) -> list[Answer]:
        """§5: a queued request is removed and answered ``cancelled``; otherwise nothing happens."""
        job = self.inflight.get(request_id)
        if job is None or not self.scheduler.withdraw(job):
            return []
        del self.inflight[request_id]
        return [Answer(encode_cancelled(request_id), "cancelled")]

    # --- input: the engine's outcome for one of this session's jobs --------------------------------

    def on_outcome(self, outcome: Outcome) -> Answer | None:
        """The terminal answer for ``outcome``'s job; None when the connection has closed (dropped)."""
        job = outcome.job
        if self.closed:
            if job not in self._orphans:
                raise DoubleAnswer(f"an answer for request {job.request.id!r} after its connection closed, "
                                   "which it had no claim to")
            self._orphans.discard(job)
            return None
        request_id = job.request.id
        if self.inflight.get(request_id) is not job:
            raise DoubleAnswer(f"a second terminal answer for request {request_id!r}: {type(outcome).__name__}")
        del self.inflight[request_id]
        return _encode(outcome)

    # --- input: the clock ------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When ``expire`` next has work (a deadline of a request still in flight), or None."""
        while self._deadlines and self.inflight.get(self._deadlines[0][2].request.id) is not self._deadlines[0][2]:
            heapq.heappop(self._deadlines)  # answered already
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self) -> list[Answer]:
        """504 for every request whose deadline has passed while the engine had not started it (§6);
        one whose batch has started is left alone and gets its result."""
        now = self.clock()
        answers = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, job = heapq.heappop(self._deadlines)
            request_id = job.request.id
            if self.inflight.get(request_id) is job and self.scheduler.withdraw(job):
                del self.inflight[request_id]
                answers.append(_encode(Expired(job, (now - job.arrival) * 1000, self.scheduler.retry_after_ms())))
        return answers

    # --- lifecycle ---------------------------------------------------------------------------------------

    def shut_down(self) -> None:
        """The server drains (§10): every request from now on is answered 503 ``shutting_down``."""
        self.draining = True

    def close(self) -> int:
        """The connection is gone: withdraw what the engine has not started; how many were withdrawn
        (dropped, §8). Idempotent."""
        if self.closed:
            return 0
        self.closed = True
        withdrawn = 0
        for job in self.inflight.values():
            if self.scheduler.withdraw(job):
                withdrawn += 1
            else:
                self._orphans.add(job)
        self.inflight.clear()
        self._deadlines.clear()
        return withdrawn


def _encode(outcome: Outcome) -> Answer:
    """The frame for an outcome, labelled for the metrics by the outcome's type (never by parsing it)."""
    request_id = outcome.job.request.id
    if isinstance(outcome, Result):
        return Answer(encode_result(request_id, outcome.predictions_json, outcome.queue_ms, outcome.inference_ms,
                                    outcome.batch_size, outcome.batch_tokens, outcome.batch_id,
                                    outcome.job.target_notes), "result")
    if isinstance(outcome, Rejected):
        return _error(request_id, outcome.code, outcome.message)
    if isinstance(outcome, Failed):
        return _error(request_id, "internal_error", outcome.message)
    if isinstance(outcome, Expired):
        return _overloaded(request_id, 504, "deadline_exceeded", outcome.retry_after_ms, outcome.queue_ms)
    assert isinstance(outcome, Stopped)
    return _overloaded(request_id, 503, outcome.reason, outcome.retry_after_ms)


def _error(request_id: RequestId | None, code: str, message: str) -> Answer:
    return Answer(encode_error(request_id, code, message), "error", code)


def _overloaded(request_id: RequestId, status: int, reason: str, retry_after_ms: int,
                queue_ms: float | None = None) -> Answer:
    return Answer(encode_overloaded(request_id, status, reason, retry_after_ms, queue_ms), "overloaded", reason)
