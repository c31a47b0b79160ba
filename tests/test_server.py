"""The server on a real socket with the tiny offline model: protocol.md §2–§9, section by section.

The shared ``server`` fixture is left idle and unpaused by every test; tests that change limits use
``make_server``. ``engine.paused()`` holds the engine between batches, which makes "still queued"
states deterministic without sleeping.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from fillmask_server.batching import footprint
from fillmask_server.server import FillMaskServer
from tests.wire import (
    answers_counted,
    assert_answered,
    assert_same_predictions,
    recv,
    recv_n,
    request,
    send,
    session,
    wait_until,
)

TEXTS = [
    "Paris is the [MASK] of France.",
    "The [MASK] sat on the mat.",
    "I went to the [MASK] yesterday to buy some bread, milk and a newspaper for my grandmother.",
    "[MASK]",
    "She plays the [MASK] and he plays the [MASK] in the evening.",
    "After years of careful research, the scientists finally announced that the [MASK] had been "
    "found deep beneath the ice of the southern continent, where nobody had ever thought to look.",
]


def fill(frame_id: Any, text: str, **fields: Any) -> dict[str, Any]:
    return {"type": "fill_mask", "id": frame_id, "text": text, **fields}


async def http_get(url: str) -> tuple[int, dict[str, Any]]:
    def get() -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, orjson.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, orjson.loads(error.read())

    return await asyncio.to_thread(get)


# --- §2 hello ----------------------------------------------------------------------------------


async def test_hello_is_the_first_frame_with_model_and_limits(server: FillMaskServer) -> None:
    async with session(server.url) as (_, hello):
        assert hello["type"] == "hello" and hello["protocol"] == 1
        assert server.config.model.startswith("/")  # an absolute directory, which hello never shows (§2)
        assert hello["model"] == "tiny" and hello["mask_token"] == "[MASK]"
        assert hello["random_weights"] is True  # the offline checkpoint says its weights are random
        limits = hello["limits"]
        assert limits["max_batch_size"] == server.config.max_batch_size
        assert limits["max_queue"] == server.config.max_queue
        assert limits["max_text_chars"] == server.config.max_text_chars
        assert limits["max_tokens"] == 512
        assert limits["top_k"] == {"min": 1, "max": server.config.max_top_k, "default": 5}
        assert {"max_masks", "max_targets", "max_id_chars", "max_deadline_ms", "max_frame_bytes"} <= set(limits)


async def test_the_largest_limits_accepted_are_announced_exactly_in_hello(make_server: Any) -> None:
    """Each limit hello carries, at the largest value start-up takes (``config.validate``), reaches the
    client as that number (the server had failed to encode a larger one, at start-up, with a traceback),
    and --max-connections that large listens (``listen`` takes a C int)."""
    from fillmask_client.wire import MAX_SAFE_INTEGER
    from fillmask_server.config import validate

    largest = {name: MAX_SAFE_INTEGER for name in ("max_queue", "max_text_chars", "max_masks", "max_targets",
                                                   "max_frame_bytes", "max_result_bytes", "max_connections",
                                                   "max_inflight_per_connection", "max_send_buffer_bytes",
                                                   "max_answer_bytes")}
    async with make_server(**largest) as srv:
        assert validate(srv.config) is None
        async with session(srv.url) as (_, hello):
            for name in ("max_queue", "max_text_chars", "max_masks", "max_targets", "max_frame_bytes",
                         "max_result_bytes", "max_inflight_per_connection"):
                assert hello["limits"][name] == MAX_SAFE_INTEGER, (name, hello["limits"])


async def test_an_idle_server_that_waits_for_fuller_batches_answers_a_deadline_shorter_than_the_wait(
        make_server: Any) -> None:
    """A newcomer's trial: with --max-wait-ms 200, an idle server held a request with deadline_ms 100
    until its deadline and answered 504 deadline_exceeded; also beside a plain request sent with it.
    (Here 3000 and 1000: the wait now ends at half the deadline, a margin no busy machine eats.)"""
    async with make_server(max_wait_ms=3000.0) as srv, session(srv.url) as (ws, _):
        await send(ws, {"type": "fill_mask", "id": 1, "text": "a [MASK] day.", "top_k": 1, "deadline_ms": 1000})
        assert (await recv(ws))["type"] == "result"
        await send(ws, {"type": "fill_mask", "id": 2, "text": "a [MASK] day.", "top_k": 1})
        await send(ws, {"type": "fill_mask", "id": 3, "text": "a [MASK] day.", "top_k": 1, "deadline_ms": 1000})
        assert sorted((frame["id"], frame["type"]) for frame in await recv_n(ws, 2)) == [(2, "result"), (3, "result")]


async def test_ws_alias_path_and_unknown_ws_path(server: FillMaskServer) -> None:
    async with session(server.url + "ws") as (_, hello):
        assert hello["type"] == "hello"
    with pytest.raises(InvalidStatus) as refused:
        async with connect(server.url + "elsewhere"):
            pass
    assert refused.value.response.status_code == 404


# --- §4 results equal the pipeline ---------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
async def test_result_equals_pipeline(server: FillMaskServer, reference_pipeline: Any, text: str) -> None:
    async with session(server.url) as (ws, _):
        result = await request(ws, 1, text)
    assert result["type"] == "result" and result["id"] == 1
    assert_same_predictions(result["predictions"], reference_pipeline(text))
    assert result["queue_ms"] >= 0 and result["inference_ms"] > 0 and result["batch_size"] >= 1
    assert result["batch_tokens"] >= 3


@pytest.mark.parametrize("parts", [1, 2])
async def test_mixed_length_batch_equals_each_text_alone(make_server: Any, reference_pipeline: Any, parts: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One batch of short and long texts, one and two masks, top_k and targets: each equals the pipeline,
    in one forward pass or in two parts side by side (``--forward-parts 2``: hello says so).

    ``max_length_ratio`` is raised so that the lengths really mix in one padded batch."""
    cases = [(text, {}) for text in TEXTS] + [
        (TEXTS[0], {"top_k": 12}),
        (TEXTS[2], {"targets": ["store", "bank", "zzqqxx", "store"]}),
        (TEXTS[4], {"top_k": 2, "targets": ["piano", "guitar", "violin"]}),
        (TEXTS[1], {"top_k": 1}),
    ]
    threads: list[str] = []  # each forward pass's thread
    async with make_server(max_length_ratio=100, forward_parts=parts) as srv, session(srv.url) as (ws, hello):
        forward = srv.model.forward
        monkeypatch.setattr(srv.model, "forward", lambda items: threads.append(
            threading.current_thread().name) or forward(items))
        with srv.engine.paused():
            for i, (text, fields) in enumerate(cases):
                await send(ws, fill(i, text, **fields))
            await wait_until(lambda: srv.engine.runnable() >= len(cases), timeout=30)
        frames = {frame["id"]: frame for frame in await recv_n(ws, len(cases))}
    assert hello["engine"]["forward_parts"] == parts
    assert sorted(threads) == (["fillmask-model"] if parts == 1 else ["fillmask-model", "fillmask-part-1"])
    lengths = [len(reference_pipeline.tokenizer(text)["input_ids"]) for text, _ in cases]
    assert len(set(lengths)) >= 5 and {frame["batch_size"] for frame in frames.values()} == {len(cases)}
    # One batch, its texts packed into shared rows: fewer tokens than one padded row each.
    assert srv.model.pack_width and frames[0]["batch_tokens"] == footprint(lengths, srv.model.pack_width)
    assert frames[0]["batch_tokens"] < len(cases) * max(lengths)
    for i, (text, fields) in enumerate(cases):
        assert frames[i]["type"] == "result", frames[i]
        assert_same_predictions(frames[i]["predictions"], reference_pipeline(text, **fields))


