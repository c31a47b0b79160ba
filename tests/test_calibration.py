"""Unit tests of the start-up calibration's pure parts: the candidate thread counts (the CPUs this process
may use, within its container's CPU quota) and how one is chosen from timings."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from fillmask_server.calibration import (
    FIT_SHAPES,
    MIN_THREAD_ROUNDS,
    QUIET_GAP,
    QUIET_ROUNDS,
    THREAD_SHAPE,
    Calibration,
    choose_threads,
    fastest_per_count,
    part_counts,
)
from fillmask_server.costmodel import Coefficients, fit
from fillmask_server.cpus import (
    CGROUP_ROOT,
    CGROUP_V1_CPU_DIRS,
    CGROUP_V2_CPU_MAX,
    PROC_SELF_CGROUP,
    cpu_quota,
    usable_cpus,
)
from fillmask_server.layout import QuietLone, choose_layout, serving_rate
from fillmask_server.parts import plan
from fillmask_server.tuning import THREAD_TIE


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


def test_a_second_thread_that_barely_speeds_the_forward_pass_loses_to_the_work_beside_it() -> None:
    # A small model on 2 CPUs (the families' shape, as timed at start-up): a 16-row batch takes 0.50 ms at
    # one thread and 0.45 ms at two, and each request takes 20 us of CPU beside the forward pass. Timed
    # alone, two threads win; serving, the second thread's core is the one the other stages need, and
    # a team on both cores waits for every other thread that runs (each stage's CPU adds to its time).
    timed = {1: 0.50e-3, 2: 0.45e-3}
    assert choose_threads(timed) == 2
    assert choose_threads(timed, 16, 20e-6, 2) == 1
    assert serving_rate(1, timed[1], 16, 20e-6, 2) == 16 / timed[1]  # one thread: the engine is the bound
    assert serving_rate(2, timed[2], 16, 20e-6, 2) == 1 / (timed[2] / 16 + 20e-6)
    # A model whose forward pass dwarfs that work keeps both threads (the tiny benchmark model's shape).
    assert choose_threads({1: 6.0e-3, 2: 3.8e-3}, 16, 20e-6, 2) == 2


def test_parts_side_by_side_win_a_tie_with_one_team_of_as_many_threads() -> None:
    """Layouts are (all threads, parts). On a tie the fewer threads win, then the narrower team: parts
    meet once a batch, so a thread the other stages preempt stalls one part, not every operator."""
    # A batch of 16 rows: one thread 8.5 ms, two in one pass 6.0 ms, two in two parts 6.1 ms (a tie).
    assert choose_layout({(1, 1): 8.5e-3, (2, 1): 6.0e-3, (2, 2): 6.1e-3}, 16, 10e-6, 2) == (2, 2)
    # Parts clearly slower: the team of two.
    assert choose_layout({(1, 1): 8.5e-3, (2, 1): 6.0e-3, (2, 2): 7.0e-3}, 16, 10e-6, 2) == (2, 1)
    # One thread within the tie of both: the fewest threads first.
    assert choose_layout({(1, 1): 6.2e-3, (2, 1): 6.0e-3, (2, 2): 6.0e-3}, 16, 0.0, 2) == (1, 1)
    # Four CPUs: four parts of one, two of two, one team of four, all level: the narrowest team.
    assert choose_layout({(1, 1): 4e-3, (2, 1): 2e-3, (4, 1): 1e-3, (4, 2): 1e-3, (4, 4): 1e-3}) == (4, 4)
    assert choose_threads({1: 8.5e-3, 2: 6.0e-3}, 16, 10e-6, 2) == choose_layout(
        {(1, 1): 8.5e-3, (2, 1): 6.0e-3}, 16, 10e-6, 2)[0]


def test_the_parts_timed_are_two_and_one_a_thread_but_never_more_than_the_batch_has_rows() -> None:
    """On 64 threads, 64 parts of a 16-row batch would run as 16 parts of 4 threads (``parts.plan``),
    so the calibration would time one layout and name another; it times 16 parts of 4 instead."""
    assert THREAD_SHAPE[0] == 16
    assert part_counts(1, 16) == [] and part_counts(2, 16) == [2] and part_counts(4, 16) == [2, 4]
    assert part_counts(3, 16) == [3] and part_counts(16, 16) == [2, 16]
    assert part_counts(24, 16) == [2, 12] and part_counts(64, 16) == [2, 16] and part_counts(17, 16) == []
    for threads in range(1, 130):
        for parts in part_counts(threads, 16):
            cuts, each = plan([12] * 16, threads, parts)
            assert len(cuts) == parts and each * parts == threads  # the layout timed is the one named


def test_parts_are_not_held_to_a_full_width_teams_barrier_bound() -> None:
    # Two CPUs, 1 ms of CPU a request beside the forward pass: a team of two stops at every operator
    # for that work; two parts of one thread share the CPUs with it.
    assert serving_rate(2, 6e-3, 16, 1e-3, 2) == 1 / (6e-3 / 16 + 1e-3)
    assert serving_rate(2, 6e-3, 16, 1e-3, 2, team=1) == 2 / (2 * 6e-3 / 16 + 1e-3)


def test_the_serving_rate_is_the_least_of_the_engine_the_cpus_and_a_full_width_team() -> None:
    # 4 CPUs, a batch of 10 rows: 10 ms at one thread, 4 ms at two, 3 ms at four; 1 ms of CPU beside.
    assert serving_rate(1, 10e-3, 10, 1e-3, 4) == 1000  # the engine: 1 ms a request
    assert serving_rate(2, 4e-3, 10, 1e-3, 4) == 4 / (2 * 0.4e-3 + 1e-3)  # the CPUs: 1.8 ms of CPU a request
    assert serving_rate(4, 3e-3, 10, 1e-3, 4) == 1 / (0.3e-3 + 1e-3)  # the team waits for the stages
    assert choose_threads({1: 10e-3, 2: 4e-3, 4: 3e-3}, 10, 1e-3, 4) == 2
    assert choose_threads({1: 10e-3, 2: 4e-3, 4: 3e-3}) == 4  # timed alone, the widest team wins


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


def test_a_quota_on_any_cgroup_above_the_process_binds_it_and_the_tightest_wins() -> None:
    pod = f"{CGROUP_ROOT}/kubepods.slice/pod1"
    v2 = {PROC_SELF_CGROUP: "0::/kubepods.slice/pod1/ctr\n"}
    # A pod's limit sits on the pod's cgroup, above the container's own (which has none).
    assert cpu_quota(files({**v2, f"{pod}/ctr/cpu.max": "max 100000", f"{pod}/cpu.max": "150000 100000"})) == 1.5
    assert cpu_quota(files({**v2, f"{pod}/ctr/cpu.max": "50000 100000", f"{pod}/cpu.max": "150000 100000"})) == 0.5
    assert cpu_quota(files({**v2, f"{pod}/ctr/cpu.max": "max 100000", f"{pod}/cpu.max": "max 100000"})) is None
    # cgroup v1: the hierarchy that holds the cpu controller, whatever else it holds.
    v1 = CGROUP_V1_CPU_DIRS[-1]
    v1_self = {PROC_SELF_CGROUP: "4:memory:/elsewhere\n3:cpu,cpuacct:/kubepods/pod1/ctr\n0::/\n"}
    assert cpu_quota(files({**v1_self, f"{v1}/kubepods/pod1/cpu.cfs_quota_us": "200000",
                            f"{v1}/kubepods/pod1/cpu.cfs_period_us": "100000",
                            f"{v1}/kubepods/pod1/ctr/cpu.cfs_quota_us": "-1",
                            f"{v1}/kubepods/pod1/ctr/cpu.cfs_period_us": "100000"})) == 2.0
    # A container that sees only its own cgroup, mounted at the root, while /proc names the host's path:
    # the walk ends at the mount's root, which is that cgroup.
    assert cpu_quota(files({PROC_SELF_CGROUP: "0::/docker/abc\n", CGROUP_V2_CPU_MAX: "300000 100000"})) == 3.0
    assert cpu_quota(files({PROC_SELF_CGROUP: "garbage\n1:cpu:relative\n", CGROUP_V2_CPU_MAX: "100000 100000"})) == 1.0


def test_this_machines_cgroups_are_read_without_error() -> None:
    from fillmask_server.cpus import _read_text

    quota = cpu_quota(_read_text)
    assert quota is None or quota > 0
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)


def test_a_cgroup_path_outside_the_namespace_reads_only_the_mount_root() -> None:
    """``/proc/self/cgroup`` names a cgroup above the namespace's root with ``..``: the directories it
    would name under the mount belong to other cgroups, so only the mount's root (this one's) is read."""
    sibling = f"{CGROUP_ROOT}/system.slice/cpu.max"
    read = files({PROC_SELF_CGROUP: "0::/../../system.slice\n", sibling: "50000 100000",
                  CGROUP_V2_CPU_MAX: "200000 100000"})
    assert cpu_quota(read) == 2.0


def test_the_usable_cpus_are_capped_by_the_quota_rounded_up_and_never_below_one() -> None:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert usable_cpus(files({})) == cpus
    assert usable_cpus(files({CGROUP_V2_CPU_MAX: "50000 100000"})) == 1  # half a CPU: one thread
    assert usable_cpus(files({CGROUP_V2_CPU_MAX: f"{(cpus + 8) * 100000} 100000"})) == cpus  # above: the CPUs
    if cpus >= 2:
        assert usable_cpus(files({CGROUP_V2_CPU_MAX: "150000 100000"})) == 2


def test_the_first_three_fit_shapes_tell_the_token_price_apart_under_a_few_percent_of_noise() -> None:
    """A tight budget (a large model on a slow CPU) times only the first three shapes. With 5% noise on
    each timing, in every combination, their fit keeps the token price within a factor of two of the
    truth, for a model whose tokens dominate (BERT-base-like) and one whose rows do (a tiny one). Shapes
    whose padded tokens follow their rows (1x8, 4x16, 16x16) gave a token price of 0 for some noise:
    the server then priced every request's output as too large for any batch but its own."""
    import itertools

    for true in (Coefficients(0.03, 1.7e-3, 1e-3), Coefficients(0.0015, 8e-6, 1.5e-4)):
        for signs in itertools.product((-1, 0, 1), repeat=3):
            samples = [(rows, rows * width, true.batch_s(rows, rows * width, 0.0) * (1 + 0.05 * sign))
                       for (rows, width), sign in zip(FIT_SHAPES[:3], signs, strict=True)]
            fitted = fit(samples)
            assert fitted is not None and 0.5 < fitted.token_s / true.token_s < 2, (true, signs, fitted)


