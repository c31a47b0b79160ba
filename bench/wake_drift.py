"""How a sleeping OpenMP team's wake-up varies within one process, minute by minute (``layout.QuietLone``).

    .venv/bin/python bench/wake_drift.py                      # models/tiny, 7 minutes
    .venv/bin/python bench/wake_drift.py --minutes 2 --window-s 10

In-process, no server: a pass of the team (all the torch threads), ``--quiet-ms`` of sleep, then a lone
request timed on the team; the same again with the lone request timed on one thread; a pause, and
again. Every ``--window-s`` seconds one line: each count's median and mean, and the share of the
team's passes that took over twice one thread's median. The calibration times a lone request after
a quiet two or three times per count at start-up (``calibration.time_quiet_lone``): where this share
sits between a fifth and a half, such a median is a coin toss, which is why the engine times the
rule again while serving.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fillmask_server.calibration import THREAD_SHAPE, batch_items, usable_cpus  # noqa: E402
from fillmask_server.loading import load_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"))
    parser.add_argument("--minutes", type=float, default=7.0)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--quiet-ms", type=float, default=60.0, help="sleep after the team's pass")
    parser.add_argument("--team", type=int, default=0, help="the team's threads (0: the CPUs this process may use)")
    args = parser.parse_args(argv)
    import torch

    team = args.team or usable_cpus()
    if team < 2:
        parser.error(f"a team needs two threads or more, and this process may use {usable_cpus()} CPU(s)")
    model = load_model(args.model, threads=team)
    items = batch_items(model, 1, THREAD_SHAPE[1])
    for count in (1, team, team, 1, 1, team):  # (each count's graph, warm)
        torch.set_num_threads(count)
        model.forward(items)
    print(f"team of {team}, a lone request after {args.quiet_ms:.0f} ms of quiet | ms: team median, mean | "
          "one thread median, mean | team's passes over 2x one thread's median", flush=True)
    started = window_start = time.perf_counter()
    window: dict[int, list[float]] = {team: [], 1: []}
    while time.perf_counter() - started < args.minutes * 60:
        for count in (team, 1):
            torch.set_num_threads(team)
            model.forward(items)
            time.sleep(args.quiet_ms / 1000)
            torch.set_num_threads(count)
            clock = time.perf_counter()
            model.forward(items)
            window[count].append((time.perf_counter() - clock) * 1000)
        time.sleep(0.25)
        if time.perf_counter() - window_start >= args.window_s:
            one = statistics.median(window[1])
            slow = sum(ms > 2 * one for ms in window[team]) / len(window[team])
            print(f"{time.perf_counter() - started:5.0f} s | {statistics.median(window[team]):5.1f} "
                  f"{statistics.fmean(window[team]):5.1f} | {one:4.1f} {statistics.fmean(window[1]):4.1f} | "
                  f"{slow:4.0%} of {len(window[team])}", flush=True)
            window = {team: [], 1: []}
            window_start = time.perf_counter()
    return 0


if __name__ == "__main__":
    sys.exit(main())
