"""One command for the whole benchmark (from the repository root)::

    .venv/bin/python bench/run.py --sizes tiny,base --out bench/results     # full run, about 30 min
    .venv/bin/python bench/run.py --quick                                   # smoke run, tiny only, < 2 min
    .venv/bin/python bench/run.py --families all                            # every family, about 10 min
    .venv/bin/python bench/run.py --families distilbert,esm --quick         # two families, short windows
    .venv/bin/python bench/run.py --families all --family-shape small       # compute-bound: 4 layers, width 384
    .venv/bin/python bench/run.py --families all --family-shape base --repeats 1   # BERT-base's shape, real vocab

For each model size and each corpus (``mixed``: 8-81 tokens, one and two masks; ``short``: 9-16
tokens, one mask) it makes the offline checkpoint if missing, measures the in-process limits in a
child process (the pipeline, and the server's own code without sockets), then starts the real server
(``ws_server.py``) once per configuration and drives it over WebSockets: idle single requests, closed
loop (32 clients × K in flight; then the deepest K again with the ``/healthz`` prober, a phase of its own so
that the prober's CPU does not lower the throughput ratios) and,
on the mixed corpus, open loop at fixed fractions of the closed-loop capacity. Repeats are interleaved
(r1 of every phase, then r2, ...) and the report uses their medians, because this machine is shared.
Every phase is time-boxed; servers are stopped in ``finally`` blocks. Outputs: ``results.md``,
``results.json``, ``latency_vs_throughput.png``.

``--families`` measures instead each model family's tiny checkpoint (``fillmask_server.checkpoint``,
``models/families/``; with ``--family-shape small``, 4 layers of width 384, ``models/families-small/``,
and with ``base``, BERT-base's 12 layers of width 768, ``models/families-base/``, where the model rather
than the Python around it is most of a request's cost) on the short corpus
(``bench.pipeline_limits.family_texts``: its mask token;
protein sequences for ESM): the family's best ``pipeline(list, batch_size=N)`` and in-process limit
in a child process, then its server, closed loop, 32 clients x K in flight; the path the server took
(``hello.engine``) and the two ratios per family, with the issue 16 goals (server >= 1.3x its best
pipeline and >= 0.85x its in-process limit). Outputs: ``families.md``, ``families.json`` (small:
``families-small.md``, ``families-small.json``; base: ``families-base.*``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/run.py``: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from bench import report
from bench.corpus import CORPORA, corpus_stats
from bench.loadgen import Recorder, closed_loop, idle_single, open_loop, run_probe, settle
from bench.server_proc import ROOT, CpuMeter, QuietGate, ServerProcess
from fillmask_server.checkpoint import FAMILIES, FAMILY_SHAPES


@dataclass(frozen=True)
class Timing:
    """Durations and repeats of one model size (all phases are bounded by these)."""

    repeats: int
    warmup_s: float
    closed_s: float
    open_s: float
    grace_s: float
    pipeline_texts: int
    singles: int  # single requests: pipe(text) calls, and idle-server requests (the same texts)
    pipeline_timeout_s: float


FULL: dict[str, Timing] = {
    "tiny": Timing(repeats=3, warmup_s=1.0, closed_s=5.0, open_s=5.0, grace_s=6.0, pipeline_texts=256,
                   singles=50, pipeline_timeout_s=300),
    "base": Timing(repeats=2, warmup_s=2.0, closed_s=10.0, open_s=8.0, grace_s=8.0, pipeline_texts=128,
                   singles=50, pipeline_timeout_s=600),
}
#: --families: per family one pipeline child and one server, short windows (tiny models are fast).
FAMILY_TIMING = {
    "full": Timing(repeats=3, warmup_s=1.0, closed_s=3.0, open_s=0.0, grace_s=0.0, pipeline_texts=256, singles=10,
                   pipeline_timeout_s=300),
    "quick": Timing(repeats=1, warmup_s=0.5, closed_s=2.0, open_s=0.0, grace_s=0.0, pipeline_texts=128, singles=5,
                    pipeline_timeout_s=180),
    # --family-shape base: a batch takes far longer, so longer windows and fewer pipeline texts.
    "base": Timing(repeats=1, warmup_s=4.0, closed_s=10.0, open_s=0.0, grace_s=0.0, pipeline_texts=128, singles=5,
                   pipeline_timeout_s=600),
}
FAMILY_CORPUS = "short"
FAMILY_GOALS = {"pipeline": 1.3, "limit": 0.85}  # issue 16's targets: server ÷ best pipeline, ÷ in-process limit
QUICK: dict[str, Timing] = {
    "tiny": Timing(repeats=1, warmup_s=0.5, closed_s=1.5, open_s=1.5, grace_s=3.0, pipeline_texts=96,
                   singles=20, pipeline_timeout_s=120),
    "base": Timing(repeats=1, warmup_s=1.0, closed_s=3.0, open_s=3.0, grace_s=5.0, pipeline_texts=64,
                   singles=10, pipeline_timeout_s=300),
}


@dataclass(frozen=True)
class ServerConfig:
    """One server configuration to start and measure."""

    name: str
    size: str
    corpus: str = "mixed"
    args: tuple[str, ...] = ()
    in_flight: tuple[int, ...] = (1, 4)
    open_loop: bool = True
    idle: bool = True
    probe: bool = True  # the /healthz prober's phase (see ``ServerBench.closed``)

    @property
    def label(self) -> str:
        return f"{self.name} [{self.corpus}]"


def server_configs(size: str, in_flight: tuple[int, ...], corpus: str) -> list[ServerConfig]:
    """The configurations for one model size and corpus: batching on (fp32, and bf16 for base); on the
    mixed corpus also open loop, and batching off (``--max-batch-size 1``) for comparison."""
    mixed = corpus == "mixed"
    configs = [ServerConfig(f"{size} fp32", size, corpus, (), in_flight, open_loop=mixed)]
    if size == "base":
        configs.append(ServerConfig("base bf16", size, corpus, ("--dtype", "bfloat16"), in_flight, open_loop=mixed))
    if mixed:
        configs.append(ServerConfig(f"{size} fp32 batch=1", size, corpus, ("--max-batch-size", "1"),
                                    (max(in_flight),), open_loop=False, idle=False, probe=False))
    return configs


@dataclass
class Settings:
    """Everything the command line decides."""

    sizes: list[str]
    corpora: list[str]
    out: Path
    models: Path
    quick: bool
    clients: int
    in_flight: tuple[int, ...]
    open_factors: tuple[float, ...]
    pipeline_batch_sizes: tuple[int, ...]
    pipeline_bf16: bool
    repeats: int | None
    gate: QuietGate
    server_args: tuple[str, ...] = ()
    timing: dict[str, Timing] = field(default_factory=dict)
    families: list[str] = field(default_factory=list)
    family_shape: str = "tiny"


def log(message: str) -> None:
    """Progress on stderr, with the time since start."""
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


_T0 = time.perf_counter()


def ensure_checkpoint(size: str, models: Path) -> Path:
    """``models/SIZE``, written by ``fillmask_server.checkpoint`` when missing (base: about 30 s)."""
    from fillmask_server.checkpoint import is_checkpoint

    directory = models / size
    if not is_checkpoint(directory):
        log(f"writing the offline '{size}' checkpoint to {directory}")
        subprocess.run([sys.executable, "-m", "fillmask_server.checkpoint", size, str(directory)], cwd=ROOT,
                       check=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return directory


def measure_pipeline(model_dir: Path, dtype: str, corpus: str, settings: Settings, timing: Timing,
                     family: str = "", limit_only: bool = False) -> dict[str, Any]:
    """Run ``bench.pipeline_limits`` in a child process and return its raw JSON.

    Only the float32 pipeline is a target's denominator; a bfloat16 one (information) gets one repeat.
    ``family``: the model is that family's checkpoint (its corpus is ``family_texts``). ``limit_only``:
    the in-process limits alone, measured again after the servers (``report.bracket_limit``).
    """
    repeats = timing.repeats if dtype == "float32" else 1
    command = [sys.executable, "-m", "bench.pipeline_limits", "--model", str(model_dir), "--dtype", dtype,
               "--corpus", corpus,
               "--batch-sizes", ",".join(map(str, settings.pipeline_batch_sizes)),
               "--texts", str(timing.pipeline_texts), "--repeats", str(repeats),
               "--singles", str(timing.singles), "--wait-quiet", str(settings.gate.per_wait_s),
               "--wait-budget", str(max(0.0, min(60.0, settings.gate.budget_s - settings.gate.waited_s)))]
    if family:
        command += ["--family", family]
    if limit_only:
        command.append("--limit-only")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    meter = CpuMeter(None)  # the worker is a child: its CPU shows as "client" once it is reaped
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timing.pipeline_timeout_s)
    share = meter.stop()
    if done.returncode != 0:
        raise RuntimeError(f"pipeline measurement failed:\n{done.stderr[-2000:]}")
    raw = orjson.loads(done.stdout.strip().splitlines()[-1])
    raw["cpu"] = {"pipeline": round(share.client, 2), "other": round(share.other, 2), "cores": share.cores}
    settings.gate.waited_s += raw.get("quiet_waits", {}).get("waited_s", 0.0)
    return raw


def limit_after(model_dir: Path, corpus: str, settings: Settings, timing: Timing, family: str = "") -> dict[str, Any]:
    """The in-process limits again, after the servers; on failure ``{}`` and a log line (the servers'
    figures are kept, and the ratios use the limit from before alone)."""
    try:
        return measure_pipeline(model_dir, "float32", corpus, settings, timing, family=family, limit_only=True)
    except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as exc:
        log(f"the in-process limit after the servers failed ({type(exc).__name__}); the ratios use the one before")
        return {}


class ServerBench:
    """The phases run against one started server; every phase's raw summary is kept under its key."""

    def __init__(self, server: ServerProcess, config: ServerConfig, texts: list[str], token_counts: list[int] | None,
                 settings: Settings, timing: Timing) -> None:
        self.server, self.config, self.texts, self.settings, self.timing = server, config, texts, settings, timing
        self.token_counts = token_counts
        self.raw: dict[str, list[dict[str, Any]]] = {}

    def medians(self) -> list[dict[str, Any]]:
        return [report.median_phase(repeats) for repeats in self.raw.values()]

    async def _keep(self, key: str, result: dict[str, Any], meter: CpuMeter) -> None:
        """Store a phase result with its CPU split, then wait until the server's last batch is done."""
        share = meter.stop()
        result["cpu"] = share.as_dict()
        if "answered_in_span" in result:  # the closed loops: every answer over the meter's span
            result["cpu"]["per_request_us"] = share.per_request_us(result["answered_in_span"])
        self.raw.setdefault(key, []).append(result)
        result["settle_s"] = await settle(self.server.url)

    async def warm_up(self) -> None:
        """Not measured: single requests, then a short saturated burst (kernels for many shapes)."""
        await idle_single(self.server.url, self.texts, 5, warmup=5)
        await closed_loop(self.server.url, self.texts, self.settings.clients, max(self.config.in_flight), 0.0,
                          self.timing.warmup_s * 2)
        await settle(self.server.url)

    async def idle(self, r: int) -> None:
        await quiet(self.settings, f"{self.config.label} r{r} idle")
        meter = CpuMeter(self.server.pid)
        result = await idle_single(self.server.url, self.texts, self.timing.singles, token_counts=self.token_counts)
        result["healthz"] = await run_probe(self.server.port, 1.0)
        await self._keep("idle", result, meter)
        log(f"{self.config.label} r{r}: idle p50 {result['latency_ms']['p50']:.2f} ms "
            f"(server inference {result['server_ms']['inference_p50']:.2f} ms)")

    async def closed(self, r: int, k: int, probe: bool = False) -> None:
        """Closed loop, C clients x ``k`` in flight. With ``probe`` the ``/healthz`` prober runs in the
        window too, and the phase is kept apart (mode ``probed``): the prober's own requests take CPU from
        the server, so throughput ratios come from the phase without it."""
        timing = self.timing
        # the prober starts as the window opens (plus its own start-up) and must end inside it
        on_window = (lambda: run_probe(self.server.port, max(1.0, timing.closed_s - 0.5))) if probe else None
        label = f"closed K={k}" + (" + /healthz" if probe else "")
        await quiet(self.settings, f"{self.config.label} r{r} {label}")
        meter = CpuMeter(self.server.pid)
        recorder = Recorder()
        result = await closed_loop(self.server.url, self.texts, self.settings.clients, k, timing.warmup_s,
                                   timing.closed_s, on_window=on_window, token_counts=self.token_counts,
                                   recorder=recorder)
        result["answered_in_span"] = sum(1 for kind in recorder.kind if kind)  # warm-up and window
        if probe:
            result["mode"] = "probed"
        await self._keep(label, result, meter)
        health = result.get("during_window", {})
        log(f"{self.config.label} r{r}: {label.replace(f'K={k}', f'{self.settings.clients}x{k}')}: "
            f"{result['throughput_rps']:.1f} req/s, "
            f"p50 {result['latency_ms']['p50']:.1f} ms, p99 {result['latency_ms']['p99']:.1f} ms, "
            f"{result['batch']['mean_rows_per_batch']:.1f} rows/batch"
            + (f", healthz p99 {health.get('p99_ms', float('nan')):.1f} ms" if health else ""))

    async def open(self, r: int, factor: float, capacity: float) -> None:
        timing = self.timing
        await quiet(self.settings, f"{self.config.label} r{r} open {factor:g}x")
        meter = CpuMeter(self.server.pid)
        result = await open_loop(self.server.url, self.texts, self.settings.clients, factor * capacity,
                                 timing.warmup_s, timing.open_s, timing.grace_s, seed=r,
                                 token_counts=self.token_counts)
        result["factor"] = factor
        await self._keep(f"open {factor:g}x", result, meter)
        log(f"{self.config.label} r{r}: open {factor:g}x ({factor * capacity:.0f}/s): "
            f"{result['throughput_rps']:.1f} req/s, p50 {result['latency_ms']['p50']:.1f} ms, "
            f"p99 {result['latency_ms']['p99']:.1f} ms, overloaded {100 * result['overloaded_share']:.1f}%, "
            f"unanswered {result['unanswered']}")


