"""Churn soak: connections that come and go with every kind of frame, and the server's resources when quiet.

    .venv/bin/python scripts/churn_soak.py --duration 60   # models/tiny, default flags
    .venv/bin/python scripts/churn_soak.py --duration 2400 --model models/base
    # bfloat16 on a CPU: oneDNN's kernel caches grow to their caps (README, "Fast modes"); set lower ones
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=256 LRU_CACHE_CAPACITY=256 \
        .venv/bin/python scripts/churn_soak.py --duration 600 --server-flags "--dtype bfloat16"

It starts ``ws_server.py`` (``bench.server_proc.ServerProcess``) and runs waves of visitors, each wave
followed by a quiet spell. A wave keeps a number of visitors chosen for it (1 to ``--visitors``) going for
``--wave-s`` seconds: a visitor opens a connection, sends 1 to 40 frames a few milliseconds apart (and
now and then a ``subscribe_stats``) and leaves, and another takes its place. Its frames: requests of 1 to
60 words with 1 to 3 masks, ``top_k`` from 1 to 50, some with ``targets``, some with deadlines of 0.5 to
10 ms (mostly missed: 504s), all within ``hello.limits``; cancels of requests in flight (or of none); an
id in flight sent again (``duplicate_id``); and sixteen kinds of frame the server must refuse, each with
the error code it provokes. It keeps ``retry_after_ms`` as a well-behaved client does. It leaves in one of
four ways: it waits for every answer and closes; or, with whatever is in flight, it sends a close frame,
resets the TCP connection, or half-closes it (protocol.md §8).

The checks (exit status 1 if any fails, each printed):

- On every connection (``Ledger``): no answer twice, none for an id not in flight; a request's answer is
  a result, a cancel's ``cancelled``, a 503 ``queue_full`` or 429 ``queue_share`` with its
  ``retry_after_ms``, a 504 only with a deadline, an error only for its size where the limits allow it;
  a refused frame gets the error it was sent to provoke; an id sent again a ``duplicate_id`` error beside
  the first request's answer, or, read after that answer, an answer of its own (§3 to §8). The server
  neither refuses nor ends a connection (the visitors break no rule). Where the visitor waited, nothing
  is left unanswered after 60 s; where it cut, the connection ends within 30 s.
- At each quiet spell: the server's live figures (§13) say nothing is queued or in flight and one
  connection is open (the probe's); its open file descriptors are as at the first spell, its threads as
  at the first with the same layout (torch threads and parts, which the server retunes while serving),
  and its resident memory within ``--rss-bound-mb`` of the first's.
- At the end: ``/metrics`` counted, under each label, at least the answers received with it, and no more
  in all than the frames sent to be answered (§11: a frame sent just before a cut may never be read);
  ``/readyz`` 200; no WARNING, ERROR or traceback in the server's log after its start, its drain
  included; exit status 0 on SIGTERM.

The load runs no model code. The checks are pure (``Ledger``, ``quiet_failures``, ``final_failures``);
``tests/test_hardening_soak.py`` shows each can fail, and runs the whole for a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import socket
import struct
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.server_proc import ServerProcess, ServerStartError, rss_mb  # noqa: E402

VOCABULARY = ("the old library on the corner of square took a dusty book from top shelf and sat down by window to "
              "read until light was gone committee met on tuesday morning discuss new bridge which had been delayed "
              "twice because storms shortage steel every summer family drove coast rented small house near spent "
              "long evenings playing cards listening radio paris is capital france")
WORDS = tuple(VOCABULARY.split())
TARGETS = ("the", "a", "capital", "city", "book", "river", "music")
#: The four ways a visitor leaves: waiting for every answer, then a close; or, with whatever is in flight,
#: a close frame, a TCP reset, or a half-close (the weights are how often each is drawn).
LEAVES = {"wait": 5, "close": 1, "reset": 1, "half-close": 1}
#: The refusals of a load that keeps its back-off (§6), by reason: their status.
BUSY = {"queue_full": 503, "queue_share": 429}
REQUEST = "request"
#: Due under an id sent again while in flight, once the first request's answer came: a ``duplicate_id``
#: error, or (read by the server after that answer) an answer of its own.
AGAIN = "again"
#: Seconds a visitor waits for what is due, and for the server to end a connection it cut.
ANSWER_WAIT_S = 60.0
END_WAIT_S = 30.0


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def label(frame: dict[str, Any]) -> tuple[str, str]:
    """The ``fillmask_requests_total`` labels (outcome, code) an answer is counted under (§11)."""
    kind = str(frame.get("type"))
    return kind, str(frame.get("code") or "") if kind == "error" else str(frame.get("reason") or "")


@dataclass(frozen=True)
class Terms:
    """What a request may be answered besides a result: a refusal for its size (only where the limits
    allow one: the load does not know the model's tokenizer), and a 504 (only with a deadline)."""

    refusals: frozenset[str] = frozenset()
    deadline: bool = False


@dataclass
class Ledger:
    """What one connection was sent, what came back, and what broke protocol.md §8 on it.

    Invariant: an id is in ``due`` from the frame that expects an answer under it until that answer
    (``REQUEST`` for an accepted request's terminal frame, ``AGAIN`` for a frame sent again under it,
    else the error code a refused frame should get); ``duplicates`` and ``unnamed`` count the errors
    still due that answer no request (a ``duplicate_id`` by id, an error with id null by code).
    Anything received that nothing is due for is a problem, and so, on a connection whose visitor
    waited, is anything still due at its end."""

    due: dict[Any, str] = field(default_factory=dict)
    terms: dict[Any, Terms] = field(default_factory=dict)
    duplicates: Counter[Any] = field(default_factory=Counter)
    unnamed: Counter[str] = field(default_factory=Counter)
    cancels: set[Any] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    sent: int = 0  # frames the server answers (§11 counts each once)
    received: Counter[tuple[str, str]] = field(default_factory=Counter)  # answers, by their §11 labels

    def request(self, request_id: Any, terms: Terms | None = None) -> None:
        self.due[request_id] = REQUEST
        self.terms[request_id] = terms or Terms()
        self.sent += 1

    def refused(self, request_id: Any, code: str) -> None:
        """A frame the server must refuse with ``code``: under a fresh id, or with id null (None)."""
        if request_id is None:
            self.unnamed[code] += 1
        else:
            self.due[request_id] = code
        self.sent += 1

    def duplicate(self, request_id: Any) -> None:
        """A valid request sent again under ``request_id`` while it is in flight (no deadline, short)."""
        self.duplicates[request_id] += 1
        self.sent += 1

    def cancel(self, request_id: Any) -> None:
        """A cancel frame: answered only through the request it names (§5), so not counted as sent."""
        self.cancels.add(request_id)

    def in_flight(self) -> list[Any]:
        """Requests without their answer yet (those sent again included): the server holds as many or fewer."""
        return [request_id for request_id, want in self.due.items() if want in (REQUEST, AGAIN)]

    def take(self, frame: dict[str, Any]) -> None:
        """A frame received."""
        kind, request_id, code = frame.get("type"), frame.get("id"), frame.get("code")
        if kind in ("stats", "hello"):
            return
        if kind not in ("result", "overloaded", "cancelled", "error"):
            self.problems.append(f"an unexpected {kind!r} frame: {json.dumps(frame)[:200]}")
            return
        self.received[label(frame)] += 1
        if kind == "error" and request_id is None:
            if self.unnamed[code] > 0:
                self.unnamed[code] -= 1
            else:
                self.problems.append(f"an error with id null that no frame provoked: {code}")
            return
        if kind == "error" and code == "duplicate_id" and self.duplicates[request_id] > 0:
            self.duplicates[request_id] -= 1
            return
        want = self.due.pop(request_id, None)
        terms = self.terms.pop(request_id, Terms()) if want == REQUEST else Terms()
        if want in (REQUEST, AGAIN) and self.duplicates[request_id] > 0:
            # A frame sent again under this id before this answer came: the server may have read it
            # after writing this answer, and then it is a request of its own (§3).
            self.duplicates[request_id] -= 1
            self.due[request_id] = AGAIN
        named = " ".join(str(part) for part in (kind, code or frame.get("reason")) if part)
        if want is None:
            self.problems.append(f"a {named} for id {request_id!r}, which was not in flight")
        elif want not in (REQUEST, AGAIN):
            if (kind, code) != ("error", want):
                self.problems.append(f"a frame sent to provoke {want} under id {request_id!r} got {named}")
        elif kind == "error" and code not in terms.refusals and not (want == AGAIN and code == "duplicate_id"):
            self.problems.append(f"request {request_id!r} got error {code}: {frame.get('message')}")
        elif kind == "cancelled" and request_id not in self.cancels:
            self.problems.append(f"request {request_id!r} was cancelled, and no cancel named it")
        elif kind == "overloaded" and not self._fair(frame, terms):
            self.problems.append(f"request {request_id!r} got {json.dumps(frame)[:200]}")
        elif kind == "result" and not isinstance(frame.get("predictions"), list):
            self.problems.append(f"request {request_id!r} got a result without predictions")

    @staticmethod
    def _fair(frame: dict[str, Any], terms: Terms) -> bool:
        """An ``overloaded`` a request of these terms may get from a server that is neither draining nor
        stopped (§6): a full queue (503) or its connection's share (429), or a 504 past its deadline."""
        reason, status = frame.get("reason"), frame.get("status")
        told = isinstance(frame.get("retry_after_ms"), int) and frame["retry_after_ms"] >= 0
        late = terms.deadline and (reason, status) == ("deadline_exceeded", 504)
        return told and (BUSY.get(reason) == status or late)

    def outstanding(self) -> list[str]:
        """What is still due: on a connection whose visitor waited for every answer, each is a problem."""
        return ([f"id {request_id!r} ({want})" for request_id, want in self.due.items()]
                + [f"duplicate_id for {request_id!r}" for request_id, n in self.duplicates.items() for _ in range(n)]
                + [f"error {code} with id null" for code, n in self.unnamed.items() for _ in range(n)])


def text(rng: random.Random, mask: str, masks: int, words: int) -> str:
    chosen = [rng.choice(WORDS) for _ in range(words)]
    chosen[0] = chosen[0].capitalize()  # (a word's, before the masks go in: a mask is sent as hello spells it)
    for _ in range(masks):
        chosen.insert(rng.randrange(len(chosen) + 1), mask)
    return " ".join(chosen) + "."


def refusable(sentence: str, masks: int, top_k: int, targets: list[str] | None, limits: dict[str, Any]
              ) -> frozenset[str]:
    """The refusals a valid request of ASCII words may get for its size under these limits (§3), by an
    upper bound of what the server counts: at most a token per character and one more per word, and
    the result bound with every token's text three bytes a character plus ten, and vocabulary tokens
    of up to 256 characters; and a text over ``max_text_chars``. Under the default limits and a
    BERT-sized model, none."""
    tokens = len(sentence) + len(sentence.split()) + 4
    too_long = tokens > limits["max_tokens"] or len(sentence) > limits["max_text_chars"]
    size = masks * top_k * (96 + 3 * len(sentence) + 10 * tokens + 2 * (1 + 2 * 256)) + len(json.dumps(targets))
    return frozenset(code for code, possible in (("text_too_long", too_long),
                                                 ("result_too_large", size > limits["max_result_bytes"])) if possible)


def possible_refusals(mask: str, limits: dict[str, Any]) -> tuple[str, ...]:
    """``REFUSALS`` but those the limits would answer otherwise: a text over ``max_text_chars`` in a
    frame over ``max_frame_bytes`` (closed with 1009, §1), too many masks over ``max_text_chars``."""
    too_big = limits["max_text_chars"] + 200 > limits["max_frame_bytes"]
    too_many = (len(mask) + 1) * (limits["max_masks"] + 1) > limits["max_text_chars"]
    return tuple(kind for kind in REFUSALS
                 if not (kind == "text_too_long" and too_big) and not (kind == "too_many_masks" and too_many))


def frame_for(rng: random.Random, kind: str, request_id: Any, mask: str, limits: dict[str, Any]
              ) -> tuple[str | bytes, Any, str, Terms]:
    """A frame of ``kind`` (one of ``REFUSALS``, or ``request``) under ``request_id``: (the frame, the id
    its answer carries (None: null), what it is due: ``request`` or the error code, and a request's terms)."""
    ok = text(rng, mask, 1, 5)
    fill: dict[str, Any] = {"type": "fill_mask", "id": request_id, "text": ok}
    if kind == REQUEST:
        masks = rng.randint(1, min(3, limits["max_masks"]))
        top_k = rng.randint(1, min(50, limits["top_k"]["max"]))  # (ESM's vocabulary holds 33 tokens)
        fill.update(text=text(rng, mask, masks, rng.randint(1, 60)), top_k=top_k)
        if rng.random() < 0.2:
            fill["targets"] = rng.sample(TARGETS, rng.randint(1, min(3, limits["max_targets"])))
        if rng.random() < 0.15:
            fill["deadline_ms"] = round(rng.uniform(0.5, 10), 2)
        terms = Terms(refusable(fill["text"], masks, top_k, fill.get("targets"), limits), "deadline_ms" in fill)
        return json.dumps(fill), request_id, REQUEST, terms
    named = {  # a frame with a valid id, refused under it
        "missing_field": {"type": "fill_mask", "id": request_id},
        "unknown_type": {"type": "fill_mask_please", "id": request_id, "text": ok},
        "no_mask": {**fill, "text": "a text without any mask in it"},
        "too_many_masks": {**fill, "text": " ".join([mask] * (limits["max_masks"] + 1))},
        "text_too_long": {**fill, "text": (ok + " x" * limits["max_text_chars"])[:limits["max_text_chars"] + 1]},
        "invalid_top_k": {**fill, "top_k": rng.choice([0, -1, limits["top_k"]["max"] + 1, 2.5, "3"])},
        "invalid_targets": {**fill, "targets": rng.choice([[], [" "], 7])},
        "invalid_deadline": {**fill, "deadline_ms": rng.choice([0, -5, "soon"])},
        "invalid_field": {**fill, "text": 42},
    }
    if kind in named:
        return json.dumps(named[kind]), request_id, kind, Terms()
    unnamed: dict[str, tuple[str | bytes, str]] = {  # refused with id null
        "binary_frame": (json.dumps(fill).encode(), "binary_frame"),
        "invalid_json": ('{"type": "fill_mask", "id": 1, "text": ', "invalid_json"),
        "not_an_object": (json.dumps([fill]), "not_an_object"),
        "invalid_id": (json.dumps({**fill, "id": rng.choice([True, None, 1.5, "", 2**60])}), "invalid_id"),
        "cancel_without_id": (json.dumps({"type": "cancel"}), "missing_field"),
        "cancel_bad_id": (json.dumps({"type": "cancel", "id": [1]}), "invalid_id"),
        "stats_interval": (json.dumps({"type": "subscribe_stats", "interval_ms": 5}), "invalid_field"),
    }
    if kind in unnamed:
        frame, code = unnamed[kind]
        return frame, None, code, Terms()
    raise ValueError(f"no frame of kind {kind!r}")


REFUSALS = ("missing_field", "unknown_type", "no_mask", "too_many_masks", "text_too_long", "invalid_top_k",
            "invalid_targets", "invalid_deadline", "invalid_field", "binary_frame", "invalid_json",
            "not_an_object", "invalid_id", "cancel_without_id", "stats_interval", "cancel_bad_id")


@dataclass
class Tally:
    """Everything the visitors did, for the summary and the checks."""

    ledgers: list[Ledger] = field(default_factory=list)
    leaves: Counter[str] = field(default_factory=Counter)
    frames: Counter[str] = field(default_factory=Counter)


async def visit(url: str, rng: random.Random, tally: Tally) -> None:
    """One visitor: a connection, its frames, and its way out (module docstring). Whatever goes wrong
    is one of its ledger's problems: the visitors break no rule, so the server has no cause to refuse,
    close or fail a connection."""
    ledger = Ledger()
    tally.ledgers.append(ledger)
    leave = rng.choices(list(LEAVES), weights=list(LEAVES.values()))[0]
    try:
        async with connect(url, max_size=None, open_timeout=30, close_timeout=5) as ws:
            hello = json.loads(await asyncio.wait_for(ws.recv(), 30))
            await converse(ws, hello, rng, ledger, leave, tally)
    except Exception as exc:  # (a refused handshake, a connection the server failed)
        ledger.problems.append(f"the connection failed: {type(exc).__name__}: {exc}")
    tally.leaves[leave] += 1


async def converse(ws: ClientConnection, hello: dict[str, Any], rng: random.Random, ledger: Ledger, leave: str,
                   tally: Tally) -> None:
    """A visitor's frames, read all along by a reader of their own, and its way out."""
    mask, limits = hello["mask_token"], hello["limits"]
    refusals = possible_refusals(mask, limits)
    held_until = 0.0  # retry_after_ms, as a well-behaved client keeps it
    settled = asyncio.Event()  # set while nothing is due

    async def read() -> None:  # until the connection ends, whoever ends it
        nonlocal held_until
        try:
            async for message in ws:
                frame = json.loads(message)
                if not isinstance(frame, dict):
                    ledger.problems.append(f"a frame that is not an object: {str(message)[:200]}")
                    continue
                ledger.take(frame)
                if frame.get("type") == "overloaded" and isinstance(frame.get("retry_after_ms"), int):
                    held_until = max(held_until, time.monotonic() + frame["retry_after_ms"] / 1000)
                if ledger.outstanding():
                    settled.clear()
                else:
                    settled.set()
        except ConnectionClosed:
            pass
        except Exception as exc:  # (a frame that is not JSON)
            ledger.problems.append(f"reading failed: {type(exc).__name__}: {exc}")

    reader = asyncio.create_task(read())
    try:
        await send_frames(ws, mask, limits, refusals, rng, ledger, tally, lambda: held_until)
        if rng.random() < 0.1:
            await ws.send(json.dumps({"type": "subscribe_stats", "interval_ms": hello["stats"]["min_interval_ms"]}))
        if leave == "wait" and ledger.outstanding():
            settled.clear()
            waiting = asyncio.create_task(settled.wait())
            await asyncio.wait([waiting, reader], timeout=ANSWER_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
        if reader.done():  # the connection ended before the visitor left
            ledger.problems.append(f"the server ended the connection: {ws.close_code} {ws.close_reason!r}")
        if leave == "wait" and ledger.outstanding():
            ledger.problems.append(f"nothing came in {ANSWER_WAIT_S:g} s for {', '.join(ledger.outstanding()[:5])}")
        if leave in ("wait", "close"):
            await ws.close()  # (the reader reads on until the server's close)
        elif leave == "reset":
            ws.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                             struct.pack("ii", 1, 0))
            ws.transport.abort()
        else:
            ws.transport.write_eof()  # §8: the server ends the connection at once
        try:
            await asyncio.wait_for(asyncio.shield(reader), END_WAIT_S)
        except TimeoutError:
            ledger.problems.append(f"the connection did not end within {END_WAIT_S:g} s of the visitor's {leave}")
        if leave == "wait" and ws.close_code != 1000:
            ledger.problems.append(f"the connection closed with {ws.close_code} {ws.close_reason!r}")
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def send_frames(ws: ClientConnection, mask: str, limits: dict[str, Any], refusals: tuple[str, ...],
                      rng: random.Random, ledger: Ledger, tally: Tally, held_until: Callable[[], float]) -> None:
    """1 to 40 frames, a few milliseconds apart, each entered in the ledger before it is sent."""
    next_id = rng.randrange(1000)
    most = min(48, limits["max_inflight_per_connection"])  # (too_many_inflight is the limit's own test)
    for _ in range(rng.randint(1, 40)):
        await asyncio.sleep(max(held_until() - time.monotonic(), 0) + rng.uniform(0, 0.01))
        roll, flying = rng.random(), ledger.in_flight()
        if roll < 0.1 and flying:
            target = rng.choice(flying)
            ledger.cancel(target)
            await ws.send(json.dumps({"type": "cancel", "id": target}))
            tally.frames["cancel"] += 1
            continue
        if roll < 0.15:  # a cancel for an id not in flight: ignored (§5)
            await ws.send(json.dumps({"type": "cancel", "id": "never-sent"}))
            tally.frames["cancel"] += 1
            continue
        if len(flying) >= most:
            continue
        if roll < 0.2 and flying:
            again = rng.choice(flying)
            ledger.duplicate(again)
            await ws.send(json.dumps({"type": "fill_mask", "id": again, "text": f"Again {mask}."}))
            tally.frames["duplicate_id"] += 1
            continue
        next_id += 1
        request_id: Any = next_id if rng.random() < 0.5 else f"r-{next_id}"
        kind = rng.choice(refusals) if roll < 0.35 else REQUEST
        frame, answered_as, due, terms = frame_for(rng, kind, request_id, mask, limits)
        if due == REQUEST:
            ledger.request(request_id, terms)
        else:
            ledger.refused(answered_as, due)
        await ws.send(frame)
        tally.frames[kind] += 1


async def wave(url: str, rng: random.Random, seconds: float, visitors: int, tally: Tally) -> None:
    """``visitors`` at a time for ``seconds``: each one that leaves is replaced until the time is up."""
    ends = time.monotonic() + seconds

    async def one_after_another(seed: int) -> None:
        own = random.Random(seed)
        while time.monotonic() < ends:
            await visit(url, own, tally)

    await asyncio.gather(*(one_after_another(rng.randrange(2**32)) for _ in range(visitors)))


METRIC = re.compile(r'^(fillmask_requests_total|fillmask_torch_threads|fillmask_forward_parts)(\{[^}]*\})? (\S+)$')


def metrics(text: str) -> dict[str, Any]:
    """From ``/metrics`` (§11): ``counted``, answers by their labels (outcome, code); ``layout``, the
    torch threads and forward parts in use."""
    found: dict[str, Any] = {"counted": Counter(), "layout": {}}
    for line in text.splitlines():
        match = METRIC.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        if name == "fillmask_requests_total":
            pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels or ""))
            found["counted"][pairs.get("outcome", ""), pairs.get("code", "")] += float(value)
        else:
            found["layout"][name.removeprefix("fillmask_")] = float(value)
    return found


