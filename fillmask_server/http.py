"""The HTTP front: plain HTTP routes, and the decision on every WebSocket handshake (protocol.md §9, §12).

``HttpFront.process_request`` is websockets' ``process_request`` hook: it runs on the event loop for
every incoming HTTP request, before any upgrade, and returns either a complete ``Response`` (plain
HTTP, or a refused handshake) or ``None`` (let the WebSocket handshake go on). It reads the server's
state through ``FrontState`` callables and never blocks. ``process_response`` (websockets' hook after
its own handshake checks) and ``front_connection.FrontConnection`` (websockets' connection, for requests
too broken to reach the hooks) turn the library's plain-text refusals into this server's JSON ones.
``FrontConnection`` also hands each whole text message to the server as soon as it is parsed
(``on_message``), without websockets' queue and a task switch per message, when nothing read before it
is still queued.

Invariants:

- Every answer is a complete response with ``Content-Length``, JSON unless it is a file or metrics;
  every refusal is ``{"error": "<one line>"}``. A HEAD answer is the GET answer without its body.
- Every request passes, in this order: well-formed (400: one value of each header we decide on, a
  valid ``Host``), the method (405: GET or HEAD), the ``Host`` rule (421; ``/healthz`` and ``/readyz``
  are exempt). A handshake then passes the path (404), the Origin rule (403), the token (401),
  readiness (503) and ``--max-connections`` (503), then websockets' own RFC 6455 checks (505, 426 and
  400, in protocol.md §9's order).
  The connection count is read here and the connection becomes OPEN before the loop runs anything
  else (websockets sends the 101 without yielding after these synchronous hooks), so concurrent
  handshakes cannot overshoot the limit.
- A malformed request costs at most one log line per ``LOG_INTERVAL_S`` (per kind), never a traceback.
- Nothing outside ``web_demo/`` is ever served as a file.
"""

from __future__ import annotations

import asyncio
import email.utils
import http
import logging
import mimetypes
import re
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import (
    HeaderLineTooLong,
    InvalidHandshake,
    InvalidHeader,
    InvalidHeaderValue,
    InvalidMethod,
    InvalidProtocol,
    InvalidUpgrade,
    RequestLineTooLong,
    TooManyHeaders,
)
from websockets.http11 import Request, Response

from .access import HostPolicy, OriginPolicy, ProxyPolicy, parse_host, presented_token, token_matches
from .config import Config
from .connection import cut
from .front_connection import FrontConnection, unanswered
from .metrics import Metrics

log = logging.getLogger(__name__)

WEBSOCKET_PATHS = ("/", "/ws")
# The demo page: ``web_demo/`` of a checkout (editable installs too), else the copy a wheel installs
# inside the package (pyproject.toml maps it there).
_CHECKOUT_WEB_ROOT = Path(__file__).resolve().parent.parent / "web_demo"
WEB_ROOT = _CHECKOUT_WEB_ROOT if _CHECKOUT_WEB_ROOT.is_dir() else Path(__file__).resolve().parent / "web_demo"

ALLOWED_METHODS = ("GET", "HEAD")  # case-sensitive (RFC 9110 §9.1): "get" is another method
PROBE_PATHS = ("/healthz", "/readyz")  # answer any Host: load balancers and Kubernetes probe by address or any name
# Headers whose value decides something here. A second line of one of them makes the request
# ambiguous (which origin? which token? which host?), so it is refused rather than guessed at.
# RFC 9110 §5.3 would let a recipient join the list-valued ones (Upgrade, Accept); no browser,
# WebSocket client or Prometheus sends them twice, so refusing costs nothing and keeps one rule.
SINGLE_VALUED_HEADERS = ("Host", "Origin", "Authorization", "Upgrade", "Accept", "Sec-WebSocket-Key",
                         "Sec-WebSocket-Version")
LOG_INTERVAL_S = 10.0
_METHOD = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP method: a token, RFC 9110 §5.6.2 and §9.1
_CONTROL = re.compile(r"[\x00-\x20\x7f]")  # no request target holds these (RFC 9112 §3.2, RFC 3986)
#: websockets' refusal of a request line whose version is well-formed (RFC 9112 §2.3) but neither 1.1 nor 1.0.
_OTHER_VERSION = re.compile(r"^unsupported protocol;[^:]*: \S+ \S+ HTTP/[0-9]\.[0-9]$")

