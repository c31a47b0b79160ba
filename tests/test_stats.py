"""Live figures (protocol.md §13): the pure aggregator, and subscriptions on a real server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fillmask_server.server import FillMaskServer
from fillmask_server.stats import BUCKETS, LiveStats, bucket_value, latency_bucket
from tests.wire import recv, send, session

TEXT = "Paris is the [MASK] of France."


def test_a_snapshot_covers_its_window_only() -> None:
    stats = LiveStats()
    stats.result(1.0)  # before the window
    stats.batch_ran(1, 8, 100, 0.2)
    since = stats.mark(10.0)
    for latency in [5.0, 1.0, 3.0, 2.0, 4.0]:
        stats.result(latency)
    stats.batch_ran(2, 3, 30, 0.25)
    stats.batch_ran(3, 2, 20, 0.25)
    frame, end = stats.snapshot(since, 11.0, queue_depth=4, in_flight=6, connections=2)
    assert frame["window_s"] == 1.0 and frame["requests_per_s"] == 5.0
    assert frame["latency_ms"] == {"p50": pytest.approx(3.0, rel=0.01), "p99": pytest.approx(5.0, rel=0.01)}
    assert frame["batch_size"] == {"mean": 2.5, "max": 3}
    assert frame["engine_busy"] == 0.5
    assert [b["batch_id"] for b in frame["batches"]] == [2, 3]
    assert (frame["queue_depth"], frame["in_flight"], frame["connections"]) == (4, 6, 2)
    stats.batch_ran(4, 1, 10, 0.1)  # the next window begins where this one ended
    frame, _ = stats.snapshot(end, 12.0, 0, 0, 1)
    assert frame["requests_per_s"] == 0.0 and frame["batch_size"] == {"mean": 1.0, "max": 1}
    assert [b["batch_id"] for b in frame["batches"]] == [4]


def test_an_empty_window_says_null_not_zero() -> None:
    stats = LiveStats()
    frame, _ = stats.snapshot(stats.mark(0.0), 1.0, 0, 0, 1)
    assert frame["latency_ms"] == {"p50": None, "p99": None}
    assert frame["batch_size"] == {"mean": None, "max": None}
    assert frame["requests_per_s"] == 0.0 and frame["batches"] == [] and frame["engine_busy"] == 0.0


def test_a_long_window_at_a_high_rate_counts_everything() -> None:
    """Found by an adversarial run: a 10-s window at a few thousand results a second reported 20,000 of
    them (the record kept the last 20,000), and latency quantiles of the window's end only."""
    stats = LiveStats()
    since = stats.mark(0.0)
    for i in range(60_000):  # 10 s at 6,000 a second: a tenth at 100 ms, the rest at 1..5 ms
        stats.result(100.0 if i < 6_000 else 1.0 + (i % 5))
    for i in range(3_000):
        stats.batch_ran(i, 200 if i == 5 else 20, 400, 0.002)
    frame, _ = stats.snapshot(since, 10.0, 0, 0, 1)
    assert frame["requests_per_s"] == 6000.0
    assert frame["latency_ms"] == {"p50": pytest.approx(3.0, rel=0.01), "p99": pytest.approx(100.0, rel=0.01)}
    assert frame["batch_size"] == {"mean": pytest.approx(20.06), "max": 200} and frame["engine_busy"] == 0.6
    assert [b["batch_id"] for b in frame["batches"]] == list(range(3_000 - 64, 3_000))  # the last 64


def test_latency_buckets_are_within_one_percent_over_the_whole_range() -> None:
    for latency in [0.02, 0.5, 1.0, 7.3, 250.0, 9_999.0, 600_000.0]:
        assert bucket_value(latency_bucket(latency)) == pytest.approx(latency, rel=0.01), latency
    assert latency_bucket(0.0) == latency_bucket(-1.0) == 0 and latency_bucket(1e12) == BUCKETS - 1


