"""Issue 17's side-by-side figures: the cost-model batching against hand-set flags and against the seed
design (``bench/peers/seed.py``), and the forward pass in the server against the same batches in-process.

    .venv/bin/python bench/adaptive.py --sizes tiny --corpora short,mixed --duration 8
    .venv/bin/python bench/adaptive.py --sizes families/esm --corpora short --in-flight 8 --no-seed \
        --configs 'defaults,--gil-switch-ms 0.2' --repeats 4

For each size and corpus, one real server per flag set (defaults first, then a sweep of hand-set
flags, then the seed design unless ``--no-seed``), interleaved over ``--repeats``: every set once in that
order, then once in reverse, and so on (``run_order``), so that a machine whose speed drifts over the
run favours no set (give an even ``--repeats`` for that to hold). 32 closed-loop
clients x ``--in-flight`` (4); it prints req/s, p50/p99 (medians, and each repeat's req/s and p99,
which show the run-to-run spread), rows per batch, the defaults' ratios to the best of the sweep and
to the seed design (at the same concurrency, and in an open loop at the same arrival rate:
``SEED_OPEN_SHARE``), against issue 17's goals, and the flag sets ahead of the defaults on both req/s
and p99. Then, for the default server's batches (their shapes, rows x padded width, from the results'
``batch_size`` and ``batch_tokens``), it times the same shapes in a child process with the same torch
thread count (``model.forward`` alone, nothing else running) and prints the server's per-batch forward
time (``inference_ms``) against it. Last, what each server's log said of its engine (``log_lines``).
Figures on a shared machine are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import json
import math
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loadgen, report  # noqa: E402
from bench.pipeline_limits import bench_corpus  # noqa: E402
from bench.server_proc import ServerProcess  # noqa: E402

SWEEP = {
    "defaults": [],
    "--max-length-ratio 1.15": ["--max-length-ratio", "1.15"],
    "--max-length-ratio 3": ["--max-length-ratio", "3"],
    "--max-batch-size 32": ["--max-batch-size", "32"],
    "--anticipate-ms 30": ["--anticipate-ms", "30"],
    "--torch-threads 1": ["--torch-threads", "1"],
    "--gil-switch-ms 0.2": ["--gil-switch-ms", "0.2"],
    "--gil-switch-ms 0.5": ["--gil-switch-ms", "0.5"],
    "--gil-switch-ms 1": ["--gil-switch-ms", "1"],
    "--gil-switch-ms 5": ["--gil-switch-ms", "5"],
}

INPROCESS = r"""
import json, sys, time
import torch
from fillmask_server.loading import load_model
from fillmask_server.calibration import _LayoutTimer, batch_items
model_dir, threads, shapes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
parts = int(sys.argv[4]) if len(sys.argv) > 4 else 1
torch.set_num_threads(threads)
model = load_model(model_dir, threads=threads)
out = {}
with _LayoutTimer(model, [(threads, parts)]) as timer:  # as the engine runs a batch: whole, or in parts
    for rows, width in shapes:
        items = batch_items(model, rows, width)
        for _ in range(3):
            timer.time(items, (threads, parts))
        times = sorted(timer.time(items, (threads, parts)) * 1000 for _ in range(7))
        out[f"{rows}x{width}"] = times[len(times) // 2]
print(json.dumps(out))
"""


SEED = "seed design (bench/peers/seed.py)"
#: In a closed loop at the same concurrency a server's latency is about the requests in flight over its
#: throughput, so a p99 ratio there mostly restates the throughput ratio. The seed design is also
#: compared at the same *arrival rate*: an open loop at this share of the seed's own closed-loop
#: throughput (a rate it can keep up with), against the seed and against the defaults, so that the
#: two p99s compare tails, not capacities.
SEED_OPEN_SHARE = 0.7
SEED_RATE = "defaults at the seed's open-loop rate"


async def measure(model_dir: Path, args: list[str], texts: list[str], warmup: float, duration: float,
                  keep_batches: bool, script: str = "ws_server.py", in_flight: int = 4,
                  open_share: float = 0.0, open_rate: float = 0.0) -> dict[str, Any]:
    """One server: 32 closed-loop clients x ``in_flight`` (unless ``open_rate`` is given), then, with
    ``open_share`` or ``open_rate``, an open loop at that share of the closed loop's throughput or at
    that rate (``summary["open"]``). Our server runs at ``--log-level info``; its engine's lines
    (``report.engine_lines``: the calibration, the tuner's probes and switches) are kept in
    ``summary["log"]``, so a repeat that ended on another layout says why."""
    ours = script == "ws_server.py"
    with ServerProcess(model_dir, args, script=script, log_level="info" if ours else "warning") as server:
        await loadgen.settle(server.url)
        recorder = loadgen.Recorder()
        summary: dict[str, Any] = {}
        if not open_rate:
            summary = await loadgen.closed_loop(server.url, texts, 32, in_flight, warmup, duration, recorder=recorder)
            open_rate = open_share * summary["throughput_rps"]
        if open_rate > 0:
            summary["open"] = await loadgen.open_loop(server.url, texts, 32, open_rate, warmup, duration)
        threads, parts = await hello_threads(server.url) if ours else (0, 1)  # (the seed: none)
        summary["log"] = report.engine_lines(server.log_lines()) if ours else []
    summary["torch_threads"], summary["forward_parts"] = threads, parts
    summary.setdefault("batch", {}).setdefault("mean_rows_per_batch", float("nan"))
    if keep_batches:
        per_batch: dict[tuple[int, int], list[float]] = defaultdict(list)
        for size, tokens, inference in zip(recorder.batch_size, recorder.batch_tokens, recorder.inference_ms,
                                           strict=False):
            if size and tokens:
                per_batch[(size, tokens // size)].append(inference)
        summary["shapes"] = {f"{r}x{w}": statistics.median(v) for (r, w), v in per_batch.items() if len(v) >= 3}
    return summary


def seed_lines(defaults: tuple[float, float, float], seed: tuple[float, float, float],
               seed_runs: list[dict[str, Any]], at_seed_rate: list[dict[str, Any]]) -> str:
    """The defaults against the seed design (``defaults``, ``seed``: closed-loop (req/s, p50, p99)
    medians; ``seed_runs`` and ``at_seed_rate``: each repeat's runs, whose ``open`` phases ran at the
    same rate): at the same concurrency, and at the same arrival rate (``SEED_OPEN_SHARE``)."""
    if not seed[0] > 0:
        return ("defaults against the seed design: the seed answered nothing in the window (its batches take "
                "longer than it): give it a longer --duration")
    if not math.isfinite(seed[2]):
        return ("defaults against the seed design: the seed left requests unanswered in its window (p99 infinite), "
                "so no p99 ratio: give it a longer --duration")
    lines = [f"defaults against the seed design at the same concurrency (closed loop): throughput "
             f"{defaults[0] / seed[0]:.2f}x, p99 {defaults[2] / seed[2]:.2f}x (goal <= 0.7; about 1 / the "
             "throughput ratio here, since latency is the requests in flight over the throughput)"]
    theirs = [run["open"]["latency_ms"]["p99"] for run in seed_runs if "open" in run]
    ours = [run["open"]["latency_ms"]["p99"] for run in at_seed_rate if "open" in run]
    if theirs and ours:
        rate = statistics.median(run["open"]["rate_rps"] for run in seed_runs if "open" in run)
        p99_seed, p99_ours = statistics.median(theirs), statistics.median(ours)
        if not math.isfinite(p99_seed):  # (the defaults' own infinite p99 prints as inf x: a miss)
            p99_seed = math.nan
        lines.append(f"defaults against the seed design at the same arrival rate (open loop, {rate:.1f} req/s = "
                     f"{SEED_OPEN_SHARE:g}x the seed's throughput): p99 {p99_ours:.1f} ms against {p99_seed:.1f} ms, "
                     f"{p99_ours / p99_seed:.2f}x (goal <= 0.7)")
    return "\n".join(lines)


Repeats = dict[str, tuple[list[float], list[float]]]  # flag set -> (each repeat's req/s, each repeat's p99)


SPREAD = {True: "beyond the repeats' spread", False: "within the repeats' spread", None: "spread unknown: one repeat"}


def ahead_of_defaults(rows: dict[str, tuple[float, float, float]],
                      repeats: Repeats | None = None) -> dict[str, tuple[float, float, bool | None]]:
    """The flag sets strictly ahead of the defaults on throughput and on p99 both (``rows``: name ->
    (req/s, p50, p99), medians, "defaults" among them), each with its req/s and p99 as multiples of the
    defaults', and whether it is ahead beyond the repeats' spread (``repeats``: its slowest repeat
    served more than the defaults' fastest, *and* its worst p99 was below the defaults' best), or
    None where either has fewer than two repeats (no spread measured). The goals compare the
    defaults with the best req/s and the best p99 of the sweep, which may come from two flag sets,
    each giving up the other figure; a flag set ahead on both is one the defaults could have been."""
    d = rows["defaults"]
    ahead: dict[str, tuple[float, float, bool | None]] = {}
    for name, (rps, _, p99) in rows.items():
        if name != "defaults" and rps > d[0] and p99 < d[2]:
            beyond: bool | None = None
            if repeats is not None and min(len(repeats[name][0]), len(repeats["defaults"][0])) >= 2:
                beyond = (min(repeats[name][0]) > max(repeats["defaults"][0])
                          and max(repeats[name][1]) < min(repeats["defaults"][1]))
            ahead[name] = (rps / d[0], p99 / d[2], beyond)
    return ahead


def ahead_line(rows: dict[str, tuple[float, float, float]], repeats: Repeats | None = None) -> str:
    """One line naming each flag set of ``ahead_of_defaults``, best p99 first, with its ratios to the
    defaults (three decimals: a set ahead by a hair shows as such) and where it stands against the
    repeats' spread; or that there is none."""
    ahead = ahead_of_defaults(rows, repeats)
    if not ahead:
        return "flag sets ahead of the defaults on both req/s and p99: none (none served more with a lower p99)"
    by_p99 = sorted(ahead.items(), key=lambda item: item[1][1])
    return "flag sets ahead of the defaults on both req/s and p99: " + ", ".join(
        f"{name} ({rps:.3f}x req/s, {p99:.3f}x p99, {SPREAD[beyond]})" for name, (rps, p99, beyond) in by_p99)


def configs(text: str) -> list[str]:
    """The flag sets ``--configs`` names, checked before any server starts: each is ``defaults``, a name
    of ``SWEEP`` or a string of the server's flags (``flag_set``); empty means all of ``SWEEP``. A set
    named twice runs once."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip())) if text else list(SWEEP)
    for name in names:
        if name not in SWEEP and not name.startswith("--"):
            raise ValueError(f"--configs: {name!r} is neither a name of the sweep ({', '.join(SWEEP)}) nor a set "
                             "of the server's flags (starting with --)")
        if name not in SWEEP:
            problem = _flag_problem(shlex.split(name))
            if problem:
                raise ValueError(f"--configs: {name!r}: {problem}")
    return names


def _flag_problem(flags: list[str]) -> str | None:
    """What the server would refuse in ``flags`` (its own ``load_config``, without the environment), or None."""
    from fillmask_server.config import load_config

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            load_config(flags, environ={})
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1].removeprefix("error: ").split("; see ")[0]
    return None


def run_order(names: list[str], repeat: int) -> list[str]:
    """The order in which repeat ``repeat`` (0, 1, ...) runs the flag sets ``names``: as given in even
    repeats, reversed in odd ones (ABBA). A fixed order turns a drift of the machine's speed over the run
    (a neighbour leaving, a CPU warming up) into a bias for whichever set always runs first; two repeats
    run A B C C B A, a palindrome, so each set's mean time in the pair is its middle, however long each
    run lasts, and a linear drift weighs the same on every set. An odd last repeat has no partner."""
    return list(names) if repeat % 2 == 0 else list(reversed(names))


def flag_set(name: str) -> list[str]:
    """The server's arguments for a flag set of ``configs``."""
    return SWEEP[name] if name in SWEEP else shlex.split(name)


async def hello_threads(url: str) -> tuple[int, int]:
    """The server's torch threads and the parts a batch runs in (``hello.engine``)."""
    from websockets.asyncio.client import connect

    async with connect(url) as ws:
        hello = json.loads(await ws.recv())
    engine = hello.get("engine", {})
    return int(engine.get("torch_threads", 0)), int(engine.get("forward_parts", 1))


def layouts(runs: list[dict[str, Any]]) -> str:
    """The threads column: the layout each repeat's server reported at the end of its run, ``2`` or ``2 in
    2 parts``, with a count where several repeats ended in it (the calibration may choose differently
    from one start to the next, and the thread tuner may switch while serving)."""
    each = [f"{r['torch_threads']}" + (f" in {r['forward_parts']} parts" if r.get("forward_parts", 1) > 1 else "")
            for r in runs]
    return ", ".join(f"{layout} ×{each.count(layout)}" if len(each) > 1 else layout for layout in dict.fromkeys(each))


def log_lines(runs: dict[str, list[dict[str, Any]]], corpus: str) -> list[str]:
    """What each repeat's server said of its engine (``report.log_section``), named by its flags, its
    repeat and the layout it ended on."""
    servers = [{"name": f"{name}, repeat {n}, ended on {layouts([run])}", "corpus": corpus, "log": run["log"]}
               for name, each in runs.items() for n, run in enumerate(each, start=1) if run.get("log")]
    return report.log_section({"servers": servers})


def in_process(model_dir: Path, threads: int, shapes: list[tuple[int, int]], parts: int = 1) -> dict[str, float]:
    """Median ms of a pass per shape in a fresh process, at ``threads`` torch threads in ``parts`` parts."""
    done = subprocess.run([sys.executable, "-c", INPROCESS, str(model_dir), str(threads), json.dumps(shapes),
                           str(parts)], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def corpus_texts(model_dir: Path, size: str, corpus: str) -> list[str]:
    """The corpus for ``size``: ``tiny``/``base`` take it as it is; a family's checkpoint
    (``families/NAME``, from ``bench/run.py --families``) takes it with its own mask token, as
    ``bench/run.py`` does (protein sequences for ``esm``)."""
    if not size.startswith("families/"):
        return bench_corpus(corpus, "", "", seed=0)
    from transformers import AutoTokenizer

    mask = AutoTokenizer.from_pretrained(model_dir).mask_token
    return bench_corpus(corpus, size.removeprefix("families/"), mask, seed=0)


async def main_async(args: argparse.Namespace) -> int:
    for size in args.sizes.split(","):
        model_dir = ROOT / "models" / size
        for corpus in args.corpora.split(","):
            texts = corpus_texts(model_dir, size, corpus)
            names = list(args.configs)
            # Results are kept by name, never by position: the order changes from one repeat to the next.
            # The seed design is one of the names, so the defaults' ratios to it drift no more than to the
            # sweep; the defaults at the seed's rate follow the seed (they need its rate).
            everyone = [*names, *([SEED] if args.seed else [])]
            runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for repeat in range(args.repeats):
                for name in run_order(everyone, repeat):
                    if name != SEED:
                        runs[name].append(await measure(model_dir, flag_set(name), texts, args.warmup, args.duration,
                                                        keep_batches=name == "defaults" and repeat == 0,
                                                        in_flight=args.in_flight))
                        continue
                    seed = await measure(model_dir, [], texts, args.warmup, args.duration, False,
                                         script="bench/peers/seed.py", in_flight=args.in_flight,
                                         open_share=SEED_OPEN_SHARE)
                    runs[SEED].append(seed)
                    if "open" in seed:  # the defaults at the seed's open-loop rate
                        runs[SEED_RATE].append(await measure(model_dir, [], texts, args.warmup, args.duration,
                                                             False, open_rate=seed["open"]["rate_rps"]))
            print(f"\n## {size}, {corpus} corpus, 32 clients x {args.in_flight} in flight, {args.repeats} repeat(s), "
                  "median")
            print("| flags | req/s | p50 ms | p99 ms | p99/p50 | rows/batch | threads | req/s, each repeat | "
                  "p99 ms, each repeat |")
            print("|---|---|---|---|---|---|---|---|---|")
            rows = {}
            repeats: Repeats = {}
            for name in everyone:  # (SEED_RATE: an open loop alone)
                each_rps = [r["throughput_rps"] for r in runs[name]]
                each_p99 = [r["latency_ms"]["p99"] for r in runs[name]]
                repeats[name] = (each_rps, each_p99)
                rps, p99 = statistics.median(each_rps), statistics.median(each_p99)
                p50 = statistics.median(r["latency_ms"]["p50"] for r in runs[name])
                batch = statistics.median(r["batch"]["mean_rows_per_batch"] for r in runs[name])
                rows[name] = (rps, p50, p99)
                print(f"| {name} | {rps:.1f} | {p50:.1f} | {p99:.1f} | {p99 / p50:.2f} | {batch:.1f} | "
                      f"{layouts(runs[name])} | {', '.join(f'{v:.0f}' for v in each_rps)} | "
                      f"{', '.join(f'{v:.1f}' for v in each_p99)} |")
            swept = {name: value for name, value in rows.items() if name != SEED}
            best_rps = max(v[0] for v in swept.values())
            best_p99 = min(v[2] for v in swept.values())
            d = rows.get("defaults")
            if d:
                print(f"defaults: throughput {d[0] / best_rps:.2f}x the sweep's best (goal >= 0.9), p99 "
                      f"{d[2] / best_p99:.2f}x the sweep's best (goal <= 1.1), p99 {d[2] / d[1]:.2f}x its p50 "
                      "(goal <= 1.5)")
                print(ahead_line(swept, repeats))
                if SEED in rows:
                    print(seed_lines(d, rows[SEED], runs[SEED], runs.get(SEED_RATE, [])))
            shapes = runs["defaults"][0].get("shapes") if "defaults" in runs else None
            if shapes:
                top = sorted(shapes, key=lambda k: -int(k.split("x")[0]))[:6]
                threads = runs["defaults"][0]["torch_threads"] or 2
                parts = runs["defaults"][0].get("forward_parts", 1)
                alone = in_process(model_dir, threads, [tuple(map(int, k.split("x"))) for k in top],  # type: ignore[misc]
                                   parts)
                layout = f"{threads} threads" + (f" in {parts} parts" if parts > 1 else "")
                print(f"\nforward pass per batch, server (inference_ms, median) vs in-process ({layout}, the first "
                      "repeat's):")
                print("| rows x width | server ms | in-process ms | ratio |")
                print("|---|---|---|---|")
                for key in top:
                    print(f"| {key} | {shapes[key]:.2f} | {alone[key]:.2f} | {shapes[key] / alone[key]:.2f} |")
            print("\n".join(log_lines(runs, corpus)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny", help="comma-separated: tiny, base, or families/NAME (a checkpoint "
                        "that bench/run.py --families wrote)")
    parser.add_argument("--in-flight", type=int, default=4, help="requests each of the 32 clients keeps in flight")
    parser.add_argument("--corpora", default="short,mixed")
    parser.add_argument("--configs", default="", help="comma-separated flag sets: 'defaults', a name of SWEEP, or "
                        "any of the server's flags as one string ('--max-batch-size 128 --max-batch-tokens 16384'); "
                        "default: all of SWEEP")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every flag set, interleaved, every "
                        "second one in reverse order (an even number cancels a linear drift)")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--seed", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the seed design (bench/peers/seed.py) at the same load")
    args = parser.parse_args(argv)
    if args.in_flight < 1:
        parser.error("--in-flight must be at least 1")
    try:
        args.configs = configs(args.configs)
    except ValueError as exc:
        parser.error(str(exc))
    missing = [name for name in ("starlette", "uvicorn") if args.seed and importlib.util.find_spec(name) is None]
    if missing:  # found out now, not after minutes of sweep whose output would be lost
        parser.error(f"the seed design needs {' and '.join(missing)}: run `.venv/bin/pip install -e '.[bench]'`, "
                     "or pass --no-seed")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
