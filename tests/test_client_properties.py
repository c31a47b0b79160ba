"""Property-based tests of the client package (``clients/python/fillmask_client``) against scripted fake
servers: hypothesis draws, for every text, what the server does with each of its sends (answer, refuse,
stay silent, go away, close, abort, send junk first), and a client configuration (pool size, reconnect,
retry policy, deadline, in-flight limit, concurrency, how it is called); the fake server
(``tests/test_client_hostile.py``'s ``Fake``) plays the script and keeps a log of what it received and
what it answered. The invariants, from protocol.md (§3 to §8, §10, §14) and the client's docstrings:

- every call ends (a hang is a failure: each run is bounded by ``HANG_S``) with exactly one outcome:
  predictions, or a ``FillMaskError`` of the documented kind;
- ``fill_mask_many`` and ``fill_mask_iter`` give one outcome per text, in input order;
- an answer is never given to another request: each result's predictions carry a marker of its text;
- sends match the retry policy: a busy refusal (503 ``queue_full``, 429 ``queue_share``, an unknown
  reason) is resent only within ``RetryPolicy.attempts``; a lost send only after a close code the client
  documents as worth a resend, at most ``MAX_RESENDS`` times; a request answered for good is not sent again;
- a resend after a busy refusal comes no sooner than its ``retry_after_ms``; a resend carries what is left
  of ``deadline_ms``; no more than ``max_inflight_per_connection`` requests are in flight on a connection,
  nor more than ``concurrency`` for ``fill_mask_many``/``fill_mask_iter``, and a generator is read at most
  ``AHEAD * concurrency`` texts ahead; ids are never reused while in flight; ``cancel`` names only ids sent;
- a call cancelled by its caller sends ``cancel`` for a request still unanswered (§5), nothing stays in
  flight afterwards, and the next call works (no place lost); ``close()`` ends every running call;
- after ``async with`` no task of the client is left (``SyncFillMaskClient``: no thread), and the fake
  server has no connection left open.

The client is called four ways: ``fill_mask`` calls at once (some cancelled, or the client closed under
them), ``fill_mask_many`` (``return_exceptions`` or not), ``fill_mask_iter`` (over a list or a generator,
left early or not), and ``SyncFillMaskClient.fill_mask_many`` from a thread.

``test_request_scripts`` uses scripts where each send's fate is its own (its answer), so every outcome is
predicted exactly; ``test_connection_scripts`` adds what ends or drains a connection for every request on
it, where what happens to the others depends on timing, so each outcome is checked against the server's
log instead. The tests at the end are minimal repros of the three bugs the properties found (a call that
waited in the client for a place under ``max_inflight_per_connection`` or for a redial sent its whole
``deadline_ms``, was sent after its deadline, and stayed parked on a connection that went away), each
failing before its fix in ``fillmask_client``.

Each hypothesis example runs on its own event loop (``asyncio.run``), so that the tasks left after the
client closed can be counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, cast

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from fillmask_client import (
    ConnectError,
    ConnectionLostError,
    DeadlineExceededError,
    FillMaskClient,
    FillMaskError,
    OverloadedError,
    ReconnectBackoff,
    RequestError,
    RetryPolicy,
    SyncFillMaskClient,
    UsageError,
)
from fillmask_client.async_client import AHEAD, MAX_RESENDS, default_concurrency
from fillmask_client.connection import RECONNECT_CODES
from fillmask_client.wire import SERVER_GONE_REASONS
from tests.test_client_hostile import HELLO, Fake, until

#: The fake server's ``hello.limits`` (tests/test_client_hostile.py's ``HELLO``).
LIMITS = cast(dict[str, Any], HELLO["limits"])
#: The most one example may take, client closing included: generous, only a hang should reach it.
HANG_S = 15.0
#: A deadline_ms the calls may carry: long enough never to run out on a busy machine (the fake server
#: answers 504 itself where a script says so), so that outcomes never depend on timing.
DEADLINE_MS = 30_000
#: §7's codes that end the request they name (``duplicate_id`` does not: it is tried as noise below),
#: and one this client does not know (§14: that request's failure all the same).
ERROR_CODES = ["invalid_json", "not_an_object", "binary_frame", "missing_field", "unknown_type", "invalid_id",
               "invalid_field", "text_too_long", "no_mask", "too_many_masks", "invalid_top_k", "invalid_targets",
               "invalid_deadline", "too_many_inflight", "result_too_large", "internal_error", "a_future_code"]
#: Busy refusals, which ``RetryPolicy`` resends (§6; §14: an unknown reason reads as ``queue_full``).
BUSY = [(503, "queue_full"), (429, "queue_share"), (503, "queue_busy_v2")]
#: Frames the client must ignore (§1, §7, §14), sent before the request's own answer.
NOISE = ["text", "list", "type_not_string", "unknown_type", "string_id", "bool_id", "other_id", "null_id_error",
         "duplicate_id", "second_hello", "stats"]
#: Close codes a server (or a proxy in front of it) may close with (§14's table; 1006 is ``abort``).
CLOSE_CODES = [1000, 1001, 1008, 1009, 1011, 1012, 1013]


def text_of(index: int) -> str:
    return f"t{index} [MASK]"


def index_of(text: str) -> int:
    return int(text.split()[0][1:])


def marked(index: int) -> list[dict[str, Any]]:
    """Predictions that say which text they answer."""
    return [{"score": 0.5, "token": index, "token_str": f"w{index}", "sequence": f"t{index} w{index}"}]


@dataclasses.dataclass(frozen=True)
class Act:
    """What the fake server does with one send of a text.

    ``kind``: ``result`` (after ``delay_ms``), ``error`` (``code``), ``busy`` (``status``, ``reason``,
    ``retry_ms``), ``late`` (504), ``cancelled``, ``noise`` (the frame ``noise`` first, then the result),
    ``bad_result`` (predictions ``[]``), ``silent`` (504 after 30 ms if the frame has ``deadline_ms``,
    else nothing; ``cancelled`` if a ``cancel`` comes first), and what ends or drains the connection:
    ``gone`` (503 ``reason``), ``going_away`` (the notice, then the result if ``answer``, else a close
    with 1001), ``close`` (``code``, no answer), ``abort`` (no close frame: 1006).
    """

    kind: str
    delay_ms: int = 0
    code: str = ""
    status: int = 0
    reason: str = ""
    retry_ms: int = 0
    noise: str = ""
    answer: bool = False
    close: int = 0


#: ``Act`` kinds whose answer ends the call for good (``busy`` and ``gone`` may be resent).
FINAL_ANSWERS = {"result", "error", "late", "cancelled", "noise", "bad_result", "silent"}


@dataclasses.dataclass(eq=False)
class Send:
    """One ``fill_mask`` frame the fake server read, and the terminal frame it handed to the socket."""

    text: int
    conn: int
    frame: dict[str, Any]
    act: Act
    answer: dict[str, Any] | None = None
    received_at: float = 0.0  # loop time the server read it
    answered_at: float = 0.0  # loop time the server began to send its terminal frame
    cancel: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set by a cancel (silent only)


class Scripted(Fake):
    """``Fake`` whose script is a plan per text (the n-th send of text i gets ``plans[i][n]``, a result
    past the plan), and which logs every send, answer, ``cancel`` and close."""

    def __init__(self, plans: list[list[Act]], hello: dict[str, Any]) -> None:
        super().__init__(self.play, hello)
        self.plans = plans
        self.sends: dict[int, list[Send]] = defaultdict(list)
        self.closed_with: dict[int, int] = {}  # connection -> the close code its client sees (1006: cut)
        self.aborted: set[int] = set()
        self.aborted_at: dict[int, float] = {}  # connection -> loop time the script cut it
        self.cut: set[int] = set()  # connections the script closed or cut
        self.notices: list[dict[str, Any]] = []  # going_away frames and 503 shutting_down/engine_stopped
        self.in_flight: dict[int, dict[int, Send]] = defaultdict(dict)  # connection -> id -> unanswered send
        self.held: dict[tuple[int, int], asyncio.Event] = {}  # silent requests: set by their cancel
        self.cancels: list[tuple[int, Any]] = []
        self.violations: list[str] = []  # what the server saw that the client must never send
        self.width: int | None = None  # at most this many requests in flight at once (fill_mask_many/iter)
        self.opened_at: list[float] = []  # loop time each connection's handler started
        limits = hello.get("limits")
        self.max_inflight = limits.get("max_inflight_per_connection") if isinstance(limits, dict) else None

    async def handler(self, ws: ServerConnection) -> None:
        self.open += 1
        conn = len(self.connections)
        self.connections.append(ws)
        self.opened_at.append(asyncio.get_running_loop().time())
        try:
            await ws.send(orjson.dumps(self.hello).decode())
            async for message in ws:
                frame = orjson.loads(message)
                kind = frame.get("type")
                if kind == "fill_mask":
                    self.requests += 1
                    send = self.receive(conn, frame)
                    self.tasks.add(asyncio.ensure_future(self.play_one(ws, conn, send)))
                elif kind == "cancel":
                    self.cancels.append((conn, frame.get("id")))
                    if frame.get("id") not in self.in_flight[conn] and frame.get("id") not in self.seen_ids(conn):
                        self.violations.append(f"cancel for id {frame.get('id')} never sent on connection {conn}")
                    held = self.held.pop((conn, frame.get("id")), None)
                    if held is not None:
                        held.set()
                else:
                    self.violations.append(f"unexpected frame {frame}")
        except ConnectionClosed:
            pass
        finally:
            self.open -= 1
            self.closed_with.setdefault(conn, ws.close_code if ws.close_code is not None else 1006)

    def seen_ids(self, conn: int) -> set[Any]:
        return {send.frame.get("id") for sends in self.sends.values() for send in sends if send.conn == conn}

    async def play(self, ws: ServerConnection, request: dict[str, Any], number: int) -> None:
        raise AssertionError("Scripted reads its frames itself")  # (Fake's script: unused)

    def receive(self, conn: int, frame: dict[str, Any]) -> Send:
        """Log a ``fill_mask`` as it is read (before any other frame is: a ``cancel`` may follow at once)."""
        index = index_of(frame["text"])
        plan = self.plans[index]
        nth = len(self.sends[index])
        send = Send(index, conn, frame, plan[nth] if nth < len(plan) else Act("result"),
                    received_at=asyncio.get_running_loop().time())
        self.sends[index].append(send)
        request_id: Any = frame.get("id")
        if send.act.kind == "silent":  # held from now: its cancel may be read before its act starts
            self.held[(conn, request_id)] = send.cancel
        if type(request_id) is not int or request_id < 1 or request_id in self.in_flight[conn]:
            self.violations.append(f"id {request_id!r} sent while in flight (or not a positive integer)")
        if conn in self.cut:
            # Read after the script closed its connection (sent before the client saw the close): the
            # client counts it lost and may resend it at once, so it is in flight nowhere.
            return send
        limit = self.max_inflight
        if limit is not None and len(self.in_flight[conn]) >= limit:  # §12: answered too_many_inflight
            self.violations.append(f"request {request_id} sent with {limit} in flight on connection {conn}")
        self.in_flight[conn][request_id] = send
        total = sum(len(requests) for requests in self.in_flight.values())
        if self.width is not None and total > self.width:  # fill_mask_iter: at most `concurrency` at a time
            self.violations.append(f"{total} requests in flight, concurrency {self.width}")
        return send

    async def play_one(self, ws: ServerConnection, conn: int, send: Send) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self.perform(ws, conn, send)

    async def answer(self, ws: ServerConnection, send: Send, frame: dict[str, Any]) -> None:
        """Hand a terminal frame to the socket, logged before the send (the client may act on it at once)."""
        send.answer, send.answered_at = frame, asyncio.get_running_loop().time()
        self.in_flight[send.conn].pop(send.frame["id"], None)
        try:
            await ws.send(orjson.dumps(frame).decode())
        except ConnectionClosed:
            send.answer = None
            raise

    async def close(self, ws: ServerConnection, conn: int, code: int) -> None:
        if conn in self.closed_with or ws.state is not State.OPEN:
            return
        self.closed_with[conn] = code
        self.cut.add(conn)
        self.in_flight[conn].clear()  # (the server forgets them now: its client may resend them at once)
        if code == 1006:
            self.aborted.add(conn)
            self.aborted_at[conn] = asyncio.get_running_loop().time()
            ws.transport.abort()
        else:
            await ws.close(code, "scripted close")

    async def perform(self, ws: ServerConnection, conn: int, send: Send) -> None:
        act, request_id, index = send.act, send.frame["id"], send.text
        result = {"type": "result", "id": request_id, "predictions": marked(index), "queue_ms": 0.1,
                  "inference_ms": 1.0, "batch_size": 1, "batch_tokens": 4, "batch_id": 1}
        match act.kind:
            case "result":
                if act.delay_ms:
                    await asyncio.sleep(act.delay_ms / 1000)
                await self.answer(ws, send, result)
            case "error":
                await self.answer(ws, send, {"type": "error", "id": request_id, "code": act.code,
                                             "message": f"scripted {act.code}"})
            case "busy":
                await self.answer(ws, send, {"type": "overloaded", "id": request_id, "status": act.status,
                                             "reason": act.reason, "retry_after_ms": act.retry_ms})
            case "late":
                await self.answer(ws, send, {"type": "overloaded", "id": request_id, "status": 504,
                                             "reason": "deadline_exceeded", "queue_ms": 12.5, "retry_after_ms": 5})
            case "cancelled":
                await self.answer(ws, send, {"type": "cancelled", "id": request_id})
            case "noise":
                await ws.send(noise_frame(act.noise, request_id))
                await self.answer(ws, send, result)
            case "bad_result":
                await self.answer(ws, send, {**result, "predictions": []})
            case "silent":
                cancelled = send.cancel
                timeout = 0.03 if send.frame.get("deadline_ms") is not None else None
                try:
                    # (asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the wait as a task of
                    # its own, which the leak check would take for the client's.)
                    async with asyncio.timeout(timeout):
                        await cancelled.wait()
                except TimeoutError:
                    self.held.pop((conn, request_id), None)
                    await self.answer(ws, send, {"type": "overloaded", "id": request_id, "status": 504,
                                                 "reason": "deadline_exceeded", "queue_ms": 30.0,
                                                 "retry_after_ms": 5})
                else:
                    await self.answer(ws, send, {"type": "cancelled", "id": request_id})
            case "gone":
                frame = {"type": "overloaded", "id": request_id, "status": 503, "reason": act.reason,
                         "retry_after_ms": 10}
                self.notices.append(frame)
                await self.answer(ws, send, frame)
            case "going_away":
                notice = {"type": "going_away", "reason": "shutting_down", "reconnect_within_ms": 10}
                self.notices.append(notice)
                await ws.send(orjson.dumps(notice).decode())
                if act.answer:
                    await self.answer(ws, send, result)
                else:
                    await self.close(ws, conn, 1001)
            case "close":
                await self.close(ws, conn, act.close)
            case "abort":
                await self.close(ws, conn, 1006)
            case _:
                raise AssertionError(act)


def noise_frame(kind: str, request_id: int) -> str:
    """A frame the client must not take as any request's answer (§1, §7, §14)."""
    other = marked(999)  # a result taken as this request's would show the wrong marker
    frames: dict[str, Any] = {
        "text": "this is not json {",
        "list": [1, 2, 3],
        "type_not_string": {"type": 5, "id": request_id},
        "unknown_type": {"type": "mystery", "id": request_id, "predictions": other},
        "string_id": {"type": "result", "id": str(request_id), "predictions": other},
        "bool_id": {"type": "result", "id": True, "predictions": other},
        "other_id": {"type": "result", "id": request_id + 10**6, "predictions": other},
        "null_id_error": {"type": "error", "id": None, "code": "invalid_json", "message": "scripted"},
        "duplicate_id": {"type": "error", "id": request_id, "code": "duplicate_id", "message": "scripted"},
        "second_hello": HELLO,
        "stats": {"type": "stats", "window_s": 1.0, "queue_depth": 0, "in_flight": 1, "connections": 1},
    }
    value = frames[kind]
    return value if isinstance(value, str) else orjson.dumps(value).decode()


