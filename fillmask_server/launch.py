"""What comes before a server listens: the model loaded, the machine measured, the server built.

``ws_server.py`` runs ``load_and_calibrate`` with its start-up lines on stderr; a program that embeds
the server calls ``load_server`` (blocking: from async code, ``await asyncio.to_thread(load_server,
config)``), then serves with ``async with server:`` (``FillMaskServer.start``, then ``drain``). Both
read every setting from one ``Config``, so the model a server reports is the model it runs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from .calibration import Calibration, calibrate
from .config import Config, checked
from .diagnosis import WORKS_WITH, check_libraries
from .loading import load_model, resolve_device
from .model import FillMaskModel
from .server import FillMaskServer
from .startup import StartupLines

log = logging.getLogger("fillmask_server")


def load_server(config: Config) -> FillMaskServer:
    """A server for ``config``, not yet started: ``config`` checked (``ValueError``, one line), its
    model loaded (``ModelLoadError``, one line) and calibrated for ``config.calibration_s`` seconds.
    Prints nothing: its warnings are logged (logger ``fillmask_server``). Blocks for seconds to minutes.
    Loading sets process-wide state, as ``load_model``'s docstring lists."""
    checked(config)  # (before loading: a wrong setting fails at once)
    model, calibration = load_and_calibrate(config, StartupLines(quiet=True), warn=_to_log)
    return FillMaskServer(config, model, calibration)


def load_and_calibrate(config: Config, lines: StartupLines, warn: Callable[[str], None] | None = None
                       ) -> tuple[FillMaskModel, Calibration]:
    """The model, loaded and checked, and what the calibration measured with it; the stages on
    ``lines``, the calibration's line logged, each warning to ``warn`` (by default on stderr). First,
    ``ModelLoadError`` if a library is not a release the server works with (``WORKS_WITH``)."""
    warn = warn or _to_stderr
    check_libraries(*WORKS_WITH)  # (the server's: load_model checks only what loading needs)
    model = load_model(config.model, config.device, config.dtype, config.torch_threads, config.forward, lines,
                       projection=config.projection)
    if config.calibration_s > 0:
        lines("calibration of threads and the cost model")
    device = resolve_device(config.device)
    parts = config.forward_parts
    if parts > 1 and model.device.type != "cpu":
        warn(f"warning: --forward-parts {parts} applies on a CPU; on {model.device} each batch runs as one pass")
        parts = 1
    calibration = calibrate(model, config.calibration_s, config.torch_threads, config.model, device,
                            config.forward, parts, quiet_lone=config.quiet_lone != "off")
    lines.done()
    if config.calibration_s > 0:
        log.info("%s", calibration.line())
    if calibration.warning:
        warn(calibration.warning)
    return model, calibration


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _to_log(line: str) -> None:
    log.warning("%s", line.removeprefix("warning: "))  # (the record's level says it)
