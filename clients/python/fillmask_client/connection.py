"""One WebSocket to one server: its ``hello``, the requests in flight on it, and whether it takes new ones.

A ``Connection`` multiplexes any number of requests: one reader task owns every incoming frame and
resolves the future of the request each terminal frame names (§8); callers only send and await their
own future. Ids are consecutive integers per connection, so they are unique among the requests in
flight without any bookkeeping beyond a counter (2**53 of them last centuries at a million a second).

Whether to use a connection, and what to do when it goes away, is the pool's business (``pool.py``);
this module only reports, through ``on_change``, the moments that decide it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import ssl as ssl_module
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.protocol import State

from .errors import ConnectError, ConnectionLostError, OverloadedError, RequestError
from .frames import check_hello, decode_frame, encode_cancel, encode_fill_mask, terminal_id
from .wire import CLOSE_GOING_AWAY, CLOSE_SERVICE_RESTART, CLOSE_TRY_AGAIN_LATER

log = logging.getLogger("fillmask_client")

#: Largest server frame accepted. A result can be large (100 candidates x 8 masks x a 2000-character
#: sequence is about 2 MB); this bound only guards against a peer that is not our server.
MAX_INCOMING_BYTES = 2**26
#: Close codes that mean "this server is going away, another will do" (§10): going away, service restart.
GOING_AWAY_CODES = frozenset({CLOSE_GOING_AWAY, CLOSE_SERVICE_RESTART})
#: Close codes after which the same request may well succeed elsewhere: the server went away, the
#: connection dropped without a close frame (a crashed replica, a proxy that lost its backend), or the
#: server asked to try again later. Not among them: 1008/1009/1007/1002 (this client broke a rule; the
#: same would happen again) and 1011 (a server fault the caller should see).
RECONNECT_CODES = GOING_AWAY_CODES | {1006, CLOSE_TRY_AGAIN_LATER}

_CLOSE_NAMES = {
    1000: "normal closure",
    1001: "going away",
    1006: "connection dropped without a close frame",
    1009: "message too big",
    1011: "server internal error",
    1012: "service restart",
    1013: "try again later",
}


class NotSentError(Exception):
    """Internal: the connection stopped taking new requests before this one was sent; choose another.

    Nothing reached the server, so choosing again is not a resend.
    """


def redact(url: str) -> str:
    """``url`` with the value of a ``token`` query parameter hidden, for messages and logs (§12)."""
    return re.sub(r"(?i)([?&]token=)[^&#]*", r"\1***", url)


def _refusal(exc: InvalidStatus) -> tuple[int, str]:
    """The HTTP status of a refused handshake and the server's one-line reason (§9: ``{"error": ...}``)."""
    status = exc.response.status_code
    try:
        reason = str(orjson.loads(exc.response.body or b"{}").get("error", ""))
    except (ValueError, AttributeError):
        reason = ""
    return status, reason


def retrieve(future: asyncio.Future[Any]) -> None:
    """Done-callback that marks a future's exception as retrieved.

    A request's future can fail (connection lost) in the same loop iteration as its caller is cancelled;
    nobody awaits it then, and asyncio would log "exception was never retrieved" for a normal event.
    """
    if not future.cancelled():
        future.exception()


def request_frame(
    limits: dict[str, Any],
    text: str,
    top_k: int | None,
    targets: str | Sequence[str] | None,
    deadline_ms: float | None,
    request_id: int,
) -> bytes:
    """The ``fill_mask`` frame, refused locally (``frame_too_large``) when the server could not take it.

    A frame over ``limits.max_frame_bytes`` makes the server close the connection with 1009 (§1), which
    would fail every other call in flight on it; failing this one call instead is the whole point.
    """
    data = encode_fill_mask(request_id, text, top_k=top_k, targets=targets, deadline_ms=deadline_ms)
    max_bytes = limits.get("max_frame_bytes")
    if isinstance(max_bytes, int) and len(data) > max_bytes:
        raise RequestError(
            "frame_too_large",
            f"the request is {len(data)} bytes; the server accepts frames of at most {max_bytes} bytes"
            " (limits.max_frame_bytes): shorten the text or the targets",
        )
    return data


