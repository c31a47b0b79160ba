"""WebSocket load against a running server: closed loop, open loop and an idle single client.

All times are ``time.perf_counter()`` seconds in this process; a request's latency is measured by
the client, from the moment it was sent (closed loop, idle) or *scheduled* (open loop: a sender that
falls behind its schedule adds its lag to the latency instead of hiding it) to the moment its answer
was read. Each phase has a warm-up and a measured window; then every connection is closed (the
server discards what is still queued) and ``settle`` waits for the batch still running.

- Closed loop: ``clients`` connections, each keeping ``in_flight`` requests outstanding: a new one is
  sent as soon as one is answered, until the window ends. Throughput is the rate of answers read in
  the window (see ``_throughput``); latencies are those of the requests answered in the window. Its
  connections have no task of their own (``_TaskFreeConnection``): the answers of one read are kept
  (parsed and recorded after the window) and the requests they free are sent in one write, so the
  load generator, which shares the machine with the server, takes less of it.
- Open loop: Poisson arrivals at ``rate`` req/s for the whole phase, spread round-robin over the
  connections, whatever the server's progress, except that, like any client that follows protocol.md
  §6, a connection sends nothing before an ``overloaded`` answer's ``retry_after_ms`` has passed (a
  server closes a connection that keeps sending early with 1008): a request due meanwhile goes on
  another connection, or waits, its latency counting from when it was due. After the window a
  bounded grace period collects the answers still due. Throughput is the rate of ``result`` answers
  read in the window; latencies are those of the requests *scheduled* in the window, where a request
  still unanswered at the end of the grace period counts as infinitely late (so percentiles never
  hide it), and ``overloaded`` answers are counted apart, not as latencies.
- Idle: one connection, one request at a time.

``Client`` is the one client of bench/ and scripts/ (``scripts/soak.py``, ``scripts/reliability.py``)
besides the closed loop's connections: a connection that sends the corpus and records every answer in a
``Recorder``, both through ``Requests`` as the closed loop does. Its ``Policy`` is how it treats the
server beyond that: back off as told (the default) or ignore it, read at a given rate, or never read,
so that scripts can play the clients that break the rules on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

ROOT = Path(__file__).resolve().parent.parent
RESULT, OVERLOADED, ERROR, OTHER = "result", "overloaded", "error", "other"
BURST_GAP_S = 0.005  # answers closer than this belong to one burst (one batch, read back to back)
EDGE_PERIODS = 1.5  # a window edge this many burst periods from the nearest answer is a stall, not a phase


@dataclass
class Recorder:
    """Every request of a phase, in parallel lists (cheap appends on the hot path)."""

    sent: list[float] = field(default_factory=list)
    done: list[float] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)
    batch_size: list[int] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    inference_ms: list[float] = field(default_factory=list)
    batch_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the request text's own token count (0: unknown)
    error_codes: Counter[str] = field(default_factory=Counter)
    strays: list[str] = field(default_factory=list)  # frames for no pending request: a second answer, no id

    def add(self, sent: float, tokens: int = 0) -> int:
        self.sent.append(sent)
        self.tokens.append(tokens)
        self.batch_tokens.append(0)
        self.done.append(math.inf)
        self.kind.append("")
        self.batch_size.append(0)
        self.queue_ms.append(math.nan)
        self.inference_ms.append(math.nan)
        return len(self.sent) - 1

    def answer(self, index: int, now: float, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        self.done[index] = now
        if kind == RESULT:
            self.kind[index] = RESULT
            self.batch_size[index] = int(frame.get("batch_size", 0))
            self.batch_tokens[index] = int(frame.get("batch_tokens", 0))
            self.queue_ms[index] = float(frame.get("queue_ms", math.nan))
            self.inference_ms[index] = float(frame.get("inference_ms", math.nan))
        elif kind == OVERLOADED:
            self.kind[index] = OVERLOADED
            self.error_codes[f"{frame.get('status')} {frame.get('reason')}"] += 1
        elif kind == ERROR:
            self.kind[index] = ERROR
            self.error_codes[str(frame.get("code"))] += 1
        else:
            self.kind[index] = OTHER
            self.error_codes[str(kind)] += 1


@dataclass(frozen=True, slots=True)
class Policy:
    """How a ``Client`` treats the server beyond sending (the hooks of the scripts' misbehaving clients).

    - ``backoff``: after an ``overloaded`` answer, send nothing before its ``retry_after_ms`` has passed
      (protocol.md §6; ``Client.wait_until_allowed``). False: resend at once, as a client that ignores
      the protocol does (the server closes it with 1008, §12).
    - ``read_bytes_per_s``: read answers no faster than this (a slow reader: after each answer,
      ``read_one`` waits its size divided by the rate). None: as fast as they come.
    - ``reads``: False: never read (``read_one`` waits until cancelled), so the answers pile up on the
      server.
    """

    backoff: bool = True
    read_bytes_per_s: float | None = None
    reads: bool = True


POLITE = Policy()


class Requests:
    """What one connection sends and what its answers say, without I/O: the ids, frames and records of its
    requests. It walks the corpus from its own offset (so that concurrent connections send different
    texts and none sends the same text twice in a row); ``fields`` go in every request besides its id and
    text (``top_k``, say); ids are 0, 1, 2, ... per connection. ``Client`` (websockets' asyncio
    connection, with policies) and the closed loop's ``_TaskFreeConnection`` both send through it, so
    every load records its answers the same way."""

    def __init__(self, texts: list[str], offset: int, recorder: Recorder,
                 token_counts: Sequence[int] | None = None, fields: dict[str, Any] | None = None) -> None:
        self.texts = texts
        self.token_counts = token_counts
        self.offset = offset
        self.recorder = recorder
        self.fields = fields or {}
        self.pending: dict[int, int] = {}  # request id -> its index in the recorder
        self.next_id = 0
        self.hold_until = 0.0  # after an overloaded answer: send nothing before its retry_after_ms (§6)

    def next_frame(self, sent: float, extra: dict[str, Any] | None = None) -> tuple[bytes, int]:
        """The next request's frame (with ``extra`` fields for it alone), recorded as sent at ``sent``;
        and its index in the recorder."""
        request_id = self.next_id
        self.next_id += 1
        index = (self.offset + request_id) % len(self.texts)
        body = {"type": "fill_mask", "id": request_id, "text": self.texts[index], **self.fields}
        tokens = self.token_counts[index] if self.token_counts else 0
        entry = self.pending[request_id] = self.recorder.add(sent, tokens)
        return orjson.dumps({**body, **extra} if extra else body), entry

    def answered(self, raw: bytes, now: float) -> dict[str, Any]:
        """Record the answer ``raw`` read at ``now`` (a frame for no pending request is a stray) and
        return it parsed; an ``overloaded`` answer moves ``hold_until``."""
        frame = orjson.loads(raw)
        index = self.pending.pop(frame.get("id"), None)  # type: ignore[arg-type]
        if index is not None:
            self.recorder.answer(index, now, frame)
        else:
            self.recorder.strays.append(raw[:120].decode(errors="replace"))
        retry_after_ms = frame.get("retry_after_ms") if frame.get("type") == OVERLOADED else None
        if isinstance(retry_after_ms, int | float):
            self.hold_until = max(self.hold_until, now + retry_after_ms / 1000)
        return frame


class Client(Requests):
    """One WebSocket connection (websockets' asyncio client) sending ``Requests``, with a ``Policy``."""

    def __init__(self, ws: ClientConnection, texts: list[str], offset: int, recorder: Recorder,
                 token_counts: Sequence[int] | None = None, policy: Policy = POLITE,
                 fields: dict[str, Any] | None = None) -> None:
        super().__init__(texts, offset, recorder, token_counts, fields)
        self.ws = ws
        self.policy = policy
        self.closed_by_server: int | None = None  # the close code, once the server closed the connection

    async def send(self, scheduled: float | None = None, extra: dict[str, Any] | None = None) -> int:
        """Send the next text (with ``extra`` fields for this request alone); its latency counts from
        ``scheduled`` (default: now). Returns its index in the recorder."""
        frame, entry = self.next_frame(time.perf_counter() if scheduled is None else scheduled, extra)
        await self.ws.send(frame, text=True)
        return entry

    async def read_one(self) -> dict[str, Any]:
        """Read the next answer, record it and return it (raises ConnectionClosed at the end)."""
        if not self.policy.reads:
            await asyncio.Future()  # never: a client that does not read
        raw = await self.ws.recv(decode=False)
        frame = self.answered(raw, time.perf_counter())
        if self.policy.read_bytes_per_s:
            await asyncio.sleep(len(raw) / self.policy.read_bytes_per_s)
        return frame

    def closed_by(self, closed: ConnectionClosed) -> None:
        """Record that the server closed this connection (1006 when no close frame came)."""
        self.closed_by_server = closed.rcvd.code if closed.rcvd is not None else 1006

    async def wait_until_allowed(self) -> None:
        """Return once this connection may send again: it waits as an overloaded answer said, unless
        its policy ignores back-off."""
        delay = self.hold_until - time.perf_counter()
        if delay > 0 and self.policy.backoff:
            await asyncio.sleep(delay)


async def open_client(url: str, texts: list[str], recorder: Recorder, offset: int = 0,
                      token_counts: Sequence[int] | None = None, policy: Policy = POLITE,
                      fields: dict[str, Any] | None = None) -> Client:
    """Open one connection and read its hello."""
    ws = await connect(url, max_size=None, compression=None, ping_interval=None, close_timeout=2, open_timeout=30)
    hello = orjson.loads(await asyncio.wait_for(ws.recv(decode=False), 30))
    if hello.get("type") != "hello":
        raise RuntimeError(f"expected hello, got {hello!r}")
    return Client(ws, texts, offset, recorder, token_counts, policy, fields)


def _offset(i: int, n: int, texts: list[str]) -> int:
    """Where the ``i``-th of ``n`` connections starts in ``texts``: evenly apart."""
    return (i * len(texts)) // n


async def open_clients(url: str, n: int, texts: list[str], recorder: Recorder,
                       token_counts: Sequence[int] | None = None, policy: Policy = POLITE,
                       fields: dict[str, Any] | None = None) -> list[Client]:
    """Open ``n`` connections concurrently, each starting at its own offset in ``texts``."""
    return list(await asyncio.gather(*(open_client(url, texts, recorder, _offset(i, n, texts), token_counts,
                                                   policy, fields) for i in range(n))))


async def close_all(clients: list[Client]) -> None:
    """Close every connection (at most 3 s each; then the socket is dropped)."""

    async def close(client: Client) -> None:
        try:
            await asyncio.wait_for(client.ws.close(), 3)
        except (TimeoutError, ConnectionClosed, OSError):
            client.ws.transport.abort()

    await asyncio.gather(*(close(c) for c in clients), return_exceptions=True)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of ``values`` (``inf`` values sort last)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    if math.isinf(ordered[high]):
        return math.inf
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _latency_summary(latencies_ms: list[float]) -> dict[str, float]:
    finite = [v for v in latencies_ms if math.isfinite(v)]
    return {
        "p50": percentile(latencies_ms, 50), "p95": percentile(latencies_ms, 95),
        "p99": percentile(latencies_ms, 99), "mean": statistics.fmean(finite) if finite else math.nan,
        "max": max(latencies_ms) if latencies_ms else math.nan, "n": len(latencies_ms),
    }


def summarize(recorder: Recorder, window: tuple[float, float], by_schedule: bool) -> dict[str, Any]:
    """Metrics of one phase over ``window`` (see the module docstring for what each mode counts)."""
    start, end = window
    duration = end - start
    n = len(recorder.sent)
    answered_in_window = [i for i in range(n) if start <= recorder.done[i] <= end]
    results_in_window = [i for i in answered_in_window if recorder.kind[i] == RESULT]
    if by_schedule:
        chosen = [i for i in range(n) if start <= recorder.sent[i] < end]
        sample = [i for i in chosen if recorder.kind[i] in (RESULT, "")]
    else:
        chosen = answered_in_window
        sample = results_in_window
    latencies = [(recorder.done[i] - recorder.sent[i]) * 1000 for i in sample]
    overloaded = sum(1 for i in chosen if recorder.kind[i] == OVERLOADED)
    errors = sum(1 for i in chosen if recorder.kind[i] in (ERROR, OTHER))
    unanswered = sum(1 for i in chosen if recorder.kind[i] == "")
    results = [i for i in sample if recorder.kind[i] == RESULT]
    sizes = [recorder.batch_size[i] for i in results]
    overheads = [(recorder.done[i] - recorder.sent[i]) * 1000 - recorder.queue_ms[i] - recorder.inference_ms[i]
                 for i in results]
    histogram = Counter(sizes)
    known = [i for i in results if recorder.tokens[i] and recorder.batch_tokens[i] and recorder.batch_size[i]]
    padded_per_row = sum(recorder.batch_tokens[i] / recorder.batch_size[i] for i in known)
    return {
        "window_s": round(duration, 3),
        "requests": len(chosen),
        "results": len(results),
        "throughput_rps": _throughput(sorted(recorder.done[i] for i in results_in_window), window),
        "latency_ms": _latency_summary(latencies),
        "overloaded": overloaded,
        "overloaded_share": overloaded / len(chosen) if chosen else 0.0,
        "errors": errors,
        "unanswered": unanswered,
        "answer_codes": dict(recorder.error_codes),
        "batch": {
            # per batch: requests / number of batches (a batch of b rows is seen b times)
            "mean_rows_per_batch": len(sizes) / sum(1 / s for s in sizes) if sizes and min(sizes) > 0 else math.nan,
            "request_weighted_mean": statistics.fmean(sizes) if sizes else math.nan,
            "p50": percentile([float(s) for s in sizes], 50),
            "max": max(sizes) if sizes else 0,
            "histogram": {str(k): histogram[k] for k in sorted(histogram)},
            # the requests' own tokens over the padded tokens of their rows: 1.0 = no padding
            "useful_token_share": sum(recorder.tokens[i] for i in known) / padded_per_row if known else math.nan,
        },
        "server_ms": {
            "queue_p50": percentile([recorder.queue_ms[i] for i in results], 50),
            "inference_p50": percentile([recorder.inference_ms[i] for i in results], 50),
            "queue_mean": statistics.fmean([recorder.queue_ms[i] for i in results]) if results else math.nan,
            "inference_mean": statistics.fmean([recorder.inference_ms[i] for i in results]) if results else math.nan,
            # client latency minus queue and inference: sockets, JSON, both event loops
            "overhead_p50": percentile(overheads, 50),
        },
    }


def _throughput(done: list[float], window: tuple[float, float]) -> float:
    """Answers per second in ``window`` (``done``: sorted answer times inside it).

    Answers arrive in bursts, one per batch; with few, large batches (a base-sized model) a plain
    count over the window is quantised by whether a burst falls just inside or just outside it. So
    when the window holds at least 5 bursts and neither of its edges is further from the nearest
    answer than ``EDGE_PERIODS`` times the mean time between bursts, the rate is measured from the
    first burst to the last: the answers after the first burst divided by the time between them.
    Otherwise count / window: a server that stalls at either edge is charged for the stall.
    """
    duration = window[1] - window[0]
    if not done or duration <= 0:
        return 0.0 if duration > 0 else math.nan
    bursts = 1 + sum(1 for a, b in itertools.pairwise(done) if b - a > BURST_GAP_S)
    span = done[-1] - done[0]
    edge = max(done[0] - window[0], window[1] - done[-1])
    if bursts >= 5 and span > 0 and edge <= EDGE_PERIODS * span / (bursts - 1):
        first_burst = 1 + next((i for i, (a, b) in enumerate(itertools.pairwise(done)) if b - a > BURST_GAP_S),
                               len(done) - 1)
        return (len(done) - first_burst) / span
    return len(done) / duration


async def settle(url: str, timeout: float = 120.0) -> float:
    """Send one request on a fresh connection and wait for its answer: returns once the engine has
    finished whatever batch was running (a barrier between phases). Returns the seconds it took."""
    recorder = Recorder()
    t0 = time.perf_counter()
    (conn,) = await open_clients(url, 1, ["Settle the [MASK] now."], recorder)
    try:
        await conn.send()
        await asyncio.wait_for(conn.read_one(), timeout)
    finally:
        await close_all([conn])
    return time.perf_counter() - t0


async def _read_forever(client: Client) -> None:
    """Read answers until cancelled or the connection closes (the open loop's readers)."""
    try:
        while True:
            await client.read_one()
    except ConnectionClosed as closed:
        client.closed_by(closed)


async def _drain(conns: list[Client], readers: list[asyncio.Task[None]], grace_s: float) -> None:
    """Wait (at most ``grace_s``) until no request is pending, then stop the readers."""
    give_up = time.perf_counter() + grace_s
    while any(c.pending and c.closed_by_server is None for c in conns) and time.perf_counter() < give_up:
        await asyncio.sleep(0.01)
    await _stop_tasks(readers)


async def _stop_tasks(tasks: Sequence[asyncio.Task[Any] | None]) -> None:
    """Cancel the tasks still running and wait for them (idempotent)."""
    live = [task for task in tasks if task is not None and not task.done()]
    for task in live:
        task.cancel()
    await asyncio.gather(*live, return_exceptions=True)


class _TaskFreeConnection(asyncio.Protocol):
    """One connection of the closed loop without a task of its own: websockets' sans-I/O client protocol
    on an asyncio transport, sending ``Requests``.

    Each read takes every answer it holds and, until the window ends (``start``), sends one new request
    per answer (after an ``overloaded`` answer, once its ``retry_after_ms`` has passed, §6); the requests
    one read frees leave in one write. An answer is kept as its bytes and the time it was read, and
    parsed and recorded after the window (``record``), except one that may be ``overloaded``, which is
    parsed at once for its ``retry_after_ms``. A ``Client`` spends a task step and a write on every
    answer and every request, and parses each as it comes; this spends neither during the window, so
    less of the machine the server shares with its load goes to the load. The server sees the same
    frames, masked with a fresh random key each, as from any client.
    """

    def __init__(self, url: str, requests: Requests) -> None:
        self.protocol = ClientProtocol(parse_uri(url), max_size=None)
        self.requests = requests
        self.transport: asyncio.Transport | None = None
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future[None] = loop.create_future()  # the hello was read
        self.lost: asyncio.Future[None] = loop.create_future()
        self.until = -math.inf  # answers read before this time are recorded and each sends the next request
        self.closed_by_server: int | None = None
        self._closing = False  # this side started the close
        self._fragments: list[bytes] = []
        self._binary = False  # the message being read is binary
        self._unrecorded: list[tuple[bytes, float]] = []  # answers read and not yet parsed: (bytes, when)
        self._owed = 0  # requests to send once ``hold_until`` has passed
        self._resume: asyncio.TimerHandle | None = None

    def start(self, in_flight: int, until: float) -> None:
        """Send ``in_flight`` requests now; record each answer read before ``until`` (perf_counter time)
        and send one more for it. Later answers are neither recorded nor answered with a request."""
        self.until = until
        self._owed += in_flight
        self._send_owed()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.protocol.send_request(self.protocol.connect())
        self._flush()

    def data_received(self, data: bytes) -> None:
        self.protocol.receive_data(data)
        now = time.perf_counter()
        for event in self.protocol.events_received():
            if isinstance(event, Frame) and event.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                if event.opcode is not Opcode.CONT:
                    self._binary = event.opcode is Opcode.BINARY  # (the server sends text only)
                self._fragments.append(event.data)
                if event.fin:
                    raw = b"".join(self._fragments)
                    self._fragments.clear()
                    if not self._binary:
                        self._message(raw, now)
        if self.protocol.handshake_exc is not None and not self.opened.done():
            self.opened.set_exception(self.protocol.handshake_exc)
        self._note_close()
        self._send_owed()

    def _note_close(self) -> None:
        """Record the code of a close the server started (its close frame came before ours went)."""
        close = self.protocol.close_rcvd
        if close is not None and self.closed_by_server is None and self.protocol.close_rcvd_then_sent:
            self.closed_by_server = close.code

    def _message(self, raw: bytes, now: float) -> None:
        if not self.opened.done():
            hello = orjson.loads(raw)
            if hello.get("type") == "hello":
                self.opened.set_result(None)
            else:
                self.opened.set_exception(RuntimeError(f"expected hello, got {hello!r}"))
            return
        if now < self.until:
            if b"overloaded" in raw:  # (a result that merely holds the word is parsed early: no harm)
                self.requests.answered(raw, now)
            else:
                self._unrecorded.append((raw, now))
            self._owed += 1

    def record(self) -> None:
        """Parse and record the answers kept so far, in the order they were read."""
        for raw, when in self._unrecorded:
            self.requests.answered(raw, when)
        self._unrecorded.clear()

    def _send_owed(self) -> None:
        """Send the requests owed, unless an overloaded answer says to wait (then a timer comes back)."""
        if self._owed and self._resume is None and self.protocol.state is State.OPEN:
            now = time.perf_counter()
            if self.requests.hold_until > now:
                self._resume = asyncio.get_running_loop().call_later(self.requests.hold_until - now, self._resumed)
            else:
                for _ in range(self._owed):
                    self.protocol.send_text(self.requests.next_frame(now)[0])
                self._owed = 0
        self._flush()

    def _resumed(self) -> None:
        self._resume = None
        self._send_owed()

    def _flush(self) -> None:
        """Everything websockets has to send in one write (it gives one chunk per frame); an empty
        chunk, last, is its end of stream."""
        chunks = self.protocol.data_to_send()
        data = b"".join(chunks)
        if data:
            self.transport.write(data)  # type: ignore[union-attr]
        if chunks and not chunks[-1] and self.transport.can_write_eof():  # type: ignore[union-attr]
            self.transport.write_eof()  # type: ignore[union-attr]

    def eof_received(self) -> None:
        self.protocol.receive_eof()
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocol.receive_eof()  # idempotent: the state is CLOSED from here
        self._note_close()
        if self.closed_by_server is None and not self._closing:
            self.closed_by_server = 1006  # no close frame came
        if self._resume is not None:
            self._resume.cancel()
        if not self.opened.done():
            self.opened.set_exception(ConnectionError("the connection closed before the hello"))
        self.lost.set_result(None)

    async def close(self, timeout_s: float = 3.0) -> None:
        """Close with 1000 and wait (at most ``timeout_s``) for the server to end the connection."""
        self._closing = True
        self.until = -math.inf
        self.record()
        if self.transport is None or self.lost.done():
            return
        if self.protocol.state is State.OPEN:
            self.protocol.send_close(1000)
            self._flush()
        try:
            await asyncio.wait_for(asyncio.shield(self.lost), timeout_s)
        except TimeoutError:
            self.transport.abort()


async def _open_task_free(url: str, n: int, texts: list[str], recorder: Recorder,
                          token_counts: Sequence[int] | None) -> list[_TaskFreeConnection]:
    """Open ``n`` task-free connections concurrently (each at its own offset in ``texts``) and read their hellos."""
    uri = parse_uri(url)
    if uri.secure:
        raise ValueError("the closed loop speaks ws:// only")
    loop = asyncio.get_running_loop()

    async def one(i: int) -> _TaskFreeConnection:
        requests = Requests(texts, _offset(i, n, texts), recorder, token_counts)
        _, conn = await asyncio.wait_for(loop.create_connection(lambda: _TaskFreeConnection(url, requests),
                                                                uri.host, uri.port), 30)
        conn.opened.add_done_callback(lambda opened: opened.cancelled() or opened.exception())  # (read once)
        try:
            await asyncio.wait_for(asyncio.shield(conn.opened), 30)
        except BaseException:
            if conn.transport is not None:
                conn.transport.abort()
            raise
        return conn

    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    conns = [conn for conn in results if isinstance(conn, _TaskFreeConnection)]
    failure = next((exc for exc in results if isinstance(exc, BaseException)), None)
    if failure is not None:
        await asyncio.gather(*(conn.close() for conn in conns))
        raise failure
    return conns


def _closes(conns: Sequence[Client | _TaskFreeConnection]) -> dict[str, int]:
    """How many connections the server closed, by close code (1006: with no close frame)."""
    return dict(Counter(str(c.closed_by_server) for c in conns if c.closed_by_server is not None))


async def closed_loop(url: str, texts: list[str], clients: int, in_flight: int, warmup_s: float, duration_s: float,
                      on_window: Any = None, token_counts: Sequence[int] | None = None,
                      recorder: Recorder | None = None) -> dict[str, Any]:
    """Closed loop: ``clients`` connections each keeping ``in_flight`` requests outstanding.

    Only answers read inside the window count, so the requests still in flight when it ends are not
    waited for: the connections close and the server discards what is queued (call ``settle`` next).
    The connections are ``_TaskFreeConnection``\\ s: the load takes as little of the machine as it can.

    ``on_window`` (optional) is an async callable started when the measured window opens, e.g. the
    ``/healthz`` prober; its return value lands in the summary under ``"during_window"``. ``recorder``
    (optional) is where every answer is recorded, for a caller that looks at the batches themselves; the
    summary's ``"window"`` (perf_counter seconds) is the span its figures count.
    """
    recorder = recorder if recorder is not None else Recorder()
    conns = await _open_task_free(url, clients, texts, recorder, token_counts)
    side_task: asyncio.Task[Any] | None = None
    try:
        t0 = time.perf_counter()
        window = (t0 + warmup_s, t0 + warmup_s + duration_s)
        for conn in conns:
            conn.start(in_flight, window[1])
        await asyncio.sleep(max(0.0, window[0] - time.perf_counter()))
        if on_window is not None:
            side_task = asyncio.create_task(on_window())
        await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
        for conn in conns:
            conn.record()
        summary = summarize(recorder, window, by_schedule=False)
        if side_task is not None:
            summary["during_window"] = await asyncio.wait_for(side_task, duration_s + 30)
    finally:
        await _stop_tasks([side_task])
        await asyncio.gather(*(conn.close() for conn in conns))
    summary.update({"mode": "closed", "clients": clients, "in_flight": in_flight,
                    "closed_by_server": _closes(conns), "window": window})
    return summary


async def open_loop(url: str, texts: list[str], clients: int, rate: float, warmup_s: float, duration_s: float,
                    grace_s: float = 10.0, seed: int = 0, token_counts: Sequence[int] | None = None) -> dict[str, Any]:
    """Open loop: Poisson arrivals at ``rate`` req/s over ``clients`` connections for warm-up + window."""
    recorder = Recorder()
    conns = await open_clients(url, clients, texts, recorder, token_counts)
    rng = random.Random(seed)
    max_lag = 0.0
    readers: list[asyncio.Task[None]] = []
    try:
        readers = [asyncio.create_task(_read_forever(c)) for c in conns]
        t0 = time.perf_counter()
        window = (t0 + warmup_s, t0 + warmup_s + duration_s)
        due = t0
        i = 0
        while True:
            due += rng.expovariate(rate)
            if due >= window[1]:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                max_lag = max(max_lag, -delay)
            # Round-robin over the connections that may send; when every one waits out a retry_after_ms,
            # the request waits too, and its latency counts from when it was due.
            live = [c for c in conns if c.closed_by_server is None]
            if not live:
                break
            allowed = [c for c in live if c.hold_until <= time.perf_counter()]
            conn = allowed[i % len(allowed)] if allowed else min(live, key=lambda c: c.hold_until)
            await conn.wait_until_allowed()
            try:
                await conn.send(scheduled=due)
            except ConnectionClosed as closed:
                # A client that falls behind reading its overloaded answers sends early without knowing
                # it, and the server closes it with 1008 (§6): the rest of the load goes on the others,
                # and the requests it had in flight count as unanswered.
                conn.closed_by(closed)
            i += 1
        await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
        await _drain(conns, readers, grace_s)
        summary = summarize(recorder, window, by_schedule=True)
    finally:
        await _stop_tasks(readers)
        await close_all(conns)
    summary.update({"mode": "open", "clients": clients, "rate_rps": rate, "send_lag_max_ms": max_lag * 1000,
                    "closed_by_server": _closes(conns)})
    return summary


async def idle_single(url: str, texts: list[str], n: int, warmup: int = 10,
                      token_counts: Sequence[int] | None = None) -> dict[str, Any]:
    """One connection, one request at a time: ``warmup`` unmeasured requests, then ``n`` measured."""
    recorder = Recorder()
    (conn,) = await open_clients(url, 1, texts, recorder, token_counts)
    try:
        for _ in range(warmup):
            await conn.send()
            await asyncio.wait_for(conn.read_one(), 30)
        first = len(recorder.sent)
        start = time.perf_counter()
        for _ in range(n):
            await conn.send()
            await asyncio.wait_for(conn.read_one(), 30)
        end = time.perf_counter()
    finally:
        await close_all([conn])
    measured = Recorder(recorder.sent[first:], recorder.done[first:], recorder.kind[first:],
                        recorder.batch_size[first:], recorder.queue_ms[first:], recorder.inference_ms[first:],
                        recorder.batch_tokens[first:], recorder.tokens[first:], recorder.error_codes)
    summary = summarize(measured, (start, end), by_schedule=False)
    summary.update({"mode": "idle", "clients": 1, "in_flight": 1})
    return summary


async def run_probe(port: int, duration_s: float, interval_s: float = 0.02) -> dict[str, Any]:
    """Run ``bench.probe`` as a child process for ``duration_s`` and return its summary."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.probe", "--port", str(port), "--interval", str(interval_s),
        "--duration", str(duration_s), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=str(ROOT))
    try:
        out, err = await asyncio.wait_for(process.communicate(), duration_s + 30)
    except TimeoutError:
        return {"error": "probe timed out"}
    finally:
        if process.returncode is None:  # timed out or cancelled: never leave the prober running
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    if process.returncode != 0:
        return {"error": err.decode(errors="replace")[-500:]}
    raw = orjson.loads(out.splitlines()[-1])
    latencies = raw["latencies_ms"]
    return {
        "ticks": len(latencies) + raw["failures"],  # (each a probe sent, or one a slow probe overran)
        "failures": raw["failures"],
        "skipped_ticks": raw["skipped"],
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies + [math.inf] * raw["failures"], 99),
        "max_ms": max(latencies) if latencies else math.nan,
    }
