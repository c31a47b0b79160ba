"""Seeded random examples of a server's life and death against real ``ws_server.py`` subprocesses
(protocol.md §10 with §4, §6, §7, §8, §9; README's signals, exit codes, ``/readyz``, ``--drain-delay``,
``--shutdown-timeout``).

Each example draws settings (``--drain-delay``, ``--shutdown-timeout``, ``--max-queue``,
``--max-batch-size``, ``--max-inflight-per-connection``, ``--send-timeout``), 1 to 4 raw WebSocket
connections (requests with and without ``deadline_ms``, ``top_k``, ``targets``; cancels; a connection
closed or aborted mid-way; one that pauses reading; one that connects only after the signal) and a
signal sequence (SIGTERM, SIGINT or SIGHUP alone; the first delivered twice back to back; another kind
back to back; a second one after ``/readyz`` showed the first taken; one after the drain ended; or
signals while the model loads, before the ready line), while ``/readyz`` and ``/healthz`` are polled.
Then it checks by counting what was recorded, never by waiting for something to be fast:

- no request id is answered twice, nor an id never sent; every frame is of a documented kind; ``hello``
  comes first and ``going_away`` at most once, with no ``shutting_down`` before it, never sooner than
  ``--drain-delay`` after a SIGTERM, and after it only the answers §10 allows;
- a connection that stayed open and kept reading through a drain that ended (exit 0) got exactly one
  terminal frame for every request it sent, then close code 1001; other connections end with a code
  the moment allows (1006 only after a second signal stopped the process or for a paused reader);
- ``/readyz`` is 200 before the signal, 503 (or the port closed) for every look that began after the
  log said the drain began, and never 200 again after a 503; ``/healthz`` is 200 while it answers;
- the exit status is §10's (0; 130 after a second signal during the drain; 128 + the signal's number
  before the ready line), within a generous bound derived from the settings; stderr has no
  ``Traceback`` and every line has a documented format; no process of the server's group remains.

The base seed is ``LIFECYCLE_SEED`` (default below) and the count ``LIFECYCLE_EXAMPLES``; a failure
names the example's seed and plan, so ``LIFECYCLE_SEED=<seed> LIFECYCLE_EXAMPLES=1`` replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
#: Start-up as short as the flags allow: what is measured or traced at load is not what this file is about.
FAST_START = ("--calibration-s", "0", "--forward", "eager", "--projection", "torch", "--torch-threads", "1")
BASE_SEED = int(os.environ.get("LIFECYCLE_SEED", "20261207"))
EXAMPLES = int(os.environ.get("LIFECYCLE_EXAMPLES", "2"))  # (more by hand: the suite's time)
CONCURRENT = 3  # servers alive at once (two cores)
SIGNAL_NAMES = {signal.SIGTERM: "terminated", signal.SIGINT: "interrupted", signal.SIGHUP: "hung up"}
SAME_SIGNAL_S = 0.25  # signals.SAME_SIGNAL_S, as §10 states it
CLOSE_GRACE_S = 5.0  # §12: the server waits 5 s for the client's close frame
TEXTS = ["Paris is the [MASK] of France.", "a [MASK] day.", "the [MASK] sat on the [MASK].",
         "a long sentence about the [MASK] and what came of it " * 6]
TERMINAL = {"result", "error", "overloaded", "cancelled"}
#: Every stderr line has one of these forms (README, --log-level; protocol.md §10's last words).
LOG_LINE = re.compile(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: \S.*"
    r"|loading \S.*|  \S.*|warning: \S.*|error: \S.*"
    r"|stopped at a second signal during the drain; every accepted request had been answered")
STOP_LINES = ("stopped at a second signal during the drain; every accepted request had been answered",
              "error: stopped before the drain finished; accepted requests were not all answered")


# --- plans ------------------------------------------------------------------------------------------

@dataclass
class ConnPlan:
    behaviour: str  # steady | burst (no pauses between sends) | close | abort | pause | late
    requests: int
    start_s: float  # after the clients start (late: after the first signal)
    cut_after: int = 0  # close/abort: after this many requests
    pause_after: int = 0  # pause: after this many frames read
    pause_s: float = 0.0


@dataclass
class Plan:
    seed: int
    mode: str  # serving | startup
    drain_delay: float
    shutdown_timeout: float
    send_timeout: float
    args: list[str]
    first: signal.Signals
    second: str  # none | twin | other | far | after_stop
    second_signal: signal.Signals
    signal_at_s: float
    conns: list[ConnPlan]


def draw_plan(seed: int) -> Plan:
    rng = random.Random(seed)
    drain_delay = rng.choice([0.0, 0.0, 1.0, 1.5])
    shutdown_timeout = rng.choice([1.0, 2.0, 3.0])
    send_timeout = rng.choice([3.0, 30.0])
    args = ["--drain-delay", f"{drain_delay:g}", "--shutdown-timeout", f"{shutdown_timeout:g}",
            "--send-timeout", f"{send_timeout:g}",
            "--max-queue", str(rng.choice([4, 16, 1024])), "--max-batch-size", str(rng.choice([1, 2, 8, 64])),
            "--max-inflight-per-connection", str(rng.choice([8, 256]))]
    mode = "startup" if rng.random() < 0.2 else "serving"
    first = rng.choice([signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
    second = rng.choice(["none", "twin", "other", "far", "after_stop"]) if mode == "serving" else \
        rng.choice(["none", "other"])
    if second == "far" and rng.random() < 0.6:  # mostly provably during the drain: within a SIGTERM's delay
        first, drain_delay = signal.SIGTERM, max(drain_delay, 1.5)
        args[1] = f"{drain_delay:g}"
    others = [s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if s != first]
    second_signal = first if second == "twin" else rng.choice(others if second == "other" else
                                                              [first, *others])
    conns: list[ConnPlan] = []
    for _ in range(rng.randint(1, 4) if mode == "serving" else 0):
        behaviour = rng.choice(["steady", "steady", "burst", "close", "abort", "pause", "late"])
        requests = 200 if behaviour == "burst" else rng.choice([3, 10, 30, 60])
        conns.append(ConnPlan(behaviour, requests, rng.uniform(0, 0.3) if behaviour != "late" else rng.uniform(0, 1.5),
                              cut_after=rng.randint(0, requests), pause_after=rng.randint(1, 10),
                              pause_s=rng.uniform(0.2, 1.2)))
    return Plan(seed, mode, drain_delay, shutdown_timeout, send_timeout, args, first, second, second_signal,
                rng.uniform(0.2, 1.5) if mode == "serving" else rng.uniform(0.0, 5.0), conns)


def describe(plan: Plan) -> str:
    conns = ", ".join(f"{c.behaviour}({c.requests}, at {c.start_s:.2f}s, cut {c.cut_after}, pause {c.pause_s:.2f}s "
                      f"after {c.pause_after})" for c in plan.conns)
    return (f"seed {plan.seed}: {plan.mode}, {' '.join(plan.args)}; {plan.first.name} at {plan.signal_at_s:.2f}s, "
            f"then {plan.second} {plan.second_signal.name}; connections: [{conns}]")


# --- records ----------------------------------------------------------------------------------------

@dataclass
class Sent:
    at: float
    after_going_away: bool  # the client had read going_away before sending it


@dataclass
class ConnRecord:
    plan: ConnPlan
    connected: bool = False
    refused: int | str | None = None  # the handshake's HTTP status, or why it failed
    attempted_at: float = 0.0
    refused_at: float = 0.0  # when the handshake's refusal or failure came
    sent: dict[str, Sent] = field(default_factory=dict)
    frames: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    going_away_at: float | None = None
    cut_at: float | None = None  # when we closed or aborted it
    paused: tuple[float, float] | None = None  # when reading paused and resumed
    close_code: int | None = None
    ended_at: float | None = None


@dataclass
class Run:
    plan: Plan
    started: float = 0.0
    ready_at: float | None = None
    url: str = ""
    http: tuple[str, int] = ("127.0.0.1", 0)
    stderr: list[tuple[float, str]] = field(default_factory=list)
    stdout: list[str] = field(default_factory=list)
    signals: list[tuple[float, signal.Signals]] = field(default_factory=list)
    polls: list[tuple[float, float, str, int | str]] = field(default_factory=list)  # start, end, path, status
    conns: list[ConnRecord] = field(default_factory=list)
    status: int | None = None
    exited_at: float | None = None
    hung: bool = False
    group_left: bool = False

    def logged_at(self, needle: str) -> float | None:
        return next((at for at, line in self.stderr if needle in line), None)


# --- the example ------------------------------------------------------------------------------------

async def _read_lines(stream: asyncio.StreamReader | None, into: list[Any], stamped: bool,
                      ready: asyncio.Event | None = None) -> None:
    assert stream is not None
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip("\n")
        into.append((time.monotonic(), text) if stamped else text)
        if ready is not None and text.startswith("ready: "):
            ready.set()
    if ready is not None:
        ready.set()  # (stdout ended: the process is leaving)


def _send_signal(run: Run, pid: int, signum: signal.Signals) -> None:
    at = time.monotonic()  # (before: the server cannot take it sooner)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)  # (os.kill: Popen.send_signal may reap the child behind asyncio's back)
        run.signals.append((at, signum))


async def _http_status(host: str, port: int, path: str) -> int | str:
    try:
        async with asyncio.timeout(5):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
                line = await reader.readline()
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
        parts = line.split()
        return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else f"bad status line {line!r}"
    except (OSError, TimeoutError) as exc:
        return f"no answer: {type(exc).__name__}"


async def _poll(run: Run, rng: random.Random, stop: asyncio.Event) -> None:
    host, port = run.http
    for i in range(2000):  # bounded: the process exits, or the example's timeout ends it
        if stop.is_set():
            return
        path = "/readyz" if i % 3 else "/healthz"
        begun = time.monotonic()
        status = await _http_status(host, port, path)
        run.polls.append((begun, time.monotonic(), path, status))
        await asyncio.sleep(rng.uniform(0.02, 0.12))


def _request(rng: random.Random, ident: str) -> dict[str, Any]:
    frame: dict[str, Any] = {"type": "fill_mask", "id": ident, "text": rng.choice(TEXTS)}
    if rng.random() < 0.4:
        frame["top_k"] = rng.choice([1, 5, 20])
    if rng.random() < 0.3:
        frame["deadline_ms"] = rng.choice([1, 30, 300, 5000])
    if rng.random() < 0.15:
        frame["targets"] = rng.choice([["capital", "heart"], "day", ["new york"]])
    return frame


async def _client(run: Run, rec: ConnRecord, index: int, rng: random.Random, signalled: asyncio.Event) -> None:
    plan = rec.plan
    if plan.behaviour == "late":
        await signalled.wait()
    await asyncio.sleep(plan.start_s)
    rec.attempted_at = time.monotonic()
    try:
        ws = await connect(run.url, max_size=None, max_queue=4, open_timeout=10, close_timeout=2,
                           ping_interval=None)
    except InvalidStatus as exc:
        rec.refused, rec.refused_at = exc.response.status_code, time.monotonic()
        return
    except (OSError, TimeoutError, ConnectionClosed) as exc:
        rec.refused, rec.refused_at = type(exc).__name__, time.monotonic()
        return
    rec.connected = True
    reader = asyncio.create_task(_reader(rec, ws))
    try:
        after_going_away = 0
        for i in range(plan.requests):
            if plan.behaviour in ("close", "abort") and i == plan.cut_after:
                rec.cut_at = time.monotonic()
                if plan.behaviour == "close":
                    with contextlib.suppress(ConnectionClosed, TimeoutError):
                        await ws.close()
                else:
                    ws.transport.abort()
                break
            if rec.going_away_at is not None:
                after_going_away += 1
                if after_going_away > 2:
                    break
            ident = f"c{index}-{i}"
            sent = Sent(time.monotonic(), rec.going_away_at is not None)
            await ws.send(orjson.dumps(_request(rng, ident)).decode())
            rec.sent[ident] = sent
            if rng.random() < 0.15:
                await ws.send(orjson.dumps({"type": "cancel", "id": f"c{index}-{rng.randint(0, i)}"}).decode())
            if plan.behaviour != "burst" and rng.random() < 0.5:
                await asyncio.sleep(rng.uniform(0, 0.08))
    except ConnectionClosed:
        pass
    await reader


async def _reader(rec: ConnRecord, ws: ClientConnection) -> None:
    read = 0
    try:
        while True:
            if rec.plan.behaviour == "pause" and read == rec.plan.pause_after and rec.paused is None:
                begun = time.monotonic()
                await asyncio.sleep(rec.plan.pause_s)
                rec.paused = (begun, time.monotonic())
            raw = await ws.recv()
            read += 1
            frame = orjson.loads(raw)
            now = time.monotonic()
            rec.frames.append((now, frame))
            if frame.get("type") == "going_away" and rec.going_away_at is None:
                rec.going_away_at = now
    except ConnectionClosed:
        pass
    rec.close_code = ws.close_code
    rec.ended_at = time.monotonic()


async def run_example(plan: Plan) -> Run:
    run = Run(plan)
    run.started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "ws_server.py", "--model", str(ROOT / "models" / "tiny"), "--port", "0", *FAST_START,
        *plan.args, cwd=ROOT, env=ENV, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its own process group: what is left of it is seen at the end
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    ready = asyncio.Event()
    readers = [asyncio.create_task(_read_lines(process.stdout, run.stdout, False, ready)),
               asyncio.create_task(_read_lines(process.stderr, run.stderr, True))]
    stop_polling = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        if plan.mode == "startup":
            async with asyncio.timeout(60):
                while not run.stderr and process.returncode is None:  # the first line: the handlers are in
                    await asyncio.sleep(0.01)
            await asyncio.sleep(plan.signal_at_s)
            _send_signal(run, process.pid, plan.first)
            if plan.second == "other":
                _send_signal(run, process.pid, plan.second_signal)
        else:
            await asyncio.wait_for(ready.wait(), 90)
            found = next((re.search(r"ready: (ws://(\S+):(\d+)/)", line) for line in run.stdout), None)
            assert found, f"no ready line: {run.stdout} {run.stderr[-5:]}"
            run.ready_at = time.monotonic()
            run.url, run.http = found.group(1), (found.group(2), int(found.group(3)))
            tasks.append(asyncio.create_task(_poll(run, random.Random(plan.seed + 17), stop_polling)))
            signalled = asyncio.Event()
            for index, conn in enumerate(plan.conns):
                run.conns.append(ConnRecord(conn))
                tasks.append(asyncio.create_task(_client(run, run.conns[-1], index,
                                                         random.Random(plan.seed * 31 + index), signalled)))
            await asyncio.sleep(plan.signal_at_s)
            _send_signal(run, process.pid, plan.first)
            signalled.set()
            await _second_signal(run, process)
        bound = _exit_bound(run)
        try:
            await asyncio.wait_for(process.wait(), max(1.0, bound - time.monotonic()))
        except TimeoutError:
            run.hung = True
            process.kill()
            await process.wait()
        run.status, run.exited_at = process.returncode, time.monotonic()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_GRACE_S + 5)
        run.group_left = True
        for _ in range(100):  # bounded: 5 s for the group's last member to go
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                run.group_left = False
                break
            await asyncio.sleep(0.05)
    finally:
        stop_polling.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if process.returncode is None:
            process.kill()
            await process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await asyncio.wait(readers, timeout=10)
    return run


async def _second_signal(run: Run, process: asyncio.subprocess.Process) -> None:
    plan = run.plan
    if plan.second == "twin":
        _send_signal(run, process.pid, plan.second_signal)  # back to back: the first delivered twice
    elif plan.second == "other":
        _send_signal(run, process.pid, plan.second_signal)
    elif plan.second == "far":
        async with asyncio.timeout(30):  # the first was taken: /readyz says so (or the process has gone)
            while process.returncode is None and await _http_status(*run.http, "/readyz") != 503:
                await asyncio.sleep(0.02)
        await asyncio.sleep(SAME_SIGNAL_S + 0.1)
        _send_signal(run, process.pid, plan.second_signal)
    elif plan.second == "after_stop":
        async with asyncio.timeout(plan.drain_delay + plan.shutdown_timeout + 30):
            while run.logged_at("fillmask_server.server: stopped") is None and process.returncode is None:
                await asyncio.sleep(0.01)
        _send_signal(run, process.pid, plan.second_signal)


def _delay(run: Run) -> float:
    return run.plan.drain_delay if run.plan.first == signal.SIGTERM else 0.0


def _exit_bound(run: Run) -> float:
    """When the process must have exited, generously: after its drain (delay, shutdown timeout, the
    running batch, the last second of reading and the close frame's 5 s), or soon after a stop."""
    first = run.signals[0][0] if run.signals else time.monotonic()
    return first + _delay(run) + run.plan.shutdown_timeout + 1 + CLOSE_GRACE_S + 20


# --- the checks ---------------------------------------------------------------------------------------

def expected_statuses(run: Run) -> set[int]:
    plan = run.plan
    sent = [signum for _, signum in run.signals]
    if not any(line.startswith("ready: ") for line in run.stdout):
        return {128 + int(signum) for signum in sent}
    if plan.mode == "startup":  # the signal raced the ready line: either phase's answer
        return {128 + int(signum) for signum in sent} | {0, 130}
    if len(sent) < 2 or plan.second == "twin" or plan.second == "after_stop":
        return {0}
    if plan.second == "other":
        return {130}
    (t1, _), (t2, _) = run.signals[:2]
    return {130} if t2 < t1 + _delay(run) else {0, 130}  # (still within the SIGTERM's delay: draining)


def check(run: Run) -> list[str]:
    plan, problems = run.plan, []
    say = problems.append
    if run.hung:
        say(f"the process had not exited {_exit_bound(run) - run.signals[0][0]:.1f} s after the first signal")
    expected = expected_statuses(run)
    if run.status not in expected:
        say(f"exit status {run.status}, expected one of {sorted(expected)}")
    text = "\n".join(line for _, line in run.stderr)
    if "Traceback" in text:
        say("a traceback on stderr")
    for _, line in run.stderr:
        if not LOG_LINE.fullmatch(line):
            say(f"an undocumented stderr line: {line!r}")
    last = run.stderr[-1][1] if run.stderr else ""
    ready = any(line.startswith("ready: ") for line in run.stdout)
    if run.status == 130 and ready and last not in STOP_LINES:
        say(f"exit 130 without §10's last line: {last!r}")
    if run.status in {129, 130, 143} and not ready:  # (two kinds at once: Python takes the lower number first)
        said = {f"error: {SIGNAL_NAMES[s]} before the server was ready" for _, s in run.signals}
        if last not in said:
            say(f"stopped before ready with {last!r}, not one of {sorted(said)}")
    if run.status == 0 and "fillmask_server.server: stopped" not in text:
        say("exit 0 without the drain's 'stopped' line")
    if run.group_left:
        say("a process of the server's group was still there after it exited")
    if plan.mode == "serving" and run.ready_at is not None:
        problems += check_polls(run)
        for rec in run.conns:
            problems += [f"connection {rec.plan.behaviour} #{run.conns.index(rec)}: {p}" for p in check_conn(run, rec)]
    return problems


def check_polls(run: Run) -> list[str]:
    problems: list[str] = []
    first = run.signals[0][0] if run.signals else float("inf")
    draining_logged = run.logged_at("received: draining")
    seen_503: float | None = None
    for begun, ended, path, status in run.polls:
        if path == "/healthz":
            if status != 200 and (not isinstance(status, str) or begun < first):
                problems.append(f"/healthz answered {status} at {begun - first:+.2f} s from the signal")
            continue
        if ended < first and status != 200:
            problems.append(f"/readyz answered {status} before any signal")
        if draining_logged is not None and begun > draining_logged and status == 200:
            problems.append(f"/readyz answered 200 {begun - draining_logged:.2f} s after the drain was logged")
        if seen_503 is not None and begun > seen_503 and status == 200:
            problems.append("/readyz answered 200 after it had answered 503")
        if status == 503 and seen_503 is None:
            seen_503 = ended
        if isinstance(status, int) and status not in (200, 503):
            problems.append(f"/readyz answered {status}")
    return problems


def check_conn(run: Run, rec: ConnRecord) -> list[str]:
    plan, problems = run.plan, []
    say = problems.append
    first = run.signals[0][0] if run.signals else float("inf")
    if not rec.connected:
        # (a handshake begun just before the signal may be read once the drain has begun: refused then)
        if isinstance(rec.refused, int) and (rec.refused != 503 or rec.refused_at < first):
            say(f"handshake refused with {rec.refused} ({rec.refused_at - first:+.2f} s from the signal)")
        if isinstance(rec.refused, str) and rec.refused_at < first:
            say(f"could not connect before any signal: {rec.refused}")
        return problems
    frames = [frame for _, frame in rec.frames]
    if frames and frames[0].get("type") != "hello":
        say(f"first frame {frames[0]}")
    going = [at for at, frame in rec.frames if frame.get("type") == "going_away"]
    if len(going) > 1:
        say(f"{len(going)} going_away frames")
    for _, frame in rec.frames:
        if frame.get("type") == "going_away" and (frame.get("reason"), frame.get("reconnect_within_ms")) != (
                "shutting_down", 1000):
            say(f"going_away {frame}")
    if going and going[0] < first + _delay(run):
        say(f"going_away {going[0] - first:.2f} s after SIGTERM, within --drain-delay {plan.drain_delay:g}")
    answers: dict[str, list[dict[str, Any]]] = {}
    for at, frame in rec.frames:
        kind = frame.get("type")
        if kind in ("hello", "going_away"):
            continue
        if kind not in TERMINAL:
            say(f"a frame of an unknown kind: {frame}")
            continue
        ident = frame.get("id")
        if ident not in rec.sent:
            say(f"an answer for an id never sent: {frame}")
            continue
        answers.setdefault(ident, []).append(frame)
        before_going_away = rec.going_away_at is None or at < rec.going_away_at
        reason = frame.get("reason")
        if kind == "overloaded" and reason == "shutting_down" and before_going_away:
            say(f"shutting_down before going_away: {frame}")
        if kind == "overloaded" and not before_going_away and reason not in ("shutting_down", "deadline_exceeded"):
            say(f"after going_away, an answer §10 does not allow: {frame}")
        if kind == "overloaded" and reason == "engine_stopped":
            say(f"engine_stopped without a fault: {frame}")
        if kind == "error" and frame.get("code") == "internal_error":
            say(f"internal_error: {frame}")
        if rec.sent[ident].after_going_away and not (kind == "overloaded" and reason == "shutting_down"):
            say(f"a request sent after going_away answered {frame}")
    for ident, got in answers.items():
        if len(got) > 1:
            say(f"{ident} answered {len(got)} times: {got}")
    cut = rec.cut_at is not None
    paused_long = rec.paused is not None and (
        rec.plan.pause_s >= plan.send_timeout / 2 or rec.paused[1] > first + plan.shutdown_timeout - 1.0)
    stopped = run.status != 0
    allowed = {1001} | ({1006} if stopped or paused_long or rec.paused is not None else set()) | (
        {1008} if paused_long else set())
    if not cut and rec.close_code not in allowed:
        say(f"closed with {rec.close_code}, allowed {sorted(allowed)}")
    if not cut and not stopped and not paused_long and run.status == 0:
        # Owed an answer: what the server had surely read before it closed. A request sent after the
        # signal may follow the close frame, which the client reads only later (RFC 6455: ignored), and
        # one sent while the client did not read may wait unread (§12): neither was accepted.
        owed_until = min(first, rec.paused[0] if rec.paused is not None else first)
        missing = [ident for ident, sent in rec.sent.items() if sent.at < owed_until and ident not in answers]
        if missing:
            say(f"{len(missing)} of {len(rec.sent)} requests without a terminal frame: {missing[:8]}")
        if not going:
            say("the drain ended without going_away")
    return problems


async def test_signals_at_random_moments_leave_every_request_answered_once_and_the_documented_exit() -> None:
    plans = [draw_plan(BASE_SEED * 1000 + i) for i in range(EXAMPLES)]
    gate = asyncio.Semaphore(CONCURRENT)

    async def one(plan: Plan) -> tuple[Plan, Run | BaseException]:
        async with gate:
            try:
                return plan, await asyncio.wait_for(run_example(plan), 150)
            except Exception as exc:  # (reported with its seed below)
                return plan, exc

    failures: list[str] = []
    async with asyncio.timeout(240):  # (a safety net: each example has its own bound)
        outcomes = await asyncio.gather(*(one(plan) for plan in plans))
    for plan, run in outcomes:
        if isinstance(run, BaseException):
            failures.append(f"{describe(plan)}\n  the example itself failed: {run!r}")
            continue
        problems = check(run)
        if problems:
            tail = "\n    ".join(line for _, line in run.stderr[-6:])
            failures.append(f"{describe(plan)}\n  exit {run.status}; " + "\n  ".join(problems[:12])
                            + f"\n  stderr's last lines:\n    {tail}")
    assert not failures, f"replay with LIFECYCLE_SEED={BASE_SEED} (or the example's seed // 1000):\n" + "\n".join(
        failures)


# --- what the examples found ------------------------------------------------------------------------

def _caught_signals(pid: int) -> int:
    """The mask of signals the process has handlers for (``SigCgt`` in ``/proc/PID/status``), or -1."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return -1
    found = re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M)
    return int(found.group(1), 16) if found else -1


def _imports_begun(pid: int) -> bool:
    """Whether ``ws_server.py``'s own imports run: websockets' speedups (the client package's, which
    ``fillmask_server.protocol`` imports; nothing in the interpreter's start loads it) are mapped."""
    try:
        return "websockets/speedups" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


#: The two ways to start the server: the script, and the console script (deploy/Dockerfile's command).
PROGRAMS = {"ws_server.py": [sys.executable, "ws_server.py"],
            "fillmask-server": [str(Path(sys.executable).with_name("fillmask-server"))]}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc to find the moment")
@pytest.mark.parametrize("program", list(PROGRAMS))
@pytest.mark.parametrize(("signum", "status", "said"), [
    (signal.SIGINT, 130, "error: interrupted before the server was ready"),
    (signal.SIGTERM, 143, "error: terminated before the server was ready"),
], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_server_is_still_importing_stops_with_128_plus_its_number_and_one_line(
        program: str, signum: signal.Signals, status: int, said: str) -> None:
    """§10: a signal before the server is ready stops it at once with 128 + its number and one line,
    from the program's first line on (before the interpreter has started nothing can be done). The
    moment here: the program's imports run (websockets is loaded), about a tenth of a second of every
    start. The server's handler must be there already (``SigCgt`` has SIGTERM): before, it came only
    once the imports were done, and a signal then ended SIGINT with a KeyboardInterrupt traceback and
    -2 (once a segfault, inside orjson's import), SIGTERM with -15 and no line."""
    command = PROGRAMS[program]
    if not Path(command[0]).exists():
        pytest.skip(f"{command[0]} is not installed (pip install -e .)")
    process = subprocess.Popen([*command, "--model", str(ROOT / "models" / "tiny"), "--port", "0", *FAST_START],
                               cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        until = time.monotonic() + 30
        while time.monotonic() < until and not _imports_begun(process.pid):  # bounded
            time.sleep(0.0005)
        caught = _caught_signals(process.pid)
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert caught != -1 and caught & (1 << (signal.SIGTERM - 1)), "no handler for SIGTERM while the imports ran"
    assert "Traceback" not in err, err[-2000:]
    assert process.returncode == status, (process.returncode, err[-2000:])
    assert err.strip().splitlines()[-1:] == [said], err[-2000:]
