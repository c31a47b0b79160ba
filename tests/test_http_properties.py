"""A differential test of the HTTP front (protocol.md §9, §12) over raw TCP, driven by hypothesis.

Hypothesis draws HTTP requests and writes their exact bytes to a real server on 127.0.0.1: every route
and method (GET, HEAD, POST, OPTIONS, unknown and lower-case methods), HTTP/1.1 and HTTP/1.0, targets in
origin and absolute form, and header sets of every kind the front decides on (``Host`` absent, twice,
upper case, with odd ports, IPv6 literals, names it does not answer for or malformed; ``Origin`` of this
server, of localhost, of another site, ``null``, twice; ``Connection``, ``Upgrade`` with and without a
right ``Sec-WebSocket-Key`` and ``Sec-WebSocket-Version``; the token in ``Authorization`` or the query;
``Accept``; bodies by ``Content-Length`` and chunked), sent in one write, split over many small writes,
followed by a half-close, or followed by more requests in the same write (pipelined). A second test
mutates valid requests into malformed ones (bare LF, header folding, lines at and past the 8 KiB limit,
129 headers, non-ASCII bytes, NUL, broken request lines, other versions, empty lines before the request
line, a request cut short); a third writes arbitrary bytes.

The oracle is this file's own reading of §9's tables (the order of the checks, each status), not the
server's code. ``h11`` parses every answer independently. The invariants:

- exactly one answer per connection, to its first request (§9: every answer is ``Connection: close``
  and bytes after the first request are discarded), or, for a request cut short, the connection closed
  with nothing written; never half an answer;
- the answer is a well-formed HTTP/1.1 response (h11 accepts it, its ``Content-Length`` frames it, a
  HEAD answer has no body) followed by the end of the stream, except a 101, which is followed by
  WebSocket frames; its status is the one §9 gives for that request, with the headers §9 names
  (``Allow``, ``WWW-Authenticate``, ``Upgrade``, ``Sec-WebSocket-Accept``, ``Connection: close``,
  ``X-Content-Type-Options: nosniff``);
- a JSON body is one compact line; a refusal is ``{"error": ...}`` with no traceback, file path or repr;
- a HEAD answer has the status and headers of the GET answer (``Date`` aside);
- afterwards the server settles (no connection left open, unfinished or held, no handler running) and
  a new connection's ``/healthz`` is answered 200.

The two deviations from RFC 9112 it found (a method that is not a token answered 405, a target with a
control character answered 404, both now 400) are the two tests at the end of the file.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import h11
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fillmask_server.server import FillMaskServer

TOKEN = "s3cret-Token_42"
KEY = "dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455 §1.3's example key
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
READ_S = 5.0  # the most any one answer may take
SETTLE_S = 5.0
SINGLE_VALUED = ("host", "origin", "authorization", "upgrade", "accept", "sec-websocket-key", "sec-websocket-version")
PROBES = ("/healthz", "/readyz")
STATIC = ("/", "/index.html", "/app.js", "/style.css")
# Anything in a body that would be the server's insides: a traceback, a source file, an object's repr.
LEAK = re.compile(r"Traceback|File \"|\.py\b|site-packages|/usr/|/home/|/work/|<[A-Za-z_.]+ object|"
                  r"0x[0-9a-f]{6,}|Error\(|Exception\(|websockets\.|fillmask_server\.")

SETTINGS = settings(derandomize=True, deadline=None, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


# --- requests and what §9 says they get ---------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    """One request, as fields; ``raw()`` writes its bytes exactly."""

    method: str = "GET"
    target: str = "/healthz"
    version: str = "HTTP/1.1"
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def raw(self) -> bytes:
        lines = [f"{self.method} {self.target} {self.version}", *(f"{n}: {v}" for n, v in self.headers)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body

    def all(self, name: str) -> list[str]:
        return [value for n, value in self.headers if n.lower() == name]

    def one(self, name: str) -> str | None:
        values = self.all(name)
        return values[0] if values else None


def host_answered(host: str) -> bool | None:
    """The default ``--allowed-hosts`` (``localhost,ip``, §12) on one of the hosts drawn here: True,
    False (421), or None for a ``Host`` that is not a host at all (400)."""
    lowered = host.lower()
    if lowered in ("[::1", "127.0.0.1:99999", "a b", "", "two:colons:here", "user@127.0.0.1") or "\t" in host:
        return None
    name = lowered.rsplit(":", 1)[0] if not lowered.startswith("[") else lowered.split("]")[0] + "]"
    return not name.startswith("attacker.")


def websocket_asked(req: Req) -> bool:
    return any(t.strip().lower().split("/", 1)[0] == "websocket" for v in req.all("upgrade") for t in v.split(","))


def presented_token(req: Req, query: str) -> str | None:
    authorization = req.one("authorization")
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    given = [part.split("=", 1)[1] for part in query.split("&") if part.startswith("token=")]
    return given[0] if len(given) == 1 else None


def origin_allowed(origin: str | None, host: str | None) -> bool:
    """The default ``--allowed-origins`` (``same-origin,localhost``, §12) on the origins drawn here."""
    if origin is None:
        return True
    if origin in ("null", "not an origin") or "evil" in origin:
        return False
    authority = origin.split("://", 1)[1]
    if authority.split(":")[0] in ("127.0.0.1", "localhost", "[::1]"):
        return True
    return host is not None and host.lower() == authority  # same-origin (an https page on a plain server too)


def expected_status(req: Req, token: str) -> int:
    """§9's checks in their order, then the route's answer."""
    if req.body or req.all("transfer-encoding") or any(v != "0" for v in req.all("content-length")):
        return 400
    if any(len(req.all(name)) > 1 for name in SINGLE_VALUED):
        return 400
    host = req.one("host")
    if host is None and req.version == "HTTP/1.1":
        return 400
    if host is not None and host_answered(host) is None:
        return 400
    if req.method not in ("GET", "HEAD"):
        return 405
    target = req.target
    if target.lower().startswith(("http://", "https://")):
        rest = target.split("://", 1)[1]
        slash = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        host, target = rest[:slash], rest[slash:]
        target = target if target.startswith("/") else "/" + target
    elif not target.startswith("/"):
        return 400
    path, _, query = target.partition("?")
    if host is not None and path not in PROBES and not host_answered(host):
        return 421
    if req.method == "GET" and websocket_asked(req):
        if path not in ("/", "/ws"):
            return 404
        if not origin_allowed(req.one("origin"), host):
            return 403
        if token and presented_token(req, query) != token:
            return 401
        if req.version != "HTTP/1.1":
            return 505
        connection = [t.strip().lower() for v in req.all("connection") for t in v.split(",")]
        upgrade = [t.strip() for v in req.all("upgrade") for t in v.split(",")]
        if "upgrade" not in connection or len(upgrade) != 1 or upgrade[0].lower() != "websocket":
            return 426
        if req.one("sec-websocket-key") != KEY:
            return 400
        version = req.one("sec-websocket-version")
        if version is None:
            return 400
        return 426 if version != "13" else 101
    if path in PROBES:
        return 200
    if path == "/metrics":
        return 401 if token and presented_token(req, query) != token else 200
    return 200 if path in STATIC else 404


# --- strategies ------------------------------------------------------------------------------------------


def cased(name: str) -> st.SearchStrategy[str]:
    return st.sampled_from([name, name.lower(), name.upper()])


@st.composite
def requests(draw: st.DrawFn, port: int) -> Req:
    handshake = draw(st.booleans())  # shaped like a WebSocket handshake, each part of it perhaps wrong
    method = draw(st.sampled_from(["GET"] * (30 if handshake else 10) + ["HEAD"] * 4
                                  + ["POST", "OPTIONS", "PUT", "get", "BREW", "M-SEARCH"]))
    path = draw(st.sampled_from(["/", "/ws"] * (8 if handshake else 1) + [
        "/healthz", "/readyz", "/metrics", "/index.html", "/app.js", "/style.css", "/nope", "/ws/x", "/../README.md",
        "/%2e%2e/README.md", "//etc/passwd", "/.git/config", "*", "http:/x", "metrics"]))
    query = draw(st.sampled_from(["", "", "?a=1", f"?token={TOKEN}", "?token=wrong", f"?token={TOKEN}&token={TOKEN}"]))
    target = path + query if path.startswith("/") else path
    if path.startswith("/") and draw(st.sampled_from([False] * 5 + [True])):  # absolute form (§9): its host decides
        scheme = draw(st.sampled_from(["http", "HTTP", "https"]))
        authority = draw(st.sampled_from([f"127.0.0.1:{port}", "localhost", f"10.1.2.3:{port}",
                                          f"attacker.example:{port}"]))
        target = f"{scheme}://{authority}{target}"
    good_hosts = [f"127.0.0.1:{port}", "127.0.0.1", "localhost", f"LOCALHOST:{port}", f"[::1]:{port}", "[::1]",
                  f"10.1.2.3:{port}", f"[::ffff:127.0.0.1]:{port}", "app.localhost"]
    foreign_hosts = [f"attacker.example:{port}", "ATTACKER.example"]
    bad_hosts = ["[::1", "127.0.0.1:99999", "a b", "", "two:colons:here", "user@127.0.0.1"]
    chosen: dict[str, list[str]] = {
        "Host": [draw(st.sampled_from(good_hosts * 4 + foreign_hosts * 2 + bad_hosts))]
        if draw(st.sampled_from([True] * 9 + [False])) else [],
        "Upgrade": [draw(st.sampled_from(["websocket"] * 6 + ["WebSocket", "websocket, h2c", "h2c", "websocket/13"]))]
        if handshake or draw(st.sampled_from([False] * 5 + [True])) else [],
        "Connection": [draw(st.sampled_from(["Upgrade"] * 4 + ["upgrade", "keep-alive, Upgrade", "close", "keep-alive",
                                                               "close, Upgrade"]))] if handshake or draw(st.booleans())
        else [],
        "Sec-WebSocket-Key": [draw(st.sampled_from([KEY] * 6 + ["short"]))]
        if handshake and draw(st.sampled_from([True] * 7 + [False]))
        else [],
        "Sec-WebSocket-Version": [draw(st.sampled_from(["13"] * 6 + ["8"]))]
        if handshake and draw(st.sampled_from([True] * 7 + [False]))
        else [],
        "Origin": [draw(st.sampled_from([f"http://127.0.0.1:{port}", "http://localhost:5173", "https://evil.example",
                                         "null", f"http://10.1.2.3:{port}", f"https://10.1.2.3:{port}",
                                         f"http://attacker.example:{port}", "not an origin"]))]
        if draw(st.booleans()) else [],
        "Authorization": [draw(st.sampled_from([f"Bearer {TOKEN}", f"bearer {TOKEN}", "Bearer wrong",
                                                f"Basic {TOKEN}"]))] if draw(st.booleans()) else [],
        "Accept": [draw(st.sampled_from(["text/plain", "application/openmetrics-text; version=1.0.0", "*/*"]))]
        if draw(st.sampled_from([False] * 3 + [True])) else [],
        "X-Junk": [draw(st.sampled_from(["caf\xe9", "a\tb", "", "x" * 300]))]
        if draw(st.sampled_from([False] * 3 + [True])) else [],
    }
    twice = draw(st.sampled_from([None] * 60 + [name for name in chosen if name != "X-Junk"]))
    if twice is not None and chosen[twice]:  # one header sent twice: refused (§9), but Connection, a list
        chosen[twice] = [*chosen[twice], chosen[twice][0]]
    headers = [(draw(cased(name)), value) for name, values in chosen.items() for value in values]
    headers = draw(st.permutations(headers))
    body = b""
    framing = draw(st.sampled_from(["none"] * 24 + ["cl0", "cl", "chunked"]))
    if framing == "cl0":
        headers.append(("Content-Length", "0"))
    elif framing == "cl":
        body = b"hello"
        headers.append(("Content-Length", "5"))
    elif framing == "chunked":
        body = b"5\r\nhello\r\n0\r\n\r\n"
        headers.append(("Transfer-Encoding", "chunked"))
    version = draw(st.sampled_from(["HTTP/1.1"] * 6 + ["HTTP/1.0"]))
    return Req(method, target, version, tuple(headers), body)


#: How the bytes reach the server: one write, many small ones, one then a half-close, or with more
#: requests after it in the same write.
DELIVERIES = st.sampled_from(["whole", "split", "half_close", "pipelined"])


# --- talking to the server ------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int | None  # None: the connection ended with nothing written
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names; repeated ones joined by ", "
    raw_headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    after: bytes = b""  # what followed a 101
    raw: bytes = b""


async def send(port: int, data: bytes, delivery: str, cuts: list[int] | None = None) -> bytes:
    """Write ``data`` as ``delivery`` says; read to the end of the stream (or the end of a 101's head)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if delivery == "split":
            points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts or [])})
            for start, end in itertools.pairwise(points):
                writer.write(data[start:end])
                await writer.drain()
                await asyncio.sleep(0.001)
        else:
            writer.write(data)
            if delivery == "half_close":
                writer.write_eof()
        received = b""
        async with asyncio.timeout(READ_S):
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                received += chunk
                if received.startswith(b"HTTP/1.1 101 ") and b"\r\n\r\n" in received:
                    break  # a WebSocket now: the client closes it
        return received
    except ConnectionResetError:
        return b"<reset>"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def parse(received: bytes, head: bool, upgrade: bool) -> Answer:
    """``received`` through h11 as the answer to one request (HEAD or not, proposing an upgrade or not),
    followed by the end of the stream; fails the test on anything h11 refuses."""
    if not received:
        return Answer(None)
    assert received != b"<reset>", "the server reset the connection instead of answering"
    client = h11.Connection(h11.CLIENT)
    proposal = [("Upgrade", "websocket"), ("Connection", "Upgrade")] if upgrade else []
    client.send(h11.Request(method="HEAD" if head else "GET", target="/", headers=[("Host", "x"), *proposal]))
    client.send(h11.EndOfMessage())
    client.receive_data(received)
    client.receive_data(b"")
    events: list[Any] = []
    try:
        while True:
            event = client.next_event()
            events.append(event)
            if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                break
            assert event is not h11.NEED_DATA, events
    except h11.RemoteProtocolError as exc:
        raise AssertionError(f"h11 refuses the answer ({exc}): {received[:300]!r}") from None
    response = events[0]
    assert isinstance(response, (h11.Response, h11.InformationalResponse)), events
    assert response.http_version == b"1.1", response
    raw_headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in response.headers]
    headers: dict[str, str] = {}
    for name, value in raw_headers:
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    body = b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))
    if response.status_code == 101:
        assert events[-1] is h11.PAUSED, events
        return Answer(101, headers, raw_headers, b"", client.trailing_data[0], received)
    assert isinstance(events[-1], h11.ConnectionClosed), events  # one answer, then the end of the stream
    assert isinstance(events[-2], h11.EndOfMessage), events
    return Answer(response.status_code, headers, raw_headers, body, b"", received)


