"""Start-up calibration: what the engine measures about this machine before it serves.

Four measurements, each a few forward passes of the loaded model on synthetic batches (the model's
own tokens around its mask token), all within ``--calibration-s``:

1. **Torch threads, and the forward pass in parts** (a flag the user sets wins: nothing is timed with
   ``--forward-parts`` above 1, and ``--torch-threads`` is the one count timed): one batch timed at
   each candidate *layout*: each count of threads in one pass (1, half the CPUs this process may use,
   all of them: ``usable_cpus``, its CPU affinity within its container's CPU quota; or the count
   set), and, on a CPU with two threads or more, the batch in parts side by side on the most of them
   (2 parts, and one a thread, where they divide evenly, but no more parts than the batch has rows:
   ``part_counts``, ``parts.py``; not with ``--forward-parts 1``). The layouts are taken in
   turn for ``THREAD_ROUNDS`` rounds (1, 2, 1, 2, ...; fewer, but at least ``MIN_THREAD_ROUNDS``, when
   they would take more than half the budget) and each count's fastest pass kept, so that a
   neighbour's passing burst of load (another replica starting beside this one) weighs on every count
   alike instead of deciding for the one it happened to hit. Each timed pass follows untimed ones in
   its own layout (``SETTLE_PASSES``), as a busy server runs a layout's batches back to back: the
   first passes after another layout's are slower, parts above all (``_LayoutTimer``). The forward
   pass is not all the CPU a request takes: the same batch's requests are also parsed, tokenized,
   checked, decoded and encoded
   (``stages_s``, timed once, CPU seconds per request). The layout that wins is the one predicted to
   serve the most requests a second with both (``serving_rate``), on a tie within ``THREAD_TIE`` the
   one with fewer threads, then the one with the narrower team: a model whose forward pass is cheap
   beside that work gains nothing from a second thread that takes the core the other stages need,
   and a narrower team waits less for a thread that the other stages preempt (the rule is
   ``layout.choose_layout``'s; ``layout.SecondLook`` applies it once more on the first busy spell of
   serving, with that CPU measured). The count is set for the whole process; the engine runs the
   parts (``Engine(forward_parts=...)``).
2. **The cost model's first coefficients**: batches of a few shapes (rows x width), timed in turn
   like the thread counts (``FIT_ROUNDS`` rounds, at least ``MIN_THREAD_ROUNDS``), each shape keeping
   its fastest pass, so that a neighbour's burst inflates no shape's time alone; the fit of
   ``overhead + token·padded + row·rows`` (``costmodel.fit``), and the decode price per byte of answer
   bound from decoding their top-k; the engine's ``CostModel`` starts from it and goes on fitting
   online (and never prices a batch's overhead above the fastest batch it runs).
3. **A lone request after a quiet spell** (on a CPU, the layout chosen of two threads or more,
   ``--torch-threads`` unset, ``--quiet-lone`` not ``off``): a request of one text, timed on one
   thread and on all the layout's threads, each once the team's OpenMP workers have gone quiet
   after a pass of the team (``wait_until_quiet``, which also says how long they took) and stayed
   so as long again; two rounds, three while the first half of the budget lasts, the median of
   each kept: the slow first pass after a quiet spell is what is measured; and each back to back.
   Where one thread is the faster after the quiet, by more than it is slower back to back
   (``layout.choose_quiet_lone``), the engine runs a lone request on one thread after such a quiet
   (``layout.QuietLone``): on a machine where waking a sleeping team is slow, every request of a
   lightly loaded server is such a one. These timings are the rule's start: the engine times its
   lone requests after a quiet and chooses again as it serves.
4. **Reduced precision** (``--dtype bfloat16``, ``float16`` or ``int8`` only): the same batch on a
   float32 copy of the model; when the chosen dtype is slower, ``Calibration.warning`` is one line
   saying so with the measured ratio (a CPU without native bf16 emulates it).

It all runs on a thread of its own that ends when it is done, like the model's loading: the OpenMP
worker pool each thread's first parallel operator creates goes with that thread (see
``loading.load_model``). Test hooks: ``FILLMASK_TEST_DTYPE_SLOWDOWN=F`` multiplies the reduced dtype's
measured time by ``F`` (the measurement still runs), so a test can see the warning on any CPU;
``FILLMASK_TEST_QUIET_LONE_MS=1:3.7,2:3.6`` puts those milliseconds in place of a lone request's
times after a quiet on the counts it names (the timing still runs), so a benchmark can start the
rule where a start in an hour without the wake-up's cost would (``bench/quiet.py``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from . import intake
from .costmodel import Coefficients, fit
from .cpus import usable_cpus
from .decode import SequenceDecoder, predictions_json
from .diagnosis import first_line
from .items import Item, TopK
from .layout import Layout, QuietLone, SecondLook, choose_layout, preference
from .loading import on_a_thread_that_ends
from .model import FillMaskModel
from .parts import PartRunner, plan
from .protocol import FillMaskRequest, Limits, encode_result, parse_frame

log = logging.getLogger(__name__)
K = TypeVar("K")

THREAD_ROUNDS = 4  # timed passes per candidate thread count, the counts in turn ...
MIN_THREAD_ROUNDS = 2  # ... and at least this many, whatever the time budget
SETTLE_PASSES = 2  # untimed passes in a layout before one is timed, where the last pass was in another ...
#: ... while that layout's last timed pass was shorter than this: a slow first pass after a change costs
#: milliseconds, within ``THREAD_TIE`` of a longer pass, which settling would make seconds longer to time.
SETTLE_BELOW_S = 0.1
THREAD_SHAPE = (16, 16)  # rows x tokens of the batch the thread counts are timed on
# rows x width, cheapest first. A tight budget times only the first three, so they alone must tell the
# overhead, the row price and the token price apart: rows and padded tokens vary independently there
# (with widths that repeat, tokens follow rows and a few percent of noise can fit any token price).
FIT_SHAPES = ((1, 8), (8, 8), (2, 40), (16, 16), (32, 24))
FIT_ROUNDS = 4  # timed passes per shape, the shapes in turn like the thread counts (at least MIN_THREAD_ROUNDS)
QUIET_ROUNDS = 3  # a lone request timed after a quiet spell, per count (at least MIN_THREAD_ROUNDS) ...
QUIET_GAP = 2.0  # ... that spell this many times as long, from the team's pass, as its workers took to go quiet
TOP_K = 5
SLOWDOWN_ENV = "FILLMASK_TEST_DTYPE_SLOWDOWN"
QUIET_LONE_ENV = "FILLMASK_TEST_QUIET_LONE_MS"


@dataclass
class Calibration:
    """What the start-up calibration found; ``hello()`` is its part of ``hello.engine``."""

    torch_threads: int  # all the forward pass's threads: with parts, the parts' together
    threads_from: str  # "flag", "calibration" or "default": the thread count's (parts: timed when in parts_ms)
    threads_ms: dict[int, float] = field(default_factory=dict)  # per candidate count in one pass: ms for THREAD_SHAPE
    forward_parts: int = 1  # the batch in this many parts side by side (``parts.py``), each on part_threads
    parts_ms: dict[int, float] = field(default_factory=dict)  # per candidate count of parts: ms for THREAD_SHAPE
    stages_us: float | None = None  # CPU microseconds a request takes outside the forward pass (``stages_s``)
    coefficients: Coefficients | None = None
    samples: list[tuple[int, int, float]] = field(default_factory=list)  # (rows, padded tokens, seconds)
    quiet_lone_ms: dict[int, float] = field(default_factory=dict)  # per count: a lone request after the team's quiet
    quiet_after_ms: float | None = None  # how long after the team's pass that was, at most (``time_quiet_lone``)
    quiet_warm_ms: dict[int, float] = field(default_factory=dict)  # per count: a lone request back to back
    dtype: str = "float32"
    dtype_speed: float | None = None  # float32's time ÷ the chosen dtype's (below 1: slower than float32)
    seconds: float = 0.0
    cpus: int = 0  # the CPUs the layouts were chosen for (0: none chosen)

    @property
    def part_threads(self) -> int:
        """Each part's torch threads (all of them in one pass)."""
        return max(1, self.torch_threads // self.forward_parts)

    @property
    def warning(self) -> str | None:
        """One line when the chosen reduced precision runs slower than float32 here."""
        if self.dtype_speed is None or self.dtype_speed >= 1:
            return None
        return (f"warning: --dtype {self.dtype} runs at {self.dtype_speed:.2f}x the speed of float32 on this "
                f"machine (measured at start-up); this hardware has no fast {self.dtype} path, so "
                "--dtype float32 is faster and exact")

    def hello(self) -> dict[str, Any]:
        """``torch_threads`` and ``calibration`` for ``hello.engine`` (protocol.md §2)."""
        calibration: dict[str, Any] = {"threads_from": self.threads_from, "seconds": round(self.seconds, 3)}
        if self.threads_ms or self.parts_ms:
            calibration["threads_ms"] = [{"threads": n, "ms": round(ms, 3)}
                                         for n, ms in sorted(self.threads_ms.items())]
            calibration["threads_ms"] += [{"threads": self._parts_threads(p), "parts": p, "ms": round(ms, 3)}
                                          for p, ms in sorted(self.parts_ms.items())]
        if self.stages_us is not None:
            calibration["stages_us_per_request"] = round(self.stages_us, 1)
        if self.coefficients is not None:
            c = self.coefficients
            calibration["cost_model"] = {"overhead_ms": round(c.overhead_s * 1e3, 4),
                                         "per_token_us": round(c.token_s * 1e6, 4),
                                         "per_row_us": round(c.row_s * 1e6, 4),
                                         "per_output_kb_us": round(c.byte_s * 1e9, 4)}
        if (quiet := self.quiet_lone()) is not None and self.quiet_after_ms is not None:  # (one needs the other)
            calibration["quiet_lone"] = {
                "after_ms": round(self.quiet_after_ms, 3),
                "threads_ms": [{"threads": n, "ms": round(ms, 3)} for n, ms in sorted(self.quiet_lone_ms.items())],
                "team": quiet.team, "threads": quiet.calibrated}
            if self.quiet_warm_ms:
                calibration["quiet_lone"]["warm_ms"] = [{"threads": n, "ms": round(ms, 3)}
                                                        for n, ms in sorted(self.quiet_warm_ms.items())]
        if self.dtype_speed is not None:
            # Three significant figures, not three decimals: a ratio under 0.0005 must not read 0 (§2: > 0).
            calibration["dtype_speed_vs_float32"] = float(f"{self.dtype_speed:.3g}")
        return {"torch_threads": self.torch_threads, "forward_parts": self.forward_parts, "calibration": calibration}

    def layouts(self) -> list[tuple[int, int]]:
        """The layouts timed, (all the threads, parts), the most preferred on a tie first (the fewer
        threads, then the narrower team: ``choose_layout``'s order); the thread tuner's candidates."""
        return sorted(self._timed(), key=preference)

    def quiet_lone(self) -> QuietLone | None:
        """The rule for a lone request after the team has gone quiet (``layout.QuietLone``), a new one
        each call, starting from this calibration's choice (the team where it was as fast); None where
        it was not timed."""
        if not self.quiet_lone_ms or self.quiet_after_ms is None:
            return None
        return QuietLone({n: ms / 1000 for n, ms in self.quiet_lone_ms.items()}, self.quiet_after_ms / 1000,
                         {n: ms / 1000 for n, ms in self.quiet_warm_ms.items()} or None, THREAD_SHAPE[1])

    def second_look(self) -> SecondLook | None:
        """The second look at the layout this calibration chose (``layout.SecondLook``), or None when
        no thread count was timed in two layouts (one pass and parts; with ``--torch-threads`` set,
        that count is)."""
        timed = self._timed()
        layouts = self.layouts()
        if len({threads for threads, _ in layouts}) == len(layouts):
            return None
        return SecondLook(layouts, [timed[layout] / 1000 for layout in layouts], THREAD_SHAPE[0], self.cpus,
                          (self.stages_us or 0.0) / 1e6)

    def _timed(self) -> dict[Layout, float]:
        """Each layout timed, (all the threads, parts): its ms for ``THREAD_SHAPE``."""
        timed = {(n, 1): ms for n, ms in self.threads_ms.items()}
        timed.update({(self._parts_threads(p), p): ms for p, ms in self.parts_ms.items()})
        return timed

    def _parts_threads(self, parts: int) -> int:
        """All the threads of the candidate layout of ``parts`` parts."""
        return part_layout(max(self.threads_ms, default=self.torch_threads), parts)[0]

    def layout_words(self) -> str:
        """``torch threads 2``, or ``torch threads 2 in 2 parts of 1``."""
        if self.forward_parts == 1:
            return f"torch threads {self.torch_threads}"
        return f"torch threads {self.torch_threads} in {self.forward_parts} parts of {self.part_threads}"

    def line(self) -> str:
        """The start-up line."""
        parts = [f"{self.layout_words()} ({self.threads_from}"]
        if self.threads_ms or self.parts_ms:
            timed = [f"{n} -> {ms:.1f} ms" for n, ms in sorted(self.threads_ms.items())]
            timed += [f"{self._parts_threads(p)} in {p} parts -> {ms:.1f} ms"
                      for p, ms in sorted(self.parts_ms.items())]
            parts[0] += ": " + ", ".join(timed)
        if self.stages_us is not None:
            parts[0] += f"; {self.stages_us:.0f} us of CPU a request beside the forward pass"
        parts[0] += ")"
        if self.coefficients is not None:
            c = self.coefficients
            parts.append(f"cost model {c.overhead_s * 1e3:.3f} ms per batch + {c.token_s * 1e6:.2f} us per padded "
                         f"token + {c.row_s * 1e6:.1f} us per row + {c.byte_s * 1e9:.1f} us per KB of output")
        if (quiet := self.quiet_lone()) is not None:
            parts.append(quiet.line())
        if self.dtype_speed is not None:
            parts.append(f"{self.dtype} at {self.dtype_speed:.2f}x float32's speed")
        return f"calibrated in {self.seconds:.2f} s: " + "; ".join(parts)


def part_layout(threads: int, parts: int) -> tuple[int, int]:
    """(all the threads, each part's) of ``parts`` parts sharing ``threads``: at least one each."""
    each = max(1, threads // max(1, parts))
    return each * max(1, parts), each


def part_counts(threads: int, rows: int) -> list[int]:
    """The counts of parts the calibration times ``threads`` threads in, on a batch of ``rows`` rows:
    2, and one a thread, where the threads divide evenly; but never more parts than the batch has
    rows: there the most that divide the threads (64 threads: 16 parts of 4). A batch of fewer texts
    than parts runs in fewer parts, on more threads each (``parts.plan``), so more parts than rows
    would time another layout than the one the server runs its full batches in."""
    if threads < 2:
        return []
    widest = max(parts for parts in range(1, min(threads, rows) + 1) if threads % parts == 0)
    return sorted({parts for parts in (2, widest) if 1 < parts <= rows and threads % parts == 0})


def uncalibrated(torch_threads: int = 0, forward_parts: int = 0) -> Calibration:
    """What the engine knows without calibrating (and what the calibration starts from): the layout the
    flags set (``--torch-threads``, ``--forward-parts``; 0: unset), and where it came from. Parts share
    the thread count, or without one the CPUs this process may use, each part an equal share of at
    least one thread (``part_layout``: ``validate`` refuses fewer threads than parts,
    and ``setting_warnings`` names a count the parts do not share evenly); a thread count without parts
    runs in one pass. Torch's own default (one thread per core) is capped at those CPUs."""
    import torch

    if forward_parts > 1:
        total, _ = part_layout(torch_threads or usable_cpus(), forward_parts)
        return Calibration(total, "flag", forward_parts=forward_parts)
    if not torch_threads and torch.get_num_threads() > (cpus := usable_cpus()):
        torch.set_num_threads(cpus)
    return Calibration(torch_threads or torch.get_num_threads(), "flag" if torch_threads else "default")


def calibrate(model: FillMaskModel, budget_s: float, torch_threads: int = 0, model_name: str | None = None,
              device: str = "cpu", forward: str = "traced", forward_parts: int = 0, quiet_lone: bool = True
              ) -> Calibration:
    """Measure this machine (see the module doc) within about ``budget_s`` seconds; 0 skips it.

    ``model_name`` (with ``device`` and ``forward``) is where a float32 copy is loaded from when
    ``model.dtype`` is a reduced precision. ``forward_parts``: ``--forward-parts`` (0: the calibration's
    choice; 1: one pass, parts not timed). ``quiet_lone`` False (``--quiet-lone off``): a lone request
    after a quiet spell is not timed, and keeps its layout's threads.
    """
    if budget_s <= 0:
        return uncalibrated(torch_threads, forward_parts)
    return on_a_thread_that_ends(lambda: _calibrate(model, budget_s, torch_threads, model_name, device, forward,
                                                    forward_parts, quiet_lone), "fillmask-calibrate")


def _calibrate(model: FillMaskModel, budget_s: float, torch_threads: int, model_name: str | None, device: str,
               forward: str, forward_parts: int = 0, quiet_lone: bool = True) -> Calibration:
    import torch

    started = time.perf_counter()
    until = started + budget_s
    on_cpu = model.device.type == "cpu"
    forward_parts = forward_parts if on_cpu else 1  # (parts only share CPU cores)
    result = uncalibrated(torch_threads, forward_parts)
    result.dtype = model.dtype
    decoder = SequenceDecoder(model.decode_tokenizer)
    if forward_parts > 1:
        torch.set_num_threads(result.torch_threads)
    else:
        # The thread counts to time (a count the user set: that one alone), and the same threads in parts
        # (2, and one a thread), each part an equal share.
        counts = [torch_threads] if torch_threads else _thread_candidates()
        candidates: list[Layout] = [(count, 1) for count in counts]
        widest = max(counts)
        if on_cpu and forward_parts == 0:
            candidates += [(widest, parts) for parts in part_counts(widest, THREAD_SHAPE[0])]
        cpus = usable_cpus()
        if len(candidates) == 1:  # one usable CPU (a quota of one or less), or one thread set: nothing to time
            result.torch_threads = candidates[0][0]
        else:
            items = batch_items(model, *THREAD_SHAPE)
            with _LayoutTimer(model, candidates) as timer:
                def time_at(layout: Layout) -> float:
                    return timer.time(items, layout)

                beside = stages_s(model, items, decoder) if device == "cpu" else 0.0  # a GPU's leaves the CPUs free
                result.stages_us = beside * 1e6
                thread_until = started + budget_s / 2  # the other half is the cost model's
                # (Each layout's first timed pass follows untimed ones, which start its workers: _LayoutTimer.)
                fastest = fastest_per_count(time_at, candidates, THREAD_ROUNDS,
                                            lambda: time.perf_counter() < thread_until)
            result.threads_ms = {count: s * 1000 for (count, parts), s in fastest.items() if parts == 1}
            result.parts_ms = {parts: s * 1000 for (_, parts), s in fastest.items() if parts > 1}
            result.cpus = max(cpus, widest)
            result.torch_threads, result.forward_parts = choose_layout(fastest, len(items), beside, result.cpus)
            result.threads_from = "flag" if torch_threads else "calibration"
        torch.set_num_threads(result.torch_threads)
    if quiet_lone and on_cpu and not torch_threads and result.torch_threads > 1:
        lone_s, quiet_s, warm_s = time_quiet_lone(model, result.torch_threads,
                                                  lambda: time.perf_counter() < started + budget_s / 2)
        result.quiet_lone_ms = forced_quiet_lone({count: seconds * 1000 for count, seconds in lone_s.items()})
        result.quiet_after_ms = quiet_s * 1000
        result.quiet_warm_ms = {count: seconds * 1000 for count, seconds in warm_s.items()}
    decode_s = 0.0
    decode_bytes = 0
    batches: dict[tuple[int, int], list[Item]] = {}
    round_s = 0.0  # one pass over the shapes so far: what each timed round will take
    last_s, last_tokens = 0.0, 1
    layout = (result.torch_threads, result.forward_parts)  # the shapes are timed as the engine will run them
    with _LayoutTimer(model, [layout]) as timer:
        for rows, width in FIT_SHAPES:
            # Past the first three, a shape joins only while the timed rounds still fit the budget with it
            # (its pass guessed from the last one's, per token): the rounds run at least MIN_THREAD_ROUNDS.
            guess = last_s * rows * width / last_tokens
            if len(batches) >= 3 and time.perf_counter() + MIN_THREAD_ROUNDS * (round_s + guess) > until:
                break
            items = batches[rows, width] = batch_items(model, rows, width)
            _, groups = timer.run(items, layout)  # the first passes specialise the graph to the shape (``_warm``)
            last_s, last_tokens = timer.time(items, layout), rows * width
            round_s += last_s
            clock = time.perf_counter()
            for cut, topk in groups:
                for n, i in enumerate(cut):
                    predictions_json(decoder, items[i], topk, n)
            decode_s += time.perf_counter() - clock
            decode_bytes += sum(intake.result_bound(model, list(item.input_ids), 1, TOP_K) for item in items)
        fastest = fastest_per_count(lambda shape: timer.time(batches[shape], layout),
                                    list(batches), FIT_ROUNDS, lambda: time.perf_counter() < until)
    _set_threads(result.torch_threads)
    result.samples = [(rows, rows * width, seconds) for (rows, width), seconds in fastest.items()]
    byte_s = decode_s / decode_bytes if decode_bytes else Coefficients.byte_s
    result.coefficients = fit(result.samples, byte_s)
    if model.dtype != "float32" and model_name is not None:
        try:
            result.dtype_speed = _dtype_speed(model, model_name, device, forward)
        except Exception as exc:  # a float32 copy that does not fit beside the model, say: serve without it
            log.warning("could not measure --dtype %s against float32 (%s); serving without that check",
                        model.dtype, first_line(exc))
    result.seconds = time.perf_counter() - started
    return result


def _dtype_speed(model: FillMaskModel, model_name: str, device: str, forward: str) -> float:
    """float32's time for one batch divided by ``model``'s (its reduced precision's)."""
    from .loading import load_model

    items = batch_items(model, *THREAD_SHAPE)
    # (not announced: its "loaded ... (float32)" line read as if the server had loaded float32 instead)
    reference = load_model(model_name, device, "float32", forward=forward, announce=False,
                           projection=model.projection_setting)
    log.info("measuring --dtype %s against a float32 copy of %s (loaded for the measurement only)", model.dtype,
             model_name)
    _warm(model, items)
    _warm(reference, items)
    reduced = full = float("inf")
    for _ in range(5):  # alternated, so that a neighbour's load weighs on both alike
        reduced = min(reduced, _time(model, items, 1))
        full = min(full, _time(reference, items, 1))
    del reference
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # (the float32 copy's memory, back for the batches)
    slowdown = float(os.environ.get(SLOWDOWN_ENV, "") or 1.0)
    return full / (reduced * slowdown)


class _LayoutTimer:
    """Times passes in the candidate layouts as the engine runs them (``Engine._run_batch``): in parts side
    by side, or whole at all the layout's threads when the batch is one item. A context manager: the
    part runners' helper threads end with it.

    A busy server runs one layout's batches back to back, and so each timed pass follows passes in its
    own layout: where the last pass was in another (or of another cut), ``SETTLE_PASSES`` untimed
    ones come first (unless that layout's last timed pass took ``SETTLE_BELOW_S`` or more). The first
    passes after a change are slower, by milliseconds: a core the last layout left idle wakes slowly
    (above all on a virtual machine), and half or more of tiny's passes in parts that followed a pass
    on one thread or on the whole team took about twice as long, so that one start in ten timed its
    parts slow in every round and kept a layout that served less
    (docs/performance-log.md, "Parts timed as a busy server runs them"). And a pass in parts right
    after a whole pass on a wider team comes only once the process is quiet (``wait_until_quiet``):
    that team's OpenMP workers go on spinning after their pass, on the cores the parts need
    (libgomp's default spins for milliseconds; docs/performance-log.md, "A second look at the layout
    while serving")."""

    def __init__(self, model: FillMaskModel, layouts: list[Layout]) -> None:
        self.model = model
        self.runners: dict[int, PartRunner[TopK]] = {
            parts: PartRunner(parts - 1, threads // parts, _set_threads, name="fillmask-calibrate-part")
            for threads, parts in layouts if parts > 1}
        self.team = 0  # the threads of the team that ran the last pass
        self._last: tuple[Layout, int] | None = None  # the layout of the last pass, and its number of parts
        self._took: dict[tuple[Layout, int], float] = {}  # each one's last timed pass, seconds

    def __enter__(self) -> _LayoutTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        for runner in self.runners.values():
            runner.close()

    def time(self, items: list[Item], layout: Layout) -> float:
        """Seconds of one pass over ``items`` in ``layout``."""
        return self.run(items, layout)[0]

    def run(self, items: list[Item], layout: Layout) -> tuple[float, list[tuple[list[int], TopK]]]:
        """Seconds of one pass over ``items`` in ``layout``, and its top-k: (indices, top-k) per part;
        after untimed passes where the last was in another layout (see the class docstring)."""
        cuts, each = plan([len(item.input_ids) for item in items], *layout)
        _set_threads(each)
        key = (layout, len(cuts))
        if self._last != key:
            if len(cuts) > 1 and self.team > each:
                wait_until_quiet()
            if self._took.get(key, 0.0) < SETTLE_BELOW_S:
                for _ in range(SETTLE_PASSES):
                    self._pass(items, layout, cuts, each)
            self._last = key
        clock = time.perf_counter()
        tops = self._pass(items, layout, cuts, each)
        self._took[key] = seconds = time.perf_counter() - clock
        return seconds, tops

    def _pass(self, items: list[Item], layout: Layout, cuts: list[list[int]], each: int
              ) -> list[tuple[list[int], TopK]]:
        self.team = each
        if len(cuts) == 1:
            return [(cuts[0], self.model.forward(items))]
        calls = [functools.partial(self.model.forward, [items[i] for i in cut]) for cut in cuts]
        return list(zip(cuts, self.runners[layout[1]].run(calls, each), strict=True))


#: How often ``wait_until_quiet`` looks at the process's CPU time: no shorter than the kernel's
#: scheduler tick (10 ms at 100 Hz), at which the CPU time of a thread running on another core is
#: counted (over 1-ms looks, a spinning worker read as quiet) ...
QUIET_TICK_S = 0.01
#: ... until it used less than this share of one core over a look (a spinning thread that shares its
#: core with other processes still uses more) ...
QUIET_SHARE = 0.25
QUIET_MOST_S = 0.2  # ... or this long has passed


def forced_quiet_lone(timed_ms: dict[int, float]) -> dict[int, float]:
    """``timed_ms`` (a lone request's milliseconds after a quiet, by count), with those that
    ``FILLMASK_TEST_QUIET_LONE_MS`` names (``1:3.7,2:3.6``) in their place: a test hook (the module
    docstring)."""
    forced = os.environ.get(QUIET_LONE_ENV, "")
    if not forced:
        return timed_ms
    try:
        given = {int(count): float(ms) for count, ms in (pair.split(":") for pair in forced.split(","))}
    except ValueError:
        given = {}
    if not given or not set(given) <= set(timed_ms) or not all(0 < ms < math.inf for ms in given.values()):
        raise ValueError(f"{QUIET_LONE_ENV} reads like 1:3.7,2:3.6 (thread count:milliseconds above 0, of the "
                         f"counts timed: {sorted(timed_ms)}), not {forced!r}")
    return {count: given.get(count, ms) for count, ms in timed_ms.items()}


def wait_until_quiet(cpu: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.perf_counter,
                     sleep: Callable[[float], None] = time.sleep) -> float:
    """Sleep until this process uses less than ``QUIET_SHARE`` of a core over ``QUIET_TICK_S`` (an
    OpenMP team's idle workers have stopped spinning), at most ``QUIET_MOST_S``; returns the seconds
    waited. Measured, not a fixed pause: how long workers spin depends on the OpenMP runtime, its
    settings and the CPU. (``cpu``, ``clock`` and ``sleep``: the process's CPU time, the wall clock
    and a sleep, for a test to fake.)"""
    started = clock()
    while (waited := clock() - started) < QUIET_MOST_S:
        used, at = cpu(), clock()
        sleep(QUIET_TICK_S)
        if cpu() - used < QUIET_SHARE * (clock() - at):
            return clock() - started
    return waited


def time_quiet_lone(model: FillMaskModel, team: int, more: Callable[[], bool] = lambda: True,
                    sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.perf_counter
                    ) -> tuple[dict[int, float], float, dict[int, float]]:
    """A lone request's seconds on one thread and on ``team`` threads, each timed once the team's
    workers have gone quiet after a pass of the team and stayed so as long again (``QUIET_GAP`` times
    the wait: on a virtual machine the slow wake-up came only after its CPU had been idle a while; a
    pass of the team, untimed, comes first where the last pass was on one thread), the counts in turn
    for up to ``QUIET_ROUNDS`` rounds (after ``MIN_THREAD_ROUNDS``, while ``more()``): the median of
    each count's, not the fastest, since the first pass after a quiet spell is what is measured; the
    longest time from the end of the team's pass to a timed pass's start (``clock``); and each count's
    time warm, the median of ``QUIET_ROUNDS`` passes back to back. Leaves this thread at ``team``
    threads. (``sleep`` and ``clock``: for a test to see the spells.)"""
    items = batch_items(model, 1, THREAD_SHAPE[1])
    counts = (1, team)
    warm: dict[int, list[float]] = {}
    for count in counts:
        _set_threads(count)
        _warm(model, items)  # (the graph's shape, at each count)
        warm[count] = [_time(model, items, 1) for _ in range(QUIET_ROUNDS)]
    times: dict[int, list[float]] = {count: [] for count in counts}
    spell_s = 0.0
    team_ended: float | None = clock()  # (the warm passes' last was the team's)
    for done in range(QUIET_ROUNDS):
        if done >= MIN_THREAD_ROUNDS and not more():
            break
        for count in counts:
            if team_ended is None:  # the last pass was on one thread: the team runs first, untimed
                _set_threads(team)
                model.forward(items)
                team_ended = clock()
            waited = wait_until_quiet()  # its workers spin on after its pass until they sleep ...
            sleep(waited * (QUIET_GAP - 1))  # ... and stay asleep a while
            spell_s = max(spell_s, clock() - team_ended)
            _set_threads(count)
            times[count].append(_time(model, items, 1))
            team_ended = clock() if count == team else None
    _set_threads(team)
    return ({count: statistics.median(seconds) for count, seconds in times.items()}, spell_s,
            {count: statistics.median(seconds) for count, seconds in warm.items()})


def _set_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)


def _warm(model: FillMaskModel, items: list[Item]) -> None:
    """Two passes: TorchScript's profiling executor specialises a graph to a shape on its first runs."""
    model.forward(items)
    model.forward(items)


def _time(model: FillMaskModel, items: list[Item], repeats: int) -> float:
    """The fastest of ``repeats`` forward passes, seconds."""
    best = float("inf")
    for _ in range(repeats):
        clock = time.perf_counter()
        model.forward(items)
        best = min(best, time.perf_counter() - clock)
    return best


def fastest_per_count(time_at: Callable[[K], float], candidates: list[K], rounds: int,
                      more: Callable[[], bool] = lambda: True) -> dict[K, float]:
    """Each candidate's fastest of up to ``rounds`` timings (``time_at(candidate)``, seconds): thread
    counts, or the cost model's batch shapes. The candidates are taken in turn round by round, so a
    burst of load shorter than the rounds run less one leaves every candidate at least one pass it did
    not touch. After ``MIN_THREAD_ROUNDS``, a round starts only while ``more()`` (the time budget) allows."""
    fastest = {count: float("inf") for count in candidates}
    for done in range(rounds):
        if done >= MIN_THREAD_ROUNDS and not more():
            break
        for count in candidates:
            fastest[count] = min(fastest[count], time_at(count))
    return fastest


def choose_threads(fastest: dict[int, float], rows: int = 1, beside_s: float = 0.0, cpus: int | None = None) -> int:
    """``choose_layout`` among thread counts in one pass: ``fastest[count]``."""
    return choose_layout({(count, 1): seconds for count, seconds in fastest.items()}, rows, beside_s, cpus)[0]


def stages_s(model: FillMaskModel, items: list[Item], decoder: SequenceDecoder) -> float:
    """CPU seconds a request takes outside the forward pass, timed on ``items`` made into requests (the
    fastest of ``MIN_THREAD_ROUNDS`` rounds): its frame parsed, its text tokenized and checked, its top
    k decoded and its result encoded. The WebSocket framing and the socket calls are left out, so
    this is less than the server spends: it errs towards more torch threads. 0 when the requests
    cannot be made (a tokenizer that cannot decode its own ids, say): the fastest count wins then."""
    try:
        texts = []
        for item in items:
            body = list(item.input_ids[1:-1])
            mask = body.index(model.mask_token_id)
            texts.append(f"{decoder.tokenizer.decode(body[:mask])} {model.mask_token} "
                         f"{decoder.tokenizer.decode(body[mask + 1:])}")
        limits = Limits(model.mask_token)
        frames = [orjson.dumps({"type": "fill_mask", "id": n, "text": text}) for n, text in enumerate(texts)]
        topk = model.forward(items)
        best = math.inf
        for _ in range(MIN_THREAD_ROUNDS):
            clock = time.thread_time()
            requests = [r for r in (parse_frame(frame, limits) for frame in frames) if isinstance(r, FillMaskRequest)]
            ids = intake.tokenize_all(model, [request.text for request in requests])
            for request, token_ids in zip(requests, ids, strict=True):
                intake.check(model, request, token_ids, limits.max_masks, sys.maxsize)
            for n, item in enumerate(items):
                encode_result(n, predictions_json(decoder, item, topk, n), 1.0, 1.0, len(items), 0, 0)
            best = min(best, time.thread_time() - clock)
        return best / len(items)
    except Exception as exc:  # the thread count must not keep the server from starting
        log.warning("could not time a request's work beside the forward pass (%s); the fastest thread count "
                    "wins", exc)
        return 0.0


def _thread_candidates() -> list[int]:
    cpus = usable_cpus()
    return sorted({1, max(1, cpus // 2), cpus})


def batch_items(model: FillMaskModel, rows: int, width: int) -> list[Item]:
    """``rows`` items of ``width`` tokens each (special tokens, ordinary vocabulary, one mask), varied
    per row, deterministic."""
    ids = model.tokenize([f"the {model.mask_token} ."])[0]
    first, last = ids[0], ids[-1]
    low = min(1000, model.vocab_size // 2)
    span = max(1, min(model.vocab_size, 2000) - low)
    items = []
    for row in range(rows):
        body = [low + (row * 7 + i * 13) % span for i in range(max(1, width - 2))]
        body[len(body) // 2] = model.mask_token_id
        items.append(Item([first, *body, last], TOP_K))
    return items