TOKEN_HELP = ("missing or wrong token; send it as the header 'Authorization: Bearer TOKEN' or as one query "
              "parameter ?token=TOKEN, URL-encoded (a + in it as %2B)")


@dataclass(frozen=True)
class FrontState:
    """What the HTTP front reads of the server, each a cheap callable safe on the event loop."""

    accepting: Callable[[], bool]  # loaded and not draining: new connections are welcome
    unready: Callable[[], bool]  # a drain has begun: /readyz answers 503
    engine_alive: Callable[[], bool]
    connections: Callable[[], int]  # WebSocket connections open or closing (not handshakes in progress)


#: Connections accepted whose WebSocket handshake is not done, or whose HTTP answer is not taken yet,
#: each hold memory (up to websockets' 128 header lines of 8 KiB) for up to its open timeout (10 s), and
#: nothing else bounds how many there are (``--max-connections`` counts open WebSocket connections):
#: at most this many, or a quarter of ``--max-connections`` where that is more (§12). One past it makes
#: room by resetting the oldest of them that has sent no whole request, so clients that open
#: connections and send nothing (or a byte now and then) cannot keep a probe or a client that asks at
#: once from getting in; where every one has sent its request, the newcomer is reset instead. But the
#: server accepts before it reads: a burst of connections accepted at once (clients reconnecting after
#: a drain) has sent nothing the server has read yet. So one from which nothing has been read, accepted
#: less than ``UNFINISHED_GRACE_S`` ago, is not reset to make room: where every one without a whole
#: request is such, the newcomer is let in past the bound, up to ``unfinished_ceiling``
#: (``--max-connections``, or this bound where that is more). Once a connection's grace has passed with
#: nothing read, it counts as one that sends nothing, and those past the bound are reset then, oldest
#: first, with those that took no answer (``_trim_unfinished``): past the bound, connections stay for
#: about a grace. A handshake whose request the server has read and not yet answered (a burst's, a
#: moment before its 101) lets newcomers in past the bound too, where every other one has sent its
#: request: only answers that clients do not take make a newcomer be reset.
MIN_UNFINISHED = 256

#: Seconds a connection is given, from its accept, to have its first bytes read before it counts as one
#: that sends nothing (``MIN_UNFINISHED``): longer than a client's request takes to follow its TCP
#: handshake on most networks (a round trip), far shorter than the open timeout.
UNFINISHED_GRACE_S = 1.0