def resources(pid: int) -> dict[str, float]:
    """The server's resident memory (MiB), threads and open file descriptors, from /proc."""
    return {"rss_mb": rss_mb(pid), "threads": len(list(Path(f"/proc/{pid}/task").iterdir())),
            "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


async def quiet_spell(server: ServerProcess, seconds: float, timeout: float = 10.0) -> dict[str, Any]:
    """After ``seconds`` of quiet: the server's live figures (§13), from a probe connection of its own,
    once nothing is in flight or queued and the probe's is the only connection (or the last seen after
    ``timeout`` s); then, with the probe still open, its layout (``/metrics``) and its resources, read
    until two readings a tenth of a second apart agree (a thread on its way out)."""
    await asyncio.sleep(seconds)
    async with connect(server.url, open_timeout=timeout) as ws:
        hello = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        await ws.send(json.dumps({"type": "subscribe_stats", "interval_ms": hello["stats"]["min_interval_ms"]}))
        give_up = time.monotonic() + timeout
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), timeout))
            if frame.get("type") != "stats":
                continue
            figures = {key: frame[key] for key in ("in_flight", "queue_depth", "connections")}
            if figures == {"in_flight": 0, "queue_depth": 0, "connections": 1} or time.monotonic() > give_up:
                break
        layout = metrics((await asyncio.to_thread(http_get, f"http://127.0.0.1:{server.port}/metrics"))[1])["layout"]
        own = resources(server.pid)
        for _ in range(20):
            await asyncio.sleep(0.1)
            again, own = own, resources(server.pid)
            if (again["threads"], again["fds"]) == (own["threads"], own["fds"]):
                break
    return {**figures, **own, "layout": layout}


