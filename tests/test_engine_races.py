"""Races between the engine's stage threads, the event loop's calls and the engine's death or stop.

Each test stages one interleaving deterministically: a stage is held at a known point (the batch
observer the server passes as ``on_batch``, which the decode stage calls outside the engine's lock
before it decodes a batch; or a model whose ``forward`` waits for the test), and the racing event
(a cancel, a stage thread's death, a stop) happens while it is held. Faults are injected as
tests/test_hardening_faults.py does: a subclass of the model that fails on purpose for a marked
text, otherwise predicting normally. The thread-free core is used directly where no thread is needed.

Tests that reproduced a bug say so in their docstring (each failed before its fix); the others pin an
interleaving that was suspected and found sound, so that it stays so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from fillmask_server import intake
from fillmask_server.batching import BatchPolicy
from fillmask_server.core import Admission, EngineCore
from fillmask_server.engine import Engine
from fillmask_server.items import Item, TopK
from fillmask_server.jobs import Failed, Job, Outcome, Result, State, Stopped
from fillmask_server.loading import load_model
from fillmask_server.model import FillMaskModel
from fillmask_server.protocol import FillMaskRequest
from fillmask_server.session import Session
from tests import wire
from tests.test_engine import Collector as EngineCollector

MARKER = "explode"  # one WordPiece token of the tiny model's vocabulary (as in test_hardening_faults)
TEXT = "Paris is the [MASK] of France."
WAIT_S = 10.0


class EngineKiller(BaseException):
    """Not an ``Exception``: nothing in the engine catches it, so the stage thread that meets it ends."""


class KillingTokenizer(FillMaskModel):
    """The tiny model, but tokenizing a text with ``MARKER`` ends the tokenizer stage's thread."""

    def __init__(self, base: FillMaskModel) -> None:
        self.__dict__.update(base.__dict__)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        if any(MARKER in text for text in texts):
            raise EngineKiller("the tokenizer stage dies")
        return super().tokenize(texts)


class HeldForward(FillMaskModel):
    """The tiny model, but its first ``forward`` waits for ``go`` (``inside`` is set once it waits); with
    ``out_of_memory``, a pass over more than one item raises out of memory (after ``on_oom``)."""

    def __init__(self, base: FillMaskModel, hold: bool = True, out_of_memory: bool = False,
                 on_oom: Callable[[], None] | None = None) -> None:
        self.__dict__.update(base.__dict__)
        self.inside, self.go = threading.Event(), threading.Event()
        self._hold = hold
        self._out_of_memory = out_of_memory
        self._on_oom = on_oom
        self.calls: list[int] = []

    def forward(self, items: Sequence[Item]) -> TopK:
        self.calls.append(len(items))
        if self._hold and not self.inside.is_set():
            self.inside.set()
            assert self.go.wait(WAIT_S)
        if self._out_of_memory and len(items) > 1:
            if self._on_oom is not None:
                self._on_oom()
            raise MemoryError("out of memory (injected)")
        return super().forward(items)


class Collector(EngineCollector):
    """``tests.test_engine.Collector`` (every outcome, waited for), and the outcomes of one job."""

    def of(self, job: Job) -> list[Outcome]:
        with self._cond:
            return [outcome for outcome in self.outcomes if outcome.job is job]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> FillMaskModel:
    return load_model(str(tiny_model_dir))


def job(name: int | str, text: str = TEXT, owner: object = "conn") -> Job:
    return Job(FillMaskRequest(name, text, 5), owner=owner, arrival=time.monotonic())


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


@pytest.fixture
def stopped_after() -> Iterator[list[Engine]]:
    """Engines a test started; each is stopped at the test's end, whatever happened."""
    engines: list[Engine] = []
    yield engines
    for engine in engines:
        engine.stop(timeout=WAIT_S)


# --- a stage thread dies while a batch waits between the model thread and the decode stage ------------


