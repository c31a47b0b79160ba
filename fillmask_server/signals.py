"""What a shutdown signal means when it comes (protocol.md §10): no I/O, the caller's clock.

The first SIGINT, SIGTERM or SIGHUP starts the drain. A second one during the drain stops the process
at once, except a signal of the first one's kind within ``SAME_SIGNAL_S`` of it: that is the first
delivered twice (GNU ``timeout`` signals the process and then its process group, microseconds
apart), which a person pressing Ctrl-C twice never is. During a drain that the model thread's fault
started, the first signal already stops. Once the drain has closed every connection (``drained``), a
signal only hurries the exit, with the drain's status: what is left is the engine's threads stopping,
and nothing a client sent is at stake.

The drain's first wait (``drain_delay``): SIGTERM is how an orchestrator stops a replica, and its load
balancer needs ``--drain-delay`` to notice ``/readyz`` at 503; a person's Ctrl-C (SIGINT) or a closed
terminal (SIGHUP) wants the drain now.

Invariant: ``take`` answers DRAIN at most once.
"""

from __future__ import annotations

import enum
import signal

SAME_SIGNAL_S = 0.25  # a signal of the first one's kind this soon after it is the first delivered twice


class Verdict(enum.Enum):
    DRAIN = "drain"  # the first signal: drain
    TWIN = "twin"  # the first one again, delivered twice: nothing to do
    STOP = "stop"  # a second signal during the drain: stop at once
    EXIT = "exit"  # a signal after the drain closed every connection: leave now, with the drain's status


class SignalGate:
    """The verdict on each signal, in the order they are taken (see the module docstring)."""

    def __init__(self, same_signal_s: float = SAME_SIGNAL_S) -> None:
        self._same_signal_s = same_signal_s
        self._first: tuple[int, float] | None = None  # the first signal's number and when it was taken
        self._draining = False  # a drain runs that no signal started (the model thread's fault)
        self._drained = False  # the drain closed every connection

    def draining_without_signal(self) -> None:
        """The model thread stopped and the drain began: from now on every signal stops."""
        self._draining = True

    def drained(self) -> None:
        """The drain closed every connection (and the listener): from now on every signal exits."""
        self._drained = True

    def take(self, signum: int, now: float) -> Verdict:
        if self._drained:
            return Verdict.EXIT
        if self._first is None:
            if self._draining:
                return Verdict.STOP
            self._first = (signum, now)
            return Verdict.DRAIN
        first, at = self._first
        if signum == first and now - at < self._same_signal_s:
            return Verdict.TWIN
        return Verdict.STOP


def drain_delay(signum: int, configured_s: float) -> float:
    """Seconds the drain that ``signum`` started waits first, with ``/readyz`` at 503 (module docstring)."""
    return configured_s if signum == signal.SIGTERM else 0.0
