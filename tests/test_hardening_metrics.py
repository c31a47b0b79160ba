"""``GET /metrics`` (protocol.md §11): every outcome counted once, batch histograms, live gauges, and one
registry per server."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from fillmask_server.server import FillMaskServer
from tests.wire import recv, recv_n, request, send, session, wait_until

TEXT = "Paris is the [MASK] of France."


async def scrape(srv: FillMaskServer, accept: str | None = None) -> tuple[str, dict[tuple[str, tuple], float]]:
    """The content type and every sample, keyed by (name, sorted labels)."""

    def get() -> tuple[str, str]:
        headers = {"Accept": accept} if accept else {}
        with urllib.request.urlopen(urllib.request.Request(srv.http_url + "/metrics", headers=headers),
                                    timeout=5) as response:
            return response.headers["Content-Type"], response.read().decode()

    content_type, text = await asyncio.to_thread(get)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return content_type, samples


def outcome(samples: dict[tuple[str, tuple], float], kind: str, code: str = "") -> float:
    return samples.get(("fillmask_requests_total", (("code", code), ("outcome", kind))), 0.0)


async def test_every_outcome_batches_and_live_values(make_server: Any) -> None:
    async with make_server(max_queue=1) as srv, make_server() as other:
        async with session(srv.url) as (ws, _):
            assert (await request(ws, "ok", TEXT))["type"] == "result"
            with srv.engine.paused():
                await send(ws, {"type": "fill_mask", "id": "late", "text": TEXT, "deadline_ms": 20})
                assert (await recv(ws))["reason"] == "deadline_exceeded"
                await send(ws, {"type": "fill_mask", "id": "gone", "text": TEXT})
                await send(ws, {"type": "cancel", "id": "gone"})
                assert (await recv(ws))["type"] == "cancelled"
                await send(ws, {"type": "fill_mask", "id": "q1", "text": TEXT})
                await send(ws, {"type": "fill_mask", "id": "q2", "text": TEXT})
                assert (await recv(ws))["reason"] == "queue_full"
                await ws.send("not json")
                await send(ws, {"type": "fill_mask", "id": "nm", "text": "no mask"})
                assert [f["code"] for f in await recv_n(ws, 2)] == ["invalid_json", "no_mask"]
                _, held = await scrape(srv)
                assert held[("fillmask_queue_depth", ())] == 1
                assert held[("fillmask_open_connections", ())] == 1
                assert held[("fillmask_connections_total", ())] == 1
            assert (await recv(ws))["id"] == "q1"
        async with session(srv.url), session(srv.url):
            pass
        # Opened: three; closed: opened less open (a soak trial had no count of connections to check).
        await wait_until(lambda: not srv.connections)
        _, after = await scrape(srv)
        assert after[("fillmask_connections_total", ())] == 3 and after[("fillmask_open_connections", ())] == 0

        for _ in range(100):  # the decode stage records a batch before decoding its results, on its thread
            content_type, samples = await scrape(srv)
            if samples[("fillmask_batch_size_count", ())] == srv.engine.stats.batches:
                break
            await asyncio.sleep(0.01)
        assert content_type.startswith("text/plain; version=0.0.4")
        assert outcome(samples, "result") == 2
        assert outcome(samples, "overloaded", "deadline_exceeded") == 1
        assert outcome(samples, "overloaded", "queue_full") == 1
        assert outcome(samples, "cancelled") == 1
        assert outcome(samples, "error", "invalid_json") == 1 and outcome(samples, "error", "no_mask") == 1
        assert sum(v for (name, _), v in samples.items() if name == "fillmask_requests_total") == 7

        batches = srv.engine.stats.batches
        assert batches >= 2
        assert samples[("fillmask_batch_size_count", ())] == batches
        assert samples[("fillmask_batch_size_sum", ())] == srv.engine.stats.rows == 2
        assert samples[("fillmask_inference_seconds_count", ())] == batches
        assert samples[("fillmask_batch_tokens_count", ())] == batches
        assert samples[("fillmask_batch_tokens_sum", ())] >= 2 * 9  # two rows of nine tokens at least
        assert samples[("fillmask_queue_wait_seconds_count", ())] == 2
        assert samples[("fillmask_queue_wait_seconds_bucket", (("le", "+Inf"),))] == 2
        assert samples[("fillmask_queue_depth", ())] == 0
        assert samples[("fillmask_engine_up", ())] == 1
        assert samples[("fillmask_scores_not_numbers_total", ())] == 0  # there from the start
        assert 0 < samples[("fillmask_engine_busy_seconds_total", ())] <= samples[
            ("fillmask_inference_seconds_sum", ())] + 0.01
        assert 0 < samples[("fillmask_engine_busy_ratio", ())] < 1

        _, fresh = await scrape(other)  # a second server in the same process counts on its own
        assert sum(v for (name, _), v in fresh.items() if name == "fillmask_requests_total") == 0
        for kind in ("result", "cancelled", "dropped"):  # there from the start, at 0, so that rate() has a series
            assert ("fillmask_requests_total", (("code", ""), ("outcome", kind))) in fresh, kind
        assert fresh[("fillmask_batch_size_count", ())] == 0


async def test_openmetrics_is_served_when_asked_for(server: FillMaskServer) -> None:
    content_type, _ = await scrape(server, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    # An Accept header prometheus_client cannot read gets the text format, not a 500 (an adversarial run).
    for accept in ("application/openmetrics-text; version=abc", "application/openmetrics-text; version=1..0"):
        content_type, samples = await scrape(server, accept)
        assert content_type.startswith("text/plain") and ("fillmask_engine_up", ()) in samples, accept


async def test_every_series_is_there_at_0_before_it_happens(make_server: Any) -> None:
    """An alert on ``rate(fillmask_requests_total{outcome="overloaded"}[5m])`` read "no data", not 0, until
    the first overload (found by an operator's review): every outcome and code of §6 and §7, and every
    reason a handshake is refused for (§11), is exported at 0 from the start."""
    from fillmask_client.wire import OVERLOADED_REASONS
    from fillmask_server.protocol import ERROR_CODES

    async with make_server() as srv:
        _, samples = await scrape(srv)
    for kind, codes in (("error", ERROR_CODES), ("overloaded", OVERLOADED_REASONS), ("result", [""]),
                        ("cancelled", [""]), ("dropped", [""])):
        for code in codes:
            assert samples[("fillmask_requests_total", (("code", code), ("outcome", kind)))] == 0, (kind, code)
    refused = {labels[0][1] for name, labels in samples if name == "fillmask_handshakes_refused_total"}
    assert refused == {"bad_request", "not_found", "host", "origin", "token", "unavailable", "max_connections",
                       "unfinished"}


async def test_every_series_served_is_one_that_protocol_md_lists(server: FillMaskServer) -> None:
    """A newcomer found 30 families where §11 lists fewer: prometheus_client's ``*_created`` series (each
    counter's start time, as a gauge) were served too, and ``fillmask_requests_created`` reads like a
    count of requests. Every family served must be in §11's table, in both formats."""
    import re

    spec = (Path(__file__).resolve().parent.parent / "protocol.md").read_text()
    section = spec[spec.index("## §11"):spec.index("## §12")]
    def family(name: str) -> str:
        return re.sub(r"_(total|bucket|sum|count)$", "", name)

    listed = {family(name) for name in re.findall(r"`((?:fillmask|python|process)_[a-z_]+)", section)}
    _, samples = await scrape(server)
    served = {family(name) for name, _ in samples}
    assert not {name for name in served if name.endswith("_created")}
    assert served <= listed, served - listed

    def openmetrics() -> str:
        request = urllib.request.Request(server.http_url + "/metrics",
                                         headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.read().decode()

    assert "_created" not in await asyncio.to_thread(openmetrics)


async def test_the_process_memory_and_file_descriptors_are_served(server: FillMaskServer) -> None:
    """An operator's audit: the README sizes replicas by memory and file descriptors, and /metrics had
    neither. Prometheus' standard process metrics now come with the rest (on Linux, where CI runs)."""
    _, samples = await scrape(server)
    assert samples[("process_resident_memory_bytes", ())] > 10 * 2**20  # (torch alone is more)
    assert 3 <= samples[("process_open_fds", ())] <= samples[("process_max_fds", ())]
    assert samples[("process_cpu_seconds_total", ())] > 0


async def test_a_scrape_does_not_walk_the_frozen_heap(make_server: Any, monkeypatch: Any) -> None:
    """The frozen-objects gauge called ``gc.get_freeze_count`` at every scrape: CPython walks its whole
    frozen list (hundreds of thousands of objects in a real server) holding the GIL, and one client
    fetching /metrics in a loop stalled every connection (a helper's audit: p50 5 -> 53 ms). The count
    is taken once, when start-up freezes the heap (``allocator.frozen_objects``)."""
    import gc

    calls = []
    walk = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append(1) or walk())
    async with make_server() as srv:  # (its metrics made after the patch)
        for _ in range(3):
            _, samples = await scrape(srv)
            assert ("fillmask_gc_frozen_objects", ()) in samples
    assert calls == []


async def test_the_rule_for_a_lone_request_after_a_quiet_spell_is_on_metrics_and_counts_what_it_moved(
        tiny_config: Any) -> None:
    """A calibration that timed one thread faster than the team after the quiet: /metrics gives the rule
    and counts each lone request it ran on one thread (the first: the team had never run); protocol.md
    §11 lists each series, and the gauge follows the rule when it chooses again. Where the team was
    the faster, the rule is there at the team's count (the engine times its lone requests and may
    choose again) and has moved nothing; with ``--quiet-lone off``, whatever the calibration it is
    given, no such series."""
    import re
    from dataclasses import replace

    from fillmask_server.calibration import Calibration
    from fillmask_server.loading import load_model

    spec = (Path(__file__).resolve().parent.parent / "protocol.md").read_text()
    listed = set(re.findall(r"`(fillmask_quiet_lone_[a-z_]+)`", spec[spec.index("## §11"):spec.index("## §12")]))
    assert len(listed) == 3
    model = load_model(tiny_config.model)
    cases = (({1: 3.8, 2: 14.8}, "auto", 1), ({1: 76.1, 2: 58.7}, "auto", 2), ({1: 3.8, 2: 14.8}, "off", None))
    for quiet_ms, setting, threads in cases:
        calibration = Calibration(2, "calibration", threads_ms={1: 7.0, 2: 5.1}, quiet_lone_ms=quiet_ms,
                                  quiet_after_ms=41.0)
        server = FillMaskServer(replace(tiny_config, quiet_lone=setting), model, calibration)
        await server.start()
        try:
            async with session(server.url) as (ws, hello):
                if setting == "auto":
                    assert hello["engine"]["calibration"]["quiet_lone"]["threads"] == threads
                assert (await request(ws, "lone", TEXT))["type"] == "result"
            _, samples = await scrape(server)
            rule = server.engine.quiet
            if threads == 1 and rule is not None:  # fast wakes of the team while serving: the gauge follows
                # One thread's last passes at the calibration's time first, whatever the real request's
                # pass took on this machine (a busy core's run: a fast one kept the rule on one thread).
                assert not [line for line in (rule.ran(1, 3.8e-3) for _ in range(5)) if line is not None]
                assert [rule.ran(2, 3.0e-3) for _ in range(5)][-1] is not None and rule.threads == 2
                _, later = await scrape(server)
                assert later[("fillmask_quiet_lone_threads", ())] == 2
        finally:
            await server.drain(timeout=2.0)
        if threads is not None:
            assert samples[("fillmask_quiet_lone_threads", ())] == threads
            assert samples[("fillmask_quiet_lone_after_seconds", ())] == 0.041
            assert samples[("fillmask_quiet_lone_requests_total", ())] == (1 if threads == 1 else 0)
            assert {name.removesuffix("_total") for name, _ in samples if name.startswith("fillmask_quiet")} == {
                name.removesuffix("_total") for name in listed}  # §11 lists each (the shared server has none)
        else:
            assert not [name for name, _ in samples if name.startswith("fillmask_quiet_lone")]
