"""A lightly loaded server: each request comes after a quiet spell (``fillmask_server/layout.py``, ``QuietLone``).

    .venv/bin/python bench/quiet.py                    # models/tiny, 2, 10 and 30 req/s, about 5 min
    .venv/bin/python bench/quiet.py --model models/base --rates 2,10 --repeats 1

For each flag set of ``--configs`` (separated by commas; ``defaults`` is none), in turn and then in
reverse (ABBA, ``--repeats`` times), starts the server and sends Poisson arrivals at each of
``--rates`` requests a second over 4 connections (the short corpus), ``--window-s`` seconds each.
One row per start and rate: the client's p50 and p99 latency, the server's forward pass (its p50,
as its answers report it), the server's CPU per request (all its threads, OpenMP workers included:
a team that spins after each pass shows here) and what the start-up calibration logged for a lone
request after a quiet spell, and any change of it while serving. ``--quiet-lone off`` keeps every
request on its layout's threads, as the server did before the rule. ``missed`` is the defaults in a
start whose calibration saw the team wake fast (``FILLMASK_TEST_QUIET_LONE_MS``, set to
``--missed-ms``: tiny's times on the 2-core KVM guest in such a start), which the engine must put
right from the requests it serves (``layout.QuietLone``): its rows are what such a start serves
from the settling requests on, corrections included. The summary gives each flag set's medians
per rate.

    .venv/bin/python bench/quiet.py --configs 'defaults,--quiet-lone off,missed'
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.adaptive import run_order  # noqa: E402
from bench.corpus import make_short_corpus  # noqa: E402
from bench.server_proc import CpuMeter, ServerProcess  # noqa: E402
from fillmask_server.calibration import QUIET_LONE_ENV  # noqa: E402

RULE = re.compile(r"a lone request after (\d+) ms of quiet (runs on \d+ threads?|keeps \d+ threads) \(([^;)]*)")
CHANGE = re.compile(r"a lone request after \d+ ms of quiet now runs on (\d+) threads?, not (\d+)")


def rule(log: str) -> str:
    """What the calibration's start-up line says of a lone request after a quiet spell, shortened, and
    each change of it while serving (``before->after``)."""
    found = RULE.search(log)
    if found is None:
        return "not timed"
    changes = " ".join(f"{before}->{after}" for after, before in CHANGE.findall(log))
    return f"after {found[1]} ms {found[2]} ({found[3]})" + (f"; while serving {changes}" if changes else "")


def measure(model: Path, flags: list[str], rates: list[float], seconds: float, env: dict[str, str] | None = None
            ) -> tuple[str, list[dict[str, float]]]:
    """One start (``env`` beside this process's environment): the rule it logged, and a row of figures
    per rate."""
    texts = make_short_corpus()
    rows = []
    with ServerProcess(model, ["--log-level", "info", *flags], env=env) as server:
        asyncio.run(loadgen.settle(server.url))
        for rate in rates:
            meter = CpuMeter(server.pid)
            summary = asyncio.run(loadgen.open_loop(server.url, texts, 4, rate, 1.0, seconds))
            cpu = meter.stop()
            served = max(1e-9, summary["throughput_rps"])
            rows.append({"rate": rate, "p50": summary["latency_ms"]["p50"], "p99": summary["latency_ms"]["p99"],
                         "forward": summary["server_ms"]["inference_p50"], "cpu_ms": cpu.server / served * 1000})
        said = rule(Path(server.log_path).read_text())
    return said, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"))
    parser.add_argument("--configs", default="defaults,--quiet-lone off")
    parser.add_argument("--rates", default="2,10,30", help="requests a second, separated by commas")
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2, help="ABBA rounds (each runs every flag set twice)")
    parser.add_argument("--missed-ms", default="1:3.7,2:3.6",
                        help="the config 'missed': a lone request's ms after a quiet, by count, as its start sees "
                             "them (the default: tiny's, for a team of two)")
    args = parser.parse_args(argv)
    configs = [config.strip() for config in args.configs.split(",")]
    rates = [float(rate) for rate in args.rates.split(",")]
    figures: dict[tuple[str, float], list[dict[str, float]]] = {}
    print("flags | rate req/s | p50 ms | p99 ms | forward p50 ms | server CPU ms a request | "
          "lone request after a quiet")
    for repeat in range(2 * args.repeats):
        for config in run_order(configs, repeat):
            flags = [] if config in ("defaults", "missed") else config.split()
            env = {QUIET_LONE_ENV: args.missed_ms} if config == "missed" else None
            said, rows = measure(Path(args.model), flags, rates, args.window_s, env)
            for row in rows:
                figures.setdefault((config, row["rate"]), []).append(row)
                print(f"{config} | {row['rate']:.0f} | {row['p50']:.2f} | {row['p99']:.2f} | {row['forward']:.2f} | "
                      f"{row['cpu_ms']:.2f} | {said}", flush=True)
    print("\nmedians | rate req/s | p50 ms | p99 ms | forward p50 ms | server CPU ms a request")
    for (config, rate), rows in figures.items():
        print(f"{config} | {rate:.0f} | " + " | ".join(f"{statistics.median(row[key] for row in rows):.2f}"
                                                       for key in ("p50", "p99", "forward", "cpu_ms")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
