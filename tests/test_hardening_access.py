"""Who may connect (protocol.md §9, §12): the Host rule, the Origin rule, the token, TLS, and clean HTTP errors.

The pure decisions of ``fillmask_server.access`` are tested directly; the handshake is then tested
on real sockets, with raw HTTP where a test needs headers a WebSocket client would not send.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
import shutil
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from fillmask_server.access import (
    MAX_FORWARDED_HOPS,
    HostPolicy,
    OriginPolicy,
    ProxyPolicy,
    normalize_origin,
    parse_host,
    presented_token,
    tls_context,
    token_matches,
)
from fillmask_server.config import BROWSER_BLOCKED_PORTS, Config, load_config, setting_warnings, validate
from fillmask_server.server import FillMaskServer
from tests.wire import request, session

TEXT = "Paris is the [MASK] of France."
TOKEN = "s3cret-Token_42"

# --- the pure rules -------------------------------------------------------------------------------


def test_default_origin_policy_allows_no_origin_same_origin_and_localhost_only() -> None:
    policy = OriginPolicy.parse(Config().allowed_origins)
    host = "fill.example.com:8765"
    assert policy.allows(None, host, tls=False)  # not a browser
    assert policy.allows("http://fill.example.com:8765", host, tls=False)  # the server's own page
    assert policy.allows("HTTP://Fill.Example.com:8765", host, tls=False)
    for local in ("http://localhost:3000", "http://127.0.0.1", "https://[::1]:8443", "http://app.localhost:5173"):
        assert policy.allows(local, host, tls=False), local
    for other in ("http://fill.example.com", "http://fill.example.com:8766", "https://fill.example.com",
                  "https://evil.example", "http://localhost.evil.example", "null", "", "garbage", "http://"):
        assert not policy.allows(other, host, tls=False), other
    assert policy.allows("https://fill.example.com", "fill.example.com:443", tls=True)  # default ports
    assert policy.allows("https://fill.example.com:443", "fill.example.com", tls=True)
    # An operator's find: behind an Ingress that ends TLS, the demo page (https://fill.example.com) got 403
    # from its own server, which is plain HTTP there. An https page on the same Host is now the same
    # origin on a plain server; an http page for a TLS server (a downgrade) is still refused.
    assert policy.allows("https://fill.example.com:8765", host, tls=False)
    assert policy.allows("https://fill.example.com", "fill.example.com", tls=False)
    assert policy.allows("https://fill.example.com", "fill.example.com:443", tls=False)
    assert not policy.allows("https://fill.example.com", "fill.example.com:80", tls=False)
    assert not policy.allows("http://fill.example.com", "fill.example.com", tls=True)
    alone = OriginPolicy.parse("same-origin")  # without the localhost keyword: the same rule, IPv6 too
    assert alone.allows("https://[::1]:8765", "[::1]:8765", tls=False)
    assert alone.allows("https://FILL.example.com.", "fill.example.com.", tls=False)
    assert not alone.allows("https://[::1]:8766", "[::1]:8765", tls=False)
    assert not alone.allows("https://evil.example", "fill.example.com", tls=False)


def test_explicit_origins_and_keywords() -> None:
    policy = OriginPolicy.parse("https://app.example.com, http://10.0.0.5:8080")
    assert policy.allows("https://app.example.com", "api.example.com", tls=True)
    assert policy.allows("https://APP.example.com:443", "api.example.com", tls=True)
    assert policy.allows("http://10.0.0.5:8080", "api.example.com", tls=False)
    assert not policy.allows("http://localhost:3000", "api.example.com", tls=False)  # not listed any more
    assert not policy.allows("http://api.example.com", "api.example.com", tls=False)  # nor same-origin
    assert OriginPolicy.parse("*").allows("https://anything.example", None, tls=False)
    assert OriginPolicy.parse("null").allows("null", None, tls=False)
    for bad in ("example.com", "ftp://example.com", "https://example.com/path", "https://", "same origin"):
        with pytest.raises(ValueError, match="--allowed-origins"):
            OriginPolicy.parse(bad)
    assert normalize_origin("https://example.com:443") == "https://example.com"
    assert normalize_origin("http://[::1]:80") == "http://[::1]"
    assert normalize_origin("http://example.com:99999") is None


def test_parse_host_reads_names_addresses_and_ports() -> None:
    parsed = parse_host("Fill.Example.COM.:8443")
    assert parsed is not None and (parsed.host, parsed.port, parsed.address) == ("fill.example.com", 8443, None)
    v6 = parse_host("[::1]:8765")
    assert v6 is not None and (v6.host, v6.port, str(v6.address)) == ("::1", 8765, "::1")
    v4 = parse_host("10.0.0.5")
    assert v4 is not None and (v4.port, str(v4.address)) == (None, "10.0.0.5")
    for bad in ("", " ", "::1", "[::1", "[nope]:80", "[::1]x", "a b", "host:port", "host:99999", "host:1:2",
                "http://host", "user@host", "host/path"):
        assert parse_host(bad) is None, bad


def test_default_host_policy_refuses_only_names_that_are_not_local() -> None:
    """§12: the default lets localhost names and every address through, and no other name (DNS rebinding)."""
    policy = HostPolicy.parse(Config().allowed_hosts, listen=Config().host)

    def allows(host: str) -> bool:
        authority = parse_host(host)
        assert authority is not None, host
        return policy.allows(authority, tls=False)

    for host in ("127.0.0.1:8765", "127.9.9.9", "localhost", "LOCALHOST:1", "localhost.", "app.localhost:5173",
                 "[::1]:8765", "[::ffff:127.0.0.1]", "10.0.0.5:8765", "192.168.1.20", "[fd00::5]"):
        assert allows(host), host
    for host in ("attacker.example:8765", "attacker.example", "localhost.attacker.example", "localhost.example",
                 "127.0.0.1.nip.io", "fill.example.com"):
        assert not allows(host), host


def test_explicit_hosts_wildcards_ports_and_keywords() -> None:
    policy = HostPolicy.parse("fill.example.com, *.internal.example:8765, [fd00::5]:443", listen="0.0.0.0")

    def allows(host: str, tls: bool = False) -> bool:
        authority = parse_host(host)
        assert authority is not None, host
        return policy.allows(authority, tls)

    assert allows("fill.example.com") and allows("FILL.example.com:9999")  # no port given: any port
    assert allows("a.internal.example:8765") and allows("a.b.internal.example:8765")
    assert not allows("a.internal.example:8766") and not allows("internal.example:8765")
    assert allows("[fd00::5]", tls=True) and not allows("[fd00::5]") and not allows("[fd00::5]:80")  # default ports
    assert not allows("localhost") and not allows("127.0.0.1") and not allows("10.0.0.5")  # keywords replaced
    assert HostPolicy.parse("*").allows(parse_host("attacker.example"), tls=False)  # type: ignore[arg-type]
    listening = HostPolicy.parse("fill.example.com", listen="myhost.lan")
    assert listening.allows(parse_host("myhost.lan:8765"), tls=False)  # type: ignore[arg-type]
    ipv6_listener = HostPolicy.parse("fill.example.com", listen="::1")
    assert ipv6_listener.allows(parse_host("[::1]:8765"), tls=False)  # type: ignore[arg-type]
    assert not ipv6_listener.allows(parse_host("[::2]"), tls=False)  # type: ignore[arg-type]
    for bad in ("http://fill.example.com", "fill.example.com/", "*.10.0.0.5", "*.", "", " , "):
        with pytest.raises(ValueError, match="--allowed-hosts"):
            HostPolicy.parse(bad)


def test_token_from_header_or_query() -> None:
    assert presented_token(f"Bearer {TOKEN}", "/") == TOKEN
    assert presented_token(f"bearer  {TOKEN} ", "/") == TOKEN
    assert presented_token(None, f"/?a=1&token={TOKEN}") == TOKEN
    assert presented_token(None, "/?token=a%20b%2B") == "a b+"  # URL-encoded
    assert presented_token(None, "/?token=a+b") == "a b"  # as a form: a plus is %2B
    assert presented_token(None, f"/?token={TOKEN}&token={TOKEN}") is None  # two are ambiguous: refused
    assert presented_token(f"Bearer {TOKEN}", "/?token=other") == TOKEN  # the header first
    assert presented_token("Basic abc", "/") is None and presented_token(None, "/ws?tok=1") is None
    assert token_matches("", None) and token_matches(TOKEN, TOKEN)
    assert not token_matches(TOKEN, None) and not token_matches(TOKEN, TOKEN + "x") and not token_matches(TOKEN, "")
    assert not token_matches(TOKEN, "\ud800")  # never raises, whatever arrives


@pytest.mark.parametrize(("overrides", "message"), [
    ({"max_connections": 0}, "--max-connections must be at least 1"),
    ({"max_inflight_per_connection": 0}, "--max-inflight-per-connection must be at least 1"),
    ({"max_send_buffer_bytes": 0}, "--max-send-buffer-bytes must be at least 1"),
    ({"send_timeout": 0.0}, "--send-timeout must be greater than 0"),
    ({"allowed_origins": "example.com"}, "--allowed-origins entry 'example.com'"),
    ({"allowed_hosts": "https://example.com"}, "--allowed-hosts entry 'https://example.com'"),
    ({"allowed_hosts": ","}, "--allowed-hosts is empty"),
    ({"token": "two words"}, "--token must be printable ASCII"),
    ({"keyfile": "key.pem"}, "--keyfile needs --certfile"),
    ({"certfile": "/nonexistent/cert.pem"}, "cannot read TLS file '/nonexistent/cert.pem'"),
    ({"certfile": "c" * 400}, "cannot read TLS file 'ccc"),  # a name too long: is_file() raised OSError
])
def test_bad_hardening_settings_are_refused_with_one_line(overrides: dict[str, Any], message: str) -> None:
    problem = validate(Config(**overrides))
    assert problem is not None and message in problem and "\n" not in problem


def test_a_short_token_gets_a_warning_at_start(tmp_path: Path) -> None:
    """A TLS audit guessed 2,700 tokens a second, all answered at once: nothing slows guessing down, so
    a short token is worth a word at start (before the model loads: here, one that does not exist)."""
    result = subprocess.run([sys.executable, "ws_server.py", "--model", str(tmp_path / "none"), "--token", "abc"],
                            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=60)
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning: --token")]
    assert len(warned) == 1 and "3 characters long" in warned[0] and "abc" not in warned[0], result.stderr
    assert setting_warnings(Config(token=TOKEN * (16 // len(TOKEN) + 1))) == []
    assert setting_warnings(Config()) == []


def test_a_port_browsers_refuse_is_warned_of_at_start_up() -> None:
    """A demo-page trial: with --port 6000 (X11's) the server printed its demo page's address, which
    Chromium refused to open (ERR_UNSAFE_PORT), and the page opened from disk called the server not
    running. Such a port (the Fetch standard's list) is now said at start-up; every other port is not."""
    (said,) = setting_warnings(Config(port=6000))
    assert said.startswith("warning: --port 6000 is one that browsers refuse") and "8765" in said, said
    assert [setting_warnings(Config(port=port)) for port in (0, 8765, 8080, 443, 80)] == [[]] * 5
    assert all(setting_warnings(Config(port=port)) for port in BROWSER_BLOCKED_PORTS)


def test_hardening_flags_have_environment_variables() -> None:
    config = load_config(["--max-connections", "5"], {"FILLMASK_MAX_CONNECTIONS": "7", "FILLMASK_TOKEN": TOKEN,
                                                      "FILLMASK_ALLOWED_ORIGINS": "*",
                                                      "FILLMASK_ALLOWED_HOSTS": "fill.example.com",
                                                      "FILLMASK_MAX_INFLIGHT_PER_CONNECTION": "9"})
    assert (config.max_connections, config.token, config.allowed_origins, config.allowed_hosts,
            config.max_inflight_per_connection) == (5, TOKEN, "*", "fill.example.com", 9)


@pytest.mark.parametrize(("argv", "environ", "message"), [
    (["--token", ""], {}, "--token is empty"),  # as from --token "$UNSET"
    (["--token", ""], {"FILLMASK_TOKEN": TOKEN}, "--token is empty"),  # the flag wins, and it is empty
    ([], {"FILLMASK_TOKEN": ""}, "FILLMASK_TOKEN is set but empty"),  # a secret that came out empty
])
def test_an_empty_token_is_refused_not_taken_as_no_token(argv: list[str], environ: dict[str, str], message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Serving without a token is leaving the token out; an empty one is a mistake that would open the
    server to anyone, so it stops the start with one line (exit 2, argparse's usage error)."""
    with pytest.raises(SystemExit) as exited:
        load_config(argv, environ)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and message in lines[-1] and ("leave --token out" in lines[-1]
                                                                or "unset the variable" in lines[-1])


# --- the handshake on a real socket --------------------------------------------------------------


async def raw_handshake(port: int, path: str = "/", headers: dict[str, str] | None = None,
                        ssl_context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    """Send one WebSocket upgrade request; return the status, headers and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ssl_context,
                                                   server_hostname="localhost" if ssl_context else None)
    lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Upgrade: websocket", "Connection: Upgrade",
             f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}", "Sec-WebSocket-Version: 13"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    answer_headers = dict(line.split(": ", 1) for line in header_lines if ": " in line)
    body = b""
    if "Content-Length" in answer_headers:
        body = await reader.readexactly(int(answer_headers["Content-Length"]))
    writer.close()
    return int(status_line.split()[1]), answer_headers, body


def assert_clean_error_body(body: bytes) -> str:
    """The body is one JSON line ending in one newline (a newcomer's find: ``curl`` of a refused ``/metrics``
    left the shell's prompt on the error's line), and its message one line without internals."""
    assert body.endswith(b"}\n") and body.count(b"\n") == 1, body
    message = orjson.loads(body)["error"]
    assert message and "\n" not in message and "Traceback" not in message and ".py" not in message, message
    return message


async def test_origin_check_on_the_handshake(server: FillMaskServer) -> None:
    port = server.port
    for origin in (None, f"http://127.0.0.1:{port}", "http://localhost:5173"):
        status, _, _ = await raw_handshake(port, headers={"Origin": origin} if origin else {})
        assert status == 101, origin
    for origin in ("https://evil.example", "null", f"https://127.0.0.1.evil.example:{port}"):
        status, _, body = await raw_handshake(port, headers={"Origin": origin})
        assert status == 403, origin
        assert "--allowed-origins" in assert_clean_error_body(body)
    with pytest.raises(InvalidStatus) as refused:  # what a browser page on another site would see
        async with connect(server.url, origin="https://evil.example"):  # type: ignore[arg-type]
            pass
    assert refused.value.response.status_code == 403


async def test_allowed_origins_setting_replaces_the_default(make_server: Any) -> None:
    async with make_server(allowed_origins="https://app.example.com") as srv:
        assert (await raw_handshake(srv.port, headers={"Origin": "https://app.example.com"}))[0] == 101
        assert (await raw_handshake(srv.port, headers={"Origin": "http://localhost:3000"}))[0] == 403
        assert (await raw_handshake(srv.port))[0] == 101


async def test_token_is_required_in_header_or_query(make_server: Any) -> None:
    async with make_server(token=TOKEN) as srv:
        port = srv.port
        for headers, path in (({}, "/"), ({"Authorization": "Bearer wrong"}, "/"), ({}, "/?token=wrong"),
                              ({"Authorization": f"Basic {TOKEN}"}, "/")):
            status, answer_headers, body = await raw_handshake(port, path, headers)
            assert status == 401 and answer_headers["WWW-Authenticate"] == "Bearer", (headers, path)
            assert "?token=" in assert_clean_error_body(body)
        assert (await raw_handshake(port, "/", {"Authorization": f"Bearer {TOKEN}"}))[0] == 101
        assert (await raw_handshake(port, f"/ws?token={TOKEN}"))[0] == 101
        async with session(f"{srv.url}?token={TOKEN}") as (ws, _):  # as the demo page does it
            assert (await request(ws, 1, TEXT))["type"] == "result"
        async with connect(srv.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            assert orjson.loads(await ws.recv())["type"] == "hello"
        # Origin comes first: a foreign page learns nothing about the token.
        assert (await raw_handshake(port, "/", {"Origin": "https://evil.example"}))[0] == 403
        # Probes stay open; metrics need the token too.
        assert (await http_status(f"{srv.http_url}/healthz")) == 200
        assert (await http_status(f"{srv.http_url}/readyz")) == 200
        assert (await http_status(f"{srv.http_url}/metrics")) == 401
        assert (await http_status(f"{srv.http_url}/metrics?token={TOKEN}")) == 200
        assert (await http_status(f"{srv.http_url}/metrics", {"Authorization": f"Bearer {TOKEN}"})) == 200
        refused = srv.metrics.registry.get_sample_value("fillmask_handshakes_refused_total", {"reason": "token"})
        assert refused == 4


async def test_refused_tokens_and_origins_are_logged_without_the_token(make_server: Any,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A 401 or 403 was only counted: an operator looking for who was refused access found nothing in
    the log (found by an operator's review). One line per kind and interval, with the peer, and never
    what was presented as a token."""
    wrong = "wrong-" + os.urandom(6).hex()
    with caplog.at_level(logging.INFO, logger="fillmask_server"):
        async with make_server(token=TOKEN) as srv:
            for _ in range(3):
                assert (await raw_handshake(srv.port, f"/?token={wrong}"))[0] == 401
            assert (await raw_handshake(srv.port, "/", {"Origin": "https://evil.example"}))[0] == 403
            assert (await http_status(f"{srv.http_url}/metrics?token={wrong}")) == 401
    said = [record.getMessage() for record in caplog.records if "refused" in record.getMessage()]
    assert len([line for line in said if "WebSocket handshake" in line and "401" in line]) == 1  # throttled
    assert any("403" in line and "'https://evil.example'" in line for line in said)
    assert not any(wrong in record.getMessage() or TOKEN in record.getMessage() for record in caplog.records)


def test_the_client_behind_a_trusted_proxy_is_read_from_the_right_of_x_forwarded_for() -> None:
    """``--forwarded-allow-ips``: only a peer that is a proxy is believed, and of its header only what
    the proxies appended (from the right): what a client wrote to the left of its own address is not."""
    proxies = ProxyPolicy.parse("127.0.0.1, 10.0.0.0/8")
    assert proxies.client("127.0.0.1", ["203.0.113.9"]) == "203.0.113.9"
    # A client's own "X-Forwarded-For: 1.2.3.4", then its real address, then an inner proxy's:
    assert proxies.client("127.0.0.1", ["1.2.3.4, 203.0.113.9", "10.0.0.7"]) == "203.0.113.9"
    assert proxies.client("192.0.2.1", ["203.0.113.9"]) is None  # not a proxy: the header is anyone's
    assert proxies.client("127.0.0.1", []) is None and proxies.client("127.0.0.1", ["unknown"]) is None
    assert proxies.client("::ffff:10.1.2.3", ["[2001:db8::1]:443"]) == "2001:db8::1"  # a dual-stack socket's v4 peer
    assert proxies.client("127.0.0.1", ["192.0.2.7:5555"]) == "192.0.2.7"
    assert proxies.client("127.0.0.1", ["10.9.9.9, 10.0.0.2"]) == "10.9.9.9"  # all proxies: the leftmost
    assert ProxyPolicy.parse("").client("127.0.0.1", ["203.0.113.9"]) is None  # the default: nobody
    # "*": any direct peer is a proxy, but no forwarded entry is: the nearest proxy's word, never what
    # the client wrote before it.
    assert ProxyPolicy.parse("*").client("198.51.100.1", ["6.6.6.6, 203.0.113.9"]) == "203.0.113.9"
    # Only a canonical address ever reaches a log line: a zone id's text is dropped, not echoed.
    assert proxies.client("127.0.0.1", ["fe80::1%\x85 refused from 10.6.6.6"]) == "fe80::1"
    assert proxies.client("127.0.0.1", ["[fe80::1%eth0]:80"]) == "fe80::1"
    assert proxies.client("127.0.0.1", [" ", "203.0.113.9"]) == "203.0.113.9"
    assert proxies.client("127.0.0.1", ["203.0.113.9, "]) is None  # an empty entry where the client should be
    # However long the header, at most MAX_FORWARDED_HOPS entries are read (from the right).
    long_chain = ", ".join(["203.0.113.1"] + ["10.0.0.1"] * (MAX_FORWARDED_HOPS + 5))
    assert proxies.client("127.0.0.1", [long_chain]) == "10.0.0.1"
    for bad in ("10.0.0.0/33", "proxy.example", "10.0.0.1:80"):
        with pytest.raises(ValueError, match="--forwarded-allow-ips entry"):
            ProxyPolicy.parse(bad)
    assert validate(Config(forwarded_allow_ips="eth0")).startswith("--forwarded-allow-ips entry 'eth0'")


@pytest.mark.parametrize("trusted", [True, False], ids=["behind-a-trusted-proxy", "header-from-anyone"])
async def test_a_refusal_behind_a_trusted_proxy_names_the_client_it_forwarded(
        make_server: Any, caplog: pytest.LogCaptureFixture, trusted: bool) -> None:
    """Behind deploy/haproxy.cfg (``option forwardfor``) every refusal named the balancer's address. With
    ``--forwarded-allow-ips`` naming it, the log names the client the balancer saw, and the balancer;
    without it, the header is ignored: any client could write it."""
    with caplog.at_level(logging.INFO, logger="fillmask_server"):
        async with make_server(token=TOKEN, forwarded_allow_ips="127.0.0.1" if trusted else "") as srv:
            headers = {"X-Forwarded-For": "203.0.113.9"}
            assert (await raw_handshake(srv.port, "/?token=wrong", headers))[0] == 401
    said = [record.getMessage() for record in caplog.records if "refused a WebSocket handshake" in record.getMessage()]
    assert len(said) == 1
    if trusted:
        assert re.search(r"from 203\.0\.113\.9 through 127\.0\.0\.1:\d+ with 401", said[0]), said
    else:
        assert "203.0.113.9" not in said[0] and re.search(r"from 127\.0\.0\.1:\d+ with 401", said[0]), said


async def test_the_serving_line_says_whether_a_token_is_required(make_server: Any,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """An operator reading the start-up lines learns whether the port is open to anyone."""
    for token, says in ((TOKEN, "(clients must present the token)"), ("", "(no token: whoever reaches the port")):
        caplog.clear()
        with caplog.at_level("INFO", logger="fillmask_server.server"):
            async with make_server(token=token):
                pass
        serving = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving ")]
        assert len(serving) == 1 and says in serving[0], serving


def test_a_server_on_every_interface_says_so_and_that_it_is_open_to_the_network() -> None:
    """`--host 0.0.0.0` (the container image's setting) said `serving ... on ws://127.0.0.1:8765/`, as if
    the server were local only, and nothing about the network when no token was set."""
    from fillmask_server.startup import serving_line

    line = serving_line("m", "0.0.0.0", 8765, "ws://127.0.0.1:8765/", token=False)
    assert line == ("m on every IPv4 interface, port 8765 (here: ws://127.0.0.1:8765/) (no token: anyone who "
                    "reaches this machine's port 8765 may use it; set --token)")
    # An operator's audit: "::" took no IPv4 client (asyncio makes it IPv6-only), yet said "every interface".
    six = serving_line("m", "::", 8765, "ws://[::1]:8765/", token=True)
    assert six.startswith("m on every IPv6 interface (no IPv4)") and six.endswith("(clients must present the token)")
    assert serving_line("m", "", 8765, "ws://127.0.0.1:8765/", token=True).startswith(
        "m on every interface, IPv4 and IPv6, port 8765")
    local = serving_line("m", "127.0.0.1", 8765, "ws://127.0.0.1:8765/", token=False)
    assert local == "m on ws://127.0.0.1:8765/ (no token: whoever reaches the port may use it)"


async def http_status(url: str, headers: dict[str, str] | None = None,
                      context: ssl.SSLContext | None = None) -> int:
    def get() -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5,
                                        context=context) as response:
                return response.status
        except urllib.error.HTTPError as error:
            assert_clean_error_body(error.read())
            return error.code

    return await asyncio.to_thread(get)


async def test_http_errors_are_clean_json_lines(server: FillMaskServer) -> None:
    for path in ("/nope", "/../../etc/passwd", "/%2e%2e/pyproject.toml", "/" + "a" * 5000):
        assert await http_status(server.http_url + path) == 404
    status, _, body = await raw_handshake(server.port, "/elsewhere" + "x" * 3000)
    assert status == 404 and len(assert_clean_error_body(body)) < 300


# --- TLS -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, made here with openssl."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {made.stderr.strip()[:200]}")
    return cert, key


async def test_tls_serves_wss_and_https_only(make_server: Any, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    client = ssl.create_default_context(cafile=str(cert))
    async with make_server(certfile=str(cert), keyfile=str(key)) as srv:
        assert srv.url.startswith("wss://") and srv.http_url.startswith("https://")
        async with connect(srv.url, ssl=client) as ws:
            assert orjson.loads(await ws.recv())["type"] == "hello"
            await ws.send(orjson.dumps({"type": "fill_mask", "id": 1, "text": TEXT}).decode())
            assert orjson.loads(await ws.recv())["type"] == "result"
        assert await http_status(srv.http_url + "/readyz", context=client) == 200
        same_origin = {"Origin": f"https://127.0.0.1:{srv.port}"}
        assert (await raw_handshake(srv.port, headers=same_origin, ssl_context=client))[0] == 101
        assert (await raw_handshake(srv.port, headers={"Origin": f"http://127.0.0.1.evil:{srv.port}"},
                                    ssl_context=client))[0] == 403
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port, ssl=client, server_hostname="localhost")
        try:  # a pipelined request over TLS: the first is answered, the rest discarded (§9), as on plain TCP
            request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n".encode()
            writer.write(request + request)
            answer = await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status":"ok"}\n'), answer[:60]
        with pytest.raises(Exception):  # noqa: B017 (plain ws:// on a TLS port fails, however it fails)
            async with connect(srv.url.replace("wss://", "ws://"), open_timeout=3):
                pass
        with pytest.raises(ssl.SSLCertVerificationError):  # an untrusted certificate is not accepted
            async with connect(srv.url, open_timeout=3):
                pass


def dockerfile_healthcheck() -> list[str]:
    """The command of deploy/Dockerfile's HEALTHCHECK (its exec form)."""
    text = (Path(__file__).resolve().parent.parent / "deploy" / "Dockerfile").read_text()
    return orjson.loads(re.search(r"^HEALTHCHECK [^\n]*\\\n\s*CMD (\[.*\])$", text, re.M).group(1))


async def test_the_images_health_check_follows_the_port_and_tls(make_server: Any, certificate: tuple[Path, Path]
                                                                ) -> None:
    """The image's HEALTHCHECK asked plain HTTP even of a server serving TLS, which answered it 400: the
    container was reported unhealthy (found by an operator's review)."""
    command = [sys.executable, *dockerfile_healthcheck()[1:]]  # its "python", here the venv's
    cert, key = certificate
    for settings, env in (({}, {}), ({"certfile": str(cert), "keyfile": str(key)},
                                     {"FILLMASK_CERTFILE": str(cert), "FILLMASK_KEYFILE": str(key)})):
        async with make_server(**settings) as srv:
            env = {**os.environ, "FILLMASK_PORT": str(srv.port), **env}
            checked = await asyncio.to_thread(subprocess.run, command, env=env, capture_output=True, text=True,
                                              timeout=30)
            assert checked.returncode == 0, (settings, checked.stderr[-500:])


def _other_key(directory: Path) -> bool:
    """Write ``other.pem``, a private key of no certificate here; whether openssl made it."""
    made = subprocess.run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out",
                           str(directory / "other.pem")], capture_output=True, text=True, timeout=30)
    return made.returncode == 0


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"),
                    reason="root reads any file; setpriv (util-linux) takes that power away")
def test_a_key_the_servers_user_may_not_read_is_named_not_the_certificate(certificate: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    """A newcomer's trial: a key.pem its owner alone may read, the server run as another user: the line
    named cert.pem (the OSError of OpenSSL's load names no file). Each file is read first now. (The key
    here may be read by nobody; root, which reads any file, runs without that power.)"""
    cert, key = certificate
    shutil.copy(key, tmp_path / "key.pem")
    os.chmod(tmp_path / "key.pem", 0)
    code = ("from fillmask_server.access import tls_context\n"
            f"try: tls_context({str(cert)!r}, {str(tmp_path / 'key.pem')!r})\n"
            "except ValueError as exc: print(exc)")
    powerless = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    said = subprocess.run([*powerless, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert said.stdout.startswith(f"cannot read TLS file {str(tmp_path / 'key.pem')!r}: Permission denied"), (
        said.stdout + said.stderr)


def test_tls_files_that_do_not_load_are_one_line_errors(certificate: tuple[Path, Path], tmp_path: Path) -> None:
    cert, key = certificate
    assert isinstance(tls_context(str(cert), str(key)), ssl.SSLContext)
    bundle = tmp_path / "bundle.pem"
    bundle.write_text(cert.read_text() + key.read_text())
    assert isinstance(tls_context(str(bundle)), ssl.SSLContext)  # key in the certificate file
    with pytest.raises(ValueError, match="the file holds no private key; give the key with --keyfile"):
        tls_context(str(cert))  # no key anywhere (it said "not PEM, or the key does not match")
    with pytest.raises(ValueError, match="it is a directory; name the PEM file in it"):
        tls_context(str(tmp_path))  # (it said "no such file")
    assert _other_key(tmp_path)
    with pytest.raises(ValueError, match="the key does not belong to the certificate"):
        tls_context(str(cert), str(tmp_path / "other.pem"))
    (tmp_path / "junk.pem").write_text("junk")
    problem = validate(Config(certfile=str(tmp_path / "junk.pem")))
    assert problem is not None and problem.startswith("--certfile/--keyfile: ") and "\n" not in problem
    # An encrypted key: one line, never OpenSSL's passphrase prompt (an audit saw the server stop and ask,
    # twice, then blame the certificate). stdin is a pipe here, as under a supervisor.
    locked = tmp_path / "locked.pem"
    made = subprocess.run(["openssl", "pkey", "-in", str(key), "-aes256", "-passout", "pass:secret", "-out",
                           str(locked)], capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    refused = subprocess.run([sys.executable, "-c", "import sys; from fillmask_server.access import tls_context\n"
                              f"try: tls_context({str(cert)!r}, {str(locked)!r})\n"
                              "except ValueError as exc: print(exc)"],
                             capture_output=True, text=True, timeout=60, input="")
    assert refused.stdout.startswith(f"the TLS key {str(locked)!r} is encrypted"), refused.stdout + refused.stderr
    assert "pass phrase" not in refused.stdout + refused.stderr