class HttpFront:
    """Answers plain HTTP and decides WebSocket handshakes for one server (see the module docstring)."""

    def __init__(self, config: Config, origins: OriginPolicy, tls: bool, metrics: Metrics,
                 state: FrontState) -> None:
        self.config = config
        self.origins = origins
        self.hosts = HostPolicy.parse(config.allowed_hosts, listen=config.host)
        self.proxies = ProxyPolicy.parse(config.forwarded_allow_ips)
        self.tls = tls
        self.metrics = metrics
        self.state = state
        self.log = LogThrottle(log, LOG_INTERVAL_S, schedule=on_the_loop)
        # Connections accepted and not yet upgraded or ended, oldest first, each with when it was accepted
        # (``time.monotonic``); and of those, the ones nothing has been read from yet, and the ones that
        # sent part of a request, in the same order (kept as they read: ``read_from``), so that choosing
        # whom to reset costs the same however many there are.
        self._unfinished: dict[FrontConnection, float] = {}
        self._unread: dict[FrontConnection, float] = {}
        self._partial: dict[FrontConnection, float] = {}
        self.max_unfinished = max(MIN_UNFINISHED, config.max_connections // 4)
        self.unfinished_ceiling = max(self.max_unfinished, config.max_connections)
        self._trim: asyncio.TimerHandle | None = None  # ``_trim_unfinished``, when some are past the bound

    def peer(self, connection: ServerConnection) -> str:
        """``connection``'s client for a log line (``peer``, with this server's ``--forwarded-allow-ips``)."""
        return peer(connection, self.proxies)

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """websockets' hook: a response for plain HTTP and refused handshakes; None lets a handshake go on."""
        response = self._answer(connection, request)
        if response is not None and request.method == "HEAD":
            return Response(response.status_code, response.reason_phrase, response.headers, b"")
        return response

    def _answer(self, connection: ServerConnection, request: Request) -> Response | None:
        headers = request.headers
        problem = request_line_problem(request) or header_problem(request)
        if problem is not None:
            if asks_for_websocket(headers):
                self.metrics.handshakes_refused.labels("bad_request").inc()
            return self._refuse_bad_request(connection, 400, problem)
        if request.method not in ALLOWED_METHODS:
            if asks_for_websocket(headers):
                self.metrics.handshakes_refused.labels("bad_request").inc()
            method = request.method if len(request.method) <= 20 else "this method"  # (a token: request_line_problem)
            return json_response(405, {"error": f"{method} is not allowed here; use GET or HEAD (method names are "
                                        "case-sensitive)"}, [("Allow", ", ".join(ALLOWED_METHODS))])
        handshake = request.method == "GET" and asks_for_websocket(headers)
        # Well-formed (header_problem); None only in HTTP/1.0, which predates it.
        target, host = origin_form(request.path, headers.get("Host"))
        if target is None:
            if handshake:
                self.metrics.handshakes_refused.labels("bad_request").inc()
            return self._refuse_bad_request(connection, 400, "the request target is neither a path nor an "
                                            "http:// or https:// URL with a host; send 'GET / HTTP/1.1'")
        path = target.split("?", 1)[0]
        if host is not None and path not in PROBE_PATHS and not self._answers_for(host):
            if handshake:
                self.metrics.handshakes_refused.labels("host").inc()
            self.log.warning("host", "refused %s %s from %s with 421: Host %r is not in --allowed-hosts",
                             request.method, _shorten(path), self.peer(connection), _shorten(host))
            return json_response(421, {"error": f"this server does not answer for the host {_shorten(host)!r}; use "
                                        "its address or an allowed name, or its operator can allow this one with "
                                        "--allowed-hosts"})
        if handshake:
            return self._handshake(connection, target, host, request)
        if path == "/healthz":
            return json_response(200, {"status": "ok"})
        if path == "/readyz":
            if self.state.unready():
                return json_response(503, {"status": "draining"})
            if not self.state.engine_alive():
                return json_response(503, {"status": "engine_stopped"})
            return json_response(200, {"status": "ready"})
        if path == "/metrics":
            if not token_matches(self.config.token, presented_token(headers.get("Authorization"), target)):
                self.log.warning("token", "refused %s /metrics from %s with 401: missing or wrong token",
                                 request.method, self.peer(connection))
                return json_response(401, {"error": TOKEN_HELP}, [("WWW-Authenticate", "Bearer")])
            body, content_type = self.metrics.render(headers.get("Accept"))
            return response(200, body, content_type)
        static = static_file(path)
        if static is not None:
            return static
        return json_response(404, {"error": f"not found: nothing at {_shorten(path)!r}; this server answers "
                                    "/healthz, /readyz, /metrics and the demo page at /, and WebSocket "
                                    "connections at /"})

    def _answers_for(self, host: str) -> bool:
        authority = parse_host(host)
        return authority is not None and self.hosts.allows(authority, self.tls)

    def _handshake(self, connection: ServerConnection, target: str, host: str | None,
                   request: Request) -> Response | None:
        """``target``: the path and query; ``host``: the host it was sent to (``origin_form``)."""
        headers = request.headers
        path = target.split("?", 1)[0]
        if path not in WEBSOCKET_PATHS:
            return self._refuse("not_found", 404, f"no WebSocket endpoint at {path[:100]}; connect to /")
        if not self.origins.allows(headers.get("Origin"), host, self.tls):
            # Logged (at most once per LOG_INTERVAL_S of each kind): who was refused access, never the token.
            self.log.warning("origin", "refused a WebSocket handshake from %s with 403: Origin %r is not in "
                             "--allowed-origins", self.peer(connection), _shorten(headers.get("Origin") or ""))
            return self._refuse("origin", 403, "pages of this origin may not connect to this server; its "
                                "operator can allow them with --allowed-origins")
        if not token_matches(self.config.token, presented_token(headers.get("Authorization"), target)):
            self.log.warning("token", "refused a WebSocket handshake from %s with 401: missing or wrong token",
                             self.peer(connection))
            return self._refuse("token", 401, TOKEN_HELP, [("WWW-Authenticate", "Bearer")])
        if not self.state.accepting():
            return self._refuse("unavailable", 503, "server is shutting down; reconnect later")
        if not self.state.engine_alive():
            return self._refuse("unavailable", 503, "the server's model worker stopped; connect to another server")
        if self.state.connections() >= self.config.max_connections:
            return self._refuse("max_connections", 503, "the server has as many connections as it accepts; "
                                "try again later", [("Retry-After", "1")])
        return None

    def _refuse(self, reason: str, status: int, message: str,
                extra_headers: list[tuple[str, str]] | None = None) -> Response:
        self.metrics.handshakes_refused.labels(reason).inc()
        return json_response(status, {"error": message}, extra_headers)

    @property
    def unfinished(self) -> int:
        """How many connections have not finished their handshake or taken their answer (``MIN_UNFINISHED``)."""
        return len(self._unfinished)

    def admit_unfinished(self, connection: FrontConnection) -> bool:
        """A connection just accepted: counted among the unfinished (True), or reset itself (False).

        Where ``max_unfinished`` are, room is made by resetting the oldest of them that has not sent a whole
        request (and is not closing already) and is not in its grace (nothing read from it, and accepted
        less than ``UNFINISHED_GRACE_S`` ago). Where every such one is in its grace (a burst not read
        yet), or there is none and the server is answering a request it read
        (``_answering``: a burst a moment before its 101s), the newcomer is let in past the bound, up to
        ``unfinished_ceiling`` (and ``_trim_unfinished`` runs once the grace has passed); at the ceiling
        the oldest without a whole request is reset all the same. Where every one has sent its request
        and been answered (answers not taken), the newcomer is reset. Invariant: at most
        ``unfinished_ceiling`` are counted. See ``MIN_UNFINISHED``."""
        now = time.monotonic()
        count = len(self._unfinished)
        if count >= self.max_unfinished:
            unread, partial = _first_open(self._unread), _first_open(self._partial)
            aged = unread if unread is not None and now - self._unread[unread] >= UNFINISHED_GRACE_S else None
            oldest = self._older(aged, partial)
            if oldest is None and count < self.unfinished_ceiling and (unread is not None or self._answering()):
                self._trim_at(next(iter(self._unfinished.values())) + UNFINISHED_GRACE_S)
            elif oldest is None and unread is None:  # (and no partial one: it would be the oldest)
                self._reset_unfinished("unfinished_new", connection, count, "a new connection",
                                       "every one of them has sent its request (clients that do not take "
                                       "their answers?)")
                return False
            else:
                oldest = oldest or unread
                assert oldest is not None
                self.unfinished_ended(oldest)
                self._reset_unfinished("unfinished_oldest", oldest, count,
                                       "the connection that had waited longest without a whole request",
                                       "to make room for a new one (a client opening connections it sends "
                                       "nothing on?)" if count < self.unfinished_ceiling else
                                       "to make room for a new one: more connections at once than "
                                       "--max-connections")
        self._unfinished[connection] = self._unread[connection] = now
        return True

    def read_from(self, connection: FrontConnection) -> None:
        """``connection``, counted among the unfinished, has been read from (``FrontConnection``): no longer
        one nothing was read from; one that sent part of a request until it has sent all of it."""
        accepted = self._unread.pop(connection, None)
        if connection.request is not None:
            self._partial.pop(connection, None)
        elif accepted is not None:
            self._partial[connection] = accepted

    def unfinished_ended(self, connection: FrontConnection) -> None:
        """``connection`` upgraded or ended: it no longer counts among the unfinished."""
        self._unfinished.pop(connection, None)
        self._unread.pop(connection, None)
        self._partial.pop(connection, None)

    def _older(self, one: FrontConnection | None, other: FrontConnection | None) -> FrontConnection | None:
        """The one of ``one`` and ``other`` accepted first (None where both are)."""
        if one is None or other is None:
            return one or other
        return one if self._unfinished[one] <= self._unfinished[other] else other

    def _answering(self) -> bool:
        """Whether the server has read a request it has not answered yet (a handshake under way: its
        answer, a 101 or a refusal, comes in a moment, and the connection then upgrades or leaves)."""
        return any(_being_answered(waiting) for waiting in self._unfinished)

    def _trim_at(self, when: float) -> None:
        """``_trim_unfinished`` at ``when`` (``time.monotonic``, the loop's clock), unless it is due already."""
        if self._trim is None:
            self._trim = asyncio.get_running_loop().call_at(when, self._trim_unfinished)

    def _trim_unfinished(self) -> None:
        """Past ``max_unfinished`` after a burst: reset those accepted ``UNFINISHED_GRACE_S`` ago or more
        that neither upgraded nor took their answer (but those the server is answering, or that are
        closing already: they leave by themselves), oldest first, until at most ``max_unfinished`` are
        counted; then again a grace later, while the count is still past the bound."""
        self._trim = None
        now = time.monotonic()
        for waiting, accepted in list(self._unfinished.items()):
            count = len(self._unfinished)
            if count <= self.max_unfinished:
                return
            if now - accepted < UNFINISHED_GRACE_S:
                self._trim_at(accepted + UNFINISHED_GRACE_S)  # (and every one after it: oldest first)
                return
            if waiting.transport.is_closing() or _being_answered(waiting):
                continue
            self.unfinished_ended(waiting)
            self._reset_unfinished("unfinished_trim", waiting, count, "a connection that had neither finished its "
                                   f"handshake nor taken its answer {UNFINISHED_GRACE_S:g} s after its accept",
                                   "past the bound after a burst of new ones")
        if len(self._unfinished) > self.max_unfinished:  # (held by those being answered or closing)
            self._trim_at(now + UNFINISHED_GRACE_S)

    def _reset_unfinished(self, kind: str, connection: FrontConnection, count: int, which: str, why: str) -> None:
        self.metrics.handshakes_refused.labels("unfinished").inc()
        self.log.warning(kind, "reset %s, from %s: %d connections had not finished their handshake or "
                         "taken their answer, %s", which, self.peer(connection), count, why)
        cut(connection.transport)

    def refuse_tls(self, connection: ServerConnection) -> None:
        """A TLS handshake on this plain server (a client that said wss:// or https://): answered at once
        with a plain 400 and closed, not left to time out. The client's TLS layer cannot read the answer,
        and fails with the error that says "not TLS" (``WRONG_VERSION_NUMBER``), not with a reset a client
        would retry; the log says what happened."""
        message = ("a TLS handshake reached a server without TLS (the client used wss:// or https://); "
                   "connect with ws:// or http://, or serve TLS with --certfile")
        self.metrics.handshakes_refused.labels("bad_request").inc()
        self.log.warning("bad_request", "refused a request from %s with 400: %s", self.peer(connection), message)
        connection.transport.write(json_response(400, {"error": message}).serialize())
        connection.transport.close()

    def _refuse_bad_request(self, connection: ServerConnection, status: int, message: str,
                            extra_headers: list[tuple[str, str]] | None = None) -> Response:
        self.log.warning("bad_request", "refused a request from %s with %d: %s", self.peer(connection), status, message)
        return json_response(status, {"error": message}, extra_headers)

    def process_response(self, connection: ServerConnection, request: Request, answer: Response) -> Response | None:
        """websockets' hook once its answer to a handshake exists: a refusal of its own (the RFC 6455 checks
        that follow ``process_request``, or its 500 when a hook failed) becomes a JSON one; others stand."""
        exc = connection.protocol.handshake_exc
        if exc is None or answer.status_code == 101:
            return None
        if isinstance(exc, InvalidHandshake):
            self.metrics.handshakes_refused.labels("bad_request").inc()
        status, message, extra_headers = websocket_refusal(exc, answer)
        if status >= 500:  # websockets has already logged the failure with its traceback
            return json_response(status, {"error": message}, extra_headers)
        return self._refuse_bad_request(connection, status, message, extra_headers)

    def early_refusal(self, connection: ServerConnection, exc: Exception) -> Response | None:
        """The answer to a request websockets could not parse (so no hook saw it); None when the client
        closed before sending a whole request, leaving nobody to answer."""
        cause = exc.__cause__
        if isinstance(exc, RequestLineTooLong):
            status, message = 414, "the request line is too long; shorten the path and query"
        elif isinstance(exc, HeaderLineTooLong):
            status, message = 431, "a header line is too long; shorten it"
        elif isinstance(exc, TooManyHeaders):
            status, message = 431, "the request has too many headers; send fewer"
        elif isinstance(cause, EOFError) and connection.protocol.reader.eof:
            return None  # (an EOFError without the end of the stream: a line ended by a bare LF, a 400)
        elif isinstance(cause, ValueError) and _OTHER_VERSION.match(str(cause)):
            # RFC 9110 §15.6.6 (a minor version above 1.1 too: websockets parses 1.1 and 1.0 alone).
            status, message = 505, ("this server speaks HTTP/1.1 (and answers HTTP/1.0), not the request's version; "
                                    "send 'GET /path HTTP/1.1'")
        elif isinstance(cause, NotImplementedError) or str(cause) == "unsupported request body":
            status, message = 400, "requests with a body are not accepted; this server answers GET and HEAD"
        else:
            status, message = 400, ("the request is not valid HTTP/1.1 (its request line or a header line is "
                                    "malformed); send 'GET /path HTTP/1.1' and well-formed headers")
        # Unread, it may have been a handshake: counted like one (as a TLS hello on this port is).
        self.metrics.handshakes_refused.labels("bad_request").inc()
        refusal = self._refuse_bad_request(connection, status, message)
        if getattr(connection, "opening", b"").startswith(b"HEAD "):  # (as a parsed HEAD's: process_request)
            return Response(refusal.status_code, refusal.reason_phrase, refusal.headers, b"")
        return refusal

    def connection_class(self) -> type[ServerConnection]:
        """``serve(create_connection=...)``: websockets' connection, bound to this front."""
        return type("FrontConnection", (FrontConnection,), {"front": self})


def asks_for_websocket(headers: Headers) -> bool:
    """Whether any protocol the ``Upgrade`` header names is WebSocket (``websocket``, or ``websocket/13``),
    alone or beside others: a handshake, which websockets then checks (and refuses with 426 unless
    ``Upgrade`` is ``websocket`` alone, protocol.md §9), never a request for a page."""
    return any(token.split("/", 1)[0].strip().lower() == "websocket"
               for value in headers.get_all("Upgrade") for token in value.split(","))


class LogThrottle:
    """At most one log line per ``interval_s`` for each kind of event; the next line that is written
    says how many were left out since the last one. ``kind`` takes a few fixed values, so the table
    stays small whatever clients send.

    With ``schedule`` (``schedule(delay_s, call)``, such as ``on_the_loop``), lines left out are never
    lost for want of a next one: where no line of that kind comes by the end of the interval, the last
    one left out is written then, with their count (a burst of a thousand resets wrote one line, and
    the count of the rest never came). ``flush`` writes those at once, for a server that stops: no line
    of a server comes after its ``stopped`` (a stopped server's late line landed in the next test's
    log capture, ten seconds on, on the same event loop)."""

    def __init__(self, logger: logging.Logger, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 schedule: Callable[[float, Callable[[], None]], object] | None = None) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self.schedule = schedule
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}
        self._latest: dict[str, tuple[int, str, tuple[object, ...]]] = {}  # the last line left out, by kind
        self._calls: dict[str, object] = {}  # what ``schedule`` returned for each kind's late line, if it can cancel

    def warning(self, kind: str, message: str, *args: object) -> None:
        self.line(logging.WARNING, kind, message, *args)

    def info(self, kind: str, message: str, *args: object) -> None:
        self.line(logging.INFO, kind, message, *args)

    def line(self, level: int, kind: str, message: str, *args: object) -> None:
        now = self.clock()
        since = now - self._last.get(kind, -float("inf"))
        if since < self.interval_s:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            if self.schedule is not None and kind not in self._latest:
                last = self._last.get(kind)
                self._calls[kind] = self.schedule(self.interval_s - since, lambda: self._written_late(kind, last))
            self._latest[kind] = (level, message, args)
            return
        self._last[kind] = now
        self._latest.pop(kind, None)
        left_out = self._left_out.pop(kind, 0)
        if left_out:
            message += f" (and {left_out} more like it in the last {since:.0f} s, not logged)"
        self.logger.log(level, message, *args)

    def flush(self) -> None:
        """Write now the late line of every kind that has lines left out, and call none later."""
        for kind in list(self._latest):
            call = self._calls.pop(kind, None)
            cancel = getattr(call, "cancel", None)
            if cancel is not None:
                cancel()
            self._written_late(kind, self._last.get(kind))

    def _written_late(self, kind: str, last: float | None) -> None:
        """The interval after lines of ``kind`` were left out has ended with no line to count them in: the
        last of them, with the count. Nothing where a line was written since ``last`` (the one before
        them): it counted them, and any left out after it have a call of their own to come."""
        if self._last.get(kind) != last:
            return
        latest = self._latest.pop(kind, None)
        left_out = self._left_out.pop(kind, 0)
        if latest is None or not left_out:
            return
        now = self.clock()
        since = now - self._last.get(kind, now)
        self._last[kind] = now
        level, message, args = latest
        self.logger.log(level, message + f" (the last of {left_out} like it in the last {since:.0f} s, not logged "
                        "one by one)", *args)


