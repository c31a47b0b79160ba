"""The websockets shell: sockets and HTTP in, protocol frames and engine calls out.

Everything here runs on the asyncio event loop and stays cheap: parsing is ``protocol.parse_frame``,
admission is ``Engine.submit`` (a lock and an append), and finished frames arrive from the engine
thread through ``call_soon_threadsafe``. No model code runs on the loop.

Per connection, ``Connection.inflight`` maps each accepted id to its job until its terminal frame is
queued for sending (protocol.md §8); every outgoing frame goes through one outbox and one writer
task, so frames leave in the order they were produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import http
import logging
import mimetypes
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from . import __version__
from .batching import BatchPolicy
from .config import Config
from .engine import Engine, Job
from .model import FillMaskModel
from .protocol import (
    CancelRequest,
    FillMaskRequest,
    Limits,
    ProtocolError,
    RequestId,
    encode_cancelled,
    encode_error,
    encode_hello,
    encode_overloaded,
    parse_frame,
)

log = logging.getLogger(__name__)

WEBSOCKET_PATHS = ("/", "/ws")
WEB_ROOT = Path(__file__).resolve().parent.parent / "web_demo"
SERVER_NAME = f"fillmask-server/{__version__}"
GOING_AWAY = 1001


class Connection:
    """One client socket: its requests in flight and its ordered outbox."""

    def __init__(self, ws: ServerConnection) -> None:
        self.ws = ws
        self.inflight: dict[RequestId, Job] = {}
        self.closed = False
        self._outbox: deque[bytes] = deque()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def send(self, frame: bytes) -> None:
        """Queue one frame for the writer task (never blocks)."""
        if self.closed:
            return
        self._outbox.append(frame)
        self._idle.clear()
        self._ready.set()

    def finish(self, job: Job, frame: bytes) -> None:
        """Send ``job``'s terminal frame and forget its id (the engine guarantees one call per job)."""
        if self.inflight.get(job.request.id) is job:
            del self.inflight[job.request.id]
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        self.send(frame)

    async def write_loop(self) -> None:
        """Send queued frames in order until the connection closes."""
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                while self._outbox:
                    await self.ws.send(self._outbox.popleft(), text=True)
                self._idle.set()
        except ConnectionClosed:
            self._outbox.clear()
            self._idle.set()

    async def flushed(self) -> None:
        """Return once every queued frame has been handed to the socket."""
        await self._idle.wait()


