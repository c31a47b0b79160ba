"""What the server says while it starts: the lines an operator reads before ``ready:``.

``load_model`` reports each stage as it starts (its ``progress`` argument); ``StartupLines`` turns
those calls into lines on stderr, where the logs go too (stdout carries the one ``ready:`` line that
scripts wait for):

- the first call, ``loading NAME on DEVICE, DTYPE``, is written at once, with an ellipsis;
- every later call ends the stage before it, and a stage that took at least ``threshold_s`` gets one
  step line with its duration (``  tokenizer and weights: 2.1 s``); quick stages stay silent;
- ``done`` ends the last stage the same way;
- ``quiet`` (``--log-level warning`` or ``error``) writes none of them: they are information.

Invariant: each stage is written at most once, and only after it ended, so a line never claims a
duration that was not measured. No torch, no threads: calls come from one thread at a time (the
loading thread, then the caller of ``done`` after it has joined it).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import TextIO

#: The log lines' layout: an ISO 8601 time with its UTC offset (``LogTimes``), the level, the logger.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: A stage that takes less than this says nothing: most stages of a small model are quick.
STEP_THRESHOLD_S = 1.0


class StartupLines:
    """The ``progress`` callback of ``load_model`` that writes the start-up's lines (see above)."""

    def __init__(self, out: TextIO | None = None, threshold_s: float = STEP_THRESHOLD_S,
                 clock: Callable[[], float] = time.monotonic, quiet: bool = False) -> None:
        self._out = out
        self._quiet = quiet
        self._threshold_s = threshold_s
        self._clock = clock
        self._headed = False
        self._stage: str | None = None
        self._since = 0.0

    def __call__(self, message: str) -> None:
        """A stage starts: the first is the head line (written now); each later one ends the one before."""
        if not self._headed:
            self._headed = True
            self._write(f"{message}…")
            self._since = self._clock()
            return
        self._end_stage()
        self._stage = message

    def done(self) -> None:
        """Loading has finished: end the last stage."""
        self._end_stage()
        self._stage = None

    def _end_stage(self) -> None:
        now = self._clock()
        if self._stage is not None and now - self._since >= self._threshold_s:
            self._write(f"  {self._stage}: {now - self._since:.1f} s")
        self._since = now

    def _write(self, line: str) -> None:
        if self._quiet:
            return
        out = self._out if self._out is not None else sys.stderr  # looked up late: tests swap sys.stderr
        print(line, file=out, flush=True)


class LogTimes(logging.Formatter):
    """Log lines whose time is ISO 8601 to the millisecond with its UTC offset
    (``2026-12-05T01:53:49.181+00:00``): logging's default has neither the ``T`` nor the offset, so the
    lines of replicas in other time zones, or read after a change of zone, could not be put in order."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")


#: File descriptors the server holds beside its connections: the model's files, the event loop's own,
#: pipes, the listening sockets, log files.
OPEN_FILES_RESERVE = 64


def raise_open_files_limit(max_connections: int) -> str | None:
    """Raise this process's soft limit on open files (``ulimit -n``) to its hard limit: each connection
    holds a descriptor, and so does each handshake under way, and a soft limit of 1,024 (a common
    default, far below the hard one) is reached before ``--max-connections`` (1,000) plus the rest.
    Past the limit accepts fail, and new connections wait in the kernel's queue. Returns one warning
    line when even the limit now in force leaves fewer than ``max_connections + OPEN_FILES_RESERVE``,
    else None."""
    try:
        import resource
    except ImportError:  # not a Unix: nothing to raise
        return None
    needed = max_connections + OPEN_FILES_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # (a hard limit above the kernel's nr_open)
            pass
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    return (f"warning: this process may open {soft} files (ulimit -n), and --max-connections {max_connections} "
            f"needs about {needed}: raise the limit (ulimit -n, or the container's nofile) or lower "
            "--max-connections; past it, new connections wait in the kernel's queue until descriptors free up")
