"""The process around the server: its signal handlers, its ``ready:`` line, its last words.

What a signal *means* is ``signals.py``'s (pure); this module installs the handlers that ask it, in
four phases of the process's life (``ws_server.py`` calls them in this order):

1. starting (``stop_while_starting``): a signal leaves at once with 128 + its number, since the model
   loads inside native code and no event loop would see the signal before it had loaded. Installed
   before the program's imports (``ws_server.py`` run as a script, or ``console_main`` for the
   ``fillmask-server`` command), so that only the interpreter's own start precedes it;
2. serving (``drain_on_signals``): the first signal starts the drain, a second one during it stops at
   once (``stop_now``, exit 130), the first delivered twice does nothing, and one after the drain
   closed every connection exits with the drain's status (``drained_status``);
3. drained (``exit_on_signal``): a signal only hurries the exit, with the drain's status;
4. leaving (``ignore_signals``): a late signal must not make the exit status its own.

Invariant: from phase 1 on, each handled signal always has a handler of this module, or from phase 4
``SIG_IGN`` (each phase replaces the last one's with a single ``signal.signal`` call, never through
``SIG_DFL``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from .signals import SignalGate, Verdict

if TYPE_CHECKING:
    from .server import FillMaskServer

log = logging.getLogger("fillmask_server")

#: The exit status after the model thread stopped by a fault (the drain's is 0).
EXIT_ENGINE_STOPPED = 1
#: The exit status of a second signal during the drain.
EXIT_SECOND_SIGNAL = 130


def signals_handled() -> list[signal.Signals]:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal), unless SIGHUP was ignored when the process
    started (``nohup``): the server then goes on after its terminal closes, as asked."""
    handled = [signal.SIGINT, signal.SIGTERM]
    hangup = getattr(signal, "SIGHUP", None)  # (not on Windows)
    if hangup is not None and signal.getsignal(hangup) != signal.SIG_IGN:
        handled.append(hangup)
    return handled


def stop_while_starting(handled: list[signal.Signals]) -> None:
    """Phase 1: each of ``handled`` leaves at once (SIGTERM included: as PID 1, in a container, it is
    otherwise ignored)."""
    for signum in handled:
        signal.signal(signum, _interrupted_while_starting)


def console_main() -> int:
    """The ``fillmask-server`` command: phase 1's handlers, then ``ws_server``'s imports and ``main``
    (a console script imports its module before it calls anything in it)."""
    stop_while_starting(signals_handled())
    import ws_server  # (after the handlers, on purpose)

    return ws_server.main()


def _interrupted_while_starting(signum: int, frame: object) -> None:
    what = {int(signal.SIGINT): "interrupted", int(signal.SIGTERM): "terminated"}.get(signum, "hung up")
    last_words(f"error: {what} before the server was ready")
    os._exit(128 + signum)


def drain_on_signals(server: FillMaskServer, handled: list[signal.Signals], gate: SignalGate) -> asyncio.Future[int]:
    """Phase 2: the first of ``handled`` that ``gate`` says drains sets the future returned (its
    signal's number); one it says stops leaves at once (``stop_now``), and so does one after the drain
    closed every connection, with the drain's status (``drained_status``)."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()

    def on_signal(signum: int) -> None:
        verdict = gate.take(signum, loop.time())
        if verdict is Verdict.DRAIN:
            received.set_result(signum)
        elif verdict is Verdict.STOP:
            stop_now(server)
        elif verdict is Verdict.EXIT:
            status = drained_status(server)
            if status:
                last_words(f"exiting with status {status}: the model thread stopped")
            os._exit(status)

    def hand_over(signum: int, frame: object) -> None:
        with contextlib.suppress(RuntimeError):  # (a loop already closed: the process is leaving)
            loop.call_soon_threadsafe(on_signal, signum)

    # Not loop.add_signal_handler: its removal puts SIG_DFL back for a moment (phase 3). Python runs the
    # handler on the main thread, which the kernel interrupts first; a signal another thread took is seen
    # when the loop next wakes, at the latest at the engine watch's next look (ENGINE_WATCH_S).
    for signum in handled:
        signal.signal(signum, hand_over)
    return received


def drained_status(server: FillMaskServer) -> int:
    """The exit status of a drain that ended: 0, or ``EXIT_ENGINE_STOPPED`` when the model thread stopped."""
    return EXIT_ENGINE_STOPPED if server.engine.faulted else 0


def stop_now(server: FillMaskServer) -> None:
    """A second signal during the drain: leave at once, without waiting for accepted work."""
    answered = server.settled() and not any(conn.backlogged for conn in server.connections)
    last_words("stopped at a second signal during the drain; every accepted request had been answered"
               if answered else "error: stopped before the drain finished; accepted requests were not all answered")
    os._exit(EXIT_SECOND_SIGNAL)


def exit_on_signal(handled: list[signal.Signals], status: int) -> None:
    """Phase 3, once drained: each of ``handled`` leaves at once with ``status``. One call per signal,
    so that there is no moment without a handler: asyncio's ``remove_signal_handler`` set SIG_DFL before
    its replacement, and a SIGTERM in between ended the process with -15 (the fresh clone's CI run
    caught it once, in the test that signals in a tight loop)."""
    for signum in handled:
        signal.signal(signum, lambda *_: os._exit(status))


def ignore_signals(handled: list[signal.Signals]) -> None:
    """Phase 4, leaving. Ignored rather than handled: Python's finalization puts SIG_DFL back where a
    Python handler was."""
    for signum in handled:
        signal.signal(signum, signal.SIG_IGN)


def say_ready(line: str) -> None:
    """The ready line on stdout. A stdout nobody reads any more (a pipe whose reader has gone, as in
    ``ws_server.py | true``) must not stop a server that is serving: the line is then logged, and
    stdout goes to /dev/null, so that no later write (the interpreter's own flush at exit) fails."""
    try:
        print(line, flush=True)
    except OSError as exc:
        log.warning("%s (stdout is gone: %s; serving on)", line, exc.strerror or exc)
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)


def last_words(line: str) -> None:
    """One line on stderr before ``os._exit``, if stderr can take it: after SIGHUP its terminal may be
    gone, and a failed write must not keep the process from leaving."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())
