"""Issue 17 item 6: the benchmark on a CUDA device, one command for a session that is lent a GPU machine.

    .venv/bin/python bench/gpu.py --out bench/results                 # cuda: float32, bfloat16, float16
    .venv/bin/python bench/gpu.py --device cpu --model models/tiny --dtypes float32 --seconds 2 --out /tmp/g
    bash bench/gpu_device.sh                                          # on the device machine (see there)

For each dtype (one pipeline, one in-process model and one server each, to spend little device time),
on the ``short`` and ``mixed`` corpora:

1. **Equality.** The real server (``ws_server.py --device D --dtype X``) answers every text of the
   corpus once, and each answer is compared with ``pipeline("fill-mask")`` on the same device and
   dtype: how many texts have the same tokens in the same order, and the largest score gap. On a GPU
   a batch's shape picks its kernels, so the yardstick is the pipeline's own gap between
   ``pipeline(texts, batch_size=32)`` and ``pipeline(text)``; in a reduced dtype, also each one's gap
   to float32's pipeline (``as_near`` gives the verdict). The CPU's strict check (tokens in order,
   scores within ``TOLERANCE``) is kept as information. The table says whether the texts shared
   packed rows (``hello.engine.layout``).
2. **In-process.** ``pipe(texts, batch_size=N)`` for N = 32 and 128 (req/s), the in-process limit
   (``bench.pipeline_limits.in_process_limit``: the server's own tokenize, forward and decode, no
   sockets, no threads) and the server's ``model.forward`` alone on batches of 32 and 128 short texts
   (milliseconds per batch). Then batches of shapes the model has not run yet, first call against
   again (``new_shapes``); on CUDA a second set with cuDNN's attention on, which the server leaves out,
   and the whole model launched op by op against replayed as one CUDA graph (``cuda_graph_probe``).
3. **The server.** Closed loop, 32 clients x 1 and x 4 in flight (32 and 128 requests waiting): req/s,
   p50, p99, rows per batch; the cost model the server fitted (``/metrics``) and how well it predicts
   the batches it ran (median and 90th percentile of |predicted - measured| / measured over them).
   On a GPU a batch's fixed cost dominates, which is where the cost model has to hold.
4. **A flag sweep** (``--sweep``, the first dtype only): the defaults against the automatic batch caps
   (``--max-batch-size 0 --max-batch-tokens 0``: set from the cost model) and a hand-set cap of 256
   rows and 32,768 tokens (the fourteenth session's best on an H200), at 32 clients x 8 in flight.

A dtype that fails (a server that does not start, say) is recorded with its error, and the next one
runs. ``gpu.md`` and ``gpu.json`` are written to ``--out`` after every dtype, so a run cut short still
leaves its figures. Needs the checkpoint (``models/base`` by default, written if missing) and, for
cuda, torch with CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.corpus import make_corpus, make_short_corpus  # noqa: E402
from bench.server_proc import ServerProcess  # noqa: E402
from fillmask_server.calibration import batch_items  # noqa: E402
from fillmask_server.costmodel import Coefficients  # noqa: E402

TOLERANCE = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 5e-2}
CORPORA = {"short": make_short_corpus, "mixed": make_corpus}


async def server_answers(url: str, texts: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """Each text's answer, sent all at once (so they run in batches), and ``hello.engine``."""
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None) as ws:
        hello = json.loads(await ws.recv())
        for n, text in enumerate(texts):
            await ws.send(json.dumps({"type": "fill_mask", "id": n, "text": text, "top_k": 5}))
        answers: dict[int, Any] = {}
        while len(answers) < len(texts):
            frame = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if frame.get("type") in ("result", "error", "overloaded"):
                if frame.get("id") is None:
                    raise RuntimeError(f"the server answered no request: {frame}")
                answers[frame["id"]] = frame.get("predictions", frame)
    return [answers[n] for n in range(len(texts))], hello.get("engine", {})


