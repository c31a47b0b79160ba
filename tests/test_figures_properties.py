"""Seeded random programs against a real server, checked by counting: the live figures of §13 (``stats``
frames) and the metrics of §11 (``GET /metrics``) must add up to what happened (protocol.md §6 to §8,
§11 to §13).

Each example runs one program (drawn from a seeded ``random.Random``) against a private in-process
server on a real loopback socket, with a tight configuration (a queue of 6, 4 requests in flight per
connection, batches of 2, 4 KiB of send buffer per connection, a 1 s ``--send-timeout``), so that
``queue_full``/``queue_share``, ``too_many_inflight``, 504s, cancels and clients closed for not reading
all happen. Up to four raw WebSocket connections (some "slow": a small receive buffer and a one-frame
library queue, so a pause in reading reaches the server as a full TCP window) send valid and invalid
requests, cancels, deadlines that expire, ``subscribe_stats`` with random intervals (changed mid-way,
sent twice with the same interval, refused, ``unsubscribe_stats``, subscribed again), pause and resume
reading, close with answers pending, abort, and new connections open. Now and then, and at the end, the
program reaches a **quiet point**: every reader resumes, the server settles (``srv.settled()``, nothing
queued or in flight, counted, never slept for), each subscriber sends a marker (a frame the server
answers at once, in order with everything else on that connection) and takes the first ``stats``
frame after the marker's answer, which was therefore cut while nothing happened.

What is checked (each subscription is an *episode*, from the ``subscribe_stats`` that began it to the
``unsubscribe_stats`` or the close that ended it):

- **No gap, no double count** (§13 "describing the time since the previous one (or since the
  subscription)"): the ``batch_id``\\ s an episode's frames list are consecutive, each once, the first
  being the first batch the server ran after it read the subscription; a frame may leave batches out
  only when it lists 64 (§13's cap). At a quiet point the episode has reported every batch and every
  result (``requests_per_s`` × ``window_s``) since its subscription, exactly; between two quiet points,
  exactly what the server ran and sent between them.
- **Each frame agrees with itself**: ``batch_size.mean``/``.max`` with its ``batches``, ``engine_busy``
  with their ``inference_ms``, ``null`` exactly where nothing happened, and with the results received:
  a result's ``batch_size``, ``batch_tokens`` and ``inference_ms`` are its batch's in the frames.
- **Windows**: each is at least the interval in force (at most one frame per interval, §13), and an
  episode's windows add up to the time between its subscription and its frame at a quiet point, within
  the client's view of those moments (so neither overlapping nor leaving time out). No frame comes after
  an ``unsubscribe_stats`` has been answered (by the marker after it), nor without a subscription.
- **Live values at a quiet point**: the frame says ``queue_depth`` 0, ``in_flight`` 0, and the open
  connections; ``/metrics`` says ``fillmask_queue_depth`` 0 and ``fillmask_open_connections`` the same.
- **Metrics at the end** (all connections closed, the server settled), fetched over HTTP from the same
  server: ``fillmask_requests_total`` grew, outcome by outcome and code by code, by exactly the answers
  the clients received, where every connection read all its answers; a connection closed or aborted
  with answers pending may have had answers counted under their outcome (handed to the socket) or as
  ``dropped``, but the total is the frames owed an answer (between those read at its last marker and
  all it sent, for a connection ended without one). The batch histograms' ``_count``\\ s equal the
  engine's own count of batches and the live figures' count; ``fillmask_batch_size_sum`` and
  ``fillmask_queue_wait_seconds_count`` its rows; ``fillmask_engine_busy_seconds_total`` moved with
  ``fillmask_inference_seconds_sum``; ``fillmask_connections_total`` by the connections opened;
  ``fillmask_slow_clients_closed_total`` by the clients closed with 1008; the gauges are back to idle
  (queue 0, no open connection, no answer bytes unsent or reserved).

The base seed is ``FIGURES_SEED`` and the count ``FIGURES_EXAMPLES``; a failure names the example's seed,
so ``FIGURES_SEED=<seed> FIGURES_EXAMPLES=1`` replays it (the program is the seed's; the timing of a real
server is not, so a replay may take other branches of the server's code); ``FIGURES_VERBOSE=1`` (with
``-s``) prints what each example covered. Three examples take about 20 s on two cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from fillmask_server.server import FillMaskServer
from fillmask_server.stats import MAX_BATCHES_PER_FRAME
from tests.wire import open_reader

BASE_SEED = int(os.environ.get("FIGURES_SEED", "1306"))
EXAMPLES = int(os.environ.get("FIGURES_EXAMPLES", "1"))  # (more by hand: the suite's time)
STEPS = 50
MAX_CLIENTS = 4
WAIT_S = 10.0  # every wait is bounded by this (a safety net: a passing run never comes near it)
MAX_SENT_WHILE_PAUSED = 12  # a paused client sends no more than its buffers surely hold
INTERVALS = (250, 300, 400, 500)
PACE_S = (0, 0.01, 0.03, 0.06, 0.12)  # between two steps: a program lasts a few seconds, many intervals
#: The private server's settings: small enough that every refusal of §6/§7 and §12's close happen.
TIGHT: dict[str, Any] = {"max_queue": 6, "max_inflight_per_connection": 4, "max_batch_size": 2,
                         "max_send_buffer_bytes": 4096, "max_answer_bytes": 48_000, "max_result_bytes": 32_768,
                         "send_timeout": 1.0}
SLOW_REASON_PART = "too many unread messages"

TEXTS = [
    "Paris is the [MASK] of France.",
    "The [MASK] sat on the mat.",
    "She plays the [MASK] and he plays the [MASK] in the evening.",
    " ".join(["the [MASK] of"] * 8),
    "After years of careful research, the scientists finally announced that the [MASK] had been found.",
]
#: Frames that are not valid requests, each owed one error (§7): (the frame, ``{id}`` standing for a fresh
#: id's JSON; whether the error comes under that id, else with id null).
BAD: list[tuple[str, bool]] = [
    ('{{"type": "fill_mask", "id": {id}, "text": "no mask here"}}', True),
    ('{{"type": "fill_mask", "id": {id}, "text": "a [MASK]", "top_k": 0}}', True),
    ('{{"type": "fill_mask", "id": {id}, "text": "a [MASK]", "deadline_ms": -1}}', True),
    ('{{"type": "teleport", "id": {id}}}', True),
    ("this is not json", False),
    ('{{"type": "fill_mask", "text": "a [MASK]"}}', False),
    # §13: a refused subscription has id null whatever id it holds (and leaves the subscription as it was).
    ('{{"type": "subscribe_stats", "interval_ms": 100, "id": {id}}}', False),
]
#: Refused by the tokenizer's checks after acceptance (§3): a terminal error of an accepted request.
TOO_MANY_TOKENS = "[MASK]" + " a" * 600

Kind = tuple[str, str]  # (outcome, code) as fillmask_requests_total labels it


def kind_of(frame: dict[str, Any]) -> Kind:
    if frame["type"] == "error":
        return "error", frame["code"]
    if frame["type"] == "overloaded":
        return "overloaded", frame["reason"]
    return frame["type"], ""


# --- /metrics over HTTP ----------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(srv: FillMaskServer) -> Samples:
    """Every sample of ``GET /metrics``, keyed by (name, sorted labels)."""

    def get() -> str:
        with urllib.request.urlopen(srv.http_url + "/metrics", timeout=5) as response:
            return response.read().decode()

    text = await asyncio.to_thread(get)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def requests_by_kind(samples: Samples) -> Counter[Kind]:
    found: Counter[Kind] = Counter()
    for (name, labels), value in samples.items():
        if name == "fillmask_requests_total":
            found[dict(labels)["outcome"], dict(labels)["code"]] = int(value)
    return found


def one(samples: Samples, name: str) -> float:
    return samples[(name, ())]


# --- episodes: one subscription each --------------------------------------------------------------------


@dataclass
class StatsFrame:
    at: float  # loop time it was read
    frame: dict[str, Any]
    least_interval_ms: int  # the shortest interval that may have been in force when it was cut

    @property
    def results(self) -> int:
        return round(self.frame["requests_per_s"] * self.frame["window_s"])


@dataclass
class Checkpoint:
    """A frame cut at a quiet point: the server's totals then, and when the marker before it was sent."""

    index: int  # into the episode's frames
    batches: int
    results: int
    marker_sent: float
    connections: int