def check_answer(req: Req, answer: Answer, wanted: int) -> None:
    """The invariants every answer holds, beyond its status (module docstring)."""
    status, headers, body = answer.status, answer.headers, answer.body
    context = (req.raw()[:400], answer.raw[:400])
    assert status == wanted, context
    if status == 101:
        accept = base64.b64encode(hashlib.sha1((KEY + WS_GUID).encode()).digest()).decode()
        assert headers.get("sec-websocket-accept") == accept, context
        assert headers.get("upgrade", "").lower() == "websocket", context
        assert "upgrade" in headers.get("connection", "").lower(), context
        return
    assert "content-length" in headers and "transfer-encoding" not in headers, context
    assert "close" in headers.get("connection", "").lower(), context  # §9: every answer closes the connection
    assert headers.get("x-content-type-options") == "nosniff", context
    assert "date" in headers and "content-type" in headers, context
    if status == 405:
        assert headers.get("allow") == "GET, HEAD", context
    if status == 401:
        assert headers.get("www-authenticate") == "Bearer", context
    if status == 426:
        assert headers.get("upgrade") == "websocket", context
    head = req.method == "HEAD"
    if head:
        assert body == b"", context
        return
    assert len(body) == int(headers["content-length"]), context
    if headers["content-type"] == "application/json":
        assert body.endswith(b"\n") and body.count(b"\n") == 1, context
        value = orjson.loads(body)
        assert isinstance(value, dict) and (("error" in value) == (status >= 400)), context
        if status >= 400:
            message = value["error"]
            assert isinstance(message, str) and message and len(message) < 400, context
            assert not LEAK.search(message), context
    elif status >= 400:
        raise AssertionError(f"a refusal that is not JSON: {context}")


