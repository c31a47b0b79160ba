"""Which layout of the forward pass serves the most, and the second look at it while serving: no
threads, no torch, no clock of its own.

A *layout* is ``(threads, parts)``: all the torch threads of a forward pass, and the parts side by
side that a batch of several texts runs in (``parts.py``; 1: one pass). Two places choose one by the
same rule (``choose_layout``):

- **the start-up calibration** (``calibration.py``), from each layout's time for one batch, and the
  CPU a request takes beside the forward pass as it can time that before any load (``stages_s``:
  parsing, tokenizing, checking, decoding, encoding);
- **the second look** (``SecondLook``), once, on the first busy spell of serving: the same timings
  of the layouts of the thread count in use (one pass or parts), with the CPU a request was
  *measured* to take beside the forward pass while serving (the event loop's and the tokenizer and
  decode stages' CPU time, ``time.thread_time``, per request run).
  The calibration cannot time the rest of it: the WebSocket framing, the socket calls, the wake-ups
  and hand-overs between threads, which on a small model are most of it. That CPU takes cores from
  a full-width OpenMP team (``serving_rate``'s third bound), so a layout that won alone may lose
  under load. When the look chooses another layout, the engine switches to it
  (``tuning.ThreadTuner.adopt``); the tuner's probes go on from there, as they would from the
  calibration's choice.

Invariants: a second look decides at most once, and only from a spell of serving that began with
a forward pass, lasted at least ``LOOK_WINDOW_S``, ran at least ``LOOK_REQUESTS`` requests in
batches of ``LOOK_ROWS`` rows or more on average, and in which the forward passes kept the engine
busy at least ``LOOK_BUSY_SHARE`` of the time. An idle server's wake-ups cost more CPU a request
than a busy one's, and its layout matters least; a server answering one request at a time, even
back to back, runs each whole in every layout, so its spell says nothing about them. Batches of
several rows are the sign of load (requests queue while a batch runs); the busy share only keeps a
lone burst in a quiet spell out, and stays low because a small model's server may be bound by its
event loop and stages rather than its forward passes. A spell found
quieter than that is dropped, with the CPU counted in it, and the next begins; a busy spell short
of requests (a slow model) goes on.

A third choice is made for **a lone request after a quiet spell** (``QuietLone``): an OpenMP team's
idle workers spin for a while after a pass and then sleep, and on some machines the first pass that
wakes them takes several times a warm one, and longer than one thread takes for it (on a 2-core KVM
guest with a small model: docs/performance-log.md, "A lone request after a quiet spell"). The
calibration times a lone request on one thread and on the team once the team has gone quiet; where
one thread is the faster (``choose_quiet_lone``), by more than it is slower than the team back to
back, a lone request that starts at least as long after the model thread's last pass on the team as
the calibration waited runs on one thread. The calibration's few rounds can misjudge that wake-up,
and the host's share of slow ones moves from minute to minute, so the choice is made again while
serving, from the lone requests' own passes after a quiet and a probe of the count not in use, rare
once that count's passes while serving have replaced the calibration's timing (``QuietLone.ran``).
It is the team's own quiet that counts: a team left asleep while the model thread ran passes on one
thread, tens of milliseconds apart, was as slow to wake (the performance log has the figures). So
once lone requests run on one thread, the team runs again only for a batch that its layout gives
all of it (a one-pass layout's batch of several texts), or for a probe.
Invariant: that rule changes only batches of one request whose layout gives them the team it was
timed against, and only to a count it timed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .tuning import THREAD_TIE

Layout = tuple[int, int]  # (all the threads, parts)

LOOK_WINDOW_S = 1.0  # the second look measures a spell of serving at least this long ...
LOOK_BUSY_SHARE = 0.1  # ... in which the forward passes kept the engine busy at least this share of it ...
LOOK_ROWS = 8  # ... in batches of at least this many rows on average ...
LOOK_REQUESTS = 100  # ... that ran at least this many requests

QUIET_SAMPLES = 5  # a count's estimate for a lone request after a quiet: the mean of its last this many passes ...
QUIET_MARGIN = 0.1  # ... and another count's must beat the count in use's with this much added to it
QUIET_PROBE_EVERY = 256  # one such request in this many runs on another count, to time it (well under a p99's 1%);
# sooner while that count's probes win and its passes while serving are fewer than QUIET_SAMPLES (``probe_gap``)


def preference(layout: Layout) -> tuple[int, int]:
    """The order in which layouts win a tie (``choose_layout``, the tuner's ranks): the fewer threads,
    then the narrower team."""
    threads, parts = layout
    return threads, threads // parts


def choose_layout(fastest: dict[Layout, float], rows: int = 1, beside_s: float = 0.0, cpus: int | None = None
                  ) -> Layout:
    """The layout (all its threads, parts) predicted to serve the most requests a second
    (``serving_rate``: ``fastest[layout]`` is one batch of ``rows`` rows in that layout, ``beside_s`` the
    CPU seconds a request takes outside the forward pass, ``cpus`` those this process may use, by
    default the most threads), or among those within ``THREAD_TIE`` of it, the one with the fewest
    threads, then the narrowest team (fewer threads leave cores to the server's other stages; a
    narrower team waits less at its barriers for a thread they preempt). With nothing beside the
    forward pass, that is the fastest layout or one within the tie of it."""
    cpus = cpus or max(threads for threads, _ in fastest)
    rate = {layout: serving_rate(layout[0], seconds, rows, beside_s, cpus, layout[0] // layout[1])
            for layout, seconds in fastest.items()}
    best = max(rate.values())
    return min((layout for layout in rate if rate[layout] * (1 + THREAD_TIE) >= best),
               key=preference)


def serving_rate(count: int, batch_s: float, rows: int, beside_s: float, cpus: int, team: int | None = None
                 ) -> float:
    """Requests a second the server can serve with ``count`` torch threads, predicted from one batch's
    forward time alone (``batch_s`` for ``rows`` rows) and the CPU seconds each request takes beside it
    (``beside_s``), on ``cpus`` CPUs. The least of three bounds:

    - the engine runs one batch at a time: at most ``rows / batch_s`` requests a second;
    - each request takes ``count x batch_s / rows`` CPU seconds in the forward pass (every thread of the
      team is busy for all of it) and ``beside_s`` more, out of ``cpus`` CPU seconds a second;
    - a team (``team`` threads, by default all ``count``) as wide as the CPUs has no core to spare:
      whatever else runs takes a core from one of its threads, and the others wait for it at the next
      barrier, so the CPU used beside the forward pass adds to the engine's time
      (docs/performance-log.md, "Why the server stays below the limit"): at most
      ``1 / (batch_s / rows + beside_s)``. Parts side by side (``parts.py``), each a narrower team, meet
      once a batch, not at every operator: that bound is not theirs.
    """
    per_request = max(batch_s, 1e-9) / max(rows, 1)  # (a clock's tick at least: never a division by 0)
    rate = min(1 / per_request, cpus / (count * per_request + beside_s))
    return min(rate, 1 / (per_request + beside_s)) if (team or count) >= cpus else rate


@dataclass(frozen=True)
class Look:
    """What the second look found: ``beside_s`` CPU seconds a request took beside the forward pass,
    measured over ``requests`` requests (the calibration timed ``calibrated_s`` of it), and the layout
    chosen with it, by rank from 1 (``chosen``), where ``before`` was in use."""

    beside_s: float
    requests: int
    calibrated_s: float
    before: int
    chosen: int
    compared: int = 2  # the layouts of the count in use that it chose among (1: nothing to choose)

    def line(self, layouts: list[Layout]) -> str:
        """The log's one line about it (``layouts``: the candidates by rank, as the look had them)."""
        measured = (f"a request took {self.beside_s * 1e6:.0f} us of CPU beside the forward pass while serving "
                    f"({self.requests} requests; the calibration could time {self.calibrated_s * 1e6:.0f} us of it)")
        chosen = words(layouts[self.chosen - 1])
        if self.compared < 2:
            return (f"layout kept after a second look: {measured}; torch threads {chosen} is the one layout "
                    "of its count timed")
        if self.chosen == self.before:
            return f"layout kept after a second look: {measured}; torch threads {chosen} serve the most with it"
        return (f"layout chosen again after a second look: {measured}; torch threads "
                f"{words(layouts[self.before - 1])} -> {chosen} serve more with it")


def choose_quiet_lone(lone_s: dict[int, float], warm_s: dict[int, float] | None = None) -> int:
    """The thread count for a lone request after a quiet spell, from its time on each count after such
    a quiet (``lone_s``; the team is the largest count): the fastest count, or among those within
    ``THREAD_TIE`` of it the fewest threads; the team, though, when what that count saves after the
    quiet is no more than what it costs back to back (``warm_s``, each count's time then): a lone
    request moved once keeps the team asleep, so the requests that follow it closely run on that
    count too (the module docstring), and a load may hold as many of the one kind as of the other."""
    best = min(lone_s.values())
    chosen = min(count for count, seconds in lone_s.items() if seconds <= best * (1 + THREAD_TIE))
    team = max(lone_s)
    if warm_s is not None and warm_s[chosen] - warm_s[team] >= lone_s[team] - lone_s[chosen]:
        return team
    return chosen


class QuietLone:
    """The rule for a lone request after the team's quiet, chosen again as it runs. A lone request runs
    whole on ``threads`` threads instead of the ``team`` its layout gives it (``threads`` is the team
    where the team is the faster), when the model thread's last pass on all of the team ended at least
    ``after_s`` ago: how long after such a pass the calibration timed it (``QUIET_GAP`` times the wait
    for the team's workers to go quiet, ``calibration.time_quiet_lone``).

    ``lone_s``: the calibration's timings after the quiet, by thread count (``calibrated``: its choice),
    of a request ``tokens`` long; ``warm_s``: back to back. The calibration's few rounds can misjudge
    the wake-up: where some of the team's passes after a quiet wake fast and the others slowly, a median
    of two or three says fast in some starts, and the host's share of slow wakes moves from minute to
    minute (docs/performance-log.md has the figures). So each count keeps its last ``QUIET_SAMPLES``
    lone passes after a quiet (``ran``; the calibration's timing standing for those not yet run), each
    brought to the calibration's length (``ran``'s ``scale``), and after each pass the rule is chosen
    again by ``choose_quiet_lone`` from each count's mean of them, the expected wait (the wake-up is
    bimodal: a slow wake in five is a fifth of its cost, which a median would not see). Two brakes keep
    the noise of five passes from swinging it (each swing onto a team that wakes slowly costs a request
    a slow wake):

    - the count in use keeps lone requests unless another count wins with ``QUIET_MARGIN`` added to
      its estimate: one thread's passes in the server run a few percent slower than the calibration
      timed them, and two counts within a few percent of each other swung the rule back and forth;
    - the rule moves to more threads only on that count's own passes while serving (most of its
      last ``QUIET_SAMPLES``), never on the calibration's timing alone: that timing is the one a
      misjudged wake-up leaves too fast.

    The count in use is timed by every lone request after a quiet; one in ``QUIET_PROBE_EVERY`` of
    them runs on another count, to time that one again (a probe, which costs at most that share of
    such requests). A count whose estimate still holds the calibration's timing is probed sooner
    while its probes win, that is while the rule would choose it were it always as fast as in its
    last probe (``probe_gap``): the 8th such request is the first probe, and while each probe wins,
    the next comes twice as many later (16, 32 ...). A calibration that timed the team once at a bad
    moment put lone requests on one thread, and one probe in 256 would have needed hundreds of such
    requests to bring them back (base on the 2-core KVM guest: docs/performance-log.md, "A
    calibration's bad moment undone while serving"); a team that does wake slowly loses its first
    probe, and costs one slow wake early, then one in 256.

    Invariant: the rule changes only batches of one request whose layout gives them the team it was
    timed against, after that team's quiet, and only to a count it timed."""

    def __init__(self, lone_s: dict[int, float], after_s: float, warm_s: dict[int, float] | None = None,
                 tokens: int = 16, probe_every: int = QUIET_PROBE_EVERY) -> None:
        timings = [*lone_s.values(), *(warm_s or {}).values()]
        if len(lone_s) < 2 or not 0 <= after_s < math.inf or tokens < 1 or probe_every < 2 or not all(
                0 < seconds < math.inf for seconds in timings) or (warm_s is not None and set(warm_s) != set(lone_s)):
            raise ValueError("a lone request's time after a quiet spell is needed on each count, and how long the "
                             "team took to go quiet")
        self.team = max(lone_s)
        self.after_s = after_s
        self.tokens = tokens
        self.lone_s = dict(sorted(lone_s.items()))
        self.warm_s = dict(sorted(warm_s.items())) if warm_s is not None else None
        self.calibrated = choose_quiet_lone(self.lone_s, self.warm_s)
        self.threads = self.calibrated  # the count in use (read by /metrics from another thread)
        self.probes = 0  # lone requests run on another count than ``threads``, to time it again
        self._recent = {count: deque([seconds] * QUIET_SAMPLES, maxlen=QUIET_SAMPLES)
                        for count, seconds in self.lone_s.items()}
        self._served = dict.fromkeys(self.lone_s, 0)  # passes timed while serving, per count (at most the window)
        self._probe_every = probe_every  # (``QUIET_PROBE_EVERY``; a test's may be smaller)
        self._since_probe = 0  # the rule's requests since the last probe (or since the start)
        self._won = dict.fromkeys(self.lone_s, True)  # per count: its last probe won (``probe_gap``); none yet: True

    @property
    def served(self) -> dict[int, int]:
        """How many of each count's last ``QUIET_SAMPLES`` passes were timed while serving."""
        return dict(self._served)

    def applies(self, rows: int, threads: int, quiet_s: float) -> bool:
        """Whether a batch of ``rows`` rows, its layout giving it ``threads`` whole, is the rule's: a
        lone request on the team it was timed against, ``quiet_s`` seconds after the model thread's
        last pass on all of that team ended (``inf``: never)."""
        return rows == 1 and threads == self.team and quiet_s >= self.after_s

    def threads_for(self, rows: int, threads: int, quiet_s: float) -> int:
        """The threads that batch runs on (``applies``' arguments): ``threads`` unless it is the rule's;
        then the count in use, or once every ``probe_gap`` of the rule's requests another one, in turn
        (counted here)."""
        if not self.applies(rows, threads, quiet_s):
            return threads
        self._since_probe += 1
        others = [count for count in self.lone_s if count != self.threads]
        other = others[(self.probes + 1) % len(others)]
        if self._since_probe < self.probe_gap(other):
            return self.threads
        self._since_probe = 0
        self.probes += 1
        self._won[other] = False  # (until its pass, counted, says otherwise: ``ran``)
        return other

    def probe_gap(self, count: int) -> int:
        """How many of the rule's requests run from one probe to the next when the next runs on
        ``count``: ``QUIET_PROBE_EVERY`` (``probe_every``), or, while that count's probes win (none
        made yet, or the last one won), half as many for each of its last ``QUIET_SAMPLES`` passes
        not timed while serving (at least 2: the count in use is timed in between). A probe wins when
        the rule, with that probe's pass standing for its count, would choose the count (``ran``,
        judged once, when it ran); one whose pass was not counted (failed, or a length the cost
        model's scale could not bring to the calibration's) lost."""
        if not self._won[count]:
            return self._probe_every
        return max(2, self._probe_every >> (QUIET_SAMPLES - self._served[count]))

    def ran(self, threads: int, seconds: float, scale: float = 1.0) -> str | None:
        """The rule's batch (``applies``) ran on ``threads`` threads in ``seconds``; ``scale``: a warm
        pass of its length over one of the calibration's ``tokens`` (the cost model's, 1 at that
        length), so that what a longer request adds to the warm pass is taken off, and the wake-up
        alone compared. The scale is the cost model's, fitted on batches at the layout in use, not on
        one thread: a pass it puts at under half or over twice the calibration's length is not
        counted. Returns the log's line when that changes the count in use, else None."""
        if threads not in self._recent or not (seconds > 0 and math.isfinite(seconds)) or not 0.5 <= scale <= 2.0:
            return None
        warm = (self.warm_s or self.lone_s)[threads]
        at_length = seconds - warm * (scale - 1)
        if at_length <= 0:  # the cost model's scale, far off for this pass: nothing to learn from it
            return None
        if threads != self.threads:  # a probe: won if the rule would choose its count were it always so fast
            self._won[threads] = self._choose({**self.estimates(), threads: at_length}) == threads
        self._recent[threads].append(at_length)
        self._served[threads] = min(QUIET_SAMPLES, self._served[threads] + 1)
        estimates = self.estimates()
        chosen = self._choose(estimates)
        if chosen == self.threads or (chosen > self.threads and 2 * self._served[chosen] <= QUIET_SAMPLES):
            return None  # (more threads only on their own passes while serving: the class doc)
        before, self.threads = self.threads, chosen
        timed = ", ".join(f"{count} -> {s * 1e3:.1f} ms" for count, s in estimates.items())
        return (f"a lone request after {self.after_s * 1e3:.0f} ms of quiet now runs on {chosen} "
                f"thread{'s' if chosen > 1 else ''}, not {before}: the mean of its last passes after a quiet "
                f"on each count ({timed})")

    def _choose(self, estimates: dict[int, float]) -> int:
        """The count the rule chooses with ``estimates``: ``choose_quiet_lone``, the counts not in use
        handicapped by ``QUIET_MARGIN`` (the class doc's first brake)."""
        handicapped = {count: s * (1 + QUIET_MARGIN) if count != self.threads else s for count, s in estimates.items()}
        return choose_quiet_lone(handicapped, self.warm_s)

    def estimates(self) -> dict[int, float]:
        """Each count's seconds for a lone request after the quiet, as now estimated (the class doc)."""
        return {count: sum(recent) / len(recent) for count, recent in self._recent.items()}

    def line(self) -> str:
        """The start-up log's words for the calibration's choice."""
        timed = ", ".join(f"{count} -> {seconds * 1e3:.1f} ms" for count, seconds in self.lone_s.items())
        if self.warm_s is not None:
            timed += "; back to back " + ", ".join(f"{count} -> {s * 1e3:.1f} ms" for count, s in self.warm_s.items())
        verb = "keeps" if self.calibrated == self.team else "runs on"
        return (f"a lone request after {self.after_s * 1e3:.0f} ms of quiet {verb} {self.calibrated} "
                f"thread{'s' if self.calibrated > 1 else ''} ({timed}; timed again while serving)")


def words(layout: Layout) -> str:
    """A layout in the log's words: ``2``, or ``2 in 2 parts``."""
    threads, parts = layout
    return f"{threads}" + (f" in {parts} parts" if parts > 1 else "")


class SecondLook:
    """The calibration's choice of layout made once more on a busy spell of serving (see the module
    docstring), among the layouts of the thread count in use: one pass, or parts. ``layouts`` are the
    candidates in rank order (rank 1 first), ``batch_s`` each one's calibrated time for a batch of
    ``rows`` rows; ``cpus``: those this process may use; ``calibrated_s``: the CPU a request takes
    beside the forward pass as the calibration timed it.

    Why not another count: the measured CPU weighs on a full-width team (the rule's third bound),
    which the calibration could not see; across counts it also weighs on the CPU bound, where one
    calibration batch's rows misprice a layout with more passes: each part pays a pass's fixed
    cost, which the larger batches of a busy server share out. On tiny, a start whose calibration
    had timed two threads slowly chose one thread this way, and served less than in parts
    (docs/performance-log.md, "A second look at the layout while serving"). A change of count stays
    the tuner's probes', which time it while serving. Where the count in use has one layout timed,
    the look measures and keeps it (``Look.compared``)."""

    def __init__(self, layouts: list[Layout], batch_s: list[float], rows: int, cpus: int,
                 calibrated_s: float = 0.0) -> None:
        if len(layouts) != len(batch_s) or not layouts:
            raise ValueError("a second look needs each candidate layout's time")
        self.layouts = layouts
        self.batch_s = batch_s
        self.rows = rows
        self.cpus = cpus
        self.calibrated_s = calibrated_s
        self.done: Look | None = None  # set once, when the look is made
        self._since: float | None = None  # when the spell being measured began (None: none yet)
        self._cpu_s = 0.0  # CPU beside the forward pass in it
        self._busy_s = 0.0  # forward passes in it
        self._batches = 0  # how many
        self._requests = 0  # requests they ran

    @property
    def measuring(self) -> bool:
        """Whether the look still wants the CPU used beside the forward pass (``cpu``)."""
        return self.done is None

    def cpu(self, seconds: float) -> None:
        """The event loop or a stage thread used ``seconds`` of CPU since it last said so."""
        if self.done is None and self._since is not None:
            self._cpu_s += max(0.0, seconds)

    def ran(self, requests: int, seconds: float, now: float, current: int) -> Look | None:
        """A forward pass of ``requests`` requests took ``seconds``, ending at ``now``, with the layout
        of rank ``current`` in use. Returns the look when this batch completes it (once), else None."""
        if self.done is not None:
            return None
        since = self._since
        if since is None:
            since = self._begin(now - seconds)
        self._busy_s += seconds
        self._batches += 1
        self._requests += requests
        spell = now - since
        if spell < LOOK_WINDOW_S:
            return None
        if self._busy_s < LOOK_BUSY_SHARE * spell or self._requests < LOOK_ROWS * self._batches:
            self._begin(now)  # a quiet spell, or requests one or a few at a time: measure the next one
            return None
        if self._requests < LOOK_REQUESTS:  # busy with a slow model: the spell goes on
            return None
        beside_s = self._cpu_s / self._requests
        threads = self.layouts[current - 1][0]  # the count in use: its layouts alone (see the class doc)
        timed = {layout: s for layout, s in zip(self.layouts, self.batch_s, strict=True) if layout[0] == threads}
        chosen = self.layouts.index(choose_layout(timed, self.rows, beside_s, self.cpus)) + 1
        self.done = Look(beside_s, self._requests, self.calibrated_s, current, chosen, len(timed))
        return self.done

    def _begin(self, at: float) -> float:
        """A spell of serving begins ``at``; returns it."""
        self._since = at
        self._cpu_s = self._busy_s = 0.0
        self._batches = self._requests = 0
        return at