@dataclass
class Episode:
    client: str
    sent_at: float  # when the subscribe_stats that began it was sent
    batches_at: tuple[int, int]  # the server's count of batches (live figures) at its send and its answer
    results_at: tuple[int, int]
    acked_at: float = 0.0
    frames: list[StatsFrame] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)


# --- one connection -------------------------------------------------------------------------------------


@dataclass
class Client:
    name: str
    ws: ClientConnection
    slow: bool
    reading: asyncio.Event = field(default_factory=asyncio.Event)
    received: Counter[Kind] = field(default_factory=Counter)  # answers about requests and frames
    results: list[dict[str, Any]] = field(default_factory=list)
    awaiting: set[str] = field(default_factory=set)  # ids of frames sent, without their answer yet
    null_owed: int = 0  # errors with id null owed
    null_got: int = 0
    owed: int = 0  # frames sent that are owed exactly one answer
    marked: int = 0  # of those, the ones the server had read at the last marker's answer
    markers: dict[str, int] = field(default_factory=dict)  # marker id -> frames read before its answer
    sent_while_paused: int = 0
    interval: int | None = None  # the subscription as the client last asked for it
    least_interval: int | None = None  # shortest interval that may be in force (a change not yet answered)
    episode: Episode | None = None  # the current one (frames go here), also between unsubscribe and its answer
    unsubscribed_acked: bool = True
    ours: str | None = None  # how the test ended it: close, abort
    lossy: bool = False  # it ended with answers it may not have read
    exact: bool = False  # it ended right after a marker's answer: the server had read all it sent
    close_code: int | None = None
    close_reason: str = ""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.Task[None] | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.ours is None and not self.ended.is_set()

    def owed_now(self) -> int:
        return len(self.awaiting) + self.null_owed - self.null_got

    async def read(self) -> None:
        try:
            while True:
                await self.reading.wait()
                self.on_message(await self.ws.recv())
        except ConnectionClosed as exc:
            if exc.rcvd is not None:
                self.close_code, self.close_reason = exc.rcvd.code, exc.rcvd.reason
            if self.ours is None:
                self.lossy = True  # closed by the server (1008: §12), what it had unsent dropped
            if self.ours is None and self.close_code != 1008:
                self.problems.append(f"{self.name}: the server closed the connection: {exc!r}")
        except Exception as exc:  # a failed check: keep it, end the reader
            self.problems.append(f"{self.name}: {exc!r}")
        finally:
            self.ended.set()

    def on_message(self, message: str | bytes) -> None:
        frame = orjson.loads(message)
        now = asyncio.get_running_loop().time()
        if frame["type"] == "stats":
            if self.episode is None:
                self.problems.append(f"{self.name}: a stats frame without a subscription (or after the "
                                     f"unsubscribe_stats was answered): {frame}")
                return
            least = self.least_interval or self.interval or 0
            self.episode.frames.append(StatsFrame(now, frame, least))
            return
        kind = kind_of(frame)
        self.received[kind] += 1
        if frame.get("id") is None:
            self.null_got += 1
            return
        request_id = frame["id"]
        if request_id in self.markers:
            self.markers[request_id] = self.owed
        self.awaiting.discard(request_id)
        if frame["type"] == "result":
            self.results.append(frame)


