"""End-to-end properties of the whole server, driven by hypothesis (protocol.md §3, §5 to §8, §11 to §13).

Hypothesis draws a short program (up to ``MAX_STEPS`` steps) over one to four raw WebSocket connections
(the ``websockets`` client itself, so that every frame is the test's own) to one real server with the
tiny model: valid ``fill_mask`` requests (several texts, ``top_k``, ``targets``, tiny or large
``deadline_ms``, ids of every JSON type, a frame of exactly ``max_frame_bytes``), requests that reuse an
id in flight or one already answered, ``cancel`` for an id in flight, answered or unknown, malformed
frames of every kind (with and without a valid id), ``subscribe_stats``/``unsubscribe_stats`` (also with
an id in flight, which §13 says is ignored), a frame over ``max_frame_bytes`` (§1: 1009), pauses in
reading (some connections have a small receive buffer and a one-frame library queue, so that a pause
reaches the server as a full TCP window), sleeps, normal closes, aborts (``transport.abort()``) and new
connections. One server per test function serves every example; each example closes what it opened and
waits for the server to settle, so the next one starts from a clean server.

The invariants, checked on every example:

- **Exactly one answer** (§3 order of the checks, §7, §8): on a connection that stays open and reads,
  every frame sent under a valid id gets exactly one answer under that id, and one it may get: the
  answers to the frames of one id must be matched one to one with those frames, each answer being one
  the frame's own rules allow (a valid request: ``result``; ``overloaded`` only where the queue could
  be half full, 504 only with ``deadline_ms``; ``cancelled`` only after a ``cancel`` for it;
  ``duplicate_id`` only while another frame with that id had no answer yet; ``too_many_inflight`` only
  with the cap's worth of frames unanswered; ``result_too_large`` only where §3's size rule does not
  rule it out; a malformed frame: its one error code). A frame without a valid id gets exactly one
  ``error`` with ``id`` null, of its code; a valid ``cancel``, ``subscribe_stats`` or
  ``unsubscribe_stats`` gets nothing. No answer ever comes for an id never sent on that connection,
  and on a connection that ends early no more answers come than frames were sent.
- **Results** have the shape §4 gives: one list per mask, ``min(top_k, distinct targets)`` candidates,
  scores in descending order, ``targets`` notes only for a target that is not one token.
- **The contract**: every frame the connections receive is checked against protocol/schemas by the
  suite's wire monitor (tests/conftest.py ``wire_contract``), whose problems are taken per example.
- **No internals** in an ``error`` message: one line, no traceback, file or object repr (§7).
- **No close but ours**: the server never closes a connection that did not send an oversize frame
  (nor one that reads slowly for less than ``--send-timeout``, nor one refused a few times: the
  programs are too short to reach §12's 200 early refusals); the oversize frame closes with 1009, and a
  client's close is echoed with 1000.
- **Counting, not waiting** (§8, §11): once every connection is closed and the server has settled,
  ``fillmask_requests_total`` (every outcome, ``dropped`` included) grew by exactly the frames owed an
  answer, where every connection was read up to a marker before it ended. A connection closed or
  aborted while it was not reading may have left frames the server never read (§8: a connection counts
  as closed from its close frame, and frames queued before it are discarded; an abort loses what the
  kernel held), so for it the count lies between the frames owed up to its last marker and all it
  sent. And the queue is empty, nothing is in flight or unsent, the engine's answer memory reserved is
  back to 0, no request was answered twice, and the open connections are back to what they were.

A marker (``sync``) is a frame of an unknown type under a fresh id: the server answers it at once, after
the answers of every frame read before it (one outbox per connection, in order), so its answer shows
that the server has read and counted everything sent before it.

Two servers: ``roomy`` (default queue, a cap of 6 in flight per connection) and ``tight`` (a queue of
4, 3 in flight, batches of 2, a 32 KiB result bound, 4 KiB of send buffer per connection and 48 kB of
answer memory in all, and small kernel buffers on the server's sockets), where 429/503 refusals,
``too_many_inflight``, ``result_too_large`` and requests waiting in the queue for answer memory (§12)
are reached. (The server stopping to read a client, §12, is reached only now and then: the answer
memory keeps what waits for a client that does not read within its bound, by design;
tests/test_hardening_clients.py drives it on purpose.) Each test runs 30 examples, a few seconds (a helper ran 1,600
random programs once, with no bug found; 30 keep the suite within its time).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from fillmask_server.server import FillMaskServer
from tests.contract import WireMonitor
from tests.wire import answers_counted, open_reader

MAX_STEPS = 40
MAX_CLIENTS = 4
WAIT_S = 10.0  # every wait of the test is bounded by this (a passing run never comes near it)
FRAME_LIMIT = 4096  # --max-frame-bytes of both servers: an oversize frame costs little to send
MAX_SENT_WHILE_PAUSED = 24  # frames a paused client sends at most: never enough to fill every buffer

TEXTS = [
    "Paris is the [MASK] of France.",
    "The [MASK] sat on the mat.",
    "[MASK]",
    "She plays the [MASK] and he plays the [MASK] in the evening.",
    " ".join(["the [MASK] of"] * 8),  # eight masks: the largest answers (§3 max_masks)
    "Ünïcödé [MASK] 🗼 naïve café",
    "After years of careful research, the scientists finally announced that the [MASK] had been found deep "
    "beneath the ice of the southern continent, where nobody had ever thought to look.",
]
#: (targets as sent, distinct tokens scored, whether the result names a target not scored as given: §4)
TARGETS: list[tuple[Any, int, bool]] = [
    (["capital", "heart", "city"], 3, False),
    ("dog", 1, False),
    (["new york", "paris"], 2, True),
    (["capital", "capital", "cat"], 2, False),
]
TOP_KS = [None, 1, 3, 100, 100]
DEADLINES = [None, None, 0.001, 50.0, 600_000]
DEFAULT_TOP_K = 5

ERROR = "error"
DUPLICATE = (ERROR, "duplicate_id")
TOO_MANY_INFLIGHT = (ERROR, "too_many_inflight")
RESULT_TOO_LARGE = (ERROR, "result_too_large")
QUEUE_REFUSALS = {("overloaded", "queue_full"), ("overloaded", "queue_share")}
EXPIRED = ("overloaded", "deadline_exceeded")
RESULT = ("result", "")
CANCELLED = ("cancelled", "")
#: Words that would show internals in an error message (§7: no traceback, file path or library internals).
INTERNALS = ("Traceback", 'File "', ".py", "site-packages", " object at 0x", "Exception", "NoneType")


def _j(value: Any) -> str:
    return orjson.dumps(value).decode()


# Malformed frames that carry a valid id (the answer comes under it): (build from the id's JSON, code,
# whether the request is accepted before it is refused: §3's checks after reading, which come after
# too_many_inflight and the queue's refusals).
BAD_WITH_ID: list[tuple[Callable[[str], str], str, bool]] = [
    (lambda i: f'{{"type": "teleport", "id": {i}}}', "unknown_type", False),
    (lambda i: f'{{"type": 5, "id": {i}}}', "unknown_type", False),
    (lambda i: f'{{"id": {i}, "text": "[MASK]"}}', "missing_field", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}}}', "missing_field", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": 42}}', "invalid_field", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "\\ud800 [MASK]"}}', "invalid_field", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "no mask here"}}', "no_mask", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": ""}}', "no_mask", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "{"[MASK] " * 9}"}}', "too_many_masks", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "[MASK]{"a" * 2000}"}}', "text_too_long", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "top_k": 0}}', "invalid_top_k", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "top_k": 101}}', "invalid_top_k", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "top_k": 5.0}}', "invalid_top_k", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "top_k": true}}', "invalid_top_k", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "targets": []}}', "invalid_targets", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "targets": [" "]}}', "invalid_targets", False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "deadline_ms": 0}}', "invalid_deadline",
     False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "deadline_ms": 600001}}', "invalid_deadline",
     False),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "deadline_ms": 1e400}}', "invalid_deadline",
     False),
    # Refused by the checks that need the tokenizer, after acceptance (§3):
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "[MASK]{" a" * 600}"}}', "text_too_long", True),
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "targets": ["\\u200b"]}}', "invalid_targets",
     True),
]
# Frames that look odd but are valid requests (answered like any other: a result, or a refusal of §3
# steps 4 and 5, or result_too_large where §3's size rule allows it): (build from the id's JSON, text).
ODD_BUT_VALID: list[tuple[Callable[[str], str], str]] = [
    # §3: an optional field sent as null is the same as that field left out.
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "top_k": null, "targets": null, '
               '"deadline_ms": null}', "a [MASK]"),
    # §1: a key that appears twice takes its last value, type and id included.
    (lambda i: f'{{"type": "cancel", "id": "not-this", "text": "a [MASK]", "type": "fill_mask", "id": {i}}}',
     "a [MASK]"),
    # §1: fields not named are ignored.
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "a [MASK]", "extra": {{"nested": [1, null]}}}}',
     "a [MASK]"),
    # §3: exactly max_text_chars code points (one word past the tokenizer's longest: one token).
    (lambda i: f'{{"type": "fill_mask", "id": {i}, "text": "[MASK] {"é" * 1993}"}}', "[MASK] " + "é" * 1993),
]
# Malformed frames without a valid id: answered with id null (§7).
BAD_WITHOUT_ID: list[tuple[str | bytes, str]] = [
    ("this is not json", "invalid_json"),
    ('{"type": "fill_mask", "id": 1, "text": "a [MASK]", "top_k": NaN}', "invalid_json"),
    ("[1, 2, 3]", "not_an_object"),
    ('"fill_mask"', "not_an_object"),
    (b"\x00\x01binary", "binary_frame"),
    (b'{"type": "fill_mask", "id": 1, "text": "a [MASK]"}', "binary_frame"),
    ("{}", "missing_field"),
    ('{"type": "teleport"}', "unknown_type"),
    ('{"type": "fill_mask", "text": "a [MASK]"}', "missing_field"),
    ('{"type": "fill_mask", "id": [4], "text": "a [MASK]"}', "invalid_id"),
    ('{"type": "fill_mask", "id": 4.5, "text": "a [MASK]"}', "invalid_id"),
    ('{"type": "fill_mask", "id": 1e1, "text": "a [MASK]"}', "invalid_id"),
    ('{"type": "fill_mask", "id": true, "text": "a [MASK]"}', "invalid_id"),
    ('{"type": "fill_mask", "id": null, "text": "a [MASK]"}', "invalid_id"),
    ('{"type": "fill_mask", "id": "", "text": "a [MASK]"}', "invalid_id"),
    (f'{{"type": "fill_mask", "id": "{"x" * 129}", "text": "a [MASK]"}}', "invalid_id"),
    (f'{{"type": "fill_mask", "id": {2 ** 53}, "text": "a [MASK]"}}', "invalid_id"),
    ('{"type": "cancel"}', "missing_field"),
    ('{"type": "cancel", "id": 1.5}', "invalid_id"),
    ('{"type": "subscribe_stats", "interval_ms": 100}', "invalid_field"),
    ('{"type": "subscribe_stats", "interval_ms": "1000"}', "invalid_field"),
]


# --- the programs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fill:
    """``burst`` valid fill_mask frames sent back to back on connection ``conn``."""

    conn: int
    text: int
    top_k: int | None
    targets: int | None
    deadline_ms: float | None
    id_style: int
    burst: int
    pad_to_limit: bool


@dataclass(frozen=True)
class Reuse:
    """A frame under an id of this connection: one without its answer yet (``in_flight``) or one answered.
    ``kind``: 0 a valid fill_mask, 1 an unknown type, 2 no type (§3: ``duplicate_id`` while in flight)."""

    conn: int
    in_flight: bool
    pick: int
    kind: int


@dataclass(frozen=True)
class Cancel:
    conn: int
    which: str  # in_flight, answered, unknown
    pick: int


@dataclass(frozen=True)
class Bad:
    conn: int
    with_id: bool
    pick: int


@dataclass(frozen=True)
class Odd:
    """One of ``ODD_BUT_VALID``, under a fresh id of style ``id_style``."""

    conn: int
    pick: int
    id_style: int


@dataclass(frozen=True)
class Stats:
    """0 subscribe (250 ms), 1 subscribe with an id in flight (ignored, §13), 2 unsubscribe, 3 a bad
    interval with an id in flight (invalid_field with id null, §13)."""

    conn: int
    mode: int


@dataclass(frozen=True)
class Oversize:
    conn: int


@dataclass(frozen=True)
class Pause:
    conn: int


@dataclass(frozen=True)
class Resume:
    conn: int


@dataclass(frozen=True)
class Sleep:
    ms: int


@dataclass(frozen=True)
class Close:
    conn: int


@dataclass(frozen=True)
class Abort:
    conn: int
    marker_first: bool


@dataclass(frozen=True)
class Open:
    slow: bool


conn_ix = st.integers(0, MAX_CLIENTS - 1)
fill_steps = st.builds(Fill, conn_ix, st.integers(0, len(TEXTS) - 1), st.sampled_from(TOP_KS),
                       st.one_of(st.none(), st.integers(0, len(TARGETS) - 1)), st.sampled_from(DEADLINES),
                       st.integers(0, 6), st.integers(1, 4), st.sampled_from([False, False, False, True]))
#: Each kind of step with its weight (how many of every 30 steps are of that kind, about).
WEIGHTED_STEPS = [
    (fill_steps, 10),
    (st.builds(Reuse, conn_ix, st.booleans(), st.integers(0, 7), st.integers(0, 2)), 3),
    (st.builds(Cancel, conn_ix, st.sampled_from(["in_flight", "in_flight", "answered", "unknown"]),
               st.integers(0, 7)), 3),
    (st.builds(Bad, conn_ix, st.booleans(), st.integers(0, 63)), 3),
    (st.builds(Stats, conn_ix, st.integers(0, 3)), 1),
    (st.builds(Pause, conn_ix), 2),
    (st.builds(Resume, conn_ix), 2),
    (st.builds(Sleep, st.sampled_from([0, 5, 20, 60])), 3),
    (st.builds(Open, st.booleans()), 2),
    (st.builds(Oversize, conn_ix), 1),
    (st.builds(Close, conn_ix), 1),
    (st.builds(Abort, conn_ix, st.booleans()), 1),
]
steps = st.one_of(*(strategy for strategy, weight in WEIGHTED_STEPS for _ in range(weight)))
programs = st.tuples(st.lists(st.booleans(), min_size=1, max_size=2),  # the connections open at the start (slow?)
                     st.lists(steps, min_size=15, max_size=MAX_STEPS))


# --- one client connection and what it is owed -------------------------------------------------------


Kind = tuple[str, str]  # (type, code or reason): how an answer is told apart


@dataclass
class Owed:
    """A frame sent under a valid id: the answers it may get."""

    allowed: set[Kind]
    request: bool  # a fill_mask that may be accepted (so cancelled, or withdrawn)
    fill: bool = True  # of type fill_mask, valid or not (the wire monitor pairs these with their answers)
    text: str | None = None  # for a valid request: what its result must look like
    top_k: int = DEFAULT_TOP_K
    targets: int | None = None
    shown: str = ""


@dataclass
class Client:
    name: str
    ws: ClientConnection
    hello: dict[str, Any]
    slow: bool
    reading: asyncio.Event = field(default_factory=asyncio.Event)
    frames: dict[bytes, list[Owed]] = field(default_factory=dict)  # by the id's JSON, in send order
    answers: dict[bytes, list[dict[str, Any]]] = field(default_factory=dict)
    outstanding: Counter[bytes] = field(default_factory=Counter)  # frames of each id without an answer yet
    answered_ids: list[Any] = field(default_factory=list)
    null_owed: Counter[str] = field(default_factory=Counter)
    null_got: Counter[str] = field(default_factory=Counter)
    owed: int = 0  # frames sent that are owed an answer
    marked: int = 0  # of those, the ones the server had read at the last marker's answer
    sent_while_paused: int = 0
    ours: str | None = None  # None while open; else how the test ended it: close, abort, oversize
    end: ConnectionClosed | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    problems: list[str] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None
    stats_frames: int = 0
    kept_to_end: bool = False

    @property
    def alive(self) -> bool:
        return self.ours is None and not self.ended.is_set()

    def reusable(self) -> list[bytes]:
        """Ids (their JSON) every frame of which was a fill_mask, in the order first sent."""
        return [k for k, frames in self.frames.items() if all(f.fill for f in frames)]

    def outstanding_total(self) -> int:
        return sum(self.outstanding.values())

    async def read(self) -> None:
        try:
            while True:
                await self.reading.wait()
                self.on_message(await self.ws.recv())
        except ConnectionClosed as exc:
            self.end = exc
            if self.ours is None:
                self.problems.append(f"{self.name}: the server closed the connection: {exc!r}")
        except Exception as exc:  # a failed check in on_message: keep it, end the reader
            self.problems.append(f"{self.name}: {exc!r}")
        finally:
            self.ended.set()

    def on_message(self, message: str | bytes) -> None:
        frame = orjson.loads(message)
        kind = frame.get("type")
        if kind == "stats":
            self.stats_frames += 1
            return
        if kind in ("hello", "going_away") or kind not in ("result", "error", "overloaded", "cancelled"):
            self.problems.append(f"{self.name}: unexpected frame {str(message)[:200]}")
            return
        if kind == ERROR:
            message_text = frame["message"]
            leaks = [word for word in INTERNALS if word in message_text]
            if leaks or "\n" in message_text or "\r" in message_text or not message_text:
                self.problems.append(f"{self.name}: an error message shows internals {leaks}: {message_text!r}")
        if frame["id"] is None:
            if kind != ERROR:
                self.problems.append(f"{self.name}: a {kind} with id null: {str(message)[:200]}")
                return
            self.null_got[frame["code"]] += 1
            if self.null_got[frame["code"]] > self.null_owed[frame["code"]]:
                self.problems.append(f"{self.name}: more {frame['code']} errors with id null than frames owed one")
            return
        key = orjson.dumps(frame["id"])
        got = self.answers.setdefault(key, [])
        got.append(frame)
        if len(got) > len(self.frames.get(key, ())):
            self.problems.append(f"{self.name}: answer {len(got)} for id {frame['id']!r}, sent "
                                 f"{len(self.frames.get(key, ()))} times: {str(message)[:200]}")
        if self.outstanding[key] > 0:
            self.outstanding[key] -= 1
        self.answered_ids.append(frame["id"])


def monitored_fill(data: str) -> bool:
    """Whether the wire monitor takes ``data`` for a fill_mask it pairs with an answer (orjson reads it)."""
    try:
        frame = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return isinstance(frame, dict) and frame.get("type") == "fill_mask"


def kind_of(frame: dict[str, Any]) -> Kind:
    if frame["type"] == "error":
        return ERROR, frame["code"]
    if frame["type"] == "overloaded":
        return "overloaded", frame["reason"]
    return frame["type"], ""


def matched(frames: list[Owed], answers: list[Kind]) -> bool:
    """Whether each answer can be given a distinct frame that allows it (Kuhn's augmenting paths)."""
    owner: dict[int, int] = {}

    def place(a: int, seen: set[int]) -> bool:
        for f, frame in enumerate(frames):
            if answers[a] in frame.allowed and f not in seen:
                seen.add(f)
                if f not in owner or place(owner[f], seen):
                    owner[f] = a
                    return True
        return False

    return all(place(a, set()) for a in range(len(answers)))


def check_result(owed: Owed, frame: dict[str, Any]) -> list[str]:
    """§4: one list per mask, min(top_k, distinct targets) candidates, scores descending, notes as due."""
    assert owed.text is not None
    masks = owed.text.count("[MASK]")
    expected = owed.top_k if owed.targets is None else min(owed.top_k, TARGETS[owed.targets][1])
    predictions = frame["predictions"]
    lists = [predictions] if masks == 1 else predictions
    problems = []
    if len(lists) != masks or (masks > 1 and not all(isinstance(x, list) for x in lists)):
        problems.append(f"{len(lists)} lists of candidates for {masks} masks")
    for candidates in lists:
        scores = [c["score"] for c in candidates]
        if len(candidates) != expected or scores != sorted(scores, reverse=True):
            problems.append(f"{len(candidates)} candidates (expected {expected}), scores {scores[:5]}")
    notes = owed.targets is not None and TARGETS[owed.targets][2]
    if ("targets" in frame) != notes:
        problems.append(f"targets notes {frame.get('targets')!r} (expected {'some' if notes else 'none'})")
    return [f"result for {owed.shown}: {p}" for p in problems]


# --- the run of one program ----------------------------------------------------------------------------


class Run:
    def __init__(self, srv: FillMaskServer) -> None:
        self.srv = srv
        self.limits = srv.config
        self.clients: list[Client] = []
        self.next_id = 0
        self.problems: list[str] = []

    # ids
    def fresh(self, style: int = 0) -> Any:
        self.next_id += 1
        n = self.next_id
        longest = f"{n}-" + "🗼" * (128 - len(str(n)) - 1)  # max_id_chars code points, four bytes each
        return [n, -n, f"r{n}", 2**53 - 1 - n, f"ü-{n}-🗼", -(2**53 - 1) + n, longest][style % 7]

    async def open(self, slow: bool) -> Client:
        ws, hello = await open_reader(self.srv.url, self.srv.port, slow, WAIT_S)
        client = Client(f"c{len(self.clients)}{'s' if slow else ''}", ws, hello, slow)
        client.reading.set()
        client.reader = asyncio.create_task(client.read())
        self.clients.append(client)
        return client

    def live(self) -> list[Client]:
        return [c for c in self.clients if c.alive]

    async def pick(self, index: int) -> Client:
        live = self.live()
        if not live:
            return await self.open(False)
        return live[index % len(live)]

    def waiting_bound(self) -> int:
        """At most this many requests wait in the server's queue (each is a frame without its answer)."""
        return sum(c.outstanding_total() for c in self.clients)

    async def send(self, client: Client, data: str | bytes, key: bytes | None = None, owed: Owed | None = None,
                   null_code: str | None = None) -> None:
        """Send one frame; ``owed`` under ``key``, or ``null_code``: the answer it is owed."""
        if owed is not None:
            assert key is not None
            client.frames.setdefault(key, []).append(owed)
            client.outstanding[key] += 1
            client.owed += 1
        if null_code is not None:
            client.null_owed[null_code] += 1
            client.owed += 1
        assert len(data.encode() if isinstance(data, str) else data) <= FRAME_LIMIT, "(the test's own frame)"
        if not client.reading.is_set():
            client.sent_while_paused += 1
        try:
            await asyncio.wait_for(client.ws.send(data), WAIT_S)
        except ConnectionClosed:
            await asyncio.wait_for(client.ended.wait(), WAIT_S)  # the reader tells why (a problem unless ours)
            if client.ours is None and client.end is None:
                client.problems.append(f"{client.name}: the connection closed under a send")

    def admission(self, client: Client) -> set[Kind]:
        """The refusals §3 steps 4 and 5 allow for a request sent now on ``client``."""
        allowed: set[Kind] = set()
        if client.outstanding_total() >= self.limits.max_inflight_per_connection:
            allowed.add(TOO_MANY_INFLIGHT)
        if 2 * self.waiting_bound() >= self.limits.max_queue:
            allowed |= QUEUE_REFUSALS
        return allowed

    def maybe_too_large(self, text: str, top_k: int) -> bool:
        """§3: with BERT's uncased vocabulary, a request whose masks x top_k x (6 x its text's UTF-8 bytes +
        160) is within max_result_bytes is not refused for its size (with targets, fewer candidates and
        the notes: the same bound with top_k is taken as the weaker rule)."""
        return text.count("[MASK]") * top_k * (6 * len(text.encode()) + 160) > self.limits.max_result_bytes

    def request_frame(self, client: Client, request_id: Any, step: Fill) -> tuple[str, Owed]:
        text = TEXTS[step.text]
        frame: dict[str, Any] = {"type": "fill_mask", "id": request_id, "text": text}
        if step.top_k is not None:
            frame["top_k"] = step.top_k
        if step.targets is not None:
            frame["targets"] = TARGETS[step.targets][0]
        if step.deadline_ms is not None:
            frame["deadline_ms"] = step.deadline_ms
        data = _j(frame)
        if step.pad_to_limit:  # §1: a frame of exactly max_frame_bytes is not "larger": it is read
            data = data[:-1] + " " * (FRAME_LIMIT - len(data.encode())) + "}"
            assert len(data.encode()) == FRAME_LIMIT
        key = orjson.dumps(request_id)
        top_k = step.top_k or DEFAULT_TOP_K
        allowed = {RESULT} | self.admission(client)
        if client.outstanding[key]:
            allowed.add(DUPLICATE)
        if step.deadline_ms is not None and step.deadline_ms < 1000:
            allowed.add(EXPIRED)
        if self.maybe_too_large(text, top_k):
            allowed.add(RESULT_TOO_LARGE)
        owed = Owed(allowed, True, text=text, top_k=top_k, targets=step.targets, shown=data[:120])
        return data, owed

    # --- steps

    async def step(self, step: Any) -> None:
        if isinstance(step, Open):
            if len(self.live()) < MAX_CLIENTS:
                await self.open(step.slow)
            return
        if isinstance(step, Sleep):
            await asyncio.sleep(step.ms / 1000)
            return
        client = await self.pick(step.conn)
        paused = not client.reading.is_set()
        sends = isinstance(step, (Fill, Reuse, Cancel, Bad, Odd, Stats))
        if paused and sends and client.sent_while_paused >= MAX_SENT_WHILE_PAUSED:
            return  # a paused client sends no more than its buffers surely hold (no send may wait for good)
        if isinstance(step, Fill):
            for _ in range(step.burst):
                request_id = self.fresh(step.id_style)
                data, owed = self.request_frame(client, request_id, step)
                await self.send(client, data, orjson.dumps(request_id), owed)
        elif isinstance(step, Reuse):
            # Only ids of fill_mask frames: the wire monitor pairs a fill_mask's answer with the frames of
            # its id of that type alone, and would take another type's answer for theirs.
            pool = [k for k in client.reusable() if bool(client.outstanding[k]) == step.in_flight]
            if not pool:
                return
            key = pool[step.pick % len(pool)]
            request_id = orjson.loads(key)
            dup = bool(client.outstanding[key])
            if step.kind == 0:
                fill = Fill(step.conn, step.pick % len(TEXTS), None, None, None, 0, 1, False)
                data, owed = self.request_frame(client, request_id, fill)
            else:
                code = "unknown_type" if step.kind == 1 else "missing_field"
                data = _j({"type": "teleport", "id": request_id} if step.kind == 1 else {"id": request_id})
                owed = Owed({(ERROR, code)} | ({DUPLICATE} if dup else set()), False, False, shown=data)
            await self.send(client, data, key, owed)
        elif isinstance(step, Cancel):
            if step.which == "unknown":
                request_id: Any = f"nope-{self.fresh()}"
            else:
                pool = [k for k, n in client.outstanding.items() if n] if step.which == "in_flight" else \
                    [orjson.dumps(i) for i in client.answered_ids]
                if not pool:
                    return
                request_id = orjson.loads(pool[step.pick % len(pool)])
            key = orjson.dumps(request_id)
            for owed in client.frames.get(key, []):  # §5: a queued request is answered cancelled instead
                if owed.request:
                    owed.allowed.add(CANCELLED)
            await self.send(client, _j({"type": "cancel", "id": request_id}))
        elif isinstance(step, Bad):
            if step.with_id:
                build, code, accepted = BAD_WITH_ID[step.pick % len(BAD_WITH_ID)]
                request_id = self.fresh(step.pick)
                data = build(_j(request_id))
                allowed = {(ERROR, code)} | (self.admission(client) if accepted else set())
                owed = Owed(allowed, accepted, monitored_fill(data), shown=data[:120])
                await self.send(client, data, orjson.dumps(request_id), owed)
            else:
                data_or_bytes, code = BAD_WITHOUT_ID[step.pick % len(BAD_WITHOUT_ID)]
                await self.send(client, data_or_bytes, null_code=code)
        elif isinstance(step, Odd):
            build, text = ODD_BUT_VALID[step.pick]
            request_id = self.fresh(step.id_style)
            data = build(_j(request_id))
            allowed = {RESULT} | self.admission(client)
            if self.maybe_too_large(text, DEFAULT_TOP_K):
                allowed.add(RESULT_TOO_LARGE)
            await self.send(client, data, orjson.dumps(request_id), Owed(allowed, True, shown=data[:120]))
        elif isinstance(step, Stats):
            in_flight = [orjson.loads(k) for k, n in client.outstanding.items() if n]
            some_id = in_flight[0] if in_flight else self.fresh()
            if step.mode == 0:
                await self.send(client, _j({"type": "subscribe_stats", "interval_ms": 250}))
            elif step.mode == 1:  # §13: an id in a subscription is ignored, never duplicate_id
                await self.send(client, _j({"type": "subscribe_stats", "interval_ms": 250, "id": some_id}))
            elif step.mode == 2:
                await self.send(client, _j({"type": "unsubscribe_stats", "id": some_id}))
            else:  # §13: the invalid_field error has id null, whatever id the frame holds
                await self.send(client, _j({"type": "subscribe_stats", "interval_ms": 5, "id": some_id}),
                                null_code="invalid_field")
        elif isinstance(step, Oversize):
            if paused:
                return  # (a paused client's big send could wait for a server that stopped reading it)
            await self.marker(client)
            client.ours = "oversize"
            head = '{"type": "fill_mask", "id": "huge", "text": "[MASK] '
            data = head + "a" * (FRAME_LIMIT + 1 - len(head) - 2) + '"}'
            assert len(data.encode()) == FRAME_LIMIT + 1
            with contextlib.suppress(ConnectionClosed):
                await asyncio.wait_for(client.ws.send(data), WAIT_S)
            await asyncio.wait_for(client.ended.wait(), WAIT_S)
            code = client.end.rcvd.code if client.end is not None and client.end.rcvd is not None else None
            if code != 1009:
                client.problems.append(f"{client.name}: an oversize frame closed with {code}, not 1009 (§1)")
        elif isinstance(step, Pause):
            client.reading.clear()
            client.sent_while_paused = 0
        elif isinstance(step, Resume):
            client.reading.set()
        elif isinstance(step, Close):
            if not paused:
                await self.marker(client)
            client.ours = "close"
            await asyncio.wait_for(client.ws.close(), WAIT_S)
            if not paused:
                await asyncio.wait_for(client.ended.wait(), WAIT_S)
                self.check_echo(client)
        elif isinstance(step, Abort):
            if step.marker_first and not paused:
                await self.marker(client)
            client.ours = "abort"
            client.ws.transport.abort()
        else:  # pragma: no cover
            raise AssertionError(step)

    def check_echo(self, client: Client) -> None:
        code = client.end.rcvd.code if client.end is not None and client.end.rcvd is not None else None
        if code != 1000:
            client.problems.append(f"{client.name}: our close was answered with {code}, not echoed 1000 (§14)")

    async def marker(self, client: Client) -> None:
        """Send a frame the server answers at once, and wait for its answer: everything sent before it
        has been read and answered or accepted (``Client.marked``)."""
        request_id = f"sync-{self.fresh()}"
        key = orjson.dumps(request_id)
        await self.send(client, _j({"type": "sync", "id": request_id}), key,
                        Owed({(ERROR, "unknown_type")}, False, False, shown="sync"))
        owed = client.owed
        try:
            async with asyncio.timeout(WAIT_S):
                while key not in client.answers and not client.ended.is_set():
                    await asyncio.sleep(0.002)
        except TimeoutError:
            raise AssertionError(f"{client.name}: no answer to a marker within {WAIT_S} s") from None
        if key in client.answers:
            client.marked = owed

    # --- the end of a program

    async def finish(self) -> None:
        for client in self.live():
            client.reading.set()
            await self.send(client, _j({"type": "unsubscribe_stats"}))
            await self.marker(client)
        # Every frame sent on a connection still open is answered (§8): wait for the last answers.
        try:
            async with asyncio.timeout(WAIT_S):
                while any(c.outstanding_total() or c.null_got != c.null_owed for c in self.live()):
                    await asyncio.sleep(0.005)
        except TimeoutError:
            for c in self.live():
                missing = [orjson.loads(k) for k, n in c.outstanding.items() if n]
                self.problems.append(f"{c.name}: no answer within {WAIT_S} s for ids {missing[:10]}, null codes "
                                     f"owed {dict(c.null_owed - c.null_got)}")
        open_at_end = self.live()
        for client in open_at_end:
            client.kept_to_end = True
            client.ours = "close"
            await asyncio.wait_for(client.ws.close(), WAIT_S)
            await asyncio.wait_for(client.ended.wait(), WAIT_S)
            self.check_echo(client)
            if client.outstanding_total() == 0 and client.null_got == client.null_owed:
                client.marked = client.owed  # everything answered: all of it read by the server

    def check_answers(self) -> None:
        for client in self.clients:
            self.problems += client.problems
            complete = client.kept_to_end  # open and read to the end of the program (§8: every answer came)
            for key, answers in client.answers.items():
                frames = client.frames.get(key, [])
                kinds = [kind_of(a) for a in answers]
                if not matched(frames, kinds):
                    self.problems.append(f"{client.name}: answers {kinds} for id {orjson.loads(key)!r} do not "
                                         f"match its frames {[sorted(f.allowed) for f in frames]} "
                                         f"({[f.shown for f in frames]})")
                if len(frames) == 1 and kinds == [RESULT] and frames[0].text is not None:
                    self.problems += [f"{client.name}: {p}" for p in check_result(frames[0], answers[0])]
            if complete:
                missing = [orjson.loads(k) for k, frames in client.frames.items()
                           if len(client.answers.get(k, ())) != len(frames)]
                if missing or client.null_got != client.null_owed:
                    self.problems.append(f"{client.name}: read to the end, but ids {missing[:10]} and null codes "
                                         f"{dict(client.null_owed - client.null_got)} have no answer")

    async def teardown(self) -> None:
        """Whatever happened: end every connection (an abort where a close would wait) and the readers."""
        for client in self.clients:
            if client.ours is None:
                client.ours = "abort"
                client.ws.transport.abort()
        for client in self.clients:
            if client.reader is not None:
                client.reading.set()
                client.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await client.reader


def served(srv: FillMaskServer, connections: int) -> bool:
    """Nothing left in the server: settled, nothing queued or in flight, the connections it had."""
    return (srv.settled() and srv.engine.queued() == 0 and srv.in_flight() == 0
            and len(srv.connections) == connections and srv._connections_held() == connections)


async def run_program(srv: FillMaskServer, wire: WireMonitor, program: tuple[list[bool], list[Any]]) -> None:
    start, program_steps = program
    wire.take_problems()  # (only this example's)
    base_connections = len(srv.connections)
    before = answers_counted(srv)
    run = Run(srv)
    try:
        for slow in start:
            await run.open(slow)
        for step in program_steps:
            await run.step(step)
        await run.finish()
    finally:
        await run.teardown()
        try:  # the server settles: the next example starts on a clean server
            async with asyncio.timeout(WAIT_S):
                while not served(srv, base_connections):
                    await asyncio.sleep(0.005)
        except TimeoutError:
            run.problems.append(f"the server did not settle within {WAIT_S} s: settled {srv.settled()}, queued "
                                f"{srv.engine.queued()}, in flight {srv.in_flight()}, connections "
                                f"{len(srv.connections)}/{srv._connections_held()} (base {base_connections})")
    run.check_answers()
    lower = sum(c.marked for c in run.clients)
    upper = sum(c.owed for c in run.clients)
    counted = answers_counted(srv) - before
    if not lower <= counted <= upper:
        run.problems.append(f"fillmask_requests_total grew by {counted}, expected "
                            f"{lower if lower == upper else f'{lower} to {upper}'} (§11)")
    if srv.engine._reserved_total != 0:
        run.problems.append(f"answer memory still reserved: {srv.engine._reserved_total} bytes")
    if srv.unsent.total != 0:
        run.problems.append(f"answer bytes still counted as unsent: {srv.unsent.total}")
    if srv.double_answers:
        run.problems.append(f"{srv.double_answers} second answers refused by a session")
    run.problems += [f"contract: {p}" for p in wire.take_problems()]
    assert not run.problems, "\n".join(run.problems[:20])


PROPERTY_SETTINGS = settings(max_examples=30, derandomize=True, deadline=None, database=None,
                             suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                    HealthCheck.data_too_large])