async def frames_of_type(ws: Any, kind: str, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    """The next ``count`` frames of ``kind``, skipping others."""
    found: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while len(found) < count:
            frame = await recv(ws)
            if frame["type"] == kind:
                found.append(frame)
    return found


async def test_a_subscriber_gets_the_figures_of_what_the_server_did(server: FillMaskServer) -> None:
    async with session(server.url) as (ws, hello):
        assert hello["stats"] == {"min_interval_ms": 250, "max_interval_ms": 10000, "default_interval_ms": 1000}
        await send(ws, {"type": "subscribe_stats", "interval_ms": 250})
        for i in range(5):
            await send(ws, {"type": "fill_mask", "id": i, "text": TEXT})
        results: list[dict[str, Any]] = []
        figures: list[dict[str, Any]] = []  # every stats frame, those that came between results too
        async with asyncio.timeout(10):  # until the results, and the stats frames that cover them
            while len(results) < 5 or round(sum(f["requests_per_s"] * f["window_s"] for f in figures)) < 5:
                frame = await recv(ws)
                (results if frame["type"] == "result" else figures).append(frame)
        assert {f["type"] for f in figures} == {"stats"}
        seen = {b["batch_id"]: b for f in figures for b in f["batches"]}
        assert {r["batch_id"] for r in results} <= set(seen)
        assert all(0 < f["window_s"] < 1 for f in figures[1:])
        assert any(f["latency_ms"]["p50"] is not None and f["engine_busy"] > 0 for f in figures)
        assert figures[-1]["connections"] >= 1 and figures[-1]["in_flight"] == 0


async def test_a_batch_done_just_before_a_change_of_interval_is_in_the_next_frame(server: FillMaskServer) -> None:
    # Subscribed at 10 s, a request runs; the interval then changes to 250 ms before any frame came.
    # The next frame covers the time since the subscription, not since the change: the batch is in it.
    async with session(server.url) as (ws, _):
        await send(ws, {"type": "subscribe_stats", "interval_ms": 10_000})
        await send(ws, {"type": "fill_mask", "id": "early", "text": TEXT})
        result = await recv(ws)
        assert result["type"] == "result"
        await asyncio.sleep(0.05)
        await send(ws, {"type": "subscribe_stats", "interval_ms": 250})
        frame = await recv(ws, timeout=5)
        assert frame["type"] == "stats" and frame["window_s"] > 0.05
        assert result["batch_id"] in {b["batch_id"] for b in frame["batches"]}


@pytest.mark.parametrize("interval", [0, 249, 10_001, 1.5, "1000", True])
async def test_a_bad_interval_is_one_error_and_subscribes_nothing(server: FillMaskServer, interval: Any) -> None:
    async with session(server.url) as (ws, _):
        await send(ws, {"type": "subscribe_stats", "interval_ms": interval})
        error = await recv(ws)
        assert (error["type"], error["code"], error["id"]) == ("error", "invalid_field", None)
        assert "interval_ms" in error["message"]
        await send(ws, {"type": "fill_mask", "id": "after", "text": TEXT})
        assert (await recv(ws))["type"] == "result"  # and not a stats frame


async def test_an_interval_of_null_is_the_default_as_for_any_optional_field(server: FillMaskServer) -> None:
    """§3's rule for optional fields holds here too (an adversarial run found null refused here only)."""
    async with session(server.url) as (ws, hello):
        await send(ws, {"type": "subscribe_stats", "interval_ms": None})
        frame = await recv(ws, timeout=10)
        assert frame["type"] == "stats" and frame["window_s"] >= hello["stats"]["default_interval_ms"] / 1000 - 0.01


async def test_unsubscribing_stops_the_frames(server: FillMaskServer) -> None:
    async with session(server.url) as (ws, _):
        await send(ws, {"type": "subscribe_stats", "interval_ms": 250})
        await frames_of_type(ws, "stats", 1)
        await send(ws, {"type": "unsubscribe_stats"})
        await send(ws, {"type": "fill_mask", "id": "marker", "text": TEXT})
        while (frame := await recv(ws))["type"] != "result":  # stats sent before the unsubscribe may come first
            assert frame["type"] == "stats"
        with pytest.raises(TimeoutError):
            await recv(ws, timeout=0.6)  # more than two intervals: nothing


def test_a_batch_is_in_the_frame_whose_snapshot_follows_its_count_and_in_no_other() -> None:
    # The decode stage counts a batch, under the lock, before or after the event loop's snapshot: it
    # is in that window or the next, never in both or neither (the live timeline once missed a batch
    # that fell between two windows, beside a busy core, when windows were cut by clock readings).
    for counted_first in (True, False):
        stats = LiveStats()
        since = stats.mark(9.0)
        if counted_first:
            stats.batch_ran(7, 4, 40, 0.01)
        first, middle = stats.snapshot(since, 10.5, 0, 0, 1)
        if not counted_first:
            stats.batch_ran(7, 4, 40, 0.01)
        second, _ = stats.snapshot(middle, 11.0, 0, 0, 1)
        assert [b["batch_id"] for b in first["batches"] + second["batches"]] == [7]
        assert [f["batch_size"]["max"] for f in (first, second)] == ([4, None] if counted_first else [None, 4])