# --- the run of one program -----------------------------------------------------------------------------


class Run:
    def __init__(self, srv: FillMaskServer, seed: int) -> None:
        self.srv = srv
        self.rng = random.Random(seed)
        self.clients: list[Client] = []
        self.episodes: list[Episode] = []
        self.problems: list[str] = []
        self.next_id = 0
        self.quiet_points = 0
        self.dropped = 0  # (for the summary: fillmask_requests_total{outcome="dropped"} grew by this)

    def loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    def fresh(self, prefix: str = "r") -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def live(self) -> list[Client]:
        return [c for c in self.clients if c.alive]

    def figures(self) -> tuple[int, int]:
        """The live figures' running totals (batches, results) now."""
        mark = self.srv.stats.mark(0.0)
        return mark.batches, mark.results

    async def open(self, slow: bool) -> Client:
        ws, _ = await open_reader(self.srv.url, self.srv.port, slow, WAIT_S)
        client = Client(f"c{len(self.clients)}{'s' if slow else ''}", ws, slow)
        client.reading.set()
        client.reader = asyncio.create_task(client.read())
        self.clients.append(client)
        return client

    async def send(self, client: Client, data: str, owed: bool = False, null: bool = False) -> None:
        if owed:
            client.owed += 1
        if null:
            client.null_owed += 1
        if not client.reading.is_set():
            client.sent_while_paused += 1
        with contextlib.suppress(ConnectionClosed):  # (closed by the server for not reading: the reader tells)
            await asyncio.wait_for(client.ws.send(data), WAIT_S)

    async def marker(self, client: Client) -> float:
        """Send a frame the server answers at once and wait for its answer: everything sent before it has
        been read by the server. Returns when it was sent."""
        assert client.reading.is_set(), "(a marker's answer is read: the client must be reading)"
        marker_id = self.fresh("sync-")
        client.markers[marker_id] = -1
        client.awaiting.add(marker_id)
        sent = self.loop_time()
        await self.send(client, orjson.dumps({"type": "sync", "id": marker_id}).decode(), owed=True)
        async with asyncio.timeout(WAIT_S):
            while client.markers[marker_id] < 0 and not client.ended.is_set():
                await asyncio.sleep(0.002)
        if client.markers[marker_id] >= 0:
            client.marked = client.markers[marker_id]
        return sent

    # --- steps

    async def step(self) -> None:
        rng = self.rng
        choice = rng.choices(["fill", "bad", "cancel", "subscribe", "unsubscribe", "pause", "resume", "sleep",
                              "close", "abort", "open", "quiet"],
                             weights=[11, 3, 2, 3, 1.5, 1.5, 2, 2, 0.7, 0.5, 1.5, 0.8])[0]
        if choice == "open":
            if len(self.live()) < MAX_CLIENTS:
                await self.open(rng.random() < 0.4)
            return
        if choice == "sleep":
            await asyncio.sleep(rng.choice([0, 0.005, 0.02, 0.08, 0.15, 0.3]))
            return
        if choice == "quiet":
            await self.quiet_point()
            return
        live = self.live()
        client = rng.choice(live) if live else await self.open(False)
        paused = not client.reading.is_set()
        if paused and choice in ("fill", "bad", "cancel") and client.sent_while_paused >= MAX_SENT_WHILE_PAUSED:
            return
        if choice == "fill":
            for _ in range(rng.randint(1, 4)):
                await self.fill(client)
        elif choice == "bad":
            template, under_id = rng.choice(BAD)
            bad_id = self.fresh("bad-")
            if under_id:
                client.awaiting.add(bad_id)
            await self.send(client, template.format(id=orjson.dumps(bad_id).decode()), owed=True, null=not under_id)
        elif choice == "cancel":
            pool = sorted(i for i in client.awaiting if i.startswith("r"))
            target = rng.choice(pool) if pool and rng.random() < 0.85 else self.fresh("nope-")
            await self.send(client, orjson.dumps({"type": "cancel", "id": target}).decode())
        elif choice == "subscribe" and not paused:
            twice = client.interval is not None and rng.random() < 0.3  # subscribed twice, the same interval
            interval = client.interval if twice and client.interval is not None else rng.choice(INTERVALS)
            await self.subscribe(client, interval)
        elif choice == "unsubscribe" and not paused:
            await self.unsubscribe(client)
        elif choice == "pause":
            client.reading.clear()
            client.sent_while_paused = 0
        elif choice == "resume":
            client.reading.set()
        elif choice == "close":
            if not paused:
                for _ in range(rng.randint(0, 3)):  # answers pending when it closes
                    await self.fill(client)
                await self.marker(client)  # the server read everything: its answers are owed exactly
                client.exact = client.alive
            client.ours = "close"
            client.lossy = True  # closed with answers perhaps pending
            await asyncio.wait_for(client.ws.close(), WAIT_S)
            client.reading.set()
        elif choice == "abort":
            if not paused and rng.random() < 0.5:
                await self.marker(client)
                client.exact = client.alive
            client.ours = "abort"
            client.lossy = True
            client.ws.transport.abort()
            client.reading.set()

    async def stall(self) -> None:
        """A slow client (subscribed, or not) stops reading with large answers due for longer than a stats
        interval, perhaps past ``--send-timeout`` (then §12 closes it with 1008, its answers dropped)."""
        rng = self.rng
        client = next((c for c in self.live() if c.slow), None)
        if client is None:
            if len(self.live()) >= MAX_CLIENTS:
                return
            client = await self.open(True)
        client.reading.set()
        if client.interval is None and rng.random() < 0.7:
            await self.subscribe(client, rng.choice(INTERVALS))
        client.reading.clear()
        client.sent_while_paused = 0
        for _ in range(4):
            request_id = self.fresh()
            client.awaiting.add(request_id)
            frame = {"type": "fill_mask", "id": request_id, "text": TEXTS[3], "top_k": 10}
            await self.send(client, orjson.dumps(frame).decode(), owed=True)
        await asyncio.sleep(rng.choice([0.6, 1.0, 1.8]) * TIGHT["send_timeout"])
        client.reading.set()

    async def fill(self, client: Client) -> None:
        rng = self.rng
        request_id = self.fresh()
        frame: dict[str, Any] = {"type": "fill_mask", "id": request_id,
                                 "text": TOO_MANY_TOKENS if rng.random() < 0.05 else rng.choice(TEXTS)}
        if rng.random() < 0.3:
            frame["top_k"] = rng.choice([1, 3, 20])
        if rng.random() < 0.3:
            frame["deadline_ms"] = rng.choice([0.5, 1, 5, 50, 600_000])
        client.awaiting.add(request_id)
        await self.send(client, orjson.dumps(frame).decode(), owed=True)

    async def subscribe(self, client: Client, interval: int) -> None:
        before = self.figures()
        sent = self.loop_time()
        if client.episode is None or client.interval is None:  # a new subscription: a new episode
            episode = Episode(client.name, sent, (before[0], before[0]), (before[1], before[1]))
            self.episodes.append(episode)
            client.episode = episode
            client.least_interval = interval
        else:
            episode = None
            client.least_interval = min(interval, client.interval)
        client.interval = interval
        await self.send(client, orjson.dumps({"type": "subscribe_stats", "interval_ms": interval}).decode())
        await self.marker(client)
        client.least_interval = interval
        if episode is not None:
            after = self.figures()
            episode.batches_at = (before[0], after[0])
            episode.results_at = (before[1], after[1])
            episode.acked_at = self.loop_time()

    async def unsubscribe(self, client: Client) -> None:
        await self.send(client, orjson.dumps({"type": "unsubscribe_stats"}).decode())
        client.interval = None
        await self.marker(client)
        client.episode = None  # a frame from now on is one after the unsubscribe was answered

    async def settle(self) -> None:
        """Every reader resumed; wait (bounded, counted) until the server has nothing left to do and every
        live client has every answer it is owed."""
        for client in self.clients:
            client.reading.set()
        srv = self.srv
        try:
            async with asyncio.timeout(WAIT_S):
                while True:
                    live = self.live()
                    if (srv.settled() and srv.engine.queued() == 0 and srv.in_flight() == 0
                            and all(c.owed_now() == 0 for c in live)
                            and len(srv.connections) == len(live) and srv._connections_held() == len(live)):
                        return
                    await asyncio.sleep(0.005)
        except TimeoutError:
            raise AssertionError(
                f"the server did not settle within {WAIT_S} s: settled {srv.settled()}, queued "
                f"{srv.engine.queued()}, in flight {srv.in_flight()}, connections {len(srv.connections)}/"
                f"{srv._connections_held()} for {len(self.live())} live clients, owed "
                f"{[(c.name, sorted(c.awaiting), c.null_owed - c.null_got) for c in self.live()]}") from None

    async def quiet_point(self) -> None:
        """Settle, then take from each subscriber the first frame cut after a marker (module docstring)."""
        await self.settle()
        self.quiet_points += 1
        engine_batches = self.srv.engine.stats.batches
        batches, results = self.figures()
        if batches != engine_batches:
            self.problems.append(f"settled, the live figures counted {batches} batches, the engine ran "
                                 f"{engine_batches}")
        connections = len(self.srv.connections)

        async def take(client: Client) -> None:
            episode = client.episode
            assert episode is not None and client.interval is not None
            sent = await self.marker(client)
            seen = len(episode.frames)
            try:
                async with asyncio.timeout(client.interval / 1000 + WAIT_S):
                    while len(episode.frames) == seen and client.alive:
                        await asyncio.sleep(0.005)
            except TimeoutError:
                self.problems.append(f"{client.name}: no stats frame within {client.interval} ms + {WAIT_S} s "
                                     "of a marker at a quiet point")
                return
            if len(episode.frames) > seen:
                episode.checkpoints.append(Checkpoint(seen, batches, results, sent, connections))

        await asyncio.gather(*(take(c) for c in self.live() if c.interval is not None))
        samples = await scrape(self.srv)
        if one(samples, "fillmask_queue_depth") != 0 or one(samples, "fillmask_open_connections") != connections:
            self.problems.append(f"quiet point: /metrics says queue depth {one(samples, 'fillmask_queue_depth')}, "
                                 f"{one(samples, 'fillmask_open_connections')} open connections ({connections} open)")

    async def finish(self) -> None:
        """A last quiet point with a subscriber, then everything unsubscribed and closed, read to the end."""
        live = self.live()
        if not live:
            live = [await self.open(False)]
        if not any(c.interval is not None for c in live):
            for client in live:
                client.reading.set()
            await self.subscribe(live[0], self.rng.choice(INTERVALS))
        await self.quiet_point()
        for client in self.live():
            await self.unsubscribe(client)
        await asyncio.sleep(max(INTERVALS) / 1000 + 0.05)  # a frame would come by now: none may
        for client in self.live():
            await self.marker(client)
            client.exact = client.alive
            client.ours = "close"
            await asyncio.wait_for(client.ws.close(), WAIT_S)
            await asyncio.wait_for(client.ended.wait(), WAIT_S)
            if client.close_code != 1000:
                self.problems.append(f"{client.name}: our close was answered {client.close_code}, not 1000")

    async def teardown(self) -> None:
        for client in self.clients:
            if client.ours is None and not client.ended.is_set():
                client.ours = "abort"
                client.lossy = True
                client.ws.transport.abort()
        for client in self.clients:
            if client.reader is not None:
                client.reading.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(client.ended.wait(), WAIT_S)
                client.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await client.reader