def die_with_a_batch_handed_over(model: FillMaskModel, engines: list[Engine]
                                 ) -> tuple[Engine, Collector, list[int], list[Job]]:
    """Batch 1 (job a) is being observed by the decode stage, which the observer holds; batch 2 (job b)
    has run and waits in the hand-over; then the tokenizer stage dies on job c. Returns the engine
    (once every stage thread has returned), its outcomes, the batch ids the observer saw and a, b, c."""
    held, go = threading.Event(), threading.Event()
    seen: list[int] = []

    def on_batch(batch_id: int, size: int, tokens: int, waits: list[float], seconds: float) -> None:
        seen.append(batch_id)
        if batch_id == 1:
            held.set()
            go.wait(WAIT_S)

    collector = Collector()
    engine = Engine(KillingTokenizer(model), BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector,
                    on_batch=on_batch)
    engines.append(engine)
    engine.start()
    a, b, c = job("a"), job("b"), job("c", f"{MARKER} is the [MASK] of France.")
    try:
        assert engine.submit(a) is Admission.ACCEPTED
        assert held.wait(WAIT_S)  # the decode stage took batch 1 and observes it (outside the lock)
        assert engine.submit(b) is Admission.ACCEPTED
        until(lambda: engine.stats.batches == 2, "batch 2 was not handed over")  # (in the hand-over now)
        assert b.state is State.DECODING
        assert engine.submit(c) is Admission.ACCEPTED
        until(lambda: not engine.alive, "the tokenizer stage did not die")
    finally:
        go.set()
    until(lambda: engine.ended, "the stage threads did not all return")
    return engine, collector, seen, [a, b, c]


def test_a_stage_dying_while_a_batch_waits_for_the_decode_stage_answers_each_request_once(
        model: FillMaskModel, stopped_after: list[Engine]) -> None:
    """Sound: the dying thread answers a (being decoded) and b (handed over) ``Failed``, and the decode
    stage's later ``Result`` for a is dropped by ``EngineCore.decoded`` (its ``can`` check): one answer
    each, and every ledger back at zero."""
    engine, collector, _, jobs = die_with_a_batch_handed_over(model, stopped_after)
    for each in jobs:
        assert [type(outcome) for outcome in collector.of(each)] == [Failed], (each.request.id, collector.outcomes)
        assert each.state is State.DONE
    assert len(collector.outcomes) == 3
    engine.release(jobs)
    assert not engine.busy() and engine.core.reserved_total() == 0 and engine.queued() == 0
    assert engine.started() == 0 and not engine.core._waiting_by and not engine.core._reserved


def test_a_batch_the_model_ran_is_observed_even_when_a_stage_dies_before_the_decode_stage_takes_it(
        model: FillMaskModel, stopped_after: list[Engine]) -> None:
    """Was a bug: ``Engine._die`` cleared the hand-over to the decode stage, so a batch that ran but was
    not yet taken by the decode stage never reached ``on_batch``: the server's
    ``fillmask_batch_size`` / ``fillmask_batch_tokens`` / ``fillmask_inference_seconds`` /
    ``fillmask_queue_wait_seconds`` and the live ``stats`` frames missed it, while ``EngineStats`` and
    ``fillmask_engine_busy_seconds_total`` counted it (the decode loop's own stop path promises "the
    batches the model ran are counted, even those a stop leaves undecoded"). ``_die`` now records them."""
    engine, _, seen, _ = die_with_a_batch_handed_over(model, stopped_after)
    assert engine.stats.batches == 2
    assert seen == [1, 2], f"the observer saw batches {seen} of the {engine.stats.batches} the model ran"


# --- stop() against a request submitted meanwhile ------------------------------------------------------------


def test_a_request_submitted_once_stop_has_begun_is_refused_not_left_unanswered(
        model: FillMaskModel, stopped_after: list[Engine]) -> None:
    """Was a latent bug (the server cannot reach it: it stops its engine only after every connection
    handler has ended): ``Engine.stop`` sets ``_stopping`` at once but ``alive`` only after joining the
    threads, and ``submit`` checked ``alive`` alone, as does ``EngineCore.submit`` (``accepting``, which
    only ``stop_all`` clears). So while ``stop`` waited for a forward pass, ``submit`` accepted a request
    that no stage would ever take: no outcome, and ``busy()`` true for good. ``submit`` now refuses."""
    held = HeldForward(model)
    collector = Collector()
    engine = Engine(held, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector)
    stopped_after.append(engine)
    engine.start()
    stopper = threading.Thread(target=engine.stop, kwargs={"timeout": WAIT_S})
    try:
        assert engine.submit(job("running")) is Admission.ACCEPTED
        assert held.inside.wait(WAIT_S)
        stopper.start()
        until(lambda: not engine._threads[0].is_alive(), "stop() did not end the tokenizer stage")
        late = job("late")
        admission = engine.submit(late)
    finally:
        held.go.set()
        if stopper.ident is not None:
            stopper.join(WAIT_S)
    assert admission is Admission.STOPPED, (admission, late.state)


