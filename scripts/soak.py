"""Soak test: offered load at several times the server's capacity, then check that nothing broke.

    .venv/bin/python scripts/soak.py --duration 60            # a server of its own (models/tiny), 5x its capacity
    .venv/bin/python scripts/soak.py --duration 600 --model models/base --rss-bound-mb 800

It starts ``ws_server.py`` in a subprocess, measures its capacity (requests per second with full
batches), then offers ``--overload`` times that rate (or times the rate of results it sees, when that
is higher: a busy machine may have made the measurement low), open loop, over several connections, for
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

Exit status 0 when every check passes, 1 otherwise. The client runs no model code: it is bench/loadgen's
``Client`` (ignoring back-off), against a ``bench.server_proc.ServerProcess``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.loadgen import OTHER, OVERLOADED, RESULT, Client, Policy, Recorder, close_all, closed_loop, open_client  # noqa: E402
from bench.server_proc import ServerProcess, ServerStartError  # noqa: E402

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
#: The load resends at once whatever the server says: it is there to overload it.
NO_BACKOFF = Policy(backoff=False)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


class Sender:
    """One of the load's connections (a ``Client`` that ignores back-off, with its reader). When the server
    closes it with 1008 (the load does not back off), the requests still pending on it are discarded with
    the close (§8) and a new connection takes its place."""

    def __init__(self, url: str, recorder: Recorder, offset: int) -> None:
        self.url, self.recorder, self.offset = url, recorder, offset
        self.client: Client | None = None
        self.reader: asyncio.Task[None] | None = None
        self.discarded: set[int] = set()  # recorder indices
        self.closes = 0

    async def open(self) -> None:
        self.client = await open_client(self.url, SENTENCES, self.recorder, self.offset, policy=NO_BACKOFF)
        self.reader = asyncio.create_task(read_all(self.client))

    async def send(self, extra: dict[str, float] | None) -> None:
        assert self.client is not None and self.reader is not None
        if self.reader.done():
            await self.reopen()
        try:
            await self.client.send(extra=extra)
        except ConnectionClosed:
            await self.reopen()

    async def reopen(self) -> None:
        await self.retire()
        await self.open()

    async def retire(self) -> None:
        """The server closed the connection: what was pending on it is discarded (it must be a 1008)."""
        assert self.client is not None and self.reader is not None
        await close_all([self.client])
        await self.reader
        code = self.client.closed_by_server or self.client.ws.close_code
        if code != 1008:
            raise SystemExit(f"soak: the server closed a connection with {code}")
        self.closes += 1
        self.discarded |= set(self.client.pending.values())
        self.client.pending.clear()

    def closed_by_server(self) -> bool:
        return self.reader is not None and self.reader.done()

    async def close(self) -> None:
        if self.client is not None:
            await close_all([self.client])
        if self.reader is not None:
            await self.reader


async def read_all(client: Client) -> None:
    try:
        while True:
            await client.read_one()
    except ConnectionClosed as closed:
        client.closed_by(closed)


async def measure_capacity(url: str, batch: int, max_queue: int, windows: int = 3, seconds: float = 1.0) -> float:
    """Results per second with the queue never empty (closed loop, after a warm-up): the best of ``windows``
    short runs, since on a shared machine a neighbour's burst only ever makes a run slower, and a capacity
    measured low would offer too little to overload the server. One connection keeps at most half of the
    queue busy: more, and it would be told its fair share (§6)."""
    best = 0.0
    for _ in range(windows):
        summary = await closed_loop(url, SENTENCES, clients=1, in_flight=min(4 * batch, max_queue // 2),
                                    warmup_s=0.3, duration_s=seconds)
        if summary["overloaded"] or summary["errors"]:
            raise SystemExit(f"soak: the capacity run got {summary['answer_codes']}")
        best = max(best, float(summary["throughput_rps"]))
    if best == 0:
        raise SystemExit(f"soak: no result came back in {windows} capacity runs of {seconds:g} s")
    return best


async def offer_load(url: str, rate: float, overload: float, duration: float, connections: int,
                     recorder: Recorder) -> tuple[float, float, list[Sender]]:
    """Open loop: send ``rate`` requests/s spread over ``connections`` for ``duration`` s. After a second in
    which the server refused nothing, the rate becomes at least ``overload`` times the results of that
    second: a capacity measured low (a neighbour's burst on a shared machine during the measurement)
    would otherwise offer a load the server keeps up with. Returns the mean rate offered, the rate sent,
    and the senders (with what their closes discarded)."""
    senders = [Sender(url, recorder, (i * len(SENTENCES)) // connections) for i in range(connections)]
    for sender in senders:
        await sender.open()
    started = last = looked = time.monotonic()
    sent, due, offered, results_before, refused_before = 0, 0.0, 0.0, 0, 0
    while (now := time.monotonic()) - started < duration:
        if now - looked >= 1.0:
            results, refused = recorder.kind.count(RESULT), recorder.kind.count(OVERLOADED)
            if refused == refused_before:  # it kept up: not overloaded yet
                rate = max(rate, overload * (results - results_before) / (now - looked))
            looked, results_before, refused_before = now, results, refused
        due += (now - last) * rate
        offered += (now - last) * rate
        last = now
        while due >= 1:
            # some requests have deadlines, so that 504s occur too
            await senders[sent % connections].send({"deadline_ms": 250} if sent % 5 == 0 else None)
            sent += 1
            due -= 1
        await asyncio.sleep(0.005)
    elapsed = time.monotonic() - started
    sent_rate = sent / elapsed
    give_up = time.monotonic() + 30
    while unanswered(recorder, senders) and time.monotonic() < give_up:
        for sender in senders:  # closed after its last send: nothing will come on it
            if sender.closed_by_server() and sender.client is not None and sender.client.pending:
                await sender.retire()
        await asyncio.sleep(0.05)
    for sender in senders:
        await sender.close()
    return offered / elapsed, sent_rate, senders


def unanswered(recorder: Recorder, senders: list[Sender]) -> list[int]:
    """Requests with no terminal frame yet, but for those discarded with a 1008 close."""
    discarded = set().union(*(sender.discarded for sender in senders))
    return [i for i, kind in enumerate(recorder.kind) if kind == "" and i not in discarded]


def outcomes(recorder: Recorder) -> Counter[str]:
    """Terminal frames by kind: ``result``, ``error CODE``, ``STATUS REASON`` (overloaded)."""
    counts: Counter[str] = Counter({RESULT: recorder.kind.count(RESULT)} if RESULT in recorder.kind else {})
    for name, count in recorder.error_codes.items():
        counts[name if name[:1].isdigit() else f"error {name}"] += count
    return counts


async def soak(args: argparse.Namespace) -> int:
    server_args = ["--max-queue", str(args.max_queue), "--max-batch-size", str(args.max_batch_size)]
    try:
        with ServerProcess(Path(args.model), server_args, start_timeout=args.start_timeout) as server:
            failures = await overload_and_check(server, args)
    except ServerStartError as exc:
        print(f"soak: the server did not start: {str(exc).splitlines()[0]}")
        return 1
    if server.returncode != 0:  # it was sent SIGTERM at the end of the block: a clean drain exits 0
        failures.append(f"the server exited with status {server.returncode} after SIGTERM")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("soak: OK" if not failures else f"soak: {len(failures)} check(s) failed")
    return 1 if failures else 0


async def overload_and_check(server: ServerProcess, args: argparse.Namespace) -> list[str]:
    """The soak itself: capacity, the overload, the figures; returns the checks that failed."""
    failures: list[str] = []
    capacity = await measure_capacity(server.url, args.max_batch_size, args.max_queue)
    rss_start = server.rss_mb()
    rss_peak = rss_start
    recorder = Recorder()

    async def sample_rss() -> None:
        nonlocal rss_peak
        while True:
            rss_peak = max(rss_peak, server.rss_mb())
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample_rss())
    offered, sent_rate, senders = await offer_load(server.url, capacity * args.overload, args.overload,
                                                   args.duration, args.connections, recorder)
    sampler.cancel()
    rss_peak = max(rss_peak, server.rss_mb())

    counts = outcomes(recorder)
    missing = unanswered(recorder, senders)
    discarded = sum(len(sender.discarded) for sender in senders)
    closes = sum(sender.closes for sender in senders)
    admitted = sorted(done - sent for sent, done, kind in zip(recorder.sent, recorder.done, recorder.kind,
                                                              strict=True) if kind == RESULT)
    throughput = len(admitted) / args.duration
    latency_bound = args.latency_slack * (args.max_queue + 2 * args.max_batch_size) / max(throughput, 1) + 1.0
    ready = await asyncio.to_thread(http_status, f"http://127.0.0.1:{server.port}/readyz")

    print(f"capacity          {capacity:9.1f} requests/s (full batches of {args.max_batch_size})")
    print(f"offered           {offered:9.1f} requests/s (at least {args.overload:g}x), sent {sent_rate:.1f}/s for "
          f"{args.duration:g} s over {args.connections} connections")
    print(f"throughput        {throughput:9.1f} results/s under the overload")
    print(f"requests          {len(recorder.sent):9d} sent, {len(recorder.sent) - len(missing) - discarded} "
          f"answered, {len(missing)} unanswered, {discarded} discarded with {closes} 1008 closes "
          "(the load does not back off)")
    for name, count in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"  {name:<24}{count:9d}")
    if admitted:
        print(f"result latency    p50 {statistics.median(admitted) * 1000:.0f} ms, "
              f"p99 {admitted[int(0.99 * (len(admitted) - 1))] * 1000:.0f} ms, max {admitted[-1] * 1000:.0f} ms "
              f"(bound {latency_bound * 1000:.0f} ms)")
    print(f"server RSS        {rss_start:9.1f} MiB after warm-up, peak {rss_peak:.1f} MiB "
          f"(+{rss_peak - rss_start:.1f}, bound +{args.rss_bound_mb:g})")
    print(f"/readyz           {ready:9d}")

    failures += [f"a frame for no pending request: {stray}" for stray in recorder.strays[:10]]
    others = recorder.kind.count(OTHER)
    if others:
        failures.append(f"{others} requests were answered by a frame that is not terminal")
    if missing:
        failures.append(f"{len(missing)} requests got no terminal frame (first: {missing[:5]})")
    if sent_rate < 0.5 * offered:
        failures.append(f"the client sent only {sent_rate:.0f} requests/s of the {offered:.0f} offered "
                        "(it is too slow on this machine; use fewer --connections or a bigger model)")
    if not (counts.get("503 queue_full") or counts.get("429 queue_share")):
        failures.append("no request was refused with 503 queue_full or 429 queue_share: the server was not "
                        "overloaded")
    if not admitted:
        failures.append("no request got a result")
    elif admitted[-1] > latency_bound:
        failures.append(f"an admitted request took {admitted[-1]:.2f} s, over the bound {latency_bound:.2f} s")
    if not math.isfinite(rss_peak) or rss_peak - rss_start > args.rss_bound_mb:
        failures.append(f"server RSS grew by {rss_peak - rss_start:.1f} MiB, over {args.rss_bound_mb:g}")
    if ready != 200:
        failures.append(f"/readyz answered {ready} after the soak")
    return failures


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
