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
   delivered twice (``signals.py`` decides, ``lifecycle.py`` installs the handlers). A signal before
   the server is ready stops it at once (exit 128 + the signal's number);
5. if the model thread stops by a fault (§6 ``engine_stopped``), drain at once and exit 1, so that a
   supervisor (Kubernetes, systemd, ``docker --restart``) starts a fresh server; a fault during a
   signal's drain also ends in exit 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

from fillmask_server.lifecycle import signals_handled, stop_while_starting

if __name__ == "__main__":  # before the imports below (a tenth of a second): a signal leaves as §10 says
    stop_while_starting(signals_handled())  # (the console script's ``lifecycle.console_main`` does the same)

try:
    from fillmask_server.allocator import freeze_start_up_heap
    from fillmask_server.config import (
        Config,
        load_config,
        named_source,
        overridden_variables,
        setting_warnings,
        unknown_variables,
    )
    from fillmask_server.diagnosis import ModelLoadError
    from fillmask_server.launch import load_and_calibrate
    from fillmask_server.lifecycle import (
        EXIT_ENGINE_STOPPED,
        drain_on_signals,
        drained_status,
        exit_on_signal,
        ignore_signals,
        say_ready,
    )
    from fillmask_server.server import FillMaskServer, quiet_accept_failures
    from fillmask_server.signals import SignalGate, drain_delay
    from fillmask_server.startup import (
        LOG_FORMAT,
        CannotListen,
        LogTimes,
        StartupLines,
        check_can_listen,
        listening,
        raise_open_files_limit,
    )
except ModuleNotFoundError as missing:  # outside the project's environment: one line, not a traceback
    if (missing.name or "").partition(".")[0] not in ("fillmask_client", "websockets", "orjson", "prometheus_client"):
        raise  # (not a package pyproject.toml installs before torch: that traceback is for developers)
    sys.exit(f"error: {missing}: run the server in its environment (.venv/bin/python ws_server.py, after "
             "bash scripts/setup.sh), or install both packages first (pip install -e ./clients/python -e .)")

log = logging.getLogger("fillmask_server")


def main(argv: list[str] | None = None) -> int:
    """Configure, log, then serve until a signal or a fault (``serve_until_signalled``); the exit status."""
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
    handled = signals_handled()
    stop_while_starting(handled)
    try:
        return asyncio.run(serve_until_signalled(config, handled))
    except ModelLoadError as exc:
        print(f"error: {named_source(str(exc), argv)}", file=sys.stderr)
        return 1
    except CannotListen as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        ignore_signals(handled)


async def serve_until_signalled(config: Config, handled: list[signal.Signals]) -> int:
    """Load, calibrate, serve until one of the ``handled`` signals or the engine's fault, drain; the exit
    status."""
    with listening(config.host, config.port):
        check_can_listen(config.host, config.port)
    quiet_accept_failures(asyncio.get_running_loop())
    too_few_files = raise_open_files_limit(config.max_connections)
    if too_few_files:
        print(too_few_files, file=sys.stderr, flush=True)
    model, calibration = load_and_calibrate(config, StartupLines(quiet=config.log_level in ("warning", "error")))
    freeze_start_up_heap()  # full collections while serving skip what start-up made (allocator.py)
    server = FillMaskServer(config, model, calibration)
    with listening(config.host, config.port):
        await server.start()
    gate = SignalGate()
    received = drain_on_signals(server, handled, gate)
    # Only now: whoever waits for this line may signal at once, and that signal must drain.
    say_ready(f"ready: {server.url} (demo page {server.http_url}/, health {server.http_url}/healthz)")
    stopped = asyncio.ensure_future(server.engine_stopped())
    either: set[asyncio.Future[Any]] = {received, stopped}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if received.done():
        stopped.cancel()
        signum = received.result()
        log.info("%s received: draining (a second signal stops at once)", signal.Signals(signum).name)
        delay, status = drain_delay(signum, config.drain_delay), 0
    else:
        log.critical("the model thread stopped: draining, then exiting with status %d so that a supervisor "
                     "starts a fresh server", EXIT_ENGINE_STOPPED)
        delay, status = 0.0, EXIT_ENGINE_STOPPED
        gate.draining_without_signal()
    await server.drain(delay=delay, on_closed=gate.drained)
    if (drained := drained_status(server)) != status:  # the model thread stopped during a signal's drain
        status = drained
        log.critical("the model thread stopped during the drain: exiting with status %d", status)
    exit_on_signal(handled, status)  # drained: a signal from now on only hurries the exit
    return status


if __name__ == "__main__":
    sys.exit(main())
