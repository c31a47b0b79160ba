"""A batch's forward pass as parts side by side: one part on the calling thread, each other on a helper.

On a CPU a forward pass can use several cores two ways. Torch's intra-op threads (one OpenMP team)
split every operator of the pass between them and meet at a barrier after each; the team is only as
fast as its slowest thread, so whatever else the server runs on a core (the event loop, the
tokenizer and decode stages, a neighbour) stops the whole team at the next barrier, hundreds of times
a pass. Or the batch's rows are cut into parts, each run as a pass of its own by a smaller team on
its own thread: the parts meet once, at the end. A part that loses its core for a while delays the
batch by that while, not every operator of it. Which is faster depends on the model, the machine
and the batch (small operators gain most from fewer barriers), so the start-up calibration times
both (``calibration.py``); ``--forward-parts`` sets it by hand.

``split`` decides how a batch is cut (pure); ``PartRunner`` runs the parts. The invariants:

- for a batch of one item or more, a part is never empty, and the parts together are the batch's
  items, each once, in order;
- ``PartRunner.run`` returns only when every part has finished, with their results in part order,
  or raises the first part's exception (in part order) once every part has finished: no part of a
  batch still runs when the next batch starts, and the caller sees each failure it does not handle;
  a helper thread that ends some other way makes every later ``run`` raise, never wait for it;
- each helper thread runs only the callables ``run`` gives it (the model, and nothing else), and
  sets its own torch thread count to the run's whenever it differs from the last one it set
  (``set_threads``: a thread's count is its own once its first parallel operator has run).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, cast

R = TypeVar("R")
log = logging.getLogger(__name__)


def split(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """The batch's item indices cut into at most ``parts`` contiguous runs of about equal tokens
    (``lengths``: each item's tokens), none empty; one run when ``parts`` is 1 or there is one item."""
    count = min(parts, len(lengths))
    if count <= 1:
        return [list(range(len(lengths)))]
    total = sum(lengths)
    runs: list[list[int]] = []
    run: list[int] = []
    seen = 0
    for i, length in enumerate(lengths):
        left = len(lengths) - i  # items not yet placed, this one included
        runs_after = count - len(runs) - 1  # runs still to open after the current one
        # Close the current run before this item when its share of the tokens is reached, or when each
        # run still to open needs one of the items left.
        if run and len(runs) < count - 1 and (seen >= total * (len(runs) + 1) / count or left == runs_after):
            runs.append(run)
            run = []
        run.append(i)
        seen += length
    runs.append(run)
    return runs


def plan(lengths: Sequence[int], threads: int, parts: int) -> tuple[list[list[int]], int]:
    """How a batch of items of ``lengths`` tokens runs in a layout of ``threads`` torch threads in
    ``parts`` parts: its cut (``split``) and each part's threads, all of them shared by the parts the
    batch gives (a batch of one item runs whole on all of them; 0 threads stay 0: as they are)."""
    cuts = split(lengths, parts)
    return cuts, max(1, threads // len(cuts)) if threads else 0


class PartRunner(Generic[R]):
    """Runs parts of a batch side by side: the first on the calling thread, the others on ``helpers``
    threads of their own, each part at the run's torch thread count (``threads_each`` unless the run
    says otherwise; see the module docstring)."""

    def __init__(self, helpers: int, threads_each: int, set_threads: Callable[[int], None],
                 name: str = "fillmask-part", on_start: Callable[[str], None] | None = None) -> None:
        self.threads_each = threads_each
        self._set_threads = set_threads
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._work: list[tuple[Callable[[], R], int] | None] = [None] * helpers
        self._results: list[tuple[bool, R | BaseException] | None] = [None] * helpers
        self._closed = False
        self._broken: str | None = None  # why a helper ended other than by ``close``
        self._on_start = on_start
        self._threads = [threading.Thread(target=self._serve, args=(n,), name=f"{name}-{n + 1}", daemon=True)
                         for n in range(helpers)]
        for thread in self._threads:
            thread.start()

    @property
    def parts(self) -> int:
        """The most parts one ``run`` takes: the calling thread's and one per helper."""
        return len(self._threads) + 1

    def run(self, parts: Sequence[Callable[[], R]], threads: int = 0) -> list[R]:
        """Each of ``parts`` called once, the first on this thread (at the caller's torch thread count:
        set it first), the others on the helpers at ``threads`` each (0: ``threads_each``); their
        results in order (see the invariants)."""
        if not 1 <= len(parts) <= self.parts:
            raise ValueError(f"{len(parts)} parts for a runner of {self.parts}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the part runner is closed")
            if self._broken is not None:
                raise RuntimeError(self._broken)
            for n, part in enumerate(parts[1:]):
                self._results[n] = None
                self._work[n] = (part, threads or self.threads_each)
            self._wake.notify_all()
        first: tuple[bool, R | BaseException]
        try:
            first = (True, parts[0]())
        except BaseException as exc:  # the helpers' parts must end before anything is raised
            first = (False, exc)
        with self._lock:
            while self._broken is None and any(result is None for result in self._results[:len(parts) - 1]):
                self._done.wait()
            if self._broken is not None:
                raise RuntimeError(self._broken)
            outcomes = [first, *cast("list[tuple[bool, R | BaseException]]", self._results[:len(parts) - 1])]
            self._results = [None] * len(self._results)
        for ok, value in outcomes:
            if not ok:
                raise cast(BaseException, value)
        return [cast(R, value) for _, value in outcomes]

    def close(self, timeout: float = 5.0) -> None:
        """Stop the helpers (after the part they run or were handed, if any, so that a ``run`` under
        way still returns) and wait for them: afterwards none of them touches the model."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    @property
    def ended(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    def _serve(self, n: int) -> None:
        try:
            self._serve_parts(n)
        except BaseException as exc:  # (its part's own failures are results: this is the loop's)
            log.error("a helper thread of the forward pass's parts ended", exc_info=exc)
            with self._lock:
                self._broken = f"a helper thread of the forward pass's parts ended ({type(exc).__name__}: {exc})"
                self._done.notify_all()

    def _serve_parts(self, n: int) -> None:
        if self._on_start is not None:
            self._on_start(threading.current_thread().name)
        threads_set = 0
        while True:
            with self._lock:
                while self._work[n] is None and not self._closed:
                    self._wake.wait()
                work = self._work[n]
                if work is None:  # closed, and no part handed over: a part handed over always runs
                    return
                self._work[n] = None
            part, threads = work
            result: tuple[bool, R | BaseException]
            try:
                if threads_set != threads:
                    self._set_threads(threads)
                    threads_set = threads
                result = (True, part())
            except BaseException as exc:
                result = (False, exc)
            with self._lock:
                self._results[n] = result
                self._done.notify_all()
