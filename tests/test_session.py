"""The sans-I/O session (session.py), driven without sockets, threads or an event loop.

A ``Scheduler`` stand-in plays the engine: it accepts or refuses, and lets the test move jobs as the
stages would (``take`` = the model started it). Every answer is checked as bytes on the wire would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from fillmask_server.core import Admission
from fillmask_server.jobs import Event, Expired, Failed, Job, Rejected, Result, Stopped, advance, can
from fillmask_server.protocol import RESENDER_REASON, SLOW_READER_REASON, Limits
from fillmask_server.session import Answer, DoubleAnswer, Session

LIMITS = Limits(mask_token="[MASK]", max_text_chars=100, top_k_max=10, max_deadline_ms=10_000)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """Accepts up to ``room`` jobs; ``take`` moves a job onto the model, as the stages would."""

    def __init__(self, room: int = 100) -> None:
        self.alive = True
        self.room = room
        self.share: bool = False  # answer QUEUE_SHARE instead of accepting
        self.jobs: list[Job] = []

    def submit(self, job: Job) -> Admission:
        if not self.alive:
            return Admission.STOPPED
        if self.share:
            return Admission.QUEUE_SHARE
        if len([j for j in self.jobs if can(j, Event.WITHDRAWN)]) >= self.room:
            return Admission.QUEUE_FULL
        self.jobs.append(job)
        return Admission.ACCEPTED

    def withdraw(self, job: Job) -> bool:
        if not can(job, Event.WITHDRAWN):
            return False
        advance(job, Event.WITHDRAWN)
        return True

    estimate_ms = 42

    def retry_after_ms(self) -> int:
        return self.estimate_ms

    def take(self, job: Job) -> Job:
        advance(job, Event.CHECKED)
        advance(job, Event.BATCHED)
        return job


def make(room: int = 100, max_inflight: int = 4) -> tuple[Session, Engine, Clock]:
    engine, clock = Engine(room), Clock()
    return Session(LIMITS, engine, max_inflight, clock), engine, clock


def fill(frame_id: Any, text: str = "a [MASK] b", **fields: Any) -> str:
    return orjson.dumps({"type": "fill_mask", "id": frame_id, "text": text, **fields}).decode()


def frames(answers: list[Answer]) -> list[dict[str, Any]]:
    return [orjson.loads(answer.frame) for answer in answers]


def result(job: Job) -> Result:
    return Result(job, b'[{"score":1.0}]', 1.0, 2.0, 1, 3, 7)


def test_an_accepted_request_is_silent_until_its_outcome_which_answers_it_once() -> None:
    session, engine, _ = make()
    assert session.receive(fill(1)) == []
    job = engine.jobs[0]
    answer = session.on_outcome(result(engine.take(job)))
    assert answer is not None and answer.outcome == "result"
    assert orjson.loads(answer.frame)["predictions"] == [{"score": 1.0}]
    assert session.inflight == {}
    with pytest.raises(DoubleAnswer):
        session.on_outcome(Failed(job, "again"))


def test_each_outcome_type_becomes_its_frame_and_metric_label() -> None:
    session, engine, _ = make(max_inflight=10)
    for i in range(4):
        session.receive(fill(i))
    j = engine.jobs
    answers = [session.on_outcome(o) for o in (Rejected(j[0], "no_mask", "m"), Failed(j[1], "m"),
                                                Expired(j[2], 5.0, 42), Stopped(j[3], "engine_stopped", 1000))]
    assert [(a.outcome, a.code) for a in answers if a] == [
        ("error", "no_mask"), ("error", "internal_error"), ("overloaded", "deadline_exceeded"),
        ("overloaded", "engine_stopped")]
    assert [(f["type"], f.get("status")) for f in frames([a for a in answers if a])] == [
        ("error", None), ("error", None), ("overloaded", 504), ("overloaded", 503)]


def test_an_id_in_flight_is_duplicate_id_whatever_else_is_wrong_with_the_frame() -> None:
    """§3 order of the checks: the reused id with a bad top_k must not get invalid_top_k under that id."""
    session, engine, _ = make()
    session.receive(fill(7))
    for frame in (fill(7), fill(7, top_k=0), fill(7, text="no mask"), fill(7, deadline_ms=-1),
                  orjson.dumps({"type": "nonsense", "id": 7}).decode(), orjson.dumps({"id": 7}).decode(),
                  orjson.dumps({"type": "fill_mask", "id": 7}).decode()):
        (answer,) = frames(session.receive(frame))
        assert (answer["id"], answer["code"]) == (7, "duplicate_id"), frame
    assert len(engine.jobs) == 1 and list(session.inflight) == [7]
    # A field error on a fresh id is that field's error; an id only becomes free with its terminal answer.
    assert frames(session.receive(fill(8, top_k=0)))[0]["code"] == "invalid_top_k"
    session.on_outcome(result(engine.take(engine.jobs[0])))
    assert session.receive(fill(7)) == []


def test_stats_frames_ignore_an_id_even_one_in_flight() -> None:
    """§13: subscribe_stats and unsubscribe_stats are not requests: an id in them is ignored. An invalid
    one with an id in flight got duplicate_id, a valid one nothing, and one with a fresh id an error
    under that id, which read as a request's answer (found by a protocol review)."""
    session, _, _ = make()
    session.receive(fill(1))
    assert session.receive(orjson.dumps({"type": "subscribe_stats", "id": 1, "interval_ms": 1000}).decode()) == []
    assert session.stats_interval_ms == 1000
    for frame_id in (1, "s1"):
        (answer,) = frames(session.receive(
            orjson.dumps({"type": "subscribe_stats", "id": frame_id, "interval_ms": 5}).decode()))
        assert (answer["id"], answer["code"]) == (None, "invalid_field")
    assert session.receive(orjson.dumps({"type": "unsubscribe_stats", "id": 1}).decode()) == []
    assert session.stats_interval_ms is None and list(session.inflight) == [1]