async def measure_server(config: ServerConfig, model_dir: Path, texts: list[str], token_counts: list[int] | None,
                         settings: Settings, timing: Timing) -> dict[str, Any]:
    """Start one server, warm it up, run its phases (repeats interleaved) and return raw results + medians.

    Order per repeat: idle single requests, closed loop for each K, then the deepest K again with the
    ``/healthz`` prober (kept apart: its figures are the health check's, not the throughput's).
    The open loop comes after all closed-loop repeats, at fractions of the closed-loop capacity.
    """
    args = [*config.args, *settings.server_args]
    with ServerProcess(model_dir, args, log_level="info") as server:
        engine = await read_engine(server.url)
        log(f"{config.label}: server ready in {server.start_s:.1f} s at {server.url} (pid {server.pid}); "
            f"engine {engine}")
        bench = ServerBench(server, config, texts, token_counts, settings, timing)
        await bench.warm_up()
        for r in range(1, timing.repeats + 1):
            if config.idle:
                await bench.idle(r)
            for k in config.in_flight:
                await bench.closed(r, k)
            if config.probe:
                await bench.closed(r, max(config.in_flight), probe=True)
        if config.open_loop:
            capacity = report.capacity({"phases": bench.medians()})
            for r in range(1, timing.repeats + 1):
                for factor in settings.open_factors:
                    await bench.open(r, factor, capacity)
        engine_log = report.engine_lines(server.log_lines())
    return {"name": config.name, "size": config.size, "corpus": config.corpus, "args": args,
            "start_s": server.start_s, "engine": engine, "phases": bench.medians(), "raw": bench.raw,
            "log": engine_log}


