"""Prometheus metrics of one server, in its own registry (no global state: tests run several servers).

Served by ``GET /metrics`` (protocol.md §9, §11) in the Prometheus text format that the scraper's
``Accept`` header asks for. Invariants:

- Every answer about a request is counted exactly once in ``fillmask_requests_total``: when it is
  handed to the client's socket, labelled with what the session made of it (``Answer.outcome`` and
  ``.code``), or as ``dropped`` when its connection closed first (before the answer existed, or with
  the answer still unsent). Frames answering garbage count too (outcome ``error``).
- Batch figures are recorded by the engine thread once per batch, right after the batch ran.
- Live values (queue depth, connections, engine busy time) are read when scraped, from callables,
  so nothing has to be kept in step with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from fillmask_client.wire import OVERLOADED_REASONS

from .allocator import frozen_objects
from .costmodel import Coefficients
from .protocol import ERROR_CODES

#: ``fillmask_handshakes_refused_total``'s reasons (§11).
REFUSED_REASONS = ("bad_request", "not_found", "host", "origin", "token", "unavailable", "max_connections",
                   "unfinished")
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_BATCH_TOKENS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
@dataclass(frozen=True)
class LiveValues:
    """Callables read at scrape time; each must be cheap and safe to call from the event loop."""

    queue_depth: Callable[[], int]
    open_connections: Callable[[], int]
    engine_busy_seconds: Callable[[], float]
    engine_uptime_seconds: Callable[[], float]
    engine_alive: Callable[[], bool]
    scores_not_numbers: Callable[[], int]


class _LiveCollector:
    """Turns ``LiveValues`` into metric families on every scrape."""

    def __init__(self, live: LiveValues) -> None:
        self._live = live

    def describe(self) -> Iterable[Metric]:
        """The families without values, so that registering reads none of the callables."""
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._live)

    @staticmethod
    def _families(live: LiveValues | None) -> list[Metric]:
        busy = live.engine_busy_seconds() if live else None
        uptime = live.engine_uptime_seconds() if live else 0.0
        ratio = None if busy is None else (busy / uptime if uptime > 0 else 0.0)
        return [
            GaugeMetricFamily("fillmask_queue_depth", "Requests waiting in the queue for the model.",
                              value=live.queue_depth() if live else None),
            GaugeMetricFamily("fillmask_open_connections", "Open WebSocket connections.",
                              value=live.open_connections() if live else None),
            CounterMetricFamily("fillmask_engine_busy_seconds", "Seconds the engine spent running batches; "
                                "rate() of it is the recent busy ratio.", value=busy),
            GaugeMetricFamily("fillmask_engine_busy_ratio", "Fraction of the time since the engine started that "
                              "it spent running batches.", value=ratio),
            GaugeMetricFamily("fillmask_engine_up", "1 while the engine thread runs, 0 once it stopped.",
                              value=None if live is None else float(live.engine_alive())),
            CounterMetricFamily("fillmask_scores_not_numbers", "Requests answered internal_error because the "
                                "model's scores for their text were not numbers (NaN).",
                                value=live.scores_not_numbers() if live else None),
        ]


class _CostModelCollector:
    """``fillmask_torch_threads``, ``fillmask_forward_parts``, ``fillmask_cost_model_seconds{term}`` and
    ``fillmask_batch_cap{cap}``: the torch thread count in use, the parts a batch runs in, the engine's
    fitted cost model (costmodel.Coefficients) and the batch caps (rows, tokens), as they are now."""

    def __init__(self, torch_threads: Callable[[], int], coefficients: Callable[[], Coefficients],
                 caps: Callable[[], tuple[int, int]], forward_parts: Callable[[], int] = lambda: 1) -> None:
        self._threads = torch_threads
        self._parts = forward_parts
        self._coefficients = coefficients
        self._caps = caps

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._coefficients)

    def _families(self, coefficients: Callable[[], Coefficients] | None) -> list[Metric]:
        threads = GaugeMetricFamily("fillmask_torch_threads", "Torch intra-op threads in use (--torch-threads, "
                                    "or measured by the start-up calibration and again while serving).",
                                    value=self._threads() if coefficients else None)
        parts = GaugeMetricFamily("fillmask_forward_parts", "Parts side by side that a batch of several texts "
                                  "runs in, each on its share of the torch threads (--forward-parts, or measured "
                                  "by the start-up calibration and again while serving); 1: one forward pass.",
                                  value=self._parts() if coefficients else None)
        terms = GaugeMetricFamily("fillmask_cost_model_seconds", "The engine's fitted cost model: seconds per "
                                  "batch (overhead), per padded token, per row and per byte of answer bound.",
                                  labels=["term"])
        if coefficients is not None:
            c = coefficients()
            for term, value in (("overhead", c.overhead_s), ("padded_token", c.token_s), ("row", c.row_s),
                                ("output_byte", c.byte_s)):
                terms.add_metric([term], value)
        caps = GaugeMetricFamily("fillmask_batch_cap", "The most rows (requests) and padded tokens one batch may "
                                 "hold (--max-batch-size, --max-batch-tokens; 0 there: set at start-up from the "
                                 "calibration's cost model).",
                                 labels=["cap"])
        if coefficients is not None:
            rows, tokens = self._caps()
            caps.add_metric(["rows"], rows)
            caps.add_metric(["tokens"], tokens)
        return [threads, parts, terms, caps]


class _QuietLoneCollector:
    """``fillmask_quiet_lone_threads``, ``fillmask_quiet_lone_after_seconds`` and
    ``fillmask_quiet_lone_requests_total``: the rule for a lone request after the thread team has been
    quiet as it stands now, and the requests it ran on fewer threads so far."""

    def __init__(self, threads: Callable[[], int], after_s: float, moved: Callable[[], int]) -> None:
        self._threads = threads
        self._after_s = after_s
        self._moved = moved

    def collect(self) -> Iterable[Metric]:
        return [GaugeMetricFamily("fillmask_quiet_lone_threads", "Torch threads a lone request runs on once the "
                                  "model's thread team has been quiet fillmask_quiet_lone_after_seconds: fewer than "
                                  "the team's where waking it is the slower, as the calibration timed it and as "
                                  "the lone requests after a quiet time it since.", value=self._threads()),
                GaugeMetricFamily("fillmask_quiet_lone_after_seconds", "How long after the thread team's last pass "
                                  "a lone request runs on fillmask_quiet_lone_threads (how long after such a pass "
                                  "the calibration timed it).", value=self._after_s),
                CounterMetricFamily("fillmask_quiet_lone_requests", "Lone requests run on fewer threads than "
                                    "their layout's after a quiet spell (by the rule, or to time that count again).",
                                    value=self._moved())]


class _Registry(CollectorRegistry):
    """The server's registry, without prometheus_client's ``*_created`` series (each counter's and
    histogram's start time, as a gauge): §11 does not list them, and ``fillmask_requests_created``
    reads like a count of requests. (The library's own switch, ``disable_created_metrics``, would
    change every registry of the process, a program's that embeds the server included.)"""

    def collect(self) -> Iterable[Metric]:
        for metric in super().collect():
            metric.samples = [sample for sample in metric.samples if not sample.name.endswith("_created")]
            yield metric


class Metrics:
    """The metrics of one server; ``render`` gives the ``/metrics`` body and its content type."""

    def __init__(self, live: LiveValues, engine: Mapping[str, str] | None = None) -> None:
        self.registry = _Registry(auto_describe=True)
        registry = self.registry
        if engine is not None:  # an info-style gauge: always 1, the facts are its labels (hello.engine, §2)
            labels = ("forward", "head", "layout", "device", "dtype")
            info = Gauge("fillmask_engine_info", "Which path the model runs: forward traced or eager, head at the "
                         "masks or full (every position), layout packed or padded rows or one length a batch, "
                         "device and dtype.", labels,
                         registry=registry)
            info.labels(*(str(engine.get(label, "")) for label in labels)).set(1)
        self.requests = Counter(
            "fillmask_requests", "Requests by how they ended: outcome is result, error, overloaded, cancelled or "
            "dropped (connection closed first); code is the error code or the overloaded reason.",
            ["outcome", "code"], registry=registry)
        self._answers: dict[tuple[str, str], Counter] = {}  # the labelled children of ``requests``, as used
        # Every series there can be is there at 0 from the start, so that rate() and alerts on a code that
        # has not happened yet read 0, not "no data".
        for outcome, code in [("result", ""), ("cancelled", ""), ("dropped", ""),
                              *(("error", code) for code in sorted(ERROR_CODES)),
                              *(("overloaded", reason) for reason in OVERLOADED_REASONS)]:
            self._answers[outcome, code] = self.requests.labels(outcome, code)
        self.queue_wait = Histogram("fillmask_queue_wait_seconds", "Time from reading a request to the start "
                                    "of its batch.", buckets=_SECONDS, registry=registry)
        self.inference = Histogram("fillmask_inference_seconds", "Time one batch's forward pass took on "
                                   "the model.", buckets=_SECONDS, registry=registry)
        self.batch_size = Histogram("fillmask_batch_size", "Requests per batch.", buckets=_BATCH_SIZES,
                                    registry=registry)
        self.batch_tokens = Histogram("fillmask_batch_tokens", "Padded tokens (rows x longest row) per batch.",
                                      buckets=_BATCH_TOKENS, registry=registry)
        self.handshakes_refused = Counter("fillmask_handshakes_refused", "WebSocket handshakes refused, by reason: "
                                          "bad_request (400, 405, 426, 505; also 414 and 431, and any request that "
                                          "could not be read), not_found (404), host (421), "
                                          "origin (403), token (401), max_connections or unavailable (503), "
                                          "unfinished (reset to bound handshakes under way: the oldest "
                                          "without a whole request, the new connection, or one past the "
                                          "bound after a burst that neither upgraded nor took its answer).",
                                          ["reason"], registry=registry)
        for reason in REFUSED_REASONS:
            self.handshakes_refused.labels(reason)
        self.connections = Counter("fillmask_connections", "WebSocket connections opened (handshakes answered "
                                   "101); those closed are this less fillmask_open_connections.", registry=registry)
        self.reading_paused = Counter("fillmask_reading_paused", "Times the server stopped reading a connection "
                                      "because its unsent answers passed --max-send-buffer-bytes.", registry=registry)
        self.resenders_closed = Counter("fillmask_resenders_closed", "Connections closed with 1008 because their "
                                        "client kept sending before the retry_after_ms it was given.",
                                        registry=registry)
        self.slow_clients_closed = Counter("fillmask_slow_clients_closed", "Connections closed with 1008 because "
                                           "their client did not read for --send-timeout.", registry=registry)
        registry.register(_LiveCollector(live))
        GCCollector(registry=registry)  # python_gc_*: collections by generation, and what they collected
        ProcessCollector(registry=registry)  # process_*: memory, CPU, file descriptors (Linux's /proc; none elsewhere)
        Gauge("fillmask_gc_frozen_objects", "Objects that Python's garbage collector no longer walks (gc.freeze): "
              "what start-up made, frozen before serving.", registry=registry).set_function(frozen_objects)

    def engine_calibration(self, torch_threads: Callable[[], int], coefficients: Callable[[], Coefficients],
                           caps: Callable[[], tuple[int, int]], forward_parts: Callable[[], int] = lambda: 1
                           ) -> None:
        """Export the torch thread count, the parts a batch runs in, the cost model's current coefficients
        and the batch caps (read at scrape time)."""
        self.registry.register(_CostModelCollector(torch_threads, coefficients, caps, forward_parts))

    def quiet_lone(self, threads: Callable[[], int], after_s: float, moved: Callable[[], int]) -> None:
        """Export the rule for a lone request after a quiet spell (``layout.QuietLone``): the count it
        uses now and how many requests it has moved (``threads`` and ``moved``, read at scrape time);
        where the calibration did not time it, none of the three series is there."""
        self.registry.register(_QuietLoneCollector(threads, after_s, moved))

    def answered(self, outcome: str, code: str) -> None:
        """Count one answer handed to a client's socket, labelled by what it was (never by parsing it)."""
        child = self._answers.get((outcome, code))
        if child is None:  # ``labels`` checks and looks its arguments up each time: once per label pair
            child = self._answers[(outcome, code)] = self.requests.labels(outcome, code)
        child.inc()

    def dropped(self, count: int = 1) -> None:
        """Count accepted requests whose connection closed before their answer could be sent."""
        if count:
            self.requests.labels("dropped", "").inc(count)

    def observe_batch(self, size: int, padded_tokens: int, queue_waits_s: Sequence[float], inference_s: float) -> None:
        """Record one batch (called on the engine thread; prometheus_client is thread-safe)."""
        self.batch_size.observe(size)
        self.batch_tokens.observe(padded_tokens)
        self.inference.observe(inference_s)
        for wait in queue_waits_s:
            self.queue_wait.observe(wait)

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type, in the format ``accept`` asks for; the Prometheus
        text format when it asks for none, or in a way prometheus_client cannot read (it fails on a
        ``version`` that is not a number, such as ``version=abc``: that was a 500)."""
        try:
            encoder, content_type = choose_encoder(accept or "")
        except (TypeError, ValueError):
            encoder, content_type = choose_encoder("")
        return encoder(self.registry), content_type
