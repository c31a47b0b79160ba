"""Churn soak: connections that come and go with every kind of frame, and the server's resources when quiet.

    .venv/bin/python scripts/churn_soak.py --duration 60   # models/tiny, default flags
    .venv/bin/python scripts/churn_soak.py --duration 2400 --model models/base --server-flags "--dtype bfloat16"

It starts ``ws_server.py`` (``bench.server_proc.ServerProcess``) and runs waves of visitors, each wave
followed by a quiet spell. A wave keeps a number of visitors chosen for it (1 to ``--visitors``) going for
``--wave-s`` seconds: a visitor opens a connection, sends 1 to 40 frames a few milliseconds apart and
leaves, and another takes its place. Its frames: requests of 1 to 60 words with 1 to 3 masks, ``top_k``
from 1 to 50, some with ``targets``, some with deadlines of 0.5 to 10 ms (mostly missed: 504s); cancels
of requests in flight (or of none); an id already in flight again (``duplicate_id``); and sixteen kinds of
frame the server must refuse, each with the error code it provokes. It honours ``retry_after_ms`` as a
well-behaved client does. It leaves in one of four ways: it waits for every answer and closes; or, with
requests in flight, it sends a close frame, resets the TCP connection, or half-closes it (protocol.md §8).

The checks (exit status 1 if any fails, each printed):

- On a connection whose visitor waited: every accepted request got exactly one terminal frame, every
  refused frame exactly one error with the code it was sent to provoke, every duplicate id one
  ``duplicate_id`` error beside the first request's own answer, or, read after that answer, an answer
  of its own (§3, §7, §8); no request was answered with an error but ``text_too_long`` (nor cancelled
  without a cancel). On a connection cut with requests in flight (or not): nothing twice.
- No frame about an id that was not in flight; no close from the server (the visitors break no rule).
- At each quiet spell: the server's live figures (§13) say nothing is queued or in flight and one
  connection is open (the probe's); after the first spell, its threads and open file descriptors are
  as at the first, and its resident memory within ``--rss-bound-mb`` of the first's.
- ``/metrics`` counted no fewer frames than the visitors received answers and no more than they sent
  frames to be answered (§11: each once; a frame sent just before a cut may never have been read).
- At the end: ``/readyz`` 200, no WARNING, ERROR or traceback in the server's log after its start, and
  exit status 0 on SIGTERM.

The load runs no model code; the bookkeeping (``Ledger``, ``frame_for``, ``quiet_failures``) is pure,
and ``tests/test_hardening_soak.py`` runs the whole for a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import socket
import struct
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.server_proc import ServerProcess, ServerStartError  # noqa: E402

VOCABULARY = ("the old library on the corner of square took a dusty book from top shelf and sat down by window to "
              "read until light was gone committee met on tuesday morning discuss new bridge which had been delayed "
              "twice because storms shortage steel every summer family drove coast rented small house near spent "
              "long evenings playing cards listening radio paris is capital france")
WORDS = tuple(VOCABULARY.split())
TARGETS = ("the", "a", "capital", "city", "book", "river", "music")
#: The four ways a visitor leaves: waiting for every answer, then a close; or, with requests in flight,
#: a close frame, a TCP reset, or a half-close (the weights are how often each is drawn).
LEAVES = {"wait": 5, "close": 1, "reset": 1, "half-close": 1}
TERMINAL = {"result", "overloaded", "cancelled"}
REQUEST = "request"
#: Due under an id sent again while in flight, once the first request's answer came: a ``duplicate_id``
#: error, or (read by the server after that answer) an answer of its own.
AGAIN = "again"
#: A request may be refused for its length alone: a model of few positions (ESM's, DeBERTa's) takes
#: fewer tokens than sixty words make, and the load does not know the model's tokenizer (§3).
LENGTH_REFUSAL = "text_too_long"


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


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
    duplicates: Counter[Any] = field(default_factory=Counter)
    unnamed: Counter[str] = field(default_factory=Counter)
    cancels: set[Any] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    sent: int = 0  # frames the server answers (§11 counts each once)
    answers: int = 0  # answers received
    kinds: Counter[str] = field(default_factory=Counter)

    def request(self, request_id: Any) -> None:
        self.due[request_id] = REQUEST
        self.sent += 1

    def refused(self, request_id: Any, code: str) -> None:
        """A frame the server must refuse with ``code``: under a fresh id, or with id null (None)."""
        if request_id is None:
            self.unnamed[code] += 1
        else:
            self.due[request_id] = code
        self.sent += 1

    def duplicate(self, request_id: Any) -> None:
        self.duplicates[request_id] += 1
        self.sent += 1

    def cancel(self, request_id: Any) -> None:
        """A cancel frame: answered only through the request it names (§5), so not counted as sent."""
        self.cancels.add(request_id)

    def in_flight(self) -> list[Any]:
        return [request_id for request_id, want in self.due.items() if want == REQUEST]

    def received(self, frame: dict[str, Any]) -> None:
        kind, request_id, code = frame.get("type"), frame.get("id"), frame.get("code")
        if kind in ("stats", "hello"):
            return
        if kind not in TERMINAL and kind != "error":
            self.problems.append(f"an unexpected {kind!r} frame: {json.dumps(frame)[:200]}")
            return
        self.answers += 1
        self.kinds[f"{kind} {code or frame.get('reason') or ''}".strip()] += 1
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
        if want in (REQUEST, AGAIN) and self.duplicates[request_id] > 0:
            # A frame sent again under this id before this answer came: the server may have read it
            # after writing this answer, and then it is a request of its own (§3).
            self.duplicates[request_id] -= 1
            self.due[request_id] = AGAIN
        if want is None:
            self.problems.append(f"a {' '.join(filter(None, (kind, code)))} for id {request_id!r}, which was not in "
                                 "flight")
        elif want == AGAIN and kind == "error" and code != "duplicate_id":
            self.problems.append(f"request {request_id!r}, sent again, got error {code}: {frame.get('message')}")
        elif want == REQUEST and kind == "error" and code != LENGTH_REFUSAL:
            self.problems.append(f"request {request_id!r} got error {code}: {frame.get('message')}")
        elif want == REQUEST and kind == "cancelled" and request_id not in self.cancels:
            self.problems.append(f"request {request_id!r} was cancelled, and no cancel named it")
        elif want not in (REQUEST, AGAIN) and (kind, code) != ("error", want):
            self.problems.append(f"a frame sent to provoke {want} under id {request_id!r} got "
                                 f"{' '.join(filter(None, (kind, code)))}")

    def outstanding(self) -> list[str]:
        """What is still due: on a connection whose visitor waited for every answer, each is a problem."""
        return ([f"id {request_id!r} ({want})" for request_id, want in self.due.items()]
                + [f"duplicate_id for {request_id!r}" for request_id, n in self.duplicates.items() for _ in range(n)]
                + [f"error {code} with id null" for code, n in self.unnamed.items() for _ in range(n)])


def text(rng: random.Random, mask: str, masks: int, words: int) -> str:
    chosen = [rng.choice(WORDS) for _ in range(words)]
    for _ in range(masks):
        chosen.insert(rng.randrange(len(chosen) + 1), mask)
    sentence = " ".join(chosen)
    return sentence[0].upper() + sentence[1:] + "."  # (not str.capitalize: it lowers the rest, the mask too)


def frame_for(rng: random.Random, kind: str, request_id: Any, mask: str, limits: dict[str, Any]
              ) -> tuple[str | bytes, Any, str]:
    """A frame of ``kind`` (a code of §7, or ``request``) under ``request_id``: (the frame, the id its
    answer carries (None: null), what it is due: ``request`` or the error code)."""
    ok = text(rng, mask, 1, 5)
    fill: dict[str, Any] = {"type": "fill_mask", "id": request_id, "text": ok}
    if kind == REQUEST:
        top_k = rng.randint(1, min(50, limits["top_k"]["max"]))  # (ESM's vocabulary holds 33 tokens)
        fill.update(text=text(rng, mask, rng.randint(1, 3), rng.randint(1, 60)), top_k=top_k)
        if rng.random() < 0.2:
            fill["targets"] = rng.sample(TARGETS, rng.randint(1, 3))
        if rng.random() < 0.15:
            fill["deadline_ms"] = round(rng.uniform(0.5, 10), 2)
        return json.dumps(fill), request_id, REQUEST
    named = {  # a frame with a valid id, refused under it
        "missing_field": {"type": "fill_mask", "id": request_id},
        "unknown_type": {"type": "fill_mask_please", "id": request_id, "text": ok},
        "no_mask": {**fill, "text": "a text without any mask in it"},
        "too_many_masks": {**fill, "text": text(rng, mask, limits["max_masks"] + 1, 3)},
        "text_too_long": {**fill, "text": ok + " x" * limits["max_text_chars"]},
        "invalid_top_k": {**fill, "top_k": rng.choice([0, -1, limits["top_k"]["max"] + 1, 2.5, "3"])},
        "invalid_targets": {**fill, "targets": rng.choice([[], [" "], 7])},
        "invalid_deadline": {**fill, "deadline_ms": rng.choice([0, -5, "soon"])},
        "invalid_field": {**fill, "text": 42},
    }
    if kind in named:
        return json.dumps(named[kind]), request_id, kind
    unnamed: dict[str, str | bytes] = {  # refused with id null
        "binary_frame": json.dumps(fill).encode(),
        "invalid_json": '{"type": "fill_mask", "id": 1, "text": ',
        "not_an_object": json.dumps([fill]),
        "invalid_id": json.dumps({**fill, "id": rng.choice([True, None, 1.5, "", 2**60])}),
    }
    if kind in unnamed:
        return unnamed[kind], None, kind
    if kind == "cancel_without_id":
        return json.dumps({"type": "cancel"}), None, "missing_field"
    if kind == "stats_interval":
        return json.dumps({"type": "subscribe_stats", "interval_ms": 5}), None, "invalid_field"
    if kind == "cancel_bad_id":
        return json.dumps({"type": "cancel", "id": [1]}), None, "invalid_id"
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
    problems: list[str] = field(default_factory=list)


async def visit(url: str, rng: random.Random, tally: Tally) -> None:
    """One visitor: a connection, its frames, and its way out (module docstring)."""
    ledger = Ledger()
    tally.ledgers.append(ledger)
    leave = rng.choices(list(LEAVES), weights=list(LEAVES.values()))[0]
    async with connect(url, max_size=None, open_timeout=30, close_timeout=5) as ws:
        hello = json.loads(await ws.recv())
        mask, limits = hello["mask_token"], hello["limits"]
        held_until = 0.0  # retry_after_ms, as a well-behaved client keeps it
        stop_reading = asyncio.Event()

        async def read() -> None:
            nonlocal held_until
            try:
                async for message in ws:
                    frame = json.loads(message)
                    ledger.received(frame)
                    if frame.get("type") == "overloaded" and frame.get("status") in (429, 503):
                        held_until = max(held_until, time.monotonic() + frame["retry_after_ms"] / 1000)
                    if stop_reading.is_set() and not ledger.outstanding():
                        return
            except ConnectionClosed:
                pass

        reader = asyncio.create_task(read())
        next_id = rng.randrange(1000)
        for _ in range(rng.randint(1, 40)):
            await asyncio.sleep(max(held_until - time.monotonic(), 0) + rng.uniform(0, 0.01))
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
            if roll < 0.2 and flying:
                again = rng.choice(flying)
                ledger.duplicate(again)
                await ws.send(json.dumps({"type": "fill_mask", "id": again, "text": f"Again {mask}."}))
                tally.frames["duplicate_id"] += 1
                continue
            if len(flying) >= min(48, limits["max_inflight_per_connection"] - 1):
                continue  # (too_many_inflight is the limit's test, not this load's)
            next_id += 1
            request_id: Any = next_id if rng.random() < 0.5 else f"r-{next_id}"
            kind = rng.choice(REFUSALS) if roll < 0.35 else REQUEST
            frame, answered_as, due = frame_for(rng, kind, request_id, mask, limits)
            if due == REQUEST:
                ledger.request(request_id)
            else:
                ledger.refused(answered_as, due)
            await ws.send(frame)
            tally.frames[kind] += 1
        if rng.random() < 0.1:
            await ws.send(json.dumps({"type": "subscribe_stats", "interval_ms": 250}))
        if leave == "wait":
            stop_reading.set()
            if ledger.outstanding():
                try:
                    await asyncio.wait_for(asyncio.shield(reader), 60)
                except TimeoutError:
                    ledger.problems.append(f"no answer in 60 s for {', '.join(ledger.outstanding()[:5])}")
            else:
                reader.cancel()
            await ws.close()
        elif leave == "close":
            await ws.close()
        else:
            sock = ws.transport.get_extra_info("socket")
            if leave == "reset":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                ws.transport.abort()
            else:
                ws.transport.write_eof()
        await asyncio.gather(reader, return_exceptions=True)
        if leave == "wait" and ws.close_code != 1000:
            ledger.problems.append(f"the connection closed with {ws.close_code} {ws.close_reason!r}")
    tally.leaves[leave] += 1


async def wave(url: str, rng: random.Random, seconds: float, visitors: int, tally: Tally) -> None:
    """``visitors`` at a time for ``seconds``: each one that leaves is replaced until the time is up."""
    ends = time.monotonic() + seconds

    async def one_after_another(seed: int) -> None:
        own = random.Random(seed)
        while time.monotonic() < ends:
            try:
                await visit(url, own, tally)
            except (ConnectionClosed, OSError) as exc:
                tally.problems.append(f"a visitor's connection failed: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(one_after_another(rng.randrange(2**32)) for _ in range(visitors)))


async def live_figures(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The server's live figures (§13) from a probe connection of its own, once nothing is in flight or
    queued and the probe's is the only connection (or after ``timeout`` s, the last figures seen)."""
    async with connect(url) as ws:
        hello = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "subscribe_stats", "interval_ms": hello["stats"]["min_interval_ms"]}))
        give_up = time.monotonic() + timeout
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), timeout))
            if frame.get("type") != "stats":
                continue
            figures = {key: frame[key] for key in ("in_flight", "queue_depth", "connections")}
            if figures == {"in_flight": 0, "queue_depth": 0, "connections": 1} or time.monotonic() > give_up:
                return figures