def mismatches(expected: list[Any], got: list[Any], tolerance: float, exact_order: bool) -> list[str]:
    """One line per text whose answer differs from the pipeline's. With ``exact_order`` (float32): the
    same tokens in the same order and every score within ``tolerance``. Otherwise (reduced precision,
    where the two round differently) up to near-ties: a token's score within ``tolerance`` of the
    pipeline's, and a token in one list only scored within ``tolerance`` of the other list's last."""
    bad = []
    for n, (want, have) in enumerate(zip(expected, got, strict=True)):
        rows_want = want if want and isinstance(want[0], list) else [want]
        rows_have = have if have and isinstance(have, list) and isinstance(have[0], list) else [have]
        if not isinstance(have, list) or len(rows_want) != len(rows_have):
            bad.append(f"text {n}: {str(have)[:120]}")
            continue
        for w, h in zip(rows_want, rows_have, strict=True):
            if not _same(w, h, tolerance, exact_order):
                bad.append(f"text {n}: tokens {[c['token'] for c in h]} != {[c['token'] for c in w]}")
                break
    return bad


def _same(want: list[dict[str, Any]], have: list[dict[str, Any]], tolerance: float, exact_order: bool) -> bool:
    if exact_order:
        return [c["token"] for c in want] == [c["token"] for c in have] and all(
            abs(a["score"] - b["score"]) <= tolerance for a, b in zip(want, have, strict=True))
    scores_want = {c["token"]: c["score"] for c in want}
    scores_have = {c["token"]: c["score"] for c in have}
    for mine, other in ((scores_want, scores_have), (scores_have, scores_want)):
        floor = min(other.values(), default=0.0)
        for token, score in mine.items():
            if token in other:
                if abs(score - other[token]) > tolerance:
                    return False
            elif score > floor + tolerance:
                return False
    return True


def _rows(answer: Any) -> list[list[dict[str, Any]]]:
    """An answer's candidate lists, one per mask (a one-mask answer is one list)."""
    return answer if answer and isinstance(answer, list) and isinstance(answer[0], list) else [answer]


def gaps(expected: list[Any], got: list[Any]) -> dict[str, Any]:
    """How near ``got`` is to ``expected``, text by text: how many texts have the same tokens in the same
    order, and the largest score gap: |difference| for a token both lists hold, and for a token in one
    list only, how far its score is above the other list's lowest (where the other list would have had
    to place it; wholly other tokens are as far as their scores). Beside the same figures for
    ``pipeline(texts, batch_size=32)`` against ``pipeline(text)``, this says whether a difference is the
    device's rounding (a batch's other shapes take other kernels) or a fault."""
    same, largest = 0, 0.0
    for want, have in zip(expected, got, strict=True):
        rows_want, rows_have = _rows(want), _rows(have)
        if not isinstance(have, list) or len(rows_want) != len(rows_have):
            largest = float("inf")
            continue
        same += all([c["token"] for c in w] == [c["token"] for c in h] for w, h in zip(rows_want, rows_have,
                                                                                       strict=True))
        for w, h in zip(rows_want, rows_have, strict=True):
            for mine, other in ((w, h), (h, w)):
                scores = {c["token"]: c["score"] for c in other}
                floor = min(scores.values(), default=0.0)
                largest = max([largest, *(abs(c["score"] - scores[c["token"]]) if c["token"] in scores
                                          else c["score"] - floor for c in mine)])
    return {"same_order": same, "texts": len(expected), "max_gap": largest}


@contextlib.contextmanager
def torch_settings_kept() -> Iterator[None]:
    """The block may load the server's model, which switches settings for the whole process (cuDNN's
    attention and FlashAttention on CUDA: ``fillmask_server.loading``; TorchScript's fusion:
    ``fillmask_server.model``); after it
    they are torch's again, so that the pipelines measured later run as they would anywhere."""
    import torch

    backends = torch.backends.cuda
    cudnn, flash = backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled()
    fusion = torch._C._jit_texpr_fuser_enabled()
    try:
        yield
    finally:
        backends.enable_cudnn_sdp(cudnn)
        backends.enable_flash_sdp(flash)
        torch._C._jit_set_texpr_fuser_enabled(fusion)