async def exchange(port: int, req: Req, delivery: str = "whole", cuts: list[int] | None = None,
                   extra: bytes = b"") -> Answer:
    raw = req.raw() + extra
    head = raw.lstrip(b"\r\n").startswith(b"HEAD ")
    received = await send(port, raw, delivery, cuts)
    return parse(received, head, upgrade=req.method == "GET" and websocket_asked(req))


async def settled(srv: FillMaskServer, connections_before: int) -> None:
    """Every connection closed by the test is gone from the server too (bounded polling), and a new
    connection is served."""
    assert srv._server is not None
    try:
        async with asyncio.timeout(SETTLE_S):
            while (srv.http.unfinished or srv._connections_held() or len(srv.connections) != connections_before
                   or srv._server.all_connections or srv._server.handler_tasks):
                await asyncio.sleep(0.002)
    except TimeoutError:
        raise AssertionError(f"the server kept connections: unfinished {srv.http.unfinished}, held "
                             f"{srv._connections_held()}, open {len(srv.connections)} (before "
                             f"{connections_before}), websockets' {len(srv._server.all_connections)}, handlers "
                             f"{len(srv._server.handler_tasks)}") from None
    probe = Req("GET", "/healthz", headers=(("Host", f"127.0.0.1:{srv.port}"),))
    answer = await exchange(srv.port, probe)
    assert answer.status == 200 and answer.body == b'{"status":"ok"}\n', answer.raw


