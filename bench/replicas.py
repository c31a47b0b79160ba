"""Replicas and the balancer (issue 11 item 6): what HAProxy adds, and what two replicas give on 2 cores.

    .venv/bin/python bench/replicas.py                        # tiny and base, about 8 minutes; writes
                                                              # bench/results/replicas.md
    .venv/bin/python bench/replicas.py --sizes tiny --repeats 1 --duration 3 --out /tmp/replicas.md   # smoke

Two experiments per model size, each on real subprocesses (``ws_server.py`` and Debian's ``haproxy``
running ``deploy/haproxy.cfg``), with the load generator of the main benchmark (``bench/loadgen.py``):

1. **The proxy's cost.** One replica (torch's default threads), measured directly and through HAProxy,
   interleaved: idle single requests (1 connection, 1 in flight) and a closed loop (32 connections x 1
   in flight). The difference in p50/p99 is what the extra hop costs.
2. **Scaling on this machine.** One replica with ``--torch-threads 2`` against two replicas with
   ``--torch-threads 1`` each, both behind HAProxy (so both pay the hop), closed loop with 32
   connections x 1 and x 4 in flight, plus idle requests. Each configuration runs alone on the machine.

Every phase waits (bounded) for the rest of the machine to be quiet and records the CPU used meanwhile
by the servers and HAProxy, by this load generator, and by everyone else. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import make_corpus
from bench.loadgen import closed_loop, idle_single, settle
from bench.run import ensure_checkpoint
from bench.server_proc import ROOT, ServerProcess, machine_cpu_s, process_cpu_s, wait_quiet

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Balancer:
    """``with Balancer([port, ...]) as lb:`` HAProxy with deploy/haproxy.cfg in front of those replicas."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.port = free_port()
        self.stats_port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}/"
        self.pid = 0
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Balancer:
        haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FILLMASK_")}
        env["FILLMASK_LB_BIND"] = f"127.0.0.1:{self.port}"
        env["FILLMASK_LB_STATS_BIND"] = f"127.0.0.1:{self.stats_port}"
        env.update({f"FILLMASK_REPLICA_{n}": f"127.0.0.1:{port}" for n, port in enumerate(self.ports, start=1)})
        self._process = subprocess.Popen([haproxy, "-db", "-f", str(ROOT / "deploy" / "haproxy.cfg")], env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid = self._process.pid
        give_up = time.monotonic() + 20
        while not self._all_up():  # every replica in rotation (the first checks take ~0.5 s)
            if self._process.poll() is not None or time.monotonic() > give_up:
                self.__exit__(None, None, None)
                raise RuntimeError("haproxy did not start, or the replicas never came up in it")
            time.sleep(0.1)
        return self

    def _all_up(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=2) as answer:
                rows = [line.split(",") for line in answer.read().decode().splitlines()[1:]]
        except OSError:
            return False
        states = [row[17] for row in rows if len(row) > 17 and row[0] == "replicas" and row[1] != "BACKEND"]
        return len(states) == len(self.ports) and all(state == "UP" for state in states)

    def __exit__(self, *exc_info: object) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None


class Meter:
    """Average cores used during a phase by the given processes, by this process, and by everyone else."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t0 = time.perf_counter()
        self.served0 = sum(process_cpu_s(pid) for pid in pids)
        self.self0 = time.process_time()
        self.busy0, _ = machine_cpu_s()

    def stop(self) -> dict[str, float]:
        wall = max(1e-9, time.perf_counter() - self.t0)
        served = (sum(process_cpu_s(pid) for pid in self.pids) - self.served0) / wall
        client = (time.process_time() - self.self0) / wall
        busy = (machine_cpu_s()[0] - self.busy0) / wall
        other = max(0.0, busy - served - client)
        return {"servers": round(served, 2), "client": round(client, 2), "other": round(other, 2)}


@dataclass
class Settings:
    sizes: list[str]
    repeats: int
    duration_s: float
    warmup_s: float
    idle_n: int
    wait_quiet_s: float
    out: Path


async def phase(kind: str, url: str, texts: list[str], pids: list[int], settings: Settings,
                in_flight: int = 1) -> dict[str, Any]:
    """One measured phase, after waiting (bounded) for a quiet machine; its summary with the CPU split."""
    quiet = wait_quiet(settings.wait_quiet_s, 0.3, sample_s=0.5) if settings.wait_quiet_s > 0 else {}
    meter = Meter(pids)
    if kind == "idle":
        summary = await idle_single(url, texts, settings.idle_n)
    else:
        summary = await closed_loop(url, texts, 32, in_flight, settings.warmup_s, settings.duration_s)
    summary["cpu"] = meter.stop()
    summary["quiet"] = quiet
    await settle(url)
    return summary


def median_of(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over repeats of the figures the report shows."""
    def med(get: Any) -> float:
        return statistics.median(get(run) for run in runs)

    return {
        "p50": med(lambda r: r["latency_ms"]["p50"]), "p99": med(lambda r: r["latency_ms"]["p99"]),
        "rps": med(lambda r: r["throughput_rps"]), "errors": max(r["errors"] + r["overloaded"] for r in runs),
        "servers": med(lambda r: r["cpu"]["servers"]), "client": med(lambda r: r["cpu"]["client"]),
        "other": max(r["cpu"]["other"] for r in runs),
    }


async def proxy_cost(model: Path, texts: list[str], settings: Settings) -> dict[str, dict[str, float]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    with ServerProcess(model, ["--log-level", "warning"]) as server, Balancer([server.port]) as lb:
        log(f"proxy cost: replica {server.url}, haproxy {lb.url}")
        await closed_loop(server.url, texts, 8, 1, 0.5, 1.0)  # warm-up: first batches, allocator
        for repeat in range(settings.repeats):
            for kind in ("idle", "closed"):
                for where, url in (("direct", server.url), ("haproxy", lb.url)):
                    result = await phase(kind, url, texts, [server.pid, lb.pid], settings)
                    runs.setdefault(f"{kind} {where}", []).append(result)
                    log(f"  r{repeat + 1} {kind:6} {where:7}: p50 {result['latency_ms']['p50']:.2f} ms, "
                        f"p99 {result['latency_ms']['p99']:.2f} ms, {result['throughput_rps']:.0f} req/s")
    return {key: median_of(value) for key, value in runs.items()}


async def scaling(model: Path, texts: list[str], settings: Settings) -> dict[str, dict[str, float]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    configs = {"1 replica x 2 threads": (1, 2), "2 replicas x 1 thread": (2, 1)}
    for repeat in range(settings.repeats):
        for name, (replicas, threads) in configs.items():
            args = ["--log-level", "warning", "--torch-threads", str(threads)]
            with contextlib.ExitStack() as stack:
                servers = [stack.enter_context(ServerProcess(model, args)) for _ in range(replicas)]
                lb = stack.enter_context(Balancer([s.port for s in servers]))
                pids = [*(s.pid for s in servers), lb.pid]
                await closed_loop(lb.url, texts, 8, 1, 0.5, 1.0)
                for kind, in_flight in (("idle", 1), ("closed", 1), ("closed", 4)):
                    result = await phase(kind, lb.url, texts, pids, settings, in_flight)
                    label = "idle" if kind == "idle" else f"32x{in_flight}"
                    runs.setdefault(f"{name} | {label}", []).append(result)
                    log(f"  r{repeat + 1} {name} {label:5}: p50 {result['latency_ms']['p50']:.2f} ms, "
                        f"p99 {result['latency_ms']['p99']:.2f} ms, {result['throughput_rps']:.0f} req/s")
    return {key: median_of(value) for key, value in runs.items()}


def render(results: dict[str, Any], settings: Settings, command: str) -> str:
    lines = ["# Replicas and HAProxy on this machine (issue 11)", "",
             f"Command: `{command}`  ", f"Machine: {results['machine']}  ",
             f"Git: `{results['git']}`; {settings.repeats} repeats (medians), closed-loop windows of "
             f"{settings.duration_s:g} s after {settings.warmup_s:g} s of warm-up, {settings.idle_n} idle requests.",
             "CPU columns: average cores used during the phase by the replicas + HAProxy (`servers`), by the load "
             "generator (`client`) and by everyone else (`other`, the worst repeat).", ""]
    for size, data in results["sizes"].items():
        lines += [f"## {size}", "", "### What the proxy adds (one replica, torch's default threads)", "",
                  "| phase | path | p50 ms | p99 ms | req/s | servers | client | other |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        cost = data["proxy_cost"]
        for key, row in cost.items():
            kind, where = key.split(" ")
            lines.append(f"| {kind} | {where} | {row['p50']:.2f} | {row['p99']:.2f} | {row['rps']:.0f} | "
                         f"{row['servers']:.2f} | {row['client']:.2f} | {row['other']:.2f} |")
        for kind in ("idle", "closed"):
            direct, proxied = cost[f"{kind} direct"], cost[f"{kind} haproxy"]
            lines.append("")
            lines.append(f"{kind}: HAProxy adds {proxied['p50'] - direct['p50']:+.2f} ms at p50 and "
                         f"{proxied['p99'] - direct['p99']:+.2f} ms at p99; throughput "
                         f"{proxied['rps'] / direct['rps']:.2f}x of direct.")
        lines += ["", "### One replica with 2 threads against two replicas with 1 thread each (both behind HAProxy)",
                  "", "| configuration | load | p50 ms | p99 ms | req/s | errors | servers | client | other |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for key, row in data["scaling"].items():
            name, load = key.split(" | ")
            lines.append(f"| {name} | {load} | {row['p50']:.2f} | {row['p99']:.2f} | {row['rps']:.0f} | "
                         f"{row['errors']} | {row['servers']:.2f} | {row['client']:.2f} | {row['other']:.2f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    import torch

    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


async def main_async(settings: Settings, command: str) -> int:
    texts = make_corpus(200)
    results: dict[str, Any] = {"machine": machine(), "sizes": {},
                               "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                     capture_output=True, text=True).stdout.strip()}
    for size in settings.sizes:
        model = ensure_checkpoint(size, ROOT / "models")
        log(f"{size}: the proxy's cost")
        cost = await proxy_cost(model, texts, settings)
        log(f"{size}: one replica x 2 threads against two x 1 thread")
        scale = await scaling(model, texts, settings)
        results["sizes"][size] = {"proxy_cost": cost, "scaling": scale}
    report = render(results, settings, command)
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    settings.out.write_text(report, encoding="utf-8")
    print(report)
    log(f"wrote {settings.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/replicas.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,base", help="model sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=6.0, help="closed-loop window, seconds")
    parser.add_argument("--warmup", type=float, default=1.0, help="closed-loop warm-up, seconds")
    parser.add_argument("--idle-n", type=int, default=300, help="idle requests per phase")
    parser.add_argument("--wait-quiet", type=float, default=10.0,
                        help="seconds to wait at most, before each phase, for the rest of the machine to be quiet")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "replicas.md")
    args = parser.parse_args(argv)
    settings = Settings([s.strip() for s in args.sizes.split(",") if s.strip()], args.repeats, args.duration,
                        args.warmup, args.idle_n, args.wait_quiet, args.out)
    if shutil.which("haproxy") is None and not os.access("/usr/sbin/haproxy", os.X_OK):
        parser.error("haproxy is not installed (bash scripts/setup.sh --test installs it)")
    command = " ".join(["bench/replicas.py", *(argv if argv is not None else sys.argv[1:])])
    return asyncio.run(main_async(settings, command))


if __name__ == "__main__":
    raise SystemExit(main())
