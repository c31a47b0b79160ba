"""The websockets shell: sockets in, protocol frames and engine calls out (HTTP routes: ``http``).

Everything here runs on the asyncio event loop and stays cheap: parsing is ``protocol.parse_frame``,
admission is ``Engine.submit`` (a lock and an append), handshakes are decided by ``http.HttpFront``, and
finished frames arrive from the engine thread through ``call_soon_threadsafe``. No model code runs on
the loop.

Per connection, ``Connection.inflight`` maps each accepted id to its job until its terminal frame is
queued for sending (protocol.md §8); every outgoing frame goes through one outbox and one writer
task, so frames leave in the order they were produced. The outbox is bounded: once the bytes
waiting in it pass ``--max-send-buffer-bytes`` the server reads no more frames from that client, so
only answers to requests already in flight (at most ``--max-inflight-per-connection``) can still join
it; and if the socket then takes nothing for ``--send-timeout`` seconds the server drops the outbox
and closes the connection with 1008 (protocol.md §12).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from . import __version__
from .access import OriginPolicy, tls_context
from .batching import BatchPolicy
from .config import Config
from .engine import ENGINE_STOPPED_RETRY_MS, Engine, Job
from .http import FrontState, HttpFront
from .metrics import LiveValues, Metrics
from .model import FillMaskModel
from .protocol import (
    CancelRequest,
    FillMaskRequest,
    Limits,
    ProtocolError,
    RequestId,
    encode_cancelled,
    encode_error,
    encode_going_away,
    encode_hello,
    encode_overloaded,
    parse_frame,
)

log = logging.getLogger(__name__)

SERVER_NAME = f"fillmask-server/{__version__}"
GOING_AWAY = 1001
POLICY_VIOLATION = 1008
SHUTTING_DOWN_RETRY_MS = 1000  # retry_after_ms of the 503 shutting_down answers (§6)
RECONNECT_WITHIN_MS = 1000  # going_away's reconnect window: clients spread their reconnects over it (§10)
RUNNING_BATCH_GRACE_S = 60.0  # after the drain timeout, how long a running batch may still take
CLOSE_GRACE_S = 5.0  # how long a close may wait for a client to take the close frame before the socket is cut


class Connection:
    """One client socket: its requests in flight and its ordered, byte-counted outbox.

    ``pending_bytes`` is the size of the frames queued and not yet handed to the socket; ``congested``
    is True while it exceeds ``max_send_buffer``, and ``on_congested`` is called each time it becomes
    True. ``stalled_s`` is how long the writer has been waiting
    for the socket to take its current frame (websockets' ``send`` waits only while the transport's
    buffer is full, i.e. while the client reads nothing). Every answer about a request goes through
    ``reply`` or ``finish``, which count it in the metrics; an answer for a closed connection is
    counted as dropped and goes nowhere.
    """

    def __init__(self, ws: ServerConnection, metrics: Metrics, max_send_buffer: int,
                 on_congested: Callable[[Connection], None]) -> None:
        self.ws = ws
        self.inflight: dict[RequestId, Job] = {}
        self.closed = False
        self.pending_bytes = 0
        self._metrics = metrics
        self._max_send_buffer = max_send_buffer
        self._on_congested = on_congested
        self._outbox: deque[bytes] = deque()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._uncongested = asyncio.Event()
        self._uncongested.set()
        self._writer: asyncio.Task[None] | None = None
        self._send_started: float | None = None
        self.closing: asyncio.Task[None] | None = None  # the server's own close, once it decided on one
        self.watchdog: asyncio.Task[None] | None = None  # FillMaskServer._watch_reader, while congested

    @property
    def congested(self) -> bool:
        return self.pending_bytes > self._max_send_buffer

    @property
    def stalled_s(self) -> float:
        started = self._send_started
        return 0.0 if started is None else time.monotonic() - started

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop())

    def send(self, frame: bytes) -> None:
        """Queue one frame for the writer task (never blocks)."""
        if self.closed:
            return
        self._outbox.append(frame)
        self.pending_bytes += len(frame)
        if self.pending_bytes > self._max_send_buffer and self._uncongested.is_set():
            self._uncongested.clear()
            self._on_congested(self)
        self._idle.clear()
        self._ready.set()

    def reply(self, frame: bytes) -> None:
        """Send one answer (error, overloaded, result, cancelled) and count it."""
        self._metrics.answered(frame)
        self.send(frame)

    def finish(self, job: Job, frame: bytes) -> None:
        """Send ``job``'s terminal frame and forget its id (the engine guarantees one call per job)."""
        if self.inflight.get(job.request.id) is job:
            del self.inflight[job.request.id]
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        if self.closed:
            self._metrics.dropped()
            return
        self.reply(frame)

    async def _write_loop(self) -> None:
        """Send queued frames in order until the connection closes."""
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                while self._outbox:
                    frame = self._outbox.popleft()
                    self._send_started = time.monotonic()
                    await self.ws.send(frame, text=True)
                    self._send_started = None
                    self.pending_bytes -= len(frame)
                    if not self.congested:
                        self._uncongested.set()
                self._idle.set()
        except ConnectionClosed:
            self._drop_outbox()

    def _drop_outbox(self) -> None:
        self._send_started = None
        self._outbox.clear()
        self.pending_bytes = 0
        self._uncongested.set()
        self._idle.set()

    async def flushed(self) -> None:
        """Return once every queued frame has been handed to the socket."""
        await self._idle.wait()

    async def uncongested(self) -> None:
        """Return once the unsent bytes are back within the bound (or the connection closed)."""
        await self._uncongested.wait()

    async def close(self, code: int, reason: str, flush_s: float = 0.0) -> None:
        """Close with ``code`` after waiting up to ``flush_s`` for the outbox to go out."""
        if flush_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flushed(), flush_s)
        self.stop()
        await self._close_socket(code, reason)

    def close_soon(self, code: int, reason: str) -> None:
        """Stop sending at once, dropping the outbox, and close in a task (``closing``); idempotent."""
        if self.closing is None:
            self.stop()
            self.closing = asyncio.create_task(self._close_socket(code, reason))

    async def _close_socket(self, code: int, reason: str) -> None:
        """Send the close frame and wait ``CLOSE_GRACE_S`` for the closing handshake; a client that
        does not take the close frame in that time loses the socket (TCP abort)."""
        try:
            await asyncio.wait_for(self.ws.close(code, reason), CLOSE_GRACE_S)
        except TimeoutError:
            self.ws.transport.abort()

    def stop(self) -> None:
        """Send nothing more: mark closed, stop the writer, drop the outbox (idempotent)."""
        self.closed = True
        if self._writer is not None:
            self._writer.cancel()
        self._drop_outbox()


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


