"""The sans-I/O session (session.py) as a hypothesis state machine: any sequence the websockets shell
(server.py) can feed one connection's ``Session`` keeps protocol.md §3 and §5–§8.

The machine drives one ``Session`` with a stand-in ``Scheduler`` (the engine: it accepts, refuses with
``queue_full`` or ``queue_share``, answers ``engine_stopped``, moves its jobs through the stages of
jobs.py's table and hands their outcomes over later, in any order), as the shell does:

- ``receive`` of text (and binary) frames: valid ``fill_mask`` requests with a small pool of ids (``0``
  and ``"0"`` among them, an integer at 2^53−1, a string of ``max_id_chars`` code points), with and
  without ``top_k``, ``targets`` and ``deadline_ms`` (left out or sent as null), with a key given twice
  or an unknown field holding a lone surrogate or ``1e400`` (valid all the same, §1, §14), and sent
  again and again while the engine refuses (in bursts, early, after waiting as told, and a storm of
  resends that §12 closes with 1008, which the machine then closes as the shell does); frames with one defect
  under a valid id (every field error of §3, ``type`` missing or unknown, a lone surrogate, a number past
  a double's range, text longer than ``max_text_chars``); frames without a valid id (not JSON, too
  deep, not an object, binary, ``id`` missing, null, a boolean, ``7.0``, past 2^53); cancels, valid and
  not, for ids in flight and not; ``subscribe_stats`` / ``unsubscribe_stats``, valid and not, with an
  id in flight in them;
- the engine's outcomes (``Result``, ``Rejected``, ``Failed``, ``Expired`` by its own scheduler,
  ``Stopped`` when it dies or a drain runs out of time), delivered through ``on_outcome`` while the
  connection is open and after it closed; the clock moving and ``expire``; ``shut_down`` (drain) and
  ``close`` (more than once). Pings are the WebSocket layer's control frames, and oversize frames (1009)
  its business too: neither reaches a session.

Checked after every step and at the end of every run:

- every frame the session returns is one JSON object valid against the closed schema of its type
  (``protocol/schemas``, limits bound from the hello such a server sends; tests/contract.py), labelled
  for the metrics by its own type and code;
- the answers to each frame are exactly the ones §3's order of the checks gives (duplicate_id before
  any other error of a frame with an id in flight; too_many_inflight, then shutting_down, then
  engine_stopped, then the engine's refusals), and the retry_after_ms of ``queue_full``/``queue_share``
  follows §6's back-off (and §12's close after 200 early refusals within 10 s, and only then); a frame
  that is refused never reaches the engine, and a duplicate leaves the request in flight under that id
  as it was;
- ``inflight`` is exactly the set of accepted, unanswered ids (each with its own job), never more than
  the limit; ``next_deadline`` is the earliest deadline ``expire`` still has to look at;
- every accepted request ends exactly once (§8): its terminal frame (result, error, overloaded or
  cancelled), or dropped because its connection closed (withdrawn by ``close``, counted in what it
  returns, or its outcome dropped once when it arrives); ids come back verbatim, and may be used again
  once answered;
- after ``close`` nothing is answered, and a true double delivery still raises ``DoubleAnswer`` (a
  run never makes one: each outcome is delivered once).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from fillmask_server.core import SERVER_FAILED, Admission
from fillmask_server.jobs import Event, Expired, Failed, Job, Outcome, Rejected, Result, State, Stopped, advance, can
from fillmask_server.protocol import (
    MAX_SAFE_INTEGER,
    RESENDER_REASON,
    FillMaskRequest,
    Limits,
    RequestId,
    encode_hello,
)
from fillmask_server.session import Answer, DoubleAnswer, Session
from tests.contract import SERVER_SCHEMAS, TERMINAL_TYPES, Contract
from tests.test_session import Clock

LIMITS = Limits(mask_token="[MASK]", max_text_chars=40, max_masks=2, top_k_max=10, max_targets=3,
                max_target_chars=8, max_id_chars=8, max_deadline_ms=10_000)
MAX_INFLIGHT = 3
CONTRACT = Contract(orjson.loads(encode_hello(
    "fillmask-server/0.1.0", "tiny", True, LIMITS,
    {"max_batch_size": 64, "max_batch_tokens": 8192, "max_queue": 1024, "max_tokens": 512, "max_frame_bytes": 65536,
     "max_result_bytes": 1_048_576, "max_inflight_per_connection": MAX_INFLIGHT},
    {"forward": "traced", "head": "masks", "layout": "packed", "device": "cpu", "dtype": "float32"})))

# §6 and §12, as protocol.md states them.
GRACE_S, QUIET_S, MAX_RETRY_MS, EARLY_LIMIT, EARLY_WINDOW_S = 0.2, 1.0, 30_000, 200, 10.0
DRAIN_RETRY_MS = STOPPED_RETRY_MS = 1000
RARE = 4  # the steps that end a connection's ordinary life (close, drain, a dead engine) act once in RARE

IDS: list[RequestId] = [0, 1, -7, MAX_SAFE_INTEGER, "0", "a", "é🗼", "x" * 8]
TEXTS = ["a [MASK] b", "[MASK]", "[MASK] and [MASK]", "é🗼 [MASK]".ljust(40, "z")]
PREDICTIONS = b'[{"score":0.5,"token":7,"token_str":"x","sequence":"a x b"}]'
#: Codes the tokenizer stage refuses an accepted request with (intake.py).
REJECT_CODES = ["internal_error", "invalid_field", "text_too_long", "no_mask", "too_many_masks", "invalid_targets",
                "result_too_large"]
#: One defect of a fill_mask frame with a valid id: its code, and members replaced by raw JSON (None: left out).
DEFECTS: list[tuple[str, dict[str, str | None]]] = [
    ("missing_field", {"type": None}),
    ("unknown_type", {"type": '"bogus"'}),
    ("unknown_type", {"type": "3"}),
    ("unknown_type", {"type": '"FILL_MASK"'}),
    ("unknown_type", {"type": '"fill_mask\\r\\n\\u2028\\u0085\\ud800' + "y" * 40 + '"'}),
    ("missing_field", {"text": None}),
    ("invalid_field", {"text": "5"}),
    ("invalid_field", {"text": "null"}),
    ("invalid_field", {"text": '"\\ud800 [MASK]"'}),
    ("text_too_long", {"text": orjson.dumps("[MASK]" + "x" * 35).decode()}),
    ("no_mask", {"text": '""'}),
    ("no_mask", {"text": '"a [mask] b"'}),
    ("too_many_masks", {"text": '"[MASK][MASK][MASK]"'}),
    ("invalid_top_k", {"top_k": "0"}),
    ("invalid_top_k", {"top_k": "11"}),
    ("invalid_top_k", {"top_k": "5.0"}),
    ("invalid_top_k", {"top_k": "true"}),
    ("invalid_top_k", {"top_k": "1e400"}),
    ("invalid_top_k", {"top_k": '"5"'}),
    ("invalid_targets", {"targets": "[]"}),
    ("invalid_targets", {"targets": '[" "]'}),
    ("invalid_targets", {"targets": '"xxxxxxxxx"'}),
    ("invalid_targets", {"targets": "[1]"}),
    ("invalid_targets", {"targets": '["a","b","c","d"]'}),
    ("invalid_targets", {"targets": '["\\ud800"]'}),
    ("invalid_deadline", {"deadline_ms": "0"}),
    ("invalid_deadline", {"deadline_ms": "-1"}),
    ("invalid_deadline", {"deadline_ms": "10000.5"}),
    ("invalid_deadline", {"deadline_ms": "true"}),
    ("invalid_deadline", {"deadline_ms": "1e400"}),
    ("invalid_deadline", {"deadline_ms": '"5"'}),
]
#: Ids that are not valid (§3), as JSON text.
BAD_IDS = ["null", "true", "0.0", "1.0", "-7.0", "1e1", '""', '"xxxxxxxxx"', str(MAX_SAFE_INTEGER + 1),
           str(-MAX_SAFE_INTEGER - 1), "18446744073709551616", "1e400", "[0]", "{}", '"\\ud800"']
#: Frames without a valid id, and their code: answered with id null whatever is in flight.
IDLESS: list[tuple[str, str | bytes]] = [
    ("binary_frame", b'{"type":"fill_mask","id":0,"text":"a [MASK] b"}'),
    ("binary_frame", b"\xff\x00"),
    ("invalid_json", "not json"),
    ("invalid_json", ""),
    ("invalid_json", '{"type":"fill_mask","id":0'),
    ("invalid_json", '{"type":"fill_mask","id":NaN}'),
    ("invalid_json", "[" * 1025 + "]" * 1025),
    ("not_an_object", "[0]"),
    ("not_an_object", '"a"'),
    ("not_an_object", "null"),
    ("missing_field", "{}"),
    ("missing_field", '{"type":"fill_mask","text":"a [MASK] b"}'),
    ("missing_field", '{"type":"cancel"}'),
    *[("invalid_id", f'{{"type":"fill_mask","id":{raw},"text":"a [MASK] b"}}') for raw in BAD_IDS],
    *[("invalid_id", f'{{"type":"cancel","id":{raw}}}') for raw in BAD_IDS],
    *[("unknown_type", f'{{"type":"bogus","id":{raw}}}') for raw in BAD_IDS[:4]],
    *[("missing_field", f'{{"id":{raw}}}') for raw in BAD_IDS[:4]],
]
#: Stats frames (§13), optionally with an id: the interval they leave (None: unsubscribed), or "error".
STATS: list[tuple[str, int | str | None]] = [
    ('"type":"subscribe_stats"', 1000),
    ('"type":"subscribe_stats","interval_ms":null', 1000),
    ('"type":"subscribe_stats","interval_ms":250', 250),
    ('"type":"subscribe_stats","interval_ms":10000', 10_000),
    ('"type":"subscribe_stats","interval_ms":249', "error"),
    ('"type":"subscribe_stats","interval_ms":10001', "error"),
    ('"type":"subscribe_stats","interval_ms":1000.0', "error"),
    ('"type":"subscribe_stats","interval_ms":"1000"', "error"),
    ('"type":"subscribe_stats","interval_ms":true', "error"),
    ('"type":"unsubscribe_stats"', None),
]
#: Moves the engine makes by itself (withdrawn is decided outside the stages: cancel, deadline, close).
ENGINE_EVENTS = [Event.CHECKED, Event.REJECTED, Event.FAILED, Event.BATCHED, Event.EXPIRED, Event.FORWARDED,
                 Event.DECODED]

Key = tuple[str, Any, Any]  # a frame as (type, id, code or reason)


class StandInEngine:
    """The ``Scheduler`` a session sees, and the engine's side of its jobs: moves them through jobs.py's
    table (under the same rules as the core: withdrawn only before the model has a job, expired only
    once its deadline has passed) and keeps their outcomes *in transit* until the shell delivers them."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.alive = True
        self.admission = Admission.ACCEPTED  # what ``submit`` answers while alive
        self.estimate_ms = 42
        self.jobs: list[Job] = []
        self.submitted = 0
        self.in_transit: list[Outcome] = []
        self.delivered: list[Outcome] = []
        self.batches = 0

    def submit(self, job: Job) -> Admission:
        self.submitted += 1
        assert job.state is State.TOKENIZING
        if not self.alive:
            return Admission.STOPPED
        if self.admission is Admission.ACCEPTED:
            self.jobs.append(job)
        return self.admission

    def withdraw(self, job: Job) -> bool:
        if not can(job, Event.WITHDRAWN):
            return False
        advance(job, Event.WITHDRAWN)
        return True

    def retry_after_ms(self) -> int:
        return self.estimate_ms

    def live(self) -> list[Job]:
        return [job for job in self.jobs if job.state is not State.DONE]

    def moves(self, job: Job) -> list[Event]:
        return [event for event in ENGINE_EVENTS if can(job, event) and (
            event is not Event.EXPIRED or (job.deadline is not None and job.deadline <= self.clock.now))]

    def move(self, job: Job, event: Event, code: str = "no_mask") -> None:
        advance(job, event)
        if event is Event.CHECKED and job.request.targets:
            job.target_notes = ((job.request.targets[0], None),)
        if job.state is not State.DONE:
            return
        now = self.clock.now
        outcome: Outcome
        if event is Event.REJECTED:
            outcome = Rejected(job, code, f"refused: {code}")
        elif event is Event.FAILED:
            outcome = Failed(job, SERVER_FAILED)
        elif event is Event.EXPIRED:
            outcome = Expired(job, (now - job.arrival) * 1000, self.estimate_ms)
        else:
            assert event is Event.DECODED
            self.batches += 1
            outcome = Result(job, PREDICTIONS, (now - job.arrival) * 1000, 2.25, 1, 8, self.batches)
        self.in_transit.append(outcome)

    def run_to_end(self, job: Job) -> None:
        while job.state is not State.DONE:
            self.move(job, next(event for event in (Event.CHECKED, Event.BATCHED, Event.FORWARDED, Event.DECODED)
                                if can(job, event)))

    def die(self) -> None:
        """``EngineCore.stop_all``: the started jobs fail, the waiting ones are answered engine_stopped."""
        self.alive = False
        for job in self.live():
            if job.state in (State.RUNNING, State.DECODING):
                advance(job, Event.FAILED)
                self.in_transit.append(Failed(job, SERVER_FAILED))
        for job in self.live():
            advance(job, Event.WITHDRAWN)
            self.in_transit.append(Stopped(job, "engine_stopped", STOPPED_RETRY_MS))

    def withdraw_all(self) -> None:
        """``Engine.withdraw_all``: the drain ran out of time."""
        for job in self.live():
            if can(job, Event.WITHDRAWN):
                advance(job, Event.WITHDRAWN)
                self.in_transit.append(Stopped(job, "shutting_down", DRAIN_RETRY_MS))


