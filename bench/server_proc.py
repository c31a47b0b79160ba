"""The real server as a subprocess, and CPU accounting for the benchmark's phases.

``ServerProcess`` starts ``python ws_server.py --model DIR --port 0 ...``, waits for its
``ready: ws://127.0.0.1:PORT/ ...`` line and stops it with SIGTERM (then SIGKILL) on exit, whatever
happens; bench/ and scripts/ start servers with it alone. ``CpuMeter`` reads ``/proc`` to split a
phase's CPU time between the server, this process (the load generator) and everything else on the
machine (other users: the noise); ``rss_mb`` reads a process's resident memory.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"^ready: (ws://127\.0\.0\.1:(\d+)/)")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class ServerStartError(RuntimeError):
    """The server exited or stayed silent instead of printing its ready line."""


class ServerProcess:
    """``with ServerProcess(model_dir, extra_args) as server:`` gives ``server.url``, ``server.port`` and
    ``server.pid``; after the block, ``server.returncode`` is the server's exit status (0 after a clean
    drain; negative: the signal that killed it)."""

    def __init__(self, model_dir: Path, extra_args: list[str], start_timeout: float = 180.0,
                 script: str = "ws_server.py", env: dict[str, str] | None = None, log_level: str = "warning") -> None:
        self.script = script  # another server with the same flags and ready line, e.g. bench/peers/seed.py
        self.env = env or {}  # set for the server beside this process's environment
        self.log_level = log_level  # the server's --log-level (its log: ``log_lines`` while it runs)
        self.model_dir = model_dir
        self.extra_args = extra_args
        self.start_timeout = start_timeout
        self.url = ""
        self.port = 0
        self.pid = 0
        self.start_s = 0.0
        self.returncode: int | None = None
        self._process: subprocess.Popen[str] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="fillmask-bench-server-", suffix=".log", delete=False)  # noqa: SIM115

    @property
    def log_path(self) -> str:
        return self._log.name

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               **self.env}
        command = [sys.executable, self.script, "--model", str(self.model_dir), "--host", "127.0.0.1",
                   "--port", "0", "--log-level", self.log_level, *self.extra_args]
        started = time.perf_counter()
        self._process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log,
                                         text=True, bufsize=1, start_new_session=True)
        self.pid = self._process.pid
        try:
            self.url, self.port = self._wait_ready()
        except BaseException:
            self._stop()
            raise
        self.start_s = time.perf_counter() - started
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop()
        if exc_type is None:  # keep the server's log only when something went wrong
            Path(self.log_path).unlink(missing_ok=True)

    def stop(self) -> int | None:
        """Stop it now as the block's end would (SIGTERM, then SIGKILL after 15 s); its exit status. Its
        log stays readable (``log_lines``) until the block ends."""
        self._stop()
        return self.returncode

    def _wait_ready(self) -> tuple[str, int]:
        """Read stdout (in a thread, so that the wait is bounded) until the ready line."""
        assert self._process is not None and self._process.stdout is not None
        found: list[tuple[str, int]] = []
        stdout = self._process.stdout

        def read() -> None:
            for line in stdout:
                match = READY.match(line.strip())
                if match:
                    found.append((match.group(1), int(match.group(2))))
                    break
            # keep draining stdout so the server never blocks on a full pipe
            for _ in stdout:
                pass

        threading.Thread(target=read, name="server-stdout", daemon=True).start()
        give_up = time.monotonic() + self.start_timeout
        while not found:
            if self._process.poll() is not None:
                raise ServerStartError(f"server exited with {self._process.returncode}; log: {self.log_path}\n"
                                       + self._tail_log())
            if time.monotonic() > give_up:
                raise ServerStartError(f"server not ready after {self.start_timeout:.0f} s; log: {self.log_path}")
            time.sleep(0.05)
        return found[0]

    def log_lines(self) -> list[str]:
        """The server's log so far (stderr), one line each (none where it cannot be read)."""
        with contextlib.suppress(OSError):
            return Path(self.log_path).read_text(errors="replace").splitlines()
        return []

    def _tail_log(self, lines: int = 20) -> str:
        return "\n".join(self.log_lines()[-lines:])

    def _stop(self) -> None:
        """SIGTERM (the server drains), then SIGKILL to the whole process group after 15 s."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        self.returncode = process.returncode
        self._log.close()
        self._process = None

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def rss_mb(self) -> float:
        """The server's resident memory now, in MiB (NaN once it has exited)."""
        return rss_mb(self.pid)


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB, from ``/proc/PID/status``; NaN when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return math.nan
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan  # a zombie has no VmRSS line


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) from ``/proc/PID/stat``."""
    try:
        return _stat_cpu_s(f"/proc/{pid}/stat")
    except OSError:
        return 0.0


def _stat_cpu_s(path: str) -> float:
    """User + system CPU seconds from a ``stat`` file of /proc (a process's or one thread's)."""
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15 of stat)


THREAD_GROUPS = {"fillmask-model": "model", "fillmask-intake": "intake", "fillmask-decode": "decode"}


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """Per thread of process ``pid``: (its group, user + system CPU seconds), from ``/proc/PID/task``.

    Groups: ``loop`` (the main thread: the event loop), ``model`` (the model thread and the torch workers
    it started, which inherit its name), ``intake``, ``decode`` (the engine's stages name their threads,
    ``engine.name_os_thread``), ``other`` (anything else). Threads that end in between are not seen.
    """
    out: dict[int, tuple[str, float]] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            seconds = _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue  # it ended meanwhile
        out[int(tid)] = ("loop" if int(tid) == pid else THREAD_GROUPS.get(comm, "other"), seconds)
    return out


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed over cores, from ``/proc/stat``."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already counted in user
    return (total - idle) / CLOCK_TICKS, total / CLOCK_TICKS


@dataclass
class CpuShare:
    """Average cores used during a phase: by the server, by the load generator, by everyone else; and
    the server's by thread group (``thread_cpu_s``)."""

    server: float
    client: float
    other: float
    cores: int
    threads: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"server": round(self.server, 2), "client": round(self.client, 2), "other": round(self.other, 2),
                "cores": self.cores, "threads": {name: round(value, 3) for name, value in self.threads.items()}}

    def per_request_us(self, answers: int) -> dict[str, float]:
        """CPU microseconds per answer, for ``answers`` answered over the same span as this share: each
        server thread group's and the load generator's (``client``); empty when nothing was answered."""
        if answers <= 0 or self.wall_s <= 0:
            return {}
        return {name: round(cores * self.wall_s * 1e6 / answers, 1)
                for name, cores in {**self.threads, "client": self.client}.items()}