# --- the checks ------------------------------------------------------------------------------------------


def check_frame(name: str, f: StatsFrame) -> list[str]:
    """§13's fields, each agreeing with the others."""
    frame, problems = f.frame, []
    window, batches = frame["window_s"], frame["batches"]
    where = f"{name}: frame {frame}"
    if window < f.least_interval_ms / 1000 - 0.002:
        problems.append(f"{where}: a window of {window} s, shorter than the interval {f.least_interval_ms} ms "
                        "(more than one frame per interval)")
    # (requests_per_s is rounded to 0.1, window_s to 1 ms: their product is within this of a whole number)
    if abs(frame["requests_per_s"] * window - f.results) > 0.05 * window + 0.0005 * frame["requests_per_s"] + 0.005:
        problems.append(f"{where}: requests_per_s x window_s is not a whole number of results")
    if (frame["latency_ms"]["p50"] is None) != (f.results == 0) or (
            frame["latency_ms"]["p99"] is None) != (f.results == 0):
        problems.append(f"{where}: latency null where results were sent, or not null where none were")
    ids = [b["batch_id"] for b in batches]
    if len(ids) > MAX_BATCHES_PER_FRAME or ids != list(range(ids[0], ids[0] + len(ids)) if ids else []):
        problems.append(f"{where}: batch ids {ids} are not consecutive (or more than 64)")
    if (frame["batch_size"]["mean"] is None) != (not batches):
        problems.append(f"{where}: batch_size null where batches ran, or not null where none did")
    if batches and len(batches) < MAX_BATCHES_PER_FRAME:  # the whole window's batches: the figures follow
        sizes = [b["size"] for b in batches]
        mean = sum(sizes) / len(sizes)
        if frame["batch_size"]["max"] != max(sizes) or abs(frame["batch_size"]["mean"] - mean) > 0.006:
            problems.append(f"{where}: batch_size {frame['batch_size']} is not that of its batches {sizes}")
        busy = sum(b["inference_ms"] for b in batches) / 1000 / max(window, 1e-9)
        if abs(min(1.0, busy) - frame["engine_busy"]) > 0.002 + 0.002 * busy:
            problems.append(f"{where}: engine_busy {frame['engine_busy']} but its batches ran {busy:.4f} of it")
    elif not batches and frame["engine_busy"] != 0:
        problems.append(f"{where}: engine_busy {frame['engine_busy']} in a window without a batch")
    return problems