def forward_ms(loaded: Any, texts: list[str], sizes: list[int]) -> dict[str, Any]:
    """The server's ``model.forward`` alone on batches of ``sizes`` texts: the median of 10 calls; and
    under ``notes`` why the model runs eager, the full head or padded rows (None: it does not)."""
    from fillmask_server.items import Item

    ids = loaded.tokenize(texts)
    out: dict[str, Any] = {"notes": {"forward": loaded.forward_note, "head": loaded.head_note,
                                     "packing": loaded.packing_note}}
    for size in sizes:
        items = [Item(ids[n % len(ids)], 5) for n in range(size)]
        for _ in range(3):
            loaded.forward(items)
        times = []
        for _ in range(10):
            start = time.perf_counter()
            loaded.forward(items)
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1000
        out[str(size)] = {"ms_per_batch": round(ms, 3), "req_per_s": round(size / ms * 1000, 1)}
    out["new_shapes"] = new_shapes(loaded, NEW_SHAPES)
    if loaded.device.type == "cuda":  # the same with cuDNN's attention, which the server leaves out
        import torch

        torch.backends.cuda.enable_cudnn_sdp(True)
        try:
            out["new_shapes_cudnn"] = new_shapes(loaded, NEW_SHAPES_CUDNN)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(False)
        out["cuda_graph"] = cuda_graph_probe(loaded)
    return out


def cuda_graph_probe(loaded: Any, rows: int = 32, width: int = 16) -> dict[str, Any]:
    """What a CUDA graph would save: the model's eager forward pass (the whole model, every position's
    logits) on one batch of ``rows`` x ``width`` tokens, milliseconds per call, launched op by op and
    replayed as one captured graph (the median of 10 each). Information for a later design: where the
    per-batch overhead dominates (bench/results/gpu-h200.md), most of it is launching kernels."""
    import torch

    try:
        ids = torch.tensor([item.input_ids for item in batch_items(loaded, rows, width)], device=loaded.device)

        def timed(call: Any) -> float:
            times = []
            for _ in range(10):
                torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1000)
            return round(statistics.median(times), 3)

        with torch.no_grad():
            def run() -> Any:
                return loaded.model(input_ids=ids).logits  # (no mask: the launches are what is measured)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up on a side stream, as capture asks
                for _ in range(3):
                    run()
            torch.cuda.current_stream().wait_stream(side)
            eager_ms = timed(run)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            return {"rows": rows, "tokens": width, "eager_ms": eager_ms, "graph_ms": timed(graph.replay)}
    except Exception as exc:  # (information only: the run goes on, on a device left as it was)
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


#: (texts, tokens a text) of the batches ``new_shapes`` runs: none of them a shape run before.
NEW_SHAPES = ((7, 23), (13, 37), (19, 51), (29, 17), (41, 29), (53, 61), (11, 97), (23, 45))
#: Other new shapes, for the run with cuDNN's attention on (a plan it built for one above is kept).
NEW_SHAPES_CUDNN = ((5, 31), (17, 43), (31, 19), (43, 57), (9, 71), (37, 27), (47, 39), (3, 89))


