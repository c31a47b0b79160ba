"""One WebSocket to one server: its ``hello``, the requests in flight on it, and whether it takes new ones.

A ``Connection`` multiplexes any number of requests: one reader task owns every incoming frame and
resolves the future of the request each terminal frame names (§8); callers only send and await their
own future. Ids are consecutive integers per connection, so they are unique among the requests in
flight without any bookkeeping beyond a counter (2**53 of them last centuries at a million a second).

A connection's life is its ``state`` (``state.py``: connecting, open, draining, closed), changed only
through ``state.transition``. Whether to use a connection, and what to do when it goes away, is the
pool's business (``pool.py``); this module only reports, through ``on_change``, the moments that decide it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http
import itertools
import logging
import re
import socket
import ssl as ssl_module
import traceback
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage, InvalidStatus, InvalidURI
from websockets.protocol import State as SocketState
from websockets.uri import parse_uri

from .errors import (
    ConnectError,
    ConnectionLostError,
    DeadlineExceededError,
    OverloadedError,
    RequestError,
    one_line,
)
from .frames import check_hello, decode_frame, encode_cancel, encode_fill_mask, terminal_id
from .state import ConnState, Event, transition
from .wire import (
    CLOSE_GOING_AWAY,
    CLOSE_SERVICE_RESTART,
    CLOSE_TRY_AGAIN_LATER,
    SERVER_GONE_REASONS,
    retryable,
    wait_hint_ms,
)

log = logging.getLogger("fillmask_client")

#: Largest server frame accepted. A result can be large (100 candidates x 8 masks x a 2000-character
#: sequence is about 2 MB); this bound only guards against a peer that is not our server.
MAX_INCOMING_BYTES = 2**26
#: The most a hello's ``max_result_bytes`` may raise that to: a guard stays against any peer.
MAX_RAISED_INCOMING_BYTES = 2**30
#: How long closing waits for the server's closing handshake before dropping the socket (websockets'
#: default, 10 s, made ``close()`` take that long against a peer that stopped reading).
CLOSE_TIMEOUT_S = 2.0
#: After a ``ws://`` handshake closed without a word, how long the probe for a TLS port may take.
TLS_PROBE_S = 2.0
#: Close codes that mean "this server is going away, another will do" (§10): going away, service restart.
GOING_AWAY_CODES = frozenset({CLOSE_GOING_AWAY, CLOSE_SERVICE_RESTART})
#: Close codes after which the same request may well succeed elsewhere: the server went away, the
#: connection dropped without a close frame (a crashed replica, a proxy that lost its backend), or the
#: server asked to try again later. Not among them: 1008/1009/1007/1002 (this client broke a rule; the
#: same would happen again) and 1011 (a server fault the caller should see).
RECONNECT_CODES = GOING_AWAY_CODES | {1006, CLOSE_TRY_AGAIN_LATER}
#: Close codes after which a ``reconnect`` pool dials the slot again (§14's table): the above, and
#: the server's 1011 (a missed pong: a stalled network; or a server fault) and 1009 (a frame over the
#: server's limit). After those two the calls that were in flight are not sent again: they fail with
#: ``ConnectionLostError``, so a request that caused them never reaches another connection.
REDIAL_CODES = RECONNECT_CODES | {1009, 1011}

_CLOSE_NAMES = {
    1000: "normal closure",
    1001: "going away",
    1006: "connection dropped without a close frame",
    1009: "message too big",
    1011: "server internal error",
    1012: "service restart",
    1013: "try again later",
    1014: "bad gateway",
}
#: Closes before the ``hello`` that a restart or a proxy without a backend gives: worth dialling again.
_GONE_BEFORE_HELLO = RECONNECT_CODES | {1014}


class NotSentError(Exception):
    """Internal: the connection stopped taking new requests before this one was sent; choose another.

    Nothing reached the server, so choosing again is not a resend.
    """


def redact(url: str) -> str:
    """``url`` with the value of a ``token`` query parameter hidden, for messages and logs (§12): its name
    read as the server reads it, percent-decoded (``tok%65n`` is ``token`` too)."""

    def hide(parameter: re.Match[str]) -> str:
        named = urllib.parse.unquote_plus(parameter[2]).lower() == "token"
        return f"{parameter[1]}{parameter[2]}=***" if named else parameter[0]

    return re.sub(r"([?&])([^=&#]*)=[^&#]*", hide, url)


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a server's WebSocket URL, as one line that shows what a valid one looks
    like; ``None`` when it can. Pure: it only parses (websockets' own rules, so a URL passed here is
    one ``connect`` accepts), and the token is hidden.

    A URL passed here holds no space and no control character: websockets would put them in the
    request line as they are, and the server answer 400 to a URL that is only mistyped."""
    blank = _blank_problem(url)
    if blank is not None:
        return f"invalid server URL {redact(url)!r}: {blank}"
    port = _port_text(url)
    if port and not (port.isascii() and port.isdigit()):  # (urllib's words: "could not be cast to integer")
        brackets = " (an IPv6 address goes in brackets: ws://[::1]:8765/)" if ":" in port else ""
        detail = f"the port {port!r} is not a number{brackets}"
    else:
        try:
            parse_uri(url)
            return None
        except InvalidURI as exc:
            detail = exc.msg
        except ValueError as exc:  # urllib's: a port out of range, a broken [IPv6] host...
            detail = str(exc) or type(exc).__name__
    detail = detail[:1].lower() + detail[1:]
    instead = _websocket_url_of(url)
    if instead is not None:
        return f"invalid server URL {redact(url)!r}: {detail}; the same server's WebSocket URL is {redact(instead)!r}"
    return f"invalid server URL {redact(url)!r}: {detail}; expected ws://HOST:PORT/ or wss://HOST:PORT/"