def check_episode(episode: Episode) -> list[str]:
    """No gap and no double count over the episode's frames; exact totals at its quiet points."""
    problems: list[str] = []
    name = f"{episode.client} (subscribed at {episode.sent_at:.3f})"
    for f in episode.frames:
        problems += check_frame(name, f)
    last_id: int | None = None  # the last batch reported so far
    first_id: int | None = None
    reported_results = 0
    windows = 0.0
    checkpoints = {c.index: c for c in episode.checkpoints}
    for index, f in enumerate(episode.frames):
        ids = [b["batch_id"] for b in f.frame["batches"]]
        truncated = len(ids) == MAX_BATCHES_PER_FRAME
        if ids:
            expected = last_id + 1 if last_id is not None else None
            if expected is not None and (ids[0] < expected or (ids[0] > expected and not truncated)):
                problems.append(f"{name}: frame {index} lists batches from {ids[0]}, the previous frames up to "
                                f"{last_id}: {'counted twice' if ids[0] < expected else 'a gap'} (§13)")
            if first_id is None:
                first_id = ids[0]
                low, high = episode.batches_at
                if not (low <= first_id - 1 <= high or (truncated and first_id - 1 > high)):
                    problems.append(f"{name}: the first batch reported is {first_id}, but the server had run {low} "
                                    f"when the subscription was sent and {high} when it was answered: the first "
                                    "frame must cover the time since the subscription (§13)")
            last_id = ids[-1]
        reported_results += f.results
        windows += f.frame["window_s"]
        point = checkpoints.get(index)
        if point is None:
            continue
        # Cut at a quiet point: everything since the subscription is in the frames so far, exactly once.
        low, high = episode.batches_at
        if last_id is None:
            if point.batches > high:
                problems.append(f"{name}: at a quiet point the server had run {point.batches} batches, "
                                f"{point.batches - high} since the subscription, and its frames listed none")
        elif last_id != point.batches:
            problems.append(f"{name}: at a quiet point the frames listed batches up to {last_id}, the server had "
                            f"run {point.batches}")
        low_r, high_r = episode.results_at
        if not low_r <= point.results - reported_results <= high_r:
            problems.append(f"{name}: at a quiet point its frames counted {reported_results} results, the server "
                            f"had sent {point.results - high_r} to {point.results - low_r} since the subscription "
                            f"(per frame {[x.results for x in episode.frames[:index + 1]]})")
        tolerance = 0.0006 * (index + 1) + 0.002
        earliest = point.marker_sent - episode.acked_at - tolerance
        latest = f.at - episode.sent_at + tolerance
        if not earliest <= windows <= latest:
            problems.append(f"{name}: its windows add up to {windows:.3f} s at a quiet point, but the time from "
                            f"the subscription to that frame was between {earliest:.3f} and {latest:.3f} s "
                            f"({'overlapping' if windows > latest else 'leaving time out'})")
        frame = f.frame
        if (frame["queue_depth"], frame["in_flight"], frame["connections"]) != (0, 0, point.connections):
            problems.append(f"{name}: at a quiet point the frame says queue_depth {frame['queue_depth']}, in_flight "
                            f"{frame['in_flight']}, connections {frame['connections']} (idle: 0, 0, "
                            f"{point.connections})")
    return problems