def _being_answered(connection: FrontConnection) -> bool:
    """Whether the server has read ``connection``'s request and not yet answered it (a 101 or a refusal
    comes in a moment)."""
    return connection.request is not None and unanswered(connection.protocol)


def _first_open(table: dict[FrontConnection, float]) -> FrontConnection | None:
    """The first connection of ``table`` that is not closing; those before it, closing (one answered
    early: let it go), are taken out of ``table`` (so each is passed over once)."""
    while table:
        first = next(iter(table))
        if not first.transport.is_closing():
            return first
        del table[first]
    return None


def on_the_loop(delay_s: float, call: Callable[[], None]) -> object:
    """``LogThrottle``'s ``schedule`` for an object used on an event loop: ``call`` on the running loop."""
    return asyncio.get_running_loop().call_later(delay_s, call)


_ABSOLUTE_FORM = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def origin_form(target: str, host: str | None) -> tuple[str | None, str | None]:
    """The request target as a path and query, and the host the request was sent to.

    A target in absolute form (``http://host:port/path?query``, which proxies send) is accepted, as
    RFC 9112 §3.2.2 asks of a server and RFC 6455 §4.1 allows for a handshake: what follows its host
    is the target, as sent (so both forms are read alike), and its host replaces the ``Host``
    header's. ``(None, host)`` for an absolute form that is not an ``http``/``https`` URL with a host
    (or has user information), and for a target that is neither that nor a path (``http:/x``,
    ``mailto:a@b``, ``*``, ``?a``: RFC 9112 §3.2's origin form starts with ``/``); a path as given."""
    if target.startswith("/"):
        return target, host
    if not _ABSOLUTE_FORM.match(target):
        return None, host
    try:
        parts = urllib.parse.urlsplit(target)
    except ValueError:  # (a broken [IPv6] host)
        return None, host
    if parts.scheme.lower() not in ("http", "https") or "@" in parts.netloc or parse_host(parts.netloc) is None:
        return None, host
    rest = target.split("://", 1)[1][len(parts.netloc):]  # as sent: a fragment stays, as in origin form
    return (rest if rest.startswith("/") else "/" + rest), parts.netloc


