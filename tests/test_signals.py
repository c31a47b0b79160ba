"""The shutdown signals' verdicts (protocol.md §10), with a fake clock: fillmask_server/signals.py.
tests/test_process.py sends real signals to a real server."""

from __future__ import annotations

import signal

from fillmask_server.signals import SAME_SIGNAL_S, SignalGate, Verdict, drain_delay

TERM, INT, HUP = signal.SIGTERM, signal.SIGINT, signal.SIGHUP


def test_the_first_signal_drains_and_a_twin_of_it_changes_nothing() -> None:
    """GNU timeout signals the server and then its process group: one SIGTERM, delivered twice
    microseconds apart. A newcomer's ``timeout 90 ws_server.py`` lost 244 of 256 accepted requests,
    because the twin was taken for a second signal and stopped the drain."""
    gate = SignalGate()
    assert gate.take(TERM, 100.0) is Verdict.DRAIN
    assert gate.take(TERM, 100.0) is Verdict.TWIN
    assert gate.take(TERM, 100.0 + SAME_SIGNAL_S * 0.9) is Verdict.TWIN
    assert gate.take(TERM, 100.0 + SAME_SIGNAL_S) is Verdict.STOP  # a person's second Ctrl-C, or a script's


def test_a_signal_of_another_kind_stops_however_soon() -> None:
    """Nothing delivers one signal as another: SIGINT right behind SIGTERM is meant (an adversarial run
    found it once taken for the first)."""
    for first, second in ((TERM, INT), (INT, TERM), (HUP, TERM)):
        gate = SignalGate()
        assert gate.take(first, 5.0) is Verdict.DRAIN
        assert gate.take(second, 5.0) is Verdict.STOP


def test_during_a_drain_after_the_model_thread_stopped_the_first_signal_stops() -> None:
    gate = SignalGate()
    gate.draining_without_signal()
    assert gate.take(TERM, 1.0) is Verdict.STOP


def test_only_sigterm_waits_the_drain_delay_first() -> None:
    """An orchestrator's SIGTERM gives its balancer ``--drain-delay`` to see ``/readyz`` at 503; a
    person's Ctrl-C or a closed terminal drains at once (tests/test_process.py times both live)."""
    assert drain_delay(TERM, 4.0) == 4.0
    assert drain_delay(INT, 4.0) == 0.0 and drain_delay(HUP, 4.0) == 0.0


def test_once_the_drain_closed_every_connection_a_signal_only_hurries_the_exit() -> None:
    """A spec trial: a second SIGTERM while the engine's threads stopped, after every connection had
    been answered and closed 1001, exited 130 ("stopped at a second signal during the drain"), where
    §10 says a signal after the drain only hurries the exit, with its status."""
    gate = SignalGate()
    assert gate.take(TERM, 1.0) is Verdict.DRAIN
    assert gate.take(INT, 2.0) is Verdict.STOP  # during the drain
    gate.drained()
    assert gate.take(TERM, 3.0) is Verdict.EXIT and gate.take(INT, 3.0) is Verdict.EXIT
    fault = SignalGate()
    fault.draining_without_signal()
    fault.drained()
    assert fault.take(TERM, 1.0) is Verdict.EXIT  # (the status is the drain's: 1 after a fault)
