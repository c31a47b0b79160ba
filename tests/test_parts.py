"""Unit tests of ``parts.py``: how a batch is cut into parts, and the runner that runs them side by side."""

from __future__ import annotations

import random
import threading
import time

import pytest

from fillmask_server.parts import PartRunner, split


def test_a_batch_is_cut_into_contiguous_nonempty_parts_of_about_equal_tokens() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 40))]
        parts = rng.randint(1, 6)
        cuts = split(lengths, parts)
        assert [i for cut in cuts for i in cut] == list(range(len(lengths)))  # each item once, in order
        assert all(cuts) and len(cuts) == min(parts, len(lengths))
        share = sum(lengths) / len(cuts)
        for cut in cuts:  # no part further from its share than one item (plus the items the others need)
            tokens = sum(lengths[i] for i in cut)
            assert tokens <= share + max(lengths) or len(cut) == 1, (lengths, cuts)


def test_the_cut_follows_the_tokens_not_the_count_of_items() -> None:
    assert split([100, 1, 1], 2) == [[0], [1, 2]]
    assert split([1, 1, 100], 2) == [[0, 1], [2]]
    assert split([5] * 7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split([9], 2) == [[0]] and split([3, 4], 1) == [[0, 1]]
    assert split([1, 2], 4) == [[0], [1]]  # no more parts than items
    assert split([0, 0, 0], 2) == [[0], [1, 2]]  # even items without tokens give no empty part


def test_parts_run_side_by_side_each_on_its_own_thread_and_come_back_in_order() -> None:
    both_running = threading.Barrier(3, timeout=10)  # only passes while all three parts run at once
    names: list[str] = []
    set_counts: list[tuple[str, int]] = []

    def part(n: int):
        def run() -> int:
            names.append(threading.current_thread().name)
            both_running.wait()
            return n * 10
        return run

    runner: PartRunner[int] = PartRunner(2, 3, lambda count: set_counts.append(
        (threading.current_thread().name, count)), name="test-part")
    try:
        assert runner.parts == 3
        assert runner.run([part(0), part(1), part(2)]) == [0, 10, 20]
        assert runner.run([lambda: 50]) == [50]  # fewer parts than the runner can take: the caller's alone
        assert runner.run([lambda: 1, lambda: 2]) == [1, 2]
    finally:
        runner.close()
    assert names[0] == threading.current_thread().name and sorted(names[1:3]) == ["test-part-1", "test-part-2"]
    # Each helper set its torch thread count once, on itself, before its first part.
    assert sorted(set_counts) == [("test-part-1", 3), ("test-part-2", 3)]
    assert runner.ended


def test_a_failing_part_is_raised_only_after_every_part_has_finished() -> None:
    finished: list[str] = []

    def slow() -> str:
        time.sleep(0.2)
        finished.append("slow")
        return "slow"

    def failing() -> str:
        raise ValueError("part two failed")

    runner: PartRunner[str] = PartRunner(2, 1, lambda count: None)
    try:
        with pytest.raises(ValueError, match="part two failed"):
            runner.run([lambda: "first", failing, slow])
        assert finished == ["slow"]  # nothing of the batch still runs when the failure is seen
        with pytest.raises(KeyError):  # the caller's own part fails: the helpers' parts end first too
            runner.run([lambda: {}["missing"], slow])
        assert finished == ["slow", "slow"]
        assert runner.run([lambda: "again", lambda: "fine"]) == ["again", "fine"]  # the helpers live on
        with pytest.raises(ValueError, match="0 parts for a runner of 3"):
            runner.run([])
    finally:
        runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.run([lambda: "late"])


def test_a_runner_closed_while_a_batch_runs_still_finishes_that_batch() -> None:
    """``Engine.stop`` may close the runner while the model thread is inside ``run`` (it joins that
    thread for a while first): each part handed over still runs, so that ``run`` returns. The helper
    is held at its start until the runner is closed, so its part is handed over before it looks."""
    go = threading.Event()
    runner: PartRunner[str] = PartRunner(1, 1, lambda count: None, on_start=lambda name: go.wait(10))
    results: list[list[str]] = []

    def first() -> str:
        runner.close(timeout=0)  # closed with the helper's part handed over and not yet taken
        go.set()
        return "first"

    caller = threading.Thread(target=lambda: results.append(runner.run([first, lambda: "second"])))
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "run never returned: the helper left its part"
    assert results == [["first", "second"]]
    runner.close()
    assert runner.ended


def test_a_helper_that_dies_makes_runs_fail_instead_of_waiting_for_it() -> None:
    def crash(name: str) -> None:
        raise RuntimeError("this helper could not start")

    runner: PartRunner[str] = PartRunner(1, 1, lambda count: None, on_start=crash)
    results: list[object] = []

    def call() -> None:
        try:
            results.append(runner.run([lambda: "first", lambda: "second"]))
        except RuntimeError as exc:
            results.append(str(exc))

    for _ in range(2):  # the run under way when it dies (or the next), and every later one
        caller = threading.Thread(target=call)
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), "run waited for a dead helper"
    assert results == ["a helper thread of the forward pass's parts ended (RuntimeError: this helper could not "
                       "start)"] * 2
    runner.close()


def test_each_run_may_give_its_parts_another_thread_count() -> None:
    counts: list[int] = []
    runner: PartRunner[int] = PartRunner(1, 1, counts.append)
    try:
        runner.run([lambda: 0, lambda: 1])
        runner.run([lambda: 0, lambda: 1], threads=2)
        runner.run([lambda: 0, lambda: 1], threads=2)
        runner.run([lambda: 0, lambda: 1])
    finally:
        runner.close()
    assert counts == [1, 2, 1]  # set on the helper only when the count changes