def check_results_against_frames(run: Run) -> list[str]:
    """A result's batch figures are its batch's, as the stats frames list it (§4, §13)."""
    batches: dict[int, dict[str, Any]] = {}
    for episode in run.episodes:
        for f in episode.frames:
            for b in f.frame["batches"]:
                if batches.setdefault(b["batch_id"], b) != b:
                    return [f"batch {b['batch_id']} is {b} in one frame and {batches[b['batch_id']]} in another"]
    problems: list[str] = []
    per_batch: Counter[int] = Counter()
    for client in run.clients:
        for result in client.results:
            per_batch[result["batch_id"]] += 1
            b = batches.get(result["batch_id"])
            if b is None:
                continue
            if (b["size"], b["tokens"]) != (result["batch_size"], result["batch_tokens"]) or abs(
                    b["inference_ms"] - result["inference_ms"]) > 0.01:
                problems.append(f"result {result['id']} says batch {result['batch_id']} had {result['batch_size']} "
                                f"requests, {result['batch_tokens']} tokens, {result['inference_ms']} ms; the stats "
                                f"frames say {b}")
    problems += [f"batch {batch_id} of {batches[batch_id]['size']} sent {count} results" for batch_id, count
                 in per_batch.items() if batch_id in batches and count > batches[batch_id]["size"]]
    return problems