class CpuMeter:
    """``meter = CpuMeter(pid); ...; share = meter.stop()``: CPU split over the time in between.

    With ``server_pid=None`` there is no server: ``client`` is this process and its reaped children.
    """

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self._t0 = time.perf_counter()
        self._server0 = process_cpu_s(server_pid) if server_pid else 0.0
        self._threads0 = thread_cpu_s(server_pid) if server_pid else {}
        self._client0 = _self_cpu_s()
        self._busy0, _ = machine_cpu_s()

    def stop(self) -> CpuShare:
        wall = max(1e-9, time.perf_counter() - self._t0)
        server = (process_cpu_s(self.server_pid) - self._server0) / wall if self.server_pid else 0.0
        client = (_self_cpu_s() - self._client0) / wall
        busy = (machine_cpu_s()[0] - self._busy0) / wall
        threads: dict[str, float] = {}
        if self.server_pid:
            for tid, (group, seconds) in thread_cpu_s(self.server_pid).items():
                used = seconds - self._threads0.get(tid, (group, 0.0))[1]
                threads[group] = threads.get(group, 0.0) + used / wall
        return CpuShare(server, client, max(0.0, busy - server - client), os.cpu_count() or 1, threads, wall)


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # finished probes; the server is still running
    return usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime


def wait_quiet(max_wait_s: float, threshold: float = 0.3, sample_s: float = 1.0) -> dict[str, float]:
    """Wait (at most ``max_wait_s``) until the rest of the machine uses under ``threshold`` cores.

    Call it while nothing of the benchmark runs: everything busy then is someone else. Returns how
    long it waited and the load of the last one-second sample, for the report.
    """
    started = time.perf_counter()
    load = math.nan
    while True:
        busy0, _ = machine_cpu_s()
        t0 = time.perf_counter()
        time.sleep(sample_s)
        load = (machine_cpu_s()[0] - busy0) / (time.perf_counter() - t0)
        waited = time.perf_counter() - started
        if load < threshold or waited >= max_wait_s:
            return {"waited_s": round(waited, 1), "other_cores": round(load, 2)}


class QuietGate:
    """``wait_quiet`` before each measurement, at most ``per_wait_s`` each and ``budget_s`` in all.

    This machine is shared: other people's jobs come and go, and torch with one thread per core slows
    down many times over when another process takes a core. Waiting for a quiet moment before each
    phase (and recording the load seen during it) keeps the comparisons honest without unbounded waits.
    """

    def __init__(self, per_wait_s: float, budget_s: float, threshold: float = 0.3) -> None:
        self.per_wait_s = per_wait_s
        self.budget_s = budget_s
        self.threshold = threshold
        self.waited_s = 0.0
        self.waits = 0

    def wait(self) -> dict[str, float]:
        """Wait for quiet (bounded); returns ``{"waited_s", "other_cores"}`` or ``{}`` when disabled or spent."""
        allowed = min(self.per_wait_s, self.budget_s - self.waited_s)
        if allowed <= 0:
            return {}
        state = wait_quiet(allowed, self.threshold, sample_s=0.5)
        self.waited_s += state["waited_s"]
        self.waits += 1
        return state