def without(req: Req, *names: str) -> Req:
    return replace(req, headers=tuple(h for h in req.headers if h[0].lower() not in names))


# --- the properties ----------------------------------------------------------------------------------------


@pytest.fixture
async def guarded(make_server: Any) -> AsyncIterator[FillMaskServer]:
    """A private server with ``--token`` (the token's rules in header and query, §12)."""
    async with make_server(token=TOKEN) as srv:
        yield srv


async def check_request(srv: FillMaskServer, token: str, req: Req, delivery: str, cuts: list[int]) -> None:
    port = srv.port
    before = len(srv.connections)
    wanted = expected_status(req, token)
    extra = b""
    if delivery == "pipelined":  # a second and third request in the same write: discarded (§9)
        extra = Req("GET", "/nope-second", headers=(("Host", f"127.0.0.1:{port}"),)).raw() + b"GET /x HTTP/1.1\r\n\r\n"
    answer = await exchange(port, req, delivery, cuts, extra)
    check_answer(req, answer, wanted)
    assert b"nope-second" not in answer.body, answer.raw  # the answer is the first request's
    if req.method == "HEAD" and not websocket_asked(req) and delivery != "pipelined":
        # §9: the GET's status and headers (its Content-Length too, but for the metrics, which change)
        get = await exchange(port, replace(req, method="GET"))
        check_answer(replace(req, method="GET"), get, wanted)
        skip = {"date"} | ({"content-length"} if req.target.split("?")[0].endswith("/metrics") else set())
        assert [h for h in answer.raw_headers if h[0].lower() not in skip] == [
            h for h in get.raw_headers if h[0].lower() not in skip], (req.raw(), answer.raw, get.raw)
    await settled(srv, before)


