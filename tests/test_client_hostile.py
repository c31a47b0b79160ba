"""The client against servers that misbehave, or behave at the edges the spec allows (found by an
adversarial review of the client): each fake server here is a few lines of ``websockets`` on a
loopback port, scripted frame by frame, so that a test can say exactly what the server did."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import math
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from fillmask_client import (
    ConnectError,
    ConnectionLostError,
    DeadlineExceededError,
    FillMaskClient,
    FillMaskError,
    OverloadedError,
    RequestError,
    SyncFillMaskClient,
)
from fillmask_client.connection import MAX_INCOMING_BYTES
from fillmask_client.errors import one_line
from fillmask_client.frames import check_hello, outcome
from fillmask_client.retry import ReconnectBackoff, RetryPolicy
from fillmask_client.wire import WAIT_HINT_CAP_MS

TEXT = "Paris is the [MASK] of France."
HELLO = {"type": "hello", "protocol": 1, "server": "fake", "model": "fake", "mask_token": "[MASK]",
         "limits": {"max_batch_size": 4, "max_frame_bytes": 65536}}
CANDIDATE = {"score": 0.5, "token": 7, "token_str": "capital", "sequence": "paris is the capital of france."}

Script = Callable[[ServerConnection, dict[str, Any], int], Awaitable[None]]


def result(request: dict[str, Any]) -> bytes:
    return orjson.dumps({"type": "result", "id": request["id"], "predictions": [CANDIDATE]})


class Fake:
    """A fake server: it greets with ``hello`` and hands the n-th ``fill_mask`` it reads (0-based,
    across connections) to ``script``; ``requests`` counts them, ``open`` counts live connections,
    ``connections`` holds every one it accepted."""

    def __init__(self, script: Script, hello: dict[str, Any] | None = None) -> None:
        self.script, self.hello = script, hello or HELLO
        self.requests = 0
        self.open = 0
        self.connections: list[ServerConnection] = []
        self.tasks: set[asyncio.Future[None]] = set()
        self.url = ""

    async def handler(self, ws: ServerConnection) -> None:
        self.open += 1
        self.connections.append(ws)
        try:
            await ws.send(orjson.dumps(self.hello).decode())
            async for message in ws:
                frame = orjson.loads(message)
                if frame.get("type") == "fill_mask":
                    number, self.requests = self.requests, self.requests + 1
                    self.tasks.add(asyncio.ensure_future(self.script(ws, frame, number)))
        except ConnectionClosed:
            pass
        finally:
            self.open -= 1


@contextlib.asynccontextmanager
async def fake(script: Script, hello: dict[str, Any] | None = None) -> AsyncIterator[Fake]:
    server = Fake(script, hello)
    async with serve(server.handler, "127.0.0.1", 0) as running:
        server.url = f"ws://127.0.0.1:{running.sockets[0].getsockname()[1]}/"
        yield server


async def answers(ws: ServerConnection, request: dict[str, Any], number: int) -> None:
    await ws.send(result(request))


def refuse_first(wait_ms: float, reason: str = "queue_full") -> Script:
    async def script(ws: ServerConnection, request: dict[str, Any], number: int) -> None:
        if number == 0:
            await ws.send(orjson.dumps({"type": "overloaded", "id": request["id"], "status": 503,
                                        "reason": reason, "retry_after_ms": wait_ms}))
        else:
            await ws.send(result(request))
    return script


async def until(condition: Callable[[], bool], within: float = 5.0) -> None:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_call_waiting_out_a_back_off_ends_at_once_on_close_loss_or_its_deadline() -> None:
    """A call held back by a 20 s retry_after_ms slept all of it: past close(), past the connection's
    loss, and past its own deadline_ms (then blamed "20001 ms in the queue", never having been sent)."""
    for how in ("close", "deadline", "loss"):
        async with fake(refuse_first(20_000)) as server:
            client = FillMaskClient(server.url)
            await client.connect()
            with pytest.raises(OverloadedError):
                await client.fill_mask(TEXT)
            started = time.monotonic()
            if how == "deadline":
                with pytest.raises(DeadlineExceededError, match="before the request was sent"):
                    await client.fill_mask(TEXT, deadline_ms=1000)
            else:
                held = asyncio.ensure_future(client.fill_mask(TEXT))
                await asyncio.sleep(0.2)
                if how == "close":
                    await client.close()
                else:
                    for ws in server.connections:
                        ws.transport.abort()
                with pytest.raises(ConnectionLostError):
                    await asyncio.wait_for(held, 10)
            assert time.monotonic() - started < 3, how
            assert server.requests == 1, how  # the held call was never sent
            await client.close()


async def test_new_calls_go_to_the_connection_the_server_did_not_hold_back() -> None:
    """With two replicas, 9 of 10 new calls went to the one that had said wait 5 s (a held call did not
    count in its load), while the other was idle."""
    async with fake(refuse_first(5_000)) as held, fake(answers) as free, \
            FillMaskClient([held.url, free.url]) as client:
        with pytest.raises(OverloadedError):  # the first call goes to the first connection: refused
            await client.fill_mask(TEXT)
        started = time.monotonic()
        got = await asyncio.gather(*(client.fill_mask(TEXT) for _ in range(10)))
        assert len(got) == 10 and time.monotonic() - started < 2
        assert (held.requests, free.requests) == (1, 10)


async def test_unknown_reasons_are_read_as_section_14_says() -> None:
    """§14: an overloaded reason this client does not know is retried like queue_full; a going_away
    reason it does not know reads as shutting_down (it read "server overloaded (503 maintenance)",
    and the command exited 1 per text instead of stopping with 3)."""
    async with fake(refuse_first(50, reason="queue_busy_v2")) as server:
        async with FillMaskClient(server.url, retry=True) as client:
            assert await client.fill_mask(TEXT) == [CANDIDATE]
        assert server.requests == 2

    async def going(ws: ServerConnection, request: dict[str, Any], number: int) -> None:
        await ws.send(orjson.dumps({"type": "going_away", "reason": "maintenance", "reconnect_within_ms": 100}))
        await ws.send(result(request))

    async with fake(going) as server, FillMaskClient(server.url) as client:
        assert await client.fill_mask(TEXT) == [CANDIDATE]  # owed before the notice: still answered
        with pytest.raises(OverloadedError) as later:
            await client.fill_mask(TEXT)
        assert later.value.reason == "shutting_down" and str(later.value).startswith("server shutting down")


async def test_malformed_overloaded_frames_fail_their_own_call_only() -> None:
    """A reason that is a list, or a retry_after_ms or queue_ms that is a string, raised TypeError or
    ValueError (not a FillMaskError); the list crashed the reader and failed every call on the socket."""
    odd = [{"status": 503, "reason": ["queue_full"], "retry_after_ms": 10},
           {"status": 503, "reason": "queue_full", "retry_after_ms": "soon"},
           {"status": 504, "reason": "deadline_exceeded", "queue_ms": "x", "retry_after_ms": [1]},
           {"status": "503", "reason": {"a": 1}}]

    async def script(ws: ServerConnection, request: dict[str, Any], number: int) -> None:
        if number % 2 == 0:
            await asyncio.sleep(0.2)  # the innocent call: answered after the odd frame came
            await ws.send(result(request))
        else:
            await ws.send(orjson.dumps({"type": "overloaded", "id": request["id"], **odd[number // 2]}))

    async with fake(script) as server, FillMaskClient(server.url) as client:
        for _ in odd:
            innocent = asyncio.ensure_future(client.fill_mask(TEXT))
            await until(lambda: client.in_flight == 1)
            with pytest.raises(OverloadedError) as refused:
                await client.fill_mask(TEXT)
            assert "\n" not in str(refused.value)
            assert await innocent == [CANDIDATE]
            await asyncio.sleep(0.02)  # past any retry_after_ms this connection took from it


async def test_giving_up_on_connect_leaves_no_connection_open() -> None:
    """Cancelling connect() while it waited for the hello, or closing the client then, left the
    WebSocket open (and connect() returned as if connected)."""
    release = asyncio.Event()
    accepted: list[ServerConnection] = []

    async def slow_hello(ws: ServerConnection) -> None:
        accepted.append(ws)
        await release.wait()
        with contextlib.suppress(ConnectionClosed):
            await ws.send(orjson.dumps(HELLO).decode())
            await ws.wait_closed()

    def all_closed() -> bool:  # the server's side saw the client go (its reader runs on its own)
        return all(ws.state.name == "CLOSED" for ws in accepted)

    async with serve(slow_hello, "127.0.0.1", 0) as running:
        url = f"ws://127.0.0.1:{running.sockets[0].getsockname()[1]}/"
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(FillMaskClient(url).connect(), 0.3)
            await until(lambda: len(accepted) == 1 and all_closed())
            client = FillMaskClient(url)
            connecting = asyncio.ensure_future(client.connect())
            await until(lambda: len(accepted) == 2)
            await client.close()
            with pytest.raises(ConnectionLostError, match="closed while it connected"):
                await asyncio.wait_for(connecting, 2)  # at once: it waited up to open_timeout for the hello
            await until(all_closed)
            release.set()
        finally:
            release.set()


async def test_a_redirect_to_an_unusable_address_is_a_connect_error() -> None:
    """websockets follows redirects; one to port 99999 raised a bare ValueError (a traceback in the
    command), and with reconnect the redialler spun hundreds of handshakes a second."""

    async def redirect(connection: ServerConnection, request: Any) -> Any:
        response = connection.respond(302, "")
        response.headers["Location"] = "ws://127.0.0.1:99999/"
        return response

    async with serve(lambda ws: ws.wait_closed(), "127.0.0.1", 0, process_request=redirect) as running:
        url = f"ws://127.0.0.1:{running.sockets[0].getsockname()[1]}/"
        with pytest.raises(ConnectError, match="redirected to an unusable address") as failed:
            await FillMaskClient(url).connect(wait=5)
        assert not failed.value.transient


def test_server_hints_are_capped_and_server_text_is_one_line() -> None:
    """A retry_after_ms of 1e300 put a retrying call to sleep for ages, a reconnect_within_ms of 1e300
    stopped the redials for good; a server's message with line breaks made a multi-line error."""
    cap = WAIT_HINT_CAP_MS / 1000
    assert RetryPolicy(jitter=0).delay(1, 1e300) == cap
    assert ReconnectBackoff().window(0, 1e297) == cap and ReconnectBackoff().window(0, math.nan) == 0
    error = outcome({"type": "error", "id": 1, "code": "bad\ncode", "message": "line one\r\nline two" + "x" * 5000})
    assert isinstance(error, RequestError) and "\n" not in str(error) and "\r" not in str(error)
    assert len(error.message) <= 1000 and error.message.startswith("line one  line two")
    assert one_line("a\u2028b") == "a b"
    late = outcome({"type": "overloaded", "id": 1, "status": 504, "reason": "deadline_exceeded", "queue_ms": "x"})
    assert isinstance(late, DeadlineExceededError) and late.queue_ms is None