@contextlib.asynccontextmanager
async def scripted(plans: list[list[Act]], hello: dict[str, Any]) -> AsyncIterator[Scripted]:
    """``tests.test_client_hostile.fake`` for ``Scripted``; its scripts' tasks are ended on the way out."""
    server = Scripted(plans, hello)
    try:
        async with serve(server.handler, "127.0.0.1", 0) as running:
            server.url = f"ws://127.0.0.1:{running.sockets[0].getsockname()[1]}/"
            yield server
    finally:
        for task in server.tasks:
            task.cancel()
        await asyncio.gather(*server.tasks, return_exceptions=True)


# --- strategies --------------------------------------------------------------------------------------

results = st.builds(Act, kind=st.just("result"), delay_ms=st.sampled_from([0, 0, 5, 20, 40]))
errors = st.builds(Act, kind=st.just("error"), code=st.sampled_from(ERROR_CODES))
busies = st.sampled_from(BUSY).flatmap(lambda busy: st.builds(
    Act, kind=st.just("busy"), status=st.just(busy[0]), reason=st.just(busy[1]),
    retry_ms=st.sampled_from([0, 1, 5, 30])))
noises = st.builds(Act, kind=st.just("noise"), noise=st.sampled_from(NOISE))
simple = st.sampled_from([Act("late"), Act("cancelled"), Act("bad_result"), Act("silent")])
#: What ends one call (its own answer), and may come after busy refusals.
finals = st.one_of(results, errors, noises, simple, simple)
#: Busy refusals before a text's final act: none, mostly.
prefixes = st.sampled_from([0, 0, 0, 1, 1, 2, 3]).flatmap(lambda count: st.lists(busies, min_size=count,
                                                                                  max_size=count))
