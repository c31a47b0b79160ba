"""The ``/healthz`` prober: a small child process, so that its timings share no GIL or event loop
with the load generator (whose loop is busy while the server is saturated).

    .venv/bin/python -m bench.probe --port 8765 --interval 0.02 --duration 10

Every ``--interval`` seconds (on a fixed grid; a probe that overruns skips the ticks it missed, so
probes never pile up) it opens a TCP connection to 127.0.0.1, sends ``GET /healthz HTTP/1.1`` and
reads the whole answer (the server closes the connection after it). The latency of one probe is
connect + request + full response. It prints one JSON object: ``latencies_ms`` of the successful
probes, ``failures`` (timeouts, refused connections, non-200 answers) and ``skipped`` ticks.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import Any

import orjson


def probe_once(port: int, timeout: float) -> float | None:
    """One ``GET /healthz``; its latency in ms, or None when it failed or did not answer 200."""
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(request)
            chunks: list[bytes] = []
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                chunks.append(chunk)
    except OSError:
        return None
    elapsed_ms = (time.perf_counter() - t0) * 1000
    answer = b"".join(chunks)
    if not answer.startswith(b"HTTP/1.1 200") or b'"ok"' not in answer:
        return None
    return elapsed_ms


def run(port: int, interval: float, duration: float, timeout: float) -> dict[str, Any]:
    """Probe on a fixed grid of ``interval`` seconds for ``duration`` seconds."""
    latencies: list[float] = []
    failures = 0
    skipped = 0
    start = time.perf_counter()
    tick = 0
    n_ticks = int(duration / interval)
    while tick < n_ticks:
        due = start + tick * interval
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        result = probe_once(port, timeout)
        if result is None:
            failures += 1
        else:
            latencies.append(result)
        next_tick = int((time.perf_counter() - start) / interval) + 1
        skipped += max(0, next_tick - tick - 1)
        tick = max(tick + 1, next_tick)
    return {"latencies_ms": latencies, "failures": failures, "skipped": skipped, "interval_s": interval}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Probe GET /healthz on a fixed interval and print latencies.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between probe starts")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds to probe for")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds before a probe counts as failed")
    args = parser.parse_args(argv)
    sys.stdout.write(orjson.dumps(run(args.port, args.interval, args.duration, args.timeout)).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