async def read_engine(url: str) -> dict[str, Any]:
    """The server's ``hello.engine`` (protocol.md §2): which path its model runs."""
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None) as ws:
        hello = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
    return hello.get("engine", {})


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, relevant CPU flags, software versions and the git state."""
    import torch
    import transformers
    import websockets

    cpu_model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu_model == "unknown CPU":
                cpu_model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
        memory_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        memory_kib = 0
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni") if f in flags]
    git = _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain", "--", "fillmask_server", "ws_server.py")
    return {
        "cpu_model": cpu_model, "cores": os.cpu_count(), "cpu_flags": " ".join(wanted) or "none of note",
        "memory_gib": memory_kib / 2**20, "loadavg_start": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__, "websockets": websockets.__version__,
        "git": git + (" with uncommitted server changes" if dirty else ""),
    }


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


async def quiet(settings: Settings, what: str) -> dict[str, float]:
    """Wait (bounded) for the machine to be quiet; log when it stays busy (the measurement runs anyway)."""
    state = await asyncio.to_thread(settings.gate.wait)
    if state.get("other_cores", 0.0) >= settings.gate.threshold:
        log(f"{what}: the machine stays busy ({state['other_cores']:.2f} cores used by others after waiting "
            f"{state['waited_s']:.0f} s); measuring anyway, see the CPU columns")
    elif state.get("waited_s", 0.0) > 2:
        log(f"{what}: waited {state['waited_s']:.0f} s for the machine to be quiet")
    return state


async def run_all(settings: Settings) -> dict[str, Any]:
    """Every measurement of the run; returns the summary that ``report`` renders."""
    summary: dict[str, Any] = {"pipelines": [], "servers": [], "raw_pipelines": {}, "corpora": {}}
    for size in settings.sizes:
        timing = settings.timing[size]
        model_dir = ensure_checkpoint(size, settings.models)
        for corpus in settings.corpora:
            texts = CORPORA[corpus]()
            token_counts: list[int] | None = None
            dtypes = ["float32", "bfloat16"] if size == "base" and settings.pipeline_bf16 and corpus == "mixed" \
                else ["float32"]
            for dtype in dtypes:
                name = f"{size} {'fp32' if dtype == 'float32' else 'bf16'}"
                log(f"pipeline {name} {corpus}: {timing.pipeline_texts} texts x batch sizes "
                    f"{settings.pipeline_batch_sizes}")
                raw = measure_pipeline(model_dir, dtype, corpus, settings, timing)
                token_counts = raw.pop("token_counts", token_counts)
                pipe = {"name": name, "size": size, "dtype": dtype, "corpus": corpus, **report.pipeline_summary(raw)}
                summary["pipelines"].append(pipe)
                summary["raw_pipelines"][f"{name} {corpus}"] = raw
                log(f"pipeline {name} {corpus}: best {pipe['best_rps']:.1f} req/s at N={pipe['best_batch_size']}, "
                    f"single call p50 {pipe['single_p50_ms']:.2f} ms; in-process limit {pipe['limit_rps']:.1f} req/s")
            for config in server_configs(size, settings.in_flight, corpus):
                summary["servers"].append(await measure_server(config, model_dir, texts, token_counts, settings,
                                                               timing))
            fp32 = next(p for p in summary["pipelines"] if p["name"] == f"{size} fp32" and p["corpus"] == corpus)
            after = limit_after(model_dir, corpus, settings, timing)
            summary["raw_pipelines"][f"{size} fp32 {corpus} limit after the servers"] = after
            report.bracket_limit(fp32, after.get("limit", []))
            log(f"in-process limit {size} fp32 {corpus} after the servers: {fp32.get('limit_after_rps', math.nan):.1f} "
                f"req/s (before {fp32.get('limit_before_rps', math.nan):.1f}; the ratios use the mean)")
            summary["corpora"][corpus] = corpus_stats(texts, token_counts)
    return summary


async def run_families(settings: Settings) -> dict[str, Any]:
    """``--families``: rows for ``families.md``. Each repeat measures every family in turn, and each
    family's pipeline (with its in-process limit) right before its server, so that the two figures of a
    ratio share the machine's conditions as far as they can; the row gives the medians over the repeats
    of the three figures and of each ratio."""
    from bench.pipeline_limits import family_texts
    from fillmask_server.checkpoint import ensure_family

    timing = settings.timing["family"]
    once = Timing(**{**asdict(timing), "repeats": 1})
    pairs: dict[str, list[dict[str, Any]]] = {family: [] for family in settings.families}
    for r in range(1, timing.repeats + 1):
        for family in settings.families:
            root = settings.models / ("families" if settings.family_shape == "tiny" else
                                      f"families-{settings.family_shape}")
            model_dir = ensure_family(family, root, settings.family_shape)
            log(f"family {family} r{r}: pipeline and in-process limit on the {FAMILY_CORPUS} corpus")
            raw = measure_pipeline(model_dir, "float32", FAMILY_CORPUS, settings, once, family=family)
            token_counts = raw.pop("token_counts", None)
            pipe = report.pipeline_summary(raw)
            texts = family_texts(FAMILY_CORPUS, family, raw["mask_token"])
            config = ServerConfig(family, "family", FAMILY_CORPUS, (), settings.in_flight, open_loop=False,
                                  idle=False, probe=False)
            server = await measure_server(config, model_dir, texts, token_counts, settings, once)
            after = limit_after(model_dir, FAMILY_CORPUS, settings, once, family)
            report.bracket_limit(pipe, after.get("limit", []))
            raw["limit_after_the_server"] = after
            best = max((p for p in server["phases"] if p["mode"] == "closed"), key=lambda p: p["throughput_rps"])
            pair = {"engine": server["engine"], "server_rps": best["throughput_rps"],
                    "in_flight": best.get("in_flight"), "pipeline_rps": pipe["best_rps"],
                    "pipeline_batch_size": pipe["best_batch_size"],
                    "limit_rps": pipe["limit_rps"], "limit_before_rps": pipe.get("limit_before_rps", math.nan),
                    "limit_after_rps": pipe.get("limit_after_rps", math.nan),
                    "limit_drift": pipe.get("limit_drift", math.nan),
                    "vs_pipeline": best["throughput_rps"] / pipe["best_rps"],
                    "vs_limit": best["throughput_rps"] / pipe["limit_rps"],
                    "cpu_other_server": best.get("cpu_other"), "cpu_other_pipeline": pipe["cpu_other"],
                    **{f"cpu_us_{group}": best.get(f"cpu_us_{group}") for group in report.CPU_GROUPS},
                    "tokens": corpus_stats(texts, token_counts), "server": server, "pipeline": raw}
            pairs[family].append(pair)
            log(f"family {family} r{r}: {pair['engine']}; server {pair['server_rps']:.0f} req/s "
                f"(K={pair['in_flight']}), pipeline {pair['pipeline_rps']:.0f} (N={pair['pipeline_batch_size']}), "
                f"limit {pair['limit_rps']:.0f}: {pair['vs_pipeline']:.2f}x pipeline, {pair['vs_limit']:.2f}x limit")
    rows = []
    for family, measured in pairs.items():
        first = measured[0]
        row = {key: report.median([m[key] for m in measured]) for key in (
            "server_rps", "pipeline_rps", "limit_rps", "limit_before_rps", "limit_after_rps", "vs_pipeline",
            "vs_limit", "cpu_other_server",
            "cpu_other_pipeline", *(f"cpu_us_{group}" for group in report.CPU_GROUPS))}
        row.update({"family": family, "engine": first["engine"], "tokens": first["tokens"],
                    "in_flight": [m["in_flight"] for m in measured],
                    "pipeline_batch_size": [m["pipeline_batch_size"] for m in measured],
                    "vs_pipeline_range": [min(m["vs_pipeline"] for m in measured),
                                          max(m["vs_pipeline"] for m in measured)],
                    "vs_limit_range": [min(m["vs_limit"] for m in measured), max(m["vs_limit"] for m in measured)],
                    "limit_drift_max": max((abs(m["limit_drift"]) for m in measured
                                            if math.isfinite(m.get("limit_drift", math.nan))), default=math.nan),
                    "repeats": measured})
        rows.append(row)
    return {"families": rows}


def families_markdown(summary: dict[str, Any]) -> str:
    """``families.md``: per family its path and the two ratios against the issue 16 goals."""
    meta = summary["meta"]
    lines = [
        "# Every family: server against its own pipeline and its in-process limit",
        "",
        f"`{meta['command']}` on {meta['date']} UTC, {meta['duration_s'] / 60:.1f} min; git {meta['git']}; "
        f"{meta['cpu_model']}, {meta['cores']} cores, torch {meta['torch']} ({meta['torch_threads']} threads), "
        f"transformers {meta['transformers']}; load average at start {meta['loadavg_start']}.",
        "",
        f"Each family's {FAMILY_SHAPE_TEXT[summary['settings']['family_shape']]}, made by `python -m "
        "fillmask_server.checkpoint` (random weights, a tokenizer of the family's kind), on the "
        f"`{FAMILY_CORPUS}` "
        f"corpus (one mask; ESM: protein sequences of 8-14 residues). Server: `ws_server.py`, closed loop, "
        f"{summary['settings']['clients']} clients x K in flight (best K of {summary['settings']['in_flight']}). "
        f"Pipeline: `pipeline(list, batch_size=N)`, best N of {summary['settings']['pipeline_batch_sizes']}. "
        "In-process limit: the server's own code without sockets or stage threads (`bench/pipeline_limits.py`), "
        "measured right before the family's server and again right after it; the ratio uses the mean of the two "
        f"(⚠: they differ by more than {100 * report.LIMIT_DRIFT:.0f}%, the machine's speed moved). "
        f"{summary['settings']['repeats']} repeats; in each, a family's pipeline and limit were measured right "
        "before its server; the table gives medians over the repeats (ratios: the median of the per-repeat "
        "ratios, with their range).",
        "",
        f"Goals (issue 16): server ≥ {FAMILY_GOALS['pipeline']}x its best pipeline and "
        f"≥ {FAMILY_GOALS['limit']}x its in-process limit, with `forward: traced` and `head: masks`.",
        "",
        "| family | tokens (min–max) | forward | head | server req/s (K) | best pipeline req/s (N) | in-process "
        "limit req/s (before / after the server) | server ÷ pipeline (range) | server ÷ limit (range) | "
        "others' CPU cores (server / pipeline) | CPU µs per request: model / rest of the server / load generator |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["families"]:
        engine, tokens = row["engine"], row["tokens"]

        def mark(value: float, goal: float, spread: list[float]) -> str:
            return (f"**{value:.2f}x** {'PASS' if value >= goal else 'FAIL'} "
                    f"({spread[0]:.2f}–{spread[1]:.2f})")

        lines.append(
            f"| {row['family']} | {tokens.get('tokens_min', '?')}–{tokens.get('tokens_max', '?')} | "
            f"{engine.get('forward', '?')} | {engine.get('head', '?')} | "
            f"{row['server_rps']:.0f} ({','.join(map(str, row['in_flight']))}) | "
            f"{row['pipeline_rps']:.0f} ({','.join(map(str, row['pipeline_batch_size']))}) | {_limit_cell(row)} | "
            f"{mark(row['vs_pipeline'], FAMILY_GOALS['pipeline'], row['vs_pipeline_range'])} | "
            f"{mark(row['vs_limit'], FAMILY_GOALS['limit'], row['vs_limit_range'])} | "
            f"{_cores(row['cpu_other_server'])} / {_cores(row['cpu_other_pipeline'])} | {_cpu_split(row)} |")
    lines += ["", "Others' CPU: cores used by other processes on the machine during the measurement (it is "
              "shared); a ratio measured while others used much of the machine is noisy.",
              "", "CPU per request: the server's threads and the load generator over the best closed loop "
              "(results.md, CPU per request, says how to read it): *model* is the model thread and its torch "
              "workers, *rest of the server* the event loop, the two stages and any other server thread; the "
              "load generator is not the server's.", ""]
    return "\n".join(lines)


def _limit_cell(row: dict[str, Any]) -> str:
    """The limit a ratio used (the mean of before and after the server) and the two, where measured."""
    before, after = row.get("limit_before_rps"), row.get("limit_after_rps")
    if not (isinstance(before, float) and isinstance(after, float) and math.isfinite(before) and math.isfinite(after)):
        return f"{row['limit_rps']:.0f}"
    drift = row.get("limit_drift_max", after / before - 1)  # any repeat's drift, not the medians'
    warning = " ⚠" if report.drifted(drift) else ""
    return f"{row['limit_rps']:.0f} ({before:.0f} / {after:.0f}{warning})"


def _cpu_split(row: dict[str, Any]) -> str:
    """``model / rest of the server / load generator`` µs per request, '?' where not measured."""
    rest = [row.get(f"cpu_us_{group}") for group in report.CPU_GROUPS if group not in ("model", "client")]
    cells = [row.get("cpu_us_model"), sum(v for v in rest if _known(v)) if any(_known(v) for v in rest) else None,
             row.get("cpu_us_client")]
    return " / ".join(f"{v:.0f}" if _known(v) else "?" for v in cells)


def _known(value: Any) -> bool:
    """A measured number (not missing, not NaN)."""
    return isinstance(value, int | float) and value == value


def _cores(value: Any) -> str:
    return f"{value:.2f}" if _known(value) else "?"


FAMILY_SHAPE_TEXT = {
    "tiny": "tiny offline checkpoint (`models/families/`: 2 layers, hidden 32-64; the Python around the model is "
            "most of a request's cost)",
    "small": "small offline checkpoint (`models/families-small/`, `--family-shape small`: 4 layers, hidden 384, "
             "ELECTRA's generator 768; the model is most of a request's cost)",
    "base": "base-sized offline checkpoint (`models/families-base/`, `--family-shape base`: BERT-base's 12 layers, "
            "hidden 768, ELECTRA's generator 256 over embeddings of 768, as electra-base-generator; each family's "
            "real vocabulary size, 30,000-250,002 tokens, ESM's 33)",
}


def write_families(summary: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    shape = summary["settings"]["family_shape"]
    stem = "families" if shape == "tiny" else f"families-{shape}"
    md, js = out / f"{stem}.md", out / f"{stem}.json"
    md.write_text(families_markdown(summary))
    js.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY,
                                default=str))
    return [md, js]


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description="Benchmark the fill-mask server against the in-process pipeline.")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated model sizes: tiny, base (default tiny,base; with --quick tiny)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default bench/results; with --quick bench/out/tmp, git-ignored)")
    parser.add_argument("--corpora", default="mixed,short",
                        help=f"comma-separated corpora: {', '.join(sorted(CORPORA))} (default both)")
    parser.add_argument("--models", type=Path, default=ROOT / "models", help="where the offline checkpoints live")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: short windows, one repeat, tiny only unless --sizes says otherwise")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per phase (default: tiny 3, base 2)")
    parser.add_argument("--clients", type=int, default=32, help="WebSocket connections")
    parser.add_argument("--in-flight", default=None,
                        help="closed loop: requests in flight per client, each a phase, the best reported (default "
                             "1,4; with --families 1,8,16: a small model's batch is over before 4 a client come "
                             "back, and its engine waits for them)")
    parser.add_argument("--open-factors", default="0.5,1,1.5", help="open-loop rates as fractions of capacity")
    parser.add_argument("--pipeline-batch-sizes", default=None,
                        help="in-process pipeline batch sizes (default 1,8,16,32,64; with --quick 1,8,32)")
    parser.add_argument("--no-pipeline-bf16", action="store_true", help="skip the base bf16 pipeline (info only)")
    parser.add_argument("--wait-quiet", type=float, default=None,
                        help="before each measured phase, wait up to this many seconds for the rest of the machine "
                             "to use < 0.3 cores (default 15; with --quick 0)")
    parser.add_argument("--wait-budget", type=float, default=150.0,
                        help="most seconds spent waiting for quiet over the whole run")
    parser.add_argument("--families", default=None,
                        help="measure these model families' tiny checkpoints instead of --sizes: 'all' or a "
                             "comma-separated list of " + ", ".join(FAMILIES))
    parser.add_argument("--family-shape", choices=sorted(FAMILY_SHAPES), default="tiny",
                        help="with --families: the checkpoints' shape, tiny (2 layers, hidden 32-64), small "
                             "(4 layers, hidden 384) or base (12 layers, hidden 768)")
    parser.add_argument("--server-args", default="",
                        help="extra ws_server.py flags for every server config, e.g. '--torch-threads 1'")
    args = parser.parse_args(argv)
    sizes_arg = args.sizes or ("tiny" if args.quick else "tiny,base")
    sizes = [s.strip() for s in sizes_arg.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in FULL]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {sorted(FULL)}")
    corpora = [c.strip() for c in args.corpora.split(",") if c.strip()]
    if not corpora or any(c not in CORPORA for c in corpora):
        parser.error(f"--corpora takes {', '.join(sorted(CORPORA))}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    families: list[str] = []
    if args.families is not None:
        families = list(FAMILIES) if args.families.strip() == "all" else [
            f.strip() for f in args.families.split(",") if f.strip()]
        unknown = [f for f in families if f not in FAMILIES]
        if not families or unknown:
            parser.error(f"unknown famil{'ies' if len(unknown) > 1 else 'y'} {unknown}; choose 'all' or from "
                         f"{', '.join(FAMILIES)}")
        sizes = []
    timing = {}
    if families:
        base = FAMILY_TIMING["quick" if args.quick else "base" if args.family_shape == "base" else "full"]
        timing["family"] = base if args.repeats is None else Timing(**{**asdict(base), "repeats": args.repeats})
    for size in sizes:
        base = (QUICK if args.quick else FULL)[size]
        timing[size] = base if args.repeats is None else Timing(**{**asdict(base), "repeats": args.repeats})
    return Settings(
        sizes=sizes, corpora=corpora, out=args.out or ROOT / "bench" / ("out/tmp" if args.quick else "results"),
        models=args.models,
        quick=args.quick, clients=args.clients,
        in_flight=tuple(int(k) for k in (args.in_flight or ("1,8,16" if families else "1,4")).split(",")),
        open_factors=tuple(float(f) for f in args.open_factors.split(",")),
        pipeline_batch_sizes=tuple(int(n) for n in (args.pipeline_batch_sizes
                                                     or ("1,8,32" if args.quick else "1,8,16,32,64")).split(",")),
        pipeline_bf16=not args.no_pipeline_bf16, repeats=args.repeats, timing=timing,
        server_args=tuple(shlex.split(args.server_args)), families=families, family_shape=args.family_shape,
        gate=QuietGate(args.wait_quiet if args.wait_quiet is not None else (0.0 if args.quick else 15.0),
                       args.wait_budget),
    )


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    started = time.time()
    meta = machine_info()
    summary = asyncio.run(run_families(settings) if settings.families else run_all(settings))
    meta.update({
        "command": " ".join([".venv/bin/python", "bench/run.py", *map(shlex.quote, sys.argv[1:] if argv is None
                                                                       else argv)]),
        "date": datetime.datetime.fromtimestamp(started, datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "duration_s": time.time() - started,
    })
    summary["meta"] = meta
    summary["settings"] = {
        "corpora": settings.corpora,
        "clients": settings.clients, "in_flight": list(settings.in_flight),
        "open_factors": list(settings.open_factors), "pipeline_batch_sizes": list(settings.pipeline_batch_sizes),
        "quick": settings.quick, "server_args": list(settings.server_args),
        "quiet_waits": {"count": settings.gate.waits, "waited_s": round(settings.gate.waited_s, 1),
                        "per_wait_s": settings.gate.per_wait_s, "budget_s": settings.gate.budget_s},
        "per_size": {size: asdict(t) for size, t in settings.timing.items()},
    }
    if settings.families:
        summary["settings"]["repeats"] = settings.timing["family"].repeats
        summary["settings"]["family_shape"] = settings.family_shape
        for path in write_families(summary, settings.out):
            log(f"wrote {path}")
        print(families_markdown(summary))
        return 0
    summary["targets"] = report.targets(summary)
    for path in report.write_all(summary, settings.out):
        log(f"wrote {path}")
    print()
    print("| target | measured | ratio / value | goal | result | others' CPU cores (server / pipeline) |")
    print("|---|---|---|---|---|---|")
    for row in summary["targets"]:
        print(report.target_line(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
