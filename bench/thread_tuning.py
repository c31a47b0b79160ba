"""The torch thread count measured again while serving (``fillmask_server/tuning.py``), shown end to end.

    .venv/bin/python bench/thread_tuning.py       # models/families-small/bert (written if missing), 2 min
    .venv/bin/python bench/thread_tuning.py --model models/tiny --windows 6
    .venv/bin/python bench/thread_tuning.py --model models/tiny --idle 50 --in-flight 1,4 --windows 6 --window-s 5

A neighbour keeps one core busy (a Python process that never sleeps) while the server starts and
calibrates, and leaves once the server is ready: on two cores the calibration then times two threads
no faster than one (each pass waits for the worker the neighbour holds up) and picks one. Closed-loop
windows follow (32 clients x 4 in flight, the short corpus); each prints its throughput and the
layout in use: its torch threads and the parts a batch runs in (``fillmask_torch_threads`` and
``fillmask_forward_parts`` on /metrics). Last, a reference: the same server pinned to the layout the
tuned one ended on (``--torch-threads`` and ``--forward-parts``), started on the quiet machine.

``--idle N`` first sends N lone requests one at a time, and ``--in-flight 1,4`` gives the windows'
requests in flight per client in turn (the last for the rest): bench/run.py's order of phases, a
load whose batches grow (tuning.py, "A verdict holds for the load it was measured under").
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.corpus import make_short_corpus  # noqa: E402
from bench.server_proc import ServerProcess  # noqa: E402
from fillmask_server.checkpoint import ensure_family  # noqa: E402

SPIN = "import time\nuntil = time.monotonic() + 600\nwhile time.monotonic() < until:\n    pass\n"


def layout_in_use(port: int) -> tuple[int, int]:
    """(torch threads, forward parts) on the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        gauges = dict(line.split()[:2] for line in answer.read().decode().splitlines()
                      if line.startswith(("fillmask_torch_threads ", "fillmask_forward_parts ")))
    if "fillmask_torch_threads" not in gauges:
        raise RuntimeError("no fillmask_torch_threads on /metrics")
    return int(float(gauges["fillmask_torch_threads"])), int(float(gauges.get("fillmask_forward_parts", 1)))


def layout_words(layout: tuple[int, int]) -> str:
    threads, parts = layout
    return f"{threads} threads" + (f" in {parts} parts" if parts > 1 else " in one pass")


def window(server: ServerProcess, texts: list[str], seconds: float, in_flight: int = 4) -> tuple[float, float]:
    """One closed-loop window: its req/s and its mean rows a batch."""
    summary = asyncio.run(loadgen.closed_loop(server.url, texts, 32, in_flight, 0.5, seconds))
    asyncio.run(loadgen.settle(server.url))
    return float(summary["throughput_rps"]), float(summary["batch"]["mean_rows_per_batch"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory (default: models/families-small/bert, written if missing)")
    parser.add_argument("--windows", type=int, default=10, help="closed-loop windows after the start")
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--idle", type=int, default=0, help="lone requests, one at a time, before the windows")
    parser.add_argument("--in-flight", default="4",
                        help="comma-separated: each window's requests in flight per client, in turn (the last "
                             "for the rest)")
    args = parser.parse_args(argv)
    in_flight = [int(k) for k in args.in_flight.split(",")]
    model = Path(args.model) if args.model else ensure_family("bert", ROOT / "models" / "families-small", "small")
    texts = make_short_corpus()
    neighbour = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        server = ServerProcess(model, ["--log-level", "info"])
        server.__enter__()
    finally:
        neighbour.kill()
        neighbour.wait()
    try:
        calibrated = [line for line in server.log_lines() if "calibrated in" in line]
        print(f"started beside a busy core: {calibrated[-1].split('INFO fillmask_server: ')[-1][:110]}")
        started = time.monotonic()
        if args.idle:
            idle = asyncio.run(loadgen.idle_single(server.url, texts, args.idle))
            print(f"{args.idle} lone requests (t = {time.monotonic() - started:5.1f} s): p50 "
                  f"{idle['latency_ms']['p50']:.2f} ms at {layout_words(layout_in_use(server.port))}")
        last = (0, 1)
        for n in range(args.windows):
            k = in_flight[min(n, len(in_flight) - 1)]
            rps, rows = window(server, texts, args.window_s, k)
            last = layout_in_use(server.port)
            print(f"window {n + 1:2d} (t = {time.monotonic() - started:5.1f} s, 32 x {k}, {rows:4.1f} rows a batch): "
                  f"{rps:8.1f} req/s at {layout_words(last)}")
        switches = [line.split("INFO fillmask_server.engine: ")[-1].split(": ")[0] + (
                        ": " + line.split("; ")[-1] if "second look" in line else "")
                    for line in server.log_lines()
                    if "fillmask_server.engine" in line and (" -> " in line or "second look" in line)]
        print("switches:", "; ".join(switches) or "none")
    finally:
        server.__exit__(None, None, None)
    pinned = ["--torch-threads", str(last[0]), "--forward-parts", str(last[1])]
    with ServerProcess(model, pinned) as reference:
        rates = [window(reference, texts, args.window_s, in_flight[-1])[0] for _ in range(2)]
    print(f"reference, {' '.join(pinned)} on the quiet machine: {max(rates):.1f} req/s (best of 2 windows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