@settings(SETTINGS, max_examples=80)
@given(data=st.data(), delivery=DELIVERIES, cuts=st.lists(st.integers(0, 10_000), max_size=6))
async def test_requests_to_a_server_with_a_token(guarded: FillMaskServer, data: st.DataObject, delivery: str,
                                                 cuts: list[int]) -> None:
    req = data.draw(requests(guarded.port), label="request")
    await check_request(guarded, TOKEN, req, delivery, cuts)


@settings(SETTINGS, max_examples=150)
@given(data=st.data(), delivery=DELIVERIES, cuts=st.lists(st.integers(0, 10_000), max_size=12))
async def test_requests_get_the_answer_section_9_gives(server: FillMaskServer, data: st.DataObject, delivery: str,
                                                       cuts: list[int]) -> None:
    req = data.draw(requests(server.port), label="request")
    await check_request(server, "", req, delivery, cuts)


# --- malformed requests ------------------------------------------------------------------------------------


@st.composite
def malformed(draw: st.DrawFn, port: int) -> tuple[bytes, set[int | None], bool]:
    """A valid request broken one way: its bytes, the statuses §9 (or RFC 9112 where §9 leaves a choice)
    allows (None: no answer, the connection closed), and whether to half-close after it."""
    method = draw(st.sampled_from(["GET", "HEAD"]))
    path, base = draw(st.sampled_from([("/healthz", 200), ("/nope", 404), ("/", 200)]))
    host = f"Host: 127.0.0.1:{port}"
    line = f"{method} {path} HTTP/1.1"
    headers = [host, "Accept: */*"]
    kind = draw(st.sampled_from([
        "bare_lf", "one_bare_lf", "fold", "long_line", "long_header", "many_headers", "header_non_ascii",
        "name_non_ascii", "path_non_ascii", "value_nul", "value_cr", "space_before_colon", "empty_name",
        "no_colon", "bad_line", "version", "leading_crlf", "content_length", "cut_short"]))
    half_close = draw(st.booleans())

    def join(line: str, headers: list[str], end: str = "\r\n") -> bytes:
        return (end.join([line, *headers]) + end + end).encode("latin-1")

    if kind == "bare_lf":
        return join(line, headers, "\n"), {400}, half_close
    if kind == "one_bare_lf":
        at = draw(st.integers(0, len(headers)))
        lines = [line, *headers, ""]
        text = "".join(part + ("\n" if i == at else "\r\n") for i, part in enumerate(lines))
        return text.encode(), {400}, half_close
    if kind == "fold":  # RFC 9112 §5.2: refused with 400, or the fold read as a space
        return join(line, [host, "X-Folded: a", " b"]), {400, base}, half_close
    if kind == "long_line":  # 414 past 8,192 bytes with its CRLF (§9)
        length = draw(st.sampled_from([8190, 8191, 8192, 8193, 8194, 9000]))
        pad = length - len(f"{method} /nope HTTP/1.1\r\n")
        raw = join(f"{method} /nope{'a' * pad} HTTP/1.1", headers)
        return raw, {414 if length > 8192 else 404}, half_close
    if kind == "long_header":  # 431 past 8,192 bytes with its CRLF
        length = draw(st.sampled_from([8191, 8192, 8193, 9000]))
        value = "v" * (length - len("X-Long: \r\n"))
        return join(line, [*headers, f"X-Long: {value}"]), {431 if length > 8192 else base}, half_close
    if kind == "many_headers":  # 431 past 128 headers
        count = draw(st.sampled_from([127, 128, 129, 200]))
        extra = [f"X-{i}: {i}" for i in range(count - len(headers))]
        return join(line, [*headers, *extra]), {431 if count > 128 else base}, half_close
    if kind == "header_non_ascii":  # obs-text in a value is valid (RFC 9110 §5.5)
        value = draw(st.binary(min_size=1, max_size=8).map(lambda b: bytes(0x80 | c for c in b)))
        return join(line, headers).replace(b"Accept: */*", b"Accept-Language: " + value), {base}, half_close
    if kind == "name_non_ascii":
        return join(line, headers).replace(b"Accept:", "Accépt:".encode()), {400}, half_close
    if kind == "path_non_ascii":  # not a request target (RFC 3986): 400
        return join(f"{method} /caf\u00e9 HTTP/1.1", headers).replace(b"caf\xe9", "café".encode()), {400}, half_close
    if kind == "value_nul":  # RFC 9110 §5.5: NUL in a field value is refused (or replaced by SP)
        return join(line, [*headers, "X-Nul: a\x00b"]), {400}, half_close
    if kind == "value_cr":
        return join(line, [*headers, "X-Cr: a\rb"]), {400}, half_close
    if kind == "space_before_colon":  # RFC 9112 §5.1: MUST be refused with 400
        return join(line, [f"Host : 127.0.0.1:{port}", "Accept: */*"]), {400}, half_close
    if kind == "empty_name":
        return join(line, [*headers, ": x"]), {400}, half_close
    if kind == "no_colon":
        return join(line, [*headers, "NoColonHere"]), {400}, half_close
    if kind == "bad_line":
        bad = draw(st.sampled_from([f"{method} {path}", f"{method} {path} HTTP/1.1 extra", f"{method}  {path} HTTP/1.1",
                                    f"{method} {path} http/1.1", f"{method} {path} HTTP/1.10",
                                    f"{method}\t{path}\tHTTP/1.1", f"{method} {path} HTTP/1", "HELLO"]))
        return join(bad, headers), {400}, half_close
    if kind == "version":  # well-formed, another version: 505 (RFC 9110 §15.6.6)
        version = draw(st.sampled_from(["HTTP/1.2", "HTTP/2.0", "HTTP/3.0", "HTTP/0.9"]))
        return join(f"{method} {path} {version}", headers), {505}, half_close
    if kind == "leading_crlf":  # RFC 9112 §2.2: SHOULD be ignored; websockets refuses them (§9's tests: 400)
        lead = draw(st.sampled_from(["\r\n", "\r\n\r\n"]))
        return lead.encode() + join(line, headers), {400, base}, half_close
    if kind == "content_length":
        value, status = draw(st.sampled_from([("abc", 400), ("-1", 400), ("1, 1", 400), ("0", base), ("00", 400),
                                              ("+0", 400)]))
        return join(line, [*headers, f"Content-Length: {value}"]), {status}, half_close
    # cut short, then the client ends its side: nobody to answer, nothing written
    raw = join(line, headers)
    return raw[:draw(st.integers(1, len(raw) - 3))], {None}, True


