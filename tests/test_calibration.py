"""Unit tests of the start-up calibration's pure parts: the candidate thread counts (the CPUs this process
may use, within its container's CPU quota) and how one is chosen from timings."""

from __future__ import annotations

import os
from collections.abc import Callable

from fillmask_server.calibration import (
    CGROUP_V1_CPU_DIRS,
    CGROUP_V2_CPU_MAX,
    MIN_THREAD_ROUNDS,
    THREAD_TIE,
    choose_threads,
    cpu_quota,
    fastest_per_count,
    usable_cpus,
)


def timings(speeds: dict[int, float], burst: range) -> tuple[list[int], Callable[[int], float]]:
    """A fake ``time_at``: each count's own time, 100x slower for the calls numbered in ``burst`` (a
    neighbour's passing load); and the list of counts in the order they were timed."""
    calls: list[int] = []

    def time_at(count: int) -> float:
        slow = 100.0 if len(calls) in burst else 1.0
        calls.append(count)
        return speeds[count] * slow

    return calls, time_at


def test_the_counts_are_timed_in_turn_and_each_keeps_its_fastest_pass() -> None:
    calls, time_at = timings({1: 2.0, 2: 1.0}, range(0))
    fastest = fastest_per_count(time_at, [1, 2], 3)
    assert calls == [1, 2, 1, 2, 1, 2]
    assert fastest == {1: 2.0, 2: 1.0}


def test_a_burst_of_load_does_not_decide_the_count_it_happened_to_hit() -> None:
    # Two threads are twice as fast here, and a burst covers the second half of the passes. Timed one
    # count after the other (four passes at one thread, then four at two) it would have covered every
    # pass at two threads, and one thread would have won; in turn, each count keeps two clean passes.
    calls, time_at = timings({1: 2.0, 2: 1.0}, range(4, 8))
    fastest = fastest_per_count(time_at, [1, 2], 4)
    assert len(calls) == 8 and fastest == {1: 2.0, 2: 1.0}
    assert choose_threads(fastest) == 2


def test_the_smaller_count_wins_a_tie_and_a_clear_winner_wins() -> None:
    assert choose_threads({1: 1.0, 2: 1.0 / (1 + THREAD_TIE / 2)}) == 1
    assert choose_threads({1: 1.0, 2: 0.5}) == 2
    assert choose_threads({1: 1.0, 2: 0.8, 4: 0.79}) == 2
    assert choose_threads({1: 3.0, 4: 1.0}) == 4
    assert choose_threads({1: 1.0}) == 1


def test_the_rounds_stop_when_the_budget_is_spent_but_never_below_the_minimum() -> None:
    calls, time_at = timings({1: 1.0, 2: 1.0}, range(0))
    fastest_per_count(time_at, [1, 2], 4, more=lambda: False)
    assert len(calls) == 2 * MIN_THREAD_ROUNDS
    calls, time_at = timings({1: 1.0, 2: 1.0}, range(0))
    fastest_per_count(time_at, [1, 2], 4, more=lambda: len(calls) < 6)
    assert len(calls) == 6
    calls, time_at = timings({1: 1.0, 2: 1.0}, range(0))
    fastest_per_count(time_at, [1, 2], 4)
    assert len(calls) == 8


def files(contents: dict[str, str]) -> Callable[[str], str | None]:
    return contents.get


def test_the_cpu_quota_is_read_from_cgroup_v2_or_v1_and_absent_when_unlimited() -> None:
    assert cpu_quota(files({CGROUP_V2_CPU_MAX: "200000 100000"})) == 2.0
    assert cpu_quota(files({CGROUP_V2_CPU_MAX: "150000 100000"})) == 1.5
    assert cpu_quota(files({CGROUP_V2_CPU_MAX: "max 100000"})) is None
    v1 = CGROUP_V1_CPU_DIRS[-1]
    assert cpu_quota(files({f"{v1}/cpu.cfs_quota_us": "300000", f"{v1}/cpu.cfs_period_us": "100000"})) == 3.0
    assert cpu_quota(files({f"{v1}/cpu.cfs_quota_us": "-1", f"{v1}/cpu.cfs_period_us": "100000"})) is None
    assert cpu_quota(files({f"{v1}/cpu.cfs_quota_us": "junk", f"{v1}/cpu.cfs_period_us": "100000"})) is None
    assert cpu_quota(files({})) is None


def test_the_usable_cpus_are_capped_by_the_quota_rounded_up_and_never_below_one() -> None:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert usable_cpus(files({})) == cpus
    assert usable_cpus(files({CGROUP_V2_CPU_MAX: "50000 100000"})) == 1  # half a CPU: one thread
    assert usable_cpus(files({CGROUP_V2_CPU_MAX: f"{(cpus + 8) * 100000} 100000"})) == cpus  # above: the CPUs
    if cpus >= 2:
        assert usable_cpus(files({CGROUP_V2_CPU_MAX: "150000 100000"})) == 2
