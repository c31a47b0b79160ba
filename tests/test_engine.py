"""The engine's stages with the real tiny model but no sockets: what the server cannot easily stage."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from fillmask_server.batching import BatchPolicy
from fillmask_server.engine import Admission, Engine
from fillmask_server.jobs import Expired, Job, Outcome, Rejected, Result, State
from fillmask_server.model import FillMaskModel, load_model
from fillmask_server.protocol import FillMaskRequest


class Collector:
    """A ``deliver`` callback that records outcomes and lets a test wait for them."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self._cond = threading.Condition()

    def __call__(self, outcomes: list[Outcome]) -> None:
        with self._cond:
            self.outcomes.extend(outcomes)
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = 10.0) -> dict[Any, Outcome]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.outcomes) >= count, timeout), self.outcomes
            return {outcome.job.request.id: outcome for outcome in self.outcomes}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> FillMaskModel:
    return load_model(str(tiny_model_dir))


@pytest.fixture
def collector() -> Collector:
    return Collector()


@pytest.fixture
def engine(model: FillMaskModel, collector: Collector):
    engine = Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector)
    engine.start()
    yield engine
    engine.stop()


def job(frame_id: object, text: str = "a [MASK] b", deadline: float | None = None, top_k: int = 5,
        owner: object = None) -> Job:
    return Job(FillMaskRequest(frame_id, text, top_k), owner=owner, arrival=time.monotonic(), deadline=deadline)


def wait_runnable(engine: Engine, count: int) -> None:
    deadline = time.monotonic() + 10
    while engine.runnable() < count:
        assert time.monotonic() < deadline, "the tokenizer stage did not queue them"
        time.sleep(0.002)


def test_expired_requests_are_answered_504_without_running(engine: Engine, collector: Collector) -> None:
    with engine.paused():
        assert engine.submit(job("old", deadline=time.monotonic() - 1))
        assert engine.submit(job("fresh"))
        wait_runnable(engine, 2)
    outcomes = collector.wait_for(2)
    assert isinstance(outcomes["old"], Expired) and isinstance(outcomes["fresh"], Result)
    assert engine.stats.rows == 1 and engine.stats.expired == 1


def test_submit_counts_requests_still_being_tokenized_against_max_queue(engine: Engine, collector: Collector) -> None:
    with engine.paused():
        accepted = [engine.submit(job(i, owner=i)) for i in range(12)]  # one connection each: no share limit
        assert accepted == [Admission.ACCEPTED] * 10 + [Admission.QUEUE_FULL] * 2
    assert len(collector.wait_for(10)) == 10


def test_withdraw_wins_only_before_the_model_has_the_job(engine: Engine, collector: Collector) -> None:
    first, second = job(1), job(2)
    with engine.paused():
        engine.submit(first)
        engine.submit(second)
        wait_runnable(engine, 2)
        assert engine.withdraw(first) is True
        assert engine.withdraw(first) is False  # a second move out of the queue is refused
        assert first.state is State.DONE
    outcomes = collector.wait_for(1)
    assert list(outcomes) == [2] and second.state is State.DONE
    assert engine.withdraw(second) is False


def test_the_tokenizer_stage_answers_its_checks_and_queues_only_runnable_jobs(
        engine: Engine, collector: Collector) -> None:
    with engine.paused():
        engine.submit(job("long", "[MASK]" + " word" * 600))
        engine.submit(job("many", "[MASK] " * 5))
        engine.submit(job("none", "no mask here"))
        engine.submit(job("fine"))
        wait_runnable(engine, 1)
        outcomes = collector.wait_for(3)
        assert engine.runnable() == 1  # only the runnable one reached the model's queue
    assert {key: o.code for key, o in outcomes.items() if isinstance(o, Rejected)} == {
        "long": "text_too_long", "many": "too_many_masks", "none": "no_mask"}
    assert "512" in outcomes["long"].message  # type: ignore[union-attr]
    assert isinstance(collector.wait_for(4)["fine"], Result)


def test_results_carry_serialized_predictions_and_batch_facts(engine: Engine, collector: Collector) -> None:
    with engine.paused():
        for i in range(3):
            engine.submit(job(i, top_k=2 + i))
        wait_runnable(engine, 3)
    outcomes = collector.wait_for(3)
    batch_ids = {o.batch_id for o in outcomes.values()}  # type: ignore[union-attr]
    assert len(batch_ids) == 1
    for i, outcome in outcomes.items():
        assert isinstance(outcome, Result) and outcome.batch_size == 3
        assert len(orjson.loads(outcome.predictions_json)) == 2 + i


def test_max_wait_holds_a_batch_for_requests_that_arrive_while_others_are_tokenized(
        model: FillMaskModel, collector: Collector) -> None:
    """Issue 9: with --max-wait-ms, a request arriving while another is tokenized used to skip the wait and
    run alone, and the next one then waited the whole max-wait. Now every request is tokenized before the
    queue, and the wait is one deadline from the oldest queued request."""
    engine = Engine(model, BatchPolicy(8, 4096, max_wait_s=1.0), max_queue=10, max_masks=4, deliver=collector)
    engine.start()
    try:
        first = job("first")
        engine.submit(first)
        time.sleep(0.02)  # the first is tokenized and queued, waiting for company
        engine.submit(job("second"))
        outcomes = collector.wait_for(2)
    finally:
        engine.stop()
    assert {o.batch_size for o in outcomes.values()} == {2}  # type: ignore[union-attr]
    assert len({o.batch_id for o in outcomes.values()}) == 1  # type: ignore[union-attr]
    waited = outcomes["first"].queue_ms  # type: ignore[union-attr]
    assert 900 <= waited <= 3000, waited  # it waited the max-wait, counted from its own arrival


def test_a_busy_queue_keeps_a_newcomers_share_free(engine: Engine, collector: Collector) -> None:
    """§6 queue_share: past half of max_queue (10), a connection holds at most max_queue ÷ (connections
    waiting + 1); so a flood that had the queue to itself stops at half, and a newcomer still gets in."""
    with engine.paused():
        answers = [engine.submit(job(i, owner="flood")) for i in range(8)]
        assert answers == [Admission.ACCEPTED] * 5 + [Admission.QUEUE_SHARE] * 3
        assert engine.submit(job("polite", owner="polite")) is Admission.ACCEPTED
        assert engine.submit(job("third", owner="third")) is Admission.ACCEPTED
    assert len(collector.wait_for(7)) == 7