class FillMaskServer:
    """Wires the protocol, the engine and websockets together. Create, ``await start()``, ``await drain()``."""

    def __init__(self, config: Config, model: FillMaskModel) -> None:
        self.config = config
        self.model = model
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
        policy = BatchPolicy(config.max_batch_size, config.max_batch_tokens, config.max_wait_ms / 1000,
                             config.max_length_ratio)
        self.metrics = Metrics(LiveValues(
            queue_depth=lambda: self.engine.queued(),
            open_connections=lambda: len(self.connections),
            engine_busy_seconds=lambda: self.engine.stats.busy_s,
            engine_uptime_seconds=lambda: time.monotonic() - self.engine.started_at,
            engine_alive=lambda: self.engine.alive,
        ))
        self.engine = Engine(model, policy, config.max_queue, config.max_masks, self._deliver_from_engine,
                             on_batch=self.metrics.observe_batch)
        self._hello = encode_hello(SERVER_NAME, model_display_name(config.model), model.random_weights, self.limits, {
            "max_batch_size": config.max_batch_size,
            "max_batch_tokens": config.max_batch_tokens,
            "max_queue": config.max_queue,
            "max_tokens": model.max_tokens,
            "max_frame_bytes": config.max_frame_bytes,
            "max_inflight_per_connection": config.max_inflight_per_connection,
        })
        self._going_away = encode_going_away("shutting_down", RECONNECT_WITHIN_MS)
        self.http = HttpFront(config, self.origins, self._tls is not None, self.metrics, FrontState(
            accepting=lambda: self.ready.loaded and not self.ready.draining,
            unready=lambda: self.ready.unready,
            engine_alive=lambda: self.engine.alive,
            connections=lambda: len(self._server.connections) if self._server is not None else 0,
        ))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread and listen; ready once this returns."""
        self._loop = asyncio.get_running_loop()
        self.engine.start()
        self._server = await serve(
            self._handle, self.config.host, self.config.port,
            process_request=self.http.process_request,
            process_response=self.http.process_response,
            create_connection=self.http.connection_class(),
            max_size=self.config.max_frame_bytes,
            compression=None,
            server_header=SERVER_NAME,
            ssl=self._tls,
        )
        self.ready.loaded = True
        log.info("serving %s on %s", self.config.model, self.url)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"{'wss' if self._tls else 'ws'}://{self._display_host()}:{self.port}/"

    @property
    def http_url(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self._display_host()}:{self.port}"

    def _display_host(self) -> str:
        host = self.config.host
        if host in ("", "0.0.0.0"):
            return "127.0.0.1"
        return f"[{host}]" if ":" in host else host

    async def drain(self, timeout: float | None = None, delay: float = 0.0) -> None:
        """Graceful shutdown (protocol.md §10): after ``delay`` seconds of serving with ``/readyz`` at 503,
        refuse new work, tell every connection ``going_away``, finish accepted work, close with 1001."""
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        self.ready.unready = True
        if delay > 0:
            log.info("draining in %g s: /readyz answers 503 meanwhile, everything is still served", delay)
            await asyncio.sleep(delay)
        self.ready.draining = True
        for conn in list(self.connections):
            conn.send(self._going_away)
        log.info("draining: %d requests in flight", sum(len(c.inflight) for c in self.connections))
        give_up = time.monotonic() + timeout
        while any(conn.inflight for conn in self.connections) and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
        for job in self.engine.drain_queue():
            job.owner.finish(job, encode_overloaded(job.request.id, 503, "shutting_down", SHUTTING_DOWN_RETRY_MS))
        # A batch already running is never cut off: its requests were accepted and have started, so
        # wait for it (one batch, bounded) rather than drop answers that are about to exist.
        running_until = time.monotonic() + RUNNING_BATCH_GRACE_S
        while self.engine.busy() and time.monotonic() < running_until:
            await asyncio.sleep(0.02)
        # Concurrently, and each bounded in time: a client that does not read cannot hold up the rest.
        await asyncio.gather(*(conn.close(GOING_AWAY, "server shutting down", flush_s=1.0)
                               for conn in list(self.connections)))
        if self._server is not None:
            self._server.close(close_connections=True, code=GOING_AWAY)
            await self._server.wait_closed()
        await asyncio.to_thread(self.engine.stop)
        log.info("stopped")

    # --- WebSocket --------------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        conn = Connection(ws, self.metrics, self.config.max_send_buffer_bytes, self._on_congested)
        self.connections.add(conn)
        conn.start()
        conn.send(self._hello)
        if self.ready.draining:  # the handshake passed just before the drain began
            conn.send(self._going_away)
        try:
            async for message in ws:
                if conn.closed:
                    continue  # closing: frames still arriving are read only to reach the client's close frame
                self._on_message(conn, message)
                if conn.congested:  # backpressure: read nothing more until the client takes its answers
                    await conn.uncongested()
        except ConnectionClosed:
            pass
        finally:
            conn.stop()
            self.connections.discard(conn)
            jobs = list(conn.inflight.values())
            for job in jobs:
                if job.timer is not None:
                    job.timer.cancel()
            dropped = self.engine.discard(jobs)
            self.metrics.dropped(dropped)
            if dropped:
                log.debug("connection closed with %d requests queued; discarded", dropped)
            conn.inflight.clear()

    def _on_congested(self, conn: Connection) -> None:
        self.metrics.reading_paused.inc()
        conn.watchdog = asyncio.create_task(self._watch_reader(conn))

    async def _watch_reader(self, conn: Connection) -> None:
        """While ``conn`` is congested, close it once its socket has taken nothing for ``--send-timeout``
        seconds. A client that reads, however slowly, keeps resetting that clock and is only slowed
        down; one that reads nothing is closed even if it also sends nothing more."""
        while conn.congested and not conn.closed:
            remaining = self.config.send_timeout - conn.stalled_s
            if remaining <= 0:
                self.metrics.slow_clients_closed.inc()
                log.info("closing a connection whose client read nothing for %gs (%d bytes of answers unsent)",
                         self.config.send_timeout, conn.pending_bytes)
                # In a task: the handler goes on reading (and discarding) so that websockets can see the
                # client's answering close frame behind the requests still in the socket.
                conn.close_soon(POLICY_VIOLATION, "too many unread messages; read the server's messages as "
                                "they come")
                self.metrics.dropped(self.engine.discard(list(conn.inflight.values())))  # nobody to answer
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conn.uncongested(), remaining)

    def _on_message(self, conn: Connection, message: str | bytes) -> None:
        parsed = parse_frame(message, self.limits)
        if isinstance(parsed, FillMaskRequest):
            self._admit(conn, parsed)
        elif isinstance(parsed, CancelRequest):
            job = conn.inflight.get(parsed.id)
            if job is not None and self.engine.cancel(job):
                conn.finish(job, encode_cancelled(job.request.id))
        else:
            assert isinstance(parsed, ProtocolError)
            conn.reply(encode_error(parsed.id, parsed.code, parsed.message))

    def _admit(self, conn: Connection, request: FillMaskRequest) -> None:
        if request.id in conn.inflight:
            conn.reply(encode_error(request.id, "duplicate_id", "a request with this id is still in flight on this "
                                    "connection; use a new id, or wait for its answer"))
            return
        if len(conn.inflight) >= self.config.max_inflight_per_connection:
            conn.reply(encode_error(request.id, "too_many_inflight", f"this connection already has "
                                    f"{len(conn.inflight)} requests in flight, the most allowed; wait for "
                                    "answers before sending more"))
            return
        if self.ready.draining:
            conn.reply(encode_overloaded(request.id, 503, "shutting_down", SHUTTING_DOWN_RETRY_MS))
            return
        now = time.monotonic()
        deadline = None if request.deadline_ms is None else now + request.deadline_ms / 1000
        job = Job(request, conn, now, deadline)
        if not self.engine.submit(job):
            if self.engine.alive:
                conn.reply(encode_overloaded(request.id, 503, "queue_full", self.engine.retry_after_ms()))
            else:
                conn.reply(encode_overloaded(request.id, 503, "engine_stopped", ENGINE_STOPPED_RETRY_MS))
            return
        conn.inflight[request.id] = job
        if deadline is not None:
            assert self._loop is not None
            job.timer = self._loop.call_at(self._loop.time() + request.deadline_ms / 1000, self._expire, job)

    def _expire(self, job: Job) -> None:
        job.timer = None
        if self.engine.expire(job):
            queued_ms = (time.monotonic() - job.arrival) * 1000
            job.owner.finish(job, encode_overloaded(job.request.id, 504, "deadline_exceeded",
                                                    self.engine.retry_after_ms(), queued_ms))

    def _deliver_from_engine(self, frames: list[tuple[Job, bytes]]) -> None:
        """Called on the engine thread: hand the frames to the loop in one wake-up."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
            loop.call_soon_threadsafe(_finish_all, frames)


def model_display_name(model: str) -> str:
    """How ``hello`` names the model (§2): a hub id as given, a local directory by its name only, so that
    no client learns the server's file system layout."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve().name
    return model


def check_can_listen(host: str, port: int) -> None:
    """Raise ``OSError`` now if ``host:port`` cannot be bound, so that a port already in use is
    reported before the model loads (which may take minutes), not after. Port 0 always works."""
    if port == 0:
        return
    for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server does
            probe.bind(address)


def _finish_all(frames: list[tuple[Job, bytes]]) -> None:
    for job, frame in frames:
        job.owner.finish(job, frame)
