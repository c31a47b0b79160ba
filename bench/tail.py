"""Where a closed loop's tail comes from: its slowest requests against its middle ones, by stage.

    .venv/bin/python bench/tail.py                                   # tiny, mixed corpus, 32 x 4, 6 s
    .venv/bin/python bench/tail.py --corpus short --runs 2 --flags '--torch-threads 2'

Each run starts a server (``ws_server.py --model M`` and ``--flags``), runs the closed loop of
``bench/adaptive.py`` (32 clients x ``--in-flight``) and splits the latency of each request answered
in the closed loop's own window (from the end of its ``--warmup``, as its own p50 and p99 count), as
the client saw it, into the server's ``queue_ms`` and ``inference_ms`` (protocol.md's result frame)
and the rest (tokenizing, decoding, the sockets, the client). It prints those for the middle tenth
of the latencies and for the slowest 2%, and when the slowest 1% were sent, as bursts: a tail made of
a few bursts is an event in the server (a slow batch and the ones queued behind it); one spread over
the window is the machine's jitter (docs/performance-log.md, "Probes that stop when they know").
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.adaptive import corpus_texts, hello_threads  # noqa: E402
from bench.run import ensure_checkpoint  # noqa: E402
from bench.server_proc import ServerProcess  # noqa: E402

BURST_GAP_S = 0.1  # slow requests sent closer together than this belong to one burst


def decompose(recorder: loadgen.Recorder, window: tuple[float, float]) -> dict[str, Any]:
    """The answered requests done within ``window`` (perf_counter seconds): their p50 and p99, each
    band's medians (``middle``: the 45th to 55th percentile of latency; ``tail``: the slowest 2%) of
    latency, queue, inference and the rest, in ms, and ``bursts``: (seconds into the window, requests)
    for the slowest 1%, grouped by ``BURST_GAP_S``."""
    rows = sorted(((done - sent) * 1000, queue, inference, sent)
                  for sent, done, kind, queue, inference in zip(recorder.sent, recorder.done, recorder.kind,
                                                                recorder.queue_ms, recorder.inference_ms, strict=True)
                  if kind == loadgen.RESULT and window[0] <= done <= window[1] and not math.isnan(queue))
    if len(rows) < 100:
        raise ValueError(f"{len(rows)} answered requests in the window: too few for a p99")
    n = len(rows)

    def band(part: list[tuple[float, float, float, float]]) -> dict[str, float]:
        latency = statistics.median(r[0] for r in part)
        queue = statistics.median(r[1] for r in part)
        inference = statistics.median(r[2] for r in part)
        return {"latency_ms": latency, "queue_ms": queue, "inference_ms": inference,
                "rest_ms": latency - queue - inference}

    bursts: list[list[float]] = []
    for sent in sorted(r[3] - window[0] for r in rows[int(n * 0.99):]):
        if bursts and sent - bursts[-1][0] - bursts[-1][1] <= BURST_GAP_S:
            bursts[-1][1] = sent - bursts[-1][0]
            bursts[-1][2] += 1
        else:
            bursts.append([sent, 0.0, 1])
    return {"requests": n, "p50_ms": rows[n // 2][0], "p99_ms": rows[int(n * 0.99)][0],
            "middle": band(rows[int(n * 0.45): int(n * 0.55)]), "tail": band(rows[int(n * 0.98):]),
            "bursts": [(round(start, 2), int(count)) for start, _, count in bursts]}


async def run(model: Path, size: str, corpus: str, flags: list[str], in_flight: int, warmup: float,
              duration: float) -> dict[str, Any]:
    texts = corpus_texts(model, size, corpus)
    with ServerProcess(model, flags) as server:
        await loadgen.settle(server.url)
        threads = [await hello_threads(server.url)]
        recorder = loadgen.Recorder()
        # Its own window: the warm-up starts only once all 32 connections have read their hellos, so a
        # window timed from before the call opened that long before the warm-up ended.
        summary = await loadgen.closed_loop(server.url, texts, 32, in_flight, warmup, duration, recorder=recorder)
        threads.append(await hello_threads(server.url))
    return {**decompose(recorder, summary["window"]), "torch_threads": threads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", help="tiny, base, or families/NAME (under models/)")
    parser.add_argument("--corpus", default="mixed")
    parser.add_argument("--flags", default="", help="the server's extra flags, as one string")
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    models = ROOT / "models"
    model = ensure_checkpoint(args.size, models) if args.size in ("tiny", "base") else models / args.size
    for n in range(args.runs):
        got = asyncio.run(run(model, args.size, args.corpus, shlex.split(args.flags), args.in_flight, args.warmup,
                              args.duration))
        print(f"run {n + 1}: {args.size}, {args.corpus}, flags '{args.flags}': {got['requests']} requests, "
              f"p50 {got['p50_ms']:.1f} ms, p99 {got['p99_ms']:.1f} ms ({got['p99_ms'] / got['p50_ms']:.2f}x); "
              "torch threads {} before the load, {} after".format(*got["torch_threads"]))
        for name in ("middle", "tail"):
            b = got[name]
            print(f"  {name:6s}: latency {b['latency_ms']:.1f} = queue {b['queue_ms']:.1f} + inference "
                  f"{b['inference_ms']:.1f} + rest {b['rest_ms']:.1f} ms")
        print("  slowest 1% sent at (s into the window, requests): "
              + ", ".join(f"{start:.2f} ({count})" for start, count in got["bursts"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