async def test_several_masks_give_one_list_per_mask(server: FillMaskServer, reference_pipeline: Any) -> None:
    async with session(server.url) as (ws, _):
        result = await request(ws, "m", "The [MASK] and the [MASK] went to [MASK].", top_k=3)
    predictions = result["predictions"]
    assert len(predictions) == 3 and all(len(row) == 3 for row in predictions)
    assert "[MASK]" in predictions[0][0]["sequence"]  # the other masks stay, as in the pipeline
    assert_same_predictions(predictions, reference_pipeline("The [MASK] and the [MASK] went to [MASK].", top_k=3))


async def test_top_k_and_targets(server: FillMaskServer, reference_pipeline: Any) -> None:
    text = TEXTS[0]
    async with session(server.url) as (ws, _):
        one = await request(ws, 1, text, top_k=1)
        many = await request(ws, 2, text, top_k=40)
        targeted = await request(ws, 3, text, targets=["capital", "city", "heart"], top_k=10)
        single = await request(ws, 4, text, targets="capital")
    assert len(one["predictions"]) == 1 and len(many["predictions"]) == 40
    assert_same_predictions(many["predictions"], reference_pipeline(text, top_k=40))
    assert len(targeted["predictions"]) == 3  # top_k shrinks to the number of targets
    assert {p["token_str"] for p in targeted["predictions"]} == {"capital", "city", "heart"}
    assert_same_predictions(targeted["predictions"], reference_pipeline(text, targets=["capital", "city", "heart"],
                                                                        top_k=10))
    assert [p["token_str"] for p in single["predictions"]] == ["capital"]
    assert "targets" not in targeted and "targets" not in single and "targets" not in many  # all scored as given


