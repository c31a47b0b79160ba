"""HTTP done right (protocol.md §9, §12): the Host rule against DNS rebinding, well-formed requests only,
GET and HEAD only, and every refusal as one JSON line, websockets' own refusals included.

The pure parts (``header_problem``, ``LogThrottle``) are tested directly, as the Host rule itself
(``access.HostPolicy``) is in test_hardening_access.py; everything else runs on a real server, with
raw sockets writing the exact bytes a test needs (duplicate headers, odd methods, a forged Host) that
no HTTP or WebSocket client would send.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import ssl
from pathlib import Path
from typing import Any

import orjson
import pytest
from websockets.datastructures import Headers
from websockets.http11 import Request

from fillmask_server.config import Config
from fillmask_server.http import ALLOWED_METHODS, SINGLE_VALUED_HEADERS, LogThrottle, header_problem, origin_form
from fillmask_server.server import FillMaskServer

ATTACKER = "attacker.example"
SPEC = (Path(__file__).resolve().parent.parent / "protocol.md").read_text()


def spec_section(number: int) -> str:
    start = SPEC.index(f"## §{number} ")
    following = SPEC.find("\n## §", start + 1)
    return SPEC[start: following if following != -1 else len(SPEC)]


def test_the_spec_states_these_rules() -> None:
    """§9 lists every status the front answers with and the headers it wants once; §12 the Host rule."""
    for status in (400, 405, 414, 421, 426, 431, 505, 404, 403, 401, 503):
        assert f"\n| {status} |" in spec_section(9), status
    for name in SINGLE_VALUED_HEADERS:
        assert f"`{name}`" in spec_section(9), name
    assert f"`Allow: {', '.join(ALLOWED_METHODS)}`" in spec_section(9)
    assert "`--allowed-hosts`" in spec_section(12) and f"The default is `{Config().allowed_hosts}`" in spec_section(12)
    assert "`host` (421)" in spec_section(11) and "`bad_request`" in spec_section(11)


# --- the pure rules ----------------------------------------------------------------------------------


def request_with(*headers: tuple[str, str], protocol: str = "HTTP/1.1") -> Request:
    return Request("/", Headers(list(headers)), "GET", protocol)


def test_header_problem_names_what_is_wrong_in_one_line() -> None:
    host = ("Host", "127.0.0.1:8765")
    assert header_problem(request_with(host)) is None
    assert header_problem(request_with(host, ("Connection", "keep-alive"), ("Connection", "Upgrade"))) is None
    for name in ("Host", "Origin", "Upgrade", "Authorization", "Accept", "sec-websocket-key"):
        problem = header_problem(request_with(host, (name, "a"), (name.upper(), "b")))
        assert problem is not None and "more than one" in problem, name
    assert "no Host header" in (header_problem(request_with()) or "")
    assert header_problem(request_with(protocol="HTTP/1.0")) is None  # HTTP/1.0 has no Host
    assert "Host header is not" in (header_problem(request_with(("Host", "[::1"))) or "")


def test_log_throttle_writes_one_line_per_interval_and_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    throttle = LogThrottle(logging.getLogger("test.throttle"), 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.throttle"):
        for _ in range(50):
            throttle.warning("bad", "bad request from %s", "here")
            now[0] += 0.1
        throttle.warning("host", "refused host")  # another kind has its own allowance
        now[0] += 6.0
        throttle.warning("bad", "bad request from %s", "there")
    assert [record.getMessage() for record in caplog.records] == [
        "bad request from here", "refused host",
        "bad request from there (and 49 more like it in the last 11 s, not logged)"]


def test_a_stopping_server_counts_the_lines_its_throttle_left_out_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """The suite's run: a server that had refused a dozen tokens wrote its late line ("the last of 12 like
    it") ten seconds on, after it had stopped, into the next test's log capture on the same event loop.
    ``flush`` (the drain's last step) writes it at once and cancels the later call."""
    now = [100.0]
    calls: list[asyncio.TimerHandle] = []
    loop = asyncio.new_event_loop()
    try:
        def schedule(delay: float, call: Any) -> asyncio.TimerHandle:
            calls.append(loop.call_later(delay, call))
            return calls[-1]

        throttle = LogThrottle(logging.getLogger("test.throttle"), 10.0, clock=lambda: now[0], schedule=schedule)
        with caplog.at_level(logging.INFO, logger="test.throttle"):
            for n in range(12):
                throttle.warning("token", "refused %d", n)
            throttle.warning("host", "refused host")
            throttle.flush()
            throttle.flush()  # (nothing left: nothing written twice)
        assert [record.getMessage() for record in caplog.records] == [
            "refused 0", "refused host", "refused 11 (the last of 11 like it in the last 0 s, not logged one by one)"]
        assert len(calls) == 1 and calls[0].cancelled()
    finally:
        loop.close()


def test_lines_the_throttle_left_out_are_counted_when_no_later_line_comes(caplog: pytest.LogCaptureFixture) -> None:
    """An operator's trial: a burst of 690 resets wrote one line, and no later line came to count the
    rest. With ``schedule``, the end of the interval writes the last line left out, with the count; a
    line that comes first counts them itself, and the end of its interval then writes nothing."""
    now = [100.0]
    due: list[tuple[float, Any]] = []
    throttle = LogThrottle(logging.getLogger("test.throttle"), 10.0, clock=lambda: now[0],
                           schedule=lambda delay, call: due.append((now[0] + delay, call)))
    with caplog.at_level(logging.INFO, logger="test.throttle"):
        for n in range(690):
            throttle.warning("reset", "reset %d", n)
            now[0] += 0.001
        assert [when for when, _ in due] == [pytest.approx(110.0)]  # one summary per interval, not per line
        now[0] = due[0][0]
        due.pop()[1]()
        throttle.warning("host", "refused host")  # another kind: its own lines
        now[0] += 10.0
        throttle.warning("reset", "reset %d", 690)  # a line of its own again, a whole interval later
        throttle.warning("reset", "reset %d", 691)  # left out; then counted by the next line, not late
        now[0] += 10.0
        throttle.warning("reset", "reset %d", 692)
        throttle.warning("reset", "reset %d", 693)  # left out just after a line: its own call comes later
        for _, call in due[:-1]:
            call()  # (691's call, stale: 692 counted it; a review saw it write 693 two milliseconds after 692)
        now[0] += 10.0
        due[-1][1]()
    assert [record.getMessage() for record in caplog.records] == [
        "reset 0", "reset 689 (the last of 689 like it in the last 10 s, not logged one by one)", "refused host",
        "reset 690", "reset 692 (and 1 more like it in the last 10 s, not logged)",
        "reset 693 (the last of 1 like it in the last 10 s, not logged one by one)"]


# --- raw HTTP against a real server ----------------------------------------------------------------


def handshake_headers() -> list[str]:
    key = base64.b64encode(os.urandom(16)).decode()
    return ["Upgrade: websocket", "Connection: Upgrade", f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]


async def exchange(port: int, raw: bytes, address: str = "127.0.0.1") -> tuple[int, Headers, bytes]:
    """Write ``raw``, read one answer: its status, headers and body. For anything but a 101 it also reads
    to the end of the stream, so that a byte beyond Content-Length (a body on HEAD) fails the test."""
    reader, writer = await asyncio.open_connection(address, port)
    try:
        writer.write(raw)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        headers = Headers([tuple(line.split(": ", 1)) for line in lines])  # type: ignore[misc]
        status = int(status_line.split()[1])
        if status == 101:
            return status, headers, b""
        body = await asyncio.wait_for(reader.read(), 5)  # the server ends the stream after one answer
        expected = 0 if raw.lstrip(b"\r\n").startswith(b"HEAD ") else int(headers.get("Content-Length", "0"))
        assert len(body) == expected, (status, body[:200])
        return status, headers, body
    finally:
        writer.close()


async def get(port: int, path: str = "/healthz", host: str | None = None, method: str = "GET",
              extra: list[str] | None = None, address: str = "127.0.0.1", protocol: str = "HTTP/1.1",
              ) -> tuple[int, Headers, bytes]:
    lines = [f"{method} {path} {protocol}"]
    authority = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    lines += [f"Host: {host if host is not None else authority}"] if host != "" else []
    lines += extra or []
    return await exchange(port, ("\r\n".join(lines) + "\r\n\r\n").encode(), address)


def error_line(headers: Headers, body: bytes) -> str:
    """The refusal's message, checked to be the one-line JSON every refusal is (§9)."""
    assert headers["Content-Type"] == "application/json", headers
    message = orjson.loads(body)["error"]
    assert message and "\n" not in message and "Traceback" not in message and ".py" not in message, message
    assert len(message) < 300, message
    return message


def refused(srv: FillMaskServer, reason: str) -> float:
    value = srv.metrics.registry.get_sample_value("fillmask_handshakes_refused_total", {"reason": reason})
    return value or 0.0


async def test_dns_rebinding_is_refused_421_without_a_token(server: FillMaskServer) -> None:
    """The issue's reproduction: the attacker's page, rebound to 127.0.0.1, has a matching Origin and Host."""
    port = server.port
    before = refused(server, "host")
    forged = [f"Origin: http://{ATTACKER}:{port}", *handshake_headers()]
    status, headers, body = await get(port, "/", host=f"{ATTACKER}:{port}", extra=forged)
    assert status == 421 and "--allowed-hosts" in error_line(headers, body)
    assert refused(server, "host") == before + 1
    for path in ("/", "/index.html", "/metrics", "/nope"):  # the page and the metrics are reachable by rebinding too
        status, headers, body = await get(port, path, host=f"{ATTACKER}:{port}")
        assert status == 421 and ATTACKER in error_line(headers, body), path
    for path in ("/healthz", "/readyz"):  # probes send whatever Host their configuration says
        assert (await get(port, path, host="fillmask.default.svc.cluster.local"))[0] == 200, path


async def test_allowed_hosts_pass(server: FillMaskServer) -> None:
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"app.localhost:{port}", f"10.1.2.3:{port}",
                 f"LocalHost.:{port}"):
        status, _, _ = await get(port, "/", host=host, extra=[f"Origin: http://{host}", *handshake_headers()])
        assert status == 101, host
        assert (await get(port, "/", host=host))[0] == 200, host  # the demo page