def test_order_after_the_frame_is_valid_inflight_then_draining_then_engine_then_queue() -> None:
    session, engine, _ = make(room=1, max_inflight=2)
    session.receive(fill(1))
    first = frames(session.receive(fill(2)))[0]
    assert (first["reason"], first["status"], first["retry_after_ms"]) == ("queue_full", 503, 42)
    session.receive(fill(3))  # refused (queue_full) again: nothing held
    engine.room = 5
    assert session.receive(fill(2)) == []
    assert frames(session.receive(fill(3)))[0]["code"] == "too_many_inflight"  # before draining
    session.on_outcome(result(engine.take(engine.jobs[0])))
    engine.alive = False
    assert frames(session.receive(fill(3)))[0]["reason"] == "engine_stopped"
    session.shut_down()
    assert frames(session.receive(fill(3)))[0]["reason"] == "shutting_down"  # draining comes first
    assert frames(session.receive(fill(2)))[0]["code"] == "duplicate_id"  # and the id rule before all


def test_cancel_answers_only_a_request_the_engine_has_not_started() -> None:
    session, engine, _ = make()
    session.receive(fill("q"))
    session.receive(fill("r"))
    queued, running = engine.jobs
    engine.take(running)
    assert frames(session.receive('{"type":"cancel","id":"q"}')) == [{"type": "cancelled", "id": "q"}]
    assert session.receive('{"type":"cancel","id":"r"}') == []  # running: its result stands
    assert session.receive('{"type":"cancel","id":"nope"}') == []  # not in flight: ignored
    assert list(session.inflight) == ["r"]
    with pytest.raises(DoubleAnswer):  # the cancelled job can never be answered again
        session.on_outcome(Failed(queued, "late"))