async def test_a_target_that_is_not_one_token_is_named_in_the_result(server: FillMaskServer,
                                                                     reference_pipeline: Any) -> None:
    """§4 ``targets``: each target replaced by its first token says what was scored, in request order;
    a one-token target gets no entry, an ignored one (no token at all) says null; predictions stay the
    pipeline's."""
    text = TEXTS[0]
    alone = {t: reference_pipeline(text, targets=[t])[0]["token_str"] for t in ("new york", "zzzzqqq")}
    assert alone["new york"] == "new" and len(alone["zzzzqqq"]) < len("zzzzqqq")  # its first sub-token
    targets = ["zzzzqqq", "capital", "new york", "\u0301", "zzzzqqq"]
    async with session(server.url) as (ws, _):
        frame = await request(ws, 1, text, targets=targets, top_k=10)
        plain = await request(ws, 2, text, targets=["capital", "city"])
    assert frame["targets"] == [{"given": "zzzzqqq", "scored": alone["zzzzqqq"]},
                                {"given": "new york", "scored": "new"}, {"given": "\u0301", "scored": None}]
    assert {p["token_str"] for p in frame["predictions"]} == {alone["zzzzqqq"], "capital", "new"}
    assert_same_predictions(frame["predictions"], reference_pipeline(text, targets=targets, top_k=10))
    assert "targets" not in plain


# --- §3 ids --------------------------------------------------------------------------------------


async def test_integer_and_string_ids_are_echoed_with_their_type(server: FillMaskServer) -> None:
    async with session(server.url) as (ws, _):
        with server.engine.paused():
            for frame_id in (5, "5", -7, "a-long-id-" * 10, 2**53 - 1):
                await send(ws, fill(frame_id, TEXTS[1]))
            await wait_until(lambda: server.engine.runnable() >= 5, timeout=30)
        frames = await recv_n(ws, 5)
    ids = sorted((type(f["id"]).__name__, f["id"]) for f in frames)
    assert ids == sorted([("int", 5), ("str", "5"), ("int", -7), ("str", "a-long-id-" * 10), ("int", 2**53 - 1)])
    assert all(f["type"] == "result" for f in frames)


async def test_same_id_on_two_connections_is_independent(server: FillMaskServer) -> None:
    async with session(server.url) as (a, _), session(server.url) as (b, _):
        await send(a, fill(1, TEXTS[0]))
        await send(b, fill(1, TEXTS[1]))
        ra, rb = await recv(a), await recv(b)
    assert (ra["type"], rb["type"]) == ("result", "result")
    assert ra["predictions"][0]["sequence"].startswith("paris")
    assert rb["predictions"][0]["sequence"].startswith("the")


# --- §8 exactly one terminal frame, many in flight ----------------------------------------------


async def exchange_many(url: str, count: int, tag: str) -> list[dict[str, Any]]:
    async with session(url) as (ws, _):
        for i in range(count):
            await send(ws, fill(f"{tag}-{i}", TEXTS[i % len(TEXTS)], top_k=1 + i % 4))
        return await recv_n(ws, count, timeout=60)


def assert_each_answered_once(frames: list[dict[str, Any]], expected_ids: set[str]) -> None:
    ids = [frame["id"] for frame in frames]
    assert len(ids) == len(set(ids)) == len(expected_ids) and set(ids) == expected_ids
    assert all(frame["type"] == "result" for frame in frames), [f for f in frames if f["type"] != "result"][:3]


async def test_100_in_flight_on_one_socket_each_answered_once(server: FillMaskServer) -> None:
    before = answers_counted(server)
    frames = await exchange_many(server.url, 100, "one")
    assert_each_answered_once(frames, {f"one-{i}" for i in range(100)})
    await assert_answered(server, before, 100)
    assert max(frame["batch_size"] for frame in frames) > 1  # they were batched together


async def test_100_in_flight_on_each_of_10_sockets(make_server: Any) -> None:
    async with make_server(max_queue=4096) as server:  # room for all of them: this is about exactly once
        before = answers_counted(server)
        results = await asyncio.gather(*(exchange_many(server.url, 100, f"s{n}") for n in range(10)))
        await assert_answered(server, before, 1000)
    for n, frames in enumerate(results):
        assert_each_answered_once(frames, {f"s{n}-{i}" for i in range(100)})
    for frames in results:  # answers went back on the socket that asked
        assert len({frame["id"].split("-")[0] for frame in frames}) == 1


# --- §7 bad input ------------------------------------------------------------------------------