# --- the out-of-memory split against a cancel -----------------------------------------------------------------


def test_a_cancel_during_the_out_of_memory_split_has_no_effect_and_each_request_gets_its_result(
        model: FillMaskModel, stopped_after: list[Engine]) -> None:
    """Sound: the split re-runs the batch's halves on the model thread only; its requests stay RUNNING
    throughout, so a cancel (``withdraw``) that comes during the failed pass is refused (§5) and each
    request still gets exactly one ``Result``."""
    refused: list[bool] = []
    engine_box: list[Engine] = []
    jobs = [job(n) for n in range(4)]

    def cancel_all() -> None:  # on the model thread, outside the engine's lock, as the event loop would
        if not refused:
            refused.extend(engine_box[0].withdraw(each) for each in jobs)

    oom = HeldForward(model, hold=False, out_of_memory=True, on_oom=cancel_all)
    collector = Collector()
    engine = Engine(oom, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector)
    engine_box.append(engine)
    stopped_after.append(engine)
    engine.start()
    with engine.paused():
        for each in jobs:
            assert engine.submit(each) is Admission.ACCEPTED
        until(lambda: engine.runnable() == 4, "the requests were not queued")
    collector.wait_for(4)
    assert refused == [False] * 4
    assert oom.calls == [4, 2, 1, 1, 2, 1, 1]
    for each in jobs:
        assert [type(outcome) for outcome in collector.of(each)] == [Result]
    engine.release(jobs)
    until(lambda: not engine.busy(), "the engine stayed busy")
    assert engine.core.reserved_total() == 0


# --- the thread-free core: a drain's withdrawal against a batch chosen ahead ---------------------------------


def checked(n_tokens: int = 10, result_bytes: int = 1000) -> intake.Checked:
    return intake.Checked(list(range(n_tokens)), 1, None, result_bytes)


def test_a_drain_withdrawing_a_batch_chosen_ahead_leaves_no_charge_no_count_and_no_reservation() -> None:
    """Sound: ``withdraw_waiting`` (the drain's, engine.py ``withdraw_all``) also takes the requests of a
    batch chosen ahead (``_next``: still QUEUED, out of the policy's queue); the model thread's
    ``start`` of that batch then starts nothing and takes back the policy's charge, and no ledger keeps
    a trace of them."""
    core = EngineCore(BatchPolicy(3, 100_000), 100)
    jobs = [job(n, owner="a") for n in range(3)] + [job("b0", owner="b")]
    for each in jobs:
        assert core.submit(each) is Admission.ACCEPTED
    assert core.checked([(each, checked()) for each in core.take_intake()]) == []
    ahead = core.schedule(0.0, start=False)
    assert len(ahead.batch) == 3 and core.runnable() == 4
    withdrawn = core.withdraw_waiting()
    assert {each.request.id for each in withdrawn} == {0, 1, 2, "b0"}
    outcomes: list[Outcome] = [Stopped(each, "shutting_down", 1000) for each in withdrawn]
    assert len(outcomes) == 4
    started = core.start(ahead, 0.0)
    assert started.batch == [] and not core.busy() and core.reserved_total() == 0
    assert core._waiting_by == {} and core._reserved == {} and len(core._queue) == 0
    assert all(served[1] == pytest.approx(0.0) for served in core.policy._recent.values())


async def test_an_answer_that_fails_to_route_leaves_the_others_answered_and_the_ledgers_settled(
        make_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A defect while one outcome is routed to its connection (here: the session raising for request
    "boom") costs that answer alone: the other answers go out, and the answer memory and the count of
    hand-overs in transit are given back, so the server settles. (Before, the exception left the loop's
    callback at once: the rest of the hand-over unrouted, the memory reserved and ``settled()`` false
    for good.)"""
    routed = Session.on_outcome

    def failing(self: Session, outcome: Outcome) -> Any:
        if outcome.job.request.id == "boom":
            raise RuntimeError("a defect while routing")
        return routed(self, outcome)

    monkeypatch.setattr(Session, "on_outcome", failing)
    async with make_server() as srv, wire.session(srv.url) as (ws, _hello):
        for frame_id in ("boom", "ok"):
            await wire.send(ws, {"type": "fill_mask", "id": frame_id, "text": TEXT})
        answer = await wire.recv(ws)
        assert (answer["type"], answer["id"]) == ("result", "ok")
        await wire.wait_until(srv.settled, timeout=10.0)
        assert srv.engine._reserved_total == 0