#: What drains or ends the connection a request came on.
disruptions = st.one_of(
    st.builds(Act, kind=st.just("gone"), reason=st.sampled_from(sorted(SERVER_GONE_REASONS))),
    st.builds(Act, kind=st.just("going_away"), answer=st.booleans()),
    st.builds(Act, kind=st.just("close"), close=st.sampled_from(CLOSE_CODES)),
    st.just(Act("abort")),
)


@dataclasses.dataclass(frozen=True)
class Setup:
    """How the client is made and called."""

    connections: int
    reconnect: bool
    attempts: int  # RetryPolicy.attempts, 0: retry=False
    deadline: bool
    max_inflight: int | None
    mode: str  # "calls" (one fill_mask each, at once), "many", "iter"
    return_exceptions: bool
    concurrency: int | None
    stop: int | None  # iter: leave the loop after this many outcomes
    generator: bool  # iter: texts from a generator, not a list
    cancel_ms: tuple[int | None, ...] = ()  # calls: cancel text i's call after this many ms (None: never)
    close_ms: int | None = None  # calls: close the client after this many ms, calls still running

    def options(self) -> dict[str, Any]:
        retry: RetryPolicy | bool = False
        if self.attempts:
            retry = RetryPolicy(attempts=self.attempts, base_delay=0.001, max_delay=0.004, jitter=0.0)
        return {"connections": self.connections, "reconnect": self.reconnect, "retry": retry,
                "reconnect_timeout": HANG_S / 2, "open_timeout": 5,
                "backoff": ReconnectBackoff(base=0.001, cap=0.01)}

    def client(self, url: str) -> FillMaskClient:
        return FillMaskClient(url, **self.options())

    def may_hang(self, index: int) -> bool:
        """Whether text ``index``'s call is ended by the test (cancelled, the client closed, or left
        unread by an early exit), so that a server that never answers it is allowed."""
        if self.mode == "calls":
            return self.close_ms is not None or (index < len(self.cancel_ms) and self.cancel_ms[index] is not None)
        return self.mode == "iter" and self.stop is not None and index >= self.stop

    def hello(self) -> dict[str, Any]:
        limits = dict(LIMITS)
        if self.max_inflight is not None:
            limits["max_inflight_per_connection"] = self.max_inflight
        return {**HELLO, "limits": limits}

    @property
    def tries(self) -> int:
        """Sends one call makes at most for busy refusals alone."""
        return max(1, self.attempts)