def test_malformed_results_and_hellos_are_refused() -> None:
    for predictions in (None, [], "x", {"0": 1}, [["a"]], [{"score": None, "token_str": "a", "sequence": "b"}],
                        [[]]):
        refused = outcome({"type": "result", "id": 3, "predictions": predictions})
        assert type(refused) is FillMaskError and "malformed" in str(refused), predictions
    two = outcome({"type": "result", "id": 3, "predictions": [[CANDIDATE], [CANDIDATE]]})
    assert not isinstance(two, FillMaskError) and two.mask_count == 2
    for protocol in (True, 1.0, "1"):  # == 1, but not the integer 1
        assert check_hello({"type": "hello", "protocol": protocol}) is not None, protocol
    assert check_hello({"type": "hello", "protocol": 1}) is None


async def test_the_read_limit_follows_max_result_bytes_and_a_mask_token_must_be_a_string() -> None:
    """§14: a client reads frames of up to max_result_bytes + 1 KiB; the limit stayed at 64 MiB."""
    big = {**HELLO, "mask_token": None, "limits": {**HELLO["limits"], "max_result_bytes": 96 * 2**20}}
    async with fake(answers, hello=big) as server, FillMaskClient(server.url) as client:
        [conn] = client._pool.connections()
        assert conn.ws.protocol.max_message_size == 96 * 2**20 + 1024
        assert client.mask_token == "[MASK]"  # null read as the string 'None'