def quiet_failures(spells: list[dict[str, Any]], rss_bound_mb: float) -> list[str]:
    """The checks of the quiet spells (module docstring): nothing in flight, and each spell's resources
    against the first's; its threads against the first spell's with the same layout (torch threads and
    forward parts: the server changes them while serving, and its thread count with them)."""
    failures = []
    first = spells[0]
    for number, spell in enumerate(spells, start=1):
        if (spell["in_flight"], spell["queue_depth"], spell["connections"]) != (0, 0, 1):
            failures.append(f"quiet spell {number}: {spell['in_flight']} in flight, {spell['queue_depth']} queued, "
                            f"{spell['connections']} connections (the probe's alone expected)")
        alike = next(other for other in spells if other.get("layout") == spell.get("layout"))
        if spell["threads"] != alike["threads"]:
            failures.append(f"quiet spell {number}: {spell['threads']:.0f} threads, {alike['threads']:.0f} at the "
                            f"first with the same layout ({spell.get('layout')})")
        if spell["fds"] != first["fds"]:
            failures.append(f"quiet spell {number}: {spell['fds']:.0f} fds, {first['fds']:.0f} at the first")
        if spell["rss_mb"] - first["rss_mb"] > rss_bound_mb:
            failures.append(f"quiet spell {number}: resident memory {spell['rss_mb']:.0f} MiB, over the first's "
                            f"{first['rss_mb']:.0f} + {rss_bound_mb:g}")
    return failures