@dataclass
class Readiness:
    loaded: bool = False
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
        policy = BatchPolicy(config.max_batch_size, config.max_batch_tokens, config.max_wait_ms / 1000)
        self.engine = Engine(model, policy, config.max_queue, config.max_masks, self._deliver_from_engine)
        self.ready = Readiness()
        self.connections: set[Connection] = set()
        self._hello = encode_hello(SERVER_NAME, config.model, self.limits, {
            "max_batch_size": config.max_batch_size,
            "max_batch_tokens": config.max_batch_tokens,
            "max_queue": config.max_queue,
            "max_tokens": model.max_tokens,
            "max_frame_bytes": config.max_frame_bytes,
        })
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread and listen; ready once this returns."""
        self._loop = asyncio.get_running_loop()
        self.engine.start()
        self._server = await serve(
            self._handle, self.config.host, self.config.port,
            process_request=self._process_request,
            max_size=self.config.max_frame_bytes,
            compression=None,
            server_header=SERVER_NAME,
        )
        self.ready.loaded = True
        log.info("serving %s on %s", self.config.model, self.url)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"ws://{self._display_host()}:{self.port}/"

    @property
    def http_url(self) -> str:
        return f"http://{self._display_host()}:{self.port}"

    def _display_host(self) -> str:
        host = self.config.host
        if host in ("", "0.0.0.0"):
            return "127.0.0.1"
        return f"[{host}]" if ":" in host else host

    async def drain(self, timeout: float | None = None) -> None:
        """Graceful shutdown (protocol.md §10): refuse new work, finish accepted work, close with 1001."""
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        self.ready.draining = True
        log.info("draining: %d requests in flight", sum(len(c.inflight) for c in self.connections))
        give_up = time.monotonic() + timeout
        while any(conn.inflight for conn in self.connections) and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
        for job in self.engine.drain_queue():
            job.owner.finish(job, encode_overloaded(job.request.id, 503, "shutting_down", 1000))
        for conn in list(self.connections):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conn.flushed(), timeout=1.0)
            await conn.ws.close(GOING_AWAY, "server shutting down")
        if self._server is not None:
            self._server.close(close_connections=True, code=GOING_AWAY)
            await self._server.wait_closed()
        await asyncio.to_thread(self.engine.stop)
        log.info("stopped")

    # --- HTTP -------------------------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if request.headers.get("Upgrade", "").lower() == "websocket":
            if path not in WEBSOCKET_PATHS:
                return _json_response(404, {"error": f"no WebSocket endpoint at {path}; connect to /"})
            if self.ready.draining or not self.ready.loaded:
                return _json_response(503, {"error": "server is shutting down; reconnect later"})
            return None
        if path == "/healthz":
            return _json_response(200, {"status": "ok"})
        if path == "/readyz":
            if self.ready.draining:
                return _json_response(503, {"status": "draining"})
            if not self.ready.loaded or not self.engine.alive:
                return _json_response(503, {"status": "loading" if not self.ready.loaded else "engine stopped"})
            return _json_response(200, {"status": "ready"})
        static = _static_file(path)
        if static is not None:
            return static
        return _json_response(404, {"error": "not found"})

    # --- WebSocket --------------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        conn = Connection(ws)
        self.connections.add(conn)
        writer = asyncio.create_task(conn.write_loop())
        conn.send(self._hello)
        try:
            async for message in ws:
                self._on_message(conn, message)
        except ConnectionClosed:
            pass
        finally:
            conn.closed = True
            self.connections.discard(conn)
            jobs = list(conn.inflight.values())
            for job in jobs:
                if job.timer is not None:
                    job.timer.cancel()
            dropped = self.engine.discard(jobs)
            if dropped:
                log.debug("connection closed with %d requests queued; discarded", dropped)
            conn.inflight.clear()
            writer.cancel()

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
            conn.send(encode_error(parsed.id, parsed.code, parsed.message))

    def _admit(self, conn: Connection, request: FillMaskRequest) -> None:
        if request.id in conn.inflight:
            conn.send(encode_error(request.id, "duplicate_id", "a request with this id is still in flight on this "
                                   "connection; use a new id, or wait for its answer"))
            return
        if self.ready.draining:
            conn.send(encode_overloaded(request.id, 503, "shutting_down", 1000))
            return
        now = time.monotonic()
        deadline = None if request.deadline_ms is None else now + request.deadline_ms / 1000
        job = Job(request, conn, now, deadline)
        if not self.engine.submit(job):
            conn.send(encode_overloaded(request.id, 503, "queue_full", self.engine.retry_after_ms()))
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


def _finish_all(frames: list[tuple[Job, bytes]]) -> None:
    for job, frame in frames:
        job.owner.finish(job, frame)


def _json_response(status: int, body: dict[str, Any]) -> Response:
    return _response(status, orjson.dumps(body), "application/json")


def _response(status: int, body: bytes, content_type: str) -> Response:
    headers = Headers([
        ("Date", email.utils.formatdate(usegmt=True)),
        ("Connection", "close"),
        ("Content-Length", str(len(body))),
        ("Content-Type", content_type),
        ("Cache-Control", "no-store"),
    ])
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


def _static_file(path: str) -> Response | None:
    """A file of web_demo/ (``/`` is index.html), or None; never a path outside web_demo/."""
    if not WEB_ROOT.is_dir():
        return None
    relative = "index.html" if path in ("", "/") else path.lstrip("/")
    if ".." in relative.split("/") or "\\" in relative or relative.startswith("."):
        return None
    target = (WEB_ROOT / relative).resolve()
    if WEB_ROOT not in target.parents or not target.is_file():
        return None
    content_type = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    if content_type.startswith("text/") or content_type in ("application/javascript", "application/json"):
        content_type += "; charset=utf-8"
    return _response(200, target.read_bytes(), content_type)