BAD_FRAMES: list[tuple[str | bytes, str, Any]] = [
    ("this is not json", "invalid_json", None),
    ("[1, 2, 3]", "not_an_object", None),
    (b"\x00\x01binary", "binary_frame", None),
    ('{"type": "teleport", "id": 1}', "unknown_type", 1),
    ('{"id": 2, "text": "[MASK]"}', "missing_field", 2),
    ('{"type": "fill_mask", "id": 3}', "missing_field", 3),
    ('{"type": "fill_mask", "text": "a [MASK]"}', "missing_field", None),
    ('{"type": "fill_mask", "id": 4, "text": 42}', "invalid_field", 4),
    ('{"type": "fill_mask", "id": [4], "text": "a [MASK]"}', "invalid_id", None),
    ('{"type": "fill_mask", "id": 4.5, "text": "a [MASK]"}', "invalid_id", None),
    ('{"type": "fill_mask", "id": true, "text": "a [MASK]"}', "invalid_id", None),
    ('{"type": "fill_mask", "id": 5, "text": "no mask here"}', "no_mask", 5),
    ('{"type": "fill_mask", "id": "empty", "text": ""}', "no_mask", "empty"),  # §3: an empty text has no mask
    ('{"type": "fill_mask", "id": 6, "text": "' + "[MASK] " * 9 + '"}', "too_many_masks", 6),
    ('{"type": "fill_mask", "id": 7, "text": "[MASK]' + "a" * 2000 + '"}', "text_too_long", 7),
    ('{"type": "fill_mask", "id": 8, "text": "[MASK]' + " a" * 600 + '"}', "text_too_long", 8),
    ('{"type": "fill_mask", "id": 9, "text": "a [MASK]", "top_k": 0}', "invalid_top_k", 9),
    ('{"type": "fill_mask", "id": 10, "text": "a [MASK]", "top_k": 101}', "invalid_top_k", 10),
    ('{"type": "fill_mask", "id": 11, "text": "a [MASK]", "targets": 5}', "invalid_targets", 11),
    ('{"type": "fill_mask", "id": 12, "text": "a [MASK]", "targets": []}', "invalid_targets", 12),
    ('{"type": "fill_mask", "id": 13, "text": "a [MASK]", "targets": ["\\u200b"]}', "invalid_targets", 13),
    ('{"type": "fill_mask", "id": 14, "text": "a [MASK]", "deadline_ms": -1}', "invalid_deadline", 14),
    ('{"type": "cancel"}', "missing_field", None),
]


#: What a refusal of a limit tells the client to do (the limit itself is named before it).
WHAT_TO_DO = {"too_many_masks": "remove some, or split the text", "text_too_long": "shorten it"}


async def test_every_bad_input_gets_one_clear_error_and_the_connection_stays_open(server: FillMaskServer) -> None:
    before = answers_counted(server)
    async with session(server.url) as (ws, _):
        for data, code, frame_id in BAD_FRAMES:
            await ws.send(data)
            frame = await recv(ws)
            assert (frame["type"], frame["code"], frame["id"]) == ("error", code, frame_id), (data[:60], frame)
            message = frame["message"]
            assert message and "\n" not in message and "Traceback" not in message and "/" not in message, message
            assert WHAT_TO_DO.get(code, "") in message, message  # §7: what was wrong and what to do
        await assert_answered(server, before, len(BAD_FRAMES), ws)
        good = await request(ws, "still-open", TEXTS[0])
        assert good["type"] == "result"


async def test_duplicate_id_in_flight_is_rejected_and_the_first_still_answered(server: FillMaskServer) -> None:
    async with session(server.url) as (ws, _):
        with server.engine.paused():
            await send(ws, fill("dup", TEXTS[0]))
            await send(ws, fill("dup", TEXTS[1]))
            error = await recv(ws)
            assert (error["type"], error["code"], error["id"]) == ("error", "duplicate_id", "dup")
        result = await recv(ws)
        assert (result["type"], result["id"]) == ("result", "dup")
        assert result["predictions"][0]["sequence"].startswith("paris")
        again = await request(ws, "dup", TEXTS[1])  # answered, so the id is free again
        assert again["type"] == "result"


# --- §6 overload ------------------------------------------------------------------------------


async def test_queue_bound_answers_503_at_once(make_server: Any) -> None:
    """§6: with max_queue requests waiting (here from three connections, each within its share), the
    next request is refused at once; the accepted ones are answered as usual."""
    async with make_server(max_queue=3) as srv, session(srv.url) as (ws, hello), \
            session(srv.url) as (second, _), session(srv.url) as (third, _):
        before = answers_counted(srv)
        assert hello["limits"]["max_queue"] == 3
        with srv.engine.paused():
            for n, conn in enumerate((ws, second, third)):
                await send(conn, fill(n, TEXTS[0]))
            await wait_until(lambda: srv.engine.queued() == 3)
            await send(ws, fill(3, TEXTS[0]))
            await send(ws, fill(4, TEXTS[0]))
            rejected = await recv_n(ws, 2, timeout=2)  # while the engine is held
            assert srv.engine.queued() == 3
        assert [(f["type"], f["id"], f["status"], f["reason"]) for f in rejected] == [
            ("overloaded", 3, 503, "queue_full"), ("overloaded", 4, 503, "queue_full")]
        assert all(isinstance(f["retry_after_ms"], int) and f["retry_after_ms"] > 0 for f in rejected)
        results = [*(await recv_n(ws, 1)), *(await recv_n(second, 1)), *(await recv_n(third, 1))]
        assert sorted(f["id"] for f in results) == [0, 1, 2] and {f["type"] for f in results} == {"result"}
        await assert_answered(srv, before, 5, ws, second, third)


