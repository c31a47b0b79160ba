"""The engine thread with the real tiny model but no sockets: what the server cannot easily stage."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import orjson
import pytest

from fillmask_server.batching import BatchPolicy
from fillmask_server.engine import Engine, Job, State
from fillmask_server.model import FillMaskModel, load_model
from fillmask_server.protocol import FillMaskRequest


class Collector:
    """A ``deliver`` callback that records frames and lets a test wait for them."""

    def __init__(self) -> None:
        self.frames: list[dict] = []
        self._cond = threading.Condition()

    def __call__(self, items: list[tuple[Job, bytes]]) -> None:
        with self._cond:
            self.frames.extend(orjson.loads(frame) for _, frame in items)
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = 10.0) -> list[dict]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.frames) >= count, timeout), self.frames
            return list(self.frames)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> FillMaskModel:
    return load_model(str(tiny_model_dir))


@pytest.fixture
def engine(model: FillMaskModel):
    collector = Collector()
    engine = Engine(model, BatchPolicy(8, 4096), max_queue=10, max_masks=4, deliver=collector)
    engine.collector = collector  # type: ignore[attr-defined]
    engine.start()
    yield engine
    engine.stop()


def job(frame_id: object, text: str = "a [MASK] b", deadline: float | None = None, **fields: object) -> Job:
    now = time.monotonic()
    return Job(FillMaskRequest(frame_id, text, fields.get("top_k", 5)), owner=None, arrival=now, deadline=deadline)


def test_expired_requests_are_answered_504_without_running(engine: Engine) -> None:
    with engine.paused():
        assert engine.submit(job("old", deadline=time.monotonic() - 1))
        assert engine.submit(job("fresh"))
    frames = {f["id"]: f for f in engine.collector.wait_for(2)}  # type: ignore[attr-defined]
    assert (frames["old"]["type"], frames["old"]["status"]) == ("overloaded", 504)
    assert frames["fresh"]["type"] == "result"
    assert engine.stats.rows == 1 and engine.stats.expired == 1


def test_submit_refuses_beyond_max_queue(engine: Engine) -> None:
    with engine.paused():
        accepted = [engine.submit(job(i)) for i in range(12)]
        assert accepted == [True] * 10 + [False] * 2
    assert len(engine.collector.wait_for(10)) == 10  # type: ignore[attr-defined]


def test_cancel_wins_only_while_queued(engine: Engine) -> None:
    first, second = job(1), job(2)
    with engine.paused():
        engine.submit(first)
        engine.submit(second)
        assert engine.cancel(first) is True
        assert engine.cancel(first) is False  # a second transition out of QUEUED is refused
    frames = engine.collector.wait_for(1)  # type: ignore[attr-defined]
    assert [f["id"] for f in frames] == [2]
    assert second.state is State.DONE and engine.cancel(second) is False


def test_tokenizer_checks_answer_with_errors(engine: Engine) -> None:
    long_text = "[MASK]" + " word" * 600
    engine.submit(job("long", long_text))
    engine.submit(job("many", "[MASK] " * 5))
    frames = {f["id"]: f for f in engine.collector.wait_for(2)}  # type: ignore[attr-defined]
    assert frames["long"]["code"] == "text_too_long" and "512" in frames["long"]["message"]
    assert frames["many"]["code"] == "too_many_masks"
    assert engine.stats.rows == 0
