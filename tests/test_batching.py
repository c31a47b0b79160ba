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
    n_tokens: int = 10
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
    q = queue(FakeJob("a", n_tokens=40), FakeJob("b", n_tokens=40), FakeJob("c", n_tokens=30))
    decision = policy(tokens=100).take(q, now=0)
    assert names(decision.batch) == ["a", "b"] and decision.padded_tokens == 80  # a+b+c: 3 x 40 > 100
    decision = policy(tokens=100).take(q, now=0)
    assert names(decision.batch) == ["c"] and decision.padded_tokens == 30


def test_one_request_over_the_budget_still_runs_alone() -> None:
    q = queue(FakeJob("big", n_tokens=500), FakeJob("small", n_tokens=5))
    decision = policy(tokens=100).take(q, now=0)
    assert names(decision.batch) == ["big"]


def test_a_batch_keeps_its_lengths_within_a_band() -> None:
    lengths = {"a": 20, "long": 200, "short": 8, "b": 25, "c": 30, "d": 14, "e": 31}
    q = queue(*(FakeJob(name, n_tokens=n) for name, n in lengths.items()))
    decision = policy().take(q, now=0)
    # led by the oldest (a, 20 tokens); the others join while longest <= 1.5 x shortest
    assert names(decision.batch) == ["a", "b", "c"]
    assert decision.padded_tokens == 3 * 30
    assert names(q) == ["long", "short", "d", "e"]
    assert names(policy().take(q, now=0).batch) == ["long"]


def test_similar_lengths_need_less_padding_than_arrival_order() -> None:
    """The point of the band: mixed lengths cost fewer padded tokens in all."""
    lengths = [8, 60, 9, 55, 10, 64, 12, 58] * 4
    q = queue(*(FakeJob(str(i), arrival=i, n_tokens=n, owner=str(i)) for i, n in enumerate(lengths)))
    p = policy(size=32)
    padded = 0
    while q:
        padded += p.take(q, now=0).padded_tokens
    assert padded <= 1.25 * sum(lengths)  # one arrival-order batch would pad to 32 x 64 = 3.5 x the tokens


def test_the_least_recently_served_connection_leads_the_next_batch() -> None:
    heavy = [FakeJob(f"h{i}", arrival=i, n_tokens=10, owner="heavy") for i in range(100)]
    light = FakeJob("light", arrival=50, n_tokens=300, owner="light")  # far outside heavy's band
    q = queue(*heavy[:50], light, *heavy[50:])
    p = policy(size=8, tokens=100_000)
    first = p.take(q, now=0)
    assert names(first.batch) == [f"h{i}" for i in range(8)]  # heavy's oldest leads; light is too long
    assert names(p.take(q, now=0).batch) == ["light"]  # then light, the connection not yet served


def test_a_trickle_of_new_connections_cannot_starve_a_backlog() -> None:
    """A light client whose single request arrives between every two batches must not lead them all."""
    heavy = [FakeJob(f"h{i}", arrival=i, n_tokens=80, owner="heavy") for i in range(400)]
    q = queue(*heavy)
    p = policy(size=4)
    heavy_batches = 0
    for n in range(100):
        q.append(FakeJob(f"l{n}", arrival=1000 + n, n_tokens=8, owner=f"light{n % 2}"))
        if any(job.owner == "heavy" for job in p.take(q, now=0).batch):
            heavy_batches += 1
    assert heavy_batches >= 45  # heavy leads at least every other batch


def test_max_wait_never_waits_past_a_deadline() -> None:
    p = policy(size=8, wait=0.050)
    q = queue(FakeJob("a", arrival=1.000, deadline=1.010))
    assert p.wait_s(q, now=1.002) == pytest.approx(0.008)