def resources(pid: int) -> dict[str, float]:
    """The server's resident memory (MiB), threads and open file descriptors, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    rss = next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))
    return {"rss_mb": rss, "threads": len(list(Path(f"/proc/{pid}/task").iterdir())),
            "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


def quiet_failures(spells: list[dict[str, float]], rss_bound_mb: float) -> list[str]:
    """The checks of the quiet spells: each after the first against the first (module docstring)."""
    failures = []
    for number, spell in enumerate(spells, start=1):
        if (spell["in_flight"], spell["queue_depth"], spell["connections"]) != (0, 0, 1):
            failures.append(f"quiet spell {number}: {spell['in_flight']} in flight, {spell['queue_depth']} queued, "
                            f"{spell['connections']} connections (the probe's alone expected)")
        first = spells[0]
        for what in ("threads", "fds"):
            if spell[what] != first[what]:
                failures.append(f"quiet spell {number}: {spell[what]:.0f} {what}, {first[what]:.0f} at the first")
        if spell["rss_mb"] - first["rss_mb"] > rss_bound_mb:
            failures.append(f"quiet spell {number}: resident memory {spell['rss_mb']:.0f} MiB, over the first's "
                            f"{first['rss_mb']:.0f} + {rss_bound_mb:g}")
    return failures


def listing(counts: Counter[str]) -> str:
    return ", ".join(f"{n} {name}" for name, n in counts.most_common())


def counted(metrics: str) -> float:
    """The sum of ``fillmask_requests_total`` over its labels (§11)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("fillmask_requests_total{"))


