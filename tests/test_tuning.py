"""Fake-clock unit tests of the thread count measured again while serving (``tuning.ThreadTuner``)."""

from __future__ import annotations

import itertools

import pytest

from fillmask_server.tuning import (
    ABORT_RATIO,
    ABORT_RATIO_WARM_UP,
    CLEAR_LOSS_RATIO,
    CONFIRM_INTERVAL_S,
    FIRST_INTERVAL_S,
    FRESH_BATCHES,
    LOAD_ROWS_CHANGE,
    MAX_INTERVAL_S,
    PROBE_BATCHES,
    PROBE_MAX_BATCHES,
    PROBE_SHARE,
    SWITCH_ONE_THREAD_S,
    SWITCH_TEAM_S,
    THREAD_TIE,
    WARM_UP_MOST,
    WINS_TO_SWITCH,
    ThreadTuner,
    switch_interval_s,
)


class Machine:
    """Batches of ``rows`` requests on a fake clock: each count's time per batch against a prediction of
    1 s x ``scale``; ``noise`` (optional) multiplies a count's batches' times by its factors, in turn;
    the first batch after a change of count takes ``change_s`` more, and the first batches after one
    are ``settle``'s factors slower, in order."""

    def __init__(self, tuner: ThreadTuner, speed: dict[int, float], scale: float = 0.01,
                 noise: dict[int, tuple[float, ...]] | None = None, change_s: float = 0.0,
                 settle: tuple[float, ...] = (), rows: int = 1) -> None:
        self.tuner, self.speed, self.scale, self.change_s = tuner, speed, scale, change_s
        self.settle, self.rows = settle, rows
        self.since_change = len(settle)  # batches since the last change of count (the start's is settled)
        self.noise = {count: itertools.cycle((noise or {}).get(count, (1.0,))) for count in speed}
        self.now = 0.0
        self.counts: list[int] = []
        self.started: list[float] = []  # when each batch started
        self.fits: list[bool] = []
        self.switches: list[tuple[int, int]] = []
        self.switched_at = 0  # batches run when the last switch was decided
        self.busy = {count: 0.0 for count in speed}

    def run(self, seconds: float) -> None:
        until = self.now + seconds
        while self.now < until:
            count = self.tuner.count(self.now)
            changed = bool(self.counts) and count != self.counts[-1]
            self.since_change = 0 if changed else self.since_change + 1
            took = self.speed[count] * self.scale * next(self.noise[count])
            took *= self.settle[self.since_change] if self.since_change < len(self.settle) else 1.0
            took += self.change_s if changed else 0.0
            self.started.append(self.now)
            self.now += took
            self.busy[count] += took
            ran = self.tuner.ran(count, took, self.scale, self.now, self.rows)
            self.counts.append(count)
            self.fits.append(ran.fit)
            if ran.switched:
                self.switches.append(ran.switched)
                self.switched_at = len(self.counts)


def run_until_a_probe(machine: Machine, count: int) -> None:
    """Batches until the tuner's next batch is a probe's at ``count``."""
    machine.run(FIRST_INTERVAL_S * 1.2)
    while machine.tuner.count(machine.now) != count:
        machine.run(0.01)


def probes(counts: list[int], current: int) -> int:
    """How many runs of batches at another count than ``current`` the list holds."""
    return sum(1 for before, count in zip([current, *counts], counts, strict=False) if count != current == before)


def test_nothing_is_probed_before_the_first_interval_nor_ever_when_not_adaptive() -> None:
    machine = Machine(ThreadTuner([1, 2], 2, 0.0), {1: 1.0, 2: 1.0})
    machine.run(FIRST_INTERVAL_S * 0.9)
    assert set(machine.counts) == {2}
    fixed = Machine(ThreadTuner([1, 2], 2, 0.0, adaptive=False), {1: 0.1, 2: 1.0})
    fixed.run(100.0)
    assert set(fixed.counts) == {2} and all(fixed.fits)
    alone = Machine(ThreadTuner([2], 2, 0.0), {2: 1.0})
    alone.run(100.0)
    assert set(alone.counts) == {2}