def new_shapes(loaded: Any, shapes: tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    """Milliseconds of a batch of a shape the model has not run yet, its first call and again (the
    median of three more): whether a device pays once per new shape (kernel selection, compilation,
    cuDNN's execution plans), which a server whose batches take many shapes pays over and over."""
    import torch

    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out = []
    for rows, width in shapes:
        width = min(width, loaded.max_tokens)
        items = batch_items(loaded, rows, width)
        times = []
        for _ in range(4):
            synchronize()
            start = time.perf_counter()
            loaded.forward(items)
            synchronize()
            times.append((time.perf_counter() - start) * 1000)
        out.append({"rows": rows, "tokens": width, "first_ms": round(times[0], 3),
                    "again_ms": round(statistics.median(times[1:]), 3)})
    return out


def pipeline_figures(model: str, device: str, dtype: str, corpora: dict[str, list[str]], timed_texts: int
                     ) -> dict[str, Any]:
    """Per corpus: the pipeline's answers (for the equality check), its own batched-against-single gap,
    and its req/s at batch sizes 32 and 128 over ``timed_texts`` texts of the corpus."""
    import torch
    from transformers import pipeline

    from bench.pipeline_limits import timed_rate

    fill = pipeline("fill-mask", model=model, device=device, dtype=getattr(torch, dtype))
    out: dict[str, Any] = {}
    for name, texts in corpora.items():
        timed = timed_corpus(texts, timed_texts)
        rates = {}
        for size in (32, 128):
            fill(timed[:size], batch_size=size)  # warm-up: this shape's kernels

            def once(size: int = size, texts: list[str] = timed, pipe: Any = fill) -> None:
                assert len(pipe(texts, batch_size=size)) == len(texts)

            rates[str(size)] = round(timed_rate(once, len(timed)), 1)
        single = [fill(text, top_k=5) for text in texts]
        out[name] = {"answers": single, "batched_vs_single": gaps(single, fill(texts, batch_size=32, top_k=5)),
                     "pipeline_req_per_s": rates}
    return out


def server_model_figures(model: str, device: str, dtype: str, corpora: dict[str, list[str]], timed_texts: int
                         ) -> tuple[dict[str, float], dict[str, Any]]:
    """The server's model, loaded once: the in-process limit per corpus (over ``timed_texts`` texts)
    and ``forward_ms`` on short texts. Torch's settings are kept for the pipelines measured after."""
    from bench.pipeline_limits import limit_rates
    from bench.server_proc import QuietGate
    from fillmask_server.loading import load_model

    with torch_settings_kept():
        loaded = load_model(model, device=device, dtype=dtype)
        limits = {name: round(limit_rates(loaded, timed_corpus(texts, timed_texts), 1, QuietGate(0.0, 0.0))[0][0], 1)
                  for name, texts in corpora.items()}
        return limits, forward_ms(loaded, make_short_corpus(), [32, 128])


def timed_corpus(texts: list[str], count: int) -> list[str]:
    """``count`` texts: ``texts`` over and over."""
    return [texts[n % len(texts)] for n in range(count)]


def cost_model(url: str) -> dict[str, float]:
    port = url.rsplit(":", 1)[1].strip("/")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("fillmask_cost_model_seconds{")}


def prediction_error(recorder: loadgen.Recorder, coefficients: dict[str, float]) -> dict[str, float]:
    """|predicted - measured| / measured of the cost model's forward time over the batches that ran, and
    (``runs``, the first 300) each batch's rows, padded tokens, measured and predicted milliseconds."""
    batches = {(size, tokens, round(ms, 3)) for size, tokens, ms in zip(
        recorder.batch_size, recorder.batch_tokens, recorder.inference_ms, strict=False) if size and ms == ms}
    forward = Coefficients(coefficients.get("overhead", 0.0), coefficients.get("padded_token", 0.0),
                           coefficients.get("row", 0.0), 0.0)  # the forward pass alone: no output term
    runs = [(size, tokens, ms, forward.batch_s(size, tokens, 0.0) * 1000) for size, tokens, ms in batches]
    errors = [abs(predicted - ms) / ms for _, _, ms, predicted in runs]
    if not errors:
        return {}
    median, p90 = median_p90(errors)
    return {"batches": len(errors), "median": median, "p90": p90,
            "runs": [[size, tokens, round(ms, 3), round(predicted, 3)] for size, tokens, ms, predicted in runs[:300]]}


def median_p90(errors: list[float]) -> list[float]:
    """The median and the 90th percentile (the value at 0.9 of the way up) of ``errors``, to 3 places:
    how this benchmark and ``bench/cost_replay.py`` sum up prediction errors."""
    ordered = sorted(errors)
    return [round(statistics.median(ordered), 3), round(ordered[int(0.9 * (len(ordered) - 1))], 3)]