@settings(SETTINGS, max_examples=150)
@given(data=st.data(), split=st.booleans(), cuts=st.lists(st.integers(0, 10_000), max_size=8))
async def test_malformed_requests_are_refused_cleanly(server: FillMaskServer, data: st.DataObject, split: bool,
                                                      cuts: list[int]) -> None:
    port = server.port
    before = len(server.connections)
    raw, allowed, half_close = data.draw(malformed(port), label="malformed")
    delivery = "half_close" if half_close else ("split" if split else "whole")
    if half_close and split:  # split, then the half-close: the split is done in one write's pieces here
        delivery = "half_close"
    received = await send(port, raw, delivery, cuts)
    head = raw.lstrip(b"\r\n").startswith(b"HEAD ")
    answer = parse(received, head, upgrade=False)
    assert answer.status in allowed, (raw[:200], answer.raw[:300])
    if answer.status is not None:
        method = "HEAD" if head else "GET"
        check_answer(Req(method=method), answer, answer.status)
    await settled(server, before)


@settings(SETTINGS, max_examples=60)
@given(garbage=st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from([b"GET", b"HEAD", b" ", b"/", b"HTTP/1.1", b"\r\n", b"\n", b"\r", b":", b"Host",
                              b"\x00", b"\xff", b"\t", b"Upgrade: websocket", b"Content-Length: 1"]),
             max_size=30).map(b"".join)))
