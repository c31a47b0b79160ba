"""The HTTP front: plain HTTP routes, and the decision on every WebSocket handshake (protocol.md §9, §12).

``HttpFront.process_request`` is websockets' ``process_request`` hook: it runs on the event loop for
every incoming HTTP request, before any upgrade, and returns either a complete ``Response`` (plain
HTTP, or a refused handshake) or ``None`` (let the WebSocket handshake go on). It reads the server's
state through ``FrontState`` callables and never blocks.

Invariants:

- Every answer is a complete response with ``Content-Length``, JSON unless it is a file or metrics.
- A handshake passes, in this order: the path (404), the Origin rule (403), the token (401),
  readiness (503) and ``--max-connections`` (503). The connection count is read here and the
  connection becomes OPEN before the loop runs anything else (websockets sends the 101 without
  yielding after this synchronous hook), so concurrent handshakes cannot overshoot the limit.
- Nothing outside ``web_demo/`` is ever served as a file.
"""

from __future__ import annotations

import email.utils
import http
import mimetypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from .access import OriginPolicy, presented_token, token_matches
from .config import Config
from .metrics import Metrics

WEBSOCKET_PATHS = ("/", "/ws")
# The demo page: ``web_demo/`` of a checkout (editable installs too), else the copy a wheel installs
# inside the package (pyproject.toml maps it there).
_CHECKOUT_WEB_ROOT = Path(__file__).resolve().parent.parent / "web_demo"
WEB_ROOT = _CHECKOUT_WEB_ROOT if _CHECKOUT_WEB_ROOT.is_dir() else Path(__file__).resolve().parent / "web_demo"

TOKEN_HELP = ("missing or wrong token; send it as the header 'Authorization: Bearer TOKEN' or the query "
              "parameter ?token=TOKEN")


@dataclass(frozen=True)
class FrontState:
    """What the HTTP front reads of the server, each a cheap callable safe on the event loop."""

    accepting: Callable[[], bool]  # loaded and not draining: new connections are welcome
    unready: Callable[[], bool]  # a drain has begun: /readyz answers 503
    engine_alive: Callable[[], bool]
    connections: Callable[[], int]  # open WebSocket connections, handshakes in progress included


class HttpFront:
    """Answers plain HTTP and decides WebSocket handshakes for one server (see the module docstring)."""

    def __init__(self, config: Config, origins: OriginPolicy, tls: bool, metrics: Metrics,
                 state: FrontState) -> None:
        self.config = config
        self.origins = origins
        self.tls = tls
        self.metrics = metrics
        self.state = state

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """websockets' hook: a response for plain HTTP and refused handshakes; None lets a handshake go on."""
        path = request.path.split("?", 1)[0]
        headers = request.headers
        if headers.get("Upgrade", "").lower() == "websocket":
            return self._handshake(path, request)
        if path == "/healthz":
            return json_response(200, {"status": "ok"})
        if path == "/readyz":
            if self.state.unready():
                return json_response(503, {"status": "draining"})
            if not self.state.engine_alive():
                return json_response(503, {"status": "engine_stopped"})
            return json_response(200, {"status": "ready"})
        if path == "/metrics":
            if not token_matches(self.config.token, presented_token(headers.get("Authorization"), request.path)):
                return json_response(401, {"error": TOKEN_HELP}, [("WWW-Authenticate", "Bearer")])
            body, content_type = self.metrics.render(headers.get("Accept"))
            return response(200, body, content_type)
        static = static_file(path)
        if static is not None:
            return static
        return json_response(404, {"error": "not found"})

    def _handshake(self, path: str, request: Request) -> Response | None:
        headers = request.headers
        if path not in WEBSOCKET_PATHS:
            return json_response(404, {"error": f"no WebSocket endpoint at {path[:100]}; connect to /"})
        if not self.origins.allows(headers.get("Origin"), headers.get("Host"), self.tls):
            return self._refuse("origin", 403, "pages of this origin may not connect to this server; its "
                                "operator can allow them with --allowed-origins")
        if not token_matches(self.config.token, presented_token(headers.get("Authorization"), request.path)):
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


def json_response(status: int, body: dict[str, Any], extra_headers: list[tuple[str, str]] | None = None) -> Response:
    return response(status, orjson.dumps(body), "application/json", extra_headers)


def response(status: int, body: bytes, content_type: str,
             extra_headers: list[tuple[str, str]] | None = None) -> Response:
    headers = Headers([
        ("Date", email.utils.formatdate(usegmt=True)),
        ("Connection", "close"),
        ("Content-Length", str(len(body))),
        ("Content-Type", content_type),
        ("Cache-Control", "no-store"),
        *(extra_headers or []),
    ])
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


def static_file(path: str) -> Response | None:
    """A file of web_demo/ (``/`` is index.html), or None; never a path outside web_demo/."""
    if not WEB_ROOT.is_dir():
        return None
    relative = "index.html" if path in ("", "/") else path.lstrip("/")
    if ".." in relative.split("/") or "\\" in relative or relative.startswith("."):
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
    return response(200, body, content_type)
