"""The benchmark's outputs: medians over repeats, targets with ratios, Markdown, JSON and the plot.

Every function here is pure (numbers in, text or a file out), so a finished ``results.json`` can be
re-rendered without re-running anything: ``.venv/bin/python -m bench.report bench/results``.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

from bench.loadgen import percentile
from bench.pipeline_limits import LIMIT_BATCHES

# the server's thread groups (bench/server_proc.thread_cpu_s) and the load generator, in table order
CPU_GROUPS = ("model", "loop", "intake", "decode", "other", "client")
# The phase metrics that get a median over repeats: (path in a phase summary, name in the median dict).
_MEDIAN_FIELDS: list[tuple[tuple[str, ...], str]] = [
    (("throughput_rps",), "throughput_rps"),
    (("latency_ms", "p50"), "p50_ms"),
    (("latency_ms", "p95"), "p95_ms"),
    (("latency_ms", "p99"), "p99_ms"),
    (("overloaded_share",), "overloaded_share"),
    (("unanswered",), "unanswered"),
    (("errors",), "errors"),
    (("batch", "mean_rows_per_batch"), "rows_per_batch"),
    (("batch", "request_weighted_mean"), "batch_request_weighted"),
    (("batch", "useful_token_share"), "useful_token_share"),
    (("server_ms", "queue_p50"), "queue_p50_ms"),
    (("server_ms", "inference_p50"), "inference_p50_ms"),
    (("server_ms", "overhead_p50"), "overhead_p50_ms"),
    (("during_window", "p50_ms"), "healthz_p50_ms"),
    (("during_window", "p99_ms"), "healthz_p99_ms"),
    (("healthz", "p50_ms"), "healthz_p50_ms"),
    (("healthz", "p99_ms"), "healthz_p99_ms"),
    (("cpu", "server"), "cpu_server"),
    (("cpu", "client"), "cpu_client"),
    (("cpu", "other"), "cpu_other"),
    *((("cpu", "per_request_us", group), f"cpu_us_{group}") for group in CPU_GROUPS),
    (("send_lag_max_ms",), "send_lag_max_ms"),
    (("rate_rps",), "rate_rps"),
]


def _get(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def median(values: list[float]) -> float:
    """Median that keeps ``inf`` (an unanswered p99 stays unanswered) and ignores NaN; NaN if empty."""
    kept = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(statistics.median(kept)) if kept else math.nan


def median_phase(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one phase, plus its description (mode, clients, in_flight/rate)."""
    first = repeats[0]
    out: dict[str, Any] = {key: first[key] for key in ("mode", "clients", "in_flight", "factor") if key in first}
    for path, name in _MEDIAN_FIELDS:
        values = [_get(r, path) for r in repeats]
        if any(v is not None for v in values):
            out[name] = median([float(v) for v in values if v is not None])
    histogram: dict[str, int] = {}
    for r in repeats:
        for size, count in (_get(r, ("batch", "histogram")) or {}).items():
            histogram[size] = histogram.get(size, 0) + count
    if histogram:
        out["batch_histogram"] = dict(sorted(histogram.items(), key=lambda kv: int(kv[0])))
    out["repeats"] = len(repeats)
    return out


BATCH_BUCKETS: list[tuple[int, int]] = [(1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 1 << 30)]


def batch_shares(histogram: dict[str, int]) -> list[float]:
    """Share of requests (summed over repeats) that ran in a batch of each size bucket."""
    total = sum(histogram.values())
    return [sum(n for size, n in histogram.items() if low <= int(size) <= high) / total if total else math.nan
            for low, high in BATCH_BUCKETS]


def pipeline_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """Median req/s per pipeline batch size, the best of them, and the single-call latency."""
    per_size = {size: median(values) for size, values in raw["throughput"].items()}
    best_size = max(per_size, key=lambda s: per_size[s])
    singles = sorted(raw["single_ms"])
    return {
        "per_batch_size_rps": per_size,
        "best_rps": per_size[best_size],
        "best_batch_size": int(best_size),
        "single_p50_ms": median(singles),
        "single_p99_ms": percentile(singles, 99),
        "repeats": len(next(iter(raw["throughput"].values()))),
        "n_texts": raw["n_texts"],
        "torch_threads": raw["torch_threads"],
        "cpu_other": raw.get("cpu", {}).get("other", math.nan),
        "limit_rps": median(raw.get("limit", [])),
        "limit_forward_only_rps": median(raw.get("limit_forward_only", [])),
        "limit_batch": raw.get("limit_batch"),
        "limit_parts": raw.get("limit_parts"),
    }