def _blank_problem(url: str) -> str | None:
    """Where ``url`` holds a space or a control character (a tab, a line break...), and what to do;
    ``None`` when it holds none. A URL spells them percent-encoded (``%20``); as they are, they are
    most often a copy's stray space, or two URLs given as one."""
    if re.search(r"\S\s+wss?://", url, re.IGNORECASE):
        return "it holds more than one URL; give each server's URL on its own"
    found = next(((index, char) for index, char in enumerate(url) if ord(char) <= 32 or ord(char) == 127), None)
    if found is None:
        return None
    index, char = found
    what = "a space" if char == " " else f"a control character (U+{ord(char):04X})"
    where = "at its start" if index == 0 else "at its end" if index == len(url) - 1 else f"at character {index + 1}"
    return f"it contains {what} {where}; remove it, or write it as %{ord(char):02X} if it is meant to be there"


def _port_text(url: str) -> str:
    """The port of ``url`` as written (after the host's ``:``, as urllib reads it), or ``""``."""
    try:
        host = urllib.parse.urlsplit(url).netloc.rpartition("@")[2]
    except ValueError:
        return ""
    return host.partition("]")[2].partition(":")[2] if host.startswith("[") else host.partition(":")[2]


def _preview(data: bytes) -> str:
    """The start of a frame that is not what it should be, for a message: quoted, one line, short."""
    text = data[:60].decode("utf-8", "replace")
    return repr(one_line(text, 40))


def is_secure(url: str) -> bool:
    """A ``wss://`` URL (``url_problem`` found none in it)."""
    return parse_uri(url).secure