@dataclass(eq=False)
class Ticket:
    """The model's record of one accepted request."""

    id: RequestId
    job: Job
    seq: int
    deadline_pending: bool  # expire has yet to look at its deadline
    ends: list[str] = field(default_factory=list)  # its terminal frame's type, or "dropped"

    def end(self, how: str) -> None:
        self.ends.append(how)
        assert len(self.ends) == 1, f"request {self.id!r} ended twice: {self.ends}"


@dataclass
class BackOff:
    """§6's back-off as protocol.md states it: what a connection was last told, and its bursts."""

    told_ms: int = 0
    wait_until: float = -math.inf
    burst_start: float = -math.inf
    last_refusal: float = -math.inf
    early: list[float] = field(default_factory=list)
    close_due: bool = False  # §12: EARLY_LIMIT early refusals within EARLY_WINDOW_S close the connection

    def check(self, now: float, estimate: int, told: int) -> None:
        waited = now >= self.wait_until
        if waited or now - self.last_refusal > QUIET_S:
            self.burst_start = now  # a new burst
        self.last_refusal = now
        if waited:  # starts over from the server's estimate
            assert told == estimate, (told, estimate)
        elif now - self.burst_start > GRACE_S:  # early: twice what it was last told
            assert told == min(MAX_RETRY_MS, max(estimate, 2 * self.told_ms)), (told, estimate, self.told_ms)
            self.early = [*(t for t in self.early if t >= now - EARLY_WINDOW_S), now]
            self.close_due = self.close_due or len(self.early) >= EARLY_LIMIT
        else:  # on its way before the client could know: not early, not doubled
            assert min(MAX_RETRY_MS, estimate) <= told <= max(estimate, self.told_ms), (told, estimate, self.told_ms)
        self.told_ms = told
        self.wait_until = now + told / 1000


