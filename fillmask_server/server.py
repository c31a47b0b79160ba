"""The websockets shell: sockets in and out, wired to sessions and the engine (HTTP routes: ``http``).

Everything here runs on the asyncio event loop and stays cheap. Per connection there is a
``Connection`` (the socket and its outbox, ``connection.py``) and a ``Session`` (the protocol's rules,
``session.py``); this module only moves things between them:

- each incoming message goes to ``Session.receive``, and its answers to the outbox;
- the engine's outcomes arrive from its stage threads in one ``call_soon_threadsafe`` per batch; each
  goes to its job's session (``Session.on_outcome``), and the answer to that session's outbox;
- one timer per connection wakes ``Session.expire`` at its next request deadline;
- the watchdog closes a client that takes no bytes at all for ``--send-timeout`` while it has
  answers waiting to be sent, whether its outbox is over ``--max-send-buffer-bytes`` or within it
  (protocol.md §12); a client that reads, however slowly, is kept;
- ``drain`` carries out protocol.md §10.

No model code runs on the loop: admission is ``Engine.submit`` (a lock and an append).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import os
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.protocol import State

from fillmask_client.wire import CLOSE_GOING_AWAY

from . import __version__, allocator
from .access import WILDCARD_HOSTS, OriginPolicy, tls_context
from .batching import DEFAULT_BATCH_ROWS, DEFAULT_BATCH_TOKENS, BatchPolicy
from .calibration import Calibration, uncalibrated
from .config import Config, checked
from .connection import Connection, UnsentBytes
from .core import AnswerMemory
from .costmodel import CostModel
from .engine import Engine
from .front_connection import FrontConnection
from .http import LOG_INTERVAL_S, FrontState, HttpFront, LogThrottle, on_the_loop
from .jobs import Outcome, Result
from .metrics import LiveValues, Metrics
from .model import FillMaskModel
from .protocol import SLOW_READER_REASON, Limits, encode_going_away, encode_hello, encode_stats
from .session import POLICY_VIOLATION, SHUTTING_DOWN_RETRY_MS, Answer, DoubleAnswer, Session
from .startup import serving_line
from .stats import LiveStats
from .tuning import ThreadTuner, switch_interval_s

log = logging.getLogger(__name__)

SERVER_NAME = f"fillmask-server/{__version__}"
GOING_AWAY = CLOSE_GOING_AWAY
RECONNECT_WITHIN_MS = 1000  # going_away's reconnect window: clients spread their reconnects over it (§10)
RUNNING_BATCH_GRACE_S = 60.0  # after the drain timeout, how long a running batch may still take
#: The longest a drain waits for a client's pong before closing its connection (``close_once_read``): the
#: pong comes after every request the client sent before it read ``going_away``, so those are answered
#: ``shutting_down`` instead of lost to the close. A client's round trip, well below it.
NOTICE_BARRIER_S = 1.0
TRIM_AFTER_S = 1.0  # after a connection closes, when its answers' memory is given back to the system
ENGINE_WATCH_S = 0.25  # how often ``engine_stopped`` looks whether the model thread still runs
WATCHDOG_LOOKS = 10  # the watchdog looks at a stalled socket this many times per --send-timeout
#: Each accepted socket's kernel send buffer (Linux allocates twice this). Left to itself the kernel grows
#: it up to ``net.ipv4.tcp_wmem``'s maximum (4 MiB here, 32 MiB on some hosts) for a client that stops
#: reading: answers then left the server's outbox as "sent", the connection never looked congested, was
#: never closed (§12), and its queued requests stayed queued. A fixed size keeps what a client that does
#: not read can hold in the kernel small, and costs nothing here: answers are a few kilobytes, and a
#: socket that takes this much per round trip serves thousands of them a second.
KERNEL_SEND_BUFFER_BYTES = 128 * 1024
#: The listen backlog is ``--max-connections``, at least this: when a replica drains, its clients
#: (up to ``--max-connections``) reconnect to the others within ``reconnect_within_ms`` (§10), and
#: asyncio's default of 100 left the rest of a burst waiting a second for their SYN's retransmit.
#: The kernel caps it at ``net.core.somaxconn``, and ``listen`` takes a C int: the backlog is at most
#: ``MAX_LISTEN_BACKLOG`` (a larger ``--max-connections`` overflowed it, a traceback at start-up).
MIN_LISTEN_BACKLOG = 128
MAX_LISTEN_BACKLOG = 65535


@dataclass
class Readiness:
    """Where the server is in its life (protocol.md §9, §10); each flag only ever turns on.

    ``unready``: a drain has begun, ``/readyz`` answers 503 so that load balancers stop sending new
    connections, but everything is still served (the ``--drain-delay``). ``draining``: new handshakes
    and requests are refused and open connections have been told ``going_away``.
    """

    loaded: bool = False
    unready: bool = False
    draining: bool = False


#: asyncio's words when accepting a connection failed for want of a resource (EMFILE, ENFILE,
#: ENOBUFS, ENOMEM): it then stops accepting for a second, and logs a traceback each time.
ACCEPT_FAILED = "socket.accept() out of system resource"
ACCEPT_FAILED_LOG_S = 10.0


def quiet_accept_failures(loop: asyncio.AbstractEventLoop) -> None:
    """Make ``loop`` log a failed accept as one line at most every ``ACCEPT_FAILED_LOG_S`` (with how many
    were left out), without the traceback; anything else goes to the default handler. Out of file
    descriptors, asyncio logged a traceback for every failure, thousands a second. For the process's
    own loop (``ws_server``), not for a program embedding the server, whose loop is its own."""
    throttle = LogThrottle(log, ACCEPT_FAILED_LOG_S, schedule=on_the_loop)

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if str(context.get("message", "")).startswith(ACCEPT_FAILED):
            throttle.warning("accept", "could not accept a connection (%s): out of file descriptors (or "
                             "memory); raise the open-files limit (ulimit -n) or lower --max-connections", exc)
            return
        if isinstance(exc, ValueError) and "_start_serving" in repr(context.get("handle")):
            # asyncio's retry of such an accept, come after the server closed its socket (each failure
            # schedules one, CPython 3.11): nothing is lost, the server is gone.
            log.debug("a retry of a failed accept came after the server closed (%s)", exc)
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class _SwitchInterval:
    """The interpreter's switch interval is the process's, not a server's. The first server to start
    keeps the value it found; when one stops, the latest started of those still serving sets its own
    again, and the last to stop puts back what the first found, whatever the order they stop in."""

    def __init__(self) -> None:
        self._holders: list[FillMaskServer] = []
        self._found = 0.0

    def acquire(self, holder: FillMaskServer) -> None:
        if not self._holders:
            self._found = sys.getswitchinterval()
        self._holders.append(holder)

    def release(self, holder: FillMaskServer) -> None:
        self._holders.remove(holder)
        sys.setswitchinterval(self._holders[-1].switch_interval_s if self._holders else self._found)


_SWITCH_INTERVAL = _SwitchInterval()


class _Phase(enum.Enum):
    NEW = "new"
    STARTING = "starting"  # start() runs
    SERVING = "serving"
    DRAINING = "draining"  # drain() runs, or ran and was cancelled (it may be called again to finish)
    ENDED = "ended"  # drained, or a start() that failed: nothing runs


class FillMaskServer:
    """Wires the protocol, the engine and websockets together. Create, ``await start()``, ``await drain()``;
    or ``async with`` (start, then drain). A server serves once: build a new one to serve again.

    ``config`` is checked here (``ValueError``, one line, as ``--help``'s words name it); the model's
    own settings (``--device``, ``--dtype``, ``--forward``, ``--projection``, ``--calibration-s``) are
    ``load_server``'s, which reads them from the same ``Config``."""

    def __init__(self, config: Config, model: FillMaskModel, calibration: Calibration | None = None) -> None:
        self.config = checked(config)
        self.model = model
        self.calibration = calibration or uncalibrated(config.torch_threads, config.forward_parts)
        self.limits = Limits(
            mask_token=model.mask_token,
            max_text_chars=config.max_text_chars,
            max_masks=config.max_masks,
            top_k_max=min(config.max_top_k, model.vocab_size),
            top_k_default=min(5, config.max_top_k, model.vocab_size),
            max_targets=config.max_targets,
        )
        self.ready = Readiness()
        self.connections: set[Connection] = set()
        self.origins = OriginPolicy.parse(config.allowed_origins)
        self._tls: ssl.SSLContext | None = (
            tls_context(config.certfile, config.keyfile) if config.certfile else None)
        policy = BatchPolicy(config.max_batch_size or DEFAULT_BATCH_ROWS,
                             config.max_batch_tokens or DEFAULT_BATCH_TOKENS, config.max_wait_ms / 1000,
                             config.max_length_ratio,
                             anticipate_s=config.anticipate_ms / 1000, max_batch_s=config.max_batch_ms / 1000,
                             max_missed=config.max_missed_batches, pack_width=model.pack_width,
                             one_length=model.one_length,
                             auto_rows=not config.max_batch_size, auto_tokens=not config.max_batch_tokens)
        if config.max_length_ratio and model.one_length:
            log.warning("--max-length-ratio is not used: this model runs one length a batch (its answers change "
                        "with padding), so the cost model cuts each round by length")
        cost = CostModel(self.calibration.coefficients)
        policy.follow_cost(cost.coefficients)  # automatic caps: from the calibration's fit, once (batching.py)
        if policy.auto_rows or policy.auto_tokens:
            log.info("batch caps %d rows, %d tokens (automatic: %s)", policy.max_batch_size, policy.max_batch_tokens,
                     "from the calibration's cost model" if self.calibration.coefficients is not None
                     else "the defaults, with no calibration to scale them from")
        self.metrics = Metrics(LiveValues(
            queue_depth=lambda: self.engine.queued(),
            open_connections=lambda: len(self.connections),
            engine_busy_seconds=lambda: self.engine.stats.busy_s,
            engine_uptime_seconds=lambda: time.monotonic() - self.engine.started_at,
            engine_alive=lambda: self.engine.alive,
            scores_not_numbers=lambda: self.engine.not_numbers,
        ), engine=model.engine_facts())
        self.stats = LiveStats()
        self.unsent = UnsentBytes()
        # Lines about a connection it closes, each kind.
        self._closing_log = LogThrottle(log, LOG_INTERVAL_S, schedule=on_the_loop)
        memory = AnswerMemory(config.max_send_buffer_bytes, config.max_answer_bytes,
                              unsent=lambda session: session.peer.pending_bytes,
                              unsent_total=lambda: self.unsent.total)
        calibration = self.calibration
        # The layout the calibration chose is measured again while serving (tuning.py): the tuner's
        # candidates are the layouts it timed, by rank from 1 (the most preferred on a tie first; with
        # --torch-threads set, that count's layouts, in one pass and in parts); and chosen once more on
        # the first busy spell, with the CPU a request takes beside the forward pass as measured then
        # (layout.py's second look).
        on_cpu = model.device.type == "cpu"
        parts = calibration.forward_parts if on_cpu else 1
        layouts = calibration.layouts() if on_cpu else []
        tuner = (ThreadTuner(list(range(1, len(layouts) + 1)),
                             layouts.index((calibration.torch_threads, parts)) + 1, time.monotonic())
                 if len(layouts) > 1 else None)
        quiet = calibration.quiet_lone() if on_cpu and config.quiet_lone != "off" else None
        self.engine = Engine(model, policy, config.max_queue, config.max_masks, self._deliver_from_engine,
                             on_batch=self._observe_batch, max_result_bytes=config.max_result_bytes, memory=memory,
                             cost=cost, threads=tuner, on_threads=self._follow_thread_count,
                             forward_parts=parts, part_threads=calibration.part_threads,
                             layouts=layouts if tuner is not None else None,
                             second_look=calibration.second_look() if tuner is not None else None,
                             quiet=quiet)
        if quiet is not None:
            self.metrics.quiet_lone(lambda: quiet.threads, quiet.after_s, lambda: self.engine.stats.quiet_lone)
        self._phase = _Phase.NEW  # a server serves once: NEW, STARTING, SERVING, DRAINING, ENDED
        self._start_done = asyncio.Event()  # set once start() has returned or raised (a drain waits for it)
        self._switch: _SwitchInterval | None = None  # the process's switch interval, held while it runs
        self.switch_interval_s = sys.getswitchinterval()  # the one it set last (_follow_thread_count)
        self._port: int | None = None  # the port listened on, known from start() on (after drain() too)
        self.metrics.engine_calibration(self._torch_threads, lambda: cost.coefficients,
                                        lambda: (policy.max_batch_size, policy.max_batch_tokens),
                                        lambda: self.engine.forward_parts)
        self._hello_layout = self._layout_now()
        self._hello_args = (SERVER_NAME, model_display_name(model.name), model.random_weights, self.limits, {
            "max_batch_size": policy.max_batch_size,
            "max_batch_tokens": policy.max_batch_tokens,
            "max_queue": config.max_queue,
            "max_tokens": model.max_tokens,
            "max_frame_bytes": config.max_frame_bytes,
            "max_result_bytes": config.max_result_bytes,
            "max_inflight_per_connection": config.max_inflight_per_connection,
        })
        self._hello = self._encode_hello()
        self._going_away = encode_going_away("shutting_down", RECONNECT_WITHIN_MS)
        self.http = HttpFront(config, self.origins, self._tls is not None, self.metrics, FrontState(
            accepting=lambda: self.ready.loaded and not self.ready.draining,
            unready=lambda: self.ready.unready,
            engine_alive=lambda: self.engine.alive,
            connections=self._connections_held,
        ))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None
        self._in_transit = 0  # batches of outcomes handed over by the engine, not yet routed by the loop
        self._transit_lock = threading.Lock()
        self.double_answers = 0  # second answers a session refused to send: a bug if ever above 0
        self._trim: asyncio.TimerHandle | None = None

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine's threads and listen; ready once this returns. If it fails (the port is
        taken, say) or is cancelled, it leaves nothing running: the engine's threads are stopped and
        the switch interval is put back before the exception is raised. A server starts once."""
        if self._phase is not _Phase.NEW:
            raise RuntimeError(f"this FillMaskServer was started before (it is {self._phase.value}): a server "
                               "starts once, even after a failed start, so build a new one (with the same "
                               "model) to serve again")
        self._phase = _Phase.STARTING
        try:
            self._loop = asyncio.get_running_loop()
            self._switch = _SWITCH_INTERVAL
            self._switch.acquire(self)
            self._follow_thread_count(self._team_threads())
            self.engine.start()
            # Bound but not accepting until start_serving: a cancel at any await leaves no listener
            # that this server does not know of (asyncio's own start awaits once after accepting).
            self._server = await serve(
                self._handle, self.config.host, self.config.port,
                process_request=self.http.process_request,
                process_response=self.http.process_response,
                create_connection=self.http.connection_class(),
                max_size=self.config.max_frame_bytes,
                compression=None,
                server_header=SERVER_NAME,
                ssl=self._tls,
                backlog=min(max(MIN_LISTEN_BACKLOG, self.config.max_connections), MAX_LISTEN_BACKLOG),
                start_serving=False,
            )
            for listener in self._server.sockets:  # accepted sockets inherit it
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, KERNEL_SEND_BUFFER_BYTES)
            self._port = self._server.sockets[0].getsockname()[1]
            await self._server.start_serving()
        except BaseException:
            if self._server is not None:
                self._server.server.close()  # (asyncio's: the sockets close now, not a loop step later)
                self._server.close()
            self.engine.stop()  # (idle threads: they end at once)
            self._release_switch_interval()
            self._phase = _Phase.ENDED
            raise
        finally:
            self._start_done.set()
        if self._phase is _Phase.STARTING:  # (not when a drain began meanwhile: it goes on from here)
            self._phase = _Phase.SERVING
        self.ready.loaded = True
        log.info("serving %s", serving_line(self.model.name, self.config.host, self.port, self.url,
                                            bool(self.config.token)))

    async def __aenter__(self) -> FillMaskServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.drain()

    def _release_switch_interval(self) -> None:
        if self._switch is not None:
            held, self._switch = self._switch, None
            held.release(self)

    def _follow_thread_count(self, count: int) -> None:
        """Set the interpreter's switch interval for a model on ``count`` torch threads: ``--gil-switch-ms``
        when set, else the one that suits the count (``tuning.switch_interval_s``). Called by ``start``
        and, on the model thread, by the engine after each change of the count. Process-wide, like
        torch's thread count: the last server to stop puts back what the first one found."""
        ms = self.config.gil_switch_ms
        self.switch_interval_s = ms / 1000 if ms else switch_interval_s(count, self.model.device.type)
        sys.setswitchinterval(self.switch_interval_s)

    @property
    def port(self) -> int:
        """The port listened on (the one chosen for ``port=0``), from ``start()`` on, after ``drain()`` too."""
        if self._port is None:
            raise RuntimeError("the server has no port yet: await start() first")
        return self._port

    @property
    def url(self) -> str:
        return f"{'wss' if self._tls else 'ws'}://{self._display_host()}:{self.port}/"

    @property
    def http_url(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self._display_host()}:{self.port}"

    def _display_host(self) -> str:
        """Where a client on this machine reaches the server: loopback when it listens everywhere."""
        host = self.config.host
        if host in WILDCARD_HOSTS:
            return "[::1]" if host == "::" else "127.0.0.1"
        return f"[{host}]" if ":" in host else host

    def in_flight(self) -> int:
        """Accepted requests without their terminal answer, over every connection."""
        return sum(len(conn.session.inflight) for conn in self.connections)

    async def engine_stopped(self) -> None:
        """Return once the engine has stopped by a fault (a stage thread ended: §6 ``engine_stopped``),
        and only then: not before ``start()``, not while it runs, not after a ``drain()`` (cancel the
        wait once you have drained). The process's shell drains and exits then, so that its supervisor
        starts a fresh one (a server whose model thread is gone can answer nothing but 503)."""
        while not self.engine.faulted:
            await asyncio.sleep(ENGINE_WATCH_S)

    def settled(self) -> bool:
        """Nothing left to happen by itself: no request on its way through the engine, no outcome on its
        way to the loop, no answer waiting in an outbox. (Tests count answers once this holds.)"""
        return (not self.engine.busy() and self._in_transit == 0
                and all(conn.pending_bytes == 0 for conn in self.connections))

    async def drain(self, timeout: float | None = None, delay: float = 0.0,
                    on_closed: Callable[[], None] | None = None) -> None:
        """Graceful shutdown (protocol.md §10): after ``delay`` seconds of serving with ``/readyz`` at 503,
        refuse new work, tell every connection ``going_away``, finish accepted work, close with 1001;
        ``on_closed`` is called once every connection and the listener are closed, before the engine's
        threads are stopped (``ws_server``: a signal from then on only hurries the exit).
        Called again after a drain that was cancelled, it finishes that drain (``going_away`` is sent
        once); after one that ended, or before ``start()``, it does nothing (and the server will not
        start); during ``start()``, it waits for the start to end."""
        if self._phase is _Phase.NEW:
            self._phase = _Phase.ENDED
        if self._phase is _Phase.ENDED:
            return
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            await self._drained_elsewhere()
        self._phase = _Phase.DRAINING  # (from STARTING too: start() then leaves the phase to this drain)
        if not self._start_done.is_set():  # every drain during start() waits for it to end
            await self._start_done.wait()
            if self._phase is _Phase.ENDED:  # the start failed (nothing runs), or another drain ended
                return
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        self.ready.unready = True
        if delay > 0:
            log.info("draining in %g s: /readyz answers 503 meanwhile, everything is still served", delay)
            await asyncio.sleep(delay)
        if not self.ready.draining:  # (once: a drain that was cancelled after this has told them)
            self.ready.draining = True
            for conn in list(self.connections):
                conn.session.shut_down()
                conn.send(self._going_away)
        log.info("draining: %d requests in flight", self.in_flight())
        give_up = time.monotonic() + timeout
        while self.in_flight() and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
        self._on_outcomes(self.engine.withdraw_all("shutting_down", SHUTTING_DOWN_RETRY_MS))
        # A batch already running is never cut off: its requests were accepted and have started, so
        # wait for it (one batch, bounded) rather than drop answers that are about to exist.
        running_until = time.monotonic() + RUNNING_BATCH_GRACE_S
        while self.engine.busy() and time.monotonic() < running_until:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0)  # let the last call_soon_threadsafe deliveries run
        # Concurrently, each bounded in time: a client gets its answers for as long as it keeps reading
        # them (however slowly), up to the shutdown timeout (at least one second from now); one that
        # takes no bytes for --send-timeout is closed then (§12), so none holds up the others. Each is
        # pinged before its close, so that a request sent before going_away arrived is answered.
        until = max(give_up, time.monotonic() + 1.0)
        await asyncio.gather(*(conn.close_once_read(GOING_AWAY, "server shutting down", until,
                                                    self.config.send_timeout, NOTICE_BARRIER_S)
                               for conn in list(self.connections)))
        if self._server is not None:
            self._server.close(close_connections=True, code=GOING_AWAY)
            await self._server.wait_closed()
        if on_closed is not None:
            on_closed()
        await asyncio.to_thread(self.engine.stop)
        self._release_switch_interval()
        self._phase = _Phase.ENDED
        for throttle in (self.http.log, self._closing_log):
            throttle.flush()  # (lines it left out are counted now: nothing of this server comes after "stopped")
        log.info("stopped")

    async def _drained_elsewhere(self) -> None:
        """``drain`` on another event loop than ``start``'s (two ``asyncio.run`` calls, say): everything
        the server does on its loop (connections, timers, the listener) can only be done there, so this
        raises ``RuntimeError`` saying how to drain it. Where that loop has closed, nothing can ever run
        on it again: the listening sockets are closed and the engine's threads stopped first, so that
        nothing is left running (its connections ended as that loop's tasks were cancelled, without
        ``going_away``)."""
        assert self._loop is not None
        if not self._loop.is_closed():
            how = ("asyncio.run_coroutine_threadsafe(server.drain(), loop) from another thread"
                   if self._loop.is_running() else "loop.run_until_complete(server.drain())")
            raise RuntimeError("drain() was called on another event loop than the one this server was started "
                               f"on, where its connections live: run it there ({how})")
        if self._server is not None:
            with contextlib.suppress(RuntimeError):  # (asyncio's close: its sockets close, then "loop closed")
                self._server.server.close()
        await asyncio.to_thread(self.engine.stop)
        self._release_switch_interval()
        self._phase = _Phase.ENDED
        log.warning("stopped without a drain: the event loop it was started on had closed")
        raise RuntimeError("the event loop this server was started on has closed (asyncio.run closes its loop "
                           "when its coroutine returns), so it could not drain: its listener and threads are "
                           "stopped, and its clients were not told going_away; start and drain a server within "
                           "one asyncio.run (async with server: ...)")

    # --- WebSocket --------------------------------------------------------------------------------

    def _layout_now(self) -> tuple[int, int]:
        """(torch threads, parts) in use now: the calibration's, or the layout the engine switched to.
        Read without the engine's lock (from the event loop and /metrics scrapes): the tuner's current
        candidate is one integer, written only by the model thread under that lock, so a read sees the
        layout before or after a switch."""
        tuner = self.engine.core.threads
        if tuner is None:
            return self.calibration.torch_threads, self.engine.forward_parts
        return self.engine.layout(tuner.current)

    def _torch_threads(self) -> int:
        """The torch thread count in use now (with parts, all the parts' together)."""
        return self._layout_now()[0]

    def _team_threads(self) -> int:
        """The threads of one OpenMP team now: each part's with parts, else all of them."""
        threads, parts = self._layout_now()
        return max(1, threads // parts)

    def _encode_hello(self) -> bytes:
        threads, parts = self._hello_layout
        engine = {**self.model.engine_facts(), **self.calibration.hello(), "torch_threads": threads,
                  "forward_parts": parts}
        return encode_hello(*self._hello_args, engine)

    def _current_hello(self) -> bytes:
        """The hello frame, encoded again only when the layout changed since the last one."""
        layout = self._layout_now()
        if layout != self._hello_layout:
            self._hello_layout = layout
            self._hello = self._encode_hello()
        return self._hello

    def _connections_held(self) -> int:
        """WebSocket connections open or closing (a client's close frame is answered at once, but its TCP
        connection, and its slot, last until the client ends it or websockets' close timeout)."""
        if self._server is None:
            return 0
        return sum(1 for ws in self._server.all_connections if ws.protocol.state in (State.OPEN, State.CLOSING))

    async def _handle(self, ws: ServerConnection) -> None:
        if isinstance(ws, FrontConnection):
            ws.finished()  # upgraded: counted against --max-connections from now on, not as unfinished
        conn = Connection(ws, self.metrics, self.config.max_send_buffer_bytes, self._on_congested, self.unsent,
                          self._watch)
        session = Session(self.limits, self.engine, self.config.max_inflight_per_connection, time.monotonic,
                          peer=conn)
        conn.session = session
        self.connections.add(conn)
        self.metrics.connections.inc()
        conn.start()
        conn.send(self._current_hello())
        if self.ready.draining:  # the handshake passed just before the drain began
            session.shut_down()
            conn.send(self._going_away)
        front = ws if isinstance(ws, FrontConnection) else None
        read_at_once = functools.partial(self._on_message_read, front, conn) if front is not None else None
        if front is not None:
            front.on_message = read_at_once
            front.on_backed_up, front.on_drained = conn.socket_backed_up, conn.socket_drained  # (unread pongs)
            front.on_close_frame = functools.partial(self._let_go, session)
        try:
            # Messages that went through websockets' queue (see FrontConnection.process_event). While the
            # handler holds one, later ones queue behind it; it hands the fast path back once caught up.
            async for message in ws:
                if front is not None:
                    front.taken()
                    front.on_message = None
                if conn.congested:  # read while congested: it waits until the client takes its answers
                    await conn.uncongested()
                self._on_message(conn, message)
                if conn.congested:  # backpressure: read nothing more until the client takes its answers
                    await conn.uncongested()
                if front is not None and not front.queued and not conn.closed and not conn.congested:
                    front.on_message = read_at_once  # caught up: messages are handled as they are read again
        except ConnectionClosed:
            pass
        finally:
            if front is not None:
                front.on_message = front.on_close_frame = None
            conn.stop()
            self.connections.discard(conn)
            self._let_go(session)
            self._trim_soon()

    def _let_go(self, session: Session) -> None:
        """The client's close frame came (no answer can follow the close echoed to it), or the connection
        ended: withdraw what the engine has not started (§8 dropped: ``Session.close`` withdraws once,
        whoever closed the session first: the watchdog, the resender rule), and the batching policy
        forgets the connection (each time: a batch that was running may have reminded it since)."""
        withdrawn = session.close()
        self.metrics.dropped(withdrawn)
        self.engine.forget(session)
        if withdrawn:
            log.debug("connection closed with %d requests not yet started; discarded", withdrawn)

    def _on_message(self, conn: Connection, message: str | bytes) -> None:
        """One message from ``conn``'s client: its session's answers, then the session's deadline timer,
        stats subscription and early-resend close followed."""
        if conn.closed:
            return  # closing: frames still arriving are read only to reach the client's close frame
        session: Session = conn.session
        self._send_answers(conn, session.receive(message))
        self._arm_deadline(conn)
        if session.stats_interval_ms != conn.stats_interval_ms:
            self._follow_stats(conn)
        if session.close_request is not None:  # it kept sending before its retry_after_ms (§12)
            self.metrics.resenders_closed.inc()
            self._closing_log.info("resender", "closing a connection whose client kept sending before its "
                                   "retry_after_ms (%s)", self.http.peer(conn.ws))
            conn.close_soon(*session.close_request)
            self.metrics.dropped(session.close())

    def _on_message_read(self, front: FrontConnection, conn: Connection, message: str) -> None:
        """A message handed over as soon as it was parsed (``FrontConnection.on_message``), handled at once.
        From the moment the connection is congested (``_on_congested``) until the handler has taken a
        message from websockets' queue again and caught up, messages go through that queue, where the
        handler waits for the client to take its answers (backpressure). A failure closes the
        connection with 1011, as websockets does when a handler fails."""
        try:
            self._on_message(conn, message)
        except Exception:
            log.exception("handling a message failed; closing the connection with 1011")
            front.on_message = None
            conn.close_soon(CloseCode.INTERNAL_ERROR, "internal error")

    def _trim_soon(self) -> None:
        """A connection closed: a moment later (after a burst of closes, once), give the memory its
        answers held back to the system (``allocator.trim``)."""
        if self._trim is None and self._loop is not None:
            self._trim = self._loop.call_later(TRIM_AFTER_S, self._trim_now)

    def _trim_now(self) -> None:
        self._trim = None
        allocator.trim()

    def _send_answers(self, conn: Connection, answers: list[Answer]) -> None:
        for answer in answers:
            conn.send(answer.frame, (answer.outcome, answer.code))

    def _arm_deadline(self, conn: Connection) -> None:
        """Keep one timer per connection, set to its session's next request deadline."""
        when = conn.session.next_deadline()
        timer = conn.deadline_timer
        if timer is not None and (when is None or timer.when() != when):
            timer.cancel()
            conn.deadline_timer = timer = None
        if when is not None and timer is None and not conn.closed:
            assert self._loop is not None  # the loop's clock is time.monotonic, the session's clock
            conn.deadline_timer = self._loop.call_at(when, self._on_deadline, conn)

    def _on_deadline(self, conn: Connection) -> None:
        conn.deadline_timer = None
        if not conn.closed:
            self._send_answers(conn, conn.session.expire())
            self._arm_deadline(conn)

    def _observe_batch(self, batch_id: int, size: int, padded_tokens: int, queue_waits_s: list[float],
                       seconds: float) -> None:
        """Called on the decode stage's thread for each batch the model ran, before its answers are
        decoded: the metrics and the live figures."""
        self.metrics.observe_batch(size, padded_tokens, queue_waits_s, seconds)
        self.stats.batch_ran(batch_id, size, padded_tokens, seconds)

    def _deliver_from_engine(self, outcomes: list[Outcome]) -> None:
        """Called on an engine thread: hand a batch's outcomes to the loop in one wake-up."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._transit_lock:
            self._in_transit += 1
        try:
            loop.call_soon_threadsafe(self._on_outcomes, outcomes, True)
        except RuntimeError:  # the loop closed between the check and the call
            with self._transit_lock:
                self._in_transit -= 1

    def _on_outcomes(self, outcomes: Sequence[Outcome], in_transit: bool = False) -> None:
        """Each outcome to its job's session, and the answer to that session's connection; then the answer
        memory their computation reserved is given back (the answers are now counted as unsent bytes).
        The memory and the count in transit are given back whatever routing meets."""
        try:
            self._route(outcomes)
        finally:
            self.engine.release([outcome.job for outcome in outcomes])
            if in_transit:
                with self._transit_lock:
                    self._in_transit -= 1

    def _route(self, outcomes: Sequence[Outcome]) -> None:
        touched: dict[Connection, None] = {}
        try:
            self._route_each(outcomes, touched)
        finally:
            for conn in touched:  # each connection's answers of this hand-over in one write, written now
                conn.flush()

    def _route_each(self, outcomes: Sequence[Outcome], touched: dict[Connection, None]) -> None:
        for outcome in outcomes:
            session: Session = outcome.job.owner
            try:
                answer = session.on_outcome(outcome)
            except DoubleAnswer:
                self.double_answers += 1
                log.exception("not sending a second answer")
                continue
            except Exception:  # a defect: the other answers of this hand-over still go out
                log.exception("routing an answer failed")
                continue
            if answer is None:
                self.metrics.dropped()  # its connection closed while the model had it
                continue
            session.peer.send(answer.frame, (answer.outcome, answer.code), defer=True)
            touched[session.peer] = None
            if isinstance(outcome, Result):
                self.stats.result((time.monotonic() - outcome.job.arrival) * 1000)

    # --- live figures (§13) -----------------------------------------------------------------------

    def _follow_stats(self, conn: Connection) -> None:
        """Start, restart with a new interval, or stop ``conn``'s stats frames, as its session asks.

        The first frame covers the time since the subscription, marked here rather than when the task
        first runs (a batch done in between would be in no frame); after a change of interval, since
        the previous frame (``conn.stats_mark``), so nothing falls between two frames."""
        restarting = conn.stats_task is not None
        if conn.stats_task is not None:
            conn.stats_task.cancel()
            conn.stats_task = None
        conn.stats_interval_ms = conn.session.stats_interval_ms
        if conn.stats_interval_ms is not None:
            if not restarting or conn.stats_mark is None:
                conn.stats_mark = self.stats.mark(time.monotonic())
            conn.stats_task = asyncio.create_task(self._send_stats(conn, conn.stats_interval_ms / 1000))
        else:
            conn.stats_mark = None

    async def _send_stats(self, conn: Connection, interval: float) -> None:
        """Every ``interval`` seconds, the figures since the previous frame (``conn.stats_mark``); none
        while the client is behind on reading (a stats frame never adds to a backlog), nor after the
        connection closed."""
        while not conn.closed:
            await asyncio.sleep(interval)
            if conn.closed or conn.behind:
                continue
            now = time.monotonic()
            since = conn.stats_mark if conn.stats_mark is not None else self.stats.mark(now)
            frame, conn.stats_mark = self.stats.snapshot(since, now, self.engine.queued(), self.in_flight(),
                                                         len(self.connections))
            conn.send(encode_stats(frame))

    # --- clients that do not read ------------------------------------------------------------------

    def _on_congested(self, conn: Connection) -> None:
        if isinstance(conn.ws, FrontConnection):
            conn.ws.on_message = None  # its next messages queue up for the handler, which waits (backpressure)
        self.metrics.reading_paused.inc()
        self._watch(conn)

    def _watch(self, conn: Connection) -> None:
        """Watch ``conn`` (``_watch_reader``) unless a watchdog already does."""
        if conn.watchdog is None or conn.watchdog.done():
            conn.watchdog = asyncio.create_task(self._watch_reader(conn))

    async def _watch_reader(self, conn: Connection) -> None:
        """While anything waits to be sent on ``conn`` (it is congested, or merely backlogged: its
        answers within the bound, the kernel's send buffer full), close it once its client has taken no
        bytes at all for ``--send-timeout`` seconds. Progress is measured on the transport
        (``Connection.note_progress``), so a client that reads steadily, however slowly and however
        large the frame it is reading, is only slowed down; one that reads nothing is closed even if it
        also sends nothing more."""
        timeout = self.config.send_timeout
        look = timeout / WATCHDOG_LOOKS
        while not conn.closed and (conn.congested or conn.backlogged):
            conn.note_progress()
            if time.monotonic() - conn.last_progress >= timeout:
                self.metrics.slow_clients_closed.inc()
                self._closing_log.info("slow", "closing a connection whose client read nothing for %gs (%d bytes "
                                       "of answers unsent, %s)", timeout, conn.pending_bytes, self.http.peer(conn.ws))
                # In a task: the handler goes on reading (and discarding) so that websockets can see the
                # client's answering close frame behind the requests still in the socket.
                conn.close_soon(POLICY_VIOLATION, SLOW_READER_REASON)
                self.metrics.dropped(conn.session.close())  # nobody to answer
                return
            if conn.congested:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(conn.uncongested(), look)
            else:
                await asyncio.sleep(look)


def model_display_name(model: str) -> str:
    """How ``hello`` names the model (§2): a hub id as given, a local directory by its name only, so that
    no client learns the server's file system layout."""
    path = Path(model).expanduser()
    if path.is_dir():  # (its own name, not a link's target's: ``/models/current``, not what it points at)
        return Path(os.path.abspath(path)).name
    return model
