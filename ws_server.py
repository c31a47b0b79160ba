"""Entry point: ``python ws_server.py [options]`` (or the ``fillmask-server`` console script).

The whole life of the server, in order:
1. read the configuration (flags over environment over defaults; ``--help`` lists them);
2. check what needs no torch (the port is free, ``--model`` names a model), raise the open-files limit
   (a warning line if it stays below what ``--max-connections`` needs), then load the model once,
   saying on stderr what it loads and each stage that takes a second or more; or exit 1 with one line
   saying why; calibrate the engine to this machine (``calibration.py``: torch threads, the cost model,
   a reduced dtype's speed), with its log lines, and a warning when a reduced dtype is slower;
3. start the engine thread and listen for WebSocket and HTTP on one port;
4. on SIGINT/SIGTERM/SIGHUP, drain (protocol.md §10: SIGTERM first waits ``--drain-delay`` with
   ``/readyz`` at 503) and exit 0; a second signal stops at once (exit 130), but not the first one
   delivered twice (``signals.SignalGate``). A signal before the server is ready stops it at once
   (exit 128 + the signal's number);
5. if the model thread stops by a fault (§6 ``engine_stopped``), drain at once and exit 1, so that a
   supervisor (Kubernetes, systemd, ``docker --restart``) starts a fresh server; a fault during a
   signal's drain also ends in exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator

try:
    from fillmask_server.allocator import freeze_start_up_heap
    from fillmask_server.calibration import Calibration, calibrate
    from fillmask_server.config import (
        Config,
        load_config,
        named_source,
        overridden_variables,
        setting_warnings,
        unknown_variables,
    )
    from fillmask_server.diagnosis import ModelLoadError
    from fillmask_server.loading import load_model, resolve_device
    from fillmask_server.model import FillMaskModel
    from fillmask_server.server import FillMaskServer, quiet_accept_failures
    from fillmask_server.signals import SignalGate, Verdict
    from fillmask_server.startup import (
        LOG_FORMAT,
        LogTimes,
        StartupLines,
        check_can_listen,
        listen_problem,
        raise_open_files_limit,
    )
except ModuleNotFoundError as missing:  # outside the project's environment: one line, not a traceback
    if (missing.name or "").partition(".")[0] not in ("fillmask_client", "websockets", "orjson", "prometheus_client"):
        raise  # (not a package pyproject.toml installs before torch: that traceback is for developers)
    sys.exit(f"error: {missing}: run the server in its environment (.venv/bin/python ws_server.py, after "
             "bash scripts/setup.sh), or install both packages first (pip install -e ./clients/python -e .)")

log = logging.getLogger("fillmask_server")

#: The exit status after the model thread stopped by a fault (the drain's is 0).
EXIT_ENGINE_STOPPED = 1


class CannotListen(Exception):
    """``host:port`` cannot be listened on: the one line that says why (``listen_problem``). Only the
    check before the model loads and the listen itself raise it: any other ``OSError`` is not about the
    port, and must not be reported as if it were."""


async def serve_until_signalled(config: Config, handled: list[signal.Signals]) -> int:
    """Load, calibrate, serve until one of the ``handled`` signals or the engine's fault, drain; the exit
    status."""
    with _listening(config):
        check_can_listen(config.host, config.port)
    quiet_accept_failures(asyncio.get_running_loop())
    too_few_files = raise_open_files_limit(config.max_connections)
    if too_few_files:
        print(too_few_files, file=sys.stderr, flush=True)
    model, calibration = _load_and_calibrate(config)
    freeze_start_up_heap()  # full collections while serving skip what start-up made (allocator.py)
    server = FillMaskServer(config, model, calibration)
    with _listening(config):
        await server.start()
    gate = SignalGate()
    received = _drain_on_signals(server, handled, gate)
    # Only now: whoever waits for this line may signal at once, and that signal must drain.
    _say_ready(f"ready: {server.url} (demo page {server.http_url}/, health {server.http_url}/healthz)")
    stopped = asyncio.ensure_future(server.engine_stopped())
    await asyncio.wait({received, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if received.done():
        stopped.cancel()
        signum = received.result()
        log.info("%s received: draining (a second signal stops at once)", signal.Signals(signum).name)
        # An orchestrator stops a replica with SIGTERM: give its load balancer time to notice /readyz
        # first. A person's Ctrl-C (SIGINT), or a closed terminal (SIGHUP), wants the drain now.
        delay, status = (config.drain_delay if signum == signal.SIGTERM else 0.0), 0
    else:
        log.critical("the model thread stopped: draining, then exiting with status %d so that a supervisor "
                     "starts a fresh server", EXIT_ENGINE_STOPPED)
        delay, status = 0.0, EXIT_ENGINE_STOPPED
        gate.draining_without_signal()
    await server.drain(delay=delay)
    if status == 0 and server.engine.faulted:  # the model thread stopped during a signal's drain
        log.critical("the model thread stopped during the drain: exiting with status %d", EXIT_ENGINE_STOPPED)
        status = EXIT_ENGINE_STOPPED
    for signum in handled:  # drained: a signal from now on only hurries the exit, with the drain's status
        # One call, so that there is no moment without a handler: asyncio's remove_signal_handler set
        # SIG_DFL before this replaced it, and a SIGTERM in between ended the process with -15 (the
        # fresh clone's CI run caught it once, in the test that signals in a tight loop).
        signal.signal(signum, lambda *_: os._exit(status))
    return status


def _load_and_calibrate(config: Config) -> tuple[FillMaskModel, Calibration]:
    """The model, loaded and checked, and what the calibration measured with it; their lines on stderr."""
    lines = StartupLines(quiet=config.log_level in ("warning", "error"))
    model = load_model(config.model, config.device, config.dtype, config.torch_threads, config.forward, lines,
                       projection=config.projection)
    if config.calibration_s > 0:
        lines("calibration of threads and the cost model")
    device = resolve_device(config.device)
    parts = config.forward_parts
    if parts > 1 and model.device.type != "cpu":
        print(f"warning: --forward-parts {parts} applies on a CPU; on {model.device} each batch runs as one pass",
              file=sys.stderr, flush=True)
        parts = 1
    calibration = calibrate(model, config.calibration_s, config.torch_threads, config.model, device,
                            config.forward, parts, quiet_lone=config.quiet_lone != "off")
    lines.done()
    if config.calibration_s > 0:
        log.info("%s", calibration.line())
    if calibration.warning:
        print(calibration.warning, file=sys.stderr, flush=True)
    return model, calibration


def _drain_on_signals(server: FillMaskServer, handled: list[signal.Signals], gate: SignalGate) -> asyncio.Future[int]:
    """Handle the ``handled`` signals from now on: the first that ``gate`` says drains sets the future
    returned (its signal's number); one it says stops leaves at once (``_stop_now``)."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()

    def on_signal(signum: int) -> None:
        verdict = gate.take(signum, loop.time())
        if verdict is Verdict.DRAIN:
            received.set_result(signum)
        elif verdict is Verdict.STOP:
            _stop_now(server)

    def hand_over(signum: int, frame: object) -> None:
        with contextlib.suppress(RuntimeError):  # (a loop already closed: the process is leaving)
            loop.call_soon_threadsafe(on_signal, signum)

    # Not loop.add_signal_handler: its removal puts SIG_DFL back for a moment (``serve_until_signalled``'s
    # end). Python runs the handler on the main thread, which the kernel interrupts first; a signal another
    # thread took is seen when the loop next wakes, at the latest at the engine watch's next look
    # (ENGINE_WATCH_S).
    for signum in handled:
        signal.signal(signum, hand_over)
    return received


@contextlib.contextmanager
def _listening(config: Config) -> Iterator[None]:
    """An ``OSError`` inside is ``host:port`` that cannot be listened on: ``CannotListen``, saying why."""
    try:
        yield
    except OSError as exc:  # the port is taken, the host does not resolve, the address is not this machine's
        raise CannotListen(listen_problem(config.host, config.port, exc)) from exc


def _say_ready(line: str) -> None:
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


def _signals_handled() -> list[signal.Signals]:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal), unless SIGHUP was ignored when the process
    started (``nohup``): the server then goes on after its terminal closes, as asked."""
    hangup = getattr(signal, "SIGHUP", None)
    ignored = hangup is None or signal.getsignal(hangup) == signal.SIG_IGN
    return [signal.SIGINT, signal.SIGTERM] + ([] if ignored else [hangup])


def _stop_now(server: FillMaskServer) -> None:
    """A second signal during the drain: leave at once, without waiting for accepted work."""
    answered = server.settled() and not any(conn.backlogged for conn in server.connections)
    _last_words("stopped at a second signal during the drain; every accepted request had been answered"
                if answered else "error: stopped before the drain finished; accepted requests were not all answered")
    os._exit(130)


def _last_words(line: str) -> None:
    """One line on stderr before ``os._exit``, if stderr can take it: after SIGHUP its terminal may be
    gone, and a failed write must not keep the process from leaving."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    for line in unknown_variables():  # first: a misspelt variable may be why another setting is refused
        print(line, file=sys.stderr, flush=True)
    config = load_config(argv)
    warned = [f"warning: {named_source(line.removeprefix('warning: '), argv)}" for line in setting_warnings(config)]
    for line in [*overridden_variables(argv), *warned]:  # (a setting a variable set names the variable)
        print(line, file=sys.stderr, flush=True)
    to_stderr = logging.StreamHandler()
    to_stderr.setFormatter(LogTimes(LOG_FORMAT))
    logging.basicConfig(level=config.log_level.upper(), handlers=[to_stderr])
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.getLogger().level))
    handled = _signals_handled()
    for signum in handled:  # SIGTERM: as PID 1 (a container) it is otherwise ignored
        signal.signal(signum, _interrupted_while_starting)
    try:
        return asyncio.run(serve_until_signalled(config, handled))
    except ModelLoadError as exc:
        print(f"error: {named_source(str(exc), argv)}", file=sys.stderr)
        return 1
    except CannotListen as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:  # leaving: a late signal must not make the exit status its own. (Ignored, not handled:
        # Python's finalization puts SIG_DFL back where a Python handler was.)
        for signum in handled:
            signal.signal(signum, signal.SIG_IGN)


def _interrupted_while_starting(signum: int, frame: object) -> None:
    """Ctrl-C, SIGTERM or SIGHUP before the server is ready: leave at once, with 128 + the signal's
    number. The model loads on its own thread, inside native code, and asyncio's own handler would
    only act once it had loaded. Serving replaces this handler with the drain's."""
    what = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}.get(signum, "hung up")
    _last_words(f"error: {what} before the server was ready")
    os._exit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