@st.composite
def setups(draw: st.DrawFn, texts: int, modes: tuple[str, ...] = ("calls", "many", "iter")) -> Setup:
    mode = draw(st.sampled_from(modes))
    calls = mode == "calls"
    return Setup(
        connections=draw(st.integers(1, 3)),
        reconnect=draw(st.booleans()),
        attempts=draw(st.sampled_from([0, 1, 2, 3])),
        deadline=draw(st.booleans()),
        max_inflight=draw(st.sampled_from([None, None, 1, 2])),
        mode=mode,
        return_exceptions=draw(st.booleans()),
        concurrency=draw(st.sampled_from([None, 1, 2, 4])),
        stop=draw(st.integers(1, texts)) if mode == "iter" else None,  # (0 would never start the generator)
        generator=mode == "iter" and draw(st.booleans()),
        cancel_ms=tuple(draw(st.lists(st.sampled_from([None, None, None, 0, 2, 10]), min_size=texts,
                                      max_size=texts))) if calls else (),
        close_ms=draw(st.sampled_from([None, None, None, 5, 25])) if calls else None,
    )


# --- running one example ---------------------------------------------------------------------------

#: One text's outcome: its predictions, or the exception its call ended with.
Outcome = Any


@dataclasses.dataclass
class Run:
    """What the client gave: outcomes by text (those it reached), and what ``fill_mask_many`` or
    ``fill_mask_iter`` raised."""

    outcomes: dict[int, Outcome] = dataclasses.field(default_factory=dict)
    raised: BaseException | None = None
    leaked: list[str] = dataclasses.field(default_factory=list)


def client_task(task: asyncio.Task[Any], server: Scripted) -> bool:
    """Whether a task left after the client closed is the client's (not the fake server's)."""
    if task in server.tasks:
        return False
    coro = task.get_coro()
    frame = getattr(coro, "cr_frame", None)
    owner = frame.f_locals.get("self") if frame is not None else None
    name = getattr(coro, "__qualname__", "")
    return not (isinstance(owner, (ServerConnection, Scripted)) or name.startswith("serve."))