async def test_many_before_connect_says_not_connected() -> None:
    client = FillMaskClient("ws://127.0.0.1:9/?token=sesame")
    with pytest.raises(ConnectionLostError, match="not connected"):  # was RuntimeError, from .limits
        await client.fill_mask_many([TEXT])
    for name in ("hello", "limits", "model", "mask_token"):  # (a trial: RuntimeError, not a FillMaskError)
        with pytest.raises(ConnectionLostError, match=r"not connected to ws://127\.0\.0\.1:9/\?token=\*\*\*: await"):
            getattr(client, name)


async def answer_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bytes) -> None:
    """Answer a client's WebSocket handshake on a raw stream, then send ``first`` as one text frame."""
    head = await reader.readuntil(b"\r\n\r\n")
    key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
               if line.lower().startswith(b"sec-websocket-key:"))
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    writer.write(bytes([0x81, 126]) + len(first).to_bytes(2, "big") + first)
    await writer.drain()


async def handshake_then_deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A peer (``asyncio.start_server``'s handler) that answers the handshake and sends ``hello``, then
    reads nothing and answers nothing, not even a close."""
    await answer_handshake(reader, writer, orjson.dumps(HELLO))
    await asyncio.sleep(30)


async def test_close_does_not_wait_long_for_a_peer_that_stopped_reading() -> None:
    """close() waited websockets' 10 s for the closing handshake of a peer that reads nothing."""
    deaf = await asyncio.start_server(handshake_then_deaf, "127.0.0.1", 0)
    try:
        client = FillMaskClient(f"ws://127.0.0.1:{deaf.sockets[0].getsockname()[1]}/")
        await client.connect()
        started = time.monotonic()
        await client.close()
        assert time.monotonic() - started < 5
    finally:
        deaf.close()


async def test_a_connection_this_client_failed_is_redialled_and_the_text_says_why() -> None:
    """Naming the client's own close (1009 here; 1011 when pongs stop) in the code, not only in the
    text, took it out of the codes that are resent and redialled: a dead network left the pool's slot
    dead for good."""

    async def too_big_twice(ws: ServerConnection, request: dict[str, Any], number: int) -> None:
        if number < 2:
            await ws.send(b"x" * (MAX_INCOMING_BYTES + 1))  # over the client's read limit: it closes with 1009
        else:
            await ws.send(result(request))

    async with fake(too_big_twice) as server:
        async with FillMaskClient(server.url) as client:
            with pytest.raises(ConnectionLostError) as lost:
                await client.fill_mask(TEXT)
        assert lost.value.code == 1006 and "this client closed it: 1009" in str(lost.value), lost.value
        async with FillMaskClient(server.url, reconnect=True) as client:
            assert await client.fill_mask(TEXT) == [CANDIDATE]  # lost, redialled, resent, answered
        assert len(server.connections) == 3


@pytest.mark.parametrize("code", [1011, 1009])
async def test_a_reconnecting_pool_dials_again_after_1011_and_1009_without_resending(code: int) -> None:
    """§14: after 1011 (the server missed a pong, or failed) and 1009, reconnect with backoff. A
    reconnecting pool left the slot dead for good (found by a protocol review). The call that was in
    flight is not sent again: it fails, so whatever caused the close never reaches another connection."""

    async def close_on_first(ws: ServerConnection, request: dict[str, Any], number: int) -> None:
        if number == 0:
            await ws.close(code, "closed by the test")
        else:
            await ws.send(result(request))

    async with fake(close_on_first) as server:
        async with FillMaskClient(server.url, reconnect=True) as client:
            with pytest.raises(ConnectionLostError) as lost:
                await client.fill_mask(TEXT)
            assert lost.value.code == code
            assert await client.fill_mask(TEXT) == [CANDIDATE]  # on the slot dialled again
        assert len(server.connections) == 2 and server.requests == 2


async def test_a_server_that_closes_every_connection_at_once_is_redialled_with_a_growing_backoff(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each redial started from the first backoff step, so a server closing every connection with 1011
    right after its hello was dialled about 26 times a second, for good (found by a review). A slot's
    backoff now carries on across connections lost within ``LASTED_S``, and starts over after one
    that lasted."""
    import fillmask_client.pool as pool

    attempts: list[int] = []

    class Recording(ReconnectBackoff):
        def delay(self, attempt: int, first_window: float | None = None, rand: Any = None) -> float:
            attempts.append(attempt)
            return 0.0

    connections = 0
    keep = asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        nonlocal connections
        connections += 1
        await ws.send(orjson.dumps(HELLO).decode())
        if connections <= 6 or connections == 8:
            await asyncio.sleep(0.02)  # installed by the client (it had its hello), then lost
            await ws.close(1011, "closing at once")
        elif connections == 7:
            await keep.wait()  # this one lasts
            await ws.close(1011, "closing after it lasted")
        else:
            await ws.wait_closed()

    monkeypatch.setattr(pool, "LASTED_S", 0.3, raising=False)
    async with serve(handler, "127.0.0.1", 0) as running:
        url = f"ws://127.0.0.1:{running.sockets[0].getsockname()[1]}/"
        async with FillMaskClient(url, reconnect=True, backoff=Recording()):
            await until(lambda: connections == 7)
            await asyncio.sleep(0.4)
            keep.set()
            await until(lambda: connections == 9)
    # The redial after the connection that lasted is the last from step 0; those before it grew.
    lasted = len(attempts) - 1 - attempts[::-1].index(0)
    quick = attempts[:lasted]
    assert len(quick) >= 6 and quick == sorted(set(quick)) and quick[0] >= 1, attempts


#: The blocking client interrupted by Ctrl-C (a real SIGINT) while it waits: ``connect`` where nothing
#: listens yet, or ``close`` against a peer that greets and then answers nothing, not even the close
#: (both given by the test, in its own process: argv is the mode and the URL).
CTRL_C_SCRIPT = r"""
import gc, os, signal, sys, threading
from fillmask_client import SyncFillMaskClient

mode, url = sys.argv[1:]
# Ctrl-C as a terminal delivers it: a shell that runs the suite in the background (`cmd &`) starts its
# children with SIGINT ignored, and Python then leaves it so, with no KeyboardInterrupt to raise.
signal.signal(signal.SIGINT, signal.default_int_handler)
try:
    if mode == "connect":  # refused until connect_wait runs out
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        SyncFillMaskClient(url, connect_wait=30)
    else:
        client = SyncFillMaskClient(url)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        client.close()  # waits for the peer's close frame (at most 2 s)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
gc.collect()
print("threads:", sorted(thread.name for thread in threading.enumerate() if thread.name.startswith("fillmask")))
"""


@pytest.mark.parametrize("waiting_in", ["connect", "close"])
async def test_ctrl_c_in_the_blocking_client_leaves_no_task_socket_or_thread(waiting_in: str) -> None:
    """A user's pytest trial: Ctrl-C while the blocking client connected (to a server not up yet) printed
    "Task was destroyed but it is pending!" twice; while it closed (a server that stopped answering),
    three of those, "Event loop is closed" from its reader, and a ResourceWarning for the socket left
    open. The client's loop now ends as ``asyncio.run`` ends its own (its tasks cancelled and awaited),
    and a close cut short cuts its socket. Run under ``-X dev``, which shows every ResourceWarning."""
    with socket.socket() as unlistened:  # bound, never listening: connecting is refused
        unlistened.bind(("127.0.0.1", 0))
        deaf = await asyncio.start_server(handshake_then_deaf, "127.0.0.1", 0)
        try:
            port = (unlistened if waiting_in == "connect" else deaf.sockets[0]).getsockname()[1]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-X", "dev", "-c", CTRL_C_SCRIPT, waiting_in, f"ws://127.0.0.1:{port}/",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            deaf.close()
    assert out.decode().splitlines() == ["interrupted", "threads: []"], (out, err)
    assert err.decode() == "", err.decode()[-3000:]


async def test_closing_the_blocking_client_ends_another_threads_calls_with_connection_lost() -> None:
    """A review: ``close`` now cancels the tasks left on the blocking client's loop (so that none is
    destroyed pending), and another thread's ``fill_mask_many`` still running on a server that does not
    answer then raised ``concurrent.futures.CancelledError`` (no ``FillMaskError``) in most trials, and
    once that was mended (a second review), one ``ConnectionLostError`` where ``return_exceptions``
    promises a list. Its outcome is the list, a ``ConnectionLostError`` in each place, as the async
    client gives."""

    async def never(ws: ServerConnection, request: dict[str, Any], number: int) -> None:
        pass

    async with fake(never) as server:
        def trials() -> list[str]:
            outcomes = []
            for _ in range(5):
                client = SyncFillMaskClient(server.url)
                got: list[str] = []

                def caller(client: SyncFillMaskClient = client, got: list[str] = got) -> None:
                    try:
                        listed = client.fill_mask_many([TEXT] * 200, return_exceptions=True)
                        got.extend(f"list of {name}" for name in sorted({type(one).__name__ for one in listed}))
                    except BaseException as exc:  # (what a caller would see, whatever it is)
                        got.append(f"raised {type(exc).__name__}")

                thread = threading.Thread(target=caller, daemon=True)
                thread.start()
                time.sleep(0.3)  # its requests sent, none answered
                client.close()
                thread.join(10)
                outcomes.append("hung" if thread.is_alive() else ",".join(got))
            return outcomes

        assert set(await asyncio.to_thread(trials)) == {"list of ConnectionLostError"}


async def test_open_timeout_bounds_the_handshake_and_the_hello_together() -> None:
    """A review: ``open_timeout`` ("seconds to open a connection and receive hello") was given to the
    handshake and then again to the wait for ``hello``, so one try could take twice as long (and the
    README's "connect_wait plus one open_timeout" was false). A peer whose handshake takes 1.5 s and
    then says nothing now fails at 2 s with ``open_timeout=2``, not at 3.5."""

    async def slow_handshake(connection: ServerConnection, request: Any) -> None:
        await asyncio.sleep(1.5)

    async def silent(ws: ServerConnection) -> None:
        await ws.wait_closed()

    async with serve(silent, "127.0.0.1", 0, process_request=slow_handshake) as running:
        url = f"ws://127.0.0.1:{running.sockets[0].getsockname()[1]}/"
        started = time.monotonic()
        with pytest.raises(ConnectError) as failed:
            await FillMaskClient(url, open_timeout=2).connect()
        took = time.monotonic() - started
    assert failed.value.kind == "no_hello" and "within 2 s" in str(failed.value), failed.value
    assert 1.9 < took < 2.9, took  # (each with its own timeout: 3.5 s)


# --- what a hostile server sends that reaches the terminal, or that is not a hello (a newcomer's trial) --


#: A candidate whose strings would clear the screen, turn it red, ring the bell and add lines of their own.
EVIL = {"score": 0.5, "token": 7, "token_str": "\x1b[2J\x1b[31mEVIL\nline2\r\x07",
        "sequence": "paris is the \x1b[2J\x9b31m\u2028EVIL\r\n\x07 of france."}


async def evil_answers(ws: ServerConnection, request: dict[str, Any], number: int) -> None:
    frame = {"type": "result", "id": request["id"], "predictions": [EVIL],
             "targets": [{"given": "a\x1bb", "scored": "c\x9bd"}]}
    await ws.send(orjson.dumps(frame))


async def test_the_table_shows_no_control_character_a_server_sent_and_json_stays_exact() -> None:
    """``fillmask-client ... | cat -A`` showed a server's token_str raw: a screen clear, a colour, a carriage
    return, a bell and a line break of its own. The table now shows each as a space; --json is the frame."""
    from fillmask_client import cli

    async with fake(evil_answers) as server:
        for json_flag in ([], ["--json"]):
            args = cli.build_parser().parse_args(["--url", server.url, "-k", "1", "-t", "a\x1bb", *json_flag, TEXT])
            out, err = io.StringIO(), io.StringIO()
            assert await cli.run(args, [TEXT], out, err) == 0, err.getvalue()
            if json_flag:
                assert orjson.loads(out.getvalue())["predictions"] == [EVIL]  # exactly as sent
                continue
            table = out.getvalue()
            shown = [c for c in table if c != "\n" and (ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029")]
            assert not shown, table
            lines = table.splitlines()
            assert len(lines) == 4, table  # the text, the note on the target, the heading, one row
            assert lines[1] == 'note: target "a\\u001bb" was scored as "c d"', lines[1]
            assert " [2J [31mEVIL line2  " in lines[3] and "paris is the  [2J 31m EVIL    of france." in lines[3]


def handshake_then(first: bytes) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A peer (``asyncio.start_server``'s handler) that answers the handshake, sends ``first`` as its
    first text frame, then answers nothing, not even a close, until the client drops the connection."""

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_handshake(reader, writer, first)
        with contextlib.suppress(ConnectionError):
            await reader.read()  # (the client's close frame, unanswered, then its end of the connection)
        writer.close()

    return peer


async def test_a_first_frame_that_is_not_a_hello_says_so_in_words_and_fails_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial against fake servers: a hello without "protocol" read "server speaks protocol None", a
    first frame that is not JSON gave orjson's words ("invalid literal, expected 'null'..."), and each
    failed only after the closing handshake's wait (CLOSE_TIMEOUT_S), meanwhile "waiting for the server…:
    connected, no hello frame yet". A peer that is not usable is now left at once. (The close timeout is
    made far longer than the test's bound, so that a wait for the peer's close cannot pass unseen.)"""
    import fillmask_client.connection as connection

    monkeypatch.setattr(connection, "CLOSE_TIMEOUT_S", 120.0)
    for first, words in ((b'{"type": "hello", "model": "x"}',
                          "the server's hello has no protocol field: is it a fill-mask server?"),
                         (b"nope, not JSON", "the server's first frame is not JSON: 'nope, not JSON'; is it a "
                                             "fill-mask server?")):
        peer = await asyncio.start_server(handshake_then(first), "127.0.0.1", 0)
        try:
            url = f"ws://127.0.0.1:{peer.sockets[0].getsockname()[1]}/"
            with pytest.raises(ConnectError) as failed:
                await asyncio.wait_for(FillMaskClient(url).connect(wait=10), 60)
        finally:
            peer.close()
        assert str(failed.value) == f"cannot use {url}: {words}", failed.value
        assert failed.value.kind == "bad_hello" and not failed.value.transient


async def test_a_server_that_never_answers_a_handshake_costs_one_open_timeout_however_many_connections() -> None:
    """A review's find: with at most ``MAX_OPENING`` handshakes at once, a pool of 200 against a server
    that accepts and never answers waited out ``open_timeout`` once for each group of them (four times
    here), and said "timed out after 0.5 s". Once one of ``connect``'s handshakes timed out before any
    opened, those still waiting for their turn fail with it: one group is ever dialled."""
    from fillmask_client.pool import MAX_OPENING

    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        with contextlib.suppress(ConnectionError):
            await reader.read()  # (until the client gives up and closes)
        writer.close()

    black_hole = await asyncio.start_server(silent, "127.0.0.1", 0, backlog=512)
    try:
        client = FillMaskClient(f"ws://127.0.0.1:{black_hole.sockets[0].getsockname()[1]}/", connections=200,
                                open_timeout=0.5)
        with pytest.raises(ConnectError, match=r"timed out after 0\.5 s"):
            await client.connect()
        await client.close()
        assert 0 < len(accepted) <= MAX_OPENING
    finally:
        black_hole.close()
        await black_hole.wait_closed()
