"""The engine's stages with the real tiny model but no sockets: what the server cannot easily stage."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from fillmask_server.batching import BatchPolicy
from fillmask_server.core import Admission
from fillmask_server.engine import Engine
from fillmask_server.items import Item
from fillmask_server.jobs import Expired, Job, Outcome, Rejected, Result, State
from fillmask_server.layout import QuietLone
from fillmask_server.loading import load_model
from fillmask_server.model import FillMaskModel
from fillmask_server.protocol import FillMaskRequest
from fillmask_server.tuning import ThreadTuner


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


def record_forward(model: FillMaskModel, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Each forward pass of ``model`` from now on, as (thread, items, torch's thread count on it)."""
    import torch

    calls: list[tuple[str, int, int]] = []
    forward = model.forward

    def recording(items: list[Item]) -> object:
        calls.append((threading.current_thread().name, len(items), torch.get_num_threads()))
        return forward(items)

    monkeypatch.setattr(model, "forward", recording)
    return calls


def submit_as_one_batch(engine: Engine, jobs: list[Job]) -> None:
    """Submit ``jobs`` (each accepted) while the model thread is held, and wait until all are queued:
    they run together (within the batch caps)."""
    with engine.paused():
        for j in jobs:
            assert engine.submit(j) is Admission.ACCEPTED
        wait_runnable(engine, len(jobs))


def wait_runnable(engine: Engine, count: int) -> None:
    deadline = time.monotonic() + 10
    while engine.runnable() < count:
        assert time.monotonic() < deadline, "the tokenizer stage did not queue them"
        time.sleep(0.002)


def test_outcomes_are_delivered_with_the_engine_lock_free_and_busy_until_they_are(model: FillMaskModel) -> None:
    """``deliver`` runs after its stage thread released the engine's lock: waking the event loop is a
    system call, after which that thread waits for the GIL, and the event loop, which holds the GIL,
    blocked on the lock meanwhile. And ``busy()`` stays True until the delivery is done, so a drain
    that sees it False has every answer (refusals from the tokenizer stage, expiries from the model
    thread, results from the decode stage)."""
    seen: list[tuple[str, bool, bool]] = []  # (stage thread, the lock could be taken, busy) at each delivery
    collector = Collector()

    def deliver(outcomes: list[Outcome]) -> None:
        taken = engine._lock.acquire(timeout=10.0)  # held by this very thread: never taken (not reentrant)
        if taken:
            engine._lock.release()
        seen.append((threading.current_thread().name, taken, engine.busy() if taken else True))
        collector(outcomes)

    engine = Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=deliver)
    engine.start()
    try:
        with engine.paused():
            for each in (job("old", deadline=time.monotonic() - 1), job("no mask", text="no mask here"), job("fresh")):
                assert engine.submit(each) is Admission.ACCEPTED
            wait_runnable(engine, 2)
        outcomes = collector.wait_for(3)
        deadline = time.monotonic() + 10
        while engine.busy():  # bounded: the last delivery has returned
            assert time.monotonic() < deadline
            time.sleep(0.002)
    finally:
        engine.stop()
    assert isinstance(outcomes["old"], Expired) and isinstance(outcomes["fresh"], Result)
    assert isinstance(outcomes["no mask"], Rejected)
    assert {name for name, _, _ in seen} == {"fillmask-intake", "fillmask-model", "fillmask-decode"}, seen
    assert all(taken and busy for _, taken, busy in seen), seen


def test_outcomes_queued_before_a_stage_block_raised_are_still_delivered(model: FillMaskModel) -> None:
    """A stage's block under the lock that raised after it had queued outcomes (a fault in the batch
    choice, say) still delivers them as the exception goes on to end that thread, and ``busy()`` does
    not stay True for a delivery that never comes."""
    delivered: list[Outcome] = []
    engine = Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=delivered.extend)
    expired = Expired(job("late"), 1.0, 100)
    with pytest.raises(RuntimeError, match="the block failed"), engine._handing_over():
        engine._hand_over_locked([expired])
        raise RuntimeError("the block failed")
    assert delivered == [expired] and not engine.busy()


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
    # §7: what was wrong, and what to do.
    for key, what_to_do in (("long", "shorten it"), ("many", "remove some, or split the text")):
        assert what_to_do in outcomes[key].message, outcomes[key]  # type: ignore[union-attr]
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


def test_the_model_thread_runs_each_batch_at_the_thread_count_the_core_gives_it(
        model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import torch

    caplog.set_level(logging.INFO, logger="fillmask_server.engine")

    applied: list[tuple[str, int, int]] = []  # (thread, count asked, torch's count after)
    set_threads = model.set_threads

    def recording(count: int) -> None:
        set_threads(count)
        applied.append((threading.current_thread().name, count, torch.get_num_threads()))

    monkeypatch.setattr(model, "set_threads", recording)
    before = torch.get_num_threads()
    tuner = ThreadTuner([1, 2], 2, time.monotonic(), first_interval_s=0.05, probe_share=1.0)  # at once
    told: list[tuple[str, int]] = []  # on_threads: (thread, count), after each change
    engine = Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector, threads=tuner,
                    on_threads=lambda count: told.append((threading.current_thread().name, count)))
    engine.start()
    try:
        n = 0
        deadline = time.monotonic() + 20
        ended = "probe of torch threads 1 against 2 at batches of 1 rows: "
        while len({count for _, count, _ in applied}) < 2 or len(applied) < 2 or ended not in caplog.text:
            assert time.monotonic() < deadline, applied
            assert engine.submit(job(n)) is Admission.ACCEPTED
            n += 1
            collector.wait_for(n)
    finally:
        engine.stop()
        torch.set_num_threads(before)
    assert applied[:2] == [("fillmask-model", 1, 1), ("fillmask-model", 2, 2)]  # a probe at 1, then back
    # Each probe's end is on the log, with its batches' ratios and the count in use's.
    assert re.search(r"probe of torch threads 1 against 2 at batches of 1 rows: (won|lost|no verdict[^(]*) "
                     r"\((its batches [0-9., ]+ times the cost model's prediction|no batch of it timed past its "
                     r"warm-up), the layout in use's [0-9.]+; tuning.py\)", caplog.text), caplog.text
    assert told == [(name, count) for name, count, _ in applied]  # after every change, and only then
    assert all(isinstance(outcome, Result) for outcome in collector.outcomes)


