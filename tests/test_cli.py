"""The ``fillmask-client`` command during drains and restarts, against limits, and its output (issue 12 item 3).

The command runs as a subprocess against real servers in this process (``make_server``); drains and
restarts are driven from the test, with the engine paused where a state must hold still.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import ssl
import sys
from pathlib import Path
from typing import Any

import pytest

from fillmask_client.cli import Tally, format_table, limits_problem, stop_line
from fillmask_client.connection import connect_failure
from fillmask_client.errors import ConnectionLostError, OverloadedError
from fillmask_client.frames import FillMaskResult, outcome
from tests.wire import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Paris is the [MASK] of France."
LIMITS = {"top_k": {"min": 1, "max": 100, "default": 5}, "max_targets": 3, "max_target_chars": 10,
          "max_deadline_ms": 600000}


async def start_cli(*args: str, stdin: str = "") -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fillmask_client", *args, cwd=ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None
    proc.stdin.write(stdin.encode())
    proc.stdin.close()
    return proc


async def finish(proc: asyncio.subprocess.Process, timeout: float = 30) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def run_cli(*args: str, stdin: str = "") -> tuple[int, str, str]:
    return await finish(await start_cli(*args, stdin=stdin))


def count(srv: Any, outcome_: str, code: str = "") -> float:
    return srv.metrics.registry.get_sample_value("fillmask_requests_total", {"outcome": outcome_, "code": code}) or 0


def tables(out: str) -> int:
    return len(re.findall(r"^rank  token", out, flags=re.MULTILINE))


WAITING = re.compile(r"^fillmask-client: waiting for the server… \((\d+)s\)(: .+)?$")


def split_waiting(err: str) -> tuple[list[int], list[str]]:
    """The seconds of each ``waiting for the server… (Ns)`` line of ``err``, and its other lines."""
    seconds, others = [], []
    for line in err.splitlines():
        match = WAITING.match(line)
        if match:
            seconds.append(int(match.group(1)))
        else:
            others.append(line)
    return seconds, others


# --- pure ----------------------------------------------------------------------------------------


def test_flags_are_checked_against_the_servers_limits_naming_the_flag() -> None:
    assert limits_problem(5, ["a", "b"], 1000, LIMITS) is None
    assert limits_problem(101, None, None, LIMITS) == "--top-k 101: the server accepts 1 to 100"
    assert limits_problem(None, list("abcd"), None, LIMITS) == "--targets: 4 words; the server accepts at most 3"
    assert limits_problem(None, ["capitalcity"], None, LIMITS) == (
        "--targets: 'capitalcity' has 11 characters; the server accepts at most 10")
    assert limits_problem(None, None, 600001, LIMITS) == "--deadline-ms 600001: the server accepts at most 600000"
    assert limits_problem(500, ["x"] * 9, None, {}) is None  # limits the server does not announce are its own to check


def test_numbers_are_shown_as_typed_and_the_busy_hint_fits_the_flags() -> None:
    from fillmask_client.cli import busy_hint

    assert limits_problem(None, None, 600000.5, {"max_deadline_ms": 600000}) == (
        "--deadline-ms 600000.5: the server accepts at most 600000")  # it said 600000 > 600000
    assert limits_problem(None, None, 1234567.0, {"max_deadline_ms": 600000}).startswith("--deadline-ms 1234567:")  # type: ignore[union-attr]
    assert busy_hint(1, retried=True) == ("1 text was refused because the server was busy: send fewer at once "
                                          "(a lower --concurrency or fewer --connections)")


def test_summary_counts_answers_and_failures_by_reason() -> None:
    tally = Tally(7, answered=3)
    tally.failed.update(["no_mask", "queue_full", "no_mask"])
    assert tally.summary() == "7 texts: 3 answered, 3 failed (2 no_mask, 1 queue_full), 1 not answered"
    assert Tally(2, answered=2).summary() == "2 texts: 2 answered, 0 failed"


def test_a_drain_stops_the_run_with_the_same_words_before_and_after_the_close() -> None:
    notice = OverloadedError(503, "shutting_down", 1000)
    closed = ConnectionLostError("connection lost", url="ws://x/", code=1001, reason="server shutting down")
    dropped = ConnectionLostError("connection to ws://x/ lost (1006 dropped)", url="ws://x/", code=1006)
    assert stop_line(notice, Tally(1), True) == "stopped: the server is shutting down (503 shutting_down)"
    assert stop_line(closed, Tally(1), True) == "stopped: the server is shutting down (1001 server shutting down)"
    assert stop_line(dropped, Tally(1), True) == "stopped: connection to ws://x/ lost (1006 dropped)"


def test_everything_after_a_double_dash_is_a_text_even_one_argparse_would_take_for_an_option() -> None:
    """argparse's intermixed parsing took ``-[MASK]`` for an unknown option even after ``--`` (found by
    a newcomer's trial: the README's own escape did not work for a text with no space)."""
    from fillmask_client.cli import build_parser, parse_args

    args = parse_args(build_parser(), ["a [MASK].", "-k", "2", "--", "-[MASK]", "--url", "-"])
    assert args.texts == ["a [MASK].", "-[MASK]", "--url", "-"] and args.top_k == 2
    assert parse_args(build_parser(), ["-k", "3", "b [MASK]."]).texts == ["b [MASK]."]
    # '--' as an option's own value: argparse made it an empty list, and the run ended in a traceback.
    for given in (["--targets=--", "a [MASK]."], ["-k--", "a [MASK]."], ["--url=--"]):
        with pytest.raises(SystemExit) as stopped:
            parse_args(build_parser(), given)
        assert stopped.value.code == 2, given


def test_an_untrusted_certificate_gets_the_advice_its_reason_calls_for() -> None:
    """A TLS audit: "pass --cafile" came for every reason, even an expired certificate, which no
    trust can fix, and a certificate for another host name."""

    def refused(code: int, words: str) -> str:
        exc = ssl.SSLCertVerificationError(1, f"[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: {words}")
        exc.verify_code, exc.verify_message = code, words
        return connect_failure(exc, "wss://fill.example:8765/")

    expired = refused(10, "certificate has expired")
    assert expired.endswith(": renew the certificate on the server, or check this machine's clock"), expired
    other_host = refused(62, "Hostname mismatch, certificate is not valid for 'fill.example'.")
    assert "it is not for 'fill.example'; connect with a host name it was issued for" in other_host, other_host
    self_signed = refused(18, "self-signed certificate")
    assert "to trust it, pass ssl=ssl.create_default_context(cafile=PATH)" in self_signed, self_signed
    assert "cafile" not in expired + other_host


def test_socket_errors_name_a_cause_even_when_they_carry_no_message() -> None:
    def why(exc: OSError, url: str = "ws://fill.example:8765/") -> str:
        reason = connect_failure(exc, url)
        assert reason.strip() and "  " not in reason
        return reason

    assert why(ConnectionResetError(), "wss://fill.example/") == (
        "the TLS handshake with fill.example:443 failed (connection reset); if that server speaks plain "
        "WebSocket, use ws:// instead of wss://")
    assert why(ConnectionResetError()) == (
        "fill.example:8765 reset the connection during the handshake (connection reset)")
    # OpenSSL's tag and CPython's source line are internals, not words for a person.
    plain_server = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")
    assert why(plain_server, "wss://fill.example/") == (
        "the TLS handshake with fill.example:443 failed (the answer was not TLS); if that server speaks plain "
        "WebSocket, use ws:// instead of wss://")
    newer = ssl.SSLError(1, "[SSL] record layer failure (_ssl.c:1033)")  # the same, from OpenSSL 3.2 on
    assert "failed (the answer was not TLS);" in why(newer, "wss://fill.example/")
    other = ssl.SSLError(1, "[SSL: SSLV3_ALERT_HANDSHAKE_FAILURE] sslv3 alert handshake failure (_ssl.c:1000)")
    assert "failed (sslv3 alert handshake failure);" in why(other, "wss://fill.example/")
    assert "failed (no reason given);" in why(ssl.SSLError(1, "(_ssl.c:1006)"), "wss://fill.example/")
    assert why(ConnectionRefusedError(111, "Connect call failed")).startswith(
        "connection refused: nothing listens on fill.example:8765")
    assert why(ConnectionRefusedError(111, "Connect call failed"), "ws://[::1]:8765/").startswith(
        "connection refused: nothing listens on [::1]:8765 ")  # (a pytest trial: "on ::1:8765")
    assert why(socket.gaierror(-2, "Name or service not known")) == (
        "cannot resolve the host name 'fill.example' (Name or service not known)")
    assert why(OSError()) == "OSError"


def test_table_columns_stay_aligned_whatever_the_scores() -> None:
    def candidate(word: str, score: float) -> dict[str, Any]:
        return {"score": score, "token": 1, "token_str": word, "sequence": f"the {word} here."}

    for scores in ([0.5, 2.03e-05, 0.25], [1.2e-07, 0.9999, 0.0], [0.1234, 0.0012, 0.00099]):
        result = outcome({"type": "result", "id": 1, "predictions": [candidate(f"w{n}" * (n + 1), s)
                                                                      for n, s in enumerate(scores)]})
        assert isinstance(result, FillMaskResult)
        header, *rows = format_table(TEXT, result).splitlines()[1:]
        column = header.index("sequence")
        assert all(row.index("the ") == column for row in rows), "\n".join([header, *rows])
        shown = [row[:column].split()[-1] for row in rows]
        assert all((cell == "0.0000") == (score == 0.0) for cell, score in zip(shown, scores, strict=True)), shown


def test_targets_not_scored_as_given_are_noted_under_the_text() -> None:
    candidate = {"score": 0.5, "token": 2047, "token_str": "new", "sequence": "paris is the new of france."}
    frame = {"type": "result", "id": 1, "predictions": [candidate],
             "targets": [{"given": "new york", "scored": "new"}, {"given": "zzzzqqq", "scored": "z"},
                         {"given": "\u0301", "scored": None}]}
    result = outcome(frame)
    assert isinstance(result, FillMaskResult)
    assert result.targets == ({"given": "new york", "scored": "new"}, {"given": "zzzzqqq", "scored": "z"},
                              {"given": "\u0301", "scored": None})
    lines = format_table(TEXT, result).splitlines()
    assert lines[:4] == [TEXT, 'note: target "new york" was scored as "new"',
                         'note: target "zzzzqqq" was scored as "z"',
                         'note: target "\u0301" was ignored: it has no vocabulary token']
    plain = outcome({**frame, "targets": None})  # absent or malformed: no notes, and no failure
    assert isinstance(plain, FillMaskResult) and plain.targets == ()
    assert format_table(TEXT, plain).splitlines()[1].startswith("rank")


# --- against servers ------------------------------------------------------------------------------


async def test_stops_at_the_first_going_away_with_one_line_and_exit_3(make_server: Any) -> None:
    texts = [f"Text {n} is the [MASK] one." for n in range(50)]
    async with make_server() as srv:
        with srv.engine.paused():
            proc = await start_cli("--url", srv.url, "-k", "1", "-c", "4", stdin="\n".join(texts))
            await wait_until(lambda: srv.engine.queued() == 4)
            drain = asyncio.create_task(srv.drain(timeout=10))  # going_away first, then it answers the four
            await wait_until(lambda: srv.ready.draining)
        code, out, err = await finish(proc)
        await drain
    assert code == 3
    # The fifth text fails on the draining connection (503 shutting_down) or, should the server's close
    # already have arrived, on the closed one (1001): the same news, told the same way.
    [line] = err.splitlines()
    assert re.fullmatch(
        r"fillmask-client: stopped: the server is shutting down \((503 shutting_down|1001 server shutting down)\); "
        r"50 texts: 4 answered, 0 failed, 46 not answered; run again, or pass --reconnect to follow the server "
        r"to its replacement", line), line
    assert tables(out) == 4  # the four it had accepted were still answered, and printed
    # It stopped at the notice: the other 46 were never sent (§10: "send nothing more here").
    assert (count(srv, "result"), count(srv, "overloaded", "shutting_down")) == (4, 0)


async def test_reconnect_follows_the_server_through_a_restart_longer_than_the_timeout(make_server: Any) -> None:
    texts = [f"Text {n} is the [MASK] one." for n in range(20)]
    async with make_server() as first:
        port = first.port
        with first.engine.paused():
            proc = await start_cli("--url", first.url, "-k", "2", "-c", "2", "--reconnect", "--timeout", "0.3",
                                   stdin="\n".join(texts))
            await wait_until(lambda: first.engine.queued() == 2)
            drain = asyncio.create_task(first.drain(timeout=10))
            await wait_until(lambda: first.ready.draining)
        await drain
    await asyncio.sleep(1.5)  # nothing listens for five times --timeout, as while a replacement loads its model
    assert proc.returncode is None
    async with make_server(port=port) as second:
        code, out, err = await finish(proc)
        assert (count(first, "result"), count(second, "result")) == (2, 18)
    seconds, others = split_waiting(err)
    assert (code, others) == (0, ["fillmask-client: 20 texts: 20 answered, 0 failed"]), err
    assert seconds and seconds == sorted(set(seconds)), err  # said while it waited, at most once a second
    # The first of them says why: nothing listens, or (when the drain outlasted its reconnect delay, as on
    # a loaded machine) the draining server refused it with 503.
    assert "connection refused" in err.splitlines()[0] or "(HTTP 503)" in err.splitlines()[0], err
    assert tables(out) == 20


async def test_waits_for_a_server_that_is_starting(make_server: Any) -> None:
    port = free_port()
    proc = await start_cli("--url", f"ws://127.0.0.1:{port}/", "-k", "1", "--timeout", "30", TEXT)
    await asyncio.sleep(0.5)  # nothing listens yet: the command keeps trying instead of giving up
    assert proc.returncode is None
    async with make_server(port=port):
        code, out, err = await finish(proc)
    assert (code, split_waiting(err)[1]) == (0, []) and tables(out) == 1, err

    # Two that never get a server, side by side (each waits out its --timeout).
    (code, out, err), (quiet_code, _, quiet_err) = await asyncio.gather(
        run_cli("--url", f"ws://127.0.0.1:{free_port()}/", "--timeout", "2", TEXT),
        run_cli("--url", f"ws://127.0.0.1:{free_port()}/", "--timeout", "1", "-q", TEXT))
    seconds, others = split_waiting(err)
    assert code == 3 and out == "" and seconds[:1] == [1], err  # it said it was waiting, then gave up
    assert len(others) == 1 and "cannot connect" in err and "after trying for 2 s" in err
    assert quiet_code == 3 and split_waiting(quiet_err)[0] == [], quiet_err  # --quiet: no waiting lines


async def refusing_proxy(status: str, body: bytes) -> asyncio.Server:
    """A stand-in for a proxy or load balancer that answers every handshake ``status`` with ``body``."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/html\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