LIMIT_DRIFT = 0.2  # an in-process limit that moved more than this between before and after the servers is flagged


def bracket_limit(pipe: dict[str, Any], after: list[float]) -> None:
    """Fold the limits measured after the servers into ``pipe``: ``limit_rps`` becomes the mean of the
    medians before and after (the machine's speed drifts; the servers ran in between), the two are
    kept, and ``limit_drift`` is after ÷ before − 1."""
    before, later = pipe.get("limit_rps", math.nan), median(after)
    if not (math.isfinite(before) and math.isfinite(later)):
        return
    pipe.update({"limit_before_rps": before, "limit_after_rps": later, "limit_rps": (before + later) / 2,
                 "limit_drift": later / before - 1})


def drifted(drift: float) -> bool:
    """Whether a limit moved so much between before and after the servers that its ratio is noise."""
    return abs(drift) > LIMIT_DRIFT


def limit_note(pipe: dict[str, Any]) -> str:
    """`` (limit before B, after A)``, with a warning when it moved more than ``LIMIT_DRIFT``; '' if not bracketed."""
    if "limit_after_rps" not in pipe:
        return ""
    drift = pipe["limit_drift"]
    warning = f"; ⚠ it moved {100 * drift:+.0f}%: read the ratio as noise" if drifted(drift) else ""
    return f" (limit before {pipe['limit_before_rps']:.1f}, after {pipe['limit_after_rps']:.1f}{warning})"


def _limit_batch(pipe: dict[str, Any]) -> str:
    """`` [N=64]``, or `` [N=64, 2 parts]``: the batch size of the limit (see
    ``bench.pipeline_limits.LIMIT_BATCHES``) and the parts it ran in; '' if unknown."""
    if not pipe.get("limit_batch"):
        return ""
    parts = pipe.get("limit_parts") or 1
    return f" [N={pipe['limit_batch']}" + (f", {parts} parts]" if parts > 1 else "]")


def _brackets(pipe: dict[str, Any]) -> str:
    if "limit_after_rps" not in pipe:
        return ""
    warning = " ⚠" if drifted(pipe["limit_drift"]) else ""
    return f" ({pipe['limit_before_rps']:.1f} / {pipe['limit_after_rps']:.1f}{warning})"


def capacity(server: dict[str, Any]) -> float:
    """A server config's capacity: the best closed-loop median throughput over its in-flight depths."""
    closed = [p["throughput_rps"] for p in server["phases"] if p["mode"] == "closed"]
    return max(closed) if closed else math.nan


