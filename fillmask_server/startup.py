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

Also the start-up's other lines and checks: the open-files limit raised (``raise_open_files_limit``),
the port checked before the model loads (``check_can_listen``, and ``listen_problem``'s one line when
it cannot be listened on, raised as ``CannotListen`` inside ``listening``), and the ``serving`` line (``serving_line``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import TextIO

from .access import WILDCARD_HOSTS

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


def serving_line(model: str, host: str, port: int, url: str, token: bool) -> str:
    """The start-up line after ``serving``: the model, where it listens, and who may use it. A server
    listening on every interface says so (``url`` is then the loopback one, for this machine), and
    without a token it says the port is open to the network."""
    if host in WILDCARD_HOSTS:
        # (asyncio makes an IPv6 listener IPv6-only: "::" takes no IPv4 client; "" listens on both.)
        family = {"0.0.0.0": "every IPv4 interface", "::": "every IPv6 interface (no IPv4)"}.get(
            host, "every interface, IPv4 and IPv6")
        where = f"{family}, port {port} (here: {url})"
        open_to = f"no token: anyone who reaches this machine's port {port} may use it; set --token"
    else:
        where, open_to = url, "no token: whoever reaches the port may use it"
    return f"{model} on {where} ({'clients must present the token' if token else open_to})"


class CannotListen(Exception):
    """``host:port`` cannot be listened on: the one line that says why (``listen_problem``). Only the
    check before the model loads and the listen itself raise it (inside ``listening``): any other
    ``OSError`` is not about the port, and must not be reported as if it were."""


@contextlib.contextmanager
def listening(host: str, port: int) -> Iterator[None]:
    """An ``OSError`` inside is ``host:port`` that cannot be listened on: ``CannotListen``, saying why."""
    try:
        yield
    except OSError as exc:  # the port is taken, the host does not resolve, the address is not this machine's
        raise CannotListen(listen_problem(host, port, exc)) from exc


def check_can_listen(host: str, port: int) -> None:
    """Raise ``OSError`` now if ``host:port`` cannot be bound, so that a port already in use, a host that
    does not resolve or an address this machine does not have is reported before the model loads (which
    may take minutes), not after. Port 0 binds a free port of each address, which tests the address."""
    for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server does
            probe.bind(address)


def listen_problem(host: str, port: int, exc: OSError) -> str:
    """The one line that says why ``host:port`` cannot be listened on, naming the flag to change: the
    host's for a name that does not resolve or an address no interface has, the port's otherwise."""
    where = f"cannot listen on {host or '(every interface)'}:{port}"
    hosts = ("choose another --host (127.0.0.1: this machine only; 0.0.0.0: every IPv4 interface; '': every "
             "interface, IPv4 and IPv6)")
    if isinstance(exc, socket.gaierror):
        return f"{where}: the host name does not resolve ({exc.strerror or exc}); {hosts}"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: no interface of this machine has that address; {hosts}"
    if exc.errno == errno.EACCES:
        return f"{where}: ports below 1024 need privileges; choose a --port of 1024 or more (0 picks a free one)"
    if exc.errno == errno.EADDRINUSE:
        return (f"{where}: the port is in use; is another server running there? choose another --port "
                "(0 picks a free one)")
    return f"{where}: {exc.strerror or exc}; check --host and --port (0 picks a free port)"