async def test_arbitrary_bytes_get_a_clean_answer_or_none(server: FillMaskServer, garbage: bytes) -> None:
    """Whatever a client writes and then ends its side: one well-formed answer of §9's statuses, or none."""
    before = len(server.connections)
    received = await send(server.port, garbage, "half_close")
    head = garbage.lstrip(b"\r\n").startswith(b"HEAD ")
    answer = parse(received, head, upgrade=False)
    assert answer.status in {None, 200, 400, 403, 404, 405, 414, 421, 426, 431, 505}, (garbage, answer.raw[:300])
    if answer.status is not None:
        check_answer(Req(method="HEAD" if head else "GET"), answer, answer.status)
    await settled(server, before)


# --- deviations found by this file (RFC 9112 §3; protocol.md §9's order: a malformed request line is a 400
# before the method's 405) -------------------------------------------------------------------------------


async def test_a_method_that_is_not_a_token_is_a_malformed_request_line(server: FillMaskServer) -> None:
    host = f"Host: 127.0.0.1:{server.port}\r\n\r\n".encode()
    for line in (b" /healthz HTTP/1.1\r\n", b"G\x01T /healthz HTTP/1.1\r\n", b"GE(T /healthz HTTP/1.1\r\n"):
        answer = parse(await send(server.port, line + host, "whole"), head=False, upgrade=False)
        assert answer.status == 400, (line, answer.raw[:120])


async def test_a_target_with_control_characters_is_a_malformed_request_line(server: FillMaskServer) -> None:
    host = f"Host: 127.0.0.1:{server.port}\r\n\r\n".encode()
    for target in (b"/heal\x00thz", b"/a\x7fb", b"/a\x01b"):
        answer = parse(await send(server.port, b"GET " + target + b" HTTP/1.1\r\n" + host, "whole"), head=False,
                       upgrade=False)
        assert answer.status == 400, (target, answer.raw[:120])