def final_failures(received: Counter[tuple[str, str]], counted: Counter[tuple[str, str]], sent: int, ready: int,
                   log: list[str], exit_status: int | None) -> list[str]:
    """The checks at the end (module docstring): ``/metrics`` counted, under each label, at least the
    answers received with it (§11: an answer handed to the socket counts as what it was, never as
    ``dropped``) and no more in all than the frames sent to be answered; ``/readyz``; the server's log
    since its start; its exit status after SIGTERM."""
    failures = [f"/metrics counted {counted[key]:.0f} {' '.join(filter(None, key))}, and {n} were received"
                for key, n in sorted(received.items()) if counted[key] < n]
    if sum(counted.values()) > sent:
        failures.append(f"/metrics counted {sum(counted.values()):.0f} answers, and {sent} frames were sent to be "
                        "answered")
    if ready != 200:
        failures.append(f"/readyz answered {ready} after the churn")
    failures += [f"the server logged: {line}" for line in log
                 if any(word in line for word in ("WARNING", "ERROR", "CRITICAL", "Traceback"))][:10]
    if exit_status != 0:
        failures.append(f"the server exited with status {exit_status} after SIGTERM")
    return failures


def listing(counts: Counter[Any]) -> str:
    return ", ".join(f"{n} {' '.join(filter(None, name)) if isinstance(name, tuple) else name}"
                     for name, n in counts.most_common())


