"""The asyncio client: many concurrent ``fill_mask`` calls over one connection, or a pool of them.

    async with FillMaskClient("ws://127.0.0.1:8765/") as client:
        predictions = await client.fill_mask("Paris is the [MASK] of France.", top_k=3)
        many = await client.fill_mask_many(texts, concurrency=16)

    # several replicas: four connections through a load balancer, or one to each of a list of servers
    async with FillMaskClient("ws://balancer:8765/", connections=4, reconnect=True) as client: ...
    async with FillMaskClient(["ws://a:8765/", "ws://b:8765/"], reconnect=True) as client: ...

How it is put together: ``connection`` is one WebSocket and the requests in flight on it (one reader
task per connection resolves each caller's future, §8); ``pool`` decides which connection a call goes
on and replaces those that go away; this module is the caller's side: one call, its retries after
``overloaded`` answers, and its resends after a connection ended without answering it.

Exactly one outcome per call, by construction: a call awaits the future of one request at a time, and
sends again only after that request has ended without an answer (its connection was lost, or the
server said ``shutting_down``/``engine_stopped``: it did not run it). So a caller never gets two
answers, nor both a result and an error.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import ssl as ssl_module
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Collection, Iterable, Sequence
from typing import Any, Literal, overload

from .connection import (
    Connection,
    NotSentError,
    is_secure,
    redact,
    request_frame,
    sleep_unless,
    url_problem,
)
from .errors import (
    ConnectError,
    ConnectionLostError,
    DeadlineExceededError,
    FillMaskError,
    OverloadedError,
    UsageError,
    check_seconds,
)
from .frames import FillMaskResult, Predictions, check_sendable, outcome, plain_number
from .pool import Pool
from .retry import ReconnectBackoff, RetryPolicy
from .wire import SERVER_GONE_REASONS, retryable

log = logging.getLogger("fillmask_client")

#: Where ``python ws_server.py`` listens by default.
DEFAULT_URL = "ws://127.0.0.1:8765/"
#: ``fill_mask_iter`` reads a generator's texts at most this many times its concurrency ahead of the
#: outcome its consumer waits for.
AHEAD = 4
#: How many times one call is sent again after a send ended without an answer. A bound, so that a
#: request which itself brings servers down (a "poison" request) cannot take a whole fleet with it.
MAX_RESENDS = 3
#: A send that comes this many ms or more after its call began waited in the client (a redial, a place
#: under ``max_inflight_per_connection``): its ``deadline_ms`` carries only what is left of the budget.
WAITED_MS = 1.0
#: The most connections one client opens to each URL: each is a socket and a task, and a server takes
#: up to its ``--max-connections`` (1000 by default) from everyone together.
MAX_CONNECTIONS = 1024


def default_concurrency(limits: dict[str, Any], per_url: int, urls: int = 1) -> int:
    """Requests one ``fill_mask_many`` or ``fill_mask_iter`` keeps in flight when not told, for ``urls``
    servers with ``per_url`` connections each: for each server, its ``max_batch_size`` for each
    connection (enough to fill its batches; 32 where ``hello`` gave none), but never more than half its
    ``max_queue``. Below that, one such call alone on a server never meets the fair-share limit
    (protocol.md §6: it applies while half the queue or more waits), for which a server with a small
    queue had refused most of a lone client's texts (429 ``queue_share``). ``limits`` is one server's
    ``hello.limits`` (replicas behind a list of URLs are alike)."""
    batch = limits.get("max_batch_size")
    width = (batch if type(batch) is int and batch > 0 else 32) * max(1, per_url)
    queue = limits.get("max_queue")
    if type(queue) is int and queue > 0:
        width = min(width, max(1, queue // 2))
    return width * max(1, urls)


def check_texts(texts: object) -> None:
    """``UsageError`` unless ``texts`` is an iterable of texts, as ``fill_mask_iter`` and
    ``fill_mask_many`` take: one text, ``None``, or an async iterable is a mistake to say, not a
    ``TypeError`` from deep inside."""
    if isinstance(texts, (str, bytes, bytearray)):
        raise UsageError("texts must be a list (or any iterable) of texts, not one text: wrap it, [text], "
                         "or call fill_mask")
    if isinstance(texts, AsyncIterable):
        raise UsageError("texts must be a list (or any iterable) of texts, not an async iterable: collect "
                         "its texts first, or call fill_mask for each as it comes")
    try:
        iter(texts)  # type: ignore[call-overload]  # (whatever list() takes: __iter__, or __getitem__ alone)
    except TypeError:
        raise UsageError(f"texts must be a list (or any iterable) of texts, not {type(texts).__name__}") from None


class FillMaskClient:
    """An asyncio client for the fill-mask server: any number of concurrent calls over one connection,
    or over a pool of connections.

    Use it as an async context manager (or call ``connect`` and ``aclose``)::

        async with FillMaskClient("ws://127.0.0.1:8765/", retry=True) as client:
            print(client.model, client.limits["max_batch_size"])
            predictions = await client.fill_mask("Paris is the [MASK] of France.")

    Options:

    - ``url``: the server's WebSocket URL, or a list of them (one per replica, without a balancer).
    - ``connections``: connections per URL (default 1). Each call goes on the connection with the fewest
      requests in flight. Behind a load balancer, several connections to its one URL spread the calls
      over several replicas; with a list of URLs, one each is usually right.
    - ``retry``: ``False`` (the default) raises ``OverloadedError`` at the first 503 ``queue_full`` or
      429 ``queue_share``;
      ``True`` retries with the default ``RetryPolicy``; or pass a ``RetryPolicy``.
    - ``reconnect``: replace a connection that goes away (the server's ``going_away`` frame, a 503
      ``shutting_down`` or ``engine_stopped`` answer, a close with 1001/1012/1013, or a connection
      dropped without a close frame, 1006) by a new one, dialled in the background after a random delay
      (exponential backoff with full jitter, the first spread over the server's ``reconnect_within_ms``,
      §10; see ``ReconnectBackoff``), and send the calls it did not answer again. Calls wait for a
      usable connection for up to ``reconnect_timeout`` seconds, then raise ``ConnectError``; a failure
      that waiting cannot fix (``ConnectError.transient`` false: a 4xx refusal for the token, origin or
      path, TLS against a plain server, a peer that is not a fill-mask server) is final. Off by default.
    - Without ``reconnect``, a connection that goes away is not replaced: the calls it did not answer
      are sent on another connection of the pool if one is usable, and once none is, calls raise at
      once (``OverloadedError`` 503 ``shutting_down`` while the server is going away,
      ``ConnectionLostError`` once the connection is lost). Other closes (1009 too big, 1008 not
      reading, 1011 server fault or missed pong) are never resent; with ``reconnect`` the pool dials
      again after 1009 and 1011 (§14), but the calls in flight then fail with ``ConnectionLostError``.
    - ``open_timeout``: seconds to open a connection and receive ``hello``.
    - ``connect_wait``: seconds ``connect()`` keeps trying while the server is still starting (its
      ``wait``, below); ``async with`` and ``SyncFillMaskClient``, which connect for you, use it.
      Default 0: one try.
    - ``token``: the server's ``--token``, sent as ``Authorization: Bearer ...`` (§12). (A ``?token=``
      in the URL works too; either way the token is hidden in messages and logs.)
    - ``ssl``: an ``ssl.SSLContext`` for ``wss://`` URLs, e.g. one that trusts a self-signed certificate;
      ``wss://`` without it verifies against the system's certificate authorities.
    - ``backoff``: the ``ReconnectBackoff`` for redials (base 0.05 s, cap 2 s by default).

    A malformed URL, or a timeout that is not a finite number of seconds, raises ``UsageError`` here.

    A connection that is going away gets no new calls, but the calls already sent on it stay there: the
    server still answers accepted work on a draining connection (§10). A call is sent again only when
    its request ended without an answer (at most ``MAX_RESENDS`` times), so each call ends exactly once.
    A fill-mask request has no side effects, so running it again elsewhere is safe.

    Calls beyond the server's ``max_inflight_per_connection`` wait in the client for a free place rather
    than being refused with ``too_many_inflight``.

    Cancelling a call (``task.cancel()``, ``asyncio.timeout``, ``asyncio.wait_for``) sends the server a
    ``cancel`` frame, so a request still queued there never reaches the model.

    The client is bound to the event loop it connected on; it is not thread-safe (see
    ``SyncFillMaskClient`` for use from threads and plain scripts).
    """

    def __init__(
        self,
        url: str | Sequence[str] = DEFAULT_URL,
        *,
        connections: int = 1,
        retry: RetryPolicy | bool = False,
        reconnect: bool = False,
        reconnect_timeout: float = 30.0,
        open_timeout: float = 10.0,
        connect_wait: float = 0.0,
        token: str | None = None,
        ssl: ssl_module.SSLContext | Literal[True] | None = None,
        backoff: ReconnectBackoff | None = None,
    ) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls or not all(isinstance(u, str) for u in urls):
            raise UsageError("url must be a WebSocket URL or a non-empty list of them")
        for each in urls:
            problem = url_problem(each)
            if problem is not None:
                raise UsageError(problem)
        if not isinstance(connections, int) or isinstance(connections, bool) or connections < 1:
            raise UsageError(f"connections must be a positive integer, not {connections!r}")
        if connections > MAX_CONNECTIONS:  # (a billion slots took all memory before a socket opened)
            raise UsageError(f"connections must be at most {MAX_CONNECTIONS} per URL, not {connections}: each is a "
                             "socket of its own, and a server takes up to its --max-connections from all clients")
        self.urls = tuple(urls)
        self.url = urls[0]
        if not isinstance(retry, (bool, RetryPolicy)):  # (a number would fail at the first 503, not here)
            hint = f": for {retry} tries, RetryPolicy(attempts={retry})" if type(retry) is int else ""
            raise UsageError(f"retry must be True, False or a RetryPolicy, not {retry!r}{hint}")
        if not isinstance(reconnect, bool):  # ("false" is true)
            raise UsageError(f"reconnect must be True or False, not {reconnect!r}")
        if ssl is not None:  # (True: the system's certificates, as websockets takes it, and as None gives wss://)
            if ssl is not True and not isinstance(ssl, ssl_module.SSLContext):
                raise UsageError(f"ssl must be an ssl.SSLContext or None, not {ssl!r}")
            plain = [each for each in urls if not is_secure(each)]
            if plain:  # (it would fail only when connecting, as a server that does not speak WebSocket)
                raise UsageError(f"ssl= is for wss:// URLs, and {redact(plain[0])!r} is ws://: use wss://, "
                                 "or leave ssl out")
        if backoff is not None and not isinstance(backoff, ReconnectBackoff):
            raise UsageError(f"backoff must be a ReconnectBackoff or None, not {backoff!r}")
        self.retry: RetryPolicy | None = RetryPolicy() if retry is True else (retry or None)
        self.reconnect_timeout = check_seconds("reconnect_timeout", reconnect_timeout)
        self.open_timeout = check_seconds("open_timeout", open_timeout, zero_ok=False)
        self.connect_wait = check_seconds("connect_wait", connect_wait)
        if token == "":
            raise UsageError("token is empty: give the server's token, or token=None to send none")
        if token is not None and not (isinstance(token, str) and token and token.strip() == token
                                      and all(" " <= c <= "~" for c in token)):
            # (The token itself stays out of the message: it is a secret, and may hold a line break.)
            raise UsageError("token must be printable ASCII without line breaks or surrounding spaces (it is "
                             "sent in the HTTP header 'Authorization: Bearer TOKEN')")
        self._token = token
        self._ssl = None if ssl is True else ssl  # (None: the system's certificates for wss://)
        self._awaiting_hello = 0
        self._pool = Pool(urls, connections, self._open, reconnect=reconnect, backoff=backoff or ReconnectBackoff())

    def __repr__(self) -> str:
        pool = self._pool
        urls = ", ".join(redact(u) for u in self.urls)
        if pool.closed:
            state = "closed"
        elif not pool.opened:
            state = "not connected"
        else:
            state = f"{pool.usable} of {len(pool.slots)} connections usable"
        return f"<FillMaskClient {urls} {state}, {self.in_flight} in flight>"

    async def __aenter__(self) -> FillMaskClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def reconnect(self) -> bool:
        """Whether connections that go away are replaced (see the class docstring)."""
        return self._pool.reconnect

    async def connect(self, *, wait: float | None = None) -> None:
        """Open the connection(s) and read ``hello``; ``ConnectError`` when no server can be used.
        Once connected, it returns at once while a connection is usable (or, with ``reconnect``, may be
        opened again); a client whose every connection ended without ``reconnect`` raises why (make a
        new client). ``UsageError`` on another event loop than the one it connected on.

        With several connections, it is enough that one opens: the others are dialled again in the
        background with ``reconnect``, or stay closed without it (a warning is logged).

        ``wait`` (default: the client's ``connect_wait``, 0 unless set): for up to this many seconds,
        try again (with backoff) while the failure is one that
        waiting may fix (``ConnectError.transient``): a server that is still loading its model (its
        port opens only then, §9), a load balancer with no replica ready yet (503). Any other failure
        (a 4xx refusal, TLS against a plain server, a peer that is not a fill-mask server) is raised at
        once, as it is. ``wait`` must be a finite number of seconds >= 0 (``UsageError`` otherwise: NaN
        would never end).
        """
        wait = self.connect_wait if wait is None else check_seconds("wait", wait)
        self._pool.check_loop()
        if self._pool.closed:
            raise ConnectionLostError(f"the client for {redact(self.url)} was closed", url=redact(self.url))
        if self._pool.opened:
            lost = self._pool.lost_for_good()
            if lost is not None:  # without reconnect, nothing would ever connect it again: say so
                raise lost
            return
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait
        backoff = self._pool.backoff
        for attempt in itertools.count():
            try:
                await self._pool.open()
                return
            except ConnectError as exc:
                if not exc.transient:
                    raise  # waiting cannot fix it: at once, as it is
                remaining = give_up - loop.time()
                if remaining <= 0:
                    if attempt == 0:
                        raise
                    raise ConnectError(f"{exc.message} (still, after trying for {wait:g} s)", url=exc.url,
                                       http_status=exc.http_status, kind=exc.kind) from exc
                # A server that is starting: no burst of attempts; the last one comes as ``wait`` ends.
                pause = min(backoff.delay(attempt + 1), remaining)
                log.debug("server not there yet (%s); trying again in %.2f s", exc, pause)
                await sleep_unless(self._pool.closed_event, pause)  # close() ends the pause
                if self._pool.closed:
                    raise self._pool.closed_error(" while it connected") from exc

    async def _open(self, url: str, on_change: Callable[[Connection], None]) -> Connection:
        """Open one connection to ``url`` (the pool's opener); counted in ``awaiting_hello`` from its
        handshake until its ``hello`` (or the failure to get one)."""
        upgraded = False

        def on_handshake() -> None:
            nonlocal upgraded
            upgraded = True
            self._awaiting_hello += 1

        try:
            return await Connection.open(url, open_timeout=self.open_timeout, token=self._token, ssl=self._ssl,
                                         on_change=on_change, on_handshake=on_handshake)
        finally:
            if upgraded:
                self._awaiting_hello -= 1

    async def close(self) -> None:
        """Close the connection(s). Calls still waiting fail promptly with ``ConnectionLostError``.
        Safe to call twice (``async with`` calls it for you)."""
        await self._pool.close()

    async def aclose(self) -> None:
        """The same as ``close()`` (the name ``contextlib.aclosing`` looks for)."""
        await self.close()

    @property
    def hello(self) -> dict[str, Any]:
        """The ``hello`` frame (§2) of the connection opened last, as received. Before ``connect()`` it
        (and ``model``, ``limits``, ``mask_token``) raises the ``ConnectionLostError`` a call would."""
        if self._pool.hello is None:
            raise self._pool.not_connected_error()
        return self._pool.hello

    @property
    def limits(self) -> dict[str, Any]:
        """The server's ``limits`` (§2): ``max_batch_size``, ``max_queue``, ``top_k``, ``max_frame_bytes``..."""
        limits = self.hello.get("limits")
        return limits if isinstance(limits, dict) else {}

    @property
    def model(self) -> str:
        """The model the server runs (its ``--model``)."""
        return str(self.hello.get("model", ""))

    @property
    def mask_token(self) -> str:
        """The literal mask string a text must contain, such as ``[MASK]``."""
        token = self.hello.get("mask_token")
        return token if isinstance(token, str) and token else "[MASK]"

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered, including abandoned ones whose answer is still due."""
        return sum(len(conn.pending) for conn in self._pool.connections())

    @property
    def usable_connections(self) -> int:
        """How many connections take new calls now (at most ``connections`` per URL)."""
        return self._pool.usable

    @property
    def waiting_for_connection(self) -> int:
        """How many calls wait for a connection to be reopened (with ``reconnect``; at most
        ``reconnect_timeout`` seconds each)."""
        return self._pool.waiting

    @property
    def awaiting_hello(self) -> int:
        """How many connections are open (the WebSocket handshake done) and wait for their ``hello``."""
        return self._awaiting_hello

    @property
    def last_connect_error(self) -> ConnectError | None:
        """Why the latest attempt to open (or reopen) a connection failed, if none opened since."""
        return self._pool.last_failure

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
        ``OverloadedError`` (``DeadlineExceededError`` for 504) or ``ConnectionLostError``; ``UsageError``,
        before sending, for what JSON cannot carry (see ``fill_mask_result``).
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

        A resend, or a send that waited in this client first (for a redial, for a place under the
        server's ``max_inflight_per_connection``, or out a back-off), carries what is left of
        ``deadline_ms`` (the caller's budget counts from this call, not from each send), and nothing is
        sent once it is spent (``DeadlineExceededError``). To bound the whole call, reconnecting
        included, wrap it in ``asyncio.timeout``.
        Values JSON cannot carry as given (a lone surrogate, a NaN or infinite number) raise
        ``UsageError`` at once, before any connection is waited for.
        """
        top_k, deadline_ms = plain_number(top_k), plain_number(deadline_ms)  # (numpy's numbers too)
        check_sendable(text, top_k=top_k, targets=targets, deadline_ms=deadline_ms)
        loop = asyncio.get_running_loop()
        started = loop.time()
        tries = resends = 0
        last: FillMaskError | None = None  # why the previous send did not end in a result
        while True:
            conn = await self._pool.acquire(self.reconnect_timeout)

            def build(request_id: int, conn: Connection = conn, last: FillMaskError | None = last) -> bytes:
                """The frame, built when it goes out: after any wait in this client (a redial, a place
                under ``max_inflight_per_connection``, a back-off the connection imposed, §6), so that
                ``deadline_ms`` carries what is left of the caller's budget then. A send that waited
                for nothing carries ``deadline_ms`` as given."""
                deadline = deadline_ms
                spent_ms = (loop.time() - started) * 1000.0
                waited = last is not None or conn.not_before > started or spent_ms >= WAITED_MS
                if waited and isinstance(deadline_ms, (int, float)):
                    deadline = deadline_ms - spent_ms
                    if deadline <= 0:
                        raise last or DeadlineExceededError.before_sending(
                            f"{spent_ms:.0f} ms went by in this client before the call could be sent (a redial, "
                            "a place under max_inflight_per_connection, or the server's retry_after_ms)")
                return request_frame(conn.limits, text, top_k, targets, deadline, request_id)

            send_by = started + deadline_ms / 1000.0 if isinstance(deadline_ms, (int, float)) else None
            try:
                frame = await conn.exchange(build, send_by)
            except NotSentError:
                continue  # it stopped taking calls before this one was sent: choose again (not a resend)
            except ConnectionLostError as exc:
                if resends < MAX_RESENDS and self._pool.may_resend(exc):
                    resends, last = resends + 1, exc
                    log.debug("resending a call after %s", exc)
                    continue
                raise
            answer = outcome(frame)
            if isinstance(answer, FillMaskResult):
                return answer
            last = answer
            if isinstance(answer, OverloadedError) and answer.reason in SERVER_GONE_REASONS:
                conn.refuse(answer)  # it does no more work there: no new calls go to it
                if resends < MAX_RESENDS and self._pool.may_resend(None):
                    resends += 1
                    continue
                raise answer
            tries += 1
            # §14: unknown reasons too; not a 504 (a DeadlineExceededError): the caller's time is spent
            again = (isinstance(answer, OverloadedError) and not isinstance(answer, DeadlineExceededError)
                     and retryable(answer.reason))
            if not (self.retry and tries < self.retry.attempts and again):
                if again:  # busy (queue_full, queue_share): what to do, in the traceback (str() stays §6's words)
                    answer.add_note("the server was busy: send fewer requests at once (a lower concurrency)"
                                    + (f"; refused {tries} times in a row" if self.retry
                                       else ", or let the client wait and resend (retry=True)"))
                raise answer
            assert isinstance(answer, OverloadedError)  # (for type checkers: ``again`` said so)
            wait = self.retry.delay(tries, answer.retry_after_ms)
            if isinstance(deadline_ms, (int, float)) and (loop.time() + wait - started) * 1000.0 >= deadline_ms:
                raise answer  # waiting alone would use up the caller's deadline
            log.debug("overloaded (%s); resending in %.3f s", answer.reason, wait)
            await sleep_unless(self._pool.closed_event, wait)  # close() ends it: the next acquire fails

    async def fill_mask_iter(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = None,
        top_k: int | None = None,
        targets: str | Sequence[str] | None = None,
        deadline_ms: float | None = None,
    ) -> AsyncGenerator[FillMaskResult | FillMaskError, None]:
        """Run ``fill_mask_result`` on every text, at most ``concurrency`` at a time; yield in input order.

        Each outcome is yielded as soon as it and all before it are ready: a ``FillMaskResult``, or the
        ``FillMaskError`` that request raised (yielded, not raised, so one bad text does not stop the rest).
        ``concurrency`` defaults to ``default_concurrency``: enough to fill each connection's batches, and
        never enough for this call alone on a server to meet its fair-share limit.

        ``texts`` that is not a collection (a generator, of any length, endless too) is read as the
        requests go, one text per request sent, at most ``AHEAD * concurrency`` texts ahead of the
        outcome the consumer waits for: a slow request at the head (a retry's back-off, a resend)
        then holds the sending back once that many have come after it. A collection (a list) is
        already in memory, and is sent as fast as ``concurrency`` allows. An exception the iterable
        raises is raised here, after the outcomes of the texts before it; so is, for a generator, the
        reason no text could be answered any more (the client closed, or every connection lost without
        ``reconnect``: one error, not one per text, which an endless generator would never end). A
        collection's texts each get their outcome (also once the client is lost for good). Closed or
        not connected from the start, it raises at once, whatever the texts. Leaving the loop early
        cancels the requests still running; wrap the iterator in ``contextlib.aclosing`` to make that
        happen at once rather than when it is garbage-collected.
        """
        check_texts(texts)
        self._pool.check_loop()  # (raised, not yielded: no text could ever get through)
        unopened = self._pool.unopened()
        if unopened is not None:  # the same (closed, or never connected): one error, not one per text
            raise unopened
        ahead = None if isinstance(texts, Collection) else AHEAD  # (a collection's texts are already held)
        source = iter(texts)
        width = concurrency
        if width is None:
            hello = self._pool.hello or {}  # not connected: each call then fails as fill_mask does
            limits = hello.get("limits")
            urls = len(self.urls)  # (the pool holds each URL's connections)
            width = default_concurrency(limits if isinstance(limits, dict) else {}, len(self._pool.slots) // urls, urls)
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise UsageError(f"concurrency must be a positive integer, not {width!r}")
        # The calls in input order, the first not yet yielded first; ``running`` counts those not done.
        # A call that ends wakes the loop below (``progress``), which sends the next text while fewer
        # than ``width`` run (and fewer than ``ahead * width`` wait to be yielded), and yields the head.
        most = None if ahead is None else ahead * width
        calls: collections.deque[asyncio.Task[FillMaskResult]] = collections.deque()
        progress = asyncio.Event()
        running = 0
        exhausted = False
        failure: Exception | None = None  # what the iterable raised; no text is read after it

        def ended(_: asyncio.Task[FillMaskResult]) -> None:
            nonlocal running
            running -= 1
            progress.set()

        try:
            while True:
                while not exhausted and running < width and (most is None or len(calls) < most):
                    hopeless = self._pool.hopeless() if ahead is not None else None
                    if hopeless is not None:  # a generator's, every connection lost for good: read no more
                        exhausted, failure = True, hopeless
                        break
                    try:
                        text = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    except Exception as exc:  # the caller's iterable: raised after what came before it
                        exhausted, failure = True, exc
                        break
                    call = asyncio.create_task(
                        self.fill_mask_result(text, top_k=top_k, targets=targets, deadline_ms=deadline_ms))
                    call.add_done_callback(ended)
                    calls.append(call)
                    running += 1
                if not calls:
                    if failure is not None:
                        raise failure
                    return
                if not calls[0].done():
                    progress.clear()
                    await progress.wait()
                    continue
                head = calls.popleft()
                error = head.exception()
                if error is None:
                    yield head.result()
                elif isinstance(error, FillMaskError):
                    yield error
                else:
                    raise error
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

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

    @overload
    async def fill_mask_many(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = ...,
        top_k: int | None = ...,
        targets: str | Sequence[str] | None = ...,
        deadline_ms: float | None = ...,
        return_exceptions: bool,
    ) -> list[Predictions] | list[Predictions | FillMaskError]: ...

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
        ``concurrency`` defaults to ``default_concurrency`` (see ``fill_mask_iter``). Every text is read
        before the first is sent (the list returned holds an outcome for each); for texts from a long or
        endless generator, use ``fill_mask_iter``, which reads them as it sends them.
        """
        check_texts(texts)
        results: list[Predictions | FillMaskError] = []
        items = list(texts)
        outcomes = self.fill_mask_iter(
            items, concurrency=concurrency, top_k=top_k, targets=targets, deadline_ms=deadline_ms
        )
        async with contextlib.aclosing(outcomes):
            async for item in outcomes:
                if isinstance(item, FillMaskError):
                    if not return_exceptions:
                        text = items[len(results)]
                        item.add_note(f"fill_mask_many: text {len(results)} of {len(items)} (from 0): "
                                      f"{text[:80]!r}{'...' if len(text) > 80 else ''}")
                        raise item
                    results.append(item)
                else:
                    results.append(item.predictions)
        return results
