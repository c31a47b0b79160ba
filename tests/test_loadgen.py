"""One load generator for bench/ and scripts/ (issue 18 item 7): ``bench.loadgen.Client`` and its policy
hooks against a real server, and the scripts built on it rather than on copies of it."""

from __future__ import annotations

import ast
import asyncio
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.loadgen import POLITE, RESULT, Client, Policy, Recorder, close_all, open_client
from fillmask_server.server import FillMaskServer

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["Paris is the [MASK] of France."]


def client_without_socket(policy: Policy) -> Client:
    return Client(None, TEXTS, 0, Recorder(), policy=policy)  # type: ignore[arg-type]


async def test_back_off_is_a_policy() -> None:
    """A polite client waits out retry_after_ms (§6); one with ``backoff=False`` may send at once."""
    polite, hog = client_without_socket(POLITE), client_without_socket(Policy(backoff=False))
    for client in (polite, hog):
        client.hold_until = time.perf_counter() + 60  # as after "retry_after_ms": 60000
    await asyncio.wait_for(hog.wait_until_allowed(), 5)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(polite.wait_until_allowed(), 0.1)


async def test_a_client_that_never_reads_leaves_its_answer_unread(server: FillMaskServer) -> None:
    recorder = Recorder()
    client = await open_client(server.url, TEXTS, recorder, policy=Policy(reads=False), fields={"top_k": 2})
    try:
        await client.send()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.read_one(), 0.5)
        assert recorder.kind == [""]
        client.policy = POLITE  # the answer was there all along
        frame = await asyncio.wait_for(client.read_one(), 30)
        assert frame["type"] == "result" and len(frame["predictions"]) == 2 and recorder.kind == ["result"]
    finally:
        await close_all([client])


async def test_a_slow_reader_takes_each_answer_at_its_rate(server: FillMaskServer) -> None:
    """``read_bytes_per_s``: reading an answer of n bytes takes at least n / rate seconds. (And an answer
    for no pending request, as a second answer would be, is filed as a stray.)"""
    recorder = Recorder()
    client = await open_client(server.url, TEXTS, recorder)
    try:
        await client.send()
        client.pending.clear()  # as if it had been answered already
        assert (await asyncio.wait_for(client.read_one(), 30))["type"] == "result"
        assert len(recorder.strays) == 1 and recorder.kind == [""]
        client.policy = Policy(read_bytes_per_s=1000)
        await client.send()
        started = time.perf_counter()
        frame = await asyncio.wait_for(client.read_one(), 30)
        assert time.perf_counter() - started >= len(orjson.dumps(frame)) / 1000  # a few hundred bytes: ~0.3 s
        assert recorder.kind == ["", "result"]
    finally:
        await close_all([client])


def _defined_and_imported(path: Path) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text())
    defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef
                                                                    | ast.ClassDef)}
    imported = {f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    return defined, imported


def test_the_scripts_use_the_one_load_generator_and_server_process() -> None:
    """scripts/soak.py and scripts/reliability.py open connections with bench.loadgen and start servers with
    bench.server_proc; nothing of either is written twice (``rss_mb`` exists once)."""
    files = [*sorted((ROOT / "bench").glob("*.py")), ROOT / "scripts" / "soak.py", ROOT / "scripts" / "reliability.py"]
    definitions: dict[str, list[str]] = {}
    for path in files:
        defined, imported = _defined_and_imported(path)
        for name in defined:
            definitions.setdefault(name, []).append(path.name)
        if path.parent.name == "scripts":
            assert "bench.loadgen.open_client" in imported and "bench.server_proc.ServerProcess" in imported, path
            assert "websockets.asyncio.client.connect" not in imported, path
            assert "create_subprocess_exec" not in path.read_text() and "Popen" not in path.read_text(), path
    assert set(definitions["rss_mb"]) == {"server_proc.py"}  # the function, and ServerProcess's method on it
    assert definitions["Client"] == ["loadgen.py"] and definitions["ServerProcess"] == ["server_proc.py"]


def test_the_health_probers_phase_is_apart_from_the_capacity_and_gives_the_healthz_figures() -> None:
    """The ``/healthz`` prober takes CPU from the server during its window, so its phase (mode
    ``probed``) must not set the capacity the throughput ratios use; the health target reads it."""
    from bench import report

    closed = {"mode": "closed", "clients": 32, "in_flight": 4, "throughput_rps": 100.0}
    probed = {"mode": "probed", "clients": 32, "in_flight": 4, "throughput_rps": 80.0,
              "healthz_p50_ms": 2.0, "healthz_p99_ms": 9.0}
    server = {"name": "base fp32", "size": "base", "corpus": "short", "phases": [closed, probed]}
    assert report.capacity(server) == 100.0
    pipe = {"name": "base fp32", "corpus": "short", "best_rps": 50.0, "limit_rps": 125.0}
    summary = {"settings": {"corpora": ["short"]}, "servers": [server], "pipelines": [pipe]}
    rows = {row["target"]: row for row in report.targets(summary)}
    assert rows["[short] base fp32 server ÷ in-process limit"]["value"] == pytest.approx(0.8)
    health = next(row for target, row in rows.items() if "/healthz" in target)
    assert health["value"] == 9.0
    assert report._load(probed) == "closed 32×4 + /healthz"


def test_a_target_whose_figure_is_missing_is_a_miss_not_a_row_left_out() -> None:
    """A prober that failed, or a limit that could not be measured, used to drop its row from the
    targets table, so that "every target passed" could be read above a table without it."""
    from bench import report

    closed = {"mode": "closed", "clients": 32, "in_flight": 4, "throughput_rps": 100.0}
    probed = {"mode": "probed", "clients": 32, "in_flight": 4, "throughput_rps": 80.0}  # its prober failed
    server = {"name": "base fp32", "size": "base", "corpus": "short", "phases": [closed, probed]}
    pipe = {"name": "base fp32", "corpus": "short", "best_rps": 50.0, "limit_rps": math.nan}
    summary = {"settings": {"corpora": ["short"]}, "servers": [server], "pipelines": [pipe]}
    rows = {row["target"]: row for row in report.targets(summary)}
    limit = rows["[short] base fp32 server ÷ in-process limit"]
    assert limit["pass"] is False and limit["measured"] == "not measured"
    health = next(row for target, row in rows.items() if "/healthz" in target)
    assert health["pass"] is False and "–" in health["shown"]
    assert "MISS" in report.target_line(limit) and "MISS" in report.target_line(health)
    unprobed = {"name": "base fp32", "size": "base", "corpus": "short", "phases": [closed]}  # no prober in this run
    summary["servers"] = [unprobed]
    assert not any("/healthz" in row["target"] for row in report.targets(summary))


def test_the_throughput_of_a_window_charges_a_stall_at_its_edge() -> None:
    """Big batches answer in bursts, and the rate from the first burst to the last keeps a window's
    phase from quantising it; but a server that stops answering halfway through a window is not as
    fast as one that never stops. 64 answers every 0.5 s in a 10-s window: 128 req/s; stopping after
    5.9 s, 76.8 (it was reported as 128)."""
    from bench.loadgen import _throughput

    def bursts(times: list[float]) -> list[float]:
        return [t + n * 0.0001 for t in times for n in range(64)]

    steady = bursts([0.3 + 0.5 * k for k in range(20)])  # the window's phase: the first burst 0.3 s in
    assert _throughput(steady, (0.0, 10.0)) == pytest.approx(128, rel=0.01)
    stalled = bursts([0.3 + 0.5 * k for k in range(12)])  # nothing after 5.8 s
    assert _throughput(stalled, (0.0, 10.0)) == pytest.approx(76.8, rel=0.01)
    late = bursts([4.3 + 0.5 * k for k in range(12)])  # nothing in the first 4.3 s
    assert _throughput(late, (0.0, 10.0)) == pytest.approx(76.8, rel=0.01)


def test_the_health_prober_counts_a_stall_for_every_tick_it_covered() -> None:
    """A prober that waits for each answer and skips the ticks it missed recorded a 150-ms stall as one
    slow probe among dozens (p99 unmoved): each skipped tick now counts from its own due time to the
    answer that ended the stall, and every tick of the window is a sample or a failure."""
    import socket

    from bench import probe

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stall_at, answered = 5, 0

    def serve() -> None:
        nonlocal answered
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.recv(4096)
                answered += 1
                if answered == stall_at:
                    time.sleep(0.15)
                conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"status":"ok"}')

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        result = probe.run(listener.getsockname()[1], interval=0.02, duration=0.6, timeout=2.0)
    finally:
        listener.close()
        server.join(5)
    latencies = result["latencies_ms"]
    assert len(latencies) + result["failures"] == 30 and result["failures"] == 0
    assert result["skipped"] >= 6
    assert sum(latency >= 100 for latency in latencies) >= 3  # the stall's 150, 130 and 110 ms at least