async def test_deadline_passing_in_the_queue_answers_504_promptly(server: FillMaskServer) -> None:
    before = answers_counted(server)
    async with session(server.url) as (ws, _):
        with server.engine.paused():
            await send(ws, fill("late", TEXTS[0], deadline_ms=50))
            await send(ws, fill("patient", TEXTS[0], deadline_ms=60_000))
            started = time.monotonic()
            expired = await recv(ws, timeout=5)  # arrives while the engine is still held
            waited = time.monotonic() - started
        assert (expired["type"], expired["id"], expired["status"], expired["reason"]) == (
            "overloaded", "late", 504, "deadline_exceeded")
        assert expired["queue_ms"] >= 50 and waited < 2
        result = await recv(ws)
        assert (result["type"], result["id"]) == ("result", "patient")
        await assert_answered(server, before, 2, ws)  # nothing more for "late"


# --- §5 cancel -----------------------------------------------------------------------------------


async def test_cancel_removes_a_queued_request(server: FillMaskServer) -> None:
    before = answers_counted(server)
    async with session(server.url) as (ws, _):
        with server.engine.paused():
            await send(ws, fill("a", TEXTS[0]))
            await send(ws, fill("b", TEXTS[1]))
            await send(ws, {"type": "cancel", "id": "a"})
            cancelled = await recv(ws)
            assert cancelled == {"type": "cancelled", "id": "a"}
            await send(ws, {"type": "cancel", "id": "never-sent"})  # unknown: ignored
        result = await recv(ws)
        assert (result["type"], result["id"]) == ("result", "b")
        await send(ws, {"type": "cancel", "id": "b"})  # already answered: ignored
        await assert_answered(server, before, 2, ws)


# --- §8 closed connections ----------------------------------------------------------------------


async def test_requests_of_a_closed_connection_never_reach_the_model(make_server: Any) -> None:
    async with make_server() as srv:
        with srv.engine.paused():
            async with session(srv.url) as (ws, _):
                for i in range(20):
                    await send(ws, fill(i, TEXTS[i % len(TEXTS)]))
                await wait_until(lambda: srv.engine.runnable() >= 20, timeout=30)
            deadline = time.monotonic() + 5
            while srv.engine.queued() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert srv.engine.queued() == 0
        async with session(srv.url) as (ws, _):
            assert (await request(ws, 1, TEXTS[0]))["type"] == "result"
        assert srv.engine.stats.rows == 1


# --- §9 HTTP --------------------------------------------------------------------------------------


async def test_health_ready_and_404(server: FillMaskServer) -> None:
    assert await http_get(server.http_url + "/healthz") == (200, {"status": "ok"})
    assert await http_get(server.http_url + "/readyz") == (200, {"status": "ready"})
    status, body = await http_get(server.http_url + "/no/such/page")
    assert status == 404 and body == {"error": "not found: nothing at '/no/such/page'; this server answers "
                                      "/healthz, /readyz, /metrics and the demo page at /, and WebSocket "
                                      "connections at /"}  # what was wrong and what to do (§9)
    status, _ = await http_get(server.http_url + "/../pyproject.toml")
    assert status == 404


# --- §10 drain --------------------------------------------------------------------------------


async def test_drain_finishes_accepted_work_refuses_new_and_closes_1001(make_server: Any) -> None:
    async with make_server(shutdown_timeout=10) as srv, session(srv.url) as (ws, _):
        with srv.engine.paused():
            for i in range(3):
                await send(ws, fill(i, TEXTS[i]))
            await wait_until(lambda: srv.engine.runnable() >= 3, timeout=30)
            drain = asyncio.create_task(srv.drain())
            notice = await recv(ws)
            assert notice == {"type": "going_away", "reason": "shutting_down", "reconnect_within_ms": 1000}
            assert (await http_get(srv.http_url + "/readyz"))[0] == 503
            assert (await http_get(srv.http_url + "/healthz"))[0] == 200
            with pytest.raises(InvalidStatus) as refused:
                async with connect(srv.url):
                    pass
            assert refused.value.response.status_code == 503
            await send(ws, fill("late", TEXTS[0]))
            late = await recv(ws)
            assert (late["type"], late["status"], late["reason"]) == ("overloaded", 503, "shutting_down")
        frames = await recv_n(ws, 3)
        assert sorted(f["id"] for f in frames) == [0, 1, 2] and {f["type"] for f in frames} == {"result"}
        with pytest.raises(ConnectionClosed):
            await recv(ws)
        assert ws.close_code == 1001
        await drain


async def test_drain_delay_keeps_serving_with_readyz_503_then_says_going_away(make_server: Any) -> None:
    """§10.1-2: during the delay a load balancer sees 503 on /readyz, yet connections and requests still
    work; only then does every connection get going_away (once) and new handshakes get 503."""
    async with make_server() as srv, session(srv.url) as (ws, _):
        drain = asyncio.create_task(srv.drain(delay=3.0))  # room for a handshake and two requests on a slow machine
        await wait_until(lambda: srv.ready.unready)
        assert await http_get(srv.http_url + "/readyz") == (503, {"status": "draining"})
        async with session(srv.url) as (newcomer, _):  # still accepted during the delay
            assert (await request(newcomer, "during", TEXTS[0]))["type"] == "result"
            assert (await request(ws, "during", TEXTS[1]))["type"] == "result"
            assert (await recv(newcomer, timeout=5))["type"] == "going_away"
        assert (await recv(ws, timeout=5))["type"] == "going_away"
        with pytest.raises(InvalidStatus) as refused:
            async with connect(srv.url):
                pass
        assert refused.value.response.status_code == 503
        with pytest.raises(ConnectionClosed):
            await recv(ws)  # nothing else came before the close: one going_away, no second one
        assert ws.close_code == 1001
        await drain