def test_a_reduced_dtype_far_slower_than_float32_is_reported_above_zero() -> None:
    """hello.engine.calibration.dtype_speed_vs_float32 is > 0 by the schema (§2): three significant
    figures keep a ratio under 0.0005 (an emulated bf16 on a slow CPU, under load) from reading 0."""
    for ratio, shown in ((0.0002345, 0.000235), (0.19, 0.19), (0.5, 0.5)):
        engine = Calibration(torch_threads=1, threads_from="default", dtype="bfloat16", dtype_speed=ratio).hello()
        assert engine["calibration"]["dtype_speed_vs_float32"] == shown


def test_the_float32_copy_is_named_as_such_in_the_log(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A newcomer's find: with ``--dtype int8`` the log said "loaded ... (int8)", then "loaded ... (float32)",
    as if the server had fallen back to float32; the second was the copy the dtype is measured against."""
    from fillmask_server import loading
    from fillmask_server.calibration import calibrate

    served = loading.load_model(str(tiny_model_dir), "cpu", "bfloat16")
    with caplog.at_level(logging.INFO, logger="fillmask_server"):
        found = calibrate(served, 0.5, model_name=str(tiny_model_dir))
    said = [record.getMessage() for record in caplog.records]
    assert found.dtype_speed is not None
    assert not [line for line in said if line.startswith("loaded ")], said
    assert any("float32 copy" in line and "--dtype bfloat16" in line for line in said), said


def test_a_float32_copy_that_cannot_be_loaded_leaves_the_reduced_dtype_unchecked_not_the_server_down(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The dtype check loads a float32 copy beside the model: on a full GPU (out of memory) or a model
    that cannot be loaded twice, start-up crashed with a traceback. Now the check is left out, with one
    line saying why, and the rest of the calibration stands."""
    from fillmask_server import loading
    from fillmask_server.calibration import calibrate

    served = loading.load_model(str(tiny_model_dir), "cpu", "bfloat16")

    def no_room(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA out of memory. Tried to allocate 440.00 MiB\nmore lines")

    monkeypatch.setattr(loading, "load_model", no_room)
    with caplog.at_level(logging.WARNING, logger="fillmask_server.calibration"):
        found = calibrate(served, 0.5, model_name=str(tiny_model_dir))
    assert found.dtype_speed is None and found.coefficients is not None and found.warning is None
    said = [record.getMessage() for record in caplog.records]
    assert said == ["could not measure --dtype bfloat16 against float32 (CUDA out of memory. Tried to allocate "
                    "440.00 MiB); serving without that check"], said


def test_the_timer_waits_while_the_process_uses_a_core_and_stops_at_the_first_quiet_look() -> None:
    """``wait_until_quiet`` on fake clocks: a process using a whole core for five looks, then a tenth
    of one; it returns after the sixth look, and after ``QUIET_MOST_S`` when the process never
    quietens."""
    from fillmask_server.calibration import QUIET_MOST_S, QUIET_SHARE, QUIET_TICK_S, wait_until_quiet

    def process(busy_looks: int) -> tuple[Callable[[], float], Callable[[], float], Callable[[float], None]]:
        now = {"wall": 0.0, "cpu": 0.0}

        def sleep(seconds: float) -> None:
            share = 1.0 if now["wall"] < busy_looks * QUIET_TICK_S - 1e-9 else QUIET_SHARE / 2.5
            now["wall"] += seconds
            now["cpu"] += share * seconds

        return (lambda: now["cpu"]), (lambda: now["wall"]), sleep

    assert wait_until_quiet(*process(5)) == pytest.approx(6 * QUIET_TICK_S)
    assert wait_until_quiet(*process(0)) == pytest.approx(QUIET_TICK_S)
    assert wait_until_quiet(*process(10**6)) == pytest.approx(QUIET_MOST_S)


def test_the_timer_sees_another_thread_of_the_process_spin_on_the_real_clocks() -> None:
    """The process's CPU time counts a thread that runs on another core only at the kernel's scheduler
    tick: with looks of a millisecond, a spinning thread read as quiet. On the real clocks, a thread
    hashing without the GIL for 0.15 s keeps ``wait_until_quiet`` looking past its first look, and once
    it has stopped the first look or so is quiet. Up to five tries, each needing to be seen once: beside
    a busy core the spinner may get no CPU during a look, and the process's other threads (a server of
    another test, its OpenMP workers) may not be quiet yet; a timer blind to other threads never sees it."""
    import hashlib
    import threading
    import time

    from fillmask_server.calibration import QUIET_MOST_S, QUIET_TICK_S, wait_until_quiet

    spin_s = 0.15
    assert spin_s < QUIET_MOST_S
    data = bytes(1 << 16)
    started = threading.Event()

    def spin() -> None:
        until = time.perf_counter() + spin_s
        started.set()
        while time.perf_counter() < until:
            hashlib.sha256(data).digest()  # (releases the GIL: the waiting thread goes on looking)

    seen = quiet = False
    for _ in range(5):
        started.clear()
        spinner = threading.Thread(target=spin)
        spinner.start()
        started.wait()
        waited = wait_until_quiet()
        spinner.join()
        seen = seen or waited > 1.5 * QUIET_TICK_S  # more than one look: the spinning thread was seen
        quiet = quiet or wait_until_quiet() <= 5 * QUIET_TICK_S  # quiet now: the first look or so
        if seen and quiet:
            break
    assert seen and quiet, (seen, quiet)


def test_each_timed_pass_follows_untimed_passes_in_its_own_layout(tiny_model_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy server runs one layout's batches back to back, and the first passes in parts after a
    pass in another layout took about twice as long half of the time (an idle core waking), so one
    start in ten timed its parts slow in every round. Now where the last pass was in another layout
    (or cut otherwise), ``SETTLE_PASSES`` untimed ones come first, after a wait until quiet where a
    wider team ran last; a layout timed again at once is timed at once, and so is one whose last
    timed pass took ``SETTLE_BELOW_S`` or more (a pass of seconds is not settled for milliseconds)."""
    import threading

    import torch

    from fillmask_server import calibration, loading
    from fillmask_server.calibration import SETTLE_PASSES, _LayoutTimer, batch_items

    model = loading.load_model(str(tiny_model_dir))
    events: list[tuple[str, int, int]] = []  # ("pass", torch threads, rows) or ("quiet", 0, 0)
    lock = threading.Lock()
    forward = model.forward

    def recording(items: list[object]) -> object:
        with lock:
            events.append(("pass", torch.get_num_threads(), len(items)))
        return forward(items)

    def quiet() -> float:
        events.append(("quiet", 0, 0))
        return 0.0

    monkeypatch.setattr(model, "forward", recording)
    monkeypatch.setattr(calibration, "wait_until_quiet", quiet)
    items = batch_items(model, 8, 12)
    before = torch.get_num_threads()
    taken: list[list[tuple[str, int, int]]] = []
    firsts: list[tuple[str, int, int]] = []
    long: list[list[tuple[str, int, int]]] = []
    try:
        with _LayoutTimer(model, [(1, 1), (2, 1), (2, 2)]) as timer:
            for layout in [(1, 1), (2, 1), (2, 2), (2, 2), (1, 1), (2, 2)]:
                events.clear()
                assert 0 < timer.time(items, layout) < 10
                firsts.append(events[0])
                taken.append(sorted(events))  # (a part's pass on the helper may come before one here)
            events.clear()
            timer.time(items[:1], (2, 2))  # one text: one pass on the layout's threads, a cut of its own
            taken.append(events[:])
        monkeypatch.setattr(calibration, "SETTLE_BELOW_S", 1e-9)  # every timed pass now counts as long
        with _LayoutTimer(model, [(1, 1), (2, 1)]) as timer:
            for layout in [(1, 1), (2, 1), (1, 1)]:
                events.clear()
                timer.time(items, layout)
                long.append(events[:])
    finally:
        torch.set_num_threads(before)
    settle = SETTLE_PASSES + 1
    whole = [[("pass", threads, 8)] * settle for threads in (1, 2)]
    parts = sorted([("pass", 1, 4)] * 2 * settle + [("quiet", 0, 0)])  # after a wider team: quiet first
    assert taken == [*whole, parts, [("pass", 1, 4)] * 2, whole[0], sorted([("pass", 1, 4)] * 2 * settle),
                     [("pass", 2, 1)] * settle]
    assert firsts[2] == ("quiet", 0, 0) and ("quiet", 0, 0) not in [*firsts[:2], *firsts[3:]]
    assert long == [*whole, [("pass", 1, 8)]]  # (1, 1) again: its last timed pass was "long"


# --- a lone request after a quiet spell ---------------------------------------------------------------------


def test_the_rule_for_a_lone_request_after_a_quiet_spell_is_reported_in_hello_and_the_start_up_line() -> None:
    """Where one thread was the faster after the quiet, ``quiet_lone`` says so and what it runs on; where
    the team was, it says the team's count, and the engine's rule starts there (it times its lone
    requests and may choose again: each call gives a rule of its own). Not timed: nothing."""
    found = Calibration(torch_threads=2, threads_from="calibration", quiet_lone_ms={1: 3.8, 2: 14.8},
                        quiet_after_ms=41.0, quiet_warm_ms={1: 2.5, 2: 2.6})
    quiet = found.quiet_lone()
    assert isinstance(quiet, QuietLone) and quiet.threads == 1 and quiet.after_s == pytest.approx(0.041)
    assert found.quiet_lone() is not quiet
    assert found.hello()["calibration"]["quiet_lone"] == {
        "after_ms": 41.0, "threads_ms": [{"threads": 1, "ms": 3.8}, {"threads": 2, "ms": 14.8}], "team": 2,
        "threads": 1, "warm_ms": [{"threads": 1, "ms": 2.5}, {"threads": 2, "ms": 2.6}]}
    assert found.line().endswith("; a lone request after 41 ms of quiet runs on 1 thread (1 -> 3.8 ms, 2 -> 14.8 ms; "
                                 "back to back 1 -> 2.5 ms, 2 -> 2.6 ms; timed again while serving)")
    kept = Calibration(torch_threads=2, threads_from="calibration", quiet_lone_ms={1: 76.1, 2: 58.7},
                       quiet_after_ms=20.0)
    rule = kept.quiet_lone()
    assert rule is not None and rule.threads == 2 == rule.team == kept.hello()["calibration"]["quiet_lone"]["threads"]
    assert kept.line().endswith("; a lone request after 20 ms of quiet keeps 2 threads (1 -> 76.1 ms, 2 -> 58.7 ms; "
                                "timed again while serving)")
    far = Calibration(torch_threads=2, threads_from="calibration", quiet_lone_ms={1: 15.0, 2: 19.0},
                      quiet_after_ms=41.0, quiet_warm_ms={1: 15.0, 2: 9.0})  # the warm team far faster: kept
    rule = far.quiet_lone()
    assert rule is not None and rule.threads == 2 == far.hello()["calibration"]["quiet_lone"]["threads"]
    assert far.line().endswith("keeps 2 threads (1 -> 15.0 ms, 2 -> 19.0 ms; back to back 1 -> 15.0 ms, 2 -> 9.0 ms; "
                               "timed again while serving)")
    untimed = Calibration(torch_threads=1, threads_from="default")
    assert untimed.quiet_lone() is None and "quiet_lone" not in untimed.hello()["calibration"]
    assert "quiet" not in untimed.line()


def test_a_lone_request_is_timed_right_after_the_team_went_quiet_and_stayed_so(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each timed pass follows a pass of the team (the warm-up's last, the team's timed one, or one run
    untimed for it), a wait until its workers went quiet (here a fake wait of 10 ms) and a sleep as
    long again; the spell reported is the longest from the team's pass to a timed pass (on the test's
    clock, which the wait and the sleep move). The counts take turns: three rounds while ``more()``
    allows, two when it does not. Each count is timed back to back too, after its warm-up. The thread
    is left at the team's count."""
    import torch

    from fillmask_server import calibration, loading

    model = loading.load_model(str(tiny_model_dir))
    events: list[tuple[str, float]] = []
    now = [0.0]
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda items: (events.append(("pass", torch.get_num_threads())),
                                                         forward(items))[1])

    def wait() -> float:
        events.append(("quiet", 0))
        now[0] += 0.01
        return 0.01

    def sleep(seconds: float) -> None:
        events.append(("sleep", seconds))
        now[0] += seconds

    monkeypatch.setattr(calibration, "wait_until_quiet", wait)
    before = torch.get_num_threads()
    try:
        lone_s, spell_s, warm_s = calibration.time_quiet_lone(model, 2, sleep=sleep, clock=lambda: now[0])
        left = torch.get_num_threads()
        tight = len(events)
        calibration.time_quiet_lone(model, 2, more=lambda: False, sleep=sleep, clock=lambda: now[0])
    finally:
        torch.set_num_threads(before)
    assert left == 2 and sorted(lone_s) == sorted(warm_s) == [1, 2]
    assert all(0 < seconds < 10 for seconds in [*lone_s.values(), *warm_s.values()])
    assert spell_s == pytest.approx(QUIET_GAP * 0.01)  # from the team's pass: the wait, and as long again
    warmed = [("pass", 1)] * (2 + QUIET_ROUNDS) + [("pass", 2)] * (2 + QUIET_ROUNDS)  # the shape, then back to back
    gap = ("sleep", pytest.approx(0.01 * (QUIET_GAP - 1)))
    first = [("quiet", 0), gap, ("pass", 1), ("pass", 2), ("quiet", 0), gap, ("pass", 2)]  # (an untimed team pass)
    assert events[:len(warmed)] == warmed
    assert events[len(warmed):tight] == first * QUIET_ROUNDS
    assert events[tight + len(warmed):] == first * MIN_THREAD_ROUNDS