def _phase(server: dict[str, Any] | None, mode: str, in_flight: int | None = None) -> dict[str, Any] | None:
    if server is None:
        return None
    candidates = [p for p in server["phases"] if p["mode"] == mode
                  and (in_flight is None or p.get("in_flight") == in_flight)]
    if mode == "closed" and in_flight is None and candidates:
        return max(candidates, key=lambda p: p.get("in_flight", 0))  # the most saturated
    return candidates[0] if candidates else None


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets (issue 9) that this run can judge, for each corpus: measured value, goal, PASS or MISS."""
    rows: list[dict[str, Any]] = []
    for corpus in summary["settings"].get("corpora", ["mixed"]):
        rows += _corpus_targets(summary, corpus)
    return rows


def _corpus_targets(summary: dict[str, Any], corpus: str) -> list[dict[str, Any]]:
    servers = {s["name"]: s for s in summary["servers"] if s.get("corpus", "mixed") == corpus}
    pipes = {p["name"]: p for p in summary["pipelines"] if p.get("corpus", "mixed") == corpus}
    rows: list[dict[str, Any]] = []

    def ratio_row(label: str, server_name: str, pipe_name: str, goal: float, against: str = "best_rps") -> None:
        server, pipe = servers.get(server_name), pipes.get(pipe_name)
        if server is None or pipe is None:  # not in this run
            return
        if not math.isfinite(pipe.get(against, math.nan)):  # in this run, but its figure is missing: a miss
            rows.append({"target": f"[{corpus}] {label}", "measured": "not measured", "value": math.nan,
                         "goal": f"≥ {goal:g}×", "shown": "–", "pass": False, "other_cores": []})
            return
        value = capacity(server) / pipe[against]
        best = max((p for p in server["phases"] if p["mode"] == "closed"), key=lambda p: p["throughput_rps"])
        rows.append({"target": f"[{corpus}] {label}",
                     "measured": f"{capacity(server):.1f} / {pipe[against]:.1f} req/s"
                                 + (limit_note(pipe) if against == "limit_rps" else ""),
                     "value": value, "goal": f"≥ {goal:g}×", "shown": f"{value:.2f}×", "pass": value >= goal,
                     "other_cores": [best.get("cpu_other"), pipe.get("cpu_other")]})

    ratio_row("tiny fp32 server ÷ best tiny fp32 pipeline", "tiny fp32", "tiny fp32", 2.5)
    ratio_row("base fp32 server ÷ best base fp32 pipeline", "base fp32", "base fp32", 1.2)
    ratio_row("base bf16 server ÷ best base fp32 pipeline", "base bf16", "base fp32", 2.5)
    ratio_row("tiny fp32 server ÷ in-process limit", "tiny fp32", "tiny fp32", 0.75, "limit_rps")
    ratio_row("base fp32 server ÷ in-process limit", "base fp32", "base fp32", 0.9, "limit_rps")
    for size in ("tiny", "base"):
        idle = _phase(servers.get(f"{size} fp32"), "idle")
        pipe = pipes.get(f"{size} fp32")
        if idle is not None and pipe is not None:
            delta = idle["p50_ms"] - pipe["single_p50_ms"]
            rows.append({"target": f"[{corpus}] {size} fp32 idle single request p50 − pipeline single call p50",
                         "measured": f"{idle['p50_ms']:.2f} − {pipe['single_p50_ms']:.2f} ms",
                         "value": delta, "goal": "≤ +1 ms", "shown": f"{delta:+.2f} ms", "pass": delta <= 1.0,
                         "other_cores": [idle.get("cpu_other"), pipe.get("cpu_other")]})
    for name in ("base fp32", "base bf16"):
        probed = _phase(servers.get(name), "probed")
        saturated = probed or _phase(servers.get(name), "closed")
        if saturated is not None and ("healthz_p99_ms" in saturated or probed is not None):
            p99 = saturated.get("healthz_p99_ms", math.nan)  # a prober that failed: not measured, a miss
            rows.append({"target": f"[{corpus}] /healthz p99, {name} saturated ({saturated['clients']} clients × "
                                   f"{saturated['in_flight']} in flight)",
                         "measured": f"p50 {_fmt(saturated.get('healthz_p50_ms'), 1)} ms, p99 {_fmt(p99, 1)} ms",
                         "value": p99, "goal": "≤ 20 ms", "shown": f"{_fmt(p99, 1)} ms", "pass": p99 <= 20.0,
                         "other_cores": [saturated.get("cpu_other")]})
    return rows


def target_line(row: dict[str, Any]) -> str:
    """One Markdown row of the targets table."""
    noise = " / ".join(_other(v) for v in row.get("other_cores", []))
    return (f"| {row['target']} | {row['measured']} | {row['shown']} | {row['goal']} | "
            f"{'PASS' if row['pass'] else 'MISS'} | {noise or '–'} |")


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    return f"{value:.{digits}f}"


NOISY_CORES = 0.3  # other users' CPU during a measurement above which it is flagged


def _other(value: Any) -> str:
    """Others' CPU cores, with ⚠ when a measurement shared the machine with a busy neighbour."""
    text = _fmt(value, 2)
    return text + " ⚠" if isinstance(value, float) and value >= NOISY_CORES else text