async def test_drain_timeout_answers_what_is_still_queued(make_server: Any) -> None:
    async with make_server() as srv, session(srv.url) as (ws, _):
        with srv.engine.paused():
            await send(ws, fill("stuck", TEXTS[0]))
            await wait_until(lambda: srv.engine.runnable() >= 1, timeout=30)
            await srv.drain(timeout=0.1)
            assert (await recv(ws))["type"] == "going_away"
            frame = await recv(ws)
            assert (frame["type"], frame["id"], frame["reason"]) == ("overloaded", "stuck", "shutting_down")
            with pytest.raises(ConnectionClosed):
                await recv(ws)
            assert ws.close_code == 1001


# --- fairness across connections (batching.py) ---------------------------------------------------


async def test_a_light_connection_is_not_starved_by_a_heavy_one(make_server: Any) -> None:
    """1,000 requests queued by one connection; another's single request runs in the next batch."""
    async with make_server(max_batch_size=8, max_queue=4000, max_inflight_per_connection=1000) as srv, \
            session(srv.url) as (heavy, _), session(srv.url) as (light, _):
        with srv.engine.paused():
            for i in range(1000):
                await send(heavy, fill(i, TEXTS[i % 3]))
            await send(light, fill("light", TEXTS[2]))
            await wait_until(lambda: srv.engine.runnable() >= 1001, timeout=30)
        result = await recv(light)
        first_heavy = await recv(heavy)
        assert result["type"] == "result" and first_heavy["type"] == "result"
        assert result["batch_id"] <= first_heavy["batch_id"] + 1  # served within the next two batches
        await recv_n(heavy, 999, timeout=60)


async def test_the_switch_interval_follows_the_thread_count_unless_the_user_set_one(
        tiny_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """--gil-switch-ms 0 (the default): a started server sets the interval that suits its torch thread
    count, and again each time the engine changes the count (``on_threads``); a value the user set is
    kept whatever the count. Draining puts back what the process had before (the last server to
    drain does: this test's servers are the only ones, not the suite's others in this process)."""
    import dataclasses
    import sys

    from fillmask_server import server as server_module
    from fillmask_server.calibration import Calibration
    from fillmask_server.loading import load_model
    from fillmask_server.tuning import SWITCH_ONE_THREAD_S, SWITCH_TEAM_S

    monkeypatch.setattr(server_module, "_SWITCH_INTERVAL", server_module._SwitchInterval())

    model = load_model(tiny_config.model)
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        server = FillMaskServer(tiny_config, model, Calibration(2, "calibration", {1: 1.0, 2: 0.5}))
        assert sys.getswitchinterval() == pytest.approx(0.005)  # building a server changes nothing
        await server.start()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_TEAM_S)
        assert server.engine._on_threads == server._follow_thread_count  # what the model thread calls
        server._follow_thread_count(1)  # as after a switch to one thread (tests/test_engine.py)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_ONE_THREAD_S)
        await server.drain(timeout=2.0)
        assert sys.getswitchinterval() == pytest.approx(0.005)

        set_by_user = FillMaskServer(dataclasses.replace(tiny_config, gil_switch_ms=3.0), model,
                                     Calibration(1, "calibration", {1: 0.5, 2: 1.0}))
        await set_by_user.start()
        set_by_user._follow_thread_count(2)
        assert sys.getswitchinterval() == pytest.approx(0.003)
        await set_by_user.drain(timeout=2.0)
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


async def test_hello_and_metrics_give_the_thread_count_in_use_after_the_engine_switches(make_server: Any) -> None:
    from fillmask_server.calibration import Calibration

    measured = Calibration(2, "calibration", {1: 1.0, 2: 0.5})  # as if the calibration had chosen 2 threads
    async with make_server(measured) as server:
        tuner = server.engine.core.threads
        assert tuner is not None and tuner.adaptive and tuner.candidates == [1, 2]

        async def threads_now() -> tuple[int, float]:
            async with session(server.url) as (_, hello):
                with await asyncio.to_thread(urllib.request.urlopen, server.http_url + "/metrics", timeout=5) as answer:
                    text = answer.read().decode()
            gauge = next(line for line in text.splitlines() if line.startswith("fillmask_torch_threads "))
            return hello["engine"]["torch_threads"], float(gauge.split()[1])

        assert await threads_now() == (2, 2.0)
        with server.engine._lock:
            tuner.current = 1  # what a switch does (tests/test_tuning.py)
        assert await threads_now() == (1, 1.0)  # a later hello is encoded again