def first_probe(speed: dict[int, float], noise: dict[int, tuple[float, ...]] | None = None) -> list[int]:
    """The counts of the first probe's batches (from 2 threads to 1), warm-up included."""
    machine = Machine(ThreadTuner([1, 2], 2, 0.0), speed, noise=noise)
    machine.run(FIRST_INTERVAL_S * 1.5)
    first = machine.counts.index(1)
    return machine.counts[first: machine.counts.index(2, first)]


def test_a_probe_is_a_warm_up_batch_and_its_timed_batches_none_of_which_feed_the_cost_model() -> None:
    machine = Machine(ThreadTuner([1, 2], 2, 0.0), {1: 1.0, 2: 1.0})
    machine.run(FIRST_INTERVAL_S * 1.5)
    first = machine.counts.index(1)
    timed = PROBE_BATCHES // 2 + 1  # as fast: each timed batch wins, and a majority decides
    assert machine.counts[first: first + timed + 1] == [1] * (timed + 1)
    assert machine.counts[first + timed + 1] == 2
    assert not any(machine.fits[first: first + timed + 2])  # and the warm-up batch back at 2
    assert machine.fits[first + timed + 2]


def test_a_probe_ends_once_most_of_its_timed_batches_agree_and_runs_them_all_only_when_they_split() -> None:
    assert PROBE_BATCHES == 3
    beyond_the_tie = 1 + 3 * THREAD_TIE  # slower than a smaller count may be, within CLEAR_LOSS_RATIO
    assert beyond_the_tie < CLEAR_LOSS_RATIO
    assert len(first_probe({1: beyond_the_tie, 2: 1.0})) == 1 + 2  # the warm-up, then two lost batches
    # The current count's batches all at 1.0; the probe's timed ones at 1.1, 0.9 and 1.0: a split.
    assert first_probe({1: 1.0, 2: 1.0}, noise={1: (1.0, 1.1, 0.9, 1.0)}) == [1] * 4


def test_a_probe_batch_slower_beyond_the_current_counts_own_spread_ends_the_probe_at_once() -> None:
    clearly = CLEAR_LOSS_RATIO * 1.1  # below ABORT_RATIO: the old rule ran every timed batch of it
    assert clearly < ABORT_RATIO
    assert first_probe({1: clearly, 2: 1.0}) == [1, 1]  # the warm-up and one timed batch
    # Where the current count's own batches spread as wide (0.7x to 1.5x of their median), a batch as
    # slow is not beyond doubt: the probe runs on until a majority decides.
    assert len(first_probe({1: clearly, 2: 1.0}, noise={2: (0.7, 1.5, 1.0, 0.8, 1.2)})) > 2