def noise_floor(runs: list[list[float]], repeats: int = 3) -> dict[str, Any]:
    """How well the cost model predicts against how well anything that knows only a batch's shape could:
    over the batches (``prediction_error``'s ``runs``) whose shape (rows, padded tokens) ran at least
    ``repeats`` times, |shape's median - measured| / measured (about the noise floor: what a batch's shape
    cannot tell, such as a CPU that launches the kernels late) beside the cost model's own error on the
    same batches; median and 90th percentile each. Empty when no shape repeats."""
    by_shape: dict[tuple[float, float], list[float]] = {}
    for rows, tokens, ms, _ in runs:
        by_shape.setdefault((rows, tokens), []).append(ms)
    medians = {shape: statistics.median(times) for shape, times in by_shape.items() if len(times) >= repeats}
    kept = [(medians[(rows, tokens)], ms, predicted)
            for rows, tokens, ms, predicted in runs if (rows, tokens) in medians]
    if not kept:
        return {}
    return {"batches": len(kept), "shape_median": median_p90([abs(m - ms) / ms for m, ms, _ in kept]),
            "cost_model": median_p90([abs(p - ms) / ms for _, ms, p in kept])}


async def serve_and_load(model: str, device: str, dtype: str, corpora: dict[str, list[str]], seconds: float,
                         expected: dict[str, list[Any]], reference: dict[str, list[Any]]) -> dict[str, Any]:
    """One server for every corpus: its start time and ``hello.engine``, then per corpus the equality
    check (against the pipeline in ``dtype``: ``expected``; and in a reduced dtype against float32's
    pipeline, ``reference``, when it ran) and the two closed loops; last, the warnings it logged."""
    result: dict[str, Any] = {}
    with ServerProcess(Path(model), ["--device", device, "--dtype", dtype]) as server:
        result["start_s"] = round(server.start_s, 1)
        for name, texts in corpora.items():
            got, engine = await server_answers(server.url, texts)
            result["engine"] = engine
            run: dict[str, Any] = {"mismatches": mismatches(expected[name], got, TOLERANCE.get(dtype, 1e-5),
                                                             exact_order=dtype == "float32"),
                                   "vs_pipeline": gaps(expected[name], got)}
            if name in reference and dtype != "float32":
                run["vs_float32"] = gaps(reference[name], got)
                run["pipeline_vs_float32"] = gaps(reference[name], expected[name])
            for in_flight in (1, 4):
                await loadgen.settle(server.url)
                recorder = loadgen.Recorder()
                summary = await loadgen.closed_loop(server.url, texts, 32, in_flight, 1.0, seconds, recorder=recorder)
                coefficients = cost_model(server.url)
                run[f"closed_32x{in_flight}"] = {
                    "req_per_s": round(summary["throughput_rps"], 1),
                    "p50_ms": round(summary["latency_ms"]["p50"], 2), "p99_ms": round(summary["latency_ms"]["p99"], 2),
                    "rows_per_batch": round(summary["batch"]["mean_rows_per_batch"], 1),
                    "cost_model_s": coefficients, "prediction_error": prediction_error(recorder, coefficients)}
            result[name] = run
        result["log"] = [line for line in server.log_lines()
                         if "warning" in line.lower() or "error" in line.lower()][:20]
    return result


#: Flag sets of the sweep (``--sweep``): the defaults, the automatic caps, and four times the default caps.
SWEEP = ("", "--max-batch-size 0 --max-batch-tokens 0", "--max-batch-size 256 --max-batch-tokens 32768")


async def sweep(model: str, device: str, dtype: str, corpora: dict[str, list[str]], seconds: float,
                flag_sets: list[str]) -> list[dict[str, Any]]:
    """One server per flag set, 32 clients x 8 in flight (256 requests waiting) on each corpus: whether
    the default batch cap (64 requests), fitted on CPUs, holds a GPU back, where a batch's overhead
    dominates and a batch of 128 costs about twice one of 32."""
    rows: list[dict[str, Any]] = []
    for flags in flag_sets:
        try:
            with ServerProcess(Path(model), ["--device", device, "--dtype", dtype, *flags.split()]) as server:
                for name, texts in corpora.items():
                    await loadgen.settle(server.url)
                    summary = await loadgen.closed_loop(server.url, texts, 32, 8, 1.0, seconds)
                    rows.append({"flags": flags or "defaults", "corpus": name,
                                 "req_per_s": round(summary["throughput_rps"], 1),
                                 "p50_ms": round(summary["latency_ms"]["p50"], 2),
                                 "p99_ms": round(summary["latency_ms"]["p99"], 2),
                                 "rows_per_batch": round(summary["batch"]["mean_rows_per_batch"], 1),
                                 "errors": summary["errors"], "overloaded": summary["overloaded"]})
        except Exception as exc:  # (one flag set's failure loses no other's rows)
            rows.append({"flags": flags or "defaults", "error": " ".join(f"{type(exc).__name__}: {exc}".split())[:300]})
    return rows


