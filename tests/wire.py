"""Small helpers for talking raw protocol frames to a server in tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect


def free_port() -> int:
    """A loopback port where nothing listens (bound and released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def session(url: str) -> AsyncIterator[tuple[ClientConnection, dict[str, Any]]]:
    """Connect, read the hello frame, and yield (socket, hello)."""
    async with connect(url, max_size=None) as ws:
        hello = orjson.loads(await asyncio.wait_for(ws.recv(), 30))
        yield ws, hello


#: A slow reader's receive buffer, set before it connects (so that the window stays small).
SLOW_RCVBUF = 2048


async def open_reader(url: str, port: int, slow: bool, timeout: float = 30.0) -> tuple[ClientConnection,
                                                                                      dict[str, Any]]:
    """A connection to the server at ``url`` (on loopback ``port``) and its hello: a slow one with a
    receive buffer of ``SLOW_RCVBUF`` and websockets' queue of one message, so that an answer it does
    not read soon fills the server's send buffer; the caller closes it."""
    if slow:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        ws = await connect(url, sock=sock, max_queue=1, max_size=None, close_timeout=1)
    else:
        ws = await connect(url, max_size=None, close_timeout=1)
    hello = orjson.loads(await asyncio.wait_for(ws.recv(), timeout))
    assert hello["type"] == "hello", hello
    return ws, hello


async def send(ws: ClientConnection, frame: dict[str, Any]) -> None:
    await ws.send(orjson.dumps(frame).decode())


async def recv(ws: ClientConnection, timeout: float = 30.0) -> dict[str, Any]:
    return orjson.loads(await asyncio.wait_for(ws.recv(), timeout))


async def recv_n(ws: ClientConnection, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Read exactly ``n`` frames (within ``timeout`` seconds in all)."""
    async with asyncio.timeout(timeout):
        return [orjson.loads(await ws.recv()) for _ in range(n)]


async def request(ws: ClientConnection, frame_id: Any, text: str, **fields: Any) -> dict[str, Any]:
    """Send one fill_mask and return the next frame (use only with nothing else in flight)."""
    await send(ws, {"type": "fill_mask", "id": frame_id, "text": text, **fields})
    return await recv(ws)


async def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``condition`` (cheaply) until it holds; fail the test after ``timeout`` seconds.

    The timeout is a safety net for a condition that must come, not a measure of speed: it is long
    enough for a slow or busy machine, and a passing test never waits for it."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def assert_silent(ws: ClientConnection, seconds: float = 0.2) -> None:
    """Fail if the server sends anything within ``seconds``."""
    with contextlib.suppress(TimeoutError):
        frame = await asyncio.wait_for(ws.recv(), seconds)
        raise AssertionError(f"unexpected frame: {frame!r}")


def answers_counted(srv: Any) -> float:
    """Every answer the server has counted in ``fillmask_requests_total`` (§11), whatever its outcome."""
    return sum(sample.value for metric in srv.metrics.requests.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


async def assert_answered(srv: Any, before: float, expected: int, *sockets: ClientConnection) -> None:
    """§8 by counting, not by waiting: once the server has settled (nothing left in it that could still
    produce an answer), exactly ``expected`` answers were counted at the socket since ``before``, no
    request ever got a second answer, and ``sockets`` have nothing left unread."""
    await wait_until(srv.settled)
    assert srv.double_answers == 0
    assert answers_counted(srv) - before == expected
    for ws in sockets:
        await assert_silent(ws, 0.05)  # settled: nothing more can come, so only unread frames would show


def assert_same_predictions(got: Any, expected: Any, tolerance: float = 1e-4) -> None:
    """Same structure, tokens, token_str and sequences as the pipeline; scores within ``tolerance``."""
    assert isinstance(got, list) and isinstance(expected, list)
    assert len(got) == len(expected), (got, expected)
    for g, e in zip(got, expected, strict=True):
        if isinstance(e, list):
            assert_same_predictions(g, e, tolerance)
            continue
        assert set(g) == {"score", "token", "token_str", "sequence"}, g
        assert (g["token"], g["token_str"], g["sequence"]) == (e["token"], e["token_str"], e["sequence"])
        assert abs(g["score"] - e["score"]) <= tolerance, (g, e)