F = TypeVar("F", bound=Callable[..., Any])


def step(method: F) -> F:
    """Mark the machine busy while ``method`` runs: a step that raised leaves it so, and ``teardown``
    then leaves the failure as it was (its own checks would only hide it)."""

    @functools.wraps(method)
    def wrapped(self: SessionMachine, *args: Any, **kwargs: Any) -> Any:
        self.in_step = True
        value = method(self, *args, **kwargs)
        self.in_step = False
        return value

    return wrapped  # type: ignore[return-value]


def frame_text(members: dict[str, str | None]) -> str:
    return "{" + ",".join(f'"{name}":{raw}' for name, raw in members.items() if raw is not None) + "}"


def check_answer(answer: Answer) -> dict[str, Any]:
    """One answer as the client reads it: a valid server frame of a terminal type, labelled by itself."""
    assert isinstance(answer.frame, bytes)
    frame = orjson.loads(answer.frame)
    assert isinstance(frame, dict)
    problems = CONTRACT.problems(frame, SERVER_SCHEMAS)
    assert problems == [], (frame, problems)
    assert frame["type"] in TERMINAL_TYPES
    assert (answer.outcome, answer.code) == (frame["type"], frame.get("code", frame.get("reason", ""))), answer
    return frame


def key(frame: dict[str, Any]) -> Key:
    return frame["type"], frame["id"], frame.get("code", frame.get("reason"))