async def test_every_connection_failure_says_why_in_one_line(server: Any, make_server: Any) -> None:
    # Bound and never listening, for the whole test: connecting is refused, and none of the servers it
    # starts can be given that port (a port found free and let go was, once, the 503 proxy's).
    unlistened = socket.socket()
    unlistened.bind(("127.0.0.1", 0))
    cases = [(f"wss://127.0.0.1:{server.port}/", "TLS handshake with 127.0.0.1:"),  # TLS against plain
             (f"ws://127.0.0.1:{unlistened.getsockname()[1]}/", "connection refused: nothing listens on 127.0.0.1:"),
             ("ws://no-such-host.invalid:8765/", "cannot resolve the host name 'no-such-host.invalid'")]
    proxies = [await refusing_proxy("403 Forbidden", b""),
               await refusing_proxy("503 Service Unavailable", b"<html><body>No server is available</body></html>")]
    cases += [(f"ws://127.0.0.1:{proxies[0].sockets[0].getsockname()[1]}/", "(HTTP 403): forbidden"),
              (f"ws://127.0.0.1:{proxies[1].sockets[0].getsockname()[1]}/", "(HTTP 503): no server ready")]
    try:
        async with make_server(allowed_hosts="fill.example.com") as strict:
            # Its own address is always allowed; "localhost" is not, here.
            cases.append((f"ws://localhost:{strict.port}/", "(HTTP 421): this server does not answer for the host"))
            for url, expected in cases:
                # What waiting may fix (refused, 503, a name not resolved yet) is tried again for
                # --timeout, so those get a short one; every other failure ends the run at once, and gets
                # a long one: a handshake that a busy machine slows must not turn into a timeout.
                waits = expected.startswith(("connection refused", "cannot resolve")) or "(HTTP 503)" in expected
                code, out, err = await run_cli("--url", url, "--timeout", "0.5" if waits else "20", "-q", TEXT)
                assert (code, out) == (3, ""), err
                assert len(err.splitlines()) == 1 and expected in err, err
                assert "  " not in err and ":  " not in err and not err.rstrip().endswith(":"), err
    finally:
        unlistened.close()
        for proxy in proxies:
            proxy.close()