# --- start-up calibration and honest speed modes (issue 17 items 4 and 5) ---------------------------------


async def test_calibration_is_reported_in_hello_metrics_and_the_start_up_lines(tiny_model_dir: Path) -> None:
    """The real server process measures at load: its torch threads and cost model appear in
    ``hello.engine``, on /metrics and in the log; a reduced dtype that measures slower than float32
    gets one warning line with the ratio (the test makes bfloat16 look slow through the test hook,
    on top of the real measurement, so that the outcome does not depend on this CPU).

    The same server shows what start-up made frozen out of the garbage collector's walks: a full
    collection walked every object start-up made (torch's and transformers' modules, the tokenizer, the
    model, the calibration's leftovers) while holding the GIL, and under connection churn one ran every
    few seconds and stalled every thread for about as long as a batch takes (README, Performance). The
    server freezes them once start-up is done (allocator.freeze_start_up_heap), and §11 exports how many,
    with Python's own collection counts."""
    import asyncio
    import re
    import subprocess
    import sys
    import urllib.request

    from fillmask_server.calibration import SLOWDOWN_ENV
    from tests.wire import session

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", SLOWDOWN_ENV: "1000"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "ws_server.py", "--model", str(tiny_model_dir), "--port", "0", "--dtype", "bfloat16",
        "--calibration-s", "1", cwd=root, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        # Two loads (bfloat16, and float32 to compare) and a calibration: about 9 s on a quiet 2-core machine,
        # several times that beside a busy core while the other worker runs its own servers.
        line = (await asyncio.wait_for(process.stdout.readline(), 240)).decode()  # type: ignore[union-attr]
        url = re.search(r"ready: (ws://\S+)", line).group(1)  # type: ignore[union-attr]
        async with session(url) as (_, hello):
            engine = hello["engine"]
        calibration = engine["calibration"]
        assert engine["torch_threads"] >= 1 and calibration["threads_from"] in ("calibration", "default")
        if calibration["threads_from"] == "calibration":  # more than one CPU: each candidate was timed
            assert (engine["torch_threads"], engine["forward_parts"]) in [
                (entry["threads"], entry.get("parts", 1)) for entry in calibration["threads_ms"]]
            assert calibration["stages_us_per_request"] > 0  # what the count was chosen with, beside the timings
        cost = calibration["cost_model"]
        assert cost["overhead_ms"] + cost["per_token_us"] + cost["per_row_us"] > 0
        assert 0 < calibration["dtype_speed_vs_float32"] < 1
        metrics_url = url.replace("ws://", "http://").rstrip("/") + "/metrics"
        with await asyncio.to_thread(urllib.request.urlopen, metrics_url, timeout=5) as response:
            metrics = response.read().decode()
        assert f"fillmask_torch_threads {float(engine['torch_threads'])}" in metrics
        assert f"fillmask_forward_parts {float(engine['forward_parts'])}" in metrics
        assert re.search(r'fillmask_cost_model_seconds\{term="overhead"\} [0-9.e-]+', metrics)
        values = dict(text.rsplit(" ", 1) for text in metrics.splitlines() if text and not text.startswith("#"))
        assert float(values["fillmask_gc_frozen_objects"]) > 50_000  # imports and model: hundreds of thousands
        assert 'python_gc_collections_total{generation="2"}' in values
        quiet = calibration.get("quiet_lone")  # the rule for a lone request after a quiet spell, where timed
        in_use = re.search(r"^fillmask_quiet_lone_threads ([0-9.]+)$", metrics, re.MULTILINE)
        assert (in_use is not None) is (quiet is not None)
        if quiet is not None and in_use is not None:  # the count in use: the calibration's, or one it timed since
            assert float(in_use[1]) in {float(timed["threads"]) for timed in quiet["threads_ms"]}
    finally:
        process.send_signal(subprocess.signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 120)
    lines = stderr.decode().splitlines()
    assert any("calibrated in" in text and f"torch threads {engine['torch_threads']}" in text for text in lines)
    warnings = [text for text in lines if text.startswith("warning: --dtype bfloat16 runs at")]
    assert len(warnings) == 1, lines
    said = float(re.search(r"runs at ([0-9.]+)x the speed of float32", warnings[0]).group(1))  # type: ignore[union-attr]
    assert said == pytest.approx(calibration["dtype_speed_vs_float32"], abs=0.006)