def check_metrics(run: Run, before: Samples, after: Samples, engine_before: tuple[int, int, float],
                  figures_before: tuple[int, int]) -> list[str]:
    """§11's table, by counting (module docstring)."""
    srv, problems = run.srv, []
    grown = requests_by_kind(after)
    grown.subtract(requests_by_kind(before))
    received: Counter[Kind] = Counter()
    for client in run.clients:
        received.update(client.received)
    lossy = [c for c in run.clients if c.lossy]
    unread_at_most = sum(c.owed - sum(c.received.values()) for c in lossy)
    owed_low = sum(c.owed if c.exact else c.marked for c in run.clients)
    owed_high = sum(c.owed for c in run.clients)
    total = sum(grown.values())
    if not owed_low <= total <= owed_high:
        problems.append(f"fillmask_requests_total grew by {total}, the frames owed an answer were "
                        f"{owed_low if owed_low == owed_high else f'{owed_low} to {owed_high}'} (§8, §11)")
    for kind in set(grown) | set(received):
        if kind == ("dropped", ""):
            continue
        extra = grown[kind] - received[kind]
        if extra < 0 or (not lossy and extra):
            problems.append(f"fillmask_requests_total{{outcome={kind[0]},code={kind[1]}}} grew by {grown[kind]}, "
                            f"the clients received {received[kind]} such answers")
    dropped = grown["dropped", ""]
    extra_total = sum(max(0, grown[k] - received[k]) for k in grown if k != ("dropped", "")) + dropped
    if extra_total > unread_at_most:
        problems.append(f"{extra_total} answers counted but not received (dropped {dropped}), but the connections "
                        f"that ended early had at most {unread_at_most} answers unread")
    # Batches: the histograms, the engine and the live figures count each batch once.
    batches = srv.engine.stats.batches - engine_before[0]
    rows = srv.engine.stats.rows - engine_before[1]
    figures = run.figures()
    for name in ("fillmask_batch_size_count", "fillmask_batch_tokens_count", "fillmask_inference_seconds_count"):
        if one(after, name) - one(before, name) != batches:
            problems.append(f"{name} grew by {one(after, name) - one(before, name)}, the engine ran {batches} batches")
    if figures[0] - figures_before[0] != batches:
        problems.append(f"the live figures counted {figures[0] - figures_before[0]} batches, the engine ran {batches}")
    for name in ("fillmask_batch_size_sum", "fillmask_queue_wait_seconds_count"):
        if one(after, name) - one(before, name) != rows:
            problems.append(f"{name} grew by {one(after, name) - one(before, name)}, the engine's batches held "
                            f"{rows} requests")
    busy = one(after, "fillmask_engine_busy_seconds_total") - one(before, "fillmask_engine_busy_seconds_total")
    inference = one(after, "fillmask_inference_seconds_sum") - one(before, "fillmask_inference_seconds_sum")
    if abs(busy - inference) > 1e-6 + 1e-6 * inference:
        problems.append(f"fillmask_engine_busy_seconds_total grew by {busy}, fillmask_inference_seconds_sum by "
                        f"{inference}")
    # Results: the live figures count each result handed to a connection; /metrics once it reached the
    # socket (result), or dropped with the connection.
    results = figures[1] - figures_before[1]
    got = received["result", ""]
    if not grown["result", ""] <= results <= grown["result", ""] + dropped or (not lossy and results != got):
        problems.append(f"the live figures counted {results} results; /metrics {grown['result', '']} sent and "
                        f"{dropped} dropped; the clients received {got}")
    # Connections and gauges.
    opened = one(after, "fillmask_connections_total") - one(before, "fillmask_connections_total")
    if opened != len(run.clients):
        problems.append(f"fillmask_connections_total grew by {opened}, the clients opened {len(run.clients)}")
    slow_closed = [c for c in run.clients if c.close_code == 1008 and SLOW_REASON_PART in c.close_reason]
    closed_1008 = one(after, "fillmask_slow_clients_closed_total") - one(before, "fillmask_slow_clients_closed_total")
    if not len(slow_closed) <= closed_1008 <= len(slow_closed) + len(lossy):
        problems.append(f"fillmask_slow_clients_closed_total grew by {closed_1008}, {len(slow_closed)} clients "
                        "saw the 1008 close")
    if one(after, "fillmask_resenders_closed_total") != one(before, "fillmask_resenders_closed_total"):
        problems.append("a client was closed as a resender (these programs send far fewer than 200 early)")
    for name, idle in (("fillmask_queue_depth", 0), ("fillmask_open_connections", 0), ("fillmask_engine_up", 1)):
        if one(after, name) != idle:
            problems.append(f"{name} is {one(after, name)} once the server settled, not {idle}")
    if srv.unsent.total or srv.engine._reserved_total or srv.in_flight() or srv.double_answers:
        problems.append(f"not idle: {srv.unsent.total} answer bytes unsent, {srv.engine._reserved_total} reserved, "
                        f"{srv.in_flight()} in flight, {srv.double_answers} second answers")
    return problems