def as_near(server: dict[str, Any], batched: dict[str, Any]) -> str:
    """"yes" when the server's answers are as near the pipeline's as ``pipeline(texts, batch_size=32)``'s
    are: a largest score gap at most twice the pipeline's own (or within 1e-5), and in a reduced dtype
    (``server["vs_float32"]``) at most twice as far from float32's pipeline as the pipeline in that dtype
    is. A GPU's kernels differ with a batch's shape, and so do its bits; which of two near-tied tokens
    comes first is information (the same-order counts below), not a verdict."""
    gap = server["vs_pipeline"]["max_gap"]
    near = gap <= max(1e-5, 2 * batched["max_gap"])
    if "vs_float32" in server:
        near = near and server["vs_float32"]["max_gap"] <= 2 * server["pipeline_vs_float32"]["max_gap"]
    return "yes" if near else f"**no**: gap {gap:.2g}"


def markdown(runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# The benchmark on {meta['device_name']}", "", f"`{meta['command']}` on {meta['date']} UTC; "
             f"torch {meta['torch']}, transformers {meta['transformers']}; model {meta['model']}.", "",
             *([meta["note"], ""] if meta.get("note") else []),
             "| dtype (rows) | corpus | answers as near the pipeline's as its own batched ones (below) | "
             "pipeline req/s (batch 32 / 128) | "
             "in-process limit req/s | forward ms (batch 32 / 128) | server req/s 32x1 / 32x4 | "
             "server ÷ best pipeline, ÷ limit (32x4) | p50 / p99 ms (32x4) | rows/batch (32x4) | "
             "cost model: overhead ms, us per padded token | its error on the batches run (median / p90) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        if "error" in run:
            lines.append(f"| {run['dtype']} | | failed: {run['error'].splitlines()[0][:200]} |" + " |" * 9)
            continue
        for corpus in run["corpora"]:
            server, mine = run["server"][corpus], run["in_process"][corpus]
            four, one = server["closed_32x4"], server["closed_32x1"]
            c, e = four["cost_model_s"], four["prediction_error"]
            best = max(mine["pipeline_req_per_s"].values())
            forward = run["forward"]
            lines.append(
                f"| {run['dtype']} ({run['server'].get('engine', {}).get('layout', '?')}) | {corpus} | "
                f"{as_near(server, mine['batched_vs_single'])} | "
                f"{mine['pipeline_req_per_s']['32']} / {mine['pipeline_req_per_s']['128']} | "
                f"{mine['limit_req_per_s']} | "
                f"{forward['32']['ms_per_batch']} / {forward['128']['ms_per_batch']} | "
                f"{one['req_per_s']} / {four['req_per_s']} | "
                f"{four['req_per_s'] / best:.2f}x, {four['req_per_s'] / mine['limit_req_per_s']:.2f}x | "
                f"{four['p50_ms']} / {four['p99_ms']} | {four['rows_per_batch']} | "
                f"{c.get('overhead', 0) * 1e3:.3f}, {c.get('padded_token', 0) * 1e6:.2f} | "
                f"{e.get('median', '?')} / {e.get('p90', '?')} |")
    lines += ["", "Equality: texts with the same tokens in the same order, and the largest |score difference| "
              "over the tokens both hold. `pipeline(texts, batch_size=32)` against `pipeline(text)` is the "
              "device's own rounding between batch shapes; in a reduced dtype, each against float32's pipeline "
              "says how far the dtype moves the answers.", "",
              "| dtype | corpus | server vs pipeline | batched pipeline vs pipeline | server vs float32 | "
              "pipeline vs float32 |", "|---|---|---|---|---|---|"]
    for run in runs:
        for corpus in run.get("corpora", []) if "error" not in run else []:
            server = run["server"][corpus]
            cells = [server["vs_pipeline"], run["in_process"][corpus]["batched_vs_single"],
                     server.get("vs_float32"), server.get("pipeline_vs_float32")]
            lines.append(f"| {run['dtype']} | {corpus} | " + " | ".join(
                f"{c['same_order']} of {c['texts']}, {c['max_gap']:.2g}" if c else "" for c in cells) + " |")
    lines += ["", "The cost model against the noise floor: over the batches whose shape (rows, padded tokens) ran "
              "three times or more, the error of each shape's median time (about the best that any price of a "
              "batch's shape can do) and the cost model's, median / p90.", "",
              "| dtype | corpus | clients x in flight | batches | shape's median | cost model |",
              "|---|---|---|---|---|---|"]
    for run in runs:
        for corpus in run.get("corpora", []) if "error" not in run else []:
            for load, label in (("closed_32x1", "32x1"), ("closed_32x4", "32x4")):
                floor = noise_floor(run["server"][corpus][load]["prediction_error"].get("runs", []))
                if floor:
                    lines.append(f"| {run['dtype']} | {corpus} | {label} | {floor['batches']} | "
                                 f"{floor['shape_median'][0]} / {floor['shape_median'][1]} | "
                                 f"{floor['cost_model'][0]} / {floor['cost_model'][1]} |")
    for run in runs:
        if run.get("sweep"):
            lines += ["", f"Flag sweep, {run['dtype']}, 32 clients x 8 in flight:", "",
                      "| flags | corpus | req/s | p50 / p99 ms | rows/batch | errors, overloaded |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {row['flags']} | {row['corpus']} | {row['req_per_s']} | {row['p50_ms']} / {row['p99_ms']} | "
                      f"{row['rows_per_batch']} | {row.get('errors', 0)}, {row.get('overloaded', 0)} |"
                      if "error" not in row else f"| {row['flags']} | failed: {row['error']} | | | | |"
                      for row in run["sweep"]]
    for run in runs:
        if "error" in run:
            lines += ["", f"{run['dtype']} failed:", "", "```", run["error"][-3000:], "```"]
            continue
        for key, label in (("new_shapes", ""), ("new_shapes_cudnn", ", cuDNN's attention on")):
            shapes = run["forward"].get(key, [])
            if shapes:
                lines.append(f"- {run['dtype']}: a batch of a new shape{label}, first call / again (ms): " + ", ".join(
                    f"{s['rows']}x{s['tokens']} {s['first_ms']:.1f} / {s['again_ms']:.1f}" for s in shapes))
        graph = run["forward"].get("cuda_graph")
        if graph and "error" in graph:
            lines.append(f"- {run['dtype']}: the CUDA graph probe failed: {graph['error']}")
        elif graph:
            lines.append(f"- {run['dtype']}: the whole model on {graph['rows']} x {graph['tokens']} tokens, "
                         f"eager / as one CUDA graph (ms): {graph['eager_ms']} / {graph['graph_ms']}")
        lines.append(f"- {run['dtype']}: server ready in {run['server']['start_s']} s; engine "
                     f"{json.dumps(run['server'].get('engine', {}), sort_keys=True)}; in-process notes "
                     f"{json.dumps(run.get('notes', {}))}")
        for line in run["server"].get("log", []):
            lines.append(f"  - server log: {line[:300]}")
        for corpus in run["corpora"]:
            strict = run["server"][corpus]["mismatches"]
            if strict:
                lines.append(f"  - {corpus}: {len(strict)} of {run['texts'][corpus]} texts beyond the CPU's strict "
                             f"check (tokens in order, scores within {TOLERANCE.get(run['dtype'], 1e-5)}), e.g. "
                             f"{strict[0]}")
    return "\n".join(lines) + "\n"


def save(out: Path, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """``gpu.json`` and ``gpu.md`` for the runs so far, each replaced whole (a time limit that stops the
    run mid-write leaves the last good ones)."""
    for name, text in (("gpu.json", json.dumps({"meta": meta, "runs": runs}, indent=2)),
                       ("gpu.md", markdown(runs, meta))):
        partial = out / f".{name}.partial"
        partial.write_text(text)
        os.replace(partial, out / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "base"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--corpora", default="short,mixed")
    parser.add_argument("--texts", type=int, default=200, help="texts per corpus for the equality check")
    parser.add_argument("--timed-texts", type=int, default=512, help="texts per timed pipeline or limit call")
    parser.add_argument("--seconds", type=float, default=8.0, help="closed-loop window")
    parser.add_argument("--sweep", default="|".join(SWEEP),
                        help="flag sets ('|' between them) run at 32 x 8 with the first dtype; '' for none")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--render", type=Path, help="write the table of this gpu.json again, to stdout, and stop")
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads(args.render.read_text())
        print(markdown(saved["runs"], saved["meta"]), end="")
        return 0
    # A time limit's SIGTERM (gpu_device.sh's timeout) unwinds, so that each ServerProcess stops its
    # server: they run in sessions of their own, which the signal does not reach.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))

    import torch
    import transformers

    from fillmask_server.checkpoint import is_checkpoint, write_checkpoint

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device here; run on a GPU machine, or pass --device cpu for a smoke run",
              file=sys.stderr)
        return 2
    if not is_checkpoint(Path(args.model)) and Path(args.model).name in ("tiny", "small", "base"):
        write_checkpoint(Path(args.model).name, Path(args.model))
    meta = {"command": " ".join(["bench/gpu.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "torch": torch.__version__,
            "transformers": transformers.__version__, "model": args.model,
            "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device}
    args.out.mkdir(parents=True, exist_ok=True)
    corpora = {name: CORPORA[name]()[:args.texts] for name in args.corpora.split(",")}
    runs: list[dict[str, Any]] = []
    reference: dict[str, list[Any]] = {}  # float32's pipeline answers, for the reduced dtypes after it
    for dtype in args.dtypes.split(","):
        run: dict[str, Any] = {"dtype": dtype, "corpora": list(corpora),
                               "texts": {name: len(texts) for name, texts in corpora.items()}}
        started = time.perf_counter()
        try:
            print(f"{time.strftime('%H:%M:%S')} {dtype}: pipeline and in-process limit", file=sys.stderr, flush=True)
            run["in_process"] = pipeline_figures(args.model, args.device, dtype, corpora, args.timed_texts)
            limits, run["forward"] = server_model_figures(args.model, args.device, dtype, corpora, args.timed_texts)
            for name, limit in limits.items():
                run["in_process"][name]["limit_req_per_s"] = limit
            expected = {name: run["in_process"][name].pop("answers") for name in corpora}
            reference = expected if dtype == "float32" else reference
            run["notes"] = {key: value for key, value in run["forward"].pop("notes").items() if value}
            print(f"{time.strftime('%H:%M:%S')} {dtype}: the server", file=sys.stderr, flush=True)
            run["server"] = asyncio.run(serve_and_load(args.model, args.device, dtype, corpora, args.seconds,
                                                       expected, reference))
            if args.sweep and not runs:
                save(args.out, meta, [*runs, run])  # (the sweep's failure or a time limit loses none of this)
                print(f"{time.strftime('%H:%M:%S')} {dtype}: the flag sweep", file=sys.stderr, flush=True)
                run["sweep"] = asyncio.run(sweep(args.model, args.device, dtype, corpora, args.seconds,
                                                 args.sweep.split("|")))
        except Exception as exc:  # (recorded, and the next dtype runs: device time is scarce)
            run = {"dtype": dtype, "error": f"{type(exc).__name__}: {exc}"}
            print(f"{dtype} failed: {run['error']}", file=sys.stderr, flush=True)
        run["seconds"] = round(time.perf_counter() - started, 1)
        runs.append(run)
        save(args.out, meta, runs)
    print(markdown(runs, meta))
    return 0 if all("error" not in run for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