def request_line_problem(request: Request) -> str | None:
    """One line saying why the request line is malformed, or None: websockets splits it on spaces and
    checks the version alone, so a method that is not a token (RFC 9110 §9.1: empty, or with a control
    character or a separator) or a target with a control character (RFC 9112 §3.2) reaches the hooks,
    where it was answered as an unknown method (405) or path (404); RFC 9112 §3 asks for 400."""
    if not _METHOD.fullmatch(request.method):
        return "the request line is malformed: its method is not a name such as GET; send 'GET /path HTTP/1.1'"
    if _CONTROL.search(request.path):
        return ("the request target has a control character or a space; percent-encode it, as in "
                "'GET /path%20name HTTP/1.1'")
    return None


def header_problem(request: Request) -> str | None:
    """One line saying why the request's headers cannot be acted on, or None when they can."""
    for name in SINGLE_VALUED_HEADERS:
        if len(request.headers.get_all(name)) > 1:
            return f"the request has more than one {name} header; send it once"
    host = request.headers.get("Host")
    if host is None:
        # RFC 9112 §3.2: an HTTP/1.1 request without Host is answered 400. HTTP/1.0 predates Host.
        return "the request has no Host header; HTTP/1.1 requires one" if request.protocol != "HTTP/1.0" else None
    if parse_host(host) is None:
        return "the Host header is not a host name or IP address with an optional :port"
    return None