async def run(plans: list[list[Act]], setup: Setup, check: Callable[[Scripted, Run], None], *,
              probe: bool = False) -> None:
    """Play ``plans`` to a client made and called as ``setup`` says, then ``check`` the log and the
    outcomes. With ``probe``, once the calls ended, every request the client abandoned must have been
    cancelled on the server (§5) and answered (``in_flight`` back to 0), and one more call must work:
    no permit (``max_inflight_per_connection``) or connection is lost to a cancelled call."""
    before = asyncio.all_tasks()
    texts = [text_of(index) for index in range(len(plans))]
    deadline = DEADLINE_MS if setup.deadline else None
    async with scripted([*plans, [Act("result")]], setup.hello()) as server:
        got = Run()
        if setup.mode != "calls":
            server.width = setup.concurrency or default_concurrency(LIMITS, setup.connections)
        if setup.mode == "sync":
            await asyncio.wait_for(asyncio.to_thread(call_sync, server.url, texts, setup, deadline, got), HANG_S)
            await until(lambda: server.open == 0, within=HANG_S / 3)
            assert not server.violations, server.violations
            check(server, got)
            return
        client = setup.client(server.url)
        async with asyncio.timeout(HANG_S):
            async with client:
                await call(client, texts, setup, deadline, got)
                server.width = None  # (the probe comes on top of abandoned requests)

                def unanswered() -> list[tuple[int, int]]:
                    return [key for key in server.held if server.connections[key[0]].state is State.OPEN]

                if probe and setup.close_ms is None:
                    # The calls left were cancelled, and each request still unanswered on the server
                    # got a cancel frame (§5; the class docstring), so nothing stays in flight.
                    await until(lambda: not unanswered() and client.in_flight == 0, within=HANG_S / 3)
                    assert await client.fill_mask(text_of(len(plans))) == marked(len(plans))
        for _ in range(3):
            await asyncio.sleep(0)
        got.leaked = [repr(task) for task in asyncio.all_tasks() - before
                      if task is not asyncio.current_task() and client_task(task, server)]
        await until(lambda: server.open == 0, within=HANG_S / 3)  # the fake saw every connection end
        assert not server.violations, server.violations
        check(server, got)


def call_sync(url: str, texts: list[str], setup: Setup, deadline: int | None, got: Run) -> None:
    """``SyncFillMaskClient.fill_mask_many`` (its own loop, in its own thread), from a worker thread."""
    before = {thread.ident for thread in threading.enumerate()}
    with SyncFillMaskClient(url, **setup.options()) as client:
        try:
            listed = client.fill_mask_many(texts, concurrency=setup.concurrency, deadline_ms=deadline,
                                           return_exceptions=setup.return_exceptions, timeout=HANG_S)
        except FillMaskError as exc:
            assert not setup.return_exceptions, exc
            got.raised = exc
        else:
            assert len(listed) == len(texts), listed
            got.outcomes = dict(enumerate(listed))
    got.leaked = [repr(thread) for thread in threading.enumerate() if thread.ident not in before]


async def cancel_after(task: asyncio.Task[Any], ms: int) -> None:
    await asyncio.sleep(ms / 1000)
    task.cancel()


async def call(client: FillMaskClient, texts: list[str], setup: Setup, deadline: int | None, got: Run) -> None:
    if setup.mode == "calls":
        tasks = [asyncio.ensure_future(client.fill_mask(text, deadline_ms=deadline)) for text in texts]
        helpers = [asyncio.ensure_future(cancel_after(task, ms))
                   for task, ms in zip(tasks, setup.cancel_ms, strict=True) if ms is not None]
        if setup.close_ms is not None:
            await asyncio.wait(tasks, timeout=setup.close_ms / 1000)
            await client.close()  # the calls still running end at once (close's docstring)
        await asyncio.wait(tasks)
        await asyncio.gather(*helpers)
        for index, task in enumerate(tasks):
            got.outcomes[index] = task if task.cancelled() else task.exception() or task.result()
    elif setup.mode == "many":
        try:
            listed = await client.fill_mask_many(texts, concurrency=setup.concurrency, deadline_ms=deadline,
                                                  return_exceptions=setup.return_exceptions)
        except FillMaskError as exc:
            assert not setup.return_exceptions, exc
            got.raised = exc
            return
        assert len(listed) == len(texts), listed  # one outcome per text, in input order
        got.outcomes = dict(enumerate(listed))
    else:
        pulled = 0

        def generate() -> Iterator[str]:
            nonlocal pulled
            for text in texts:
                pulled += 1
                yield text

        source: list[str] | Iterator[str] = generate() if setup.generator else texts
        width = setup.concurrency or default_concurrency(LIMITS, setup.connections)
        outcomes = client.fill_mask_iter(source, concurrency=setup.concurrency, deadline_ms=deadline)
        try:
            async with contextlib.aclosing(outcomes):
                # Leave after ``stop`` outcomes without waiting for the next: that text's answer may never
                # come (``Setup.may_hang``).
                while setup.stop is None or len(got.outcomes) < setup.stop:
                    try:
                        item = await anext(outcomes)
                    except StopAsyncIteration:
                        break
                    # A generator is read at most AHEAD * concurrency texts ahead of the outcome waited for.
                    assert pulled <= len(got.outcomes) + AHEAD * width, (pulled, len(got.outcomes), width)
                    got.outcomes[len(got.outcomes)] = item if isinstance(item, FillMaskError) else item.predictions
        except FillMaskError as exc:  # a generator's texts, every connection lost for good (documented)
            got.raised = exc
            return
        if setup.stop is None or setup.stop >= len(texts):
            assert len(got.outcomes) == len(texts), got.outcomes


def noted_index(error: BaseException) -> int:
    """The text ``fill_mask_many`` names in the note it adds to the error it raises."""
    notes = [note for note in getattr(error, "__notes__", []) if note.startswith("fill_mask_many: text ")]
    assert len(notes) == 1, (error, getattr(error, "__notes__", None))
    return int(notes[0].split()[2])


def check_documented(outcome: Outcome) -> None:
    """An outcome is predictions or a documented ``FillMaskError``, never another exception."""
    if isinstance(outcome, asyncio.Task):  # (the test cancelled that call)
        return
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, FillMaskError), f"undocumented exception {type(outcome).__name__}: {outcome!r}"
        assert not isinstance(outcome, UsageError), outcome
    else:
        assert isinstance(outcome, list) and outcome, outcome


def run_example(plans: list[list[Act]], setup: Setup, check: Callable[[Scripted, Run], None], *,
                probe: bool = False) -> None:
    asyncio.run(run(plans, setup, check, probe=probe))