async def churn(server: ServerProcess, args: argparse.Namespace) -> list[str]:
    """The waves, the quiet spells, the server stopped, and every check; returns what failed."""
    rng = random.Random(args.seed)
    tally = Tally()
    base = f"http://127.0.0.1:{server.port}"
    log_at_start = len(server.log_lines())
    counted_at_start = metrics(http_get(f"{base}/metrics")[1])["counted"]
    spells: list[dict[str, Any]] = []
    started = time.monotonic()
    while len(spells) < (args.waves or 1) or (not args.waves and time.monotonic() - started < args.duration):
        visitors = rng.randint(1, args.visitors)
        await wave(server.url, rng, args.wave_s, visitors, tally)
        spells.append(await quiet_spell(server, args.quiet_s))
        spell = spells[-1]
        layout = spell["layout"]
        print(f"wave {len(spells):3d}: {visitors:3d} visitors at a time; quiet: resident {spell['rss_mb']:.1f} MiB, "
              f"threads {spell['threads']:.0f} (torch {layout.get('torch_threads', 0):.0f} in "
              f"{layout.get('forward_parts', 0):.0f} parts), fds {spell['fds']:.0f}, in flight {spell['in_flight']}, "
              f"queued {spell['queue_depth']}, connections {spell['connections']}", flush=True)
    counted = metrics(http_get(f"{base}/metrics")[1])["counted"]
    counted.subtract(counted_at_start)
    ready = http_get(f"{base}/readyz")[0]
    exit_status = await asyncio.to_thread(server.stop)
    log = server.log_lines()[log_at_start:]

    sent = sum(ledger.sent for ledger in tally.ledgers)
    received = sum((ledger.received for ledger in tally.ledgers), Counter())
    print(f"visitors          {len(tally.ledgers)} ({listing(tally.leaves)})")
    print(f"frames            {sum(tally.frames.values())} sent: {listing(tally.frames)}")
    print(f"answers           {sum(received.values())} received: {listing(received)}")
    print(f"/metrics counted  {sum(counted.values()):.0f} (between {sum(received.values())} received and {sent} sent "
          "to be answered)")
    failures = [f"visitor {number}: {problem}" for number, ledger in enumerate(tally.ledgers)
                for problem in ledger.problems]
    return failures + quiet_failures(spells, args.rss_bound_mb) + final_failures(received, counted, sent, ready, log,
                                                                                 exit_status)