async def test_flags_outside_the_servers_limits_are_one_usage_error(make_server: Any) -> None:
    async with make_server(max_top_k=10, max_targets=2) as srv:
        texts = "\n".join([TEXT] * 5)
        for flags, named in [(["--top-k", "11"], "--top-k 11: the server accepts 1 to 10"),
                             (["-t", "a,b,c"], "--targets: 3 words; the server accepts at most 2"),
                             (["--deadline-ms", "700000"], "--deadline-ms 700000: the server accepts at most")]:
            code, out, err = await run_cli("--url", srv.url, *flags, stdin=texts)
            assert (code, out) == (2, "") and err.startswith(f"fillmask-client: {named}"), err
            assert len(err.splitlines()) == 1
        for flags, named in [(["--top-k", "0"], "--top-k 0"), (["-t", " , "], "--targets: no words given"),
                             (["--connections", "0"], "--connections must be between 1 and 1024"),
                             # (a billion connections' slots took all memory before any socket opened)
                             (["--connections", "1000000000"], "--connections must be between 1 and 1024")]:
            code, _, err = await run_cli("--url", srv.url, *flags, stdin=texts)
            assert code == 2 and named in err, err  # judged before connecting (a usage error from argparse)
        assert sum(count(srv, "error", code) for code in ("invalid_top_k", "invalid_targets", "invalid_deadline")) == 0