def check_sends(server: Scripted, setup: Setup) -> None:
    """What every frame the server read says: deadline_ms within the caller's, and a resend carries only
    what is left of it (``fill_mask_result``: the budget counts from the call, not from each send); and a
    resend after a busy refusal waited at least its ``retry_after_ms`` (``RetryPolicy``: the server's
    estimate is a floor; a lower bound only, which a slow machine cannot break)."""
    for index, sends in server.sends.items():
        if index >= len(server.plans) - 1:
            continue  # the probe (``run``), sent without deadline_ms
        for earlier, later in itertools.pairwise(sends):
            if earlier.act.kind == "busy" and earlier.answer is not None and earlier.conn not in server.aborted:
                # (On a connection cut, the refusal may never have come: a loss is resent at once.)
                waited = later.received_at - earlier.answered_at
                assert waited >= earlier.act.retry_ms / 1000 - 0.002, (index, earlier.act, waited)
        left: float = DEADLINE_MS
        for send in sends:
            deadline = send.frame.get("deadline_ms")
            if setup.deadline:
                assert isinstance(deadline, (int, float)) and 0 < deadline <= left, (send.frame, left)
                left = deadline
            else:
                assert deadline is None, send.frame


# --- exact outcomes: each send's fate is its own answer ---------------------------------------------------


def expected(plan: list[Act], setup: Setup) -> tuple[Act, int]:
    """The act that decides a call's outcome, and how many sends it takes."""
    busy = 0
    for sends, act in enumerate(plan, start=1):
        if act.kind == "busy":
            busy += 1
            if busy >= setup.tries:
                return act, sends
            continue
        return act, sends
    return Act("result"), len(plan) + 1


def matches(outcome: Outcome, act: Act, index: int) -> bool:
    match act.kind:
        case "result" | "noise":
            return outcome == marked(index)
        case "error":
            return type(outcome) is RequestError and outcome.code == act.code
        case "late" | "silent":
            return type(outcome) is DeadlineExceededError and outcome.frame is not None
        case "cancelled" | "bad_result":
            return type(outcome) is FillMaskError and outcome.frame is not None
        case "busy":
            return (type(outcome) is OverloadedError and outcome.reason == act.reason
                    and outcome.status == act.status)
    raise AssertionError(act)


@st.composite
def request_examples(draw: st.DrawFn) -> tuple[list[list[Act]], Setup]:
    count = draw(st.integers(1, 6))
    setup = draw(setups(count, ("calls", "calls", "many", "iter", "sync")))
    plans = []
    for index in range(count):
        final = draw(finals)
        if final.kind == "silent" and not setup.deadline and not setup.may_hang(index):
            final = Act("result")  # without deadline_ms nothing would end the call (the docstring's asyncio.timeout)
        plans.append([*draw(prefixes), final])
    return plans, setup


@settings(max_examples=120, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request_examples())
# Found by a longer random run: the loop left after `stop` outcomes only once the next came, and that
# text's answer never comes (silent, no deadline): the test hung.
@example(([[Act("result")], [Act("result")], [Act("silent")]],
          Setup(connections=1, reconnect=False, attempts=0, deadline=False, max_inflight=None, mode="iter",
                return_exceptions=False, concurrency=None, stop=2, generator=False)))
# ... and the same with one place per connection: the request's cancel, read before its silent act began,
# was lost (the fake held it for good).
@example(([[Act("result")], [Act("result")], [Act("silent")]],
          Setup(connections=1, reconnect=False, attempts=0, deadline=False, max_inflight=1, mode="iter",
                return_exceptions=False, concurrency=None, stop=2, generator=False)))
def test_request_scripts(example: tuple[list[list[Act]], Setup]) -> None:
    """Scripts whose every send is answered on its own connection, the connection kept: each call's outcome
    and number of sends follow from its text's plan and the retry policy alone."""
    plans, setup = example

    def check(server: Scripted, got: Run) -> None:
        assert not got.leaked, got.leaked
        check_sends(server, setup)
        decided = [expected(plan, setup) for plan in plans]
        for index, outcome in got.outcomes.items():
            check_documented(outcome)
            act, sends = decided[index]
            if setup.may_hang(index) and not matches(outcome, act, index):
                # Cancelled by the test, or ended by the client's close(): nothing else.
                assert isinstance(outcome, asyncio.Task) or (
                    setup.close_ms is not None and isinstance(outcome, ConnectionLostError)), (index, outcome)
                continue
            assert matches(outcome, act, index), (index, act, outcome)
            assert len(server.sends[index]) == sends, (index, plans[index], len(server.sends[index]))
        for index in range(len(plans)):  # those not reached (a raise, an early exit): never more
            assert len(server.sends[index]) <= decided[index][1], (index, plans[index], len(server.sends[index]))
        failing = [index for index, (act, _) in enumerate(decided) if act.kind not in ("result", "noise")]
        if setup.mode in ("many", "sync") and not setup.return_exceptions:
            if failing:  # the first failure in input order is raised, naming its text
                assert got.raised is not None and noted_index(got.raised) == failing[0], got.raised
                assert matches(got.raised, decided[failing[0]][0], failing[0]), got.raised
            else:
                assert got.raised is None and len(got.outcomes) == len(plans), got
        else:
            assert got.raised is None, got.raised
            reached = len(plans) if setup.stop is None else min(setup.stop, len(plans))
            assert sorted(got.outcomes) == list(range(reached)), got.outcomes

    run_example(plans, setup, check, probe=True)


# --- consistent outcomes: connections drained, closed and cut ------------------------------------------


def fate(server: Scripted, send: Send) -> set[str]:
    """What the client can have seen of one send: its answer's kind, or ``lost <code>`` (both where its
    connection was cut, which may drop an answer already handed to the socket)."""
    seen: set[str] = set()
    if send.answer is not None:
        seen.add("busy" if send.act.kind == "busy" else "gone" if send.act.kind == "gone" else "final")
        if send.conn not in server.aborted:
            return seen
    code = server.closed_with.get(send.conn)
    seen.add(f"lost {code}" if code is not None else "unanswered")
    return seen


