"""Soak test: offered load at several times the server's capacity, then check that nothing broke.

    .venv/bin/python scripts/soak.py --duration 60            # a server of its own (models/tiny), 5x its capacity
    .venv/bin/python scripts/soak.py --duration 600 --model models/base --rss-bound-mb 800

It starts ``ws_server.py`` in a subprocess, measures its capacity (requests per second with full
batches), then offers ``--overload`` times that rate, open loop, over several connections, for
``--duration`` seconds. Afterwards it checks, and prints, that:

- every request got exactly one terminal frame (result, error, overloaded or cancelled; protocol.md §8),
  but for those in flight on a connection the server closed with 1008 because its client kept sending
  before its retry_after_ms (§12: this load ignores back-off on purpose); those are discarded with the
  close (§8), counted apart, and the connection is opened again;
- the server's RSS grew by at most ``--rss-bound-mb`` over its level after warm-up;
- admitted requests (those with a result) waited no longer than a full queue takes to clear at the
  rate the server kept up under the overload: ``(max_queue + 2 x max_batch_size) / throughput``,
  times ``--latency-slack``, plus one second (the queue bound, not the load, bounds the latency);
- the server still answers ``/readyz`` with 200, and exits 0 on SIGTERM.

Exit status 0 when every check passes, 1 otherwise. The client runs no model code (websockets, orjson).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parent.parent
TERMINAL = ("result", "error", "overloaded", "cancelled")
SENTENCES = [
    "After years of careful research the scientists finally announced that the [MASK] had been found deep "
    "beneath the ice of the southern continent, where nobody had ever thought to look for it.",
    "She walked into the old library on the corner of the square, took a dusty [MASK] from the top shelf and "
    "sat down by the window to read until the light was gone.",
    "The committee met on Tuesday morning to discuss the [MASK] of the new bridge, which had been delayed twice "
    "because of the storms and a shortage of steel.",
    "Every summer the family drove to the coast, rented a small house near the [MASK] and spent the long "
    "evenings playing cards and listening to the radio.",
    "Paris is the [MASK] of France.",
    "He plays the [MASK] in a small jazz band that meets in the basement of the old cinema every Friday night.",
]


@dataclass
class Tally:
    """What the client saw: send times, terminal frames per id, and anything that broke the rules."""

    sent_at: dict[str, float] = field(default_factory=dict)
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    discarded: set[str] = field(default_factory=set)  # in flight on a connection closed with 1008
    closes: int = 0
    latency_s: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def record(self, frame: dict[str, Any]) -> None:
        kind, frame_id = frame.get("type"), frame.get("id")
        if kind not in TERMINAL:
            self.problems.append(f"unexpected frame {str(frame)[:120]}")
            return
        if frame_id not in self.sent_at:
            self.problems.append(f"answer for an id never sent: {str(frame)[:120]}")
        elif frame_id in self.answers:
            self.problems.append(f"second terminal frame for {frame_id}: {str(frame)[:120]}")
        else:
            self.answers[frame_id] = frame
            self.latency_s[frame_id] = time.monotonic() - self.sent_at[frame_id]

    def outcome(self, frame: dict[str, Any]) -> str:
        if frame["type"] == "error":
            return f"error {frame.get('code')}"
        if frame["type"] == "overloaded":
            return f"{frame.get('status')} {frame.get('reason')}"
        return frame["type"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        match = re.search(r"VmRSS:\s+(\d+) kB", status.read())
    return int(match.group(1)) / 1024 if match else 0.0


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


async def start_server(args: argparse.Namespace) -> tuple[asyncio.subprocess.Process, str]:
    command = [sys.executable, str(ROOT / "ws_server.py"), "--model", args.model, "--port", "0",
               "--max-queue", str(args.max_queue), "--max-batch-size", str(args.max_batch_size),
               "--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "PYTHONUNBUFFERED": "1"}
    process = await asyncio.create_subprocess_exec(*command, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), args.start_timeout)).decode()
    found = re.search(r"ready: (ws://\S+)", line)
    if not found:
        process.kill()
        raise SystemExit(f"soak: the server did not start (its first line: {line.strip()!r})")
    return process, found.group(1)


async def reader(ws: ClientConnection, tally: Tally) -> None:
    try:
        async for message in ws:
            tally.record(orjson.loads(message))
    except ConnectionClosed:
        pass


class Sender:
    """One of the load's connections: it remembers the ids in flight on it, and when the server closes it
    with 1008 (the load does not back off), counts them as discarded and opens a new one."""

    def __init__(self, url: str, tally: Tally) -> None:
        self.url, self.tally = url, tally
        self.ws: ClientConnection | None = None
        self.reader: asyncio.Task[None] | None = None
        self.in_flight: set[str] = set()

    async def open(self) -> None:
        self.ws = await connect(self.url, max_size=None)
        await self.ws.recv()  # hello
        self.reader = asyncio.create_task(reader(self.ws, self.tally))

    async def send(self, request_id: str, frame: dict[str, Any]) -> None:
        assert self.ws is not None
        if self.ws.close_code == 1008 or (self.reader is not None and self.reader.done()):
            await self.reopen()
        self.in_flight = {i for i in self.in_flight if i not in self.tally.answers}
        self.in_flight.add(request_id)
        self.tally.sent_at[request_id] = time.monotonic()
        try:
            await self.ws.send(orjson.dumps(frame).decode())
        except ConnectionClosed:
            await self.reopen()

    async def reopen(self) -> None:
        assert self.ws is not None and self.reader is not None
        with contextlib.suppress(ConnectionClosed):
            await self.ws.close()
        await self.reader
        if self.ws.close_code != 1008:
            raise SystemExit(f"soak: the server closed a connection with {self.ws.close_code}")
        self.tally.closes += 1
        self.tally.discarded |= {i for i in self.in_flight if i not in self.tally.answers}
        self.in_flight = set()
        await self.open()

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.reader is not None:
            await self.reader


async def measure_capacity(url: str, batch: int, max_queue: int, seconds: float = 2.0) -> float:
    """Results per second with the queue never empty (closed loop, after a warm-up batch). One connection
    keeps at most half of the queue busy: more, and it would be told its fair share (§6)."""
    window = min(4 * batch, max_queue // 2)
    async with connect(url, max_size=None) as ws:
        await ws.recv()
        sent = 0

        async def send_one() -> None:
            nonlocal sent
            await ws.send(orjson.dumps({"type": "fill_mask", "id": f"cap-{sent}",
                                        "text": SENTENCES[sent % len(SENTENCES)]}).decode())
            sent += 1

        async def take_one() -> None:
            frame = orjson.loads(await ws.recv())
            if frame["type"] != "result":
                raise SystemExit(f"soak: the capacity run got {frame}")

        for _ in range(batch):  # warm-up
            await send_one()
        for _ in range(batch):
            await take_one()
        for _ in range(window):
            await send_one()
        started, done = time.monotonic(), 0
        while time.monotonic() - started < seconds:
            await take_one()
            done += 1
            await send_one()
        elapsed = time.monotonic() - started
        for _ in range(window):
            await take_one()
    return done / elapsed


async def offer_load(url: str, rate: float, duration: float, connections: int, tally: Tally) -> float:
    """Open loop: send ``rate`` requests/s spread over ``connections`` for ``duration`` s; return the rate sent."""
    senders = [Sender(url, tally) for _ in range(connections)]
    for sender in senders:
        await sender.open()
    started = time.monotonic()
    sent = 0
    while (now := time.monotonic()) - started < duration:
        due = int((now - started) * rate) - sent
        for _ in range(due):
            request_id = f"s{sent}"
            frame: dict[str, Any] = {"type": "fill_mask", "id": request_id, "text": SENTENCES[sent % len(SENTENCES)]}
            if sent % 5 == 0:
                frame["deadline_ms"] = 250  # some requests have deadlines, so that 504s occur too
            await senders[sent % connections].send(request_id, frame)
            sent += 1
        await asyncio.sleep(0.005)
    sent_rate = sent / (time.monotonic() - started)
    give_up = time.monotonic() + 30
    while len(tally.answers) + len(tally.discarded) < len(tally.sent_at) and time.monotonic() < give_up:
        await asyncio.sleep(0.05)
    for sender in senders:
        await sender.close()
    return sent_rate


async def soak(args: argparse.Namespace) -> int:
    process, url = await start_server(args)
    http = url.replace("ws://", "http://").rstrip("/")
    failures: list[str] = []
    try:
        capacity = await measure_capacity(url, args.max_batch_size, args.max_queue)
        rss_start = rss_mb(process.pid)
        rss_peak = rss_start
        tally = Tally()

        async def sample_rss() -> None:
            nonlocal rss_peak
            while True:
                rss_peak = max(rss_peak, rss_mb(process.pid))
                await asyncio.sleep(0.2)

        sampler = asyncio.create_task(sample_rss())
        offered = capacity * args.overload
        sent_rate = await offer_load(url, offered, args.duration, args.connections, tally)
        sampler.cancel()
        rss_peak = max(rss_peak, rss_mb(process.pid))

        outcomes = Counter(tally.outcome(frame) for frame in tally.answers.values())
        missing = [i for i in tally.sent_at if i not in tally.answers and i not in tally.discarded]
        admitted = sorted(tally.latency_s[i] for i, f in tally.answers.items() if f["type"] == "result")
        throughput = len(admitted) / args.duration
        latency_bound = args.latency_slack * (args.max_queue + 2 * args.max_batch_size) / max(throughput, 1) + 1.0
        ready = await asyncio.to_thread(http_status, http + "/readyz")

        print(f"capacity          {capacity:9.1f} requests/s (full batches of {args.max_batch_size})")
        print(f"offered           {offered:9.1f} requests/s ({args.overload:g}x), sent {sent_rate:.1f}/s for "
              f"{args.duration:g} s over {args.connections} connections")
        print(f"throughput        {throughput:9.1f} results/s under the overload")
        print(f"requests          {len(tally.sent_at):9d} sent, {len(tally.answers)} answered, "
              f"{len(missing)} unanswered, {len(tally.discarded)} discarded with {tally.closes} 1008 closes "
              "(the load does not back off)")
        for name, count in sorted(outcomes.items(), key=lambda item: -item[1]):
            print(f"  {name:<24}{count:9d}")
        if admitted:
            print(f"result latency    p50 {statistics.median(admitted) * 1000:.0f} ms, "
                  f"p99 {admitted[int(0.99 * (len(admitted) - 1))] * 1000:.0f} ms, max {admitted[-1] * 1000:.0f} ms "
                  f"(bound {latency_bound * 1000:.0f} ms)")
        print(f"server RSS        {rss_start:9.1f} MiB after warm-up, peak {rss_peak:.1f} MiB "
              f"(+{rss_peak - rss_start:.1f}, bound +{args.rss_bound_mb:g})")
        print(f"/readyz           {ready:9d}")

        failures += tally.problems[:10]
        if missing:
            failures.append(f"{len(missing)} requests got no terminal frame (first: {missing[:5]})")
        if sent_rate < 0.5 * offered:
            failures.append(f"the client sent only {sent_rate:.0f} requests/s of the {offered:.0f} offered "
                            "(it is too slow on this machine; use fewer --connections or a bigger model)")
        if not (outcomes.get("503 queue_full") or outcomes.get("429 queue_share")):
            failures.append("no request was refused with 503 queue_full or 429 queue_share: the server was not "
                            "overloaded")
        if not admitted:
            failures.append("no request got a result")
        elif admitted[-1] > latency_bound:
            failures.append(f"an admitted request took {admitted[-1]:.2f} s, over the bound {latency_bound:.2f} s")
        if rss_peak - rss_start > args.rss_bound_mb:
            failures.append(f"server RSS grew by {rss_peak - rss_start:.1f} MiB, over {args.rss_bound_mb:g}")
        if ready != 200:
            failures.append(f"/readyz answered {ready} after the soak")
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                code = await process.wait()
            if code != 0:
                failures.append(f"the server exited with status {code} after SIGTERM")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("soak: OK" if not failures else f"soak: {len(failures)} check(s) failed")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=60, help="seconds of overload (default 60)")
    parser.add_argument("--overload", type=float, default=5, help="offered load / capacity (default 5)")
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"), help="model of the server")
    parser.add_argument("--connections", type=int, default=8, help="client connections (default 8)")
    parser.add_argument("--max-queue", type=int, default=256, help="the server's --max-queue (default 256)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="the server's --max-batch-size")
    parser.add_argument("--rss-bound-mb", type=float, default=200, help="allowed RSS growth (default 200)")
    parser.add_argument("--latency-slack", type=float, default=3, help="factor on the queue-clearing time")
    parser.add_argument("--start-timeout", type=float, default=120, help="seconds to wait for the server")
    args = parser.parse_args(argv)
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
