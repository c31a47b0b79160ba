"""The ``/healthz`` prober: a small child process, so that its timings share no GIL or event loop
with the load generator (whose loop is busy while the server is saturated).

    .venv/bin/python -m bench.probe --port 8765 --interval 0.02 --duration 10

Every ``--interval`` seconds (on a fixed grid; a probe that overruns skips the ticks it missed, so
probes never pile up) it opens a TCP connection to 127.0.0.1, sends ``GET /healthz HTTP/1.1`` and
reads the whole answer (the server closes the connection after it). The latency of one probe runs
from its tick (when it was due, not when it started) to the end of the answer: connect + request +
full response, plus any wait for the probe before it. A skipped tick is a probe that would have
waited for the one that overran: it counts as a sample from its own tick to that answer's end, so a
stall of the server weighs on the percentiles as long as it lasted, not as one slow probe (the
"coordinated omission" of a prober that waits for each answer). It prints one JSON object:
``latencies_ms`` of the successful probes and the skipped ticks, ``failures`` (timeouts, refused
connections, non-200 answers; the ticks a failed probe skipped count as failures too) and
``skipped`` ticks.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import Any

import orjson


def probe_once(port: int, timeout: float) -> bool:
    """One ``GET /healthz``: whether it was answered 200 with ``"ok"`` within ``timeout``."""
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
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
        return False
    answer = b"".join(chunks)
    return answer.startswith(b"HTTP/1.1 200") and b'"ok"' in answer


def run(port: int, interval: float, duration: float, timeout: float) -> dict[str, Any]:
    """Probe on a fixed grid of ``interval`` seconds for ``duration`` seconds (see the module docstring)."""
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
        answered = probe_once(port, timeout)
        ended = time.perf_counter()
        next_tick = min(n_ticks, max(tick + 1, int((ended - start) / interval) + 1))
        missed = range(tick, next_tick)  # this probe's tick and those it overran
        if answered:
            latencies += [(ended - (start + t * interval)) * 1000 for t in missed]
        else:
            failures += len(missed)
        skipped += len(missed) - 1
        tick = next_tick
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