async def test_automatic_batch_caps_come_from_the_calibration_and_hello_and_metrics_give_them(
        make_server: Any, tiny_config: Any) -> None:
    """--max-batch-size 0 --max-batch-tokens 0: the caps come from the start-up calibration's cost model
    (tests/test_batching.py has the rule). A calibration that found a GPU's launch-bound prices sets
    them at 8x the defaults, and batches that run later (this CPU's) change nothing. hello and /metrics
    give the caps, never 0. Caps the user set stay what they are, whatever the prices."""

    from fillmask_server.calibration import Calibration
    from fillmask_server.costmodel import Coefficients

    launch_bound = Coefficients(overhead_s=4.8e-3, token_s=1e-8, row_s=3.6e-5, byte_s=8e-8)

    async def caps_after_batches(server: FillMaskServer) -> tuple[tuple[int, int], tuple[int, int]]:
        """The caps in a new connection's hello and on /metrics, after a few batches."""
        before = answers_counted(server)
        async with session(server.url) as (ws, _):
            for n in range(8):
                assert (await request(ws, n, TEXTS[n % 3]))["type"] == "result"
            await assert_answered(server, before, 8, ws)
        async with session(server.url) as (_, hello):
            limits = hello["limits"]
        with await asyncio.to_thread(urllib.request.urlopen, server.http_url + "/metrics", timeout=5) as answer:
            text = answer.read().decode()
        gauges = {cap: int(float(line.split()[-1])) for cap in ("rows", "tokens")
                  for line in text.splitlines() if line.startswith(f'fillmask_batch_cap{{cap="{cap}"}}')}
        return (limits["max_batch_size"], limits["max_batch_tokens"]), (gauges["rows"], gauges["tokens"])

    for overrides, caps in (({"max_batch_size": 0, "max_batch_tokens": 0}, (512, 65536)),
                            ({}, (tiny_config.max_batch_size, tiny_config.max_batch_tokens))):
        async with make_server(Calibration(1, "flag", coefficients=launch_bound), **overrides) as server:
            assert await caps_after_batches(server) == (caps, caps)


# --- messages handled as they are read (FrontConnection.process_event) --------------------------------


def _refused(frame_id: str) -> str:
    """A request the session refuses at once (top_k 0), so its answer's place is the order of handling."""
    return orjson.dumps({"type": "fill_mask", "id": frame_id, "text": "a [MASK]", "top_k": 0}).decode()


async def test_messages_are_handled_in_the_order_they_were_read_whichever_way_they_go(make_server: Any) -> None:
    """A fragmented message goes through websockets' queue to the handler's ``recv``; whole messages read
    right behind it wait in that queue too, and once the handler has caught up they go straight to the
    session again. The frames leave in one write with nothing awaited in between (the server runs on
    this event loop), so the server reads them in one go: without the queue's count, the whole ones
    would be answered before the fragmented one."""
    async with make_server() as srv, session(srv.url) as (ws, _):
        first = _refused("fragmented")
        ws.protocol.send_text(first[:12].encode(), fin=False)
        ws.protocol.send_continuation(first[12:].encode(), fin=True)
        for i in range(5):
            ws.protocol.send_text(_refused(f"whole-{i}").encode())
        ws.send_data()
        answers = await recv_n(ws, 6)
        assert [a["id"] for a in answers] == ["fragmented"] + [f"whole-{i}" for i in range(5)]
        assert {a["type"] for a in answers} == {"error"}
        (conn,) = srv.connections
        assert conn.ws.queued == 0 and conn.ws.on_message is not None  # caught up: handled as read again
        await send(ws, {"type": "fill_mask", "id": "after", "text": "Paris is the [MASK] of France."})
        assert (await recv(ws))["id"] == "after"


async def test_a_message_in_more_than_4096_fragments_is_closed_with_1009_as_protocol_md_says(server: Any) -> None:
    """A fuzzing trial: 4,098 bytes in 4,097 fragments was closed with 1009 ("too many fragments", the
    WebSocket library's cap), which §1 did not say; 4,096 fragments are one message like any other."""
    frame = orjson.dumps({"type": "fill_mask", "id": "f", "text": "a [MASK] " + "b" * 8000}).decode()

    async def in_fragments(count: int) -> Any:
        async with session(server.url) as (ws, _):
            ws.protocol.send_text(frame[:1].encode(), fin=False)
            for i in range(1, count - 1):
                ws.protocol.send_continuation(frame[i:i + 1].encode(), fin=False)
            ws.protocol.send_continuation(frame[count - 1:].encode(), fin=True)
            ws.send_data()
            try:
                return await recv(ws)
            except ConnectionClosed:
                assert ws.close_code is not None
                return ws.close_code

    assert (await in_fragments(4096))["id"] == "f"
    assert await in_fragments(4097) == 1009