@st.composite
def connection_examples(draw: st.DrawFn) -> tuple[list[list[Act]], Setup]:
    count = draw(st.integers(1, 5))
    setup = draw(setups(count, ("calls", "calls", "many", "iter", "sync")))
    plans: list[list[Act]] = []
    for _ in range(count):
        before = draw(st.lists(st.one_of(busies, disruptions, disruptions), max_size=3))
        final = draw(st.one_of(finals, disruptions))
        if final.kind == "silent" and not setup.deadline and not setup.may_hang(len(plans)):
            final = Act("result")
        plans.append([*before, final])
    return plans, setup


@settings(max_examples=120, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(connection_examples())
# Found by longer random runs; each once broke the fake's own bookkeeping, not the client:
# a request read after its connection's scripted close (sent before the client saw it) ...
@example(([[Act("gone", reason="engine_stopped"), Act("going_away"), Act("result")],
           [Act("going_away", answer=True), Act("result")], [Act("result", delay_ms=20)]],
          Setup(connections=3, reconnect=True, attempts=0, deadline=False, max_inflight=None, mode="iter",
                return_exceptions=False, concurrency=2, stop=1, generator=False)))
# ... a busy refusal handed to a connection then cut, never read (the text resent as a loss) ...
@example(([[Act("result")], [Act("result")],
           [Act("gone", reason="engine_stopped"), Act("abort"), Act("result")],
           [Act("gone", reason="engine_stopped"), Act("busy", status=503, reason="queue_full"),
            Act("busy", status=503, reason="queue_full"), Act("result")]],
          Setup(connections=1, reconnect=True, attempts=0, deadline=False, max_inflight=None, mode="iter",
                return_exceptions=False, concurrency=None, stop=3, generator=False)))
# ... and a silent request's wait, a task of its own under Python 3.11's wait_for, taken for the client's.
@example(([[Act("result")], [Act("silent")], [Act("going_away")]],
          Setup(connections=1, reconnect=False, attempts=0, deadline=True, max_inflight=None, mode="calls",
                return_exceptions=False, concurrency=None, stop=None, generator=False,
                cancel_ms=(None, None, None))))
def test_connection_scripts(example: tuple[list[list[Act]], Setup]) -> None:
    """Scripts that also drain, close and cut connections: whatever the timing, each outcome is what the
    server's log allows (the answer to the text's last send, or a loss or drain it went through), and each
    resend follows a fate that the client documents as worth one."""
    plans, setup = example

    def check(server: Scripted, got: Run) -> None:
        assert not got.leaked, got.leaked
        check_sends(server, setup)
        if got.raised is not None:
            if setup.mode in ("many", "sync"):
                consistent(server, setup, noted_index(got.raised), got.raised)
            else:  # iter over a generator: every connection lost for good, said once (fill_mask_iter's doc)
                assert setup.generator and not setup.reconnect, got.raised
                assert isinstance(got.raised, (ConnectionLostError, OverloadedError)), got.raised
        for index, outcome in got.outcomes.items():
            consistent(server, setup, index, outcome)
        for index, sends in server.sends.items():
            resent = [fate(server, send) for send in sends[:-1]]
            busy = [send for send, after in itertools.zip_longest(sends, sends[1:])
                    if send.act.kind == "busy" and send.answer is not None and read(server, send, after)]
            assert len(sends) <= setup.tries + MAX_RESENDS, (index, plans[index], len(sends))
            assert len(busy) <= setup.tries, (index, plans[index])
            for number, seen in enumerate(resent):
                why = [kind for kind in seen if kind in ("busy", "gone")
                       or (kind.startswith("lost ") and int(kind.split()[1]) in RECONNECT_CODES)]
                assert why, f"text {index} sent again after its send {number} ended as {seen}: {plans[index]}"
                if why == ["busy"]:
                    assert setup.attempts > 1, (index, plans[index])

    run_example(plans, setup, check)


def read(server: Scripted, send: Send, after: Send | None) -> bool:
    """Whether the client surely read ``send``'s answer: its connection was not cut, or the text's next
    send came before the cut (a refusal handed to a connection then cut may be lost, its text resent as
    a loss)."""
    cut_at = server.aborted_at.get(send.conn)
    return cut_at is None or (after is not None and after.received_at < cut_at)


def consistent(server: Scripted, setup: Setup, index: int, outcome: Outcome) -> None:
    """``outcome`` is what the log allows for text ``index``."""
    check_documented(outcome)
    if isinstance(outcome, asyncio.Task):
        return  # cancelled by the test
    sends = server.sends.get(index, [])
    last = sends[-1] if sends else None
    if not isinstance(outcome, BaseException):
        assert last is not None and last.answer is not None and last.answer.get("predictions") == outcome, (
            index, outcome, last)
        assert outcome == marked(index), (index, outcome)
        return
    assert isinstance(outcome, FillMaskError) and not isinstance(outcome, ConnectError), outcome  # (redials work)
    frame = outcome.frame
    if isinstance(outcome, OverloadedError) and outcome.reason in SERVER_GONE_REASONS:
        # This text's own answer, or a notice of the drained connection(s) when no other could take it.
        assert frame is not None and (frame in server.notices or (last is not None and last.answer == frame)), (
            index, outcome)
    elif frame is not None:
        assert last is not None and last.answer == frame, (index, outcome, last)
        if isinstance(outcome, OverloadedError) and not isinstance(outcome, DeadlineExceededError):
            busy = [send for send in sends if send.act.kind == "busy" and send.answer is not None]
            assert setup.attempts <= 1 or len(busy) >= setup.attempts, (index, outcome, len(busy))
    elif isinstance(outcome, ConnectionLostError):
        # The connection of its last send was lost (or one it was resent on, before the server read it),
        # or none was usable any more: never after a final answer it could read.
        assert server.cut or setup.close_ms is not None, (index, outcome)
        if last is not None:
            assert fate(server, last) != {"final"}, (index, outcome, last)
    else:
        raise AssertionError(f"text {index}: {outcome!r} without a frame")


# --- what the properties found: minimal repros --------------------------------------------------------


def one_server(plans: list[list[Act]], body: Callable[[Scripted], Awaitable[None]], *,
               max_inflight: int | None = None) -> None:
    limits = dict(LIMITS)
    if max_inflight is not None:
        limits["max_inflight_per_connection"] = max_inflight

    async def main() -> None:
        async with scripted(plans, {**HELLO, "limits": limits}) as server:
            await asyncio.wait_for(body(server), HANG_S)

    asyncio.run(main())


class SlowRedial(ReconnectBackoff):
    """Every redial after 0.3 s (no jitter), so that a call made meanwhile waits that long."""

    def delay(self, attempt: int, first_window: float | None = None, rand: Any = None) -> float:
        return 0.3


@pytest.mark.parametrize("waiting_for", ["permit", "redial"])
def test_a_first_send_after_waiting_in_the_client_carries_what_is_left_of_deadline_ms(waiting_for: str) -> None:
    """``fill_mask_result``: "the caller's budget counts from this call, not from each send", and its frame
    is "built when it goes out ... so that deadline_ms carries what is left of the caller's budget then".
    A call that waited about 300 ms for a place under ``max_inflight_per_connection`` (or for a redial,
    with ``reconnect``) before its first send still sent ``deadline_ms=2000``, so the server's 504
    comes up to that much later than the caller asked."""

    async def body(server: Scripted) -> None:
        permit = waiting_for == "permit"
        async with FillMaskClient(server.url, reconnect=not permit, backoff=SlowRedial()) as client:
            first = asyncio.ensure_future(client.fill_mask(text_of(0)))
            if permit:  # the one place is taken by text 0, answered 300 ms after it came
                await until(lambda: len(server.sends[0]) == 1)
            else:  # text 0's connection is lost (1001): the redial comes 300 ms later
                await until(lambda: client.usable_connections == 0)
            started = asyncio.get_running_loop().time()
            assert await client.fill_mask(text_of(1), deadline_ms=2000) == marked(1)
            assert await first == marked(0)
            # The client built text 1's frame once the place was free (text 0 answered) or the new
            # connection open: at least this much of its budget was spent by then.
            free = server.sends[0][0].answered_at if permit else server.opened_at[1]
            spent_ms = (free - started) * 1000
            if spent_ms < 100:
                pytest.skip(f"the machine was too slow to make the call wait ({spent_ms:.0f} ms)")
            sent = server.sends[1][0].frame["deadline_ms"]
            assert sent <= 2000 - spent_ms + 1, f"sent deadline_ms={sent} after {spent_ms:.0f} ms of the call's 2000"

    plans = [[Act("result", delay_ms=300)] if waiting_for == "permit" else [Act("close", close=1001)], [Act("result")]]
    one_server(plans, body, max_inflight=1 if waiting_for == "permit" else None)


def test_a_call_whose_deadline_passed_while_it_waited_for_a_place_is_not_sent() -> None:
    """``RetryPolicy``/``fill_mask_result``: no send once the caller's deadline is spent, and a back-off
    that would outlast it raises ``DeadlineExceededError`` at once, nothing sent. A call with
    ``deadline_ms=100`` that waited 400 ms for the one place under ``max_inflight_per_connection=1``
    was then sent, with ``deadline_ms=100`` (its whole budget again), and answered."""

    async def body(server: Scripted) -> None:
        async with FillMaskClient(server.url) as client:
            first = asyncio.ensure_future(client.fill_mask(text_of(0)))
            await until(lambda: len(server.sends[0]) == 1)
            outcome: Any
            try:
                outcome = await client.fill_mask(text_of(1), deadline_ms=100)
            except FillMaskError as exc:
                outcome = exc
            assert await first == marked(0)
            assert isinstance(outcome, DeadlineExceededError), outcome
            assert not server.sends[1], server.sends[1][0].frame

    one_server([[Act("result", delay_ms=400)], [Act("result")]], body, max_inflight=1)


def test_a_call_waiting_for_a_place_leaves_a_connection_that_goes_away() -> None:
    """§10: after ``going_away`` nothing more is sent on that connection; the client's docstrings: a
    connection going away "gets no new calls", and one that stops taking work wakes the calls waiting
    on it (``_stopped``), "which then fail or choose another connection at once". A call that waited
    for the one place (``max_inflight_per_connection=1``) behind a request the server still owed kept
    waiting there after ``going_away``, though ``reconnect`` had opened a usable connection: it would
    go only once the owed answer came (after a drain's whole ``--shutdown-timeout``, at worst)."""

    async def body(server: Scripted) -> None:
        async with FillMaskClient(server.url, reconnect=True, backoff=ReconnectBackoff(base=0.001, cap=0.01)) as client:
            owed = asyncio.ensure_future(client.fill_mask(text_of(0)))  # held by the server: still owed
            await until(lambda: len(server.sends[0]) == 1)
            waiting = asyncio.ensure_future(client.fill_mask(text_of(1)))
            await asyncio.sleep(0.05)
            assert not waiting.done() and not server.sends[1]
            await server.connections[0].send(orjson.dumps(
                {"type": "going_away", "reason": "shutting_down", "reconnect_within_ms": 10}).decode())
            try:
                done, _ = await asyncio.wait([waiting], timeout=2)
                assert done, f"still waiting; {len(server.connections)} connections, {client.usable_connections} usable"
                assert waiting.result() == marked(1) and server.sends[1][0].conn == 1
            finally:
                owed.cancel()
                waiting.cancel()
                await asyncio.gather(owed, waiting, return_exceptions=True)

    one_server([[Act("silent")], [Act("result")]], body, max_inflight=1)