def test_the_work_beside_the_forward_pass_is_timed_on_real_requests_or_left_out_when_it_cannot_be(
        model: FillMaskModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the thread count is chosen with (``stages_us_per_request``): the calibration batch's rows
    as requests through the server's own parse, tokenize, check, decode and encode. A tokenizer that
    cannot decode its own ids must not keep the server from starting: the fastest count wins then."""
    from fillmask_server.calibration import THREAD_SHAPE, batch_items, stages_s
    from fillmask_server.decode import SequenceDecoder

    items = batch_items(model, *THREAD_SHAPE)
    decoder = SequenceDecoder(model.decode_tokenizer)
    assert 0 < stages_s(model, items, decoder) < 0.1

    def broken(*args: object, **kwargs: object) -> str:
        raise ValueError("no such id")

    monkeypatch.setattr(decoder.tokenizer, "decode", broken)
    assert stages_s(model, items, decoder) == 0.0


def test_a_thread_count_the_user_sets_wins_and_zero_budget_skips_calibration(model: FillMaskModel) -> None:
    import torch

    from fillmask_server.calibration import calibrate

    before = torch.get_num_threads()
    try:
        chosen = calibrate(model, 0.5, torch_threads=1)
        assert chosen.torch_threads == 1 and chosen.threads_from == "flag" and not chosen.threads_ms
        seen: list[int] = []  # torch applies the count to threads that start after it (the model thread)
        reader = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        reader.start()
        reader.join()
        assert seen == [1] and chosen.coefficients is not None
        skipped = calibrate(model, 0.0)
        assert skipped.coefficients is None and skipped.hello()["calibration"]["seconds"] == 0
    finally:
        torch.set_num_threads(before)


def test_the_decode_stage_serves_a_light_result_before_an_earlier_batchs_heavy_ones(
        model: FillMaskModel, collector: Collector) -> None:
    """Issue 17: a light request in the batch after a heavy one is decoded and handed over first (the
    decode stage takes its jobs cheapest first across the batches handed over, not batch by batch)."""
    import itertools

    from fillmask_server.engine import _Forwarded
    from fillmask_server.items import Item

    engine = Engine(model, BatchPolicy(1, 4096), max_queue=10, max_masks=8, deliver=collector)  # not started
    core = engine.core
    heavy = [job(f"heavy{i}", "[MASK] and [MASK] " * 4, top_k=100) for i in range(3)]
    light = job("light", top_k=1)
    for j in (*heavy, light):
        core.submit(j)
    core.checked([(j, engine._check_all([j])[0]) for j in core.take_intake()])
    batches = []
    scheduled = [core.schedule(0.0).batch[0] for _ in range(4)]  # one job a batch, in arrival order
    for batch_id, batch in ((1, scheduled[:3]), (2, scheduled[3:])):  # the heavy ones as one batch, then light
        topk = [model.forward([Item(j.input_ids, j.request.top_k, j.target_ids)]) for j in batch]
        core.update_from_output(batch, 1, list(range(len(batch))), [], 0.01, 0.01)
        batches.append(_Forwarded(batch, [([i], t) for i, t in enumerate(topk)], batch_id, 1, 1.0))
    assert [j.request.id for j in batches[1].jobs] == ["light"]
    engine._decoding.extend(batches)  # the heavy batch first, as the model thread ran them
    heap: list[Any] = []
    left: dict[int, int] = {}
    engine._take_handed_over_locked(heap, left, itertools.count())
    while heap:
        engine._decode_chunk(heap, left)
    assert collector.outcomes[0].job.request.id == "light"
    assert {o.job.request.id for o in collector.outcomes} == {"light", "heavy0", "heavy1", "heavy2"}


def test_the_cost_models_shapes_are_timed_in_turn_each_keeping_its_fastest_pass(
        model: FillMaskModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Like the thread counts: a neighbour's burst of load during the calibration (another replica
    starting beside this one) then weighs on every shape alike, instead of inflating the shapes it hit."""
    import torch

    from fillmask_server import calibration

    shapes: list[tuple[int, int]] = []
    forward = model.forward

    def recording(items: list[Item]) -> object:
        shapes.append((len(items), max(len(item.input_ids) for item in items)))
        return forward(items)

    monkeypatch.setattr(model, "forward", recording)
    before = torch.get_num_threads()
    try:
        result = calibration.calibrate(model, 2.0, torch_threads=1)  # a flag: no thread timing
    finally:
        torch.set_num_threads(before)
    fitted = list(calibration.FIT_SHAPES[:len(result.samples)])
    assert len(fitted) >= 3 and [(rows, padded // rows) for rows, padded, _ in result.samples] == fitted
    settle = calibration.SETTLE_PASSES  # the layout's first passes, before its first shape's (_LayoutTimer)
    warm, timed = shapes[settle:settle + 2 * len(fitted)], shapes[settle + 2 * len(fitted):]
    assert shapes[:settle] == fitted[:1] * settle
    assert warm == [shape for shape in fitted for _ in range(2)]  # each shape's first passes, not timed
    rounds = len(timed) // len(fitted)
    assert rounds >= calibration.MIN_THREAD_ROUNDS and timed == fitted * rounds


def test_a_cpu_quota_of_one_cpu_gives_one_thread_with_or_without_calibration(
        model: FillMaskModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from fillmask_server import calibration, cpus

    quota = {cpus.CGROUP_V2_CPU_MAX: "100000 100000"}  # a container limited to one CPU
    monkeypatch.setattr(cpus, "_read_text", quota.get)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # torch's default on a machine of two cores or more
        assert calibration.calibrate(model, 0.3).torch_threads == 1
        torch.set_num_threads(2)
        assert calibration.uncalibrated().torch_threads == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread names are read from Linux's /proc")
def test_each_stage_thread_has_its_name_in_the_kernel_for_top_and_cpu_figures(engine: Engine) -> None:
    engine.submit(job("named"))  # the stages are running (they name themselves when they start)
    deadline = time.monotonic() + 10
    wanted = {"fillmask-intake", "fillmask-model", "fillmask-decode"}
    while True:
        names = {(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()}
        if wanted <= names or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert wanted <= names


def test_the_next_batch_is_chosen_off_the_model_thread_while_it_runs_a_forward_pass(
        model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full batch queued during a forward pass is chosen by the tokenizer stage, not the model thread,
    which then runs it as soon as the pass ends. Until then its requests are still queued: a withdrawal
    (cancel, closed connection, drain) takes one out as before. A queue with a deadline in it is left to
    the model thread (a batch chosen ahead must not start later than its time bound assumed)."""
    inside, go = threading.Event(), threading.Event()
    forward = model.forward

    def held(items: list[Item]) -> Any:
        if not inside.is_set():  # the first pass waits for the test, once
            inside.set()
            assert go.wait(20)
        return forward(items)

    monkeypatch.setattr(model, "forward", held)
    engine = Engine(model, BatchPolicy(4, 4096), max_queue=20, max_masks=4, deliver=collector)
    chosen_on: list[tuple[str, int]] = []  # (thread, batch size) of every batch the core chose
    schedule = engine.core.schedule

    def recording(now: float, start: bool = True) -> Any:
        scheduled = schedule(now, start)
        if scheduled.batch:
            chosen_on.append((threading.current_thread().name, len(scheduled.batch)))
        return scheduled

    monkeypatch.setattr(engine.core, "schedule", recording)
    engine.start()
    try:
        assert engine.submit(job("first")) is Admission.ACCEPTED
        assert inside.wait(20)
        for n in range(4):  # a full batch, while the first pass runs
            assert engine.submit(job(n)) is Admission.ACCEPTED
        deadline = time.monotonic() + 20
        while len(chosen_on) < 2:  # chosen without the model thread
            assert time.monotonic() < deadline, chosen_on
            time.sleep(0.002)
        assert chosen_on == [("fillmask-model", 1), ("fillmask-intake", 4)]
        assert (engine.started(), engine.runnable()) == (1, 4)  # chosen, not started: still queued
        withdrawn = next(j for j in engine.core._jobs[State.QUEUED] if j.request.id == 0)
        assert engine.withdraw(withdrawn)
        for n in range(4, 8):  # another full batch, but one of them has a deadline
            assert engine.submit(job(n, deadline=time.monotonic() + 60 if n == 4 else None)) is Admission.ACCEPTED
        wait_runnable(engine, 4)
        assert len(chosen_on) == 2  # nothing chosen early this time
        go.set()
        outcomes = collector.wait_for(8)
    finally:
        go.set()
        engine.stop()
    assert 0 not in outcomes and all(isinstance(outcome, Result) for outcome in outcomes.values())
    assert [name for name, _ in chosen_on] == ["fillmask-model", "fillmask-intake", "fillmask-model"]
    assert [outcomes[n].batch_size for n in range(1, 8)] == [3] * 3 + [4] * 4


def test_an_engine_has_ended_only_once_every_stage_thread_has_returned(model: FillMaskModel,
                                                                       collector: Collector) -> None:
    engine = Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector)
    engine.start()
    with engine.paused():  # a paused model thread is still alive: the model is still the engine's
        assert not engine.ended
    engine.submit(job("last"))
    assert isinstance(collector.wait_for(1)["last"], Result)
    assert not engine.ended
    engine.stop()
    assert engine.ended  # tests/conftest.py gives the model to the next server only now


# --- the forward pass in parts side by side (--forward-parts) ---------------------------------------------


def test_a_batch_runs_in_parts_side_by_side_with_one_passs_answers_and_a_lone_request_whole(
        model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``forward_parts=2`` a batch of several requests runs as two forward passes at once, one on the
    model thread and one on its helper, each at ``part_threads``; the answers are each request's alone,
    whatever part it ran in (top_k and targets differ between them). A lone request runs whole, on the
    model thread at both parts' threads (a part of one text would leave a core idle)."""
    import torch

    from fillmask_server.decode import SequenceDecoder, predictions_json

    forward = model.forward  # (the unrecorded pass, for each request's own answer)
    calls = record_forward(model, monkeypatch)
    cases = [("a [MASK] b", 5, None), ("the [MASK] of a long text with many more words in it", 2, None),
             ("x [MASK] y [MASK] z", 3, None), ("one [MASK] more", 4, ("the", "a", "zz")),
             ("short [MASK]", 1, None), ("[MASK] at the start of a text", 7, None)]
    before = torch.get_num_threads()
    engine = Engine(model, BatchPolicy(8, 4096, growth=100.0), max_queue=20, max_masks=4, deliver=collector,
                    forward_parts=2, part_threads=1)  # (a band wide enough for every length: one batch)
    engine.start()
    try:
        with engine.paused():
            for n, (text, top_k, targets) in enumerate(cases):
                request = FillMaskRequest(n, text, top_k, targets)
                assert engine.submit(Job(request, owner=None, arrival=time.monotonic())) is Admission.ACCEPTED
            wait_runnable(engine, len(cases))
        outcomes = collector.wait_for(len(cases))
        engine.submit(job("alone"))
        alone = collector.wait_for(len(cases) + 1)["alone"]
    finally:
        engine.stop()
        torch.set_num_threads(before)
    assert engine.ended  # the helper too
    batch, lone = calls[:2], calls[2:]
    assert sorted(name for name, _, _ in batch) == ["fillmask-model", "fillmask-part-1"]
    assert sum(items for _, items, _ in batch) == len(cases) and all(count == 1 for _, _, count in batch)
    assert lone == [("fillmask-model", 1, 2)] and isinstance(alone, Result)
    assert len({outcome.batch_id for outcome in outcomes.values()}) == 1  # type: ignore[union-attr]
    decoder = SequenceDecoder(model.decode_tokenizer)
    for n, (text, top_k, targets) in enumerate(cases):
        outcome = outcomes[n]
        assert isinstance(outcome, Result) and outcome.batch_size == len(cases)
        target_ids = model.target_ids(targets) if targets else None
        item = Item(model.tokenize([text])[0], top_k, target_ids)
        expected = orjson.loads(predictions_json(decoder, item, forward([item]), 0))
        got = orjson.loads(outcome.predictions_json)
        if isinstance(expected[0], dict):  # one mask: one list (the pipeline's shape), else one per mask
            got, expected = [got], [expected]
        assert [[p["token"] for p in mask] for mask in got] == [[p["token"] for p in mask] for mask in expected]
        assert [[p["score"] for p in mask] for mask in got] == [
            pytest.approx([p["score"] for p in mask], rel=1e-4, abs=1e-6) for mask in expected]


def test_a_request_the_model_fails_on_in_one_part_fails_alone(model: FillMaskModel, collector: Collector,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure in a part is that part's: it is retried item by item there (on its helper thread), so
    only the request that fails alone gets ``internal_error``; the other part's answers stand, and the
    helper serves the next batch."""
    from fillmask_server.jobs import Failed

    poison = model.tokenize(["zebra"])[0][1]  # the token that makes this test's model fail
    forward = model.forward
    threads_failed: list[str] = []

    def failing(items: list[Item]) -> object:
        if any(poison in item.input_ids for item in items):
            threads_failed.append(threading.current_thread().name)
            raise ValueError("this test's model fails on zebras")
        return forward(items)

    monkeypatch.setattr(model, "forward", failing)
    texts = ["a [MASK] b", "c [MASK] d", "e [MASK] f", "g [MASK] zebra"]  # the last in the second part
    engine = Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector,
                    forward_parts=2, part_threads=1)
    engine.start()
    try:
        with engine.paused():
            for n, text in enumerate(texts):
                engine.submit(job(n, text))
            wait_runnable(engine, len(texts))
        outcomes = collector.wait_for(len(texts))
        with engine.paused():
            engine.submit(job("next-1"))
            engine.submit(job("next-2"))
            wait_runnable(engine, 2)
        later = collector.wait_for(len(texts) + 2)
    finally:
        engine.stop()
    assert isinstance(outcomes[3], Failed) and all(isinstance(outcomes[n], Result) for n in range(3))
    assert set(threads_failed) == {"fillmask-part-1"}  # its part's batch, then it alone, on the helper
    assert isinstance(later["next-1"], Result) and isinstance(later["next-2"], Result)


def test_the_calibration_times_the_batch_in_parts_beside_each_thread_count_unless_told_not_to(
        model: FillMaskModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """With two CPUs (as this machine kind has; set here, so that any machine runs it) the candidates are
    one and two threads in one pass and two threads in two parts; each is timed and reported in hello
    and the start-up line. ``--forward-parts 1`` leaves parts out; ``--torch-threads 2`` is timed in
    one pass and in parts; ``--forward-parts 2`` alone is a flag the user set: the parts share the
    usable CPUs, nothing is timed for them."""
    import torch

    from fillmask_server import calibration

    monkeypatch.setattr(calibration, "usable_cpus", lambda: 2)
    before = torch.get_num_threads()
    try:
        chosen = calibration.calibrate(model, 1.0)
        one_pass = calibration.calibrate(model, 1.0, forward_parts=1)
        threads_set = calibration.calibrate(model, 1.0, torch_threads=2)
        by_flag = calibration.calibrate(model, 0.5, forward_parts=2)
        skipped = calibration.calibrate(model, 0.0, forward_parts=2)
        monkeypatch.setenv(calibration.QUIET_LONE_ENV, "2:3.6,1:3.7")  # (a start without the wake-up's cost)
        forced = calibration.calibrate(model, 0.5, forward_parts=2)
    finally:
        torch.set_num_threads(before)
    timed = chosen.hello()["calibration"]["threads_ms"]
    assert [(entry["threads"], entry.get("parts", 1)) for entry in timed] == [(1, 1), (2, 1), (2, 2)]
    assert all(entry["ms"] > 0 for entry in timed) and chosen.threads_from == "calibration"
    assert (chosen.torch_threads, chosen.forward_parts) in [(1, 1), (2, 1), (2, 2)]
    assert chosen.hello()["forward_parts"] == chosen.forward_parts
    assert "2 in 2 parts -> " in chosen.line() and chosen.line().count(chosen.layout_words()) == 1
    assert one_pass.forward_parts == 1 and not one_pass.parts_ms and sorted(one_pass.threads_ms) == [1, 2]
    # A thread count the user set is the one count timed, in one pass and in parts; it stays the flag's.
    assert list(threads_set.threads_ms) == [2] and list(threads_set.parts_ms) == [2]
    assert threads_set.torch_threads == 2 and threads_set.threads_from == "flag" and threads_set.forward_parts in (1, 2)
    # A lone request after the team's quiet is timed on one thread and on the team wherever the count
    # is not the user's and is two or more (the flag's parts included); never with --torch-threads.
    for found in (chosen, one_pass, by_flag):
        assert (sorted(found.quiet_lone_ms) == [1, 2]) is (found.torch_threads == 2), found
        assert (found.quiet_after_ms is not None) is (found.torch_threads == 2)
        assert ("quiet_lone" in found.hello()["calibration"]) is (found.torch_threads == 2)
        assert ("of quiet" in found.line()) is (found.torch_threads == 2)
    assert by_flag.quiet_lone_ms and all(ms > 0 for ms in by_flag.quiet_lone_ms.values())
    assert not threads_set.quiet_lone_ms and not skipped.quiet_lone_ms
    assert forced.quiet_lone_ms == {1: 3.7, 2: 3.6} and forced.quiet_warm_ms != {1: 3.7, 2: 3.6}  # the test hook
    for bad in ("2=3.6", "4:3.6", "1:0", ""):
        monkeypatch.setenv(calibration.QUIET_LONE_ENV, bad)
        if bad:
            with pytest.raises(ValueError, match=r"reads like 1:3\.7,2:3\.6"):
                calibration.forced_quiet_lone({1: 3.5, 2: 15.0})
        else:
            assert calibration.forced_quiet_lone({1: 3.5, 2: 15.0}) == {1: 3.5, 2: 15.0}
    for flagged in (by_flag, skipped):
        assert (flagged.torch_threads, flagged.forward_parts, flagged.part_threads) == (2, 2, 1)
        assert flagged.threads_from == "flag" and not flagged.threads_ms and not flagged.parts_ms
    assert by_flag.line().startswith("calibrated in") and "torch threads 2 in 2 parts of 1 (flag)" in by_flag.line()


@contextlib.contextmanager
def quiet_engine(model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch,
                 layouts: list[tuple[int, int]], clock: list[float], quiet: QuietLone | None = None
                 ) -> Iterator[tuple[Engine, list[tuple[str, int, int]], list[int], list[int]]]:
    """A started engine on the fake ``clock`` (its one value, which the test moves, and each forward pass
    by a millisecond) whose tuner stays at the layout of rank 2, with ``quiet`` (by default one thread
    after half a second's quiet of a team of two); with the lists of its forward passes
    (``record_forward``) and of the batches whose time the tuner and the cost model were told (by
    rank, and by rows). Stopped, and torch's thread count put back, on exit."""
    import torch

    calls = record_forward(model, monkeypatch)
    recording = model.forward
    monkeypatch.setattr(model, "forward", lambda items: (clock.__setitem__(0, clock[0] + 1e-3), recording(items))[1])
    tuner = ThreadTuner([1, 2], 2, clock[0], adaptive=False)
    timed: list[int] = []
    ran = tuner.ran
    monkeypatch.setattr(tuner, "ran", lambda count, seconds, *args: (timed.extend([count] * (seconds > 0)),
                                                                    ran(count, seconds, *args))[1])
    engine = Engine(model, BatchPolicy(8, 4096, growth=100.0), max_queue=20, max_masks=4, deliver=collector,
                    clock=lambda: clock[0], threads=tuner, layouts=layouts,
                    quiet=quiet or QuietLone({1: 3.8e-3, 2: 14.8e-3}, 0.5))
    observed: list[int] = []
    observe = engine.core.cost.observe_forward
    monkeypatch.setattr(engine.core.cost, "observe_forward",
                        lambda rows, *args: (observed.append(rows), observe(rows, *args))[1])
    before = torch.get_num_threads()
    engine.start()
    try:
        yield engine, calls, timed, observed
    finally:
        engine.stop()
        torch.set_num_threads(before)


def test_a_lone_request_after_the_team_went_quiet_runs_on_the_fewer_threads_the_calibration_measured(
        model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where one thread is the rule after a quiet, a lone request runs on one thread when the model thread's
    last pass on both threads ended ``after_s`` ago or more (or never), and on its layout's two threads
    sooner; a batch of several texts always on its layout's. Such a batch, and the next one when it
    wakes the team the rule keeps asleep, say nothing to the tuner or the cost model, which model the
    layout in use.
    The engine's clock is fake: only the test moves it."""
    clock = [100.0]
    with quiet_engine(model, collector, monkeypatch, [(1, 1), (2, 1)], clock) as (engine, calls, timed, observed):
        engine.submit(job("first"))  # the team has never run
        collector.wait_for(1)
        submit_as_one_batch(engine, [job(n, "x [MASK] y") for n in range(3)])  # wakes the team
        collector.wait_for(4)
        submit_as_one_batch(engine, [job(n, "x [MASK] y") for n in range(3, 5)])
        collector.wait_for(6)
        engine.submit(job("soon"))  # right after the team's pass
        collector.wait_for(7)
        clock[0] += 1.0  # the team quiet ever since
        engine.submit(job("later"))
        outcomes = collector.wait_for(8)
    assert [(items, count) for _, items, count in calls] == [(1, 1), (3, 2), (2, 2), (1, 2), (1, 1)]
    assert all(isinstance(outcome, Result) for outcome in outcomes.values())
    assert timed == [2, 2] and observed == [2, 1]  # not the moved batches, nor the first back on the team
    assert engine.stats.quiet_lone == 2


def test_a_start_that_kept_the_team_moves_lone_requests_to_one_thread_once_a_pass_shows_the_wake_up(
        model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration saw the team wake fast and kept it. Here each forward pass moves the fake clock
    as a sleeping team's slow wake-up would (14 ms more on two threads, 3.7 on one). The first lone
    request after a quiet on the team wakes it slowly, and the rule moves the next ones to one thread.
    That first ran on the layout's team as the rule had it: the tuner and the cost model hear of it;
    the moved ones the tuner counts, untimed (so that a probe of its under light load still ends),
    and the cost model does not hear of them."""
    import torch

    clock = [100.0]
    kept = QuietLone({1: 3.7e-3, 2: 3.6e-3}, 0.5, {1: 2.6e-3, 2: 2.4e-3})
    assert kept.threads == 2
    with quiet_engine(model, collector, monkeypatch, [(1, 1), (2, 1)], clock, kept) as (engine, calls, timed,
                                                                                          observed):
        forward = model.forward

        def waking(items: list[Item]) -> object:
            clock[0] += 14e-3 if torch.get_num_threads() == 2 else 3.7e-3
            return forward(items)

        monkeypatch.setattr(model, "forward", waking)
        tuner = engine.core.threads
        assert tuner is not None
        counted: list[tuple[int, float]] = []
        ran = tuner.ran
        monkeypatch.setattr(tuner, "ran", lambda count, seconds, *args: (counted.append((count, seconds)),
                                                                        ran(count, seconds, *args))[1])
        for n in range(3):
            clock[0] += 1.0
            engine.submit(job(n))
            collector.wait_for(n + 1)
    assert [count for _, _, count in calls] == [2, 1, 1]
    assert kept.threads == 1 and kept.estimates()[2] > 5e-3 > kept.estimates()[1] and kept.served == {1: 2, 2: 1}
    assert engine.stats.quiet_lone == 2 and timed == [2] and observed == [1]
    assert counted[1:] == [(2, 0.0)] * 2 and len(counted) == 3  # (the layout's rank: two threads in one pass)


def test_a_probe_runs_a_lone_request_on_the_team_and_wakes_it_for_the_next_one(
        model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every second request of the rule is a probe here (``probe_every=2``; the server's is
    ``QUIET_PROBE_EVERY``): on one thread, the first lone request after a quiet runs on one thread,
    the second on the team to time it (not moved; its time says nothing to the tuner or the cost
    model: it woke the team), the third, right after, on the team like any lone request soon after
    the team's pass (and the tuner and the cost model hear of it), and the fourth, after a quiet,
    on one thread again."""
    clock = [100.0]
    quiet = QuietLone({1: 3.8e-3, 2: 14.8e-3}, 0.5, probe_every=2)
    with quiet_engine(model, collector, monkeypatch, [(1, 1), (2, 1)], clock, quiet) as (engine, calls, timed,
                                                                                           observed):
        for n in range(4):
            clock[0] += 1.0 if n != 2 else 0.0
            engine.submit(job(n))
            collector.wait_for(n + 1)
    assert [count for _, _, count in calls] == [1, 2, 2, 1]
    assert quiet.probes == 1 and quiet.threads == 1 and engine.stats.quiet_lone == 2
    assert timed == [2] and observed == [1]
    assert quiet.served == {1: 2, 2: 1} and quiet.estimates()[2] < 14.8e-3  # the probe's time reached the rule


def test_the_rule_gets_the_forward_pass_alone_and_the_cost_models_scale_to_the_calibrations_length(
        model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule compares passes with the calibration's timing of one ``model.forward``: it gets the
    forward pass's time alone (here the fake clock moves 2 ms before it, while the thread count is
    set, and 1 ms in it), and the cost model's ratio of a pass of the request's length to one of the
    calibration's ``tokens``: above 1 for a request longer than those, below for a shorter one."""
    clock = [100.0]
    quiet = QuietLone({1: 3.8e-3, 2: 14.8e-3}, 0.5, tokens=12)
    told: list[tuple[int, float, float]] = []
    ran = quiet.ran
    monkeypatch.setattr(quiet, "ran", lambda threads, seconds, scale: (told.append((threads, seconds, scale)),
                                                                       ran(threads, seconds, scale))[1])
    monkeypatch.setattr(model, "set_threads", lambda count, set_threads=model.set_threads: (
        clock.__setitem__(0, clock[0] + 2e-3), set_threads(count))[1])
    with quiet_engine(model, collector, monkeypatch, [(1, 1), (2, 1)], clock, quiet) as (engine, calls, _, _):
        texts = ["a [MASK] b", "one two three four five six seven eight nine ten [MASK] eleven twelve thirteen"]
        for n, text in enumerate(texts):
            clock[0] += 1.0
            engine.submit(job(n, text))
            collector.wait_for(n + 1)
    assert [count for _, _, count in calls] == [1, 1]
    assert [(threads, seconds) for threads, seconds, _ in told] == [(1, pytest.approx(1e-3))] * 2
    assert told[0][2] < 1 < told[1][2]


def test_in_parts_no_batch_runs_the_team_so_a_lone_request_runs_on_one_thread_even_right_after_one(
        model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two parts of one thread (rank 2 of ``[(1, 1), (2, 2)]``): a batch in parts runs no team, so a
    lone request right after one runs on one thread (the team's own quiet is what counts), and so does
    one after a longer quiet; a batch in parts after them keeps its parts' threads, and the tuner and
    the cost model hear of it (it wakes no team)."""
    clock = [100.0]
    with quiet_engine(model, collector, monkeypatch, [(1, 1), (2, 2)], clock) as (engine, calls, timed, observed):
        submit_as_one_batch(engine, [job(n, "x [MASK] y") for n in range(4)])
        collector.wait_for(4)
        engine.submit(job("right after the parts"))
        collector.wait_for(5)
        clock[0] += 1.0
        engine.submit(job("after the quiet"))
        collector.wait_for(6)
        submit_as_one_batch(engine, [job(n, "x [MASK] y") for n in range(6, 8)])
        outcomes = collector.wait_for(8)
    assert sorted(calls[:2]) == [("fillmask-model", 2, 1), ("fillmask-part-1", 2, 1)]  # the batch in parts
    assert calls[2:4] == [("fillmask-model", 1, 1), ("fillmask-model", 1, 1)]
    assert sorted(calls[4:]) == [("fillmask-model", 1, 1), ("fillmask-part-1", 1, 1)]
    assert all(isinstance(outcome, Result) for outcome in outcomes.values())
    assert timed == [2, 2] and observed == [4, 2] and engine.stats.quiet_lone == 2


def test_a_batch_with_fewer_texts_than_parts_shares_all_the_threads_between_them(
        model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four parts of one thread: a batch of two texts runs as two parts of two threads each, not two of
    one with two cores idle. (More threads than this machine's CPUs are fine for this check.)"""
    import torch

    calls = record_forward(model, monkeypatch)
    before = torch.get_num_threads()
    engine = Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector,
                    forward_parts=4, part_threads=1)
    engine.start()
    try:
        with engine.paused():
            engine.submit(job(0, "a [MASK] b"))
            engine.submit(job(1, "c [MASK] d"))
            wait_runnable(engine, 2)
        assert all(isinstance(outcome, Result) for outcome in collector.wait_for(2).values())
    finally:
        engine.stop()
        torch.set_num_threads(before)
    assert sorted((name, count) for name, _, count in calls) == [("fillmask-model", 2), ("fillmask-part-1", 2)]


def test_the_thread_tuner_measures_the_layouts_in_parts_too(model: FillMaskModel, collector: Collector,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose calibration chose its layout measures the layouts again while serving: the tuner's
    candidates are the layouts timed, by rank (the most preferred on a tie first), so a start-up that
    a neighbour disturbed into one pass can still reach the parts, and back. Here the tuner probes at
    once: from two parts, it runs batches in one pass at one thread or at two (its neighbours), each at
    its layout's threads, and the hello follows the layout in use."""
    import torch

    from fillmask_server.calibration import Calibration
    from fillmask_server.config import Config
    from fillmask_server.server import FillMaskServer

    with pytest.raises(ValueError, match="needs the layouts"):
        Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector,
               threads=ThreadTuner([1, 2], 2, time.monotonic()), forward_parts=2)
    chosen = Calibration(2, "calibration", threads_ms={1: 8.0, 2: 6.0}, forward_parts=2, parts_ms={2: 5.9})
    assert chosen.layouts() == [(1, 1), (2, 2), (2, 1)]
    server = FillMaskServer(Config(model="tiny"), model, chosen)
    tuner = server.engine.core.threads
    assert tuner is not None and tuner.candidates == [1, 2, 3] and tuner.current == 2
    look = server.engine.core.second_look  # the same layouts, with the times the calibration gave them
    assert look is not None and look.layouts == chosen.layouts()
    assert look.batch_s == pytest.approx([8.0e-3, 5.9e-3, 6.0e-3])
    assert server._layout_now() == (2, 2) and server.engine.forward_parts == 2
    hello = orjson.loads(server._current_hello())["engine"]
    assert (hello["torch_threads"], hello["forward_parts"]) == (2, 2)
    tuner.current = 3  # as a switch leaves it: the next hello says the layout now in use
    hello = orjson.loads(server._current_hello())["engine"]
    assert (hello["torch_threads"], hello["forward_parts"]) == (2, 1) and server.engine.forward_parts == 1
    # A thread count the user set keeps its count: only its layouts, in one pass and in parts, are tried.
    count_set = Calibration(2, "flag", threads_ms={2: 6.0}, forward_parts=1, parts_ms={2: 5.9})
    server = FillMaskServer(Config(model="tiny", torch_threads=2), model, count_set)
    tuner = server.engine.core.threads
    assert tuner is not None and tuner.candidates == [1, 2] and tuner.current == 2
    assert [server.engine.layout(rank) for rank in tuner.candidates] == [(2, 2), (2, 1)]
    assert server.engine.core.second_look is not None
    for nothing_timed in (Calibration(2, "flag", forward_parts=2), Calibration(2, "default")):
        server = FillMaskServer(Config(model="tiny"), model, nothing_timed)
        assert server.engine.core.threads is None and server.engine.core.second_look is None

    calls = record_forward(model, monkeypatch)
    before = torch.get_num_threads()
    probing = ThreadTuner([1, 2, 3], 2, time.monotonic(), first_interval_s=0.05, probe_share=1.0)  # at once
    engine = Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector, threads=probing,
                    layouts=chosen.layouts())
    engine.start()
    try:
        n = 0
        deadline = time.monotonic() + 30
        while not any(name == "fillmask-model" and items == 2 for name, items, _ in calls):  # a probe in one pass
            assert time.monotonic() < deadline, calls
            submit_as_one_batch(engine, [job(n), job(n + 1)])
            n += 2
            collector.wait_for(n)
    finally:
        engine.stop()
        torch.set_num_threads(before)
    assert engine.ended
    # Two texts a batch: in parts, one text on each thread at one torch thread; a probe in one pass runs
    # both on the model thread, at one thread or at two (which neighbour first, and whether it wins,
    # depends on this machine and its load).
    assert ("fillmask-part-1", 1, 1) in calls and ("fillmask-model", 1, 1) in calls
    assert {count for name, items, count in calls if name == "fillmask-model" and items == 2} <= {1, 2}
    assert all(isinstance(outcome, Result) for outcome in collector.outcomes)


class LockChecking(logging.Handler):
    """Records each line the engine logs with whether its lock was free to the thread that logged it: the
    lock is not re-entrant, so the thread that holds it waits out the timeout (another thread holding it
    a moment only delays the answer)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(logging.INFO)
        self.engine = engine
        self.lines: list[tuple[str, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        free = self.engine._lock.acquire(timeout=5)
        if free:
            self.engine._lock.release()
        self.lines.append((record.getMessage(), free))


def test_the_second_look_hears_the_cpu_of_every_thread_but_the_models_and_switches_to_its_layout(
        model: FillMaskModel, collector: Collector, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """On the first busy spell the engine tells the second look (``layout.SecondLook``) the CPU time
    that the submitting thread (the event loop's place), the tokenizer stage and the decode stage used,
    never the model thread's nor a part helper's, and runs the next batches in the layout the look
    chose. The timings here make one pass at two threads win with nothing beside the forward pass
    (as the calibration times it), and two parts win once a request takes more than 3 us of CPU
    beside it, which tokenizing and decoding alone take on any machine."""
    import torch

    from fillmask_server.layout import LOOK_REQUESTS, SecondLook, choose_layout

    layouts = [(1, 1), (2, 2), (2, 1)]
    timed = [1.0, 5.38e-3, 5.1e-3]
    assert choose_layout(dict(zip(layouts, timed, strict=True)), 16, 0.0, 2) == (2, 1)
    assert choose_layout(dict(zip(layouts, timed, strict=True)), 16, 5e-6, 2) == (2, 2)
    look = SecondLook(layouts, timed, 16, 2)
    with pytest.raises(ValueError, match="needs the layouts"):
        Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector,
               threads=ThreadTuner([1, 2, 3], 3, 0.0), layouts=layouts[:2], second_look=look)
    engine = Engine(model, BatchPolicy(32, 4096), max_queue=1000, max_masks=4, deliver=collector,
                    threads=ThreadTuner([1, 2, 3], 3, time.monotonic(), adaptive=False),  # (no probe)
                    layouts=layouts, second_look=look)
    heard: list[str] = []
    beside = engine.core.beside

    def hearing(cpu_s: float) -> None:
        heard.append(threading.current_thread().name)
        beside(cpu_s)

    monkeypatch.setattr(engine.core, "beside", hearing)
    calls = record_forward(model, monkeypatch)
    logged = LockChecking(engine)  # (its lines were written under the engine's lock: a handler that blocks held it)
    engine_log = logging.getLogger("fillmask_server.engine")
    engine_log.addHandler(logged)
    caplog.set_level(logging.INFO, logger=engine_log.name)
    before = torch.get_num_threads()
    engine.start()
    try:
        n = 0
        deadline = time.monotonic() + 60
        while look.done is None:  # about a second of batches back to back
            assert time.monotonic() < deadline, "no busy spell made the look"
            for _ in range(32):
                assert engine.submit(job(n)) is Admission.ACCEPTED
                n += 1
            collector.wait_for(n - 16)
        collector.wait_for(n)
        looked = len(calls)
        submit_as_one_batch(engine, [job(n + i) for i in range(4)])  # then several texts, in the layout chosen
        n += 4
        collector.wait_for(n)
    finally:
        engine.stop()
        torch.set_num_threads(before)
        engine_log.removeHandler(logged)
    assert look.done.before == 3 and look.done.chosen == 2 and look.done.requests >= LOOK_REQUESTS
    assert any("layout" in line for line, _ in logged.lines) and all(free for _, free in logged.lines), logged.lines
    assert look.done.beside_s > 5e-6  # (what the choice needs: measured, not assumed)
    assert engine.core.threads is not None and engine.core.threads.current == 2 and engine.forward_parts == 2
    assert set(heard) == {threading.current_thread().name, "fillmask-intake", "fillmask-decode"}
    assert calls[looked:] == [("fillmask-model", 2, 1), ("fillmask-part-1", 2, 1)] or calls[looked:] == [
        ("fillmask-part-1", 2, 1), ("fillmask-model", 2, 1)]  # (the parts run side by side: either ends first)
    assert all(isinstance(outcome, Result) for outcome in collector.outcomes) and len(collector.outcomes) == n