def websocket_refusal(exc: Exception, answer: Response) -> tuple[int, str, list[tuple[str, str]]]:
    """Status, one-line message and headers for websockets' refusal of a handshake (``answer``),
    from the check that failed (``exc``); no value the client sent is echoed back."""
    status = answer.status_code
    kept = [(name, answer.headers[name]) for name in ("Allow", "Server") if name in answer.headers]
    # RFC 9110 §15.5.22: a 426 names the protocol to upgrade to (and Upgrade is a connection option).
    upgrade_required = [*kept, ("Upgrade", "websocket"), ("Connection", "Upgrade, close")]
    advice = "; connect with a WebSocket client (RFC 6455)"
    if isinstance(exc, InvalidUpgrade):
        wanted = "include Upgrade" if exc.name.lower() == "connection" else "be websocket"
        return 426, f"not a WebSocket handshake: the {exc.name} header must {wanted}{advice}", upgrade_required
    if isinstance(exc, InvalidHeaderValue) and exc.name == "Sec-WebSocket-Version":
        # RFC 6455 §4.2.2: an unsupported version is answered 426 with the versions this server speaks.
        return 426, "this server speaks WebSocket version 13 only (RFC 6455); send Sec-WebSocket-Version: 13", [
            *upgrade_required, ("Sec-WebSocket-Version", "13")]
    if isinstance(exc, InvalidHeader):
        if exc.value is None:
            what = "is missing"
        elif exc.value == "multiple values":
            what = "appears more than once"
        else:
            what = "has an invalid value"
        return 400, f"not a valid WebSocket handshake: the {exc.name} header {what}{advice}", kept
    if isinstance(exc, InvalidMethod):
        return 405, "a WebSocket handshake must be a GET request", kept
    if isinstance(exc, InvalidProtocol):
        return 505, "a WebSocket handshake must use HTTP/1.1", kept
    if isinstance(exc, InvalidHandshake):
        return 400, f"not a valid WebSocket handshake{advice}", kept
    return status, "the server failed on this request; it is in the server's log", kept