async def test_a_close_frame_inside_a_fragmented_message_is_answered_1002_as_protocol_md_says(
        make_server: Any) -> None:
    """An adversarial trial's find, now in §14: RFC 6455 allows a close frame between a message's
    fragments, but the WebSocket library under the server takes the unfinished message as broken and
    closes with 1002. The table said 1002 only for frames that break RFC 6455; this holds what it says
    now (and fails, so that §14 is mended, if the library ever echoes the close instead)."""
    async with make_server() as srv, session(srv.url) as (ws, _):
        ws.protocol.send_text(b'{"type":', fin=False)
        ws.protocol.send_close(1000)
        ws.send_data()
        await asyncio.wait_for(ws.wait_closed(), 10)
        assert ws.protocol.close_rcvd is not None and ws.protocol.close_rcvd.code == 1002
        assert ws.protocol.close_rcvd.reason == ("a close frame in the middle of a fragmented message: finish or "
                                                 "drop the message before closing")
        async with session(srv.url) as (other, _):  # the server goes on
            assert (await request(other, 1, "Paris is the [MASK] of France."))["type"] == "result"


async def test_the_closes_the_websocket_library_makes_give_their_reason_in_the_protocols_words(
        server: FillMaskServer) -> None:
    """§8: a frame over the limit, one that breaks RFC 6455, a message in too many fragments: the close
    reasons were the library's ("frame with 65537 bytes exceeds limit of 65536 bytes", "reserved bits
    must be 0"); they now say what was wrong, with the limit, and what to do."""
    limit = server.config.max_frame_bytes
    for write, code, reason in (
            (lambda ws: ws.protocol.send_text(b"x" * (limit + 1)), 1009,
             f"a message larger than limits.max_frame_bytes ({limit} bytes): send shorter texts"),
            (lambda ws: ws.transport.write(b"\xc1\x82\x00\x00\x00\x00{}"), 1002,  # (RSV1 set, masked by zeros)
             "a frame that breaks RFC 6455 (reserved bits must be 0): a bug in the client or its WebSocket library"),
            (lambda ws: [ws.protocol.send_text(b"{", fin=False), *(ws.protocol.send_continuation(b" ", fin=False)
                                                                     for _ in range(4100))], 1009,
             "a message in more than 4,096 fragments: send each message in fewer frames"),
            (lambda ws: ws.transport.write(b"\x88\x83\x00\x00\x00\x00\x03\xe8\xff"), 1007,  # (a close reason)
             "text that is not valid UTF-8 (invalid start byte at byte 0): send text messages and close reasons as "
             "UTF-8")):
        async with session(server.url) as (ws, _):
            write(ws)
            ws.send_data()
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.protocol.close_rcvd is not None, reason
            assert (ws.protocol.close_rcvd.code, ws.protocol.close_rcvd.reason) == (code, reason)


async def test_a_failure_handling_a_message_closes_that_connection_with_1011_and_no_other(
        make_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug while handling one message (here: the session raises) closes that connection with 1011,
    as websockets does for a failing handler, whichever way the message came; others are served."""
    from fillmask_server.session import Session

    receive = Session.receive

    def failing(self: Session, message: str | bytes) -> Any:
        if "explode" in str(message):
            raise RuntimeError("a bug")
        return receive(self, message)

    monkeypatch.setattr(Session, "receive", failing)
    async with make_server() as srv, session(srv.url) as (other, _):
        async with session(srv.url) as (ws, _):
            await send(ws, {"type": "fill_mask", "id": "explode", "text": "a [MASK]"})
            with pytest.raises(ConnectionClosed):
                await recv(ws)
            assert ws.close_code == 1011
        assert (await request(other, 1, "Paris is the [MASK] of France."))["type"] == "result"


async def test_a_congested_connections_messages_wait_and_keep_their_order(
        make_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a connection is congested (its client does not take its answers), nothing more it sends is
    handled, whichever way a message would go (a binary one through websockets' queue, a text one
    straight to the session); once it is uncongested, they are handled in the order they came."""
    from fillmask_server.session import Session

    handled: list[str] = []
    receive = Session.receive

    def recording(self: Session, message: str | bytes) -> Any:
        handled.append(message.decode(errors="replace") if isinstance(message, bytes) else message)
        return receive(self, message)

    monkeypatch.setattr(Session, "receive", recording)
    async with make_server() as srv, session(srv.url) as (ws, _):
        (conn,) = srv.connections
        conn.pending_bytes += srv.config.max_send_buffer_bytes + 1  # as if its answers were stuck
        conn._uncongested.clear()
        srv._on_congested(conn)
        await ws.send(_refused("text-1"))
        await ws.send(b'{"binary": 1}')
        await ws.send(_refused("text-2"))
        # The handler holds the first and waits; the other two wait in websockets' queue behind it.
        await wait_until(lambda: conn.ws.queued == 2)
        assert handled == []  # nothing handled while congested
        conn.pending_bytes -= srv.config.max_send_buffer_bytes + 1
        conn._uncongested.set()
        answers = await recv_n(ws, 3)
        assert handled == [_refused("text-1"), '{"binary": 1}', _refused("text-2")]
        assert [answers[0].get("id"), answers[2].get("id")] == ["text-1", "text-2"]
        await wait_until(lambda: conn.ws.on_message is not None)  # caught up: handled as read again