@pytest.fixture
async def roomy(make_server: Any) -> AsyncIterator[FillMaskServer]:
    async with make_server(max_frame_bytes=FRAME_LIMIT, max_inflight_per_connection=6) as srv:
        yield srv


@pytest.fixture
async def tight(make_server: Any) -> AsyncIterator[FillMaskServer]:
    async with make_server(max_frame_bytes=FRAME_LIMIT, max_queue=4, max_inflight_per_connection=3,
                           max_batch_size=2, max_result_bytes=32768, max_send_buffer_bytes=4096,
                           max_answer_bytes=48_000) as srv:
        assert srv._server is not None
        for listener in srv._server.sockets:  # a slow network: a few answers fill the way to a client
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        yield srv


@PROPERTY_SETTINGS
@given(program=programs)
async def test_programs_on_a_roomy_server(roomy: FillMaskServer, wire_contract: WireMonitor,
                                          program: tuple[list[bool], list[Any]]) -> None:
    await run_program(roomy, wire_contract, program)


@PROPERTY_SETTINGS
@given(program=programs)
async def test_programs_on_a_tight_server(tight: FillMaskServer, wire_contract: WireMonitor,
                                          program: tuple[list[bool], list[Any]]) -> None:
    await run_program(tight, wire_contract, program)