async def quiet_spell(server: ServerProcess, seconds: float) -> dict[str, float]:
    await asyncio.sleep(seconds)
    figures = await live_figures(server.url)
    own = resources(server.pid)
    for _ in range(20):  # a thread or descriptor on its way out (the probe's socket) gets a moment
        await asyncio.sleep(0.1)
        again = resources(server.pid)
        if (again["threads"], again["fds"]) == (own["threads"], own["fds"]):
            break
        own = again
    return {**figures, **own}


async def churn(server: ServerProcess, args: argparse.Namespace) -> list[str]:
    """The waves, the quiet spells and every check but the server's exit; returns what failed."""
    rng = random.Random(args.seed)
    tally = Tally()
    base = f"http://127.0.0.1:{server.port}"
    log_at_start = len(server.log_lines())
    counted_at_start = counted(http_get(f"{base}/metrics")[1])
    spells: list[dict[str, float]] = []
    started = time.monotonic()
    while len(spells) < (args.waves or 1) or (not args.waves and time.monotonic() - started < args.duration):
        visitors = rng.randint(1, args.visitors)
        await wave(server.url, rng, args.wave_s, visitors, tally)
        spells.append(await quiet_spell(server, args.quiet_s))
        spell = spells[-1]
        print(f"wave {len(spells):3d}: {visitors:3d} visitors at a time; quiet: resident {spell['rss_mb']:.1f} MiB, "
              f"threads {spell['threads']:.0f}, fds {spell['fds']:.0f}, in flight {spell['in_flight']}, "
              f"queued {spell['queue_depth']}, connections {spell['connections']}", flush=True)
    server_counted = counted(http_get(f"{base}/metrics")[1]) - counted_at_start
    ready = http_get(f"{base}/readyz")[0]

    sent = sum(ledger.sent for ledger in tally.ledgers)
    answers = sum(ledger.answers for ledger in tally.ledgers)
    kinds = sum((ledger.kinds for ledger in tally.ledgers), Counter())
    print(f"visitors          {len(tally.ledgers)} ({listing(tally.leaves)})")
    print(f"frames            {sum(tally.frames.values())} sent: {listing(tally.frames)}")
    print(f"answers           {answers} received: {listing(kinds)}")
    print(f"/metrics counted  {server_counted:.0f} (between {answers} received and {sent} sent to be answered)")

    failures = list(tally.problems)
    for number, ledger in enumerate(tally.ledgers):
        failures += [f"visitor {number}: {problem}" for problem in ledger.problems]
    failures += quiet_failures(spells, args.rss_bound_mb)
    if not answers <= server_counted <= sent:
        failures.append(f"/metrics counted {server_counted:.0f} answers, outside {answers}..{sent}")
    if ready != 200:
        failures.append(f"/readyz answered {ready} after the churn")
    failures += [f"the server logged: {line}" for line in server.log_lines()[log_at_start:]
                 if any(word in line for word in ("WARNING", "ERROR", "CRITICAL", "Traceback"))][:10]
    return failures


async def main_async(args: argparse.Namespace) -> int:
    try:
        flags = shlex.split(args.server_flags)
        with ServerProcess(Path(args.model), flags, start_timeout=args.start_timeout) as server:
            failures = await churn(server, args)
    except ServerStartError as exc:
        print(f"churn soak: the server did not start: {str(exc).splitlines()[0]}")
        return 1
    if server.returncode != 0:
        failures.append(f"the server exited with status {server.returncode} after SIGTERM")
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