def test_a_faster_count_is_switched_to_after_two_winning_probes_and_then_kept() -> None:
    tuner = ThreadTuner([1, 2], 1, 0.0)
    machine = Machine(tuner, {1: 2.0, 2: 1.0})  # the calibration chose 1 thread, but 2 are twice as fast
    machine.run(60.0)
    assert machine.switches == [(1, 2)] and tuner.current == 2 and tuner.switches == 1
    assert probes(machine.counts[: machine.switched_at], 1) == WINS_TO_SWITCH
    after = machine.counts[len(machine.counts) // 2:]
    assert after.count(2) > 0.95 * len(after)


def test_a_slower_count_never_wins_and_each_lost_probe_doubles_the_wait() -> None:
    tuner = ThreadTuner([1, 2], 2, 0.0)
    machine = Machine(tuner, {1: 2.0, 2: 1.0})
    machine.run(2000.0)
    assert not machine.switches and tuner.current == 2
    starts = [n for n, (before, count) in enumerate(zip([2, *machine.counts], machine.counts, strict=False))
              if count == 1 and before == 2]
    times = [sum(machine.speed[c] * machine.scale for c in machine.counts[:n]) for n in starts]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert len(gaps) >= 5
    for earlier, later in itertools.pairwise(gaps):
        assert later >= min(MAX_INTERVAL_S, 1.9 * earlier)
    assert max(gaps) <= MAX_INTERVAL_S * 1.01


def test_the_smaller_count_wins_a_tie_and_a_larger_one_must_be_clearly_faster() -> None:
    small = ThreadTuner([1, 2], 2, 0.0)
    Machine(small, {1: 1.0 + THREAD_TIE / 2, 2: 1.0}).run(60.0)
    assert small.current == 1
    large = ThreadTuner([1, 2], 1, 0.0)
    Machine(large, {1: 1.0, 2: 1.0 / (1 + THREAD_TIE / 2)}).run(60.0)
    assert large.current == 1


def test_probes_of_a_slow_count_cost_at_most_their_share_of_long_batches() -> None:
    # Two-second batches (a large model on a slow CPU), and one thread twice as slow: what the probes
    # took beyond the same batches at two threads stays within PROBE_SHARE of the engine's time from
    # the first probe on, however long it serves.
    for horizon in (900.0, 3600.0):
        tuner = ThreadTuner([1, 2], 2, 0.0)
        machine = Machine(tuner, {1: 2.0, 2: 1.0}, scale=2.0)
        machine.run(horizon)
        beyond = machine.busy[1] - machine.counts.count(1) * machine.speed[2] * machine.scale
        assert 0 < beyond <= PROBE_SHARE * machine.now
        assert tuner.current == 2


def test_a_probe_of_a_faster_count_costs_nothing_so_the_next_one_confirms_it_soon() -> None:
    # The same long batches, but the calibration chose one thread (a neighbour was busy then) and two
    # are twice as fast: the first probe waits for the share of what a probe might cost, the second
    # only for CONFIRM_INTERVAL_S and FRESH_BATCHES batches at the count in use (after the one back),
    # however long the batches.
    tuner = ThreadTuner([1, 2], 1, 0.0)
    machine = Machine(tuner, {1: 2.0, 2: 1.0}, scale=2.0)
    first_due = (PROBE_BATCHES + 1) * 2.0 * machine.scale / PROBE_SHARE
    machine.run(first_due + 2 * FIRST_INTERVAL_S + 10 * machine.scale)
    assert machine.switches == [(1, 2)]
    first, second = probe_starts(machine, 1)[:2]
    between = machine.counts[machine.started.index(first): machine.started.index(second)]
    assert between.count(1) == 1 + FRESH_BATCHES  # the batch back, then fresh ones to compare with
    # With short batches the confirmation waits CONFIRM_INTERVAL_S, not FIRST_INTERVAL_S.
    quick = Machine(ThreadTuner([1, 2], 1, 0.0), {1: 2.0, 2: 1.0})
    quick.run(FIRST_INTERVAL_S * 3)
    first, second = probe_starts(quick, 1)[:2]
    assert quick.switches == [(1, 2)] and CONFIRM_INTERVAL_S <= second - first < CONFIRM_INTERVAL_S + 0.1
    assert CONFIRM_INTERVAL_S + 0.1 < FIRST_INTERVAL_S / 2  # (the old wait: FIRST_INTERVAL_S)


def test_the_count_follows_the_machine_when_it_changes() -> None:
    tuner = ThreadTuner([1, 2], 2, 0.0)
    machine = Machine(tuner, {1: 2.0, 2: 1.0})
    machine.run(300.0)
    assert tuner.current == 2
    machine.speed = {1: 1.0, 2: 3.0}  # a neighbour now keeps one core busy: two threads wait for it
    machine.run(MAX_INTERVAL_S * 3)
    assert tuner.current == 1


def test_a_quiet_spell_during_a_probe_does_not_put_off_the_next_one() -> None:
    # The probe's cost is its batches' engine time, not the wall time it spans: eight idle hours
    # between two of its batches leave the next probe as near as ever.
    tuner = ThreadTuner([1, 2], 2, 0.0)
    machine = Machine(tuner, {1: 1.5, 2: 1.0})
    run_until_a_probe(machine, 1)
    machine.run(0.015)  # the warm-up batch and one timed batch of the probe
    machine.now += 8 * 3600.0
    machine.run(1.0)  # the probe ends (lost: 1.5x slower), then batches at 2
    assert tuner.count(machine.now) == 2
    probes_before = probes(machine.counts, 2)
    machine.run(4 * FIRST_INTERVAL_S)
    assert probes(machine.counts, 2) > probes_before


def test_a_probe_whose_batches_fail_or_split_ends_without_a_verdict() -> None:
    tuner = ThreadTuner([1, 2], 2, 0.0)
    machine = Machine(tuner, {1: 1.0, 2: 1.0})
    run_until_a_probe(machine, 1)
    for _ in range(PROBE_MAX_BATCHES):
        assert tuner.count(machine.now) == 1
        assert not tuner.ran(1, 0.0, 0.01, machine.now).fit  # no time: the batch was split or failed
    assert tuner.count(machine.now) == 2 and tuner.current == 2


def test_a_far_slower_count_is_left_after_one_batch_and_only_neighbouring_counts_are_tried() -> None:
    tuner = ThreadTuner([1, 32, 64], 64, 0.0)
    machine = Machine(tuner, {1: 30.0, 32: 10.0, 64: 1.0})  # 32 threads stall on a neighbour
    machine.run(600.0)
    assert tuner.current == 64 and 1 not in machine.counts
    runs = [n for n, (before, count) in enumerate(zip([64, *machine.counts], machine.counts, strict=False))
            if count == 32 and before == 64]
    assert runs and all(machine.counts[n + 1] == 64 for n in runs)  # each probe: the warm-up batch alone
    assert ABORT_RATIO_WARM_UP < 10.0


def test_the_switch_interval_is_long_for_one_cpu_thread_and_short_for_a_team() -> None:
    """While the model thread waits for the GIL its whole team idles: one CPU thread takes the longer
    interval (fewer forced hand-overs between the server's other threads), a team or a GPU the shorter."""
    assert switch_interval_s(1, "cpu") == SWITCH_ONE_THREAD_S > SWITCH_TEAM_S
    assert switch_interval_s(2, "cpu") == switch_interval_s(0, "cpu") == switch_interval_s(1, "cuda") == SWITCH_TEAM_S


def probe_starts(machine: Machine, current: int) -> list[float]:
    """When each probe from ``current`` started (fake-clock seconds)."""
    return [started for started, before, count in zip(machine.started, [current, *machine.counts], machine.counts,
                                                       strict=False) if count != current == before]


def test_a_probes_cost_counts_the_slow_batch_back_and_a_switch_forgets_the_costs() -> None:
    # One thread is clearly slower, and every change of count costs a second: the probe's cost holds
    # two such seconds, going to one thread and the batch back at two, and the next probe waits for
    # both over the share (without the batch back, half as long).
    machine = Machine(ThreadTuner([1, 2], 2, 0.0), {1: 1.5, 2: 1.0}, change_s=1.0)
    machine.run(400.0)
    first, second = probe_starts(machine, 2)[:2]
    assert second - first >= 1.9 * machine.change_s / PROBE_SHARE
    # Batches that settle after each change, at 2.0, 1.6 and 1.3 times the pace: every settling batch
    # back at two threads is the probe's cost, not only the first (the probe itself: its warm-up at
    # 3.0 and one at 2.4, beyond ABORT_RATIO, lost).
    settling = Machine(ThreadTuner([1, 2], 2, 0.0), {1: 1.5, 2: 1.0}, scale=1.0, settle=(2.0, 1.6, 1.3))
    settling.run(1000.0)
    first, second = probe_starts(settling, 2)[:2]
    cost = (3.0 - 1.0) + (2.4 - 1.0) + (2.0 - 1.0) + (1.6 - 1.0) + (1.3 - 1.0)
    assert second - first >= 0.98 * cost / PROBE_SHARE
    # Costs are measured against the count in use: after 1 -> 2 -> 4, a probe of 2 (which cost
    # nothing against 1) waits for the share of what a probe might cost against 4, not FIRST_INTERVAL_S.
    tuner = ThreadTuner([1, 2, 4], 1, 0.0)
    slow = Machine(tuner, {1: 4.0, 2: 2.0, 4: 1.0}, scale=0.5)
    while tuner.current != 4:
        slow.run(1.0)
    switched = slow.now
    while tuner.probing != 2:
        slow.run(0.5)
    assert slow.now - switched >= (PROBE_BATCHES + 1) * slow.scale * 0.9 / PROBE_SHARE


def test_adopting_a_count_ends_a_probe_unjudged_and_probes_again_only_from_the_new_count() -> None:
    """``adopt`` (the second look's switch, ``layout.SecondLook``) is a switch: a probe under way ends
    without a verdict and its costs are forgotten; the next probe waits the first interval and then
    ``FRESH_BATCHES`` + 1 batches at the new count, the first of them a warm-up that the cost model
    skips."""
    tuner = ThreadTuner([1, 2, 3], 3, 0.0)
    machine = Machine(tuner, {1: 3.0, 2: 1.0, 3: 1.0})
    run_until_a_probe(machine, 2)  # from 3, its one neighbour
    assert tuner.probing == 2
    with pytest.raises(ValueError, match="not one of"):
        tuner.adopt(4, machine.now)
    assert tuner.adopt(1, machine.now) and tuner.current == 1 and tuner.switches == 1
    assert tuner.probing is None and tuner.count(machine.now) == 1
    assert not tuner.adopt(1, machine.now)  # already in use: no switch
    adopted_at, before = machine.now, len(machine.counts)
    machine.run(FIRST_INTERVAL_S * 0.9)
    assert set(machine.counts[before:]) == {1}  # no probe before the first interval
    assert not machine.fits[before] and all(machine.fits[before + 1:])  # the warm-up batch at 1 only
    machine.run(FIRST_INTERVAL_S)
    assert 2 in machine.counts[before:] and set(machine.counts[before:]) == {1, 2}  # 1's one neighbour
    assert machine.started[machine.counts.index(2, before)] >= adopted_at + FIRST_INTERVAL_S


def test_the_warm_up_after_a_change_lasts_while_the_batches_keep_getting_faster() -> None:
    # Two threads are faster (0.7 against 1.0), but the first batches after any change of count run
    # 2.0, 1.6, 1.5 and 1.3 times slower than the settled pace (on the 2-core Zen 4 EPYC, two parts
    # after a spell on one thread: 35, 28, 26 ms, then 16-20). Timed from the second batch, the probe
    # would see 1.12 and 1.05 against 1.0 and lose; timed once the batches stop getting faster, it wins.
    settle = (2.0, 1.6, 1.5, 1.3)
    assert len(settle) == WARM_UP_MOST
    def first_probe_from_1(settle: tuple[float, ...], faster: float = 0.7) -> tuple[Machine, int, int]:
        """The machine after its first switch (or 3 first intervals), and where its first probe's
        batches start and end."""
        machine = Machine(ThreadTuner([1, 2], 1, 0.0), {1: 1.0, 2: faster}, settle=settle)
        machine.run(3 * FIRST_INTERVAL_S)
        start = machine.counts.index(2)
        return machine, start, machine.counts.index(1, start)

    machine, start, back = first_probe_from_1(settle)
    assert back - start == WARM_UP_MOST + PROBE_BATCHES // 2 + 1  # the warm-up, then two winning batches
    assert machine.fits[back: back + WARM_UP_MOST] == [False] * WARM_UP_MOST  # settling back: not fitted
    assert machine.fits[back + WARM_UP_MOST]
    assert machine.switches == [(1, 2)]
    # Where only the first batch is slow (the old warm-up), the second is faster than it, so a warm-up
    # too (no batch can tell it is the settled pace but the one after it); the third, no faster, counts.
    plain, start, back = first_probe_from_1((2.0,))
    assert back - start == 2 + PROBE_BATCHES // 2 + 1 and plain.switches == [(1, 2)]
    # Where none is slow, the second batch counts.
    steady, start, back = first_probe_from_1(())
    assert back - start == 1 + PROBE_BATCHES // 2 + 1 and steady.switches == [(1, 2)]
    # Batches that keep getting faster for longer are warm-ups for WARM_UP_MOST batches at most.
    endless, start, back = first_probe_from_1(tuple(max(1.0, 6 * 1.5 ** -n) for n in range(20)), faster=0.4)
    assert back - start == WARM_UP_MOST + PROBE_BATCHES // 2 + 1
    assert endless.fits[back + WARM_UP_MOST]
    # Only the first warm-up batch may be ABORT_RATIO_WARM_UP times slower than the count in use: a
    # probe of a count three times as slow whose batches drift down ends at its second.
    tuner = ThreadTuner([1, 2], 2, 0.0)
    slow = Machine(tuner, {1: 3.0, 2: 1.0}, settle=(1.3, 1.2, 1.1, 1.03))
    slow.run(2 * FIRST_INTERVAL_S)
    start = slow.counts.index(1)
    assert ABORT_RATIO_WARM_UP > 3.0 * 1.3 and ABORT_RATIO < 3.0 * 1.2
    assert slow.counts[start: slow.counts.index(2, start)] == [1, 1]


def test_a_probe_lost_under_one_load_is_tried_again_soon_once_the_batches_grow() -> None:
    # Batches of 16 rows: two threads no faster than one, so every probe loses and the wait doubles.
    # Then the load grows to batches of 64, where two threads are faster (0.7): the next probe is due
    # FIRST_INTERVAL_S after the last one, not after the doubled wait.
    tuner = ThreadTuner([1, 2], 1, 0.0)
    machine = Machine(tuner, {1: 1.0, 2: 1.0}, rows=16)
    machine.run(200.0)
    starts = probe_starts(machine, 1)
    assert len(starts) >= 4 and not machine.switches
    backoff = starts[-1] - starts[-2]
    assert backoff >= 8 * FIRST_INTERVAL_S
    grown_at = machine.now
    machine.rows, machine.speed = 64, {1: 1.0, 2: 0.7}
    machine.run(max(FIRST_INTERVAL_S, starts[-1] + FIRST_INTERVAL_S - grown_at) + CONFIRM_INTERVAL_S + 1.0)
    assert machine.switches == [(1, 2)]
    # The same change of speed with batches of the same rows (the machine changed, not the load): the
    # doubled wait holds, and no probe comes before it.
    same = Machine(ThreadTuner([1, 2], 1, 0.0), {1: 1.0, 2: 1.0}, rows=16)
    same.run(200.0)
    last = probe_starts(same, 1)[-1]
    same.speed = {1: 1.0, 2: 0.7}
    same.run(machine.now - 200.0)
    assert not same.switches and probe_starts(same, 1)[-1] == last
    # Batches as much smaller count as another load too (the rows' moving average follows in a few).
    shrunk = Machine(ThreadTuner([1, 2], 1, 0.0), {1: 1.0, 2: 1.0}, rows=64)
    shrunk.run(200.0)
    last = probe_starts(shrunk, 1)[-1]
    shrunk.rows = int(64 / LOAD_ROWS_CHANGE) - 8
    shrunk.run(max(FIRST_INTERVAL_S, last + FIRST_INTERVAL_S - shrunk.now) + 1.0)
    assert probe_starts(shrunk, 1)[-1] > last


def test_a_load_that_swings_between_sizes_is_probed_about_as_often_as_its_loads_together() -> None:
    # Each load keeps its own doubled wait: batches of 8 and 32 rows in turn, 20 s each, where two
    # threads always lose, are probed about as often as three steady loads together (8, 32, and the 16
    # that the moving average passes through on the way), and the waits still grow (the cost share
    # alone would allow a probe every FIRST_INTERVAL_S).
    def probes_over(horizon: float, swing: bool) -> int:
        machine = Machine(ThreadTuner([1, 2], 1, 0.0), {1: 1.0, 2: 1.5}, rows=8)
        while machine.now < horizon:
            machine.run(20.0)
            if swing:
                machine.rows = 40 - machine.rows  # 8, 32, 8, ...
        return len(probe_starts(machine, 1))

    steady, swinging = probes_over(600.0, False), probes_over(600.0, True)
    assert steady >= 4 and swinging <= 3 * steady
    assert probes_over(1200.0, True) <= swinging + 3 * 2  # twice as long: a doubling more per load at most


def test_a_smaller_counts_win_is_confirmed_only_after_the_first_interval() -> None:
    # Two threads serve in use (0.7 against one thread's 1.0) when a neighbour's burst makes them twice
    # as slow for three seconds: a probe of one thread in it wins, but its confirmation comes after the
    # burst, and loses. (A larger count's win is confirmed after CONFIRM_INTERVAL_S: a burst only
    # slows a wider team, so it cannot give one a win.)
    tuner = ThreadTuner([1, 2], 2, 0.0)
    machine = Machine(tuner, {1: 1.0, 2: 0.7})
    machine.run(3 * FIRST_INTERVAL_S - 1.0)  # the first probe (lost) 5 s in, the next due 10 s later
    assert len(probe_starts(machine, 2)) == 1
    machine.speed = {1: 1.0, 2: 1.4}
    machine.run(3.0)
    in_burst = probe_starts(machine, 2)[1]
    machine.speed = {1: 1.0, 2: 0.7}
    machine.run(3 * FIRST_INTERVAL_S)
    assert not machine.switches and tuner.current == 2
    confirming = probe_starts(machine, 2)[2]
    assert confirming - in_burst >= FIRST_INTERVAL_S
    after = machine.started.index(confirming)
    assert machine.counts[after: after + 3] == [1, 1, 2]  # it lost: the warm-up and one slower batch


def test_a_probe_compares_with_batches_of_its_own_load() -> None:
    # Lone requests until just before the first probe is due, then batches of 64: the probe waits for
    # FRESH_BATCHES batches since the rows' moving average last changed load, so that most of its
    # reference is batches of 64, not the lone requests'.
    tuner = ThreadTuner([1, 2], 1, 0.0)
    machine = Machine(tuner, {1: 1.0, 2: 1.0}, rows=1)
    machine.run(FIRST_INTERVAL_S - 0.02)
    assert not probe_starts(machine, 1)
    machine.rows, changed = 64, len(machine.counts)
    machine.run(1.0)
    assert machine.counts.index(2, changed) - changed >= FRESH_BATCHES


def test_each_probe_ends_with_a_verdict_that_the_log_can_say() -> None:
    # The batch that ends a probe says how it went (``Ran.verdict``): its count against the one in use,
    # won or lost, its timed batches' ratios and the count in use's median, at the load's rows; every
    # other batch says nothing. A probe given up on batches that failed or split has no verdict.
    tuner = ThreadTuner([1, 2], 2, 0.0)
    verdicts = []
    now = 0.0
    while not verdicts:
        count = tuner.count(now)
        now += 0.013 if count == 1 else 0.01  # one thread 1.3 times slower: the probe loses
        ran = tuner.ran(count, 0.013 if count == 1 else 0.01, 0.01, now, 8)
        verdicts += [ran.verdict] if ran.verdict is not None else []
    verdict = verdicts[0]
    assert (verdict.probe, verdict.current, verdict.won, verdict.rows) == (1, 2, False, 8)
    assert verdict.ratios == pytest.approx((1.3,)) and verdict.theirs == pytest.approx(1.0)  # beyond doubt
    assert verdict.line(lambda count: f"{count}") == (
        "probe of torch threads 1 against 2 at batches of 8 rows: lost (its batches 1.30 times the cost "
        "model's prediction, the layout in use's 1.00; tuning.py)")
    given_up = ThreadTuner([1, 2], 2, 0.0)
    machine = Machine(given_up, {1: 1.0, 2: 1.0})
    run_until_a_probe(machine, 1)
    ends = [given_up.ran(1, 0.0, 0.01, machine.now).verdict for _ in range(PROBE_MAX_BATCHES)]
    assert ends[:-1] == [None] * (PROBE_MAX_BATCHES - 1) and ends[-1] is not None and ends[-1].won is None
    assert "no verdict, its batches failed or split (no batch of it timed past its warm-up" in ends[-1].line(str)