async def run_example(srv: FillMaskServer, seed: int) -> tuple[Run, list[str]]:
    before = await scrape(srv)
    engine_before = (srv.engine.stats.batches, srv.engine.stats.rows, srv.engine.stats.busy_s)
    run = Run(srv, seed)
    figures_before = run.figures()
    problems: list[str] = []
    try:
        for _ in range(run.rng.randint(1, 3)):
            await run.open(run.rng.random() < 0.4)
        stall_at = run.rng.randrange(STEPS)
        for index in range(STEPS):
            if index == stall_at:
                await run.stall()
            await run.step()
            await asyncio.sleep(run.rng.choice(PACE_S))
        await run.finish()
    finally:
        await run.teardown()
    await wait_for(lambda: srv.settled() and not srv.connections and srv._connections_held() == 0,
                   "the server settled with no connection")
    after = await scrape(srv)
    for client in run.clients:
        problems += client.problems
    problems += run.problems
    for episode in run.episodes:
        problems += check_episode(episode)
    problems += check_results_against_frames(run)
    problems += check_metrics(run, before, after, engine_before, figures_before)
    grown = requests_by_kind(after)
    grown.subtract(requests_by_kind(before))
    run.dropped = grown["dropped", ""]
    return run, problems


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not condition():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S} s: {what}") from None


def summary(run: Run) -> str:
    frames = sum(len(e.frames) for e in run.episodes)
    points = sum(len(e.checkpoints) for e in run.episodes)
    kinds: Counter[Kind] = Counter()
    for client in run.clients:
        kinds.update(client.received)
    return (f"{len(run.clients)} connections, {len(run.episodes)} subscriptions, {frames} stats frames, "
            f"{points} checked at {run.quiet_points} quiet points, {run.dropped} dropped, "
            f"{sum(c.close_code == 1008 for c in run.clients)} closed with 1008, answers {dict(kinds)}")


@pytest.mark.parametrize("example", range(EXAMPLES))
async def test_figures_add_up_to_what_happened(make_server: Callable[..., Any], example: int) -> None:
    seed = BASE_SEED + example
    async with make_server(**TIGHT) as srv:
        assert srv._server is not None
        for listener in srv._server.sockets:  # a slow network: a few answers fill the way to a client
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        started = time.monotonic()
        run, problems = await run_example(srv, seed)
        took = time.monotonic() - started
    if os.environ.get("FIGURES_VERBOSE"):
        print(f"seed {seed}: {summary(run)}, {took:.1f} s")
    assert not problems, (f"seed {seed} (replay: FIGURES_SEED={seed} FIGURES_EXAMPLES=1), {summary(run)}, "
                          f"{took:.1f} s:\n" + "\n".join(problems[:25]))
    assert sum(len(e.checkpoints) for e in run.episodes) >= 1, f"seed {seed}: no frame at a quiet point"

