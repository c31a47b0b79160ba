"""The asyncio client: many concurrent ``fill_mask`` calls multiplexed over one WebSocket.

    async with FillMaskClient("ws://127.0.0.1:8765/") as client:
        predictions = await client.fill_mask("Paris is the [MASK] of France.", top_k=3)
        many = await client.fill_mask_many(texts, concurrency=16)

How it is put together: one reader task per connection owns every incoming frame and resolves the
future of the request each terminal frame names (§8); callers only send and await their own future.
Ids are consecutive integers per connection, so they are unique among the requests in flight without
any bookkeeping beyond a counter (2**53 of them last centuries at a million requests a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import re
import ssl as ssl_module
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Literal, overload

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.protocol import State

from .errors import ConnectError, ConnectionLostError, FillMaskError, OverloadedError, RequestError
from .frames import (
    FillMaskResult,
    Predictions,
    check_hello,
    decode_frame,
    encode_cancel,
    encode_fill_mask,
    outcome,
    terminal_id,
)
from .retry import RetryPolicy, reconnect_delays

log = logging.getLogger("fillmask_server.client")

#: Where ``python ws_server.py`` listens by default.
DEFAULT_URL = "ws://127.0.0.1:8765/"
#: Close codes that mean "this server is going away, another will do" (§10): going away, service restart.
GOING_AWAY_CODES = frozenset({1001, 1012})
#: Largest server frame accepted. A result can be large (100 candidates x 8 masks x a 2000-character
#: sequence is about 2 MB); this bound only guards against a peer that is not our server.
MAX_INCOMING_BYTES = 2**26
#: How many times one call is resent after its connection went away (1001/1012, ``shutting_down``...).
MAX_RESENDS = 3
#: 503 reasons meaning "this server will not do it" (§6): not retried here; followed by ``reconnect``.
SERVER_GONE_REASONS = frozenset({"shutting_down", "engine_stopped"})

_CLOSE_NAMES = {
    1000: "normal closure",
    1001: "going away",
    1006: "connection dropped without a close frame",
    1009: "message too big",
    1011: "server internal error",
    1012: "service restart",
}


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


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Done-callback that marks a future's exception as retrieved.

    A request's future can fail (connection lost) in the same loop iteration as its caller is cancelled;
    nobody awaits it then, and asyncio would log "exception was never retrieved" for a normal event.
    """
    if not future.cancelled():
        future.exception()