async def test_summary_line_names_the_reasons(server: Any) -> None:
    code, out, err = await run_cli("--url", server.url, "-k", "1", "--connections", "2",
                                   stdin=f"{TEXT}\n\nno mask here\n" + "[MASK] " * 9 + "\n")
    assert code == 1 and tables(out) == 1
    *per_text, summary = err.splitlines()
    # Each failed text says where it is: the blank line 2 is skipped, so text 2 is on line 3.
    assert per_text[0].startswith("fillmask-client: text 2 (standard input line 3: 'no mask here'): no_mask")
    assert per_text[1].startswith("fillmask-client: text 3 (standard input line 4: ") and len(per_text) == 2
    assert summary == "fillmask-client: 3 texts: 1 answered, 2 failed (1 no_mask, 1 too_many_masks)"


async def test_texts_from_a_file_or_file_dash_are_named_by_their_line(server: Any, tmp_path: Path) -> None:
    listing = tmp_path / "texts.txt"
    listing.write_text(f"{TEXT}\n\n\nno mask here\n")
    code, _, err = await run_cli("--url", server.url, "-k", "1", "-q", "an argument [MASK].", "--file", str(listing))
    assert code == 1 and f"text 3 (--file {listing} line 4: 'no mask here'): no_mask" in err, err
    code, out, err = await run_cli("--url", server.url, "-k", "1", "-q", "--file", "-", stdin=f"{TEXT}\nno mask\n")
    assert code == 1 and tables(out) == 1, err  # --file - is standard input (it was "cannot read -")
    assert "text 2 (standard input line 2: 'no mask'): no_mask" in err, err
    code, _, err = await run_cli("--url", server.url, "-q", "-", "no mask either", stdin=f"{TEXT}\n")
    assert code == 1 and "text 2 (argument 2: 'no mask either'): no_mask" in err, err
    # A file's only text is named too (a newcomer's find: it was named only among others); an argument
    # alone is not: the line is about the one text the command was given.
    listing.write_text("\n\nno mask alone\n")
    code, _, err = await run_cli("--url", server.url, "--file", str(listing))
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"fillmask-client: text 1 (--file {listing} line 3: 'no mask alone'): no_mask: "), err
    code, _, err = await run_cli("--url", server.url, "no mask alone")
    assert code == 1 and err.startswith("fillmask-client: no_mask: "), err