async def main_async(args: argparse.Namespace) -> int:
    try:
        flags = shlex.split(args.server_flags)
        with ServerProcess(Path(args.model), flags, start_timeout=args.start_timeout) as server:
            failures = await churn(server, args)
    except ServerStartError as exc:
        print(f"churn soak: the server did not start: {str(exc).splitlines()[0]}")
        return 1
    for failure in failures[:50]:
        print(f"FAIL: {failure}")
    print("churn soak: OK" if not failures else f"churn soak: {len(failures)} check(s) failed")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=60, help="seconds of waves and quiet spells (default 60)")
    parser.add_argument("--waves", type=int, default=0, help="this many waves, whatever --duration says")
    parser.add_argument("--wave-s", type=float, default=10, help="seconds of each wave (default 10)")
    parser.add_argument("--quiet-s", type=float, default=3, help="seconds of quiet after each wave (default 3)")
    parser.add_argument("--visitors", type=int, default=24, help="most visitors at a time in a wave (default 24)")
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"), help="model of the server")
    parser.add_argument("--server-flags", default="", help="more flags for the server, as one string")
    parser.add_argument("--rss-bound-mb", type=float, default=150,
                        help="allowed growth of resident memory after the first quiet spell (default 150)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the visitors' choices (default 1)")
    parser.add_argument("--start-timeout", type=float, default=120, help="seconds to wait for the server")
    args = parser.parse_args(argv)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