def _load(phase: dict[str, Any]) -> str:
    if phase["mode"] in ("closed", "probed"):
        return f"closed {phase['clients']}×{phase['in_flight']}" + (" + /healthz" if phase["mode"] == "probed" else "")
    if phase["mode"] == "open":
        return f"open {phase.get('factor', 0):g}× ({phase.get('rate_rps', math.nan):.0f}/s)"
    return "idle 1×1"


def markdown(summary: dict[str, Any]) -> str:
    """The whole ``results.md``: command, machine, limits, server table, targets, notes."""
    meta = summary["meta"]
    lines = [
        "# Benchmark results",
        "",
        f"Command: `{meta['command']}`  ",
        f"Run: {meta['date']} UTC, {meta['duration_s']:.0f} s; git {meta['git']}  ",
        f"Machine: {meta['cpu_model']}, {meta['cores']} cores ({meta['cpu_flags']}), {meta['memory_gib']:.0f} GiB; "
        f"load average at start {meta['loadavg_start']}  ",
        f"Software: Python {meta['python']}, torch {meta['torch']} ({meta['torch_threads']} threads), "
        f"transformers {meta['transformers']}, websockets {meta['websockets']}  ",
        *[f"Corpus `{name}`: {_corpus_line(stats)}  " for name, stats in summary["corpora"].items()],
        f"Settings: {_settings_line(summary['settings'])}",
        "",
        "## Targets (issue 9; both corpora)",
        "",
        "| target | measured | ratio / value | goal | result | others' CPU cores (server / pipeline) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [target_line(row) for row in summary["targets"]]
    lines += [
        "",
        "## In-process: `pipeline(texts, batch_size=N)` and the in-process limit, req/s, median of repeats",
        "",
        "*limit*: the server's own code without sockets or stage threads (texts sorted by length, in batches of N "
        f"rows, the fastest N of {', '.join(map(str, LIMIT_BATCHES))} in each repeat (shown in brackets: the "
        "N that was fastest most often), one tokenizer call, one forward pass with the head at the masks, "
        "decoded to the pipeline's JSON), measured before the servers and again after them: the mean of the two "
        f"(before / after; ⚠ where they differ by more than {100 * LIMIT_DRIFT:.0f}%: the machine's speed moved "
        "during the run); "
        "*forward only*: the same without the decoding (measured before the servers only).",
        "",
        "| model | corpus | " + " | ".join(f"N={n}" for n in summary["settings"]["pipeline_batch_sizes"])
        + " | best | single call p50 / p99 ms | limit | forward only | CPU cores other |",
        "|---|---|" + "---|" * (len(summary["settings"]["pipeline_batch_sizes"]) + 5),
    ]
    for pipe in summary["pipelines"]:
        cells = [_fmt(pipe["per_batch_size_rps"].get(str(n)), 1) for n in summary["settings"]["pipeline_batch_sizes"]]
        lines.append(f"| {pipe['name']} | {pipe.get('corpus', 'mixed')} | " + " | ".join(cells)
                     + f" | **{pipe['best_rps']:.1f}** (N={pipe['best_batch_size']}) | "
                     f"{pipe['single_p50_ms']:.2f} / {pipe['single_p99_ms']:.2f} | "
                     f"{_fmt(pipe.get('limit_rps'), 1)}{_brackets(pipe)}{_limit_batch(pipe)} | "
                     f"{_fmt(pipe.get('limit_forward_only_rps'), 1)} | "
                     f"{_other(pipe.get('cpu_other'))} |")
    lines += [
        "",
        "## Server through WebSockets (client-measured), median of repeats",
        "",
        "| config | corpus | load | req/s | × pipeline | × limit | p50 ms | p95 ms | p99 ms | rows/batch | "
        "overloaded | server queue / infer / other p50 ms | /healthz p50 / p99 ms | "
        "CPU cores server / client / other |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pipes = {(p["name"], p.get("corpus", "mixed")): p for p in summary["pipelines"]}
    for server in summary["servers"]:
        corpus = server.get("corpus", "mixed")
        base_pipe = pipes.get((f"{server['size']} fp32", corpus))
        for phase in server["phases"]:
            ratio = (phase["throughput_rps"] / base_pipe["best_rps"]) if base_pipe and phase["mode"] != "idle" else None
            of_limit = (phase["throughput_rps"] / base_pipe["limit_rps"]
                        if base_pipe and phase["mode"] != "idle" and math.isfinite(base_pipe.get("limit_rps", math.nan))
                        else None)
            health = (f"{_fmt(phase.get('healthz_p50_ms'))} / {_fmt(phase.get('healthz_p99_ms'))}"
                      if "healthz_p99_ms" in phase else "–")
            lines.append(
                f"| {server['name']} | {corpus} | {_load(phase)} | {_fmt(phase['throughput_rps'], 1)} | "
                f"{_fmt(ratio, 2) + '×' if ratio is not None else '–'} | "
                f"{_fmt(of_limit, 2) + '×' if of_limit is not None else '–'} | {_fmt(phase['p50_ms'], 1)} | "
                f"{_fmt(phase['p95_ms'], 1)} | {_fmt(phase['p99_ms'], 1)} | {_fmt(phase.get('rows_per_batch'), 1)} | "
                f"{100 * phase.get('overloaded_share', 0):.1f}% | {_fmt(phase.get('queue_p50_ms'), 1)} / "
                f"{_fmt(phase.get('inference_p50_ms'), 1)} / {_fmt(phase.get('overhead_p50_ms'), 1)} | {health} | "
                f"{_fmt(phase.get('cpu_server'), 2)} / {_fmt(phase.get('cpu_client'), 2)} / "
                f"{_other(phase.get('cpu_other'))} |")
    bucket_names = [f"{low}" if low == high else (f"{low}–{high}" if high < 1 << 30 else f"> {low - 1}")
                    for low, high in BATCH_BUCKETS]
    lines += [
        "",
        "## Batch sizes: share of requests by the size of the batch they ran in (all repeats)",
        "",
        "*useful tokens*: the requests' own tokens ÷ the padded tokens of their batch rows (1.0 = no padding).",
        "",
        "| config | corpus | load | " + " | ".join(bucket_names) + " | rows/batch | useful tokens |",
        "|---|---|---|" + "---|" * (len(bucket_names) + 2),
    ]
    for server in summary["servers"]:
        for phase in server["phases"]:
            if phase.get("batch_histogram") and phase["mode"] != "idle":
                shares = batch_shares(phase["batch_histogram"])
                cells = ["·" if v == 0 else f"{100 * v:.0f}%" for v in shares]
                cells += [_fmt(phase.get("rows_per_batch"), 1), _fmt(phase.get("useful_token_share"), 2)]
                lines.append(f"| {server['name']} | {server.get('corpus', 'mixed')} | {_load(phase)} | "
                             + " | ".join(cells) + " |")
    lines += cpu_lines(summary)
    lines += log_section(summary)
    lines += ["", "## How to read this", "", *_NOTES, ""]
    return "\n".join(lines)


#: What a server's log says of its engine's choices, in the words its lines start with (engine.py,
#: server.py): the calibration, each probe of the tuner and each switch, the second look, the rule for
#: a lone request after a quiet spell, the batch caps, and warnings.
ENGINE_WORDS = ("calibrated in", "probe of", "torch threads ", "layout kept", "layout chosen", "a lone request",
                "batch caps", "WARNING")
LOG_LINES_MOST = 60  # a server's log lines kept at most (the first ones: its start and first choices)


def engine_lines(log: list[str]) -> list[str]:
    """The lines of a server's log (``--log-level info``) that say its engine's choices: their time of
    day and their words, without the date and the logger (``2026-12-05T21:46:41.161+00:00 INFO
    fillmask_server: calibrated in ...`` -> ``21:46:41.161 calibrated in ...``)."""
    kept = []
    for line in log:
        stamp, _, rest = line.partition(" ")
        level, _, rest = rest.partition(" ")
        _, _, words = rest.partition(": ")
        if "T" in stamp and (any(word in words for word in ENGINE_WORDS) or level == "WARNING"):
            kept.append(f"{stamp.partition('T')[2][:12]} {'WARNING ' if level == 'WARNING' else ''}{words}")
    return kept[:LOG_LINES_MOST]


def log_section(summary: dict[str, Any]) -> list[str]:
    """Each server's engine lines (``engine_lines``), for the runs whose servers kept them."""
    servers = [server for server in summary.get("servers", []) if server.get("log")]
    if not servers:
        return []
    lines = ["", "## What each server's log said of its engine", "",
             "Its calibration, the tuner's probes and switches, the second look, the rule for a lone request "
             "after a quiet spell (times of day, UTC)."]
    for server in servers:
        lines += ["", f"`{server['name']}` [{server.get('corpus', 'mixed')}]:", "",
                  *[f"    {line}" for line in server["log"]]]
    return lines


def cpu_lines(summary: dict[str, Any]) -> list[str]:
    """The closed loops' CPU per request by thread (the section's text says how to read it)."""
    lines = [
        "",
        "## CPU per request in the closed loops, µs (median of repeats)",
        "",
        "Each thread group's CPU time over the phase divided by the requests served. *model*: the model "
        "thread and its torch workers; *loop*: the event loop (WebSockets, sessions, writes); *intake*, "
        "*decode*: the engine's stages; *client*: the load generator, on the same cores. While the model "
        "thread runs a forward pass on every core, any other thread that runs takes a core from it and "
        "its OpenMP team waits at the next barrier, so the server's time per request comes to about the "
        "forward pass's time alone plus everything else's CPU (docs/performance-log.md, \"Why the server "
        "stays below the limit on a small model\").",
        "",
        "| config | corpus | load | req/s | " + " | ".join(CPU_GROUPS) + " | all but model (client too) |",
        "|---|---|---|---|" + "---|" * (len(CPU_GROUPS) + 1),
    ]
    rows = 0
    for server in summary["servers"]:
        for phase in server["phases"]:
            if phase["mode"] != "closed" or not isinstance(phase.get("cpu_us_model"), float):
                continue
            values = [phase.get(f"cpu_us_{group}") for group in CPU_GROUPS]
            rest = sum(v for group, v in zip(CPU_GROUPS, values, strict=True)
                       if group != "model" and isinstance(v, float) and math.isfinite(v))
            lines.append(f"| {server['name']} | {server.get('corpus', 'mixed')} | {_load(phase)} | "
                         f"{_fmt(phase['throughput_rps'], 1)} | " + " | ".join(_fmt(v, 0) for v in values)
                         + f" | {_fmt(rest, 0)} |")
            rows += 1
    return lines if rows else []  # results from before the table have no figures for it


_NOTES = [
    "- *× pipeline*: server throughput divided by the best in-process float32 pipeline throughput of the same "
    "model size on the same corpus (bf16 rows too, as the issues ask); *× limit*: divided by the in-process "
    "limit. A server config's capacity, used by the targets and to set "
    "the open-loop rates, is its best closed-loop throughput.",
    "- *closed C×K*: C WebSocket clients each keeping K requests in flight. *open F× (R/s)*: Poisson arrivals at "
    "F times the config's capacity over the same C connections; latency counts from the scheduled send time, a "
    "request still unanswered at the end of the grace period counts as ∞, and `overloaded` answers are counted "
    "apart. *idle 1×1*: one client, one request at a time, compared with one `pipe(text)` call.",
    "- *server queue / infer / other*: medians of the result frames' `queue_ms` and `inference_ms`, and of the "
    "client latency minus both (sockets, JSON, both event loops, and waiting for a CPU).",
    "- */healthz*: a separate process sends `GET /healthz` every 20 ms during the measured window of a phase of "
    "its own, *closed C×K + /healthz*, the most loaded closed loop run again (idle row: on the idle server); "
    "latency is connect to full answer. That phase's throughput is not the config's capacity: the prober's "
    "own CPU comes out of the server's.",
    "- *CPU cores*: average cores used during the phase by the server process, by the benchmark process (the "
    "load generator, on the same machine) and by everything else (other users: the noise). ⚠ marks a "
    f"measurement during which others used ≥ {NOISY_CORES} cores: torch with one thread per core slows down "
    "several times over when another process takes a core, so such a number says more about the neighbours "
    "than about the server. Before each phase the run waits (bounded) for a quiet machine.",
]


def _corpus_line(corpus: dict[str, Any]) -> str:
    text = (f"{corpus['texts']} distinct texts, {corpus['one_mask']} with one mask and {corpus['two_masks']} with "
            f"two")
    if "tokens_min" in corpus:
        text += (f"; {corpus['tokens_min']}–{corpus['tokens_max']} tokens (median {corpus['tokens_p50']:g}, "
                 f"mean {corpus['tokens_mean']:g})")
    return text


def _settings_line(settings: dict[str, Any]) -> str:
    return "; ".join(
        f"{size}: {s['repeats']} repeats, windows {s['closed_s']:g} s closed / {s['open_s']:g} s open "
        f"(+{s['warmup_s']:g} s warm-up), pipeline {s['pipeline_texts']} texts per call"
        for size, s in settings["per_size"].items()
    ) + f"; {settings['clients']} clients, K ∈ {settings['in_flight']}, open-loop factors {settings['open_factors']}"


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Latency p50 (solid) and p99 (dashed) against achieved throughput for the open-loop points, one panel
    per model size, one colour per server config; pipeline best throughput as a dotted vertical line."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [size for size in ("tiny", "base") if any(s["size"] == size for s in summary["servers"])]
    if not sizes:
        return False
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.8), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    pipes = {p["name"]: p for p in summary["pipelines"] if p.get("corpus", "mixed") == "mixed"}
    for ax, size in zip(axes[0], sizes, strict=True):
        servers = [s for s in summary["servers"] if s["size"] == size and any(p["mode"] == "open" for p in s["phases"])]
        for i, server in enumerate(servers):
            points = sorted((p for p in server["phases"] if p["mode"] == "open"), key=lambda p: p.get("factor", 0))
            colour = colours[i % len(colours)]
            for key, style, label in (("p50_ms", "-o", "p50"), ("p99_ms", "--x", "p99")):
                finite = [(p["throughput_rps"], p[key]) for p in points if math.isfinite(p.get(key, math.nan))]
                if finite:
                    ax.plot([x for x, _ in finite], [y for _, y in finite], style, color=colour,
                            label=f"{server['name']} {label}")
            for p in points:
                if not math.isfinite(p.get("p50_ms", math.nan)):
                    continue
                noisy = p.get("cpu_other", 0.0) >= NOISY_CORES
                ax.annotate(f"{p.get('factor', 0):g}×" + (" ⚠" if noisy else ""), (p["throughput_rps"], p["p50_ms"]),
                            fontsize=7, textcoords="offset points", xytext=(3, -9), color=colour)
        for name, pipe in pipes.items():
            if pipe["size"] == size:
                ax.axvline(pipe["best_rps"], color="grey", linestyle=":" if pipe["dtype"] == "float32" else "-.",
                           linewidth=1, label=f"pipeline {name.split(' ', 1)[1]} best")
        ax.set_yscale("log")
        ax.set_xlabel("achieved throughput (req/s)")
        ax.set_ylabel("client latency (ms)")
        ax.set_title(f"{size}: open loop, {summary['settings']['clients']} connections", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"fill-mask server, {summary['meta']['cpu_model']} ({summary['meta']['cores']} cores); labels: "
                 f"offered load × capacity, ⚠ = others used ≥ {NOISY_CORES} cores; unanswered (∞) points omitted",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _clean(value: Any) -> Any:
    """JSON has no inf/NaN: write them as the strings "inf" / null."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf"
        return round(value, 4)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _unclean(value: Any) -> Any:
    if value == "inf":
        return math.inf
    if value is None:
        return math.nan
    if isinstance(value, dict):
        return {k: _unclean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unclean(v) for v in value]
    return value


def write_all(summary: dict[str, Any], out: Path) -> list[Path]:
    """Write ``results.json``, ``results.md`` and ``latency_vs_throughput.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.md"]
    written[0].write_bytes(orjson.dumps(_clean(summary), option=orjson.OPT_INDENT_2) + b"\n")
    written[1].write_text(markdown(summary) + "\n")
    if plot(summary, out / "latency_vs_throughput.png"):
        written.append(out / "latency_vs_throughput.png")
    return written


def main(argv: list[str] | None = None) -> int:
    """Re-render the Markdown and the plot from an existing ``results.json``."""
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "bench/results")
    summary = _unclean(orjson.loads((out / "results.json").read_bytes()))
    for path in write_all(summary, out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
