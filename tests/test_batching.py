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
    owner: str = "conn"


def queue(*jobs: FakeJob) -> deque[FakeJob]:
    return deque(jobs)


def names(jobs: list[FakeJob] | deque[FakeJob]) -> list[str]:
    return [job.name for job in jobs]


def policy(size: int = 32, tokens: int = 10_000, wait: float = 0.0) -> BatchPolicy:
    return BatchPolicy(max_batch_size=size, max_batch_tokens=tokens, max_wait_s=wait)


def test_takes_in_arrival_order_up_to_max_batch_size() -> None:
    q = queue(*(FakeJob(str(i)) for i in range(5)))
    decision = policy(size=3).take(q, now=0)
    assert names(decision.batch) == ["0", "1", "2"]
    assert names(q) == ["3", "4"]
    assert decision.padded_tokens == 30


def test_token_budget_counts_padding() -> None:
    q = queue(FakeJob("a", n_tokens=10), FakeJob("b", n_tokens=40), FakeJob("c", n_tokens=5))
    decision = policy(tokens=79).take(q, now=0)
    assert names(decision.batch) == ["a", "c"]  # a+b would pad to 2 x 40 = 80 tokens; c rides along
    assert decision.padded_tokens == 20
    decision = policy(tokens=79).take(q, now=0)
    assert names(decision.batch) == ["b"] and decision.padded_tokens == 40


def test_one_request_over_the_budget_still_runs_alone() -> None:
    q = queue(FakeJob("big", n_tokens=500), FakeJob("small", n_tokens=5))
    decision = policy(tokens=100).take(q, now=0)
    assert names(decision.batch) == ["big"]


def test_short_requests_ride_along_and_much_longer_ones_wait() -> None:
    q = queue(FakeJob("a", n_tokens=20), FakeJob("long", n_tokens=200), FakeJob("b", n_tokens=12),
              FakeJob("c", n_tokens=25), FakeJob("d", n_tokens=30), FakeJob("e", n_tokens=31))
    decision = policy().take(q, now=0)
    # a sets 20; b fits under it; then longer ones by length while <= 1.5 x 20 = 30: c (25), d (30)
    assert names(decision.batch) == ["a", "b", "c", "d"]
    assert names(q) == ["long", "e"]
    assert decision.padded_tokens == 4 * 30


def test_connections_are_served_round_robin() -> None:
    heavy = [FakeJob(f"h{i}", arrival=i, owner="heavy") for i in range(100)]
    light = FakeJob("light", arrival=50, owner="light")
    q = queue(*heavy[:50], light, *heavy[50:])
    decision = policy(size=8).take(q, now=0)
    assert names(decision.batch)[:1] == ["h0"] and "light" in names(decision.batch)
    assert len(decision.batch) == 8


def test_fairness_beats_length_preference() -> None:
    heavy = [FakeJob(f"h{i}", arrival=i, n_tokens=10, owner="heavy") for i in range(40)]
    light = FakeJob("light", arrival=40, n_tokens=300, owner="light")
    q = queue(*heavy, light)
    decision = policy(size=32, tokens=20_000).take(q, now=0)
    assert "light" in names(decision.batch)


def test_a_head_that_overflows_the_budget_blocks_second_requests_of_others() -> None:
    q = queue(FakeJob("a1", n_tokens=10, owner="a"), FakeJob("b1", n_tokens=90, owner="b"),
              FakeJob("a2", n_tokens=10, owner="a"))
    decision = policy(tokens=100).take(q, now=0)
    assert names(decision.batch) == ["a1"]  # a2 must not overtake b1, which did not fit
    assert names(policy(tokens=100).take(q, now=0).batch) == ["b1"]


def test_every_request_is_served_within_a_bounded_number_of_batches() -> None:
    lengths = [5, 300, 7, 120, 9, 64, 200, 3] * 10
    q = queue(*(FakeJob(str(i), arrival=i, n_tokens=n, owner=str(i % 3)) for i, n in enumerate(lengths)))
    served: dict[str, int] = {}
    rounds = 0
    while q:
        rounds += 1
        assert rounds <= len(lengths)
        for job in policy(size=8, tokens=1200).take(q, now=0).batch:
            served[job.name] = rounds
    assert len(served) == len(lengths)
    for i in range(len(lengths)):  # the i-th oldest is served within i+1 batches
        assert served[str(i)] <= i + 1


def test_expired_requests_are_removed_not_batched() -> None:
    q = queue(FakeJob("old", deadline=1.0), FakeJob("ok", deadline=9.0), FakeJob("free"))
    decision = policy().take(q, now=1.0)
    assert names(decision.expired) == ["old"]
    assert names(decision.batch) == ["ok", "free"]


def test_untokenized_requests_wait_for_the_next_batch() -> None:
    q = queue(FakeJob("a"), FakeJob("new", n_tokens=None), FakeJob("b"))
    decision = policy().take(q, now=0)
    assert names(decision.batch) == ["a", "b"] and names(q) == ["new"]


def test_no_wait_by_default_even_for_one_request() -> None:
    assert policy(size=8).wait_s(queue(FakeJob("a", arrival=5.0)), now=5.0) == 0.0


def test_max_wait_is_one_deadline_from_the_oldest_request() -> None:
    p = policy(size=8, wait=0.010)
    q = queue(FakeJob("a", arrival=1.000))
    assert p.wait_s(q, now=1.002) == pytest.approx(0.008)
    q.append(FakeJob("b", arrival=1.007))  # a later arrival does not restart the timer
    assert p.wait_s(q, now=1.008) == pytest.approx(0.002)
    assert p.wait_s(q, now=1.020) == 0.0


def test_no_wait_when_the_batch_is_already_full() -> None:
    assert policy(size=2, wait=1.0).wait_s(queue(FakeJob("a"), FakeJob("b")), now=0) == 0.0
    tight = policy(size=8, tokens=15, wait=1.0)
    assert tight.wait_s(queue(FakeJob("a"), FakeJob("b")), now=0) == 0.0  # token budget full


def test_empty_queue_gives_an_empty_batch() -> None:
    decision = policy().take(deque(), now=0)
    assert decision.batch == [] and decision.expired == []


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BatchPolicy(max_batch_size=0, max_batch_tokens=10)