def test_places_are_shared_round_robin_across_connections() -> None:
    a = [FakeJob(f"a{i}", arrival=i, owner="a") for i in range(10)]
    b = [FakeJob(f"b{i}", arrival=10 + i, owner="b") for i in range(10)]
    decision = policy(size=6).take(queue(*a, *b), now=0)
    assert names(decision.batch) == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_every_request_is_served_within_a_bounded_number_of_batches() -> None:
    lengths = [5, 300, 7, 120, 9, 64, 200, 3] * 10
    owners = 3
    jobs = [FakeJob(str(i), arrival=i, n_tokens=n, owner=str(i % owners)) for i, n in enumerate(lengths)]
    q = queue(*jobs)
    p = policy(size=8, tokens=1200)
    served: dict[str, int] = {}
    rounds = 0
    while q:
        rounds += 1
        assert rounds <= len(lengths)
        for job in p.take(q, now=0).batch:
            served[job.name] = rounds
    assert len(served) == len(lengths)
    for i in range(len(lengths)):  # each batch serves a lead; a connection leads at least every `owners` batches
        assert served[str(i)] <= (i // owners + 1) * owners


def test_expired_requests_are_removed_not_batched() -> None:
    q = queue(FakeJob("old", deadline=1.0), FakeJob("ok", deadline=9.0), FakeJob("free"))
    decision = policy().take(q, now=1.0)
    assert names(decision.expired) == ["old"]
    assert names(decision.batch) == ["ok", "free"]


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


# --- anticipation: answers just sent bring requests back (issue 9 item 3) ---------------------------


def anticipating(size: int = 32, cap: float = 0.005) -> BatchPolicy:
    p = BatchPolicy(max_batch_size=size, max_batch_tokens=10_000, anticipate_s=cap)
    p.batch_ran(0.010)  # the last batch took 10 ms: a wait may cost at most 30% of that, 3 ms
    return p


def test_an_idle_engine_never_waits_for_company() -> None:
    assert anticipating().wait_s(queue(FakeJob("a", arrival=1.0)), now=1.0) == 0.0


def test_after_answers_a_half_empty_batch_waits_for_the_requests_they_bring_back() -> None:
    p = anticipating()
    p.answered(16, now=1.000)  # a batch of 16 answered; 16 others are queued meanwhile
    q = queue(*(FakeJob(str(i), arrival=0.995) for i in range(16)))
    assert p.wait_s(q, now=1.001) == pytest.approx(0.002)  # until 1.003: 30% of the 10 ms batch
    p.arrived(10)
    q.extend(FakeJob(f"back-{i}", arrival=1.0015) for i in range(10))
    assert p.wait_s(q, now=1.0015) == pytest.approx(0.0015)  # the deadline is not restarted
    p.arrived(6)  # all 16 came back: nothing more to wait for
    q.extend(FakeJob(f"back-{i}", arrival=1.002) for i in range(10, 16))
    assert p.wait_s(q, now=1.002) == 0.0


def test_the_wait_is_capped_and_ends_with_its_window() -> None:
    p = anticipating(cap=0.001)
    p.answered(8, now=2.0)
    q = queue(FakeJob("a", arrival=1.99))
    assert p.wait_s(q, now=2.0) == pytest.approx(0.001)  # the cap, below 30% of 10 ms
    assert p.wait_s(q, now=2.001) == 0.0  # returns that have not come back by then are not waited for


def test_a_full_batch_or_a_deadline_does_not_wait() -> None:
    p = anticipating(size=4)
    p.answered(4, now=3.0)
    assert p.wait_s(queue(*(FakeJob(str(i)) for i in range(4))), now=3.0) == 0.0
    assert p.wait_s(queue(FakeJob("soon", deadline=3.001)), now=3.0) == pytest.approx(0.001)


def test_anticipation_off_by_default() -> None:
    p = policy()
    p.batch_ran(0.010)
    p.answered(16, now=1.0)
    assert p.wait_s(queue(FakeJob("a", arrival=1.0)), now=1.0) == 0.0