async def test_reading_texts_from_a_terminal_says_how_to_end_them(server: Any) -> None:
    """`fillmask-client -` in a terminal read until Ctrl-D without a word, and seemed to hang."""
    import pty

    controller, terminal = pty.openpty()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fillmask_client", "--url", server.url, "-k", "1", "-", cwd=ROOT, stdin=terminal,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        os.write(controller, f"{TEXT}\n".encode() + b"\x04")  # a line, then Ctrl-D at the start of the next
        code, out, err = await finish(proc)
    finally:
        os.close(terminal)
        os.close(controller)
    assert code == 0 and tables(out) == 1, err
    assert err.splitlines() == ["fillmask-client: reading texts from the terminal, one per line; end with Ctrl-D "
                                "(all are read before any is sent)"]


async def test_texts_refused_by_a_busy_server_end_with_what_to_do(make_server: Any) -> None:
    async with make_server(max_queue=2) as srv:  # one connection's share: half the queue, one request
        with srv.engine.paused():
            proc = await start_cli("--url", srv.url, "-c", "6", "-k", "1", stdin="\n".join([TEXT] * 6))
            await wait_until(lambda: count(srv, "overloaded", "queue_share") == 5)
        code, out, err = await finish(proc)
    assert code == 1 and tables(out) == 1
    *_, summary, hint = err.splitlines()
    assert summary == "fillmask-client: 6 texts: 1 answered, 5 failed (5 queue_share)"
    assert hint == ("fillmask-client: 5 texts were refused because the server was busy: pass --retry, or send "
                    "fewer at once (a lower --concurrency)")


async def test_fillmask_server_help_names_the_program_as_invoked() -> None:
    script = Path(sys.executable).parent / "fillmask-server"
    if not script.exists():
        pytest.skip("the fillmask-server console script is not installed (pip install -e .)")
    proc = await asyncio.create_subprocess_exec(str(script), "--help", stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0 and out.decode().startswith("usage: fillmask-server ")


async def test_a_file_name_with_a_newline_is_quoted_so_the_message_stays_one_line(tmp_path: Path) -> None:
    """A fuzz of the command's flags: ``--file`` or ``--cafile`` naming a file with a newline in its name
    broke the one line every message is; such a name is now shown quoted."""
    odd = tmp_path / "a\nb"
    for flags in (["--file", str(odd)], ["--cafile", str(odd)]):
        code, _, err = await run_cli("--url", "wss://127.0.0.1:1/", *flags, "a [MASK]")
        assert code == 2 and len(err.splitlines()) == 1 and repr(str(odd)) in err, err
