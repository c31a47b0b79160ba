"""Unit tests of the pure batching policy with fake times: no threads, no torch, no clock."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from fillmask_server.batching import BatchPolicy


@dataclass(eq=False)
class FakeJob:
    name: str
    arrival: float = 0.0
    deadline: float | None = None
    n_tokens: int | None = 10


def queue(*jobs: FakeJob) -> deque[FakeJob]:
    return deque(jobs)


def names(jobs: list[FakeJob]) -> list[str]:
    return [job.name for job in jobs]


def test_takes_in_order_up_to_max_batch_size() -> None:
    q = queue(*(FakeJob(str(i)) for i in range(5)))
    decision = BatchPolicy(max_batch_size=3, max_batch_tokens=10_000).take(q, now=0)
    assert names(decision.batch) == ["0", "1", "2"]
    assert names(list(q)) == ["3", "4"]
    assert decision.padded_tokens == 30


def test_token_budget_counts_padding() -> None:
    q = queue(FakeJob("a", n_tokens=10), FakeJob("b", n_tokens=40), FakeJob("c", n_tokens=5))
    decision = BatchPolicy(max_batch_size=10, max_batch_tokens=79).take(q, now=0)
    assert names(decision.batch) == ["a"]  # a+b would pad to 2 x 40 = 80 tokens
    decision = BatchPolicy(max_batch_size=10, max_batch_tokens=120).take(q, now=0)
    assert names(decision.batch) == ["b", "c"] and decision.padded_tokens == 80


def test_one_request_over_the_budget_still_runs_alone() -> None:
    q = queue(FakeJob("big", n_tokens=500), FakeJob("small", n_tokens=5))
    decision = BatchPolicy(max_batch_size=10, max_batch_tokens=100).take(q, now=0)
    assert names(decision.batch) == ["big"]


def test_expired_requests_are_removed_not_batched() -> None:
    q = queue(FakeJob("old", deadline=1.0), FakeJob("ok", deadline=9.0), FakeJob("free"))
    decision = BatchPolicy(max_batch_size=10, max_batch_tokens=1000).take(q, now=1.0)
    assert names(decision.expired) == ["old"]
    assert names(decision.batch) == ["ok", "free"]


def test_untokenized_request_ends_the_batch_to_keep_order() -> None:
    q = queue(FakeJob("a"), FakeJob("new", n_tokens=None), FakeJob("b"))
    decision = BatchPolicy(max_batch_size=10, max_batch_tokens=1000).take(q, now=0)
    assert names(decision.batch) == ["a"] and names(list(q)) == ["new", "b"]


def test_no_wait_by_default_even_for_one_request() -> None:
    policy = BatchPolicy(max_batch_size=8, max_batch_tokens=1000)
    assert policy.wait_s(queue(FakeJob("a", arrival=5.0)), now=5.0) == 0.0


def test_max_wait_is_one_deadline_from_the_oldest_request() -> None:
    policy = BatchPolicy(max_batch_size=8, max_batch_tokens=1000, max_wait_s=0.010)
    q = queue(FakeJob("a", arrival=1.000))
    assert policy.wait_s(q, now=1.002) == pytest.approx(0.008)
    q.append(FakeJob("b", arrival=1.007))  # a later arrival does not restart the timer
    assert policy.wait_s(q, now=1.008) == pytest.approx(0.002)
    assert policy.wait_s(q, now=1.020) == 0.0


def test_no_wait_when_the_batch_is_already_full() -> None:
    policy = BatchPolicy(max_batch_size=2, max_batch_tokens=1000, max_wait_s=1.0)
    assert policy.wait_s(queue(FakeJob("a"), FakeJob("b")), now=0) == 0.0
    tight = BatchPolicy(max_batch_size=8, max_batch_tokens=15, max_wait_s=1.0)
    assert tight.wait_s(queue(FakeJob("a"), FakeJob("b")), now=0) == 0.0  # token budget full


def test_empty_queue_gives_an_empty_batch() -> None:
    decision = BatchPolicy(max_batch_size=2, max_batch_tokens=10).take(deque(), now=0)
    assert decision.batch == [] and decision.expired == []


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BatchPolicy(max_batch_size=0, max_batch_tokens=10)