def test_deadlines_expire_queued_requests_and_leave_started_ones_alone() -> None:
    session, engine, clock = make()
    session.receive(fill("slow", deadline_ms=50))
    session.receive(fill("fast", deadline_ms=20))
    session.receive(fill("none"))
    assert session.next_deadline() == pytest.approx(100.020)
    engine.take(engine.jobs[0])  # "slow" started: never cut short
    clock.now = 100.030
    (expired,) = frames(session.expire())  # "fast" still waits for the tokenizer: §3's step 6 yields to it
    assert (expired["id"], expired["status"], expired["queue_ms"]) == ("fast", 504, pytest.approx(30.0))
    assert session.next_deadline() == pytest.approx(100.050)
    clock.now = 101.0
    assert session.expire() == []
    assert session.next_deadline() is None
    assert sorted(session.inflight) == ["none", "slow"]


def test_close_withdraws_what_waits_and_drops_later_outcomes_once() -> None:
    session, engine, _ = make()
    session.receive(fill(1))
    session.receive(fill(2))
    waiting, running = engine.jobs
    engine.take(running)
    assert session.close() == 1 and session.close() == 0
    assert session.on_outcome(result(running)) is None  # dropped: nobody to answer
    with pytest.raises(DoubleAnswer):
        session.on_outcome(result(running))
    with pytest.raises(DoubleAnswer):
        session.on_outcome(Stopped(waiting, "shutting_down", 1))
    # A message read before the client's close frame but handled after it submits nothing (its outcome
    # would have no claim to an answer) and answers nothing.
    assert session.receive(fill(3)) == [] and len(engine.jobs) == 2


def test_garbage_gets_one_error_with_a_null_id_and_costs_nothing() -> None:
    session, engine, _ = make()
    for data in (b"\x00binary", "not json", "[1]", '{"id": 1}', '{"type":"fill_mask","id":true,"text":"a [MASK]"}'):
        (answer,) = session.receive(data)
        assert answer.outcome == "error"
    assert engine.jobs == [] and session.inflight == {}


def test_a_connection_over_its_share_of_the_queue_is_told_429_queue_share() -> None:
    session, engine, _ = make()
    engine.share = True
    (answer,) = session.receive(fill(1))
    frame = orjson.loads(answer.frame)
    assert (frame["type"], frame["status"], frame["reason"]) == ("overloaded", 429, "queue_share")
    assert (answer.outcome, answer.code) == ("overloaded", "queue_share")


def test_retry_after_grows_only_for_a_client_that_does_not_wait() -> None:
    """§6 back-off: a client that waits as told keeps getting the engine's estimate; one that resends
    early is told to wait twice as long each time, up to 30 s, and eased off again once it waits."""
    session, _, clock = make(room=0)
    for i in range(5):
        clock.now += 60.0  # a patient client
        assert frames(session.receive(fill(i)))[0]["retry_after_ms"] == 42
    clock.now += 60.0
    told = []
    for i in range(36):  # an impatient one: every 10 ms, though told to wait 42 ms or more
        clock.now += 0.01
        told.append(frames(session.receive(fill(100 + i)))[0]["retry_after_ms"])
    # Its first 0.2 s are a burst already on its way (forgiven); after that each refusal doubles the wait.
    assert told[:20] == [42] * 20 and told[-5:] == [30_000] * 5 and told == sorted(told) and told[21] > 42
    clock.now += 60.0  # waited as told: back to the estimate
    assert frames(session.receive(fill("waited")))[0]["retry_after_ms"] == 42
    assert session.close_request is None