def same_id(got: Any, expected: Any) -> bool:
    """Echoed verbatim: the same JSON type and value (0 is not "0", nor False)."""
    return type(got) is type(expected) and got == expected


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.in_step = False
        self.clock = Clock()
        self.engine = StandInEngine(self.clock)
        self.session = Session(LIMITS, self.engine, MAX_INFLIGHT, self.clock)
        self.inflight: dict[RequestId, Ticket] = {}
        self.tickets: list[Ticket] = []
        self.by_job: dict[Job, Ticket] = {}
        self.orphans: set[Ticket] = set()  # on the model when the connection closed: dropped on arrival
        self.draining = False
        self.closed = False
        self.stats: int | None = None
        self.back_off = BackOff()

    # --- helpers ------------------------------------------------------------------------------------------

    def receive(self, data: str | bytes, expected: list[Key] | None) -> list[dict[str, Any]]:
        """Feed one message; its answers must be ``expected`` (None: the caller checks them). Nothing in
        flight moves, and a refused frame never reaches the engine."""
        before = {rid: (ticket.job, ticket.job.state) for rid, ticket in self.inflight.items()}
        submitted = self.engine.submitted
        frames = [check_answer(answer) for answer in self.session.receive(data)]
        if expected is not None:
            assert [key(frame) for frame in frames] == expected, (data, frames)
            for frame, (_, rid, _) in zip(frames, expected, strict=True):
                assert same_id(frame["id"], rid), (frame, rid)
            assert self.engine.submitted == submitted, data
            assert {rid: (job, job.state) for rid, job in self.session.inflight.items()} == before, data
        return frames

    def do_close(self) -> None:
        withdrawn = 0
        if not self.closed:
            for ticket in self.inflight.values():
                if can(ticket.job, Event.WITHDRAWN):
                    withdrawn += 1
                    ticket.end("dropped")
                else:
                    self.orphans.add(ticket)
        assert self.session.close() == withdrawn
        self.closed = True
        self.inflight.clear()

    def answered(self, ticket: Ticket, frame: dict[str, Any]) -> None:
        assert not self.closed
        assert self.inflight.pop(ticket.id) is ticket
        assert same_id(frame["id"], ticket.id), (frame, ticket.id)
        ticket.end(frame["type"])

    def deliver(self, index: int) -> None:
        outcome = self.engine.in_transit.pop(index)
        self.engine.delivered.append(outcome)
        ticket = self.by_job[outcome.job]
        answer = self.session.on_outcome(outcome)
        if self.closed:
            assert answer is None, answer
            self.orphans.remove(ticket)
            ticket.end("dropped")
            return
        assert answer is not None
        frame = check_answer(answer)
        rid = ticket.id
        if isinstance(outcome, Result):
            assert key(frame) == ("result", rid, None)
            assert frame["predictions"] == orjson.loads(PREDICTIONS)
            assert frame["batch_id"] == outcome.batch_id and frame["queue_ms"] == round(outcome.queue_ms, 3)
            notes = [{"given": given, "scored": scored} for given, scored in outcome.job.target_notes]
            assert frame.get("targets", []) == notes
        elif isinstance(outcome, Rejected):
            assert key(frame) == ("error", rid, outcome.code) and frame["message"] == outcome.message
        elif isinstance(outcome, Failed):
            assert key(frame) == ("error", rid, "internal_error") and frame["message"] == outcome.message
        elif isinstance(outcome, Expired):
            assert key(frame) == ("overloaded", rid, "deadline_exceeded") and frame["status"] == 504
            assert frame["queue_ms"] == round(outcome.queue_ms, 3) and frame["retry_after_ms"] == outcome.retry_after_ms
        else:
            assert key(frame) == ("overloaded", rid, outcome.reason) and frame["status"] == 503
            assert frame["retry_after_ms"] == outcome.retry_after_ms
        self.answered(ticket, frame)

    # --- the client's frames ----------------------------------------------------------------------------

    @rule(rid=st.sampled_from(IDS), text=st.sampled_from(TEXTS), top_k=st.sampled_from([None, 1, 10]),
          given_targets=st.sampled_from([None, "w", ["a", "b c", "é"]]),
          deadline_ms=st.sampled_from([None, 0.5, 20, 150, 1000.5, 10_000]), nulls=st.booleans(),
          prefix=st.sampled_from(["", '"id":true', '"type":"cancel"', '"text":5']),
          extra=st.sampled_from(["", '"x":"\\ud800"', '"x":1e400', '"\\ud800":[[{}]]']))
    @step
    def fill_mask(self, rid: RequestId, text: str, top_k: int | None, given_targets: str | list[str] | None,
                  deadline_ms: float | None, nulls: bool, prefix: str, extra: str) -> None:
        """A valid request: accepted, or refused by the first check of §3's order that applies. A key
        given twice takes its last value; a lone surrogate or a number past a double's range in a field
        the protocol does not name is ignored like the field (§1, §14)."""
        self.send_fill_mask(rid, text, top_k, given_targets, deadline_ms, nulls, prefix, extra)

    @rule(rid=st.sampled_from(IDS), deadline_ms=st.sampled_from([None, 20, 150]))
    @step
    def plain_fill_mask(self, rid: RequestId, deadline_ms: float | None) -> None:
        """The same, plainer and more often: the connection's ordinary traffic."""
        self.send_fill_mask(rid, TEXTS[0], None, None, deadline_ms, False)

    @rule(rid=st.sampled_from(IDS), gaps=st.lists(st.sampled_from([0.0005, 0.05, 0.3, 0.9, 1.5, 4.0]), min_size=1,
                                                  max_size=6))
    @step
    def fill_mask_again_and_again(self, rid: RequestId, gaps: list[float]) -> None:
        """A client sending again and again, ``gaps`` seconds apart: early, in a burst, after a quiet spell
        or after waiting as told (§6's back-off, while the engine refuses)."""
        for seconds in gaps:
            self.clock.now += seconds
            self.send_fill_mask(rid, TEXTS[1], None, None, None, False)

    @precondition(lambda self: not self.closed)
    @rule(dice=st.integers(0, 2 * RARE - 1))
    @step
    def resender_storm(self, dice: int) -> None:
        """The queue is full and a client resends every 10 ms regardless (§12): closed with 1008 after
        EARLY_LIMIT early refusals."""
        if dice == 0:
            self.engine.admission = Admission.QUEUE_FULL
            for _ in range(EARLY_LIMIT + 30):
                self.clock.now += 0.01
                self.send_fill_mask("x" * 8, TEXTS[0], None, None, None, False)
            if self.engine.estimate_ms > 10:  # (told 10 ms, it waits as told)
                assert (self.closed or not self.engine.alive or self.draining or "x" * 8 in self.inflight
                        or len(self.inflight) >= MAX_INFLIGHT)  # (or it was never refused for the queue)

    def send_fill_mask(self, rid: RequestId, text: str, top_k: int | None, given_targets: str | list[str] | None,
                       deadline_ms: float | None, nulls: bool, prefix: str = "", extra: str = "") -> None:
        """Send a valid fill_mask (``prefix`` and ``extra``: members that leave it valid, before and after
        its own) and check its answers; then the shell's part: a close the session asks for (§12)."""
        self._send_fill_mask(rid, text, top_k, given_targets, deadline_ms, nulls, prefix, extra)
        if self.session.close_request is not None and not self.closed:
            assert self.session.close_request == (1008, RESENDER_REASON)
            self.do_close()

    def _send_fill_mask(self, rid: RequestId, text: str, top_k: int | None, given_targets: str | list[str] | None,
                        deadline_ms: float | None, nulls: bool, prefix: str, extra: str) -> None:
        frame: dict[str, Any] = {"type": "fill_mask", "id": rid, "text": text}
        for name, value in (("top_k", top_k), ("targets", given_targets), ("deadline_ms", deadline_ms)):
            if value is not None or nulls:
                frame[name] = value
        data = orjson.dumps(frame).decode()
        data = "{" + prefix + ("," if prefix else "") + data[1:-1] + ("," if extra else "") + extra + "}"
        now = self.clock.now
        refusal: Key | None = None
        if self.closed:
            self.receive(data, [])
            return
        if rid in self.inflight:
            refusal = ("error", rid, "duplicate_id")
        elif len(self.inflight) >= MAX_INFLIGHT:
            refusal = ("error", rid, "too_many_inflight")
        elif self.draining:
            refusal = ("overloaded", rid, "shutting_down")
        elif not self.engine.alive:
            refusal = ("overloaded", rid, "engine_stopped")
        if refusal is not None:
            frames = self.receive(data, [refusal])
            if refusal[0] == "overloaded":
                assert (frames[0]["status"], frames[0]["retry_after_ms"]) == (503, DRAIN_RETRY_MS)
            return
        submitted, jobs = self.engine.submitted, len(self.engine.jobs)
        admission = self.engine.admission
        frames = self.receive(data, None)
        assert self.engine.submitted == submitted + 1
        if admission is not Admission.ACCEPTED:
            assert len(self.engine.jobs) == jobs and rid not in self.session.inflight
            reason = admission.value
            assert [key(f) for f in frames] == [("overloaded", rid, reason)]
            status = {"queue_full": 503, "queue_share": 429, "engine_stopped": 503}[reason]
            assert frames[0]["status"] == status and same_id(frames[0]["id"], rid)
            if admission is Admission.STOPPED:
                assert frames[0]["retry_after_ms"] == STOPPED_RETRY_MS
            else:
                self.back_off.check(now, self.engine.estimate_ms, frames[0]["retry_after_ms"])
            return
        assert frames == []
        (job,) = self.engine.jobs[jobs:]
        assert self.session.inflight[rid] is job and job.owner is self.session and job.arrival == now
        expected_targets = (None if given_targets is None else (given_targets,) if isinstance(given_targets, str)
                            else tuple(given_targets))
        assert job.request == FillMaskRequest(rid, text, 5 if top_k is None else top_k, expected_targets,
                                              None if deadline_ms is None else float(deadline_ms))
        assert job.deadline == (None if deadline_ms is None else now + deadline_ms / 1000)
        ticket = Ticket(rid, job, len(self.tickets), deadline_ms is not None)
        self.tickets.append(ticket)
        self.by_job[job] = ticket
        self.inflight[rid] = ticket

    @rule(rid=st.sampled_from(IDS), defect=st.sampled_from(DEFECTS))
    @step
    def fill_mask_with_a_defect(self, rid: RequestId, defect: tuple[str, dict[str, str | None]]) -> None:
        """A frame with a valid id and one thing wrong: that error under its id, or duplicate_id while the
        id is in flight, whatever is wrong (§3 step 2)."""
        code, changes = defect
        members: dict[str, str | None] = {"type": '"fill_mask"', "id": orjson.dumps(rid).decode(),
                                          "text": '"a [MASK] b"', **changes}
        if self.closed:
            self.receive(frame_text(members), [])
        else:
            self.receive(frame_text(members), [("error", rid, "duplicate_id" if rid in self.inflight else code)])

    @rule(garbage=st.sampled_from(IDLESS))
    @step
    def frame_without_a_valid_id(self, garbage: tuple[str, str | bytes]) -> None:
        """One error with id null (§7): never duplicate_id, never about a request in flight."""
        code, data = garbage
        self.receive(data, [] if self.closed else [("error", None, code)])

    @rule(rid=st.sampled_from(IDS), extra=st.sampled_from(["", ',"top_k":0', ',"text":5']))
    @step
    def cancel(self, rid: RequestId, extra: str) -> None:
        """§5: a request the engine has not started is answered cancelled; otherwise nothing is sent."""
        data = f'{{"type":"cancel","id":{orjson.dumps(rid).decode()}{extra}}}'
        ticket = None if self.closed else self.inflight.get(rid)
        if ticket is None or not can(ticket.job, Event.WITHDRAWN):
            self.receive(data, [])
            return
        (frame,) = self.receive(data, None)
        assert frame == {"type": "cancelled", "id": rid} and same_id(frame["id"], rid)
        assert ticket.job.state is State.DONE
        self.answered(ticket, frame)

    @rule(stats=st.sampled_from(STATS), rid=st.sampled_from([None, *IDS]))
    @step
    def stats_frame(self, stats: tuple[str, int | str | None], rid: RequestId | None) -> None:
        """§13: not requests; an id in them is ignored, even one in flight."""
        members, interval = stats
        if rid is not None:
            members += f',"id":{orjson.dumps(rid).decode()}'
        if self.closed:
            self.receive("{" + members + "}", [])
        elif interval == "error":
            self.receive("{" + members + "}", [("error", None, "invalid_field")])
        else:
            self.receive("{" + members + "}", [])
            assert not isinstance(interval, str)
            self.stats = interval

    # --- the engine ---------------------------------------------------------------------------------------

    @rule(admission=st.sampled_from([Admission.ACCEPTED, Admission.ACCEPTED, Admission.QUEUE_FULL,
                                     Admission.QUEUE_SHARE, Admission.STOPPED]),
          estimate_ms=st.sampled_from([42, 10, 400, 1000, 30_000]))
    @step
    def engine_admits(self, admission: Admission, estimate_ms: int) -> None:
        """What the engine answers the next submits with (STOPPED while still alive: it died meanwhile)."""
        self.engine.admission, self.engine.estimate_ms = admission, estimate_ms

    @precondition(lambda self: bool(self.engine.live()))
    @rule(pick=st.integers(0, 63), choice=st.integers(0, 7), code=st.sampled_from(REJECT_CODES))
    @step
    def engine_moves_a_job(self, pick: int, choice: int, code: str) -> None:
        """One stage moves one of its jobs (of an open or a closed connection); a job that reaches DONE has
        its outcome in transit."""
        live = self.engine.live()
        job = live[pick % len(live)]
        moves = self.engine.moves(job)
        self.engine.move(job, moves[choice % len(moves)], code)

    @precondition(lambda self: bool(self.engine.in_transit))
    @rule(pick=st.integers(0, 63))
    @step
    def outcome_arrives(self, pick: int) -> None:
        """The shell hands one outcome to the session (outcomes of different jobs arrive in any order)."""
        self.deliver(pick % len(self.engine.in_transit))

    @precondition(lambda self: bool(self.engine.live()))
    @rule(pick=st.integers(0, 63))
    @step
    def engine_answers_a_job(self, pick: int) -> None:
        """A job runs to its result, which arrives at once (the common case, and a quicker one to reach)."""
        live = self.engine.live()
        self.engine.run_to_end(live[pick % len(live)])
        self.deliver(len(self.engine.in_transit) - 1)

    @precondition(lambda self: self.engine.alive)
    @rule(dice=st.integers(0, 2 * RARE - 1))
    @step
    def engine_dies(self, dice: int) -> None:
        """For good (§6): the started jobs fail, the others are answered engine_stopped."""
        if dice == 0:
            self.engine.die()

    @precondition(lambda self: self.draining)
    @rule()
    @step
    def drain_runs_out_of_time(self) -> None:
        self.engine.withdraw_all()

    # --- the clock and the connection's life ---------------------------------------------------------------

    @rule(seconds=st.sampled_from([0.0005, 0.01, 0.05, 0.15, 0.5, 1.2, 11.0]))
    @step
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule()
    @step
    def deadline_timer(self) -> None:
        """§6 504: every request whose deadline has passed and that the engine has not started."""
        now = self.clock.now
        due = sorted((t for t in self.inflight.values()
                      if t.deadline_pending and t.job.deadline is not None and t.job.deadline <= now),
                     key=lambda t: (t.job.deadline, t.seq))
        expired = []
        for ticket in due:
            ticket.deadline_pending = False
            if can(ticket.job, Event.WITHDRAWN):
                expired.append(ticket)
        frames = [check_answer(answer) for answer in self.session.expire()]
        assert [key(frame) for frame in frames] == [("overloaded", t.id, "deadline_exceeded") for t in expired]
        for frame, ticket in zip(frames, expired, strict=True):
            assert frame["status"] == 504 and frame["retry_after_ms"] == self.engine.estimate_ms
            assert frame["queue_ms"] == round((now - ticket.job.arrival) * 1000, 3)
            assert ticket.job.state is State.DONE
            self.answered(ticket, frame)

    @rule(dice=st.integers(0, 2 * RARE - 1))
    @step
    def shut_down(self, dice: int) -> None:
        """The server drains (§10): requests from now on are answered 503 shutting_down."""
        if dice == 0:
            self.session.shut_down()
            self.draining = True

    @rule(dice=st.integers(0, RARE - 1))
    @step
    def close(self, dice: int) -> None:
        """The connection is gone (the close frame, or the handler's end: twice is once)."""
        if dice == 0:
            self.do_close()

    # --- after every step ---------------------------------------------------------------------------------

    @invariant()
    @step
    def inflight_is_exactly_the_accepted_unanswered_requests(self) -> None:
        session = self.session
        assert session.inflight.keys() == self.inflight.keys()
        assert all(session.inflight[rid] is ticket.job for rid, ticket in self.inflight.items())
        assert len(session.inflight) <= MAX_INFLIGHT
        assert (session.closed, session.draining, session.stats_interval_ms) == (self.closed, self.draining, self.stats)
        assert (session.close_request is not None) == self.back_off.close_due
        deadlines = [ticket.job.deadline for ticket in self.inflight.values()
                     if ticket.deadline_pending and ticket.job.deadline is not None]
        assert session.next_deadline() == min(deadlines, default=None)
        unended = {ticket for ticket in self.tickets if not ticket.ends}
        assert unended == set(self.inflight.values()) | self.orphans
        assert all(len(ticket.ends) <= 1 for ticket in self.tickets)
        in_transit = {self.by_job[outcome.job] for outcome in self.engine.in_transit}
        assert len(in_transit) == len(self.engine.in_transit) and in_transit <= unended

    def teardown(self) -> None:
        """The engine runs every job it still has to its end and the shell delivers every outcome: then
        every accepted request has ended exactly once, and a second delivery is refused, not answered."""
        if self.in_step:
            return
        for job in self.engine.live():
            self.engine.run_to_end(job)
        while self.engine.in_transit:
            self.deliver(0)
        assert [ticket for ticket in self.tickets if len(ticket.ends) != 1] == []
        assert self.session.inflight == {} and not self.orphans
        assert not self.session._orphans  # each dropped once, nothing left to claim
        for outcome in self.engine.delivered[-3:]:
            with pytest.raises(DoubleAnswer):
                self.session.on_outcome(outcome)


def test_the_session_keeps_the_protocol_whatever_the_shell_feeds_it() -> None:
    run_state_machine_as_test(SessionMachine, settings=settings(
        derandomize=True, database=None, deadline=None, max_examples=250, stateful_step_count=50,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
