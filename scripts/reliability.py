"""Reliability figures (issue 10): what one client can do to another, and to the server's memory.

    .venv/bin/python scripts/reliability.py                 # all scenarios, tiny model, default flags (~3 min)
    .venv/bin/python scripts/reliability.py --only hogs     # one of: neighbour, memory, slow, hogs

Each scenario starts its own ``ws_server.py`` (default flags unless said) and prints its figures and
the target they answer, then PASS or MISS:

- **neighbour**: a light probe's latency alone, then while another connection keeps 64 heavy-output
  requests in flight (8 masks, top_k 100) and reads promptly; its 1 s-deadline requests must not
  expire. Target: p50 with the neighbour ≤ 5 × p50 alone, no expiry.
- **memory**: four connections keep 256 heavy requests in flight each and read steadily at about
  300 KB/s; one more never reads. The server's RSS is sampled for ``--memory-s`` seconds, then again
  after every connection closed. Targets: peak ≤ baseline + ``--max-answer-bytes`` + 100 MB; after
  the close, within 100 MB of baseline.
- **slow**: one client reads 24 KB/s without pause, for longer than ``--send-timeout`` (default 30 s).
  Target: it gets every answer and is never closed.
- **hogs**: five connections keep 256 requests in flight each and resend at once on every refusal
  (reconnecting when closed); one polite connection sends one request at a time, waiting as told.
  Target: ≥ 95 % of the polite client's requests are served.

Exit status 0 when every target holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.server_proc import ServerProcess  # noqa: E402

LIGHT = "Paris is the [MASK] of France."
# Eight masks in about 420 characters: a result of roughly 0.4 MB at top_k 100, under the 1 MiB limit.
HEAVY_TEXT = " ".join(["the [MASK] of the old town by the river"] * 8) + " " + "and so on " * 10
HEAVY = {"text": HEAVY_TEXT, "top_k": 100}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


async def hello(url: str, **options: Any) -> ClientConnection:
    ws = await connect(url, max_size=None, **options)
    await ws.recv()
    return ws


async def probe(url: str, count: int, deadline_ms: float | None = None) -> tuple[list[float], int]:
    """One light request at a time: latencies (s) of results, and how many were answered otherwise."""
    ws = await hello(url)
    latencies, other = [], 0
    try:
        for i in range(count):
            frame: dict[str, Any] = {"type": "fill_mask", "id": i, "text": LIGHT}
            if deadline_ms:
                frame["deadline_ms"] = deadline_ms
            started = time.perf_counter()
            await ws.send(orjson.dumps(frame).decode())
            answer = orjson.loads(await ws.recv())
            if answer["type"] == "result":
                latencies.append(time.perf_counter() - started)
            else:
                other += 1
            await asyncio.sleep(0.02)
    finally:
        await ws.close()
    return latencies, other


async def keep_in_flight(url: str, depth: int, frame: dict[str, Any], stop: asyncio.Event,
                         read_delay: Callable[[int], float] = lambda n: 0.0) -> tuple[int, int | None]:
    """Keep ``depth`` requests in flight on one connection until ``stop``; read each answer after
    ``read_delay(its size)`` seconds (to read at a given rate). Returns the answers read, and the close
    code if the server closed the connection first."""
    ws = await hello(url)
    ids = itertools.count()
    read = 0
    closed: int | None = None
    try:
        for _ in range(depth):
            await ws.send(orjson.dumps({**frame, "type": "fill_mask", "id": next(ids)}).decode())
        while not stop.is_set():
            message = await ws.recv(decode=False)
            read += 1
            await asyncio.sleep(read_delay(len(message)))
            await ws.send(orjson.dumps({**frame, "type": "fill_mask", "id": next(ids)}).decode())
    except ConnectionClosed:
        closed = ws.close_code
    finally:
        await ws.close()
    return read, closed


async def scenario_neighbour(args: argparse.Namespace) -> bool:
    with ServerProcess(Path(args.model), list(args.server_args)) as server:
        await probe(server.url, 10)  # warm-up
        alone, _ = await probe(server.url, args.probes)
        stop = asyncio.Event()
        heavy = asyncio.create_task(keep_in_flight(server.url, 64, HEAVY, stop))
        await asyncio.sleep(2.0)  # the neighbour's queue fills
        with_neighbour, expired = await probe(server.url, args.probes, deadline_ms=1000)
        stop.set()
        heavy_read, _ = await heavy
    p50_alone, p50_with = statistics.median(alone) * 1000, statistics.median(with_neighbour) * 1000
    ok = p50_with <= 5 * p50_alone and expired == 0
    print(f"neighbour  light p50 alone {p50_alone:.1f} ms; with a heavy-output neighbour {p50_with:.1f} ms "
          f"({p50_with / p50_alone:.1f}x, target <= 5x), p99 {1000 * sorted(with_neighbour)[-1]:.1f} ms; "
          f"1 s-deadline requests not served: {expired} (target 0); the neighbour read {heavy_read} heavy "
          f"answers meanwhile -> {verdict(ok)}")
    return ok


async def scenario_memory(args: argparse.Namespace) -> bool:
    budget_mb = args.max_answer_bytes / 2**20
    server_args = [*args.server_args, "--max-answer-bytes", str(args.max_answer_bytes)]
    with ServerProcess(Path(args.model), server_args) as server:
        await probe(server.url, 10)
        baseline = rss_mb(server.pid)
        stop = asyncio.Event()
        rate = 300 * 1024  # bytes per second each steady reader takes
        readers = [asyncio.create_task(keep_in_flight(server.url, 256, HEAVY, stop, lambda n: n / rate))
                   for _ in range(4)]
        silent = await hello(server.url)
        for i in range(256):
            await silent.send(orjson.dumps({"type": "fill_mask", "id": i, **HEAVY}).decode())
        peak, started = baseline, time.monotonic()
        while time.monotonic() - started < args.memory_s:
            peak = max(peak, rss_mb(server.pid))
            await asyncio.sleep(0.5)
        stop.set()
        silent.transport.abort()
        answers = sum(read for read, _ in await asyncio.gather(*readers))
        await asyncio.sleep(5)  # closes seen, memory given back
        after = rss_mb(server.pid)
    ok = peak <= baseline + budget_mb + 100 and after <= baseline + 100
    print(f"memory     RSS baseline {baseline:.0f} MB, peak {peak:.0f} MB (+{peak - baseline:.0f}; target <= "
          f"+{budget_mb:.0f} budget +100) over {args.memory_s:g} s with 4 steady readers ({answers} heavy "
          f"answers) and 1 silent client; after every close {after:.0f} MB (+{after - baseline:.0f}; target "
          f"<= +100) -> {verdict(ok)}")
    return ok


async def scenario_slow(args: argparse.Namespace) -> bool:
    with ServerProcess(Path(args.model), list(args.server_args)) as server:
        stop = asyncio.Event()
        rate = 24 * 1024
        reader = asyncio.create_task(keep_in_flight(server.url, 8, HEAVY, stop, lambda n: n / rate))
        started = time.monotonic()
        await asyncio.sleep(args.slow_s)
        stop.set()
        read, closed = await reader
        elapsed = time.monotonic() - started
        metrics = await asyncio.to_thread(_metrics, server.port)
    slow_closed = metrics.get("fillmask_slow_clients_closed_total", 0.0)
    paused = metrics.get("fillmask_reading_paused_total", 0.0)
    ok = read > 0 and slow_closed == 0 and closed is None
    print(f"slow       a client reading 24 KB/s for {elapsed:.0f} s (send timeout {args.send_timeout:g} s) read "
          f"{read} heavy answers, its reading paused {int(paused)} times; closed: "
          f"{'no' if closed is None else closed} (target: never) -> {verdict(ok)}")
    return ok


def _metrics(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


async def hog(url: str, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """256 in flight, resending at once on every refusal; reconnects when closed."""
    while not stop.is_set():
        try:
            ws = await hello(url)
        except (OSError, InvalidStatus):
            await asyncio.sleep(0.05)
            continue
        ids = itertools.count()
        try:
            for _ in range(256):
                await ws.send(orjson.dumps({"type": "fill_mask", "id": next(ids), "text": LIGHT}).decode())
            while not stop.is_set():
                answer = orjson.loads(await ws.recv())
                counts[answer["type"]] = counts.get(answer["type"], 0) + 1
                await ws.send(orjson.dumps({"type": "fill_mask", "id": next(ids), "text": LIGHT}).decode())
        except ConnectionClosed:
            counts["closed"] = counts.get("closed", 0) + 1
        finally:
            with contextlib.suppress(Exception):
                await ws.close()


async def polite(url: str, seconds: float) -> tuple[int, int, int, list[float]]:
    """One request at a time; on a refusal it waits retry_after_ms and sends it again (at most 3 times)."""
    ws = await hello(url)
    sent = served = first_try = 0
    latencies = []
    started = time.monotonic()
    try:
        while time.monotonic() - started < seconds:
            sent += 1
            began = time.perf_counter()
            for attempt in range(4):
                await ws.send(orjson.dumps({"type": "fill_mask", "id": f"{sent}-{attempt}", "text": LIGHT}).decode())
                answer = orjson.loads(await ws.recv())
                if answer["type"] == "result":
                    served += 1
                    first_try += attempt == 0
                    latencies.append(time.perf_counter() - began)
                    break
                if answer["type"] != "overloaded" or answer["status"] == 504:
                    break
                await asyncio.sleep(answer["retry_after_ms"] / 1000)
            await asyncio.sleep(0.05)
    finally:
        await ws.close()
    return sent, served, first_try, latencies


async def scenario_hogs(args: argparse.Namespace) -> bool:
    with ServerProcess(Path(args.model), list(args.server_args)) as server:
        stop = asyncio.Event()
        counts: dict[str, int] = {}
        hogs = [asyncio.create_task(hog(server.url, stop, counts)) for _ in range(5)]
        await asyncio.sleep(1.0)
        sent, served, first_try, latencies = await polite(server.url, args.hogs_s)
        stop.set()
        await asyncio.gather(*hogs, return_exceptions=True)
        metrics = await asyncio.to_thread(_metrics, server.port)
    share = served / sent if sent else 0.0
    ok = share >= 0.95
    print(f"hogs       polite client: {served} of {sent} requests served ({100 * share:.1f}%, target >= 95%; "
          f"{first_try} at the first try), p50 {1000 * statistics.median(latencies or [0]):.0f} ms; the five "
          f"hogs saw {counts} and were closed {int(metrics.get('fillmask_resenders_closed_total', 0))} times "
          f"for resending before their retry_after_ms -> {verdict(ok)}")
    return ok


SCENARIOS: dict[str, Callable[[argparse.Namespace], Awaitable[bool]]] = {
    "neighbour": scenario_neighbour, "memory": scenario_memory, "slow": scenario_slow, "hogs": scenario_hogs,
}


async def main_async(args: argparse.Namespace) -> int:
    results = []
    for name in args.only or list(SCENARIOS):
        results.append(await SCENARIOS[name](args))
    return 0 if all(results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"), help="checkpoint (default models/tiny)")
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only this scenario")
    parser.add_argument("--probes", type=int, default=60, help="light requests per probe run")
    parser.add_argument("--memory-s", type=float, default=30, help="seconds of the memory scenario")
    parser.add_argument("--max-answer-bytes", type=int, default=268_435_456, help="the server's answer budget")
    parser.add_argument("--send-timeout", type=float, default=30, help="the server's --send-timeout")
    parser.add_argument("--slow-s", type=float, default=None, help="seconds of the slow reader (default: "
                        "--send-timeout + 10)")
    parser.add_argument("--hogs-s", type=float, default=20, help="seconds of the polite client among hogs")
    args = parser.parse_args(argv)
    args.slow_s = args.slow_s or args.send_timeout + 10
    args.server_args = ["--send-timeout", str(args.send_timeout)]
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