def peer(connection: ServerConnection, proxies: ProxyPolicy | None = None) -> str:
    """The client's address as host:port, for log lines; behind a proxy of ``proxies`` whose
    ``X-Forwarded-For`` names the client, ``CLIENT through PROXY:PORT``."""
    address = connection.remote_address
    if not address:
        return "an unknown address"
    host, port = address[0], address[1]
    direct = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    request = connection.request
    if proxies is None or request is None:
        return direct
    client = proxies.client(str(host), request.headers.get_all("X-Forwarded-For"))
    return direct if client is None else f"{client} through {direct}"


def _shorten(value: str, limit: int = 100) -> str:
    return value if len(value) <= limit else value[:limit] + "..."


def json_response(status: int, body: dict[str, Any], extra_headers: list[tuple[str, str]] | None = None) -> Response:
    """A JSON answer, one line ending in a newline (so that ``curl`` leaves the shell's prompt on a line of
    its own)."""
    return response(status, orjson.dumps(body, option=orjson.OPT_APPEND_NEWLINE), "application/json", extra_headers)


def response(status: int, body: bytes, content_type: str,
             extra_headers: list[tuple[str, str]] | None = None) -> Response:
    extra_headers = extra_headers or []
    replaced = {name.lower() for name, _ in extra_headers}  # an extra header replaces a standard one
    headers = Headers([(name, value) for name, value in (
        ("Date", email.utils.formatdate(usegmt=True)),
        ("Connection", "close"),
        ("Content-Length", str(len(body))),
        ("Content-Type", content_type),
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),  # a JSON answer that quotes a request's path is never run as a page
    ) if name.lower() not in replaced] + extra_headers)
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