class Connection:
    """One open WebSocket, its ``hello``, and the requests in flight on it.

    Invariants:

    - ``pending`` holds every id sent on this socket whose terminal frame has not arrived, mapped to the
      future its caller awaits. A caller that gives up cancels its future but leaves the entry: the
      terminal frame that still comes is then recognised and dropped, and the id stays reserved while the
      server may still answer to it.
    - Once the reader has failed the table (``lost`` is set), nothing is added to it: ``exchange`` checks
      ``usable`` and registers with no ``await`` in between, and the reader sets ``lost`` and empties the
      table with no ``await`` in between. So no call can wait on a connection that will never answer.
    - The same holds for ``going_away`` and ``refused``: once either is set, no new request is sent here
      (§10: "send nothing more here"), while the requests already sent keep waiting for the answers the
      server still owes them. Both flags, and ``lost``, only ever go from unset to set.
    - ``on_change`` is called after each of those moments, and when an unusable connection's last
      request ends; never while ``pending`` is half updated.
    - When the server announces ``max_inflight_per_connection`` (§12), ``slots`` holds that many permits
      and a request holds one from just before it is registered until its entry leaves ``pending``
      (permits taken == ``len(pending)``). Calls beyond the limit wait here instead of being refused
      with ``too_many_inflight``; abandoned requests keep their permit, as the server still counts them.
    """

    def __init__(self, ws: ClientConnection, hello: dict[str, Any], url: str,
                 on_change: Callable[[Connection], None] | None = None) -> None:
        self.ws = ws
        self.hello = hello
        self.url = url
        limits = hello.get("limits")
        self.limits: dict[str, Any] = limits if isinstance(limits, dict) else {}
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.lost: ConnectionLostError | None = None
        #: The server's ``going_away`` frame (§10), once received: no new requests go here.
        self.going_away: dict[str, Any] | None = None
        #: The server answered a request here ``shutting_down`` or ``engine_stopped`` (§6): it does no
        #: more work on this connection; kept to tell later callers exactly what it said.
        self.refused: OverloadedError | None = None
        self.on_change = on_change
        #: Calls that chose this connection and wait for a permit (they count in ``load``).
        self.waiting = 0
        self._closed_by_client = False
        limit = self.limits.get("max_inflight_per_connection")
        self.slots = asyncio.Semaphore(limit) if isinstance(limit, int) and limit > 0 else None
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.reader = asyncio.create_task(self._read(), name=f"fillmask-client-reader {redact(url)}")

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        open_timeout: float,
        token: str | None,
        ssl: ssl_module.SSLContext | None,
        on_change: Callable[[Connection], None] | None = None,
    ) -> Connection:
        """Open the WebSocket and read the ``hello`` (§2); ``ConnectError`` on any failure."""
        shown = redact(url)
        options: dict[str, Any] = {"open_timeout": open_timeout, "max_size": MAX_INCOMING_BYTES}
        if token:
            options["additional_headers"] = {"Authorization": f"Bearer {token}"}
        if ssl is not None:
            options["ssl"] = ssl
        try:
            ws = await connect(url, **options)
        except InvalidURI as exc:
            raise ConnectError(f"invalid server URL {shown!r}: expected ws://HOST:PORT/ or wss://...",
                               url=shown) from exc
        except InvalidStatus as exc:
            status, reason = _refusal(exc)
            detail = f": {reason}" if reason else ""
            raise ConnectError(f"{shown} refused the connection (HTTP {status}){detail}", url=shown,
                               http_status=status) from exc
        except InvalidHandshake as exc:
            raise ConnectError(f"cannot connect to {shown}: {exc}", url=shown) from exc
        except TimeoutError as exc:
            raise ConnectError(f"cannot connect to {shown}: timed out after {open_timeout:g} s", url=shown) from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {shown}: {exc.strerror or exc}", url=shown) from exc
        try:
            hello = decode_frame(await asyncio.wait_for(ws.recv(decode=False), open_timeout))
            problem = check_hello(hello)
        except (TimeoutError, ConnectionClosed, ValueError) as exc:
            problem = f"no valid hello frame ({type(exc).__name__}: {exc})"
        if problem is not None:
            await ws.close()
            raise ConnectError(f"cannot use {shown}: {problem}", url=shown)
        return cls(ws, hello, url, on_change)

    @property
    def usable(self) -> bool:
        """Open, and the server has not said it takes no more work here: new requests may be sent."""
        return (self.lost is None and self.going_away is None and self.refused is None
                and self.ws.state is State.OPEN)

    @property
    def load(self) -> int:
        """Requests sent and unanswered here, plus calls waiting for a permit to send here."""
        return len(self.pending) + self.waiting

    @property
    def went_away(self) -> bool:
        """The server is shutting this connection down on purpose (§10); another connection may work."""
        return self.going_away is not None or self.refused is not None or self.ws.close_code in GOING_AWAY_CODES

    @property
    def reconnect_window(self) -> float | None:
        """Seconds over which the server asked its clients to spread their reconnects, if it said (§10, §6)."""
        hint = None
        if self.going_away is not None:
            hint = self.going_away.get("reconnect_within_ms")
        elif self.refused is not None:
            hint = self.refused.retry_after_ms
        return hint / 1000.0 if isinstance(hint, (int, float)) and not isinstance(hint, bool) and hint >= 0 else None

    def lost_error(self) -> ConnectionLostError:
        """A fresh exception describing how this connection ended (one per caller: tracebacks differ)."""
        url = redact(self.url)
        if self._closed_by_client:
            return ConnectionLostError(f"the client for {url} was closed", url=url, code=1000)
        code, reason = self.ws.close_code, self.ws.close_reason or ""
        what = _CLOSE_NAMES.get(code, "closed") if code is not None else "closed"
        detail = f"{code} {what}" if code is not None else what
        if reason:
            detail += f": {reason}"
        return ConnectionLostError(f"connection to {url} lost ({detail})", url=url, code=code, reason=reason)

    def gone_error(self) -> OverloadedError | ConnectionLostError:
        """Why this connection takes no new request: what the server said (``going_away`` as the
        ``overloaded`` 503 ``shutting_down`` it stands for, §10), or how the connection ended."""
        if self.refused is not None:
            return OverloadedError(self.refused.status, self.refused.reason, self.refused.retry_after_ms,
                                   frame=self.refused.frame)
        if self.going_away is not None and self.lost is None:
            hint = self.going_away.get("reconnect_within_ms")
            return OverloadedError(503, str(self.going_away.get("reason") or "shutting_down"),
                                   hint if isinstance(hint, (int, float)) else None, frame=self.going_away)
        return self.lost_error()

    def refuse(self, answer: OverloadedError) -> None:
        """Record that the server answered ``shutting_down``/``engine_stopped`` here: no new requests."""
        if self.refused is None:
            self.refused = answer
            self._changed()

    async def exchange(self, build: Callable[[int], bytes]) -> dict[str, Any]:
        """Send the frame ``build(id)`` under a fresh id and return that request's terminal frame.

        Raises ``NotSentError`` when the connection is not ``usable`` (nothing was sent: choose another),
        ``ConnectionLostError`` when the connection ends after the frame went out. If the calling task is
        cancelled the request is abandoned: the request frame is still sent whole (it is shielded: a
        half-sent frame would break the connection for everyone), a ``cancel`` frame follows it (§5), and
        the terminal frame that still arrives is dropped by the reader.
        """
        if not self.usable:
            raise NotSentError
        if self.slots is not None:
            self.waiting += 1
            try:
                await self.slots.acquire()
            finally:
                self.waiting -= 1
            if not self.usable:  # went away (or was lost) while this call waited for a permit
                self.slots.release()
                raise NotSentError
        request_id = next(self._ids)
        try:
            data = build(request_id)
        except BaseException:
            if self.slots is not None:
                self.slots.release()
            raise
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        future.add_done_callback(retrieve)
        self.pending[request_id] = future
        send = asyncio.ensure_future(self.ws.send(data, text=True))
        try:
            await asyncio.shield(send)
        except asyncio.CancelledError:
            future.cancel()
            self._spawn(self._cancel(request_id, after=send))
            raise
        except ConnectionClosed:
            self._forget(request_id)
            future.cancel()
            raise self.lost_error() from None
        try:
            return await future
        except asyncio.CancelledError:
            # Our future was cancelled with us. Its entry stays until the server's terminal frame arrives.
            if request_id in self.pending:
                self._spawn(self._cancel(request_id, after=None))
            raise

    async def _cancel(self, request_id: int, *, after: Awaitable[None] | None) -> None:
        """Send ``cancel`` for an abandoned request, once its own frame is out, unless it already ended."""
        with contextlib.suppress(ConnectionClosed):
            if after is not None:
                await after
            if request_id in self.pending and self.lost is None:
                await self.ws.send(encode_cancel(request_id), text=True)

    def _forget(self, request_id: int) -> asyncio.Future[dict[str, Any]] | None:
        """Remove a request from ``pending`` and give back its permit; its future, or None if not there."""
        future = self.pending.pop(request_id, None)
        if future is not None and self.slots is not None:
            self.slots.release()
        return future

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    async def _read(self) -> None:
        """Route every incoming frame to its request until the connection ends; then fail the rest."""
        try:
            while True:
                self._dispatch(await self.ws.recv(decode=False))
        except ConnectionClosed:
            pass
        except Exception:  # a bug here must not leave callers waiting on a socket nobody reads
            log.exception("fill-mask client reader failed; closing %s", redact(self.url))
            self._spawn(self.ws.close(1011))
        finally:
            self.lost = self.lost_error()
            for request_id in list(self.pending):
                future = self._forget(request_id)  # the permit wakes a call waiting for one; it sees `lost`
                if future is not None and not future.done():
                    future.set_exception(self.lost_error())
            self._changed()

    def _dispatch(self, data: bytes) -> None:
        try:
            frame = decode_frame(data)
        except ValueError as exc:
            log.warning("ignoring an unreadable frame from %s: %s", redact(self.url), exc)
            return
        request_id = terminal_id(frame)
        if request_id is None:
            if frame["type"] == "going_away":
                if self.going_away is None:
                    log.info("%s is going away (%s)", redact(self.url), frame.get("reason"))
                    self.going_away = frame
                    self._changed()
            elif frame["type"] == "error":
                log.warning("server error not tied to a request of ours: %s", frame)
            return
        future = self._forget(request_id)
        if future is None:
            log.warning("terminal frame for id %s, which is not in flight: %s", request_id, frame)
            return
        if not future.done():  # a done (cancelled) future belongs to a caller who gave up
            future.set_result(frame)
        if not self.pending and not self.usable:
            self._changed()  # the last answer owed on a connection that takes no new work

    async def close(self) -> None:
        """Close the WebSocket; calls still waiting fail with ``ConnectionLostError``."""
        self._closed_by_client = True
        await self.ws.close()
        await self.reader
        await asyncio.gather(*self._tasks, return_exceptions=True)
