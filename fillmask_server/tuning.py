"""The torch thread count, measured again while serving: no threads, no torch, no clock of its own.

The start-up calibration times the candidate counts before any load, within about a second; what
suits the machine can change after it, or was not what it measured: a neighbour (another replica,
another tenant) that starts, stops, or was busy during the calibration itself. Two replicas that
start together on two cores each measure two threads at many times their real time (each one's OpenMP
barrier waits for a worker the other has descheduled) and would run on one thread for good.

So the engine core keeps a ``ThreadTuner`` (when the calibration timed two layouts or more: torch's
default with the calibration off, and the parts the user set, are left alone; a count the user set
is never changed, only its layouts, in one pass and in parts, are tried). Its candidates are
integers that it only orders: thread counts, or, where the calibration also timed batches in parts
side by side, the ranks from 1 of the layouts it timed (``Calibration.layouts``: the fewer threads,
then the narrower team, first), which the engine maps to (threads, parts). "Larger" below is then "later
in that order". Now and then it runs a **probe**:
up to ``PROBE_BATCHES`` timed batches at a neighbouring candidate count (the next smaller or larger
one; after its warm-up, below, not counted), each batch's forward time divided by the cost
model's prediction for its shape, against the same ratio for the last batches at the current count.
The engine asks ``count`` once for each batch, when the batch starts (after the last batch's
``ran``): a batch whose count was fixed earlier could run at a probe's count after the probe ended.
The rules:

- A probe **wins** when its median ratio is below the current count's by ``THREAD_TIE`` (a larger
  count), or is not above it by more than ``THREAD_TIE`` (a smaller count: fewer threads leave cores
  to the server's other stages; the calibration's tie rule). Two wins in a row for the same count
  switch to it (one probe is one noisy sample).
- **A probe ends as soon as its verdict is known.** Once more than half of its ``PROBE_BATCHES``
  timed batches win (or lose) by that rule, so does their median: it ends there, with the verdict
  that all of them would give. A timed batch slower than the current count's beyond their own
  spread ends it at once, lost: its ratio above their median by ``CLEAR_LOSS_RATIO``, or above their
  slowest by ``THREAD_TIE`` where that is more, and always when above ``ABORT_RATIO`` times their
  median (a warm-up batch: above ``ABORT_RATIO_WARM_UP`` times it for the first, ``ABORT_RATIO``
  for the next). Under load every probe batch that is slower than the current count's holds up every
  request queued behind it, and shows in the closed loop's p99 (docs/performance-log.md, "Probes
  that stop when they know").
- **A probe is short and rare.** A probe that has not timed its batches after
  ``PROBE_MAX_BATCHES`` (its warm-up, and twice its timed batches: they failed or were split) ends
  without a verdict, as a loss. Probes cost at most about ``PROBE_SHARE`` of the time while serving.
  A probe's *cost* is the engine time its batches took beyond what the count in use would have taken for them (the
  current count's median ratio times each batch's prediction; a batch with no prediction counts
  whole), and the same for the warm-up batches back at the count in use after it, so a probe of a
  faster count costs about nothing; a quiet spell during a probe does not count. The costs are
  measured against the count in use, so a switch forgets them. A probe starts no sooner than the cost of
  the last probe of its count (before the first: ``PROBE_BATCHES`` + 1 batches at the recent batch
  time, one warm-up batch assumed) divided by ``PROBE_SHARE`` after the last probe ended (or the
  engine started), and no sooner than ``FIRST_INTERVAL_S``; a probe that loses doubles that least
  wait for its load (below), up to ``MAX_INTERVAL_S`` (a machine whose best count does not change is
  probed rarely; only probes whose batches are so long that the share asks for more wait longer); a
  switch starts again from ``FIRST_INTERVAL_S``. A probe compares with the count in use's batches
  since the last probe, of its own load: it starts only once ``FRESH_BATCHES`` of them (most of the
  ``REFERENCE_BATCHES`` it compares with) have been timed past their warm-up since the last probe
  ended and since the load (below) last changed.
- **A verdict holds for the load it was measured under.** The best layout depends on the batch: a
  lone request runs whole on every layout's threads, and a team's wake-up or a part's hand-over
  weighs on small batches what it does not on large ones (on a 2-core machine with a small model,
  one thread can serve as much as two parts at batches of a few rows and clearly less at batches of
  many: docs/performance-log.md, "A verdict for the load it was measured under"). So the tuner keeps
  the rows of the load's batches (a moving average over every batch), and the doubled wait after a
  loss is its load's: a load is the power of ``LOAD_ROWS_CHANGE`` nearest its rows (1, 2, 4, 8,
  ...), each keeps its own wait, and a load not yet probed waits ``FIRST_INTERVAL_S`` (the cost
  share still holds). A load that swings between two sizes is thus probed about as often as the
  loads it passes through would be together, steady (its two sizes, and those the moving average
  crosses between them).
- **A win of a larger count is confirmed soon**: the next probe, of the same count, is due
  ``CONFIRM_INTERVAL_S`` after it (and after ``FRESH_BATCHES`` batches of the count in use, so that
  it compares with batches the first probe did not). A neighbour's burst of load makes a wider team
  slower, never faster, so a burst that began after the first probe can only make the second lose;
  a smaller count's win, which such a burst can give, is confirmed after ``FIRST_INTERVAL_S``, long
  enough for a burst to end.
- The first batch after any change of count (to a probe, back, or a switch) is a warm-up: it counts
  for nothing, and like a probe's batches it does not feed the cost model (``Ran.fit``), which stays
  a model of the count in use. So is each next one **while the batches keep getting faster** (each
  faster than the one before it by more than ``THREAD_TIE``), up to ``WARM_UP_MOST`` in all: the first
  batch that is not is the settled pace, and counts. Under load, the first few batches in parts
  after a spell on one thread can run far slower than the ones after them (a part's helper thread,
  idle until then, finding its core among the server's other threads; in-process, with the other
  core free, the first batch ran at the settled pace), and a probe that timed them found the parts
  no faster than one thread (the performance log, same section, has the figures).
- The batch that ends a probe says how it went (``Verdict``, on ``Ran``): the engine logs it.

Invariants: ``count`` is the current count unless a probe is under way; ``current`` changes only by
a switch, and only to a candidate: after probes it won, or when the second look chose it
(``adopt``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

THREAD_TIE = 0.05  # a larger thread count must be this much faster to win (a smaller one, no slower)
PROBE_BATCHES = 3  # batches timed per probe at most, after its warm-up (odd: a median of one of them)
assert PROBE_BATCHES % 2 == 1, "a majority of the timed batches must always decide"
REFERENCE_BATCHES = 5  # the current count's latest batches a probe is compared with ...
FRESH_BATCHES = REFERENCE_BATCHES // 2 + 1  # ... of which a probe waits for this many since the last (their median)
WINS_TO_SWITCH = 2  # probes in a row that a count must win before the engine switches to it
PROBE_SHARE = 0.02  # probes cost at most about this share of the time while serving (see "cost" above)
WARM_UP_MOST = PROBE_BATCHES + 1  # a change of count's warm-up batches at most (see above)
PROBE_MAX_BATCHES = WARM_UP_MOST + 2 * PROBE_BATCHES  # a probe that has not timed enough batches by then is given up
CLEAR_LOSS_RATIO = 1.25  # a timed probe batch this much slower than the current count's median loses it
ABORT_RATIO = 2.0  # a probe batch this many times slower than the current count's ends the probe, lost
ABORT_RATIO_WARM_UP = 4.0  # the same for its first warm-up batch (which may start the count's workers)
FIRST_INTERVAL_S = 5.0  # the least time between probes (the first comes this long after start) ...
CONFIRM_INTERVAL_S = 1.0  # ... but for the probe that confirms a larger count's win, due this long after it
LOAD_ROWS_CHANGE = 2.0  # loads whose batches' rows differ by this factor keep their own waits after a loss
ROWS_WEIGHT = 0.2  # the load's rows a batch: a moving average, each batch weighing this much
MAX_INTERVAL_S = 600.0  # the most, after probes that kept losing


@dataclass(frozen=True)
class Verdict:
    """How a probe ended: the count ``probe`` against the count in use ``current``, ``won`` (None: given
    up without a verdict, its batches failed or split), its timed batches' ratios to the cost model's
    prediction (and the ratio of the batch that lost it at once, warm-up or not) and the count in
    use's median one (``theirs``), at the load's ``rows`` a batch."""

    probe: int
    current: int
    won: bool | None
    ratios: tuple[float, ...]
    theirs: float
    rows: float

    def line(self, words: Callable[[int], str]) -> str:
        """The log's line, each count in ``words`` (the engine's: ``2 in 2 parts``)."""
        ended = {True: "won", False: "lost", None: "no verdict, its batches failed or split"}[self.won]
        timed = (f"its batches {', '.join(f'{ratio:.2f}' for ratio in self.ratios)} times the cost model's "
                 "prediction" if self.ratios else "no batch of it timed past its warm-up")
        return (f"probe of torch threads {words(self.probe)} against {words(self.current)} at batches of "
                f"{self.rows:.0f} rows: {ended} ({timed}, the layout in use's {self.theirs:.2f}; tuning.py)")


@dataclass(frozen=True)
class Ran:
    """What one batch told the tuner: whether it is a batch of the count in use (the cost model may
    fit it), the switch it decided, as (from, to), if any, and how the probe it ended went, if it
    ended one."""

    fit: bool
    switched: tuple[int, int] | None = None
    verdict: Verdict | None = None


class ThreadTuner:
    """The thread count for each next batch (see the module docstring)."""

    def __init__(self, candidates: list[int], current: int, now: float, adaptive: bool = True,
                 first_interval_s: float = FIRST_INTERVAL_S, probe_share: float = PROBE_SHARE) -> None:
        self.candidates = sorted(set(candidates) | {current})
        self.current = current
        self.adaptive = adaptive and len(self.candidates) > 1
        self.switches = 0
        self._reference: deque[float] = deque(maxlen=REFERENCE_BATCHES)
        self._first_interval = first_interval_s
        self._share = probe_share
        self._intervals: dict[int, float] = {}  # each load's least wait after its last lost probe (``_load``)
        self._since = now  # when the last probe ended (or the tuner started)
        self._wait: float | None = first_interval_s  # the least time from then to the next probe (None: the load's)
        self._cost: dict[int, float] = {}  # each probed count's last probe's cost (seconds)
        self._probe_batches = 0  # batches run in the probe under way
        self._probe_excess = 0.0  # and their engine time beyond the current count's (its cost)
        self._probe: int | None = None  # the count being probed
        self._returning: int | None = None  # the count of the probe that just ended, until the batch back
        self._probe_ratios: list[float] = []
        self._wins: tuple[int, int] = (0, 0)  # (count, probes in a row it won)
        self._last = current  # the count of the last batch (the calibration warmed the current one)
        self._warm_ups: int | None = None  # warm-up batches since the last change of count (None: settled)
        self._warm_ratio: float | None = None  # ... the last one's ratio
        self._batch_s = 0.0  # moving average of a batch's time
        self._turn = 0  # which other candidate the next probe tries
        self._fresh = 0  # batches of the count in use timed since the last probe ended (or the start)
        self._rows = 0.0  # the load's rows a batch (moving average; 0: no batch yet)

    @property
    def probing(self) -> int | None:
        """The count a probe under way runs at, or None."""
        return self._probe

    @property
    def load_rows(self) -> float:
        """The rows of the load's batches: a moving average over every batch (0 before the first)."""
        return self._rows

    def count(self, now: float) -> int:
        """The thread count for the next batch; starts a probe when one is due."""
        if self._probe is None and self.adaptive and self._fresh >= FRESH_BATCHES:
            probe = self._next_probe()
            wait = self._wait if self._wait is not None else self._intervals.get(self._load(), self._first_interval)
            if now >= self._since + max(wait, self._probe_cost(probe) / self._share):
                self._probe = probe
                self._turn += 1
                self._probe_ratios = []
                self._probe_batches = 0
                self._probe_excess = 0.0
        return self._probe if self._probe is not None else self.current

    def _next_probe(self) -> int:
        """The count the next probe tries: one that won the last probe, or each neighbour in turn. Only
        the neighbouring counts: a probe of 1 thread on a 64-core machine would stall every queued
        request behind a batch many times slower."""
        place = self.candidates.index(self.current)
        others = self.candidates[max(0, place - 1): place] + self.candidates[place + 1: place + 2]
        pending, won = self._wins
        return pending if won and pending in others else others[self._turn % len(others)]

    def ran(self, count: int, seconds: float, predicted_s: float, now: float, rows: int = 1) -> Ran:
        """A batch of ``rows`` requests ran at ``count`` threads in ``seconds`` (0: not timed); the cost
        model predicted ``predicted_s``."""
        if rows > 0:
            load = self._load()
            self._rows = rows if not self._rows else (1 - ROWS_WEIGHT) * self._rows + ROWS_WEIGHT * rows
            if self._load() != load:
                self._fresh = 0  # a probe compares with batches of its own load
        if seconds > 0:
            self._batch_s = seconds if not self._batch_s else 0.9 * self._batch_s + 0.1 * seconds
        ratio = seconds / predicted_s if predicted_s > 0 and seconds > 0 else None
        warm_up = self._warming(count, ratio)
        returning = self._returning
        if not warm_up:
            self._returning = None
        if count == self._probe:
            self._probe_batches += 1
            if seconds > 0:
                self._probe_excess += self._beyond_current(seconds, predicted_s)
            if ratio is not None and ratio > self._slower_beyond_doubt(warm_up, self._probe_batches == 1):
                self._probe_ratios.append(ratio)  # (for the verdict's line: the batch that lost it)
                return self._decide(now, won=False)  # no more batches of it
            if not warm_up and ratio is not None:
                self._probe_ratios.append(ratio)
            verdict = self._verdict()
            if verdict is not None:
                return self._decide(now, won=verdict)
            if self._probe_batches >= PROBE_MAX_BATCHES:  # its batches failed or split: no verdict
                return self._decide(now, won=False, judged=False)
            return Ran(False)
        if count == self.current and warm_up and returning in self._cost and seconds > 0:
            self._cost[returning] += max(0.0, self._beyond_current(seconds, predicted_s))
        if count == self.current and not warm_up and ratio is not None:
            self._reference.append(ratio)
            self._fresh += 1
        return Ran(count == self.current and not warm_up)

    def _warming(self, count: int, ratio: float | None) -> bool:
        """Whether this batch, at ``count`` with ``ratio`` (None: not timed), is a warm-up after a change
        of count (see the module docstring): the first batch after one is, and each next one while it
        is faster than the warm-up batch before it by more than ``THREAD_TIE``, up to
        ``WARM_UP_MOST`` batches in all; the first batch that is not counts (it is the settled pace)."""
        if count != self._last:
            self._last = count
            self._warm_ups, self._warm_ratio = 0, None
        if self._warm_ups is None:
            return False
        if ratio is not None and self._warm_ratio is not None and ratio * (1 + THREAD_TIE) >= self._warm_ratio:
            self._warm_ups = None  # no longer getting faster
            return False
        self._warm_ups += 1
        self._warm_ratio = ratio if ratio is not None else self._warm_ratio
        if self._warm_ups >= WARM_UP_MOST:
            self._warm_ups = None  # (the next batch counts)
        return True

    def adopt(self, candidate: int, now: float) -> bool:
        """Switch to ``candidate`` on evidence other than a probe's (the second look,
        ``layout.SecondLook``); True when that changed the count. A probe under way ends unjudged; as
        after a switch a probe won, the costs measured against the old count are forgotten, and the
        next probe waits ``FIRST_INTERVAL_S``, and for ``FRESH_BATCHES`` batches at the new count past
        their warm-up."""
        if candidate not in self.candidates:
            raise ValueError(f"{candidate} is not one of the tuner's candidates {self.candidates}")
        if candidate == self.current:
            return False
        self._probe = self._returning = None
        self._switch_to(candidate, [])
        self._wait = self._first_interval
        self._since = now
        return True

    def _switch_to(self, candidate: int, ratios: list[float]) -> None:
        """``current`` becomes ``candidate``, whose batches so far had ``ratios``; what was measured
        against the count before it is forgotten, and probes start again from the first interval."""
        self.current = candidate
        self.switches += 1
        self._cost.clear()  # measured against the count that was in use
        self._wins = (0, 0)
        self._reference = deque(ratios, maxlen=REFERENCE_BATCHES)
        self._fresh = len(self._reference)
        self._intervals.clear()  # (waits after probes measured against the count before)

    def _beyond_current(self, seconds: float, predicted_s: float) -> float:
        """How much longer a batch took than the count in use would have (its median ratio times the
        prediction; a batch with no prediction, all of it)."""
        return seconds - statistics.median(self._reference) * max(0.0, predicted_s)

    def _probe_cost(self, probe: int) -> float:
        """A probe of ``probe`` threads' expected cost: the last one's, or before the first, its
        batches at the recent batch time."""
        return self._cost.get(probe, (PROBE_BATCHES + 1) * self._batch_s)

    def _load(self) -> int:
        """The load the batches now are (``LOAD_ROWS_CHANGE``): the power of it nearest their rows."""
        return round(math.log(max(1.0, self._rows), LOAD_ROWS_CHANGE))

    def _slower_beyond_doubt(self, warm_up: bool, first: bool) -> float:
        """The ratio above which a probe batch (a ``warm_up`` one, the probe's ``first``) loses the probe
        at once (see the module docstring)."""
        theirs = statistics.median(self._reference)
        if warm_up:
            return theirs * (ABORT_RATIO_WARM_UP if first else ABORT_RATIO)
        return min(theirs * ABORT_RATIO, max(theirs * CLEAR_LOSS_RATIO, max(self._reference) * (1 + THREAD_TIE)))

    def _verdict(self) -> bool | None:
        """Whether the probe wins, once more than half of its ``PROBE_BATCHES`` timed batches agree
        (then so does their median, whatever the rest); None until then."""
        theirs = statistics.median(self._reference)
        assert self._probe is not None
        if self._probe < self.current:
            wins = sum(mine <= theirs * (1 + THREAD_TIE) for mine in self._probe_ratios)
        else:
            wins = sum(mine * (1 + THREAD_TIE) < theirs for mine in self._probe_ratios)
        needed = PROBE_BATCHES // 2 + 1
        if wins >= needed:
            return True
        if len(self._probe_ratios) - wins >= needed:
            return False
        return None

    def _decide(self, now: float, won: bool, judged: bool = True) -> Ran:
        """The probe is over (``judged``: with a verdict; without, a loss): count a win or a loss, switch
        after enough wins, plan the next probe."""
        probe, self._probe = self._probe, None
        assert probe is not None
        verdict = Verdict(probe, self.current, won if judged else None, tuple(self._probe_ratios),
                          statistics.median(self._reference), self._rows)
        self._cost[probe] = max(0.0, self._probe_excess)
        self._returning = probe
        self._fresh = 0
        switched = None
        if not won:
            self._wins = (0, 0)
            load = self._load()
            self._intervals[load] = min(MAX_INTERVAL_S, 2 * self._intervals.get(load, self._first_interval))
            self._wait = None  # (the load's, whichever it is when the next probe is due)
        elif self._wins[0] == probe and self._wins[1] + 1 >= WINS_TO_SWITCH:
            switched = (self.current, probe)
            self._switch_to(probe, self._probe_ratios)
            self._wait = self._first_interval
        else:
            self._wins = (probe, self._wins[1] + 1 if self._wins[0] == probe else 1)
            soon = probe > self.current  # (see the module docstring: a burst only slows a wider team)
            self._wait = min(CONFIRM_INTERVAL_S, self._first_interval) if soon else self._first_interval
        self._since = now
        return Ran(False, switched, verdict)


#: The interpreter's switch interval (``sys.setswitchinterval``) for a model on one CPU thread, and for
#: one whose forward pass keeps a team busy (several CPU threads, or a GPU): see ``switch_interval_s``.
SWITCH_ONE_THREAD_S = 0.001
SWITCH_TEAM_S = 0.0002


def switch_interval_s(threads: int, device_type: str) -> float:
    """The GIL switch interval that suits a model on ``threads`` torch threads on ``device_type``.

    The model thread takes the GIL a few times a batch, and each time another thread is running
    Python it waits up to the interval; every other thread of the server runs Python, and each hand-over
    that the interval forces between them costs CPU. On one CPU thread such a wait idles one core,
    which the other threads go on using: the longer interval, with fewer forced hand-overs, serves
    more. With a team (``threads`` > 1, or 0: torch's default, one per core; or a GPU) the whole team
    idles while the model thread waits: the shorter one serves more. (docs/performance-log.md, "The GIL's
    switch interval", has the side-by-side figures.)
    """
    return SWITCH_ONE_THREAD_S if device_type == "cpu" and threads == 1 else SWITCH_TEAM_S