def _burn(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread CPU is read from Linux's /proc")
def test_the_cpu_meter_splits_a_process_by_its_named_threads() -> None:
    """A thread named as the engine's decode stage names itself is counted as ``decode``, the main
    thread as ``loop``; per request divides by the rate, and the load generator is ``client``."""
    from bench.server_proc import CpuMeter
    from fillmask_server.engine import name_os_thread

    burnt, done = threading.Event(), threading.Event()

    def decode_stage() -> None:
        name_os_thread("fillmask-decode")
        _burn(0.2)
        burnt.set()
        done.wait(30)  # alive when the meter stops: a thread that ended is not seen

    meter = CpuMeter(os.getpid())  # this process plays the server
    worker = threading.Thread(target=decode_stage)
    worker.start()
    try:
        _burn(0.05)
        assert burnt.wait(30)
        share = meter.stop()
    finally:
        done.set()
        worker.join(timeout=30)
    assert share.threads["decode"] > 0.0
    if threading.current_thread() is threading.main_thread():  # (pytest-xdist runs tests on it)
        assert share.threads["loop"] > 0.0
    # per answer over the meter's span: cores x span / answers
    per = share.per_request_us(100)
    assert per["decode"] == pytest.approx(share.threads["decode"] * share.wall_s * 1e4, rel=0.01)
    assert per["decode"] >= 0.2e6 / 100 * 0.9  # at least the 0.2 s the thread burnt, over 100 answers
    assert {"decode", "client"} <= set(per)
    assert share.per_request_us(0) == {}


def test_the_limit_is_measured_before_and_after_the_servers_and_the_ratio_uses_their_mean() -> None:
    """A limit that drifts while the servers run (the machine's speed moves) is bracketed: the ratio
    uses the mean of before and after, the target row shows both, and a drift past LIMIT_DRIFT warns."""
    from bench import report

    server = {"name": "tiny fp32", "size": "tiny", "corpus": "short",
              "phases": [{"mode": "closed", "clients": 32, "in_flight": 4, "throughput_rps": 300.0}]}
    steady = {"name": "tiny fp32", "corpus": "short", "best_rps": 100.0, "limit_rps": 380.0}
    report.bracket_limit(steady, [420.0, 400.0, 440.0])  # after: median 420
    assert steady["limit_rps"] == pytest.approx(400.0) and steady["limit_drift"] == pytest.approx(420 / 380 - 1)
    summary = {"settings": {"corpora": ["short"]}, "servers": [server], "pipelines": [steady]}
    row = next(r for r in report.targets(summary) if "in-process limit" in r["target"])
    assert row["value"] == pytest.approx(0.75)
    assert "before 380.0, after 420.0" in row["measured"] and "⚠" not in row["measured"]
    moved = {"name": "tiny fp32", "corpus": "short", "best_rps": 100.0, "limit_rps": 300.0}
    report.bracket_limit(moved, [500.0])
    summary["pipelines"] = [moved]
    row = next(r for r in report.targets(summary) if "in-process limit" in r["target"])
    assert row["value"] == pytest.approx(0.75) and "⚠ it moved +67%" in row["measured"]
    unbracketed = {"limit_rps": 10.0}
    report.bracket_limit(unbracketed, [])
    assert unbracketed == {"limit_rps": 10.0} and report.limit_note(unbracketed) == ""


def test_the_limit_only_mode_measures_the_limits_on_the_family_corpus(tiny_model_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import pipeline_limits
    from bench.server_proc import QuietGate

    monkeypatch.setattr(pipeline_limits, "MIN_TIMED_S", 0.0)  # one pass each: this checks the shape, not speed
    result = pipeline_limits.measure_limits_only(str(tiny_model_dir), "float32", 8, 2, 0, QuietGate(0.0, 0.0),
                                                 "short", family="bert")
    assert len(result["limit"]) == 2 and len(result["limit_forward_only"]) == 2
    assert all(rate > 0 for rate in result["limit"] + result["limit_forward_only"])
    assert result["n_texts"] == 8 and result["corpus"] == "short" and result["limit_batch"] == 8


def test_the_limit_is_the_fastest_batch_size_so_no_batch_the_server_forms_beats_it(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A limit timed at batches of 32 alone was beaten by the server's 64-row batches (1.15-1.28x): each
    repeat's limit is the fastest of ``LIMIT_BATCHES``, and the run names the size that won. Here the
    timer is replaced by one that charges each forward pass a fixed cost, so the biggest batch wins
    whatever this machine's speed."""
    import torch

    from bench import pipeline_limits
    from bench.server_proc import QuietGate
    from fillmask_server.loading import load_model

    model = load_model(str(tiny_model_dir), "cpu")
    calls = 0
    forward = model.forward

    def counted(items: Any) -> Any:
        nonlocal calls
        calls += 1
        return forward(items)

    def one_pass_per_forward_call(once: Any, count: int) -> float:
        nonlocal calls
        calls = 0
        once()
        return count / calls  # a pass per second each forward call: fewer, bigger batches are faster

    monkeypatch.setattr(model, "forward", counted)
    monkeypatch.setattr(pipeline_limits, "timed_rate", one_pass_per_forward_call)
    texts = [f"Paris is the [MASK] of France number {n}." for n in range(100)]
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one thread: one pass only (parts: below)
    try:
        full, forward_only, size, parts = pipeline_limits.limit_rates(model, texts, 2, QuietGate(0.0, 0.0))
        assert size == 100 and parts == 1  # 128 rows is more than the texts: all of them in one batch
        assert full == [100.0, 100.0] and forward_only == [100.0, 100.0]
        full, _, size, parts = pipeline_limits.limit_rates(model, texts, 1, QuietGate(0.0, 0.0), sizes=(32, 64))
        assert size == 64 and parts == 1 and full == [50.0]
    finally:
        torch.set_num_threads(before)  # (the limit leaves the count it found, here the fake one)


def test_the_limit_also_times_each_batch_size_in_parts_as_the_server_can_run_it(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server may run a batch in two parts side by side (``--forward-parts``), so the limit times that
    layout too and names it when it wins; the answers it decodes are each part's own. A timer that
    counts only the passes on the calling thread, and charges a batch whole twice, makes parts win
    here whatever this machine's speed."""
    import torch

    from bench import pipeline_limits
    from bench.server_proc import QuietGate
    from fillmask_server import decode
    from fillmask_server.loading import load_model

    model = load_model(str(tiny_model_dir), "cpu")
    here: list[int] = []  # rows of each pass on the calling thread
    helper = 0
    forward = model.forward

    def counted(items: Any) -> Any:
        nonlocal helper
        if threading.current_thread() is threading.main_thread():
            here.append(len(items))
        else:
            helper += 1
        return forward(items)

    decoded: list[int] = []
    runs: list[list[int]] = []  # each timed run's decoded indices

    def charged(once: Any, count: int) -> float:
        here.clear()
        decoded.clear()
        once()
        runs.append(sorted(decoded))
        return count / sum(2 if rows == 8 else 1 for rows in here)  # a whole batch of 8 costs two

    predictions = decode.predictions_json
    monkeypatch.setattr(decode, "predictions_json", lambda d, item, topk, n: decoded.append(n) or predictions(
        d, item, topk, n))
    monkeypatch.setattr(model, "forward", counted)
    monkeypatch.setattr(pipeline_limits, "timed_rate", charged)
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    texts = [f"Paris is the [MASK] of France number {n}." for n in range(8)]
    try:
        full, _, size, parts = pipeline_limits.limit_rates(model, texts, 1, QuietGate(0.0, 0.0), sizes=(8,))
    finally:
        torch.set_num_threads(before)
    assert (size, parts) == (8, 2) and full == [8.0] and helper > 0
    # One pass decodes texts 0-7 of its top-k; two parts, 0-3 of each part's own.
    assert {tuple(run) for run in runs if run} == {(0, 0, 1, 1, 2, 2, 3, 3), tuple(range(8))}


def test_the_sweep_names_the_flag_sets_ahead_of_the_defaults_on_both_throughput_and_p99() -> None:
    """The goals compare the defaults with the sweep's best req/s and its best p99, which may come from
    two flag sets that each give up the other figure; the sweep also says whether one flag set beat
    the defaults on both (req/s, p50, p99 medians), and whether beyond the repeats' spread: on both
    figures, and only where both have repeats to spread."""
    from bench import adaptive

    rows = {"defaults": (100.0, 30.0, 50.0), "faster, longer tail": (120.0, 30.0, 60.0),
            "tighter tail, slower": (90.0, 35.0, 40.0), "ahead": (110.0, 28.0, 45.0),
            "level": (100.0, 30.0, 50.0)}
    assert adaptive.ahead_of_defaults(rows) == {"ahead": (pytest.approx(1.1), pytest.approx(0.9), None)}
    ahead = ([105.0, 110.0, 111.0], [43.0, 45.0, 47.0])  # each repeat's req/s, each repeat's p99
    cases = {"overlapping": ([95.0, 100.0, 112.0], [44.0, 50.0, 52.0]),  # the defaults' repeats
             "apart on req/s only": ([95.0, 100.0, 104.0], [44.0, 50.0, 52.0]),
             "apart on p99 only": ([95.0, 100.0, 112.0], [48.0, 50.0, 52.0]),
             "apart": ([95.0, 100.0, 104.0], [48.0, 50.0, 52.0])}
    beyond = {case: adaptive.ahead_of_defaults(rows, {"defaults": defaults, "ahead": ahead})["ahead"][2]
              for case, defaults in cases.items()}
    assert beyond == {"overlapping": False, "apart on req/s only": False, "apart on p99 only": False, "apart": True}
    one_repeat: adaptive.Repeats = {"defaults": ([100.0], [50.0]), "ahead": ([110.0], [45.0])}
    assert adaptive.ahead_of_defaults(rows, one_repeat)["ahead"][2] is None  # no spread was measured
    assert adaptive.ahead_line(rows, {"defaults": cases["apart"], "ahead": ahead}) == (
        "flag sets ahead of the defaults on both req/s and p99: ahead (1.100x req/s, 0.900x p99, beyond the "
        "repeats' spread)")
    assert adaptive.ahead_line(rows, one_repeat).endswith("(1.100x req/s, 0.900x p99, spread unknown: one repeat)")
    del rows["ahead"]
    assert adaptive.ahead_line(rows).endswith(": none (none served more with a lower p99)")


def test_the_sweep_keeps_what_each_repeats_server_said_of_its_engine() -> None:
    """Two of eight default servers once ended a sweep on one thread, and the sweep kept no log to say
    why. Now each repeat's engine lines are printed under its flags, its repeat and the layout it
    ended on; a server with nothing to say (the seed design) is left out."""
    from bench import adaptive

    said = ["21:46:41.161 calibrated in 1.41 s: torch threads 2 in 2 parts of 1", "21:46:50.001 torch threads "
            "2 in 2 parts -> 1: batches so won"]
    runs = {"defaults": [{"torch_threads": 2, "forward_parts": 2, "log": said[:1]},
                         {"torch_threads": 1, "forward_parts": 1, "log": said}],
            "seed design": [{"torch_threads": 0, "forward_parts": 1, "log": []}]}
    text = "\n".join(adaptive.log_lines(runs, "short"))
    assert "`defaults, repeat 1, ended on 2 in 2 parts` [short]:" in text
    assert "`defaults, repeat 2, ended on 1` [short]:" in text and "    21:46:50.001 torch threads 2 in 2" in text
    assert "seed design" not in text
    assert adaptive.log_lines({"seed design": runs["seed design"]}, "short") == []


def test_the_seed_design_is_also_compared_at_the_same_arrival_rate() -> None:
    """At the same concurrency a closed loop's p99 ratio is about 1 / its throughput ratio, so the seed
    design is also compared in an open loop at the same rate; a seed that answered nothing in its window
    gets a line that says so (it raised ZeroDivisionError after the whole sweep)."""
    from bench import adaptive

    def open_run(rate: float, p99: float) -> dict[str, Any]:
        return {"open": {"rate_rps": rate, "latency_ms": {"p99": p99}}}

    seed_runs, ours = [open_run(70.0, 30.0), open_run(70.0, 34.0)], [open_run(70.0, 9.0), open_run(70.0, 11.0)]
    lines = adaptive.seed_lines((400.0, 300.0, 400.0), (100.0, 1000.0, 1300.0), seed_runs, ours)
    closed, same_rate = lines.splitlines()
    assert "same concurrency" in closed and "throughput 4.00x, p99 0.31x" in closed
    assert "same arrival rate (open loop, 70.0 req/s = 0.7x the seed's throughput)" in same_rate
    assert "p99 10.0 ms against 32.0 ms, 0.31x (goal <= 0.7)" in same_rate
    assert len(adaptive.seed_lines((400.0, 300.0, 400.0), (100.0, 1000.0, 1300.0), [{}], []).splitlines()) == 1
    nothing = adaptive.seed_lines((400.0, 300.0, 400.0), (0.0, float("nan"), float("inf")), [{}], [])
    assert "answered nothing" in nothing and "--duration" in nothing
    unanswered = adaptive.seed_lines((400.0, 300.0, 400.0), (50.0, 1000.0, float("inf")), [{}], [])
    assert "left requests unanswered" in unanswered and "0.00x" not in unanswered


def test_the_sweep_stops_at_once_when_the_seed_peer_cannot_run(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """bench/adaptive.py runs the seed design last: without its packages it must say so before the
    sweep, not lose minutes of output when it gets there."""
    import importlib.util

    from bench import adaptive

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(SystemExit) as stopped:
        adaptive.main(["--sizes", "tiny"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    # (where starlette is missing too, as without the bench extras, the line names both)
    assert "the seed design needs" in err and "uvicorn:" in err
    assert "pip install -e '.[bench]'" in err and "--no-seed" in err


def test_a_limit_that_cannot_be_measured_after_the_servers_keeps_the_run(tmp_path: Path) -> None:
    """The servers' figures were already measured: a failed second limit leaves the ratio on the first."""
    from bench import report, run

    settings = run.parse_args(["--sizes", "tiny", "--quick"])
    after = run.limit_after(tmp_path / "no-such-model", "short", settings, settings.timing["tiny"])
    assert after == {}
    pipe = {"limit_rps": 100.0}
    report.bracket_limit(pipe, after.get("limit", []))
    assert pipe == {"limit_rps": 100.0}

def test_the_families_closed_loop_also_tries_eight_and_sixteen_in_flight_unless_told() -> None:
    """A tiny family's batch is over before its clients' next requests come back at 4 in flight, so its
    engine waits for them (at 8 too, a little); like the pipeline's best batch size, the server's best
    depth is reported."""
    from bench.run import parse_args

    assert parse_args([]).in_flight == (1, 4)
    assert parse_args(["--families", "bert"]).in_flight == (1, 8, 16)
    assert parse_args(["--families", "bert", "--in-flight", "4"]).in_flight == (4,)


def test_the_sweep_takes_a_familys_checkpoint_with_its_own_corpus() -> None:
    """bench/adaptive.py --sizes families/NAME: the family's texts with its mask token (protein sequences
    for ESM), as bench/run.py --families sends them; tiny and base keep the corpus as it is."""
    from bench import adaptive
    from bench.corpus import make_short_corpus
    from fillmask_server.checkpoint import ensure_family

    families = Path(__file__).resolve().parent.parent / "models" / "families"
    esm = adaptive.corpus_texts(ensure_family("esm", families), "families/esm", "short")
    assert esm and all("<mask>" in text and "[MASK]" not in text for text in esm)
    assert set("".join(esm).replace("<mask>", "")) <= set("ACDEFGHIKLMNPQRSTVWY")
    assert adaptive.corpus_texts(Path("models/tiny"), "tiny", "short") == make_short_corpus()


async def test_the_closed_loop_sends_one_request_per_answer_read_in_its_window(server: FillMaskServer) -> None:
    """The closed loop's task-free connections: each starts ``in_flight`` requests and sends one more per
    answer recorded before the window ends, so (counting) sent = clients x in_flight + answers recorded in
    time; every answer is its own request's result, and nothing is recorded after the window."""
    from bench.loadgen import closed_loop, settle

    recorder = Recorder()
    clients, in_flight = 3, 4
    summary = await closed_loop(server.url, TEXTS * 5, clients, in_flight, 0.2, 0.8, recorder=recorder)
    await settle(server.url)
    answered = [i for i, kind in enumerate(recorder.kind) if kind]
    assert answered and all(recorder.kind[i] == RESULT for i in answered) and not recorder.strays
    assert len(recorder.sent) == clients * in_flight + len(answered)
    assert all(recorder.done[i] >= recorder.sent[i] for i in answered)
    assert len(recorder.sent) - len(answered) == clients * in_flight  # each connection's last requests, unrecorded
    assert summary["results"] > 0 and summary["throughput_rps"] > 0 and summary["closed_by_server"] == {}


async def test_the_closed_loop_waits_as_an_overloaded_answer_says(make_server: Any) -> None:
    """A queue of one refuses most of 3 x 8 requests in flight with ``retry_after_ms`` (§6). The closed
    loop sends nothing on a connection before that time has passed, so the server, which closes a
    connection that keeps resending early with 1008 (§12), closes none; a loop that resent at once
    would be closed within the window."""
    from bench.loadgen import closed_loop, settle

    async with make_server(max_queue=1) as srv:
        summary = await closed_loop(srv.url, TEXTS, 3, 8, 0.0, 2.0)
        await settle(srv.url)
    assert summary["overloaded"] > 0 and summary["results"] > 0
    assert summary["closed_by_server"] == {}


async def test_a_closed_loop_whose_handshakes_are_refused_fails_at_once_with_the_reason(
        server: FillMaskServer) -> None:
    """A handshake the server refuses (here a path it does not serve: 404) fails the closed loop at
    once with websockets' own error, not after its 30-second wait for a hello, and leaves no
    exception unread for asyncio to log."""
    from websockets.exceptions import InvalidStatus

    from bench.loadgen import closed_loop

    loop = asyncio.get_running_loop()
    unread: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unread.append(context))
    try:
        started = time.perf_counter()
        with pytest.raises(InvalidStatus):
            await asyncio.wait_for(closed_loop(server.url + "nowhere", TEXTS, 3, 2, 0.0, 0.5), 60)
        assert time.perf_counter() - started < 25
        await asyncio.sleep(0)
        import gc

        gc.collect()  # a future dropped with its exception unread reports it when collected
    finally:
        loop.set_exception_handler(None)
    assert not unread, unread


def test_the_gpu_benchmarks_noise_floor_is_what_a_batchs_shape_cannot_tell() -> None:
    """``noise_floor`` keeps the batches of shapes that ran three times or more, and sets the cost
    model's error on them beside each shape's median's: a cost model that prices every shape at its
    median is at the floor, one that is 20% off is 20% above it, and no shape repeated leaves nothing."""
    from bench import gpu

    runs = [[4, 40, ms, 10.0] for ms in (8.0, 10.0, 12.5)] + [[8, 80, ms, 16.0] for ms in (20.0, 20.0, 20.0)]
    runs.append([1, 8, 3.0, 3.0])  # a shape that ran once: left out
    floor = gpu.noise_floor(runs)
    assert floor["batches"] == 6
    assert floor["shape_median"] == [0.0, 0.2]  # 0.25, 0, 0.2 and three 0s: median 0, p90 (the 5th of 6) 0.2
    assert floor["cost_model"] == [0.2, 0.2]  # the same three, and three of 20% off
    assert gpu.noise_floor([[1, 8, 3.0, 3.0], [2, 8, 3.0, 3.0]]) == {}


def test_the_gpu_benchmarks_equality_verdict_is_the_pipelines_own_rounding() -> None:
    """bench/gpu.py (issue 17 item 6): on a GPU a batch's shape picks its kernels, so float32 answers
    differ from ``pipeline(text)`` by as much as ``pipeline(texts, batch_size=32)`` does. The verdict is
    "as near as that"; a wrong token (a gap the size of a score) is "no", and so is a reduced dtype
    twice as far from float32 as the pipeline in that dtype."""
    from bench.gpu import as_near, gaps

    single = [[{"token": 1, "score": 0.5}, {"token": 2, "score": 0.3}], [{"token": 3, "score": 0.9}]]
    rounded = [[{"token": 1, "score": 0.5004}, {"token": 2, "score": 0.3}], [{"token": 3, "score": 0.9}]]
    swapped = [[{"token": 2, "score": 0.5}, {"token": 1, "score": 0.3}], [{"token": 3, "score": 0.9}]]
    batched = gaps(single, rounded)
    assert batched["same_order"] == 2 and abs(batched["max_gap"] - 0.0004) < 1e-9
    assert gaps(single, swapped) == {"same_order": 1, "texts": 2, "max_gap": pytest.approx(0.2)}
    assert as_near({"vs_pipeline": gaps(single, rounded)}, batched) == "yes"
    assert as_near({"vs_pipeline": gaps(single, swapped)}, batched).startswith("**no**")
    # Wholly other tokens are as far as their scores; a near-tie swapped in at the bottom is not far.
    other = [[{"token": 7, "score": 0.5}, {"token": 8, "score": 0.3}], [{"token": 3, "score": 0.9}]]
    assert gaps(single, other)["max_gap"] == pytest.approx(0.2) and as_near({"vs_pipeline": gaps(single, other)},
                                                                            batched).startswith("**no**")
    tie = [[{"token": 1, "score": 0.5}, {"token": 9, "score": 0.3001}], [{"token": 3, "score": 0.9}]]
    assert gaps(single, tie)["max_gap"] == pytest.approx(0.0001)
    reduced = {"vs_pipeline": batched, "vs_float32": {"max_gap": 0.3}, "pipeline_vs_float32": {"max_gap": 0.1}}
    assert as_near(reduced, batched).startswith("**no**")
    # Several masks: each mask's list is compared; a missing mask is as far as it gets.
    two = [[[{"token": 1, "score": 0.5}], [{"token": 4, "score": 0.2}]]]
    assert gaps(two, two)["same_order"] == 1 and gaps(two, [[[{"token": 1, "score": 0.5}]]])["max_gap"] == float("inf")


def test_the_h200_figures_in_bench_results_render_and_hold() -> None:
    """The committed runs on an H200 (bench/results/gpu-h200*.json) render with ``--render``. Every
    dtype's answers were as near the pipeline's as its own batched ones in the thirteenth session's
    run; in the fourteenth's, all but float16 on the mixed corpus were, which the README reports as
    open (its gap 0.26 against the batched pipeline's 0.09)."""
    import contextlib
    import io

    from bench import gpu

    def verdicts(name: str) -> dict[str, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert gpu.main(["--render", str(ROOT / "bench" / "results" / name)]) == 0
        rows = [line.split("|") for line in out.getvalue().splitlines()
                if line.startswith(("| float32 (", "| bfloat16 (", "| float16 ("))]
        return {f"{row[1].split()[0]} {row[2].strip()}": row[3].strip() for row in rows}

    before = verdicts("gpu-h200.json")
    assert len(before) == 6 and set(before.values()) == {"yes"}
    latest = verdicts("gpu-h200-fourteenth.json")
    assert len(latest) == 6 and latest.pop("float16 mixed") == "**no**: gap 0.26"
    assert set(latest.values()) == {"yes"}


def test_the_cost_replay_runs_the_recorded_gpu_batches_through_this_checkouts_cost_model() -> None:
    """``bench/cost_replay.py`` on the committed H200 run: a row per dtype, corpus and load, each with
    the online and final errors of this checkout's ``CostModel`` and the noise floor beside them. The
    replay is deterministic, so this is the cost model's regression check on real GPU timings: over the
    batches of repeated shapes, its median error stays within 0.1 of the floor's at 32 x 4 and 0.17 at
    32 x 1 (with the overhead cut to the fastest batch after the fit, float16 was above both)."""
    import contextlib
    import io

    from bench import cost_replay

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cost_replay.main([str(ROOT / "bench" / "results" / "gpu-h200-fourteenth.json")]) == 0
    rows = [line.split("|") for line in out.getvalue().splitlines() if line.startswith("| gpu-h200")]
    assert len(rows) == 12  # 3 dtypes x 2 corpora x 2 loads
    for row in rows:
        load, online, final, repeated, floor = (cell.strip() for cell in (row[4], *row[6:10]))
        assert all(" / " in cell for cell in (online, final, repeated, floor)), row
        above = float(repeated.split(" / ")[0]) - float(floor.split(" / ")[0])
        assert above <= (0.1 if load == "32x4" else 0.17), row


def test_the_tail_is_split_by_stage_and_its_slowest_requests_by_burst() -> None:
    from bench.tail import decompose

    recorder = Recorder()
    for n in range(1000):  # 1,000 requests sent 10 ms apart; ten from 2.0 s and ten from 7.0 s on are slow
        sent = 100.0 + n * 0.01
        slow = 200 <= n < 210 or 700 <= n < 710
        index = recorder.add(sent)
        latency, queue, inference = ((0.040 if n % 2 else 0.030), 10.0, 15.0) if slow else (0.010, 3.0, 5.0)
        recorder.answer(index, sent + latency, {"type": RESULT, "queue_ms": queue, "inference_ms": inference})
    recorder.answer(recorder.add(104.0), 104.5, {"type": "error", "code": "bad_request"})  # not a result
    recorder.answer(recorder.add(90.0), 90.5, {"type": RESULT, "queue_ms": 1.0, "inference_ms": 1.0})  # before
    got = decompose(recorder, (100.0, 111.0))
    assert got["requests"] == 1000
    assert round(got["p50_ms"], 6) == 10.0 and round(got["p99_ms"], 6) == 40.0
    assert got["middle"] == pytest.approx({"latency_ms": 10.0, "queue_ms": 3.0, "inference_ms": 5.0, "rest_ms": 2.0})
    assert got["tail"] == pytest.approx({"latency_ms": 35.0, "queue_ms": 10.0, "inference_ms": 15.0, "rest_ms": 10.0})
    assert got["bursts"] == [(2.01, 5), (7.01, 5)]  # the slowest 1%: the 40-ms ones of each burst
    with pytest.raises(ValueError, match="too few"):
        decompose(recorder, (100.0, 100.5))


def test_the_sweep_takes_any_flag_set_and_refuses_a_name_it_does_not_know(capsys: pytest.CaptureFixture[str]) -> None:
    """``--configs`` once dropped every set that was not a name of SWEEP without a word, so a sweep of
    batch caps ran the defaults alone. A set of flags now runs as given; anything else stops the run
    before a server starts."""
    from bench import adaptive

    names = adaptive.configs("defaults, --max-batch-size 128 --max-batch-tokens 16384,--torch-threads 1,defaults")
    assert names == ["defaults", "--max-batch-size 128 --max-batch-tokens 16384", "--torch-threads 1"]
    assert [adaptive.flag_set(name) for name in names] == [
        [], ["--max-batch-size", "128", "--max-batch-tokens", "16384"], ["--torch-threads", "1"]]
    assert adaptive.configs("") == list(adaptive.SWEEP)
    with pytest.raises(SystemExit) as stopped:
        adaptive.main(["--configs", "defaults,max-batch-size 128", "--no-seed"])
    assert stopped.value.code == 2
    assert "'max-batch-size 128' is neither a name of the sweep" in capsys.readouterr().err
    for flags, said in (("--max-bach-size 128", "unrecognized arguments: --max-bach-size 128"),
                        ("--max-batch-size -1", "--max-batch-size must be 0 (automatic) or at least 1")):
        with pytest.raises(SystemExit):  # found before any server starts, not partway through a sweep
            adaptive.main(["--configs", f"defaults,{flags}", "--no-seed"])
        assert said in capsys.readouterr().err


def test_the_limits_command_refuses_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A newcomer's find: ``python -m bench.pipeline_limits`` answered a bad ``--batch-sizes`` and a model
    that does not exist with tracebacks."""
    from bench import pipeline_limits

    with pytest.raises(SystemExit) as usage:
        pipeline_limits.main(["--model", str(tmp_path), "--batch-sizes", "0,x"])
    assert usage.value.code == 2 and "give positive integers" in capsys.readouterr().err
    for model in (str(tmp_path / "none"), "models/no-such-size"):  # (the second is also a valid Hub id)
        assert pipeline_limits.main(["--model", model, "--texts", "2", "--singles", "1"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        pipeline_limits.main(["--model", str(tmp_path), "--texts", "0"])  # (it timed nothing, for ever)
    assert "must be at least 1" in capsys.readouterr().err


def test_the_sweep_runs_its_flag_sets_in_order_then_in_reverse() -> None:
    """bench/adaptive.py ran its flag sets in one fixed order in every repeat, so a machine that slowed
    down (or warmed up) over the run favoured whichever set ran first. ``run_order`` runs every set once
    per repeat, the second repeat in reverse: over a pair each set's mean position is the same."""
    from bench.adaptive import run_order

    names = ["defaults", "--torch-threads 1", "--max-batch-size 32", "seed"]
    orders = [run_order(names, repeat) for repeat in range(4)]
    assert orders[0] == names and orders[1] == names[::-1] and orders[2] == orders[0] and orders[3] == orders[1]
    for order in orders:
        assert sorted(order) == sorted(names)  # each once per repeat
    mean_position = {name: (orders[0].index(name) + orders[1].index(name)) / 2 for name in names}
    assert set(mean_position.values()) == {(len(names) - 1) / 2}
    assert run_order(names, 0) is not names  # (a new list: the caller's is left as it was)


async def test_the_sweep_keeps_each_measurement_with_its_flag_set_whatever_the_order(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Two repeats of two flag sets and the seed design, the servers faked: the second repeat runs them in
    reverse (the seed, then the defaults at its rate, still together), and every row of the table holds
    its own set's figures, in the order of ``--configs``."""
    import argparse

    from bench import adaptive

    ran: list[str] = []
    rps_of = {"defaults": 100.0, "--torch-threads 1": 200.0, "seed": 50.0}

    async def measure(model_dir: Path, args: list[str], texts: list[str], warmup: float, duration: float,
                      keep_batches: bool, script: str = "ws_server.py", in_flight: int = 4,
                      open_share: float = 0.0, open_rate: float = 0.0) -> dict[str, Any]:
        name = ("seed" if script != "ws_server.py" else "at the seed's rate" if open_rate
                else " ".join(args) or "defaults")
        ran.append(name)
        rps = rps_of.get(name, 0.0) + sum(1 for done in ran if done == name)  # each repeat's figure differs
        summary: dict[str, Any] = {"throughput_rps": rps, "latency_ms": {"p50": 1000 / rps, "p99": 2000 / rps},
                                   "batch": {"mean_rows_per_batch": 1.0}, "torch_threads": 2,
                                   "forward_parts": 2 if ran.count(name) == 1 and name == "defaults" else 1}
        if open_share or open_rate:
            summary["open"] = {"rate_rps": open_rate or open_share * rps, "latency_ms": {"p99": 10.0}}
        return summary

    monkeypatch.setattr(adaptive, "measure", measure)
    monkeypatch.setattr(adaptive, "corpus_texts", lambda *_: TEXTS)
    args = argparse.Namespace(sizes="tiny", corpora="short", configs=["defaults", "--torch-threads 1"], repeats=2,
                              warmup=0.0, duration=0.0, in_flight=4, seed=True)
    assert await adaptive.main_async(args) == 0
    assert ran == ["defaults", "--torch-threads 1", "seed", "at the seed's rate",
                   "seed", "at the seed's rate", "--torch-threads 1", "defaults"]
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [(row[0], row[1], row[-2]) for row in rows] == [
        ("| defaults", "101.5", "101, 102"), ("| --torch-threads 1", "201.5", "201, 202"),
        (f"| {adaptive.SEED}", "51.5", "51, 52")]
    # Each repeat's layout (the calibration may choose another at each start): here the defaults' first
    # start ran its batches in two parts, the second in one pass.
    assert [row[6] for row in rows] == ["2 in 2 parts ×1, 2 ×1", "2 ×2", "2 ×2"]


async def test_the_tail_counts_the_closed_loops_window_not_the_end_of_its_warm_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/tail.py timed its window from before the closed loop, which opens its 32 connections before
    its warm-up starts: the window opened that long before the warm-up ended and counted the warm-up's
    last answers (cold, slow). The closed loop is faked here, as the real one runs: it connects (0.3 s),
    warms up (0.3 s) with slow answers up to its window's opening, then answers fast."""
    from bench import loadgen, tail

    connecting_s, warmup_s, duration_s = 0.3, 0.3, 5.0

    async def closed_loop(url: str, texts: list[str], clients: int, in_flight: int, warmup: float,
                          duration: float, on_window: Any = None, recorder: Recorder | None = None,
                          **_: Any) -> dict[str, Any]:
        assert recorder is not None
        await asyncio.sleep(connecting_s + warmup)  # the connections' hellos, then the warm-up
        opened = time.perf_counter()
        for n in range(40):  # the warm-up's last 0.2 s: 500-ms answers
            done = opened - 0.2 + n * 0.005
            recorder.answer(recorder.add(done - 0.5), done, {"type": RESULT, "queue_ms": 400.0, "inference_ms": 90.0})
        for n in range(400):  # the window: 10-ms answers (the first ones sent in the warm-up)
            done = opened + 0.001 + n * 0.01
            recorder.answer(recorder.add(done - 0.01), done, {"type": RESULT, "queue_ms": 3.0, "inference_ms": 5.0})
        return {"window": (opened, opened + duration)}

    class Server:
        url = "ws://127.0.0.1:1/"

        def __enter__(self) -> Server:
            return self

        def __exit__(self, *_: object) -> None:
            return None

    async def settle(url: str) -> float:
        return 0.0

    async def hello_threads(url: str) -> int:
        return 2

    monkeypatch.setattr(loadgen, "closed_loop", closed_loop)
    monkeypatch.setattr(loadgen, "settle", settle)
    monkeypatch.setattr(tail, "ServerProcess", lambda *_: Server())
    monkeypatch.setattr(tail, "hello_threads", hello_threads)
    monkeypatch.setattr(tail, "corpus_texts", lambda *_: TEXTS)
    got = await tail.run(Path("models/tiny"), "tiny", "mixed", [], 4, warmup_s, duration_s)
    assert got["requests"] == 400
    assert round(got["p99_ms"], 6) == 10.0 and got["tail"]["queue_ms"] == pytest.approx(3.0)


def test_the_second_look_benchmark_reads_the_engines_own_log_lines() -> None:
    """``bench/second_look.py`` reads each start's layouts from the server's log: the calibration's
    start-up line and the engine's second-look line (``Look.line``), kept or switched, in the words
    they are written in."""
    from bench.second_look import logged, timed
    from fillmask_server.calibration import Calibration
    from fillmask_server.layout import Look

    layouts = [(1, 1), (2, 2), (2, 1)]
    one_pass = Calibration(2, "calibration", threads_ms={1: 7.0, 2: 5.1}, parts_ms={2: 5.4}).line()
    in_parts = Calibration(2, "calibration", threads_ms={1: 7.0, 2: 5.1}, parts_ms={2: 5.0}, forward_parts=2).line()
    switched = Look(89e-6, 3200, 10e-6, before=3, chosen=2).line(layouts)
    assert "torch threads 2 -> 2 in 2 parts" in switched
    assert logged(f"{one_pass}\n{switched}") == ((2, 1), 89, (2, 2))
    assert logged(f"{in_parts}\n{Look(87e-6, 3428, 10e-6, 2, 2).line(layouts)}") == ((2, 2), 87, (2, 2))
    assert logged(f"{in_parts}\n{Look(95e-6, 400, 10e-6, 2, 1).line(layouts)}") == ((2, 2), 95, (1, 1))
    assert logged(one_pass) == ((2, 1), None, None)
    one_thread = Look(71e-6, 9913, 9e-6, 1, 1, compared=1).line(layouts)
    assert logged(f"{one_pass}\n{one_thread}") == ((2, 1), 71, (1, 1))  # (the one layout of its count)
    assert timed(one_pass) == "1: 7.0, 2: 5.1, 2/2: 5.4"


def test_the_quiet_benchmark_reads_the_calibrations_own_words_for_a_lone_request() -> None:
    """``bench/quiet.py`` reports what the start-up line says of a lone request after a quiet spell
    (``Calibration.line``), whether one thread runs it or the team keeps it; and with the second
    look's and the cost model's words around it, as the line has them."""
    from bench.quiet import rule
    from fillmask_server.calibration import Calibration

    moved = Calibration(2, "calibration", threads_ms={1: 7.0, 2: 5.1}, quiet_lone_ms={1: 3.8, 2: 14.8},
                        quiet_after_ms=41.0).line()
    kept = Calibration(2, "calibration", threads_ms={1: 7.0, 2: 5.1}, quiet_lone_ms={1: 76.1, 2: 58.7},
                       quiet_after_ms=20.0).line()
    assert rule(f"INFO something\n{moved}\nready") == "after 41 ms runs on 1 thread (1 -> 3.8 ms, 2 -> 14.8 ms)"
    assert rule(kept) == "after 20 ms keeps 2 threads (1 -> 76.1 ms, 2 -> 58.7 ms)"
    from fillmask_server.layout import QuietLone

    rule_now = QuietLone({1: 3.9e-3, 2: 3.6e-3}, 0.041)  # (the engine's lines when it chooses again)
    said = [rule_now.ran(2, seconds) for seconds in (15e-3, 15e-3, *[3.0e-3] * 5)]
    changes = [line for line in said if line is not None]
    assert len(changes) == 2
    log = "\n".join([kept, *(f"INFO {line}" for line in changes)])
    assert rule(log) == "after 20 ms keeps 2 threads (1 -> 76.1 ms, 2 -> 58.7 ms); while serving 2->1 1->2"
    assert rule(Calibration(2, "flag").line()) == "not timed"


def test_the_benchmark_keeps_what_each_servers_log_said_of_its_engine(tiny_model_dir: Path) -> None:
    """bench/run.py runs its servers at ``--log-level info`` and keeps the lines that say the engine's
    choices (the calibration, each probe and switch of the tuner, the second look, the rule for a lone
    request, the batch caps, any warning) in results.json and results.md: a start whose calibration a
    neighbour disturbed can then be told apart from one the tuner could not correct."""
    from bench import report
    from bench.server_proc import ServerProcess

    log = [
        "2026-12-05T21:46:41.161+00:00 INFO fillmask_server: calibrated in 1.41 s: torch threads 1 (calibration: ...)",
        "2026-12-05T21:46:41.170+00:00 INFO websockets.server: server listening on 127.0.0.1:40000",
        "2026-12-05T21:46:49.153+00:00 INFO fillmask_server.engine: probe of torch threads 2 in 2 parts against 1 "
        "at batches of 64 rows: won (its batches 0.86, 0.83 times the cost model's prediction, the layout in "
        "use's 1.00; tuning.py)",
        "2026-12-05T21:46:50.001+00:00 INFO fillmask_server.engine: torch threads 1 -> 2 in 2 parts: batches so won",
        "2026-12-05T21:46:51.000+00:00 WARNING fillmask_server.engine: a batch of 3 failed (ValueError); retrying",
        "a line of a traceback: no time stamp",
    ]
    assert report.engine_lines(log) == [
        "21:46:41.161 calibrated in 1.41 s: torch threads 1 (calibration: ...)",
        "21:46:49.153 probe of torch threads 2 in 2 parts against 1 at batches of 64 rows: won (its batches 0.86, "
        "0.83 times the cost model's prediction, the layout in use's 1.00; tuning.py)",
        "21:46:50.001 torch threads 1 -> 2 in 2 parts: batches so won",
        "21:46:51.000 WARNING a batch of 3 failed (ValueError); retrying",
    ]
    assert len(report.engine_lines(log[:1] * 500)) == report.LOG_LINES_MOST
    server = {"name": "tiny fp32", "corpus": "short", "log": report.engine_lines(log)}
    section = "\n".join(report.log_section({"servers": [server, {"name": "quiet", "log": []}]}))
    assert "`tiny fp32` [short]:" in section and "    21:46:50.001 torch threads 1 -> 2" in section
    assert "`quiet`" not in section and report.log_section({"servers": [{"name": "x"}]}) == []
    # A real server's log at info, read while it runs.
    with ServerProcess(tiny_model_dir, ["--calibration-s", "0.5"], log_level="info") as live:
        said = report.engine_lines(live.log_lines())
    assert any(" calibrated in " in line for line in said), said