def _request_frame(
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


class _Connection:
    """One open WebSocket, its ``hello``, and the requests in flight on it.

    Invariants:

    - ``pending`` holds every id sent on this socket whose terminal frame has not arrived, mapped to the
      future its caller awaits. A caller that gives up cancels its future but leaves the entry: the
      terminal frame that still comes is then recognised and dropped, and the id stays reserved while the
      server may still answer to it.
    - Once the reader has failed the table (``lost`` is set), nothing is added to it: ``exchange`` checks
      ``lost`` and registers with no ``await`` in between, and the reader sets ``lost`` and empties the
      table with no ``await`` in between. So no call can wait on a connection that will never answer.
    - When the server announces ``max_inflight_per_connection`` (§12), ``slots`` holds that many permits
      and a request holds one from just before it is registered until its entry leaves ``pending``
      (permits taken == ``len(pending)``). Calls beyond the limit wait here instead of being refused
      with ``too_many_inflight``; abandoned requests keep their permit, as the server still counts them.
    """

    def __init__(self, ws: ClientConnection, hello: dict[str, Any], url: str) -> None:
        self.ws = ws
        self.hello = hello
        self.url = url
        limits = hello.get("limits")
        self.limits: dict[str, Any] = limits if isinstance(limits, dict) else {}
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.lost: ConnectionLostError | None = None
        #: The server answered ``shutting_down`` or ``engine_stopped`` here (§6, §10): it takes no more work.
        self.draining = False
        self._closed_by_client = False
        limit = self.limits.get("max_inflight_per_connection")
        self.slots = asyncio.Semaphore(limit) if isinstance(limit, int) and limit > 0 else None
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.reader = asyncio.create_task(self._read(), name=f"fillmask-client-reader {redact(url)}")

    @classmethod
    async def open(
        cls, url: str, *, open_timeout: float, token: str | None, ssl: ssl_module.SSLContext | None
    ) -> _Connection:
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
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise ConnectError(f"cannot connect to {shown}: timed out after {open_timeout:g} s", url=shown) from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {shown}: {exc.strerror or exc}", url=shown) from exc
        try:
            hello = decode_frame(await asyncio.wait_for(ws.recv(decode=False), open_timeout))
            problem = check_hello(hello)
        except (TimeoutError, asyncio.TimeoutError, ConnectionClosed, ValueError) as exc:
            problem = f"no valid hello frame ({type(exc).__name__}: {exc})"
        if problem is not None:
            await ws.close()
            raise ConnectError(f"cannot use {shown}: {problem}", url=shown)
        return cls(ws, hello, url)

    @property
    def went_away(self) -> bool:
        """The server is shutting this connection down on purpose (§10); another connection may work."""
        return self.draining or self.ws.close_code in GOING_AWAY_CODES

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

    async def exchange(self, build: Callable[[int], bytes]) -> dict[str, Any]:
        """Send the frame ``build(id)`` under a fresh id and return that request's terminal frame.

        Raises ``ConnectionLostError`` when the connection ends first. If the calling task is cancelled
        the request is abandoned: the request frame is still sent whole (it is shielded: a half-sent frame
        would break the connection for everyone), a ``cancel`` frame follows it (§5), and the terminal frame
        that still arrives is dropped by the reader.
        """
        if self.lost is not None:
            raise self.lost_error()
        if self.slots is not None:
            await self.slots.acquire()
            if self.lost is not None:  # woken by the reader failing the table
                self.slots.release()
                raise self.lost_error()
        request_id = next(self._ids)
        try:
            data = build(request_id)
        except BaseException:
            if self.slots is not None:
                self.slots.release()
            raise
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
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

    def _dispatch(self, data: bytes) -> None:
        try:
            frame = decode_frame(data)
        except ValueError as exc:
            log.warning("ignoring an unreadable frame from %s: %s", redact(self.url), exc)
            return
        request_id = terminal_id(frame)
        if request_id is None:
            if frame["type"] == "error":
                log.warning("server error not tied to a request of ours: %s", frame)
            return
        future = self._forget(request_id)
        if future is None:
            log.warning("terminal frame for id %s, which is not in flight: %s", request_id, frame)
        elif not future.done():  # a done (cancelled) future belongs to a caller who gave up
            future.set_result(frame)

    async def close(self) -> None:
        """Close the WebSocket; calls still waiting fail with ``ConnectionLostError``."""
        self._closed_by_client = True
        await self.ws.close()
        await self.reader
        await asyncio.gather(*self._tasks, return_exceptions=True)


class FillMaskClient:
    """An asyncio client for the fill-mask server: one connection, any number of concurrent calls.

    Use it as an async context manager (or call ``connect`` and ``aclose``)::

        async with FillMaskClient("ws://127.0.0.1:8765/", retry=True) as client:
            print(client.model, client.limits["max_batch_size"])
            predictions = await client.fill_mask("Paris is the [MASK] of France.")

    Options:

    - ``retry``: ``False`` (the default) raises ``OverloadedError`` at the first 503 ``queue_full``;
      ``True`` retries with the default ``RetryPolicy``; or pass a ``RetryPolicy``.
    - ``reconnect``: when the server closes the connection with 1001/1012, or answers ``shutting_down``
      (a restart, §10) or ``engine_stopped`` (a failed server, §6), open a new connection, retrying for up
      to ``reconnect_timeout`` seconds (a 4xx refusal is final), and resend the calls that had no answer
      yet (a fill-mask request has no side effects, so a resend is safe). Off by default. Other closes
      (1006 dropped, 1009 too big, 1008 not reading, ...) are never reconnected: pending and later calls
      raise ``ConnectionLostError``, and a new client is needed.
    - ``open_timeout``: seconds to open the connection and receive ``hello``.
    - ``token``: the server's ``--token``, sent as ``Authorization: Bearer ...`` (§12). (A ``?token=``
      in the URL works too; either way the token is hidden in messages and logs.)
    - ``ssl``: an ``ssl.SSLContext`` for ``wss://`` URLs, e.g. one that trusts a self-signed certificate;
      ``wss://`` without it verifies against the system's certificate authorities.

    Calls beyond the server's ``max_inflight_per_connection`` wait in the client for a free place rather
    than being refused with ``too_many_inflight``.

    Cancelling a call (``task.cancel()``, ``asyncio.timeout``, ``asyncio.wait_for``) sends the server a
    ``cancel`` frame, so a request still queued there never reaches the model.

    The client is bound to the event loop it connected on; it is not thread-safe (see
    ``SyncFillMaskClient`` for use from threads and plain scripts).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        retry: RetryPolicy | bool = False,
        reconnect: bool = False,
        reconnect_timeout: float = 30.0,
        open_timeout: float = 10.0,
        token: str | None = None,
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        self.url = url
        self.retry: RetryPolicy | None = RetryPolicy() if retry is True else (retry or None)
        self.reconnect = reconnect
        self.reconnect_timeout = reconnect_timeout
        self.open_timeout = open_timeout
        self._token = token
        self._ssl = ssl
        self._conn: _Connection | None = None
        self._retired: set[_Connection] = set()
        self._dial_lock = asyncio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._conn else "not connected")
        return f"<FillMaskClient {redact(self.url)} {state}, {self.in_flight} in flight>"

    async def __aenter__(self) -> FillMaskClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def connect(self) -> None:
        """Open the connection and read ``hello``; ``ConnectError`` when the server cannot be used."""
        if self._closed:
            raise ConnectionLostError(f"the client for {redact(self.url)} was closed", url=redact(self.url))
        if self._conn is None:
            self._conn = await self._open(self.open_timeout)

    async def _open(self, open_timeout: float) -> _Connection:
        return await _Connection.open(self.url, open_timeout=open_timeout, token=self._token, ssl=self._ssl)

    async def aclose(self) -> None:
        """Close the connection(s). Calls still waiting fail promptly with ``ConnectionLostError``."""
        self._closed = True
        connections = [*self._retired, *([self._conn] if self._conn else [])]
        self._retired.clear()
        await asyncio.gather(*(c.close() for c in connections))

    def _require(self) -> _Connection:
        if self._conn is None:
            raise RuntimeError("FillMaskClient is not connected: use 'async with FillMaskClient(url) as client'")
        return self._conn

    @property
    def hello(self) -> dict[str, Any]:
        """The server's ``hello`` frame on the current connection (§2), as received."""
        return self._require().hello

    @property
    def limits(self) -> dict[str, Any]:
        """The server's ``limits`` (§2): ``max_batch_size``, ``max_queue``, ``top_k``, ``max_frame_bytes``..."""
        return self._require().limits

    @property
    def model(self) -> str:
        """The model the server runs (its ``--model``)."""
        return str(self.hello.get("model", ""))

    @property
    def mask_token(self) -> str:
        """The literal mask string a text must contain, such as ``[MASK]``."""
        return str(self.hello.get("mask_token", "[MASK]"))

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered, including abandoned ones whose answer is still due."""
        connections = [*self._retired, *([self._conn] if self._conn else [])]
        return sum(len(c.pending) for c in connections)

    async def _connection(self) -> _Connection:
        """The connection to send on: the current one, or (with ``reconnect``) a fresh one if it went away.

        A loop, not a recursion: when a call waited for the dial lock and the connection dialled meanwhile
        is already gone too, it goes round again *after releasing the lock* (an ``asyncio.Lock`` is not
        reentrant: taking it again while holding it would hang this call and every later reconnect).
        """
        while True:
            conn = self._require()
            if conn.lost is None and conn.ws.state is not State.OPEN:
                # Closing: let the reader finish (within websockets' close_timeout) so that `lost` and the
                # close code are settled, rather than sending into a closing socket again and again.
                await asyncio.shield(conn.reader)
            if conn.lost is None and not (self.reconnect and conn.draining):
                return conn
            if self._closed:
                raise ConnectionLostError(f"the client for {redact(self.url)} was closed", url=redact(self.url))
            if not (self.reconnect and conn.went_away):
                raise conn.lost_error()
            async with self._dial_lock:
                if self._conn is not conn:  # another call reconnected while this one waited: look at that one
                    continue
                fresh = await self._redial()
                if conn.lost is None:  # draining: let it finish the requests it holds, then forget it
                    self._retired.add(conn)
                    conn.reader.add_done_callback(lambda _, old=conn: self._retired.discard(old))
                self._conn = fresh
                log.info("reconnected to %s", redact(self.url))
                return fresh

    async def _redial(self) -> _Connection:
        """Open a fresh connection, retrying refusals and failures for up to ``reconnect_timeout`` seconds.

        A 4xx refusal (token, origin, path) will not change by waiting, so it is raised at once.
        """
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.reconnect_timeout
        last: ConnectError | None = None
        for delay in reconnect_delays():
            try:
                return await self._open(max(0.1, min(self.open_timeout, give_up - loop.time())))
            except ConnectError as exc:
                if exc.http_status is not None and 400 <= exc.http_status < 500:
                    raise
                last = exc
            if loop.time() + delay > give_up:
                break
            await asyncio.sleep(delay)
        assert last is not None  # the loop only ends by returning or after a failed attempt
        raise ConnectError(f"could not reconnect within {self.reconnect_timeout:g} s: {last.message}",
                           url=redact(self.url), http_status=last.http_status) from last

    async def fill_mask(
        self,
        text: str,
        *,
        top_k: int | None = None,
        targets: str | Sequence[str] | None = None,
        deadline_ms: float | None = None,
    ) -> Predictions:
        """Fill the mask(s) in ``text``: the pipeline's predictions for it (§4).

        A text with one mask gives a list of ``{score, token, token_str, sequence}`` dicts, best first;
        a text with several masks gives one such list per mask. ``top_k``, ``targets`` and ``deadline_ms``
        are sent as given (see §3); ``None`` leaves the server's default. Raises ``RequestError``,
        ``OverloadedError`` (``DeadlineExceededError`` for 504) or ``ConnectionLostError``.
        """
        result = await self.fill_mask_result(text, top_k=top_k, targets=targets, deadline_ms=deadline_ms)
        return result.predictions

    async def fill_mask_result(
        self,
        text: str,
        *,
        top_k: int | None = None,
        targets: str | Sequence[str] | None = None,
        deadline_ms: float | None = None,
    ) -> FillMaskResult:
        """Like ``fill_mask``, but return the whole ``result``: predictions, timings and the raw frame.

        With retry or reconnect on, a resend carries what is left of ``deadline_ms`` (the caller's budget
        counts from this call, not from each send), and no resend happens once it is spent. To bound the
        whole call, reconnecting included, wrap it in ``asyncio.timeout``.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        tries = resends = 0
        last: FillMaskError | None = None  # why the previous send did not end in a result
        while True:
            deadline = deadline_ms
            if last is not None and isinstance(deadline_ms, (int, float)):
                deadline = deadline_ms - (loop.time() - started) * 1000.0
                if deadline <= 0:
                    raise last
            conn = await self._connection()
            try:
                frame = await conn.exchange(
                    functools.partial(_request_frame, conn.limits, text, top_k, targets, deadline)
                )
            except ConnectionLostError as exc:
                if self.reconnect and not self._closed and conn.went_away and resends < MAX_RESENDS:
                    resends, last = resends + 1, exc
                    continue
                raise
            answer = outcome(frame)
            if isinstance(answer, FillMaskResult):
                return answer
            last = answer
            if isinstance(answer, OverloadedError) and answer.reason in SERVER_GONE_REASONS:
                conn.draining = True
                if self.reconnect and resends < MAX_RESENDS:
                    resends += 1
                    continue
                raise answer
            tries += 1
            retryable = type(answer) is OverloadedError and answer.reason == "queue_full"
            if not (self.retry and tries < self.retry.attempts and retryable):
                raise answer
            wait = self.retry.delay(tries, answer.retry_after_ms)
            if isinstance(deadline_ms, (int, float)) and (loop.time() + wait - started) * 1000.0 >= deadline_ms:
                raise answer  # waiting alone would use up the caller's deadline
            log.debug("overloaded (%s); resending in %.3f s", answer.reason, wait)
            await asyncio.sleep(wait)

    async def fill_mask_iter(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = None,
        top_k: int | None = None,
        targets: str | Sequence[str] | None = None,
        deadline_ms: float | None = None,
    ) -> AsyncIterator[FillMaskResult | FillMaskError]:
        """Run ``fill_mask_result`` on every text, at most ``concurrency`` at a time; yield in input order.

        Each outcome is yielded as soon as it and all before it are ready: a ``FillMaskResult``, or the
        ``FillMaskError`` that request raised (yielded, not raised, so one bad text does not stop the rest).
        ``concurrency`` defaults to the server's ``max_batch_size``, enough to fill its batches. Leaving the
        loop early cancels the requests still running; wrap the iterator in ``contextlib.aclosing`` to make
        that happen at once rather than when the iterator is garbage-collected.
        """
        items = list(texts)
        width = self.limits.get("max_batch_size", 32) if concurrency is None else concurrency
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"concurrency must be a positive integer, not {width!r}")
        loop = asyncio.get_running_loop()
        slots: list[asyncio.Future[FillMaskResult]] = [loop.create_future() for _ in items]
        for slot in slots:
            slot.add_done_callback(_retrieve)
        order = iter(range(len(items)))

        async def work() -> None:
            for index in order:  # one shared iterator: each index is taken by exactly one worker
                try:
                    result: FillMaskResult | BaseException = await self.fill_mask_result(
                        items[index], top_k=top_k, targets=targets, deadline_ms=deadline_ms
                    )
                except Exception as exc:
                    result = exc
                slot = slots[index]
                if slot.done():  # the consumer was cancelled while awaiting it
                    continue
                if isinstance(result, FillMaskResult):
                    slot.set_result(result)
                else:
                    slot.set_exception(result)

        workers = [asyncio.create_task(work()) for _ in range(min(width, len(items)))]
        try:
            for slot in slots:
                try:
                    yield await slot
                except FillMaskError as exc:
                    yield exc
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    @overload
    async def fill_mask_many(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = ...,
        top_k: int | None = ...,
        targets: str | Sequence[str] | None = ...,
        deadline_ms: float | None = ...,
        return_exceptions: Literal[False] = ...,
    ) -> list[Predictions]: ...

    @overload
    async def fill_mask_many(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = ...,
        top_k: int | None = ...,
        targets: str | Sequence[str] | None = ...,
        deadline_ms: float | None = ...,
        return_exceptions: Literal[True],
    ) -> list[Predictions | FillMaskError]: ...

    async def fill_mask_many(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = None,
        top_k: int | None = None,
        targets: str | Sequence[str] | None = None,
        deadline_ms: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Predictions] | list[Predictions | FillMaskError]:
        """``fill_mask`` for every text, at most ``concurrency`` in flight; predictions in input order.

        The first error is raised and the requests still running are cancelled, unless
        ``return_exceptions`` is true: then each failed text's exception takes its place in the list.
        ``concurrency`` defaults to the server's ``max_batch_size``.
        """
        results: list[Predictions | FillMaskError] = []
        outcomes = self.fill_mask_iter(
            texts, concurrency=concurrency, top_k=top_k, targets=targets, deadline_ms=deadline_ms
        )
        async with contextlib.aclosing(outcomes):
            async for item in outcomes:
                if isinstance(item, FillMaskError):
                    if not return_exceptions:
                        raise item
                    results.append(item)
                else:
                    results.append(item.predictions)
        return results