def _websocket_url_of(url: str) -> str | None:
    """For an ``http(s)://`` address (the one the server prints for its demo page), the WebSocket URL of
    the same server: ``ws(s)://``, the same host and port, the path ``/`` (unless it is already one of
    the server's WebSocket paths, ``/`` or ``/ws``) and the same query; None for any other URL, or when
    that would not be a valid URL either."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return None
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme.lower())
    if scheme is None or not parts.netloc:
        return None
    path = parts.path if parts.path in ("/", "/ws") else "/"
    instead = urllib.parse.urlunsplit((scheme, parts.netloc, path, parts.query, ""))
    try:
        parse_uri(instead)
    except (InvalidURI, ValueError):
        return None
    return instead


#: What a refusal means when the answer does not say (a proxy's or a load balancer's empty or HTML body).
_STATUS_HINTS = {
    400: "the server did not accept the WebSocket handshake",
    401: "the server wants a token (sent as 'Authorization: Bearer TOKEN')",
    403: "forbidden: the server, or a proxy in front of it, does not let this client in",
    404: "no WebSocket endpoint at this path",
    421: "the server does not answer for this host name; use a name it serves",
    426: "the server wants another WebSocket version",
    429: "too many connections or requests from here; try again later",
    502: "the proxy could not reach a server behind it; try again later",
    503: "no server ready behind this address (starting, draining or full); try again later",
    504: "the proxy timed out waiting for a server behind it; try again later",
}


def _refusal(exc: InvalidStatus) -> tuple[int, str]:
    """The HTTP status of a refused handshake and a one-line reason, never empty: the server's own (§9:
    ``{"error": ...}``), or else what the status means."""
    status = exc.response.status_code
    try:
        body = orjson.loads(exc.response.body or b"{}")
        reason = str(body.get("error") or body.get("status") or "") if isinstance(body, dict) else ""
    except ValueError:
        reason = ""
    return status, reason or _status_meaning(status)


def _status_meaning(status: int) -> str:
    """What a refusal with ``status`` means, for an answer that does not say (``_STATUS_HINTS``, else
    the status's phrase)."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "refused"
    return _STATUS_HINTS.get(status, phrase)


#: Words for socket errors that come without a message.
_BARE_ERRORS: dict[type[OSError], str] = {ConnectionResetError: "connection reset", BrokenPipeError: "broken pipe",
                                          ConnectionAbortedError: "connection aborted"}
#: How a socket error number counts (``ConnectError.kind``), first match first.
_ERRNO_KINDS = (
    ("refused", {errno.ECONNREFUSED}),
    ("reset", {errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED}),
    ("unreachable", {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}),
    ("timeout", {errno.ETIMEDOUT}),
)


def _errnos(exc: OSError) -> list[int]:
    """The error numbers of ``exc``; for asyncio's ``OSError('Multiple exceptions: ...')`` (one per
    address of the host, such as ``::1`` and ``127.0.0.1``), which has none, those it lists."""
    if exc.errno is not None:
        return [exc.errno]
    return [int(number) for number in re.findall(r"\[Errno (\d+)\]", str(exc))]


def failure_kind(exc: OSError) -> str:
    """How a socket error that kept a WebSocket from opening counts, as a ``ConnectError.kind``
    (``errors.CONNECT_FAILURES`` says whether waiting may fix it)."""
    if isinstance(exc, ssl_module.SSLCertVerificationError):
        return "certificate"
    if isinstance(exc, (ssl_module.SSLEOFError, ssl_module.SSLZeroReturnError)):
        return "reset"  # closed in the middle of the TLS handshake
    if isinstance(exc, ssl_module.SSLError):
        return "tls"
    if isinstance(exc, socket.gaierror):
        return "unresolved"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return "reset"
    if isinstance(exc, TimeoutError):
        return "timeout"
    numbers = _errnos(exc)
    for kind, codes in _ERRNO_KINDS:
        if any(number in codes for number in numbers):
            return kind
    return "other"


def connect_failure(exc: OSError, url: str) -> str:
    """Why a WebSocket could not be opened, in a few words, never empty (``exc`` may have no message at
    all: a TLS handshake that a plain server cuts short is a bare ``ConnectionResetError``)."""
    parts = urllib.parse.urlsplit(url)
    where = _where(url)
    detail = exc.strerror or str(exc) or _BARE_ERRORS.get(type(exc), type(exc).__name__)
    if isinstance(exc, ssl_module.SSLCertVerificationError):
        why = _tls_words(exc.verify_message or detail)
        head = f"the server's TLS certificate is not trusted ({why})"
        code = getattr(exc, "verify_code", None)
        if code in _CERT_OUT_OF_DATE:  # trusting it more would not help (a TLS audit's find)
            return f"{head}: renew the certificate on the server, or check this machine's clock"
        if code == _HOSTNAME_MISMATCH:
            return (f"{head}: it is not for {parts.hostname!r}; connect with a host name it was issued for, or "
                    "give the server a certificate for this name")
        if code == _IP_ADDRESS_MISMATCH:
            return (f"{head}: it is not for the address {parts.hostname!r}; connect with a host name or address "
                    "it was issued for, or give the server a certificate for this address")
        return (f"{head}; to trust it, pass ssl=ssl.create_default_context(cafile=PATH) with its certificate "
                "(e.g. the server's cert.pem), or with the certificate of the authority that issued it")
    tls = parts.scheme == "wss"
    if tls and isinstance(exc, (ssl_module.SSLError, ConnectionResetError, BrokenPipeError)):
        return (f"the TLS handshake with {where} failed ({_tls_words(detail)}); if that server speaks plain "
                f"WebSocket, use ws:// instead of wss://")
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name {parts.hostname!r} ({detail})"
    if isinstance(exc, ConnectionRefusedError) or (exc.errno is None and failure_kind(exc) == "refused"):
        return f"connection refused: nothing listens on {where} (is the server running, on that port?)"
    if isinstance(exc, ConnectionResetError):
        return f"{where} reset the connection during the handshake ({detail})"
    return detail


#: OpenSSL's tag and the line of CPython's _ssl.c around the words of an ``SSLError``: internals, not words.
_OPENSSL_TAG = re.compile(r"^\[SSL(?:: [A-Z0-9_]+)?\]\s*")
_SSL_SOURCE_LINE = re.compile(r"\s*\(_ssl\.c:\d+\)$")
#: OpenSSL's reasons that have plainer words for a person connecting a WebSocket: what OpenSSL before 3.2
#: and from 3.2 on say when a plain (not TLS) server answers a TLS client.
_TLS_PLAIN_WORDS = {"wrong version number": "the answer was not TLS", "record layer failure": "the answer was not TLS"}


#: OpenSSL's verification codes (X509_V_ERR_*) after which trusting the certificate cannot help: not yet
#: valid, expired; and a certificate issued for another host name, or for another IP address (a URL
#: whose host is an address, such as wss://127.0.0.1:8765/, is checked against the certificate's
#: addresses, not its names).
_CERT_OUT_OF_DATE = frozenset({9, 10})
_HOSTNAME_MISMATCH = 62
_IP_ADDRESS_MISMATCH = 64


def _tls_words(detail: str) -> str:
    """An ``SSLError``'s words without OpenSSL's tag and CPython's source line
    (``[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)`` is "the answer was not TLS");
    other details as they are, and "no reason given" where nothing is left."""
    words = _SSL_SOURCE_LINE.sub("", _OPENSSL_TAG.sub("", detail)).strip()
    return _TLS_PLAIN_WORDS.get(words, words or "no reason given")


def _where(url: str) -> str:
    """``host:port`` of a WebSocket URL, the port filled in from the scheme when the URL has none; an IPv6
    address in brackets, as in the URL (``[::1]:8765``)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    return f"{f'[{host}]' if ':' in host else host}:{parts.port or (443 if parts.scheme == 'wss' else 80)}"


def _not_websocket(url: str, answer: str) -> str:
    """The words for an HTTP server that answered the upgrade with ``answer`` instead of ``101``."""
    return (f"{_where(url)} is an HTTP server but not a WebSocket server (it answered the upgrade with "
            f"{answer}); check the address and the port")


def bad_answer(exc: InvalidMessage, url: str) -> tuple[str, int | None, str]:
    """``(kind, http_status, why)`` for a handshake answer websockets could not read as HTTP/1.1.

    Judged from what websockets' parser reports as the cause: the peer closed without a word (a proxy
    whose backend is not up yet, or a TLS server reached with ``ws://``: it waits for a TLS hello), an
    HTTP status line it does not accept (``python3 -m http.server`` answers in HTTP/1.0: its status is
    then judged like any refusal), or bytes that are not HTTP at all.
    """
    cause = exc.__cause__
    tls_hint = "" if url.startswith("wss://") else "; if that server speaks TLS, use wss:// instead of ws://"
    if isinstance(cause, EOFError):
        return "reset", None, f"{_where(url)} closed the connection without answering the handshake{tls_hint}"
    text = str(cause) if cause is not None else ""
    status_line = re.search(r"HTTP/\d(?:\.\d)? (\d{3})\b[^\r\n]*", text)
    if status_line is not None:
        status = int(status_line[1])
        if status >= 400:
            return "http", status, f"refused the connection (HTTP {status}): {_status_meaning(status)}"
        return "not_websocket", status, _not_websocket(url, status_line[0])
    return "not_http", None, f"{exc} ({text or 'nothing readable'}){tls_hint}"


async def speaks_tls(url: str, timeout: float) -> bool:
    """Whether the server of ``url`` completes a TLS handshake within ``timeout`` seconds (any
    certificate: this asks only which protocol the port speaks, and sends nothing after the handshake)."""
    parts = urllib.parse.urlsplit(url)
    context = ssl_module.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl_module.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(
            parts.hostname, parts.port or 80, ssl=context, server_hostname=parts.hostname or None), timeout)
    except (OSError, TimeoutError, ValueError):
        return False
    writer.transport.abort()  # asked and answered: no closing handshake to wait for
    return True


async def sleep_unless(event: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``event`` is set meanwhile (``close()``, a connection that stops)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


def _give_back(slots: asyncio.Semaphore, place: asyncio.Future[Any]) -> None:
    """Give ``slots`` back the place ``place`` (a task of ``slots.acquire()``) took, or stop it taking
    one: a cancelled ``acquire`` that was already woken passes its place on to the next waiter."""
    if not place.done():
        place.cancel()
    elif not place.cancelled() and place.exception() is None:
        slots.release()


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
    if type(max_bytes) is int and len(data) > max_bytes:
        raise RequestError(
            "frame_too_large",
            f"the request is {len(data)} bytes; the server accepts frames of at most {max_bytes} bytes"
            " (limits.max_frame_bytes): shorten the text or the targets",
        )
    return data


class Connection:
    """One open WebSocket, its ``hello``, and the requests in flight on it.

    Invariants:

    - ``state`` changes only in ``_move`` (``state.transition``). ``lost`` is set in the same step as
      the move to ``closed`` and ``notice`` in the same step as the move to ``draining``; neither
      changes afterwards (the first notice is the one kept).

    - ``pending`` holds every id sent on this socket whose terminal frame has not arrived, mapped to the
      future its caller awaits. A caller that gives up cancels its future but leaves the entry: the
      terminal frame that still comes is then recognised and dropped, and the id stays reserved while the
      server may still answer to it.
    - Once the reader has failed the table (``closed``), nothing is added to it: ``exchange`` checks
      ``usable`` and registers with no ``await`` in between, and the reader moves to ``closed`` and
      empties the table with no ``await`` in between. So no call can wait on a connection that will
      never answer.
    - Once ``draining``, no new request is sent here (§10: "send nothing more here"), while the requests
      already sent keep waiting for the answers the server still owes them.
    - ``on_change`` is called after each move, and when an unusable connection's last request ends;
      never while ``pending`` is half updated.
    - When the server announces ``max_inflight_per_connection`` (§12), ``slots`` holds that many permits
      and a request holds one from just before it is registered until its entry leaves ``pending``
      (permits taken == ``len(pending)``). Calls beyond the limit wait here instead of being refused
      with ``too_many_inflight``; abandoned requests keep their permit, as the server still counts them.
    """

    def __init__(self, ws: ClientConnection, url: str, on_change: Callable[[Connection], None] | None = None) -> None:
        self.ws = ws
        self.url = url
        self.state = ConnState.CONNECTING
        #: The server's ``hello`` (§2), once ``open``.
        self.hello: dict[str, Any] = {}
        self.limits: dict[str, Any] = {}
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        #: How the connection ended, once ``closed``.
        self.lost: ConnectionLostError | None = None
        #: Why it takes no more work, once ``draining``: the server's ``going_away`` (§10), as the 503
        #: ``shutting_down`` it stands for, or its ``shutting_down``/``engine_stopped`` answer (§6); kept
        #: to tell later callers exactly what the server said (``frame`` is that frame).
        self.notice: OverloadedError | None = None
        self.on_change = on_change
        #: Calls that chose this connection and wait for a permit or for ``not_before`` (they count in ``load``).
        self.waiting = 0
        #: The loop time before which no request is sent here: the latest 503 ``queue_full`` or 429
        #: ``queue_share`` told this connection to wait ``retry_after_ms`` (§6, Back-off). The server
        #: counts a refusal as early per connection, so every call here waits, not only the refused
        #: one's resend: otherwise other calls' sends in that window double the wait, then close 1008.
        self.not_before = 0.0
        self._closed_by_client = False
        #: Set once the connection stops taking work (draining, closed, or closing by this client): it
        #: wakes calls waiting out ``not_before``, which then fail or choose another connection at once.
        self._stopped = asyncio.Event()
        self.slots: asyncio.Semaphore | None = None
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.reader: asyncio.Task[None] | None = None  # started with the move to ``open``

    def _move(self, event: Event) -> bool:
        """Apply ``event`` to ``state`` (the only place it changes); whether the state changed."""
        before = self.state
        self.state = transition(before, event)
        if self.state in (ConnState.DRAINING, ConnState.CLOSED):
            self._stopped.set()
        return self.state is not before

    def _greeted(self, hello: dict[str, Any]) -> None:
        """The ``hello`` was acceptable: ``open``, with the server's limits, and its reader running."""
        self.hello = hello
        limits = hello.get("limits")
        self.limits = limits if isinstance(limits, dict) else {}
        limit = self.limits.get("max_inflight_per_connection")
        self.slots = asyncio.Semaphore(limit) if type(limit) is int and limit > 0 else None
        largest = self.limits.get("max_result_bytes")
        if type(largest) is int and largest + 1024 > MAX_INCOMING_BYTES:  # §14: at least max_result_bytes + 1 KiB
            self.ws.protocol.max_message_size = min(largest + 1024, MAX_RAISED_INCOMING_BYTES)
        if self._move(Event.HELLO):
            self.reader = asyncio.create_task(self._read(), name=f"fillmask-client-reader {redact(self.url)}")

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        open_timeout: float,
        token: str | None,
        ssl: ssl_module.SSLContext | None,
        on_change: Callable[[Connection], None] | None = None,
        on_handshake: Callable[[], None] | None = None,
    ) -> Connection:
        """Open the WebSocket and read the ``hello`` (§2); ``ConnectError`` on any failure, with its
        ``kind`` (whether waiting may fix it is ``ConnectError.transient``'s call, not this method's).

        ``on_handshake`` is called once the WebSocket is open, before the wait for the ``hello``.
        ``open_timeout`` bounds the handshake and the ``hello`` together, not each."""
        shown = redact(url)
        give_up = asyncio.get_running_loop().time() + open_timeout
        options: dict[str, Any] = {"open_timeout": open_timeout, "max_size": MAX_INCOMING_BYTES,
                                   "close_timeout": CLOSE_TIMEOUT_S}
        if token:
            options["additional_headers"] = {"Authorization": f"Bearer {token}"}
        if ssl is not None:
            options["ssl"] = ssl
        # Set while the connection (TCP, and TLS for wss://) of the latest hop is made, so that a timeout
        # says which part stalled (a redirect ends one hop's connection before the next is made).
        transport_made = asyncio.Event()

        class Watched(ClientConnection):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                transport_made.set()
                super().connection_made(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                transport_made.clear()
                super().connection_lost(exc)

        options["create_connection"] = Watched
        connecting = connect(url, **options)
        try:
            ws = await connecting
        except InvalidURI as exc:
            if exc.uri != url:  # the server redirected there
                raise ConnectError(f"cannot connect to {shown}: it redirected to {redact(exc.uri)!r}, which is "
                                   "not a ws:// or wss:// URL", url=shown, kind="not_websocket") from exc
            raise ConnectError(f"invalid server URL {shown!r}: expected ws://HOST:PORT/ or wss://...",
                               url=shown) from exc
        except InvalidStatus as exc:
            status, reason = _refusal(exc)
            if status < 400:  # not a refusal: an HTTP server that does not speak WebSocket here
                phrase = f"HTTP {status} {exc.response.reason_phrase}".rstrip()
                raise ConnectError(f"cannot connect to {shown}: {_not_websocket(url, phrase)}", url=shown,
                                   http_status=status, kind="not_websocket") from exc
            raise ConnectError(f"{shown} refused the connection (HTTP {status}): {reason}", url=shown,
                               http_status=status) from exc
        except InvalidMessage as exc:
            kind, answered, why = bad_answer(exc, url)
            if kind == "reset" and url.startswith("ws://") and await speaks_tls(url, min(open_timeout, TLS_PROBE_S)):
                # Closed without a word: a proxy whose backend is not up, or a TLS port. Only the
                # second is final, and it answers a TLS hello: then say so, and stop waiting.
                secure = "wss://" + url[len("ws://"):]
                kind, why = "tls_expected", f"{_where(url)} speaks TLS: use {redact(secure)} (wss://, not ws://)"
            message = f"{shown} {why}" if kind == "http" else f"cannot connect to {shown}: {why}"
            raise ConnectError(message, url=shown, http_status=answered, kind=kind) from exc
        except InvalidHandshake as exc:  # a 101 without the right headers, a redirect loop...
            detail = str(exc) or type(exc).__name__
            raise ConnectError(f"cannot connect to {shown}: {detail}", url=shown, kind="not_websocket") from exc
        except TimeoutError as exc:
            if transport_made.is_set():
                stalled = ("connected, but no answer to the WebSocket handshake came (a server too busy to "
                           "answer, or a port that does not speak WebSocket?)")
            elif connecting.uri.startswith("wss://"):  # (TLS: made once its handshake is; the hop's URL)
                stalled = ("no TLS session was made (a host that is down, a firewall that drops packets, or a "
                           "port that does not speak TLS?)")
            else:
                stalled = "no connection was made (a host that is down, or a firewall that drops packets?)"
            raise ConnectError(f"cannot connect to {shown}: timed out after {open_timeout:g} s: {stalled}",
                               url=shown, kind="timeout") from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {shown}: {connect_failure(exc, url)}", url=shown,
                               kind=failure_kind(exc)) from exc
        except ValueError as exc:  # a redirect to an address websockets cannot use (port 99999), or ssl= with ws://
            redirected = any(step.name == "process_redirect" for step in traceback.extract_tb(exc.__traceback__))
            why = f"it redirected to an unusable address ({exc})" if redirected else str(exc)
            raise ConnectError(f"cannot connect to {shown}: {why}", url=shown, kind="not_websocket") from exc
        conn = cls(ws, url, on_change)
        if on_handshake is not None:
            on_handshake()
        kind = "bad_hello"
        try:
            left = max(0.0, give_up - asyncio.get_running_loop().time())
            first = await asyncio.wait_for(ws.recv(decode=False), left)
            hello = decode_frame(first)
            problem = check_hello(hello)
        except orjson.JSONDecodeError:
            problem = f"the server's first frame is not JSON: {_preview(first)}; is it a fill-mask server?"
        except TimeoutError:  # (its message is empty)
            kind, problem = "no_hello", (f"connected, but no hello frame came within {open_timeout:g} s "
                                         "(is this a fill-mask server?)")
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else 1006
            kind = "gone_before_hello" if code in _GONE_BEFORE_HELLO else "closed_before_hello"
            said = f": {exc.rcvd.reason}" if exc.rcvd is not None and exc.rcvd.reason else ""
            problem = f"the connection closed before the hello frame ({code} {_CLOSE_NAMES.get(code, 'closed')}{said})"
        except ValueError as exc:
            problem = f"no valid hello frame ({exc})"
        except BaseException:  # cancelled while waiting for the hello: leave no open socket behind
            conn._move(Event.CLOSE)
            ws.transport.abort()
            raise
        if problem is not None:
            conn._move(Event.CLOSE)
            if kind == "bad_hello":
                # A peer this client cannot use: its close frame goes out, and no closing handshake is
                # waited for (a peer that does not answer one held the failure up for CLOSE_TIMEOUT_S).
                ws.close_timeout = 0
            await ws.close()
            raise ConnectError(f"cannot use {shown}: {problem}", url=shown, kind=kind)
        conn._greeted(hello)
        return conn

    @property
    def usable(self) -> bool:
        """``open``, and the socket too (not already closing): new requests may be sent."""
        return self.state is ConnState.OPEN and self.ws.state is SocketState.OPEN

    @property
    def closing(self) -> bool:
        """The socket is closing, and the reader has not yet moved to ``closed`` (it will, within
        websockets' close timeout): how the connection ended is not known yet."""
        return self.state is not ConnState.CLOSED and self.ws.state is not SocketState.OPEN

    @property
    def load(self) -> int:
        """Requests sent and unanswered here, plus calls waiting for a permit to send here."""
        return len(self.pending) + self.waiting

    @property
    def went_away(self) -> bool:
        """The server is shutting this connection down on purpose (§10); another connection may work."""
        return self.notice is not None or self.ws.close_code in GOING_AWAY_CODES

    @property
    def reconnect_window(self) -> float | None:
        """Seconds over which the server asked its clients to spread their reconnects, if it said (§10, §6)."""
        hint = self.notice.retry_after_ms if self.notice is not None else None
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
        sent = self.ws.protocol.close_sent
        if self.ws.protocol.close_rcvd is None and sent is not None and sent.code != 1000:
            # This client failed the connection (a ping with no pong: 1011; a frame over its read limit:
            # 1009). Said in the text only: ``code`` stays the 1006 that decides resends and redials.
            detail += f"; this client closed it: {sent.code} {sent.reason}".rstrip()
        return ConnectionLostError(f"connection to {url} lost ({detail})", url=url, code=code, reason=reason)

    def gone_error(self) -> OverloadedError | ConnectionLostError:
        """Why this connection takes no new request, as a fresh exception: while ``draining``, what the
        server said (``notice``); otherwise how the connection ended."""
        notice = self.notice
        if self.state is ConnState.DRAINING and notice is not None:
            return OverloadedError(notice.status, notice.reason, notice.retry_after_ms, frame=notice.frame)
        return self.lost_error()

    def refuse(self, answer: OverloadedError) -> None:
        """The server answered ``shutting_down``/``engine_stopped`` here (§6): it takes no more work."""
        self._drain(answer)

    def _drain(self, notice: OverloadedError) -> None:
        if self._move(Event.GOING_AWAY):
            self.notice = notice
            log.info("%s takes no more work (%s)", redact(self.url), notice.reason)
            self._changed()

    async def exchange(self, build: Callable[[int], bytes], send_by: float | None = None) -> dict[str, Any]:
        """Send the frame ``build(id)`` under a fresh id and return that request's terminal frame.

        ``send_by`` is the loop time after which sending is pointless (the call's ``deadline_ms``): a
        back-off (§6) that would last past it raises ``DeadlineExceededError`` at once, and a wait for a
        place among this connection's ``max_inflight_per_connection`` requests that outlasts it raises
        it then; nothing is sent either way.

        Raises ``NotSentError`` when the connection is not ``usable``, or stops taking work while this
        call waits for a place or a back-off (nothing was sent: choose another),
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
                await self._take_place(self.slots, send_by)
            finally:
                self.waiting -= 1
        self.waiting += 1
        try:
            await self._back_off(send_by)
        except BaseException:
            if self.slots is not None:
                self.slots.release()
            raise
        finally:
            self.waiting -= 1
        if not self.usable:  # went away (or was lost) while this call waited for a permit or the back-off
            if self.slots is not None:
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

    async def _take_place(self, slots: asyncio.Semaphore, send_by: float | None) -> None:
        """A place among this connection's ``max_inflight_per_connection`` requests (held on return).
        The wait ends early, holding none, when the connection stops taking work (``_stopped``:
        ``NotSentError``, so the call chooses another connection or fails at once, §10) or at
        ``send_by`` (``DeadlineExceededError``)."""
        if not slots.locked():
            await slots.acquire()  # (a place is free: no wait)
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        place = asyncio.ensure_future(slots.acquire())
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            timeout = None if send_by is None else max(0.0, send_by - started)
            await asyncio.wait((place, stopped), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # (cancelled meanwhile)
            _give_back(slots, place)
            raise
        finally:
            stopped.cancel()
        if place.done() and not place.cancelled() and self.usable:
            return
        _give_back(slots, place)
        if not self.usable:
            raise NotSentError
        waited = (loop.time() - started) * 1000
        raise DeadlineExceededError.before_sending(
            f"waited {waited:.0f} ms for one of this connection's max_inflight_per_connection places, past the "
            "call's deadline_ms")

    async def _back_off(self, send_by: float | None) -> None:
        """Wait until ``not_before`` (again, if a refusal moved it meanwhile) or until the connection
        stops taking work (``_stopped`` wakes the wait at once); ``DeadlineExceededError`` at once when
        the wait would end after ``send_by``."""
        loop = asyncio.get_running_loop()
        while self.usable and (delay := self.not_before - loop.time()) > 0:
            if send_by is not None and self.not_before > send_by:
                raise DeadlineExceededError.before_sending(
                    f"the server asked this connection to wait {delay * 1000:.0f} ms more (retry_after_ms), "
                    "past the call's deadline_ms")
            await sleep_unless(self._stopped, delay)

    async def _cancel(self, request_id: int, *, after: Awaitable[None] | None) -> None:
        """Send ``cancel`` for an abandoned request, once its own frame is out, unless it already ended."""
        with contextlib.suppress(ConnectionClosed):
            if after is not None:
                await after
            if request_id in self.pending and self.state is not ConnState.CLOSED:
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
            self._move(Event.CLOSE)
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
                reason = frame.get("reason")  # §14: a reason this client does not know reads as shutting_down
                reason = reason if reason in SERVER_GONE_REASONS else "shutting_down"
                self._drain(OverloadedError(503, reason, wait_hint_ms(frame.get("reconnect_within_ms")), frame=frame))
            elif frame["type"] == "error":
                log.warning("server error not tied to a request of ours: %s", frame)
            return
        if frame["type"] == "overloaded" and retryable(frame.get("reason")) and frame.get("status") != 504:
            wait_ms = wait_hint_ms(frame.get("retry_after_ms"))  # at most WAIT_HINT_CAP_MS
            if wait_ms:
                self.not_before = max(self.not_before, asyncio.get_running_loop().time() + wait_ms / 1000)
        future = self._forget(request_id)
        if future is None:
            log.warning("terminal frame for id %s, which is not in flight: %s", request_id, frame)
            return
        if not future.done():  # a done (cancelled) future belongs to a caller who gave up
            future.set_result(frame)
        if not self.pending and not self.usable:
            self._changed()  # the last answer owed on a connection that takes no new work

    async def close(self) -> None:
        """Close the WebSocket; calls still waiting fail with ``ConnectionLostError`` (those waiting out
        a back-off at once, the others when the socket has closed: within ``CLOSE_TIMEOUT_S``). Cancelled
        while it waits for the server's side of the closing handshake, it cuts the socket: no transport
        is left open behind a close that nobody waits for any more."""
        self._closed_by_client = True
        self._stopped.set()
        try:
            await self.ws.close()
        except asyncio.CancelledError:
            self.ws.transport.abort()
            raise
        if self.reader is not None:
            await self.reader
        await asyncio.gather(*self._tasks, return_exceptions=True)