def test_early_is_measured_against_the_last_answer_and_each_early_one_doubles_it() -> None:
    """§6, found by a conformance audit: the session measured "early" against the latest of every time it
    had told, so a client that waited as the last answer said was still early (and counted toward the
    1008 close); and it doubled the engine's estimate, not what it had told, so the wait it told after
    an early resend could be shorter than the one before."""
    session, engine, clock = make(room=0)
    engine.estimate_ms = 1000
    clock.now = 100.0
    assert frames(session.receive(fill(0)))[0]["retry_after_ms"] == 1000
    engine.estimate_ms = 100  # the queue clears faster now
    clock.now += 0.3  # early: told 1000 ms, 0.3 s ago
    assert frames(session.receive(fill(1)))[0]["retry_after_ms"] == 2000  # twice what it was told, not 2 x 100
    clock.now += 0.9  # waited 0.9 s of the 2 s it was last told: early again
    assert frames(session.receive(fill(2)))[0]["retry_after_ms"] == 4000
    assert len(session._early) == 2
    clock.now += 4.0  # waited as the last answer said
    assert frames(session.receive(fill(3)))[0]["retry_after_ms"] == 100  # back to the estimate
    assert len(session._early) == 2  # not early
    engine.estimate_ms = 1000
    clock.now += 0.5
    assert frames(session.receive(fill(4)))[0]["retry_after_ms"] == 1000
    engine.estimate_ms = 50
    clock.now += 0.1  # within a burst's first 0.2 s: on its way, not early; told what it was told
    assert frames(session.receive(fill(5)))[0]["retry_after_ms"] == 1000
    clock.now += 0.2  # early
    assert frames(session.receive(fill(6)))[0]["retry_after_ms"] == 2000
    clock.now += 2.0  # waited as the last answer said
    assert frames(session.receive(fill(7)))[0]["retry_after_ms"] == 50
    assert len(session._early) == 3 and session.close_request is None


def test_a_burst_already_on_its_way_is_not_counted_against_the_client() -> None:
    """A pipelining client gets many refusals at once; those within 0.2 s of the first are requests it
    sent before it could know: no doubling, no count toward the close."""
    session, _, clock = make(room=0)
    told = []
    for i in range(256):
        clock.now += 0.0005
        told.append(frames(session.receive(fill(i)))[0]["retry_after_ms"])
    assert set(told) == {42} and session.close_request is None


def test_requests_held_back_as_told_and_sent_together_are_a_new_burst_not_early_resends() -> None:
    """A client that waits as told on one connection sends every call it held back at once when the
    wait ends (the Python client does): refused again, those are a new burst, not early resends, so its
    wait is not doubled and it is never closed; a client that does not wait still is (next test)."""
    session, _, clock = make(room=0)
    for cycle in range(30):
        told = []
        for i in range(40):  # held back, then sent together
            clock.now += 0.0005
            told.append(frames(session.receive(fill(f"{cycle}-{i}")))[0]["retry_after_ms"])
        assert set(told) == {42}, (cycle, told)
        clock.now += 0.043  # waits as told
    assert session.close_request is None and not session._early


def test_a_client_that_keeps_resending_before_its_retry_after_is_closed_1008() -> None:
    """§12: 200 early refusals within 10 s close the connection with 1008."""
    session, _, clock = make(room=0)
    for i in range(220):  # one every 10 ms, though told 42 ms: the first 0.2 s (21 of them) are forgiven
        assert session.close_request is None, i
        session.receive(fill(i))
        clock.now += 0.01
    code, reason = session.close_request or (0, "")
    assert (code, reason) == (1008, RESENDER_REASON)
    spec = " ".join((Path(__file__).resolve().parent.parent / "protocol.md").read_text().split())
    for said in (RESENDER_REASON, SLOW_READER_REASON):  # the reasons §12 quotes, word for word
        assert f'the reason "{said}"' in spec, said
    assert len(session._early) == 200


def test_early_resends_spread_out_in_time_are_forgiven() -> None:
    session, _, clock = make(room=0)
    session.receive(fill(0))
    clock.now += 0.3
    for i in range(1000):  # 1000 early resends, but only 100 within any 10 s
        clock.now += 0.1 if i % 100 else 11.0
        session.receive(fill(i + 1))
        session._wait_until = clock.now + 1  # always told to wait, so each is early
    assert session.close_request is None


def test_an_integer_id_and_the_same_digits_as_a_string_are_two_ids() -> None:
    """§3 (a spec trial asked): ``6`` and ``"6"`` are two ids, both in flight at once, and a cancel
    names one of them by type and value."""
    session, engine, _ = make()
    assert session.receive(fill(6)) == [] and session.receive(fill("6")) == []  # no duplicate_id
    assert len(engine.jobs) == 2
    (answer,) = frames(session.receive(orjson.dumps({"type": "cancel", "id": "6"}).decode()))
    assert (answer["type"], answer["id"]) == ("cancelled", "6")
    assert list(session.inflight) == [6]