#: The demo page's own defences, beside its rule of showing server text only as text: its scripts and
#: styles only from here, no framing by other sites (clickjacking), no content-type guessing. It may
#: connect to any WebSocket server (``?ws=``) and ask that server's /readyz and /healthz.
PAGE_HEADERS = [
    ("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self' ws: wss: http: https:; frame-ancestors 'none'; base-uri 'none'; "
                                "form-action 'none'; object-src 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
]


def static_file(path: str) -> Response | None:
    """A file of web_demo/ (``/`` is index.html), or None; never a path outside web_demo/, and only a
    path that names the file itself: none with an empty, ``.`` or hidden part (``/index.html/``,
    ``/app.js/.``, which the file system reads as the file, would serve a page whose relative links break)."""
    if not WEB_ROOT.is_dir():
        return None
    relative = "index.html" if path in ("", "/") else path.lstrip("/")
    if any(part == "" or part.startswith(".") for part in relative.split("/")) or "\\" in relative:
        return None
    try:
        target = (WEB_ROOT / relative).resolve()
        if WEB_ROOT not in target.parents or not target.is_file():
            return None
        body = target.read_bytes()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte, no permission, ...
        return None
    content_type = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    if content_type.startswith("text/") or content_type in ("application/javascript", "application/json"):
        content_type += "; charset=utf-8"
    return response(200, body, content_type, PAGE_HEADERS)