async def test_allowed_hosts_on_ipv6_loopback(make_server: Any) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    async with make_server(host="::1") as srv:
        port = srv.port
        assert srv.url == f"ws://[::1]:{port}/"
        status, _, _ = await get(port, "/", address="::1", extra=[f"Origin: http://[::1]:{port}", *handshake_headers()])
        assert status == 101
        assert (await get(port, "/healthz", address="::1"))[0] == 200
        assert (await get(port, "/", address="::1", host=f"{ATTACKER}:{port}"))[0] == 421


async def test_allowed_hosts_setting(make_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    async with make_server(allowed_hosts="fill.example.com") as srv:
        port = srv.port
        ok = f"fill.example.com:{port}"
        assert (await get(port, "/", host=ok, extra=[f"Origin: http://{ok}", *handshake_headers()]))[0] == 101
        assert (await get(port, "/", host=f"127.0.0.1:{port}", extra=handshake_headers()))[0] == 101  # --host
        with caplog.at_level(logging.WARNING):  # its log line names the path, as the 401 one does
            assert (await get(port, "/metrics", host=f"{ATTACKER}:{port}"))[0] == 421
        assert any(r.getMessage().startswith("refused GET /metrics from ") and "with 421" in r.getMessage()
                   for r in caplog.records)
        for host in (f"localhost:{port}", f"10.1.2.3:{port}", f"{ATTACKER}:{port}"):
            assert (await get(port, "/", host=host, extra=handshake_headers()))[0] == 421, host
    async with make_server(allowed_hosts="*") as srv:  # behind a proxy that rewrites Host: the token's job then
        port = srv.port
        assert (await get(port, "/", host=f"{ATTACKER}:{port}", extra=handshake_headers()))[0] == 101


@pytest.mark.parametrize("name", ["Origin", "Upgrade", "Authorization", "Accept", "Host", "Sec-WebSocket-Key"])
async def test_duplicate_headers_get_400_json_and_no_traceback(server: FillMaskServer, name: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    port = server.port
    values = {"Origin": "http://127.0.0.1", "Upgrade": "websocket", "Authorization": "Bearer x",
              "Accept": "text/plain", "Host": f"127.0.0.1:{port}", "Sec-WebSocket-Key": "AAAAAAAAAAAAAAAAAAAAAA=="}
    twice = [f"{name}: {values[name]}", f"{name.lower()}: {values[name]}"]
    with caplog.at_level(logging.INFO):
        for path, extra in (("/", [*handshake_headers(), *twice]), ("/healthz", twice), ("/metrics", twice)):
            status, headers, body = await get(port, path, extra=extra)
            assert status == 400 and f"more than one {name} header" in error_line(headers, body), (path, body)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_healthz_with_two_upgrade_headers_is_400_not_500(server: FillMaskServer) -> None:
    status, headers, body = await get(server.port, "/healthz", extra=["Upgrade: websocket", "Upgrade: h2c"])
    assert status == 400 and "Upgrade" in error_line(headers, body)


async def test_malformed_host_is_400(server: FillMaskServer) -> None:
    port = server.port
    for host in ("[::1", "127.0.0.1:99999", "two:colons:here", "user@127.0.0.1"):
        status, headers, body = await get(port, "/healthz", host=host)
        assert status == 400 and "Host" in error_line(headers, body), host
    status, headers, body = await get(port, "/healthz", host="")
    assert status == 400 and "no Host header" in error_line(headers, body)
    assert (await get(port, "/healthz", host="", protocol="HTTP/1.0"))[0] == 200  # HTTP/1.0 predates Host


def own_log(srv: FillMaskServer) -> str:
    """Give ``srv``'s HTTP front a logger of its own (a child of ``fillmask_server.http``), and return its
    name: the module's server, alive on the same loop, writes its own throttled lines meanwhile (a full
    run saw its late "the last of 249 like it" land in these tests' capture)."""
    srv.http.log.logger = logging.getLogger(f"fillmask_server.http.{srv.port}")
    return srv.http.log.logger.name


async def test_2000_bad_requests_write_a_handful_of_log_lines(make_server: Any,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Issue 10 item 6: 2,000 requests with duplicate headers wrote 1.6 MB of tracebacks."""
    async with make_server() as srv:
        name = own_log(srv)
        port = srv.port
        raw = (f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: http://a\r\nOrigin: http://b\r\n"
               "\r\n").encode()
        statuses: list[int] = []

        async def client(count: int) -> None:
            for _ in range(count):
                statuses.append((await exchange(port, raw))[0])

        with caplog.at_level(logging.INFO):
            await asyncio.gather(*(client(100) for _ in range(20)))
        assert statuses == [400] * 2000
        ours = [r for r in caplog.records if r.name == name]
        assert 1 <= len(ours) <= 3, [r.getMessage() for r in ours]
        assert "more than one Origin header" in ours[0].getMessage()
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_a_tls_handshake_on_a_plain_server_is_named_in_the_log(make_server: Any,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A client that says wss:// to a ws:// server gets a plain 400 at once (it waited for a timeout, then
    logged a malformed request line), which its TLS layer reports as "not TLS" (not a reset, which a
    client would retry), and the log says what happened."""
    async with make_server() as srv:
        name = own_log(srv)
        with caplog.at_level(logging.INFO, logger="fillmask_server.http"):
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            with pytest.raises(ssl.SSLError, match="WRONG_VERSION_NUMBER"):  # "not TLS", which clients name
                await asyncio.open_connection("127.0.0.1", srv.port, ssl=context)
            for _ in range(100):  # bounded: the server logs as it answers
                if [r for r in caplog.records if r.name == name]:
                    break
                await asyncio.sleep(0.02)
        lines = [r.getMessage() for r in caplog.records if r.name == name]
        assert len(lines) == 1 and "a TLS handshake reached a server without TLS" in lines[0], lines
        assert "--certfile" in lines[0]
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        refused = srv.metrics.registry.get_sample_value("fillmask_handshakes_refused_total", {"reason": "bad_request"})
        assert refused == 1
        # What a raw reader sees: the headers of every other answer (README: "every answer ... nosniff").
        status, headers, body = await exchange(srv.port, b"\x16\x03\x01\x00\x05hello")
        assert status == 400 and "--certfile" in orjson.loads(body)["error"]
        assert (headers["X-Content-Type-Options"], headers["Cache-Control"], headers["Connection"]) == (
            "nosniff", "no-store", "close")
        assert headers["Content-Type"] == "application/json" and "Date" in headers


async def test_only_get_and_head(server: FillMaskServer) -> None:
    port = server.port
    for method, path in (("PUT", "/metrics"), ("DELETE", "/"), ("POST", "/healthz"), ("get", "/healthz"),
                         ("PATCH", "/readyz"), ("OPTIONS", "/"), ("Head", "/"), ("POST", "/")):
        extra = handshake_headers() if path == "/" and method == "POST" else []
        status, headers, body = await get(port, path, method=method, extra=extra)
        assert status == 405 and headers["Allow"] == "GET, HEAD", (method, path)
        assert method in error_line(headers, body)
    status, headers, body = await get(port, "/healthz", method="POST", extra=["Content-Length: 5"])
    assert status == 400 and "body" in error_line(headers, body)  # websockets reads no request bodies


async def test_a_handshake_refused_before_it_could_be_read_is_counted(server: FillMaskServer) -> None:
    """A handshake with a body got its 400, but fillmask_handshakes_refused_total did not move: the
    refusals made while websockets parses the request (body, too long, malformed) were not counted."""
    for extra, status in ((["Content-Length: 3"], 400), (["Transfer-Encoding: chunked"], 400),
                          ([f"X-Long: {'a' * 9000}"], 431)):
        before = refused(server, "bad_request")
        answer, headers, body = await get(server.port, "/", extra=handshake_headers() + extra)
        assert answer == status and error_line(headers, body), extra
        assert refused(server, "bad_request") == before + 1, extra


async def test_the_pages_files_are_served_at_their_own_paths_only(server: FillMaskServer) -> None:
    """``/index.html/`` and ``/app.js/.`` answered 200 with the file (the file system reads them as the
    file), and the page at ``/index.html/`` then loaded ``/index.html/app.js``, which broke it. A path
    with an empty, ``.`` or hidden part is not one of the page's files: 404, as any unknown path."""
    for path in ("/", "/index.html", "/app.js", "/style.css"):
        status, _, _ = await get(server.port, path)
        assert status == 200, path
    for path in ("/index.html/", "/app.js/", "/app.js/.", "/style.css/./", "/./app.js", "/web_demo/../app.js",
                 "/index.html//", "/.hidden", "/a/.hidden", "/app.js%2F"):
        status, headers, body = await get(server.port, path)
        assert status == 404 and error_line(headers, body), path


async def test_head_has_the_get_headers_and_no_body(server: FillMaskServer) -> None:
    port = server.port
    for path in ("/healthz", "/readyz", "/", "/metrics", "/nope"):
        get_status, get_headers, get_body = await get(port, path)
        head_status, head_headers, head_body = await get(port, path, method="HEAD")
        assert (head_status, head_body) == (get_status, b""), path
        assert head_headers["Content-Type"] == get_headers["Content-Type"], path
        if path != "/metrics":  # the metrics change between the two requests
            assert head_headers["Content-Length"] == str(len(get_body)), path
        else:
            assert int(head_headers["Content-Length"]) > 0
    assert (await get(port, "/", method="HEAD", host=f"{ATTACKER}:{port}"))[0] == 421


async def test_websockets_own_handshake_refusals_are_json(server: FillMaskServer) -> None:
    port = server.port
    before = refused(server, "bad_request")
    upgrade = ["Upgrade: websocket", "Connection: Upgrade"]
    cases: list[tuple[list[str], str, int, str]] = [
        ([*upgrade, "Sec-WebSocket-Version: 13"], "HTTP/1.1", 400, "Sec-WebSocket-Key header is missing"),
        ([*upgrade, "Sec-WebSocket-Key: short", "Sec-WebSocket-Version: 13"], "HTTP/1.1", 400,
         "Sec-WebSocket-Key header has an invalid value"),
        ([*upgrade, "Sec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA=="], "HTTP/1.1", 400,
         "Sec-WebSocket-Version header is missing"),
        ([*upgrade, "Sec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA==", "Sec-WebSocket-Version: 8"], "HTTP/1.1", 426,
         "version 13"),
        (["Upgrade: websocket", "Connection: keep-alive", "Sec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA==",
          "Sec-WebSocket-Version: 13"], "HTTP/1.1", 426, "Connection header must include Upgrade"),
        # Upgrade not only websocket (found by a fuzz run: these got the demo page, 200)
        *[([f"Upgrade: {value}", "Connection: Upgrade", "Sec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA==",
            "Sec-WebSocket-Version: 13"], "HTTP/1.1", 426, "Upgrade header")
          for value in ("websocket, h2c", "h2c, websocket", "websocket/13")],
        (handshake_headers(), "HTTP/1.0", 505, "HTTP/1.1"),
    ]
    for extra, protocol, status_wanted, message in cases:
        status, headers, body = await get(port, "/", extra=extra, protocol=protocol)
        assert status == status_wanted and message in error_line(headers, body), (extra, body)
        if status == 426:  # RFC 9110 §15.5.22
            assert (headers["Upgrade"], headers["Connection"]) == ("websocket", "Upgrade, close")
        if "version 13" in message:
            assert headers["Sec-WebSocket-Version"] == "13"  # RFC 6455 §4.2.2
        assert headers["Server"].startswith("fillmask-server/")
    assert refused(server, "bad_request") == before + len(cases)


async def test_a_handshake_that_fails_several_checks_gets_the_first_in_section_9s_order(
        server: FillMaskServer) -> None:
    """§9's table of handshake refusals is in the order they are checked: 505, then 426 for Connection and
    Upgrade, then 400 for the key, then 400 or 426 for the version (found by a conformance run: the
    table had 400 and 426 before 505). Each handshake here but the last fails two of those checks; the
    last, the version's 400 alone (its 426 is ``test_websockets_own_handshake_refusals_are_json``'s)."""
    key, bad_key = "Sec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA==", "Sec-WebSocket-Key: short"
    upgrade, not_upgrade = ["Upgrade: websocket", "Connection: Upgrade"], ["Upgrade: websocket", "Connection: close"]
    cases: list[tuple[list[str], str, int, str]] = [
        ([*upgrade, key, "Sec-WebSocket-Version: 8"], "HTTP/1.0", 505, "HTTP/1.1"),
        ([*upgrade, "Sec-WebSocket-Version: 13"], "HTTP/1.0", 505, "HTTP/1.1"),
        ([*not_upgrade, "Sec-WebSocket-Version: 13"], "HTTP/1.0", 505, "HTTP/1.1"),
        ([*not_upgrade, "Sec-WebSocket-Version: 13"], "HTTP/1.1", 426, "Connection header must include Upgrade"),
        (["Upgrade: websocket, h2c", "Connection: Upgrade"], "HTTP/1.1", 426, "Upgrade header"),
        ([*upgrade, bad_key], "HTTP/1.1", 400, "Sec-WebSocket-Key header has an invalid value"),
        ([*upgrade, "Sec-WebSocket-Version: 8"], "HTTP/1.1", 400, "Sec-WebSocket-Key header is missing"),
        ([*upgrade, key], "HTTP/1.1", 400, "Sec-WebSocket-Version header is missing"),
    ]
    for extra, protocol, status_wanted, message in cases:
        status, headers, body = await get(server.port, "/", extra=extra, protocol=protocol)
        assert (status, message in error_line(headers, body)) == (status_wanted, True), (extra, protocol, body)
    # The table itself, in that order (the spec and the server in lockstep).
    spec = (Path(__file__).resolve().parent.parent / "protocol.md").read_text()
    table = spec.split("is then refused, in\nthis order:", 1)[1].split("\n\n## ", 1)[0]
    statuses = [int(line.split("|")[1]) for line in table.splitlines() if line.startswith("| ") and
                line.split("|")[1].strip().isdigit()]
    assert statuses == [404, 403, 401, 503, 503, 505, 426, 400, 400, 426], statuses


async def test_a_target_in_absolute_form_is_served_as_its_path_on_its_host(server: FillMaskServer) -> None:
    """A hostile peer's trial: ``GET http://127.0.0.1:P/ HTTP/1.1`` (as proxies send it) got 404 "no
    WebSocket endpoint at http://...". RFC 9112 §3.2.2 asks a server to accept the absolute form and to
    take its host in place of the Host header's; RFC 6455 §4.1 allows it for a handshake (§9)."""
    port, authority = server.port, f"127.0.0.1:{server.port}"
    status, _, _ = await get(port, f"http://{authority}/", extra=handshake_headers())
    assert status == 101
    assert (await get(port, f"HTTP://{authority}/healthz"))[0] == 200
    status, headers, body = await get(port, f"http://{authority}/nope?token=x")
    assert status == 404 and "nothing at '/nope'" in error_line(headers, body)
    before = refused(server, "host")
    status, headers, body = await get(port, f"http://rebound.example:{port}/", extra=handshake_headers())
    assert status == 421 and "'rebound.example:" in error_line(headers, body)  # its host, not the Host header's
    assert refused(server, "host") == before + 1
    # Read as sent, as the origin form is: a fragment stays in the query the token is read from (a review).
    assert origin_form("http://h:1/?token=s#x", "other") == ("/?token=s#x", "h:1")
    assert origin_form("https://h:1?q", None) == ("/?q", "h:1") and origin_form("/?q#x", "h") == ("/?q#x", "h")
    # Nor a path (a fuzzing trial: these were 404, or 421 with a foreign Host, as paths "ftp:x"...).
    for target in ("ftp://127.0.0.1/", "http:///", "http://user@127.0.0.1/", "ws://127.0.0.1/", "http:/x/healthz",
                   "http:healthz", "mailto:a@b", "urn:a:b", "*", "?a", "metrics"):
        status, headers, body = await get(port, target, extra=handshake_headers())
        assert status == 400 and "neither a path nor an http:// or https:// URL" in error_line(headers, body), target


async def test_requests_websockets_cannot_parse_are_answered_in_json(server: FillMaskServer,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    port = server.port
    host = f"Host: 127.0.0.1:{port}\r\n"
    cases = [
        (f"GET /{'a' * 9000} HTTP/1.1\r\n{host}\r\n", 414, "request line is too long"),
        (f"GET / HTTP/1.1\r\n{host}X-Big: {'b' * 9000}\r\n\r\n", 431, "header line is too long"),
        ("GET / HTTP/1.1\r\n" + host + "".join(f"X-{i}: {i}\r\n" for i in range(200)) + "\r\n", 431,
         "too many headers"),
        ("HELLO\r\n\r\n", 400, "not valid HTTP/1.1"),
        # Another version, well-formed: 505 (RFC 9110 §15.6.6), an h2c preface among them; a malformed one: 400.
        (f"GET / HTTP/2.0\r\n{host}\r\n", 505, "speaks HTTP/1.1"),
        (f"GET /healthz HTTP/1.2\r\n{host}\r\n", 505, "speaks HTTP/1.1"),
        ("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, "speaks HTTP/1.1"),
        (f"GET /body HTTP/1.10\r\n{host}\r\n", 400, "not valid HTTP/1.1"),  # (not "with a body": a review)
        (f"GET /x: a b HTTP/2.0\r\n{host}\r\n", 400, "not valid HTTP/1.1"),
        (f"GET /healthz http/1.1\r\n{host}\r\n", 400, "not valid HTTP/1.1"),
        (f"GET / HTTP/1.1\r\n{host}Bad Header: x\r\n\r\n", 400, "not valid HTTP/1.1"),
        (f"GET /healthz HTTP/1.1\r\n{host}Transfer-Encoding: chunked\r\n\r\n", 400, "body"),
        # Lines ended by a bare LF (found by a fuzz run: the server hung up without a word)
        (f"GET /healthz HTTP/1.1\n{host}\n", 400, "not valid HTTP/1.1"),
        (f"GET /healthz HTTP/1.1\r\n{host.strip()}\n\r\n", 400, "not valid HTTP/1.1"),
    ]
    with caplog.at_level(logging.INFO):
        for raw, status_wanted, message in cases:
            status, headers, body = await exchange(port, raw.encode())
            assert status == status_wanted and message in error_line(headers, body), (raw[:40], body)
            if raw.startswith("GET "):  # HEAD: the same status and headers, no body (§9; a fuzzing trial) ...
                status, head_headers, body = await exchange(port, b"HEAD " + raw.encode()[4:])
                assert (status, body) == (status_wanted, b""), (raw[:40], body)
                assert [h for h in head_headers.raw_items() if h[0] != "Date"] == [
                    h for h in headers.raw_items() if h[0] != "Date"]
                for lead in (b"\r\n", b"\n\r\n"):  # ... after empty lines too (RFC 9112 §2.2), which
                    status, _, body = await exchange(port, lead + b"HEAD " + raw.encode()[4:])  # websockets refuses
                    assert (status, body) == (400, b""), (lead, raw[:40], body)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    # A client that hangs up halfway gets nothing, and the server is none the worse for it.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHo")
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    assert (await get(port, "/healthz"))[0] == 200


async def test_a_request_with_more_bytes_after_it_is_answered_and_the_rest_discarded(
        server: FillMaskServer, caplog: pytest.LogCaptureFixture) -> None:
    """Found by an adversarial run: websockets parsed whatever followed a request (a second, pipelined
    request, or a stray CRLF) as a WebSocket frame at once, failed it and ended the stream, so the first
    request got no answer and the log a traceback. Every answer is ``Connection: close`` (§9): the first
    request is answered, and the rest is read and discarded."""
    port = server.port
    first = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"
    with caplog.at_level(logging.INFO):
        for rest in (first.replace("healthz", "readyz"), "\r\n", "x" * 100_000):
            status, _, body = await exchange(port, (first + rest).encode())
            assert (status, body) == (200, b'{"status":"ok"}\n'), rest[:20]  # (§9: compact, one line)
        status, headers, body = await exchange(port, (first.replace("healthz", "nope") + first).encode())
        assert status == 404 and error_line(headers, body).startswith("not found: nothing at '/nope'; ")
        assert headers["X-Content-Type-Options"] == "nosniff"  # it quotes the path: never sniffed as a page
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_a_client_that_ends_its_side_right_after_its_request_gets_the_answer(server: FillMaskServer) -> None:
    """Found by an adversarial run: ``shutdown(SHUT_WR)`` right after the request (as ``nc -N`` does)
    lost the answer most of the time: websockets closed the socket at the end of the client's stream."""
    port = server.port
    for path, status in [("/healthz", 200), ("/readyz", 200), ("/nope", 404)] * 5:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {status} ".encode()) and orjson.loads(body), (path, answer[:80])


def server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """The (opcode, payload) of each whole unmasked frame in ``data`` (a server's frames, RFC 6455 §5.2)."""
    frames, at = [], 0
    while at + 2 <= len(data):
        opcode, length, at = data[at] & 0x0F, data[at + 1] & 0x7F, at + 2
        if length == 126:
            length, at = int.from_bytes(data[at:at + 2], "big"), at + 2
        elif length == 127:
            length, at = int.from_bytes(data[at:at + 8], "big"), at + 8
        if at + length > len(data):
            break
        frames.append((opcode, data[at:at + length]))
        at += length
    return frames


async def test_frames_sent_with_the_handshake_are_handled_once_it_is_answered(server: FillMaskServer) -> None:
    """Frames are parsed only once the 101 is written (what follows a request waits for its answer):
    a client that sends its first request in the same write as its handshake still gets its result,
    and one that ends its stream after its handshake is closed, not kept."""
    from websockets.frames import Frame, Opcode

    port = server.port
    handshake = "\r\n".join(["GET / HTTP/1.1", f"Host: 127.0.0.1:{port}", *handshake_headers()]) + "\r\n\r\n"
    request = orjson.dumps({"type": "fill_mask", "id": "early", "text": "paris is the [MASK] of france."})
    frame = Frame(Opcode.TEXT, request).serialize(mask=True, extensions=[])
    ping = Frame(Opcode.PING, b"p").serialize(mask=True, extensions=[])  # its pong came before the 101
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(handshake.encode() + ping + frame)
        data = b""
        async with asyncio.timeout(10):
            while len(server_frames(data.partition(b"\r\n\r\n")[2])) < 3:
                data += await reader.read(65536)
    finally:
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 "), data[:40]
    frames = [(opcode, payload) for opcode, payload in server_frames(rest) if opcode != Opcode.PONG]
    (_, hello), (_, result) = frames[:2]
    assert (Opcode.PONG, b"p") in server_frames(rest)
    assert orjson.loads(hello)["type"] == "hello"
    assert orjson.loads(result)["type"] == "result" and orjson.loads(result)["id"] == "early"

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(handshake.encode())
        writer.write_eof()
        data = await asyncio.wait_for(reader.read(), 10)  # to the end of the stream: the server closed it
    finally:
        writer.close()
    assert data.startswith(b"HTTP/1.1 101 ")


async def test_every_refused_handshake_is_counted(server: FillMaskServer) -> None:
    """A handshake to another path (404) or with another method (405) is a refused handshake too (§11);
    an adversarial run found neither counted."""
    port = server.port
    wrong_path, wrong_method = refused(server, "not_found"), refused(server, "bad_request")
    assert (await get(port, "/nope", extra=handshake_headers()))[0] == 404
    assert (await get(port, "/", method="POST", extra=handshake_headers()))[0] == 405
    # the same without Upgrade: pages, not handshakes, so not counted
    assert (await get(port, "/nope"))[0] == 404 and (await get(port, "/", method="POST"))[0] == 405
    assert (refused(server, "not_found"), refused(server, "bad_request")) == (wrong_path + 1, wrong_method + 1)
