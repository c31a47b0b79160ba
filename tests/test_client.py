"""The Python client and its command line (issue 5), against the real server on the tiny model.

Queued states are made deterministic with ``engine.paused()``; nothing is mocked on the wire. The
first tests are pure (frames, retry arithmetic, table layout) and need no server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import http.server
import inspect
import io
import itertools
import logging
import math
import os
import random
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from websockets.asyncio.server import serve

from fillmask_client import (
    ConnectError,
    ConnectionLostError,
    DeadlineExceededError,
    FillMaskClient,
    FillMaskError,
    FillMaskResult,
    OverloadedError,
    ReconnectBackoff,
    RequestError,
    RetryPolicy,
    SyncFillMaskClient,
    UsageError,
)
from fillmask_client.async_client import AHEAD
from fillmask_client.cli import BadInput, build_parser, collect_texts, format_table, parse_targets
from fillmask_client.frames import encode_fill_mask, outcome, terminal_id
from fillmask_client.pool import least_loaded
from fillmask_client.state import ConnState, Event, transition
from tests.test_hardening_clients import sample
from tests.wire import assert_same_predictions, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Paris is the [MASK] of France."
TWO_MASKS = "The [MASK] of France is [MASK]."



@pytest.fixture
def client_warnings(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The client's warnings so far: a terminal frame for an id not in flight (answered twice, or routed
    wrongly), or a server error tied to no request. Call it at the end of the test."""
    caplog.set_level(logging.WARNING, logger="fillmask_client")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name.startswith("fillmask_client") and r.levelno >= logging.WARNING]

    return warnings


# --- pure: frames, retry arithmetic, table -------------------------------------------------------


def test_terminal_frames_map_to_results_and_typed_errors() -> None:
    one = {"score": 0.5, "token": 7, "token_str": "capital", "sequence": "paris is the capital of france."}
    result = outcome({"type": "result", "id": 1, "predictions": [one], "queue_ms": 1.0, "inference_ms": 2.0,
                      "batch_size": 3, "batch_tokens": 12})
    assert isinstance(result, FillMaskResult) and (result.queue_ms, result.batch_size) == (1.0, 3)
    error = outcome({"type": "error", "id": 1, "code": "no_mask", "message": "put [MASK] in"})
    assert type(error) is RequestError and (error.code, error.message) == ("no_mask", "put [MASK] in")
    busy = outcome({"type": "overloaded", "id": 1, "status": 503, "reason": "queue_full", "retry_after_ms": 120})
    assert type(busy) is OverloadedError and (busy.status, busy.reason, busy.retry_after_ms) == (503, "queue_full", 120)
    late = outcome({"type": "overloaded", "id": 1, "status": 504, "reason": "deadline_exceeded",
                    "retry_after_ms": 10, "queue_ms": 51.5})
    assert type(late) is DeadlineExceededError and isinstance(late, OverloadedError)
    assert (late.status, late.queue_ms, late.retry_after_ms) == (504, 51.5, 10)
    assert type(outcome({"type": "cancelled", "id": 1})) is FillMaskError
    assert str(busy) == "server overloaded (503 queue_full, retry after 120 ms)"
    # A drain or a stopped worker comes as `overloaded` (§6), but the words say what it is.
    going = outcome({"type": "overloaded", "id": 1, "status": 503, "reason": "shutting_down", "retry_after_ms": 1000})
    assert str(going) == "server shutting down (503 shutting_down, retry after 1000 ms)"
    stopped = outcome({"type": "overloaded", "id": 1, "status": 503, "reason": "engine_stopped"})
    assert str(stopped) == "the server's model worker stopped (503 engine_stopped)"


def test_only_our_ids_on_terminal_frames_end_a_request() -> None:
    assert terminal_id({"type": "result", "id": 7}) == 7
    assert terminal_id({"type": "error", "id": 7, "code": "no_mask"}) == 7
    # §7: duplicate_id is about the rejected frame; the request in flight keeps waiting for its own answer.
    assert terminal_id({"type": "error", "id": 7, "code": "duplicate_id"}) is None
    assert terminal_id({"type": "error", "id": None, "code": "invalid_json"}) is None
    assert terminal_id({"type": "result", "id": True}) is None  # True == 1, but it is not our id 1
    assert terminal_id({"type": "hello", "id": 7}) is None


def test_retry_delay_never_undercuts_retry_after_and_doubles_up_to_the_cap() -> None:
    policy = RetryPolicy(base_delay=0.1, max_delay=0.4, jitter=0.5)
    assert [policy.delay(n, None, rand=lambda: 0.0) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.4, 0.4]
    assert policy.delay(1, 2500, rand=lambda: 0.0) == 2.5  # the server's hint beats max_delay
    assert policy.delay(3, 50, rand=lambda: 0.0) == 0.4  # and the client's own backoff beats a small hint
    assert policy.delay(1, 1000, rand=lambda: 1.0) == 1.5  # jitter only lengthens
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


def test_table_has_one_block_per_mask() -> None:
    def candidate(word: str, score: float) -> dict[str, Any]:
        return {"score": score, "token": 1, "token_str": word, "sequence": f"the {word}."}

    frame = {"type": "result", "id": 1, "predictions": [[candidate("capital", 0.5), candidate("heart", 0.25)],
                                                         [candidate("paris", 0.125), candidate("lyon", 2.03e-05)]]}
    result = outcome(frame)
    assert isinstance(result, FillMaskResult)
    assert format_table(TWO_MASKS, result).splitlines() == [
        TWO_MASKS,
        "mask 1 of 2",
        "rank  token     score  sequence",
        "   1  capital  0.5000  the capital.",
        "   2  heart    0.2500  the heart.",
        "mask 2 of 2",
        "rank  token     score  sequence",
        "   1  paris    0.1250  the paris.",
        "   2  lyon   2.03e-05  the lyon.",  # too small for four decimals: not 0.0000, and still aligned
    ]


def test_cli_reads_arguments_stdin_and_file_in_order(tmp_path: Path) -> None:
    import io

    listing = tmp_path / "texts.txt"
    listing.write_text("from [MASK] file\n\n  \nsecond [MASK]\n", encoding="utf-8")
    args = build_parser().parse_args(["first [MASK]", "-", "--file", str(listing)])
    got = collect_texts(args, io.StringIO("stdin [MASK]\n\n"))
    assert got == ["first [MASK]", "stdin [MASK]", "from [MASK] file", "second [MASK]"]
    assert collect_texts(build_parser().parse_args([]), io.StringIO("only [MASK]\n")) == ["only [MASK]"]
    assert parse_targets(["capital, heart", "city"]) == ["capital", "heart", "city"]


BAD_URLS = {  # each URL, and what the message says is wrong with it
    "ws://127.0.0.1:99999/": "port out of range",
    "ws://[::1/": "invalid IPv6 URL",
    "ws://": "hostname isn't provided",
    "ws://:8765/": "hostname isn't provided",
    "ws://host:http/": "the port 'http' is not a number",  # (urllib's words: "port could not be cast...")
    "ws://127.0.0.1:1:2/": "the port '1:2' is not a number (an IPv6 address goes in brackets",
    "ftp://127.0.0.1:8765/": "scheme isn't ws or wss",
}


def test_a_malformed_url_is_a_usage_error_at_construction() -> None:
    for url, what in BAD_URLS.items():
        for make in (FillMaskClient, SyncFillMaskClient):  # the sync one refuses it before starting its thread
            with pytest.raises(UsageError) as refused:
                make(url)
            assert isinstance(refused.value, FillMaskError) and isinstance(refused.value, ValueError)
            message = str(refused.value)
            assert what in message and repr(url) in message and "expected ws://HOST:PORT/" in message, message
        with pytest.raises(UsageError):  # one bad URL in a list is enough
            FillMaskClient(["ws://127.0.0.1:8765/", url])
    for hidden in ("?token=sesame", "?a=1&tok%65n=sesame", "?TOKEN=sesame"):  # (the server decodes the name)
        with pytest.raises(UsageError) as refused:
            FillMaskClient(f"ws://127.0.0.1:99999/{hidden}")
        assert "sesame" not in str(refused.value)  # the token stays hidden (§12)
    # The address the server prints for its demo page: the message gives the WebSocket URL to use instead.
    for url, instead in (("http://127.0.0.1:8765/", "'ws://127.0.0.1:8765/'"),
                         ("HTTPS://h:1/healthz?token=sesame", "'wss://h:1/?token=***'"),  # the path of the WebSocket
                         ("http://h:8765", "'ws://h:8765/'"), ("http://h:8765/ws", "'ws://h:8765/ws'")):
        with pytest.raises(UsageError) as refused:
            FillMaskClient(url)
        assert "scheme isn't ws or wss" in str(refused.value) and str(refused.value).endswith(
            f"the same server's WebSocket URL is {instead}"), refused.value
    for url in ("http://h:99999/", "http://"):  # no valid URL to suggest: the general form instead
        with pytest.raises(UsageError, match="expected ws://HOST:PORT/ or wss://HOST:PORT/"):
            FillMaskClient(url)


#: What a typed program does with the client, checked by mypy --strict beside the README's example.
TYPED_USES = """
import contextlib

from fillmask_client import FillMaskClient, FillMaskError, FillMaskResult, Prediction, Predictions, SyncFillMaskClient


async def each(client: FillMaskClient) -> list[list[Prediction]]:
    found = []
    async with contextlib.aclosing(client.fill_mask_iter(["A [MASK]."])) as outcomes:  # (its docstring's advice)
        async for outcome in outcomes:
            if isinstance(outcome, FillMaskResult):
                found.append(outcome.per_mask()[0])
    return found


def blocking(client: SyncFillMaskClient, keep: bool) -> list[Predictions]:
    strict: list[Predictions] = client.fill_mask_many(["A [MASK]."])  # no FillMaskError in it
    loose = client.fill_mask_many(["A [MASK]."], return_exceptions=keep)  # a bool: either list
    return strict + [p for p in loose if not isinstance(p, FillMaskError)]
"""


def test_the_package_and_the_readmes_example_pass_mypy_strict(tmp_path: Path) -> None:
    """The package says it is typed (``py.typed``). A trial found eleven errors in it under ``mypy
    --strict``, the README's first example failing it (it indexed the union ``fill_mask`` returns),
    ``contextlib.aclosing(client.fill_mask_iter(...))`` refused (typed ``AsyncIterator``, which has no
    ``aclose``), and the blocking ``fill_mask_many`` typed with ``FillMaskError`` in every list."""
    section = (ROOT / "README.md").read_text().split("## Python client and command line", 1)[1]
    (tmp_path / "readme_example.py").write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    (tmp_path / "uses.py").write_text(TYPED_USES)
    testing = (ROOT / "README.md").read_text().split("### Testing your application against a real server", 1)[1]
    fixture, test = (block.split("```", 1)[0] for block in testing.split("```python\n")[1:3])
    (tmp_path / "app_tests").mkdir()  # (the README's example of testing an application: typed too)
    (tmp_path / "app_tests" / "conftest.py").write_text(fixture)
    (tmp_path / "app_tests" / "test_app.py").write_text(test)
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         str(ROOT / "clients" / "python" / "fillmask_client"), "readme_example.py", "uses.py", "app_tests"],
        cwd=tmp_path, env={**os.environ, "MYPYPATH": str(ROOT / "clients" / "python")},
        capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_options_of_the_wrong_kind_are_usage_errors_at_construction() -> None:
    """A trial: ``retry=3`` was taken, then every call raised ``AttributeError`` at the server's first 503;
    ``backoff=5`` at the first redial; ``reconnect="false"`` turned reconnecting on; ``ssl=`` with a
    ws:// URL failed only when connecting. Each is refused when the client is made, by both clients."""
    url, context = "ws://127.0.0.1:8765/", ssl.create_default_context()
    refusals = [
        ({"retry": 3}, "retry must be True, False or a RetryPolicy, not 3: for 3 tries, RetryPolicy(attempts=3)"),
        ({"retry": "yes"}, "retry must be True, False or a RetryPolicy, not 'yes'"),
        ({"retry": 0.5}, "not 0.5"),
        ({"reconnect": "false"}, "reconnect must be True or False, not 'false'"),
        ({"reconnect": 1}, "not 1"),
        ({"backoff": 5}, "backoff must be a ReconnectBackoff or None, not 5"),
        ({"ssl": context}, "ssl= is for wss:// URLs, and 'ws://127.0.0.1:8765/' is ws://"),
        ({"ssl": "cert.pem"}, "ssl must be an ssl.SSLContext or None, not 'cert.pem'"),
        # (a billion connections' slots took all memory before any socket opened: a fuzz of the command's flags)
        ({"connections": 10**9}, "connections must be at most 1024 per URL, not 1000000000"),
    ]
    for options, words in refusals:
        for make in (FillMaskClient, SyncFillMaskClient):
            with pytest.raises(UsageError) as refused:
                make(url, **options)
            assert words in str(refused.value), refused.value
    with pytest.raises(UsageError, match=r"is ws://"):  # one plain URL in a list is enough
        FillMaskClient(["wss://h:1/", url], ssl=context)
    for attempts in ("3", True, 0, 2.5):
        refusal = rf"RetryPolicy\.attempts must be an integer of at least 1, not {attempts!r}"
        with pytest.raises(UsageError, match=refusal):
            RetryPolicy(attempts=attempts)  # type: ignore[arg-type]
    made = FillMaskClient("wss://h:1/", ssl=context, retry=RetryPolicy(attempts=3), reconnect=True,
                          backoff=ReconnectBackoff(cap=1.0))
    assert made.retry == RetryPolicy(attempts=3) and made.reconnect


def test_durations_refuse_nan_and_infinity() -> None:
    url = "ws://127.0.0.1:8765/"
    for bad in (math.nan, math.inf, -math.inf, -1.0):
        with pytest.raises(UsageError, match="open_timeout must be a finite number of seconds > 0"):
            FillMaskClient(url, open_timeout=bad)
        with pytest.raises(UsageError, match="reconnect_timeout must be a finite number of seconds >= 0"):
            FillMaskClient(url, reconnect_timeout=bad)
        with pytest.raises(UsageError):
            RetryPolicy(base_delay=bad)
        with pytest.raises(UsageError):
            RetryPolicy(max_delay=bad)
        with pytest.raises(UsageError):
            ReconnectBackoff(cap=bad)
    with pytest.raises(UsageError):
        FillMaskClient(url, open_timeout=0)  # a handshake cannot take 0 s

    async def connect(wait: float) -> None:
        await asyncio.wait_for(FillMaskClient(f"ws://127.0.0.1:{free_port()}/").connect(wait=wait), 5)

    for bad in (math.nan, math.inf):  # NaN used to retry forever: every `remaining <= 0` was false
        with pytest.raises(UsageError, match="wait must be a finite number of seconds"):
            asyncio.run(connect(bad))


def test_values_json_cannot_carry_are_refused_not_sent_as_something_else() -> None:
    assert orjson.loads(encode_fill_mask(1, TEXT, top_k=2, targets=["a"], deadline_ms=2.5)) == {
        "type": "fill_mask", "id": 1, "text": TEXT, "top_k": 2, "targets": ["a"], "deadline_ms": 2.5}
    # What the server judges is sent as given (it answers invalid_top_k, invalid_deadline: §3).
    assert orjson.loads(encode_fill_mask(1, TEXT, top_k=0, deadline_ms=-5))["deadline_ms"] == -5
    cases = [
        ({"text": "\ud800 [MASK]"}, r"text is not valid Unicode: .*lone surrogate '\\ud800' at character 0"),
        ({"text": TEXT, "targets": "\udcff"}, "targets is not valid Unicode"),
        ({"text": TEXT, "targets": ["ok", "x\udcff"]}, r"targets\[1\] is not valid Unicode: .* at character 1"),
        ({"text": TEXT, "deadline_ms": math.nan}, "deadline_ms=nan is not a finite number"),
        ({"text": TEXT, "deadline_ms": math.inf}, "deadline_ms=inf is not a finite number"),
        ({"text": TEXT, "top_k": math.nan}, "top_k=nan is not a finite number"),
        ({"text": TEXT, "top_k": 2**70}, "top_k=1180591620717411303424 is beyond 64 bits"),  # orjson: TypeError
        ({"text": TEXT, "deadline_ms": -(2**70)}, "deadline_ms=-1180591620717411303424 is beyond 64 bits"),
        ({"text": TEXT.encode()}, "text must be a str, not bytes"),  # orjson: TypeError
        ({"text": TEXT, "targets": [b"capital"]}, r"targets\[0\] must be a str, not bytes"),
        ({"text": 123}, "text must be a str, not int"),  # the server would answer invalid_field: same news
        ({"text": None}, "text must be a str, not NoneType"),
    ]
    for fields, message in cases:
        with pytest.raises(UsageError, match=message):  # orjson: TypeError for the first, `null` for NaN
            encode_fill_mask(1, **fields)


async def test_a_call_with_values_json_cannot_carry_fails_alone_before_sending(server: Any) -> None:
    async with FillMaskClient(server.url) as client:
        for fields in ({"text": "\ud800 [MASK]"}, {"text": TEXT, "deadline_ms": math.nan},
                       {"text": TEXT, "deadline_ms": math.inf}, {"text": TEXT, "targets": ["\udcff"]}):
            with pytest.raises(UsageError):
                await client.fill_mask(**fields)
            assert client.in_flight == 0  # nothing was sent
        outcomes = await client.fill_mask_many([TEXT, "\ud800 [MASK]", TEXT], top_k=1, return_exceptions=True)
        assert isinstance(outcomes[1], UsageError) and len(outcomes[0]) == len(outcomes[2]) == 1
        outcomes = await client.fill_mask_many([TEXT, TEXT.encode()], top_k=1, return_exceptions=True)  # type: ignore[list-item]
        assert len(outcomes[0]) == 1 and isinstance(outcomes[1], UsageError)  # one bad value, not the whole batch
        with pytest.raises(UsageError, match="not one text"):
            await client.fill_mask_many(TEXT)  # would be one request per character

        async def texts_as_they_come() -> AsyncIterator[str]:
            yield TEXT

        # A pytest trial: these raised TypeError ("not iterable"), outside the FillMaskError family.
        for texts, said in ((None, "not NoneType"), (3, "not int"), (texts_as_they_come(), "not an async iterable")):
            with pytest.raises(UsageError, match=said):
                await client.fill_mask_many(texts)  # type: ignore[arg-type]
            with pytest.raises(UsageError, match=said):
                await anext(client.fill_mask_iter(texts))  # type: ignore[arg-type]

        class OldStyle:  # a sequence by __getitem__ alone, which iter() and list() take (a review)
            def __getitem__(self, index: int) -> str:
                if index < 2:
                    return TEXT
                raise IndexError(index)

        assert len(await client.fill_mask_many(OldStyle(), top_k=1)) == 2  # type: ignore[arg-type]
        for width in (0, True, 1.5):
            with pytest.raises(UsageError, match="concurrency must be a positive integer"):
                await client.fill_mask_many([TEXT], concurrency=width)  # type: ignore[arg-type]
        assert await client.fill_mask(TEXT, top_k=1)  # the connection is as good as before

    def use() -> None:  # in a thread: the server runs on this test's event loop
        with SyncFillMaskClient(server.url) as sync:
            for bad in (math.nan, math.inf, -1.0):
                with pytest.raises(UsageError, match="timeout must be a finite number of seconds"):
                    sync.fill_mask(TEXT, timeout=bad)
                assert sync._client.in_flight == 0  # refused before the call was handed to the loop
            assert sync.fill_mask(TEXT, top_k=1, timeout=30)
            for forever in (1e10, 1e300):  # past threading.TIMEOUT_MAX: no limit (a trial: OverflowError,
                assert sync.fill_mask(TEXT, top_k=1, timeout=forever)  # with the request left running)
            with pytest.raises(UsageError, match="not one text"):  # listed, it went as one request per character
                sync.fill_mask_many(TEXT)
            with pytest.raises(UsageError, match="not NoneType"):  # (a review: a TypeError in the blocking one)
                sync.fill_mask_many(None)  # type: ignore[arg-type]
            assert sync._client.in_flight == 0

    await asyncio.to_thread(use)


# --- against the server -------------------------------------------------------------------------


async def test_hello_is_exposed(server: Any) -> None:
    async with FillMaskClient(server.url) as client:
        assert client.hello["type"] == "hello" and client.hello["protocol"] == 1
        assert client.model == "tiny"
        assert client.mask_token == "[MASK]"
        assert client.limits["max_queue"] == server.config.max_queue
        assert client.in_flight == 0


async def test_200_concurrent_calls_on_one_client_each_get_their_own_answer(
    server: Any, reference_pipeline: Any, client_warnings: Callable[[], list[str]]
) -> None:
    # 10 texts x 20 top_k values: every call asks something different, so an answer routed to the wrong
    # caller shows as a wrong text or length, not just a wrong score. The server answers in queue order,
    # which would hide a client that matched answers by order; 20 invalid calls mixed in are answered at
    # once, ahead of the queued ones, so only matching by id gets every answer to its caller.
    texts = [f"Item {n} is the [MASK] of France." for n in range(9)] + [TWO_MASKS]
    reference = {text: reference_pipeline(text, top_k=20) for text in texts}
    calls = [(text, top_k) for text in texts for top_k in range(1, 21)]
    random.Random(5).shuffle(calls)
    for n in range(20):
        calls.insert(n * 11, (texts[n % 10], 0))  # top_k 0: an `invalid_top_k` error
    async with FillMaskClient(server.url) as client:
        with server.engine.paused():
            tasks = [asyncio.create_task(client.fill_mask(text, top_k=k)) for text, k in calls]
            # All 200 valid calls wait on the one socket at once; the 20 errors came back ahead of them.
            await wait_until(lambda: server.engine.runnable() == 200 and client.in_flight == 200
                             and sum(task.done() for task in tasks) == 20)
        answers = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert client.in_flight == 0
    assert len(answers) == 220
    for (text, top_k), got in zip(calls, answers, strict=True):
        if top_k == 0:
            assert isinstance(got, RequestError) and got.code == "invalid_top_k", got
            continue
        assert not isinstance(got, BaseException), got
        expected = reference[text]
        if text == TWO_MASKS:
            assert_same_predictions(got, [per_mask[:top_k] for per_mask in expected])
        else:
            assert_same_predictions(got, expected[:top_k])
    assert not client_warnings()


@pytest.mark.parametrize("how", ["task.cancel", "asyncio.timeout"])
async def test_cancelling_a_call_removes_it_from_the_server_queue(
    server: Any, how: str, client_warnings: Callable[[], list[str]]
) -> None:
    async with FillMaskClient(server.url) as client:
        rows_before = server.engine.stats.rows
        with server.engine.paused():
            if how == "task.cancel":
                call = asyncio.create_task(client.fill_mask(TEXT))
                await wait_until(lambda: server.engine.queued() == 1)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            else:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await client.fill_mask(TEXT)
            # The client keeps the id until its terminal frame (`cancelled`) arrives and is consumed,
            # all on the open connection: the server dropped the job because of the cancel frame.
            await wait_until(lambda: server.engine.queued() == 0 and client.in_flight == 0)
        assert await client.fill_mask(TEXT, top_k=1)  # the connection is still good
        assert server.engine.stats.rows == rows_before + 1  # only that last call reached the model
    assert not client_warnings()


async def test_cancel_after_the_batch_started_still_consumes_the_result(
    server: Any, client_warnings: Callable[[], list[str]]
) -> None:
    async with FillMaskClient(server.url) as client:
        rows_before = server.engine.stats.rows
        with server.engine.paused():
            call = asyncio.create_task(client.fill_mask(TEXT))
            await wait_until(lambda: server.engine.queued() == 1)
        # No await from here to call.cancel(): the loop (which also runs the server) stands still, so the
        # result the engine has produced cannot reach the client before the cancel does.
        give_up = time.monotonic() + 5
        while server.engine.stats.rows == rows_before and time.monotonic() < give_up:
            time.sleep(0.001)
        assert server.engine.stats.rows == rows_before + 1, "the batch never ran"
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await wait_until(lambda: client.in_flight == 0)  # the late `result` was read and dropped
        assert await client.fill_mask(TEXT, top_k=1)
    assert not client_warnings()


async def test_request_errors_carry_the_server_code_and_message(server: Any) -> None:
    async with FillMaskClient(server.url) as client:
        with pytest.raises(RequestError) as no_mask:
            await client.fill_mask("There is no mask here.")
        assert no_mask.value.code == "no_mask" and no_mask.value.message
        assert no_mask.value.frame is not None and no_mask.value.frame["type"] == "error"
        with pytest.raises(RequestError) as bad_top_k:
            await client.fill_mask(TEXT, top_k=0)
        assert bad_top_k.value.code == "invalid_top_k"
        # A frame over max_frame_bytes would make the server close the connection (1009) and fail every
        # call on it; the client refuses it locally instead and the connection lives on.
        huge = TEXT + " word" * (client.limits["max_frame_bytes"] // 5)
        with pytest.raises(RequestError) as too_big:
            await client.fill_mask(huge)
        assert too_big.value.code == "frame_too_large" and too_big.value.frame is None
        assert await client.fill_mask(TEXT, top_k=1)
        assert client.in_flight == 0


async def test_deadline_expiry_raises_deadline_exceeded(server: Any) -> None:
    async with FillMaskClient(server.url) as client:
        with server.engine.paused(), pytest.raises(DeadlineExceededError) as late:
            await asyncio.wait_for(client.fill_mask(TEXT, deadline_ms=30), 3)
        assert isinstance(late.value, OverloadedError) and late.value.status == 504
        assert late.value.queue_ms is not None and late.value.queue_ms >= 30


async def test_queue_full_raises_overloaded_without_retry(make_server: Any) -> None:
    async with make_server(max_queue=1) as srv, FillMaskClient(srv.url) as client:
        with srv.engine.paused():
            first = asyncio.create_task(client.fill_mask(TEXT))
            await wait_until(lambda: srv.engine.queued() == 1)
            with pytest.raises(OverloadedError) as busy:
                await client.fill_mask(TEXT)
        assert (busy.value.status, busy.value.reason) == (503, "queue_full")
        assert isinstance(busy.value.retry_after_ms, int) and busy.value.retry_after_ms > 0
        # What to do, as a note in the traceback (a newcomer's trial: the command line said it, the
        # library did not); str() stays §6's words.
        assert str(busy.value).startswith("server overloaded (503 queue_full")
        assert busy.value.__notes__ == ["the server was busy: send fewer requests at once (a lower concurrency), "
                                        "or let the client wait and resend (retry=True)"]
        assert await first


async def test_retry_on_overload_waits_at_least_retry_after(make_server: Any) -> None:
    records: list[tuple[float, float | None, float]] = []  # (when asked, server's retry_after_ms, chosen wait)

    class Recording(RetryPolicy):
        def delay(self, attempt: int, retry_after_ms: float | None, rand: Callable[[], float] = random.random) -> float:
            wait = super().delay(attempt, retry_after_ms, rand)
            records.append((time.monotonic(), retry_after_ms, wait))
            return wait

    async with make_server(max_queue=1) as srv, FillMaskClient(srv.url) as blocker:
        # Gives up: 3 tries in all, so exactly 2 waits, then the last 503 is raised.
        async with FillMaskClient(srv.url, retry=Recording(attempts=3, base_delay=0.001)) as client:
            with srv.engine.paused():
                held = asyncio.create_task(blocker.fill_mask(TEXT))
                await wait_until(lambda: srv.engine.queued() == 1)
                with pytest.raises(OverloadedError) as busy:
                    await client.fill_mask(TEXT)
            assert busy.value.reason == "queue_full" and len(records) == 2
            await held
        records.clear()
        # Succeeds: keeps resending while the queue is held full, gets through once it is released.
        async with FillMaskClient(srv.url, retry=Recording(attempts=100, base_delay=0.001)) as client:
            with srv.engine.paused():
                held = asyncio.create_task(blocker.fill_mask(TEXT))
                await wait_until(lambda: srv.engine.queued() == 1)
                call = asyncio.create_task(client.fill_mask(TEXT, top_k=2))
                await wait_until(lambda: len(records) >= 3)
            assert len(await asyncio.wait_for(call, 5)) == 2
            await held
    for (asked, retry_after_ms, wait), (next_asked, _, _) in itertools.pairwise(records):
        assert retry_after_ms is not None and wait >= retry_after_ms / 1000 > 0.001  # the hint, not the backoff
        assert next_asked - asked >= wait - 0.001  # and the client really waited that long before resending


async def test_calls_on_one_connection_all_wait_out_its_back_off_so_retry_is_never_early(make_server: Any) -> None:
    """§6 counts a refusal as early per connection: a resend, or any other call's send, that arrives
    before the retry_after_ms the connection was last told. So after a 503/429 the client holds every
    call on that connection until then, not only the refused one: many concurrent calls with retry
    are never early, their wait is not doubled, and they are never closed with 1008."""
    async with make_server(max_queue=4) as srv, FillMaskClient(
            srv.url, retry=RetryPolicy(attempts=10_000, base_delay=0.001, max_delay=0.01)) as client:
        (conn,) = srv.connections
        with srv.engine.paused():
            calls = [asyncio.create_task(client.fill_mask(TEXT, top_k=1)) for _ in range(40)]
            await wait_until(lambda: srv.engine.queued() == 2)  # its share of a busy queue of 4
            refused = sample(srv, "fillmask_requests_total", outcome="overloaded", code="queue_share")
            await wait_until(lambda: sample(srv, "fillmask_requests_total", outcome="overloaded",
                                            code="queue_share") >= refused + 120)  # several rounds of refusals
            assert not conn.session._early
        assert all(len(answer) == 1 for answer in await asyncio.wait_for(asyncio.gather(*calls), 30))
        assert sample(srv, "fillmask_resenders_closed_total") == 0


async def test_retry_gives_up_within_the_callers_deadline(make_server: Any) -> None:
    async with make_server(max_queue=1) as srv, FillMaskClient(srv.url) as blocker, \
            FillMaskClient(srv.url, retry=RetryPolicy(attempts=1000, base_delay=0.2, jitter=0)) as client:
        with srv.engine.paused():
            held = asyncio.create_task(blocker.fill_mask(TEXT))
            await wait_until(lambda: srv.engine.queued() == 1)
            started = time.monotonic()
            with pytest.raises(OverloadedError) as busy:
                await asyncio.wait_for(client.fill_mask(TEXT, deadline_ms=300), 2)
            # Tried at 0 and after 0.2 s; the next wait (0.4 s) would pass the deadline, so it gives up
            # at once rather than sleeping into it (that would end near 0.6 s).
            assert 0.2 <= time.monotonic() - started < 0.55 and busy.value.reason == "queue_full"
        await held


async def test_connection_loss_fails_pending_calls_promptly(make_server: Any) -> None:
    async with make_server() as srv, FillMaskClient(srv.url) as client:
        with srv.engine.paused():
            calls = [asyncio.create_task(client.fill_mask(TEXT)) for _ in range(3)]
            await wait_until(lambda: srv.engine.queued() == 3)
            lost_at = time.monotonic()
            for conn in list(srv.connections):
                conn.ws.transport.abort()  # the TCP connection drops, no close frame
            outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 2)
        assert time.monotonic() - lost_at < 1.0
        assert all(type(error) is ConnectionLostError for error in outcomes), outcomes
        assert outcomes[0].code == 1006
        assert client.in_flight == 0
        with pytest.raises(ConnectionLostError):  # later calls fail at once instead of hanging
            await asyncio.wait_for(client.fill_mask(TEXT), 1)


async def test_unreachable_server_raises_connect_error() -> None:
    url = f"ws://127.0.0.1:{free_port()}/"
    with pytest.raises(ConnectError) as refused:
        await asyncio.wait_for(FillMaskClient(url, open_timeout=2).connect(), 3)
    assert isinstance(refused.value, ConnectionLostError) and url in str(refused.value)


async def test_reconnects_after_the_server_restarts_with_1001(make_server: Any) -> None:
    async with make_server() as first_server:
        port = first_server.port
        steady = FillMaskClient(first_server.url, reconnect=True, reconnect_timeout=15)
        plain = FillMaskClient(first_server.url)
        await steady.connect()
        await plain.connect()
        before = await steady.fill_mask(TEXT)
    # The server drained and closed both connections with 1001 (§10).
    with pytest.raises(ConnectionLostError) as lost:
        await plain.fill_mask(TEXT)
    assert lost.value.code == 1001
    call = asyncio.create_task(steady.fill_mask(TEXT))  # keeps redialling while nothing listens
    await asyncio.sleep(0.1)
    assert not call.done()
    async with make_server(port=port):
        after = await asyncio.wait_for(call, 10)
        assert_same_predictions(after, before)
        await steady.aclose()
    await plain.aclose()


async def test_reconnect_resends_calls_cut_off_by_a_1012_close(make_server: Any) -> None:
    async with make_server() as srv, FillMaskClient(srv.url, reconnect=True) as steady, \
            FillMaskClient(srv.url) as plain:
        with srv.engine.paused():
            resent = [asyncio.create_task(steady.fill_mask(TEXT, top_k=k)) for k in (1, 2)]
            dropped = asyncio.create_task(plain.fill_mask(TEXT))
            await wait_until(lambda: srv.engine.queued() == 3)
            for conn in list(srv.connections):  # a restart the server could not drain: 1012, jobs discarded
                await conn.ws.close(1012, "service restart")
            with pytest.raises(ConnectionLostError) as lost:
                await asyncio.wait_for(dropped, 2)
            assert lost.value.code == 1012
            await wait_until(lambda: srv.engine.queued() == 2)  # resent on a new connection
        first, second = await asyncio.wait_for(asyncio.gather(*resent), 5)
        assert (len(first), len(second)) == (1, 2)


async def test_reconnect_follows_a_shutting_down_answer_to_the_next_server(make_server: Any) -> None:
    async with make_server() as srv:
        port = srv.port
        async with FillMaskClient(srv.url) as holder, FillMaskClient(srv.url) as plain, \
                FillMaskClient(srv.url, reconnect=True, reconnect_timeout=15) as steady:
            with srv.engine.paused():
                held = asyncio.create_task(holder.fill_mask(TEXT))
                await wait_until(lambda: srv.engine.queued() == 1)
                drain = asyncio.create_task(srv.drain(timeout=5))  # waits for `held`, refuses new work (§10)
                await wait_until(lambda: srv.ready.draining)
                with pytest.raises(OverloadedError) as refused:
                    await plain.fill_mask(TEXT)
                assert (refused.value.status, refused.value.reason) == (503, "shutting_down")
                call = asyncio.create_task(steady.fill_mask(TEXT, top_k=2))
                await asyncio.sleep(0.1)
                assert not call.done()  # answered shutting_down, now redialling (refused 503 while draining)
            await asyncio.wait_for(held, 5)
            await asyncio.wait_for(drain, 5)
            assert not call.done()
            async with make_server(port=port):
                assert len(await asyncio.wait_for(call, 10)) == 2


async def test_calls_waiting_to_redial_survive_a_server_that_drains_during_the_dial(make_server: Any) -> None:
    # Issue 9 item 8: several calls lose their connection (the server drains, §10) and queue up to redial
    # behind one of them. The server reached by that redial drains too before the others get their turn,
    # so each of them finds the fresh connection gone as well. They must dial again, not wait forever on
    # the dial lock they already hold (an asyncio.Lock is not reentrant).
    drain_during_dial: list[Any] = []

    class DrainsDuringTheDial(FillMaskClient):
        async def _open(self, *args: Any, **kwargs: Any) -> Any:
            conn = await super()._open(*args, **kwargs)
            if drain_during_dial:  # the server just dialled drains while the other calls wait for this dial
                await drain_during_dial.pop().drain(timeout=2)
                await wait_until(lambda: conn.lost is not None)
            return conn

    async with make_server() as first:
        port = first.port
        client = DrainsDuringTheDial(first.url, reconnect=True, reconnect_timeout=10)
        await client.connect()
        assert len(await client.fill_mask(TEXT, top_k=1)) == 1
    # The first server drained: the connection is gone (1001); every call now needs a fresh one.
    calls = [asyncio.create_task(client.fill_mask(TEXT, top_k=k)) for k in (1, 2, 3, 4, 5)]
    try:
        async with make_server(port=port) as second:
            drain_during_dial.append(second)
            await wait_until(lambda: not drain_during_dial)
        async with make_server(port=port):
            answers = await asyncio.wait_for(asyncio.gather(*calls), 10)
            assert [len(answer) for answer in answers] == [1, 2, 3, 4, 5]
    finally:
        for call in calls:
            call.cancel()
        await client.aclose()


async def test_calls_beyond_the_per_connection_limit_wait_in_the_client(make_server: Any) -> None:
    async with make_server(max_inflight_per_connection=4) as srv, FillMaskClient(srv.url) as client:
        assert client.limits["max_inflight_per_connection"] == 4
        with srv.engine.paused():
            calls = [asyncio.create_task(client.fill_mask(TEXT, top_k=1)) for _ in range(10)]
            await wait_until(lambda: srv.engine.queued() == 4)
            await asyncio.sleep(0.05)  # time enough for a fifth request, were one to be sent
            assert srv.engine.queued() == 4 and client.in_flight == 4
        # Nobody was refused with `too_many_inflight`: the six that waited went out as places freed.
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
        assert all(isinstance(answer, list) and len(answer) == 1 for answer in outcomes), outcomes
        assert client.in_flight == 0


async def test_engine_stopped_is_not_retried_but_followed_by_reconnect(make_server: Any) -> None:
    async with make_server() as srv, FillMaskClient(srv.url, retry=RetryPolicy(base_delay=1.0)) as client, \
            FillMaskClient(srv.url, reconnect=True, reconnect_timeout=1.5) as steady:
        await asyncio.to_thread(srv.engine.stop)
        started = time.monotonic()
        with pytest.raises(OverloadedError) as stopped:
            await asyncio.wait_for(client.fill_mask(TEXT), 10)
        assert (stopped.value.status, stopped.value.reason) == (503, "engine_stopped")
        assert time.monotonic() - started < 0.9  # raised at once, not after the 1 s backoff
        # With reconnect, the client looks for a working server instead (its first redial spread over the
        # answer's retry_after_ms, 1 s); this one refuses handshakes, so the call ends with that refusal.
        with pytest.raises(ConnectError) as refused:
            await asyncio.wait_for(steady.fill_mask(TEXT), 10)
        assert refused.value.http_status == 503


async def test_token_is_sent_and_never_shown(make_server: Any) -> None:
    async with make_server(token="s3cret-value") as srv:
        with pytest.raises(ConnectError) as refused:
            await FillMaskClient(srv.url + "?token=wrong-value").connect()
        assert refused.value.http_status == 401
        assert "token" in refused.value.message and "wrong-value" not in str(refused.value)
        async with FillMaskClient(srv.url, token="s3cret-value") as client:
            assert await client.fill_mask(TEXT, top_k=1)
        code, out, err = await run_cli("--url", srv.url, "--token", "s3cret-value", "-k", "1", TEXT)
        assert (code, err) == (0, "") and out.startswith(TEXT)


async def self_signed(folder: Path, names: str) -> tuple[Path, Path]:
    """A self-signed certificate for ``names`` (subjectAltName: ``IP:127.0.0.1,DNS:localhost``) and its
    key, written into ``folder`` by the openssl command (the test is skipped where it is missing)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        made = await asyncio.create_subprocess_exec(
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
            "-addext", f"subjectAltName={names}",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    except FileNotFoundError:
        pytest.skip("the openssl command is not installed")
    assert await made.wait() == 0
    return cert, key


async def test_wss_with_a_trusted_self_signed_certificate(make_server: Any, tmp_path: Path) -> None:
    cert, key = await self_signed(tmp_path, "IP:127.0.0.1,DNS:localhost")
    async with make_server(certfile=str(cert), keyfile=str(key)) as srv:
        assert srv.url.startswith("wss://")
        with pytest.raises(ConnectError) as untrusted:
            await FillMaskClient(srv.url).connect()
        assert "certificate is not trusted" in str(untrusted.value) and "ssl=ssl.create_default_context(cafile=" in str(
            untrusted.value)  # says how to trust it
        async with FillMaskClient(srv.url, ssl=ssl.create_default_context(cafile=str(cert))) as client:
            assert await client.fill_mask(TEXT, top_k=1)
        code, out, err = await run_cli("--url", srv.url, "--cafile", str(cert), "-k", "1", TEXT)
        assert (code, err) == (0, "") and out.startswith(TEXT)
        code, _, err = await run_cli("--url", srv.url, "-q", TEXT)
        assert code == 3 and "not trusted" in err and "pass --cafile PATH" in err and "ssl=" not in err, err

        # ws:// to this TLS port: the server closes without a word, as a proxy with no backend does; the
        # client asks the port for TLS and, answered, stops at once (it waited out the whole --timeout).
        plain = "ws://" + srv.url[len("wss://"):]
        with pytest.raises(ConnectError) as wrong_scheme:
            await FillMaskClient(plain).connect(wait=60)
        assert wrong_scheme.value.kind == "tls_expected" and not wrong_scheme.value.transient
        assert f"speaks TLS: use {srv.url}" in str(wrong_scheme.value)
        began = time.monotonic()
        code, _, err = await run_cli("--url", plain, "--timeout", "60", "-q", TEXT)
        assert code == 3 and "speaks TLS" in err and time.monotonic() - began < 20, err


async def test_fill_mask_many_keeps_at_most_k_in_flight_and_input_order(server: Any) -> None:
    texts = [f"Number {n} is the [MASK] one." for n in range(10)]
    async with FillMaskClient(server.url) as client:
        one_by_one = [await client.fill_mask(text, top_k=2) for text in texts]
        with server.engine.paused():
            many = asyncio.create_task(client.fill_mask_many(texts, concurrency=3, top_k=2))
            await wait_until(lambda: server.engine.queued() == 3)
            await asyncio.sleep(0.05)  # time enough for a fourth request, were one to be sent
            assert server.engine.queued() == 3 and client.in_flight == 3
        got = await asyncio.wait_for(many, 5)
        for answer, expected in zip(got, one_by_one, strict=True):
            assert_same_predictions(answer, expected)

        mixed = [texts[0], "no mask here", texts[1]]
        outcomes = await client.fill_mask_many(mixed, concurrency=2, top_k=2, return_exceptions=True)
        assert isinstance(outcomes[1], RequestError) and outcomes[1].code == "no_mask"
        assert_same_predictions(outcomes[0], one_by_one[0])
        assert_same_predictions(outcomes[2], one_by_one[1])
        with pytest.raises(RequestError):
            await client.fill_mask_many(mixed, concurrency=2)
        await wait_until(lambda: client.in_flight == 0)


async def test_fill_mask_iter_reads_its_texts_as_it_sends_them(server: Any) -> None:
    """A trial: ``fill_mask_iter`` read its whole input before sending anything, so an endless (or long
    and slow) generator blocked the event loop, where no ``asyncio.timeout`` could end it. Now a text is
    read as its request goes, at most ``AHEAD * concurrency`` ahead of the consumer (the README says how
    many times: a review found it saying 2 where ``AHEAD`` is 4); what the iterable raises comes after
    the outcomes of the texts before it."""
    assert f"at most `{AHEAD} × concurrency` ahead of your loop" in (ROOT / "README.md").read_text()
    pulled = 0

    def texts(count: int, fail_after: int | None = None) -> Iterator[str]:
        nonlocal pulled
        for n in range(count):
            if n == fail_after:
                raise LookupError("the source broke")
            pulled += 1
            yield f"Number {n} is the [MASK] one."

    async with FillMaskClient(server.url) as client:
        got = []
        async with contextlib.aclosing(client.fill_mask_iter(texts(10_000), concurrency=4, top_k=1)) as outcomes:
            async for outcome in outcomes:
                assert isinstance(outcome, FillMaskResult)
                assert outcome.per_mask()[0][0]["sequence"].startswith(f"number {len(got)} is ")  # in order
                got.append(outcome)
                assert pulled <= len(got) + AHEAD * 4  # (before: all 10,000 were read first)
                if len(got) == 20:
                    break
        await wait_until(lambda: client.in_flight == 0)  # the rest cancelled
        pulled, seen = 0, []
        with pytest.raises(LookupError, match="the source broke"):
            async for outcome in client.fill_mask_iter(texts(10, fail_after=5), concurrency=2, top_k=1):
                seen.append(outcome)
        assert [type(outcome) for outcome in seen] == [FillMaskResult] * 5 and pulled == 5


async def test_a_slow_request_holds_back_a_generators_texts_but_not_a_lists(server: Any) -> None:
    """A review: reading at most ``AHEAD * concurrency`` ahead made ``fill_mask_many`` and the command
    line (which hold every text anyway) wait behind one slow request (a retry's back-off, a resend):
    3.8 times slower with one text in forty taking 0.5 s. A list is now sent as fast as ``concurrency``
    allows; a generator is held back, as its bound says. (The request itself is a stand-in here: only
    the order of sending is under test, with the head held for as long as the test likes.)"""
    client = FillMaskClient(server.url)
    await client.connect()
    started: list[str] = []
    release = asyncio.Event()

    async def call(text: str, **_: Any) -> FillMaskResult:
        started.append(text)
        if text == "0":
            await release.wait()
        return FillMaskResult([], None, None, None, None, None, {})

    client.fill_mask_result = call  # type: ignore[method-assign]
    texts = [str(n) for n in range(40)]
    for given, most in ((texts, 40), ((text for text in texts), AHEAD * 2)):
        started.clear()
        release.clear()
        outcomes = asyncio.create_task(asyncio.wait_for(
            _collect(client.fill_mask_iter(given, concurrency=2)), 10))
        await asyncio.sleep(0.1)  # every text the bound lets go has been sent by now
        assert len(started) == most, (type(given).__name__, len(started))
        release.set()
        assert len(await outcomes) == 40 and started == texts  # in order, each once
    await client.close()


async def _collect(outcomes: AsyncIterator[Any]) -> list[Any]:
    return [outcome async for outcome in outcomes]


async def test_fill_mask_iter_raises_once_when_no_text_could_be_answered(make_server: Any) -> None:
    """A newcomer's trial: after ``close()``, ``fill_mask_iter`` yielded one ``ConnectionLostError`` per
    text, and with an endless generator that loop never ended. Closed or never connected, it raises at
    once; a generator's connection lost without ``reconnect``, it raises after the outcomes before (a
    list's texts each still get their outcome, as ``fill_mask_many(return_exceptions=True)`` says)."""
    async with make_server() as srv:
        never = FillMaskClient(srv.url)
        with pytest.raises(ConnectionLostError, match="not connected"):
            async for _ in never.fill_mask_iter(itertools.repeat(TEXT, 100_000)):  # (bounded, were it to yield)
                pass
        async with FillMaskClient(srv.url) as client:
            assert len([o async for o in client.fill_mask_iter([TEXT] * 3, top_k=1)]) == 3
        with pytest.raises(ConnectionLostError, match="was closed"):
            async for _ in client.fill_mask_iter(itertools.repeat(TEXT, 100_000)):
                pass
        lost = FillMaskClient(srv.url)
        await lost.connect()
        seen: list[Any] = []

        async def endless() -> None:
            async for outcome in lost.fill_mask_iter(itertools.repeat(TEXT), concurrency=2, top_k=1):
                seen.append(outcome)

        iterating = asyncio.create_task(endless())
        await wait_until(lambda: len(seen) >= 10)
    # The server drained and closed the connection (§10); the client does not reconnect.
    with pytest.raises((ConnectionLostError, OverloadedError)):
        await asyncio.wait_for(iterating, 20)
    assert len(seen) < 100_000 and all(isinstance(o, (FillMaskResult, FillMaskError)) for o in seen)
    # A list's texts each still get their outcome (a review: they raised at once), an empty list none.
    listed = await lost.fill_mask_many([TEXT] * 3, return_exceptions=True)
    assert len(listed) == 3 and all(isinstance(o, (ConnectionLostError, OverloadedError)) for o in listed), listed
    assert await lost.fill_mask_many([]) == []
    await lost.close()


def test_a_reconnecting_pool_whose_every_redial_was_refused_for_good_is_hopeless() -> None:
    """A review: with ``reconnect=True``, a pool whose redials were all refused for good (a wrong token
    after a restart) still gave a generator one error per text, for ever; ``fill_mask_iter`` now ends
    on it as it does without ``reconnect``. (The pool's state is set here, as its dialler leaves it.)"""
    from fillmask_client.pool import Pool

    async def never(url: str) -> Any:
        raise AssertionError("no dial in this test")

    pool = Pool(["ws://h:1/", "ws://h:2/"], 1, never, reconnect=True, backoff=ReconnectBackoff())
    pool.opened = True
    refused = ConnectError("ws://h:1/ refused the connection (HTTP 401): wrong token", url="ws://h:1/", http_status=401)
    pool.slots[0].failure, pool.slots[0].final = refused, True
    assert pool.hopeless() is None  # the other may still be redialled
    pool.slots[1].failure, pool.slots[1].final = refused, True
    assert isinstance(pool.hopeless(), ConnectError) and "401" in str(pool.hopeless())


async def test_numbers_of_other_types_are_sent_as_json_numbers(server: Any) -> None:
    """A trial: numpy's numbers (``top_k=np.int64(3)``) failed with orjson's ``TypeError``, neither a
    ``UsageError`` nor sent. Integers and reals of any type go as JSON's; what JSON cannot carry is still
    a ``UsageError``."""
    import numpy as np

    async with FillMaskClient(server.url) as client:
        assert len(await client.fill_mask(TEXT, top_k=np.int64(3), deadline_ms=np.float32(30_000))) == 3
        assert len(await client.fill_mask(TEXT, top_k=np.uint8(2), deadline_ms=np.float64(30_000))) == 2
        with pytest.raises(UsageError, match="deadline_ms=nan is not a finite number"):
            await client.fill_mask(TEXT, deadline_ms=np.float32("nan"))
        with pytest.raises(UsageError, match=r"top_k of type numpy\.bool has no JSON form"):  # (before: TypeError)
            await client.fill_mask(TEXT, top_k=np.True_)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match=r"targets\[2\] of type set has no JSON form"):
            await client.fill_mask(TEXT, targets=["a", np.str_("b"), {"c"}])  # type: ignore[list-item]
        with pytest.raises(UsageError, match="targets must be a str or a list of str, not bytes"):
            await client.fill_mask(TEXT, targets=b"a")  # (a newcomer: it went as [97])
        assert client.in_flight == 0
    assert orjson.loads(encode_fill_mask(1, TEXT, top_k=np.int16(4), deadline_ms=np.float16(10))) == {
        "type": "fill_mask", "id": 1, "text": TEXT, "top_k": 4, "deadline_ms": 10.0}


async def test_the_default_concurrency_never_meets_the_fair_share_of_a_client_alone(make_server: Any) -> None:
    """A newcomer's find: the default was the server's max_batch_size (64), and a server with a small
    ``--max-queue`` (the README's advice for base: about 50) refused most of a lone client's texts with 429
    ``queue_share``. The default now stays under half the queue, where the fair share never applies."""
    from fillmask_client.async_client import default_concurrency

    assert default_concurrency({"max_batch_size": 64, "max_queue": 1024}, 1) == 64
    assert default_concurrency({"max_batch_size": 64, "max_queue": 1024}, 3) == 192
    assert default_concurrency({"max_batch_size": 64, "max_queue": 50}, 2) == 25
    assert default_concurrency({"max_batch_size": 64, "max_queue": 50}, 1, urls=4) == 100  # half of each replica's
    assert default_concurrency({"max_batch_size": 64, "max_queue": 1}, 1) == 1
    assert default_concurrency({}, 2) == 64  # limits a server does not announce: 32 a connection
    texts = [f"Number {n} is the [MASK] one." for n in range(80)]
    async with make_server(max_queue=8) as srv, FillMaskClient(srv.url) as client:
        with srv.engine.paused():  # every request waits: the worst case for the fair share
            many = asyncio.create_task(client.fill_mask_many(texts, top_k=1, return_exceptions=True))
            await wait_until(lambda: srv.engine.queued() == 4)
        outcomes = await asyncio.wait_for(many, 30)  # (before: 429 queue_share for most of them)
    assert len(outcomes) == 80 and not [o for o in outcomes if isinstance(o, BaseException)]


async def test_sync_client_works_from_a_plain_thread(server: Any) -> None:
    # The server runs on this test's loop, so the blocking client is driven from another thread.
    async with FillMaskClient(server.url) as reference:
        expected = await reference.fill_mask(TEXT, top_k=3)
    client = await asyncio.to_thread(SyncFillMaskClient, server.url)
    try:
        assert client.model == "tiny" and client.limits["max_queue"] == server.config.max_queue
        assert_same_predictions(await asyncio.to_thread(client.fill_mask, TEXT, top_k=3), expected)
        many = await asyncio.to_thread(client.fill_mask_many, [TEXT, TWO_MASKS], top_k=3)
        assert_same_predictions(many[0], expected)
        assert len(many[1]) == 2 and all(len(per_mask) == 3 for per_mask in many[1])
        with server.engine.paused():
            with pytest.raises(TimeoutError, match=r"no answer within timeout=0.1 s; the call was cancelled$"):
                await asyncio.to_thread(client.fill_mask, TEXT, timeout=0.1)  # (no word of a blocked loop)
            await wait_until(lambda: server.engine.queued() == 0)  # cancelled on the server, connection open
    finally:
        await asyncio.to_thread(client.close)
    with pytest.raises(ConnectionLostError, match=r"the client for ws://127\.0\.0\.1:\d+/ was closed"):
        client.fill_mask(TEXT)  # the async client's exception (a trial: a RuntimeError, not a FillMaskError)


async def test_the_blocking_client_iterates_outcomes_as_the_async_one_does(server: Any) -> None:
    """``SyncFillMaskClient`` had no ``fill_mask_iter`` (noticed in a trial): a script streaming a long
    file through the blocking client had to hold every text and every answer at once. Its generator now
    yields each text's outcome in input order (a bad text's error in its place), reads a generator of
    texts as its requests go, cancels what still runs when the loop is left early, and takes a timeout
    for each wait, past which the rest is cancelled."""
    async with FillMaskClient(server.url) as reference:
        expected = await reference.fill_mask(TEXT, top_k=3)
    pulled = 0

    def texts(count: int) -> Iterator[str]:
        nonlocal pulled
        for n in range(count):
            pulled += 1
            yield f"Number {n} is the [MASK] one."

    def iterate(client: SyncFillMaskClient) -> None:
        outcomes = list(client.fill_mask_iter([TEXT, "no mask here", TEXT], top_k=3))
        assert [type(each) for each in outcomes] == [FillMaskResult, RequestError, FillMaskResult]
        assert isinstance(outcomes[1], RequestError) and outcomes[1].code == "no_mask"
        for answered in (outcomes[0], outcomes[2]):
            assert isinstance(answered, FillMaskResult)
            assert_same_predictions(answered.per_mask()[0], expected)
        with pytest.raises(UsageError):
            client.fill_mask_iter(TEXT)  # one bare text: refused at the call, before any ``next``
        for got, answered in enumerate(client.fill_mask_iter(texts(10_000), concurrency=2, top_k=1), 1):
            assert isinstance(answered, FillMaskResult)
            assert answered.per_mask()[0][0]["sequence"].startswith(f"number {got - 1} is ")  # in order
            assert pulled <= got + AHEAD * 2  # read as it goes, not all 10,000 first
            if got == 10:
                break

    client = await asyncio.to_thread(SyncFillMaskClient, server.url)
    try:
        await asyncio.to_thread(iterate, client)
        await wait_until(lambda: client._client.in_flight == 0)  # the break cancelled the rest
        with server.engine.paused():
            waiting = client.fill_mask_iter(itertools.repeat(TEXT, 100), concurrency=4, timeout=0.1)
            with pytest.raises(TimeoutError, match=r"no answer within timeout=0.1 s; the call was cancelled$"):
                await asyncio.to_thread(next, waiting)
            await wait_until(lambda: client._client.in_flight == 0 and server.engine.queued() == 0)
            with pytest.raises(StopIteration):
                next(waiting)  # a timeout ends the iteration
        # A source that blocks holds up the client's thread, but not the timeout: a review saw the
        # TimeoutError wait for the source (the generator's cleanup waited on that thread).
        release, waited_out = threading.Event(), []

        def blocking_source() -> Iterator[str]:
            waited_out.append(not release.wait(30))  # (bounded) a pipe with nothing in it yet
            yield TEXT

        def time_out_on_a_blocked_source() -> None:
            outcomes = client.fill_mask_iter(blocking_source(), timeout=0.2)
            with pytest.raises(TimeoutError):
                next(outcomes)
            release.set()

        await asyncio.to_thread(time_out_on_a_blocked_source)
        await wait_until(lambda: waited_out == [False] and client._client.in_flight == 0)
        assert_same_predictions(await asyncio.to_thread(client.fill_mask, TEXT, top_k=3), expected)  # still open
    finally:
        await asyncio.to_thread(client.close)
    with pytest.raises(ConnectionLostError):
        next(client.fill_mask_iter([TEXT]))


async def test_a_blocking_client_dropped_without_close_says_so_and_lets_go_of_its_connection(server: Any) -> None:
    """An application developer's trial: five ``SyncFillMaskClient`` dropped without ``close()`` (a
    notebook cell run again) kept five threads and five connections to the server for the life of the
    process, silently, also under ``-X dev``. Now each says so (``ResourceWarning``) as it is collected,
    and its connection and thread end."""
    def open_clients() -> None:  # (no reference to them survives this function)
        for _ in range(3):
            SyncFillMaskClient(server.url).fill_mask(TEXT)

    def client_threads() -> int:
        return sum(thread.name == "fillmask-client" for thread in threading.enumerate())

    before = client_threads()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", ResourceWarning)
        await asyncio.to_thread(open_clients)
        gc.collect()
    unclosed = [str(w.message) for w in said if issubclass(w.category, ResourceWarning)
                and "unclosed <SyncFillMaskClient" in str(w.message)]
    assert len(unclosed) == 3 and "call close(), or use it in a with block" in unclosed[0], unclosed
    await wait_until(lambda: not server.connections and client_threads() == before, timeout=10)


async def test_the_blocking_client_called_on_the_servers_own_loop_says_it_blocked_that_loop(server: Any) -> None:
    """A program that starts a server and then calls the blocking client from a coroutine on the same
    loop waited out the open timeout and was told of a server too busy to answer: the call itself held
    up the loop the server runs on. Its timeout now says so, and what to use instead."""
    with pytest.raises(ConnectError) as failed:
        SyncFillMaskClient(server.url, open_timeout=0.5)  # blocks this loop, the server's, for half a second
    message = str(failed.value)
    assert failed.value.kind == "timeout" and message.startswith(f"cannot connect to {server.url}: timed out"), message
    assert message.endswith("this call blocked the event loop running in this thread: if the server runs on "
                            "that loop (one started in this program), it could not answer; in a coroutine, "
                            "await FillMaskClient's calls instead"), message
    async with FillMaskClient(server.url) as client:  # the server is none the worse
        assert await client.fill_mask(TEXT, top_k=1)
    # Said only where it may be so (a review: a notebook's cells run in its loop, and its server may be
    # anywhere): a loop runs in this thread, and the server is on this machine.
    from fillmask_client.sync_client import _blocked_loop_hint

    for url in ("ws://127.0.0.1:8765/", "ws://[::1]:8765/", "wss://localhost/", "ws://127.1.2.3/ws"):
        assert _blocked_loop_hint([url]), url
    for url in ("ws://example.com:8765/", "ws://10.0.0.5/", "ws://[2001:db8::1]/"):
        assert _blocked_loop_hint([url]) == "", url
    assert await asyncio.to_thread(_blocked_loop_hint, [server.url]) == ""  # (no loop in that thread)


# --- the command line, as a subprocess ----------------------------------------------------------


async def run_cli(*args: str, stdin: str | bytes = "", env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the command; ``env``: variables to set (on top of this process's) for it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fillmask_client", *args, cwd=ROOT, env={**os.environ, **(env or {})},
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin if isinstance(stdin, bytes) else stdin.encode()), 20)
    except TimeoutError:
        proc.kill()  # a command that hangs fails the test without outliving it
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


ROW = re.compile(r"^\s*(\d+)  (\S+)\s+(\d\.\d{4})  (.*)$")


async def test_cli_prints_a_table_per_text_and_per_mask(server: Any) -> None:
    async with FillMaskClient(server.url) as client:
        one = await client.fill_mask(TEXT, top_k=3)
        two = await client.fill_mask(TWO_MASKS, top_k=3)
    code, out, err = await run_cli("--url", server.url, "--top-k", "3", "--quiet", TEXT, TWO_MASKS)
    assert (code, err) == (0, ""), err
    blocks = out.split("\n\n")
    assert len(blocks) == 2
    first = blocks[0].splitlines()
    assert first[0] == TEXT and re.fullmatch(r"rank  token\s+score  sequence", first[1])
    assert_rows(first[2:], one)
    second = blocks[1].splitlines()
    assert second[0] == TWO_MASKS and second[1] == "mask 1 of 2" and second[6] == "mask 2 of 2"
    assert_rows(second[3:6], two[0])
    assert_rows(second[8:], two[1])


def assert_rows(lines: list[str], predictions: list[dict[str, Any]]) -> None:
    assert len(lines) == len(predictions), lines
    for rank, (line, prediction) in enumerate(zip(lines, predictions, strict=True), start=1):
        row = ROW.match(line)
        assert row is not None, line
        assert (int(row[1]), row[2], row[4]) == (rank, prediction["token_str"], prediction["sequence"])
        assert abs(float(row[3]) - prediction["score"]) <= 0.00051


async def test_cli_json_reads_stdin_and_prints_one_frame_per_text(server: Any) -> None:
    texts = ["The [MASK] is big.", "A [MASK] of France.", TWO_MASKS]
    async with FillMaskClient(server.url) as client:
        expected = [await client.fill_mask(text, top_k=2, targets=["capital", "city", "paris"]) for text in texts]
    stdin = "\n".join(texts[:2]) + "\n\n" + texts[2] + "\n"
    code, out, err = await run_cli("--url", server.url, "--json", "-k", "2", "-t", "capital,city", "-t", "paris",
                                   "-c", "2", stdin=stdin)
    assert (code, err) == (0, "fillmask-client: 3 texts: 3 answered, 0 failed\n"), err  # the summary, on stderr
    frames = [orjson.loads(line) for line in out.splitlines()]
    assert [frame["type"] for frame in frames] == ["result"] * 3
    for frame, want in zip(frames, expected, strict=True):
        assert_same_predictions(frame["predictions"], want)
        assert {"queue_ms", "inference_ms", "batch_size", "batch_tokens"} <= set(frame)


async def test_cli_exit_status_and_one_line_messages(server: Any) -> None:
    code, out, err = await run_cli("--url", server.url, "-k", "1", TEXT, "no mask at all")
    assert code == 1
    assert out.startswith(TEXT + "\n") and "rank" in out  # the good text still printed
    failed, summary = err.splitlines()  # one line for the failed text, one summary line
    assert "text 2" in failed and "no_mask" in failed
    assert summary == "fillmask-client: 2 texts: 1 answered, 1 failed (1 no_mask)"

    code, out, err = await run_cli("--url", f"ws://127.0.0.1:{free_port()}/", "--timeout", "1", "-q", TEXT)
    assert code == 3 and out == ""
    assert len(err.splitlines()) == 1 and "cannot connect" in err  # -q: without the waiting lines

    code, _, err = await run_cli("--url", server.url, stdin="\n\n")
    assert code == 2 and "no texts" in err

    code, _, err = await run_cli("--url", server.http_url + "/", TEXT)  # not a WebSocket URL: a usage error
    assert code == 2 and f"WebSocket URL is 'ws://127.0.0.1:{server.port}/'" in err, err


def assert_usage_error(code: int, err: str, *words: str) -> None:
    """Exit status 2 and one line on stderr that says what was wrong (no traceback, no usage block)."""
    assert code == 2, err
    [line] = err.splitlines()
    assert line.startswith("fillmask-client: ") and all(word in line for word in words), err


async def test_cli_bad_urls_durations_and_input_are_one_line_usage_errors(tmp_path: Path) -> None:
    for url, what in BAD_URLS.items():
        # "ws://" used to be retried for the whole --timeout, then exit 3; the others were tracebacks.
        assert_usage_error(*(await run_cli("--url", url, "--timeout", "30", TEXT))[::2], what, "expected ws://")
    for flag in ("--timeout", "--reconnect-timeout", "--deadline-ms"):
        for bad in ("nan", "inf"):  # --timeout nan used to wait forever; --deadline-ms inf was sent as null
            code, _, err = await run_cli("--url", f"ws://127.0.0.1:{free_port()}/", flag, bad, TEXT)
            assert_usage_error(code, err, flag, "finite")

    latin = tmp_path / "latin-1.txt"
    latin.write_bytes(b"first [MASK].\n\n\xe9t\xe9 [MASK].\n")
    code, out, err = await run_cli("--file", str(latin), TEXT)
    assert_usage_error(code, err, str(latin), "line 3", "not valid UTF-8")
    assert out == "" and len(err.splitlines()) == 1
    code, out, err = await run_cli("-", stdin=b"ok [MASK].\n\xff [MASK]\n")
    assert_usage_error(code, err, "standard input", "line 2", "not valid UTF-8")
    assert out == "" and len(err.splitlines()) == 1

    # A trial: --cafile with a ws:// URL failed only at the connect, as a server not speaking WebSocket.
    certificate = tmp_path / "cert.pem"
    certificate.write_text("unread\n")
    for urls, shown in ((["--url", "ws://127.0.0.1:8765/?token=sesame"], "'ws://127.0.0.1:8765/?token=***'"),
                        (["--url", "wss://h:1/", "--url", "ws://127.0.0.1:8765/"], "'ws://127.0.0.1:8765/'")):
        code, out, err = await run_cli(*urls, "--cafile", str(certificate), TEXT)
        assert_usage_error(code, err, "--cafile is for wss:// URLs", f"{shown} is ws://")
    not_a_certificate = tmp_path / "hostname"
    not_a_certificate.write_text("myhost\n")
    code, out, err = await run_cli("--url", "wss://127.0.0.1:8765/", "--cafile", str(not_a_certificate), TEXT)
    assert_usage_error(code, err, f"--cafile {not_a_certificate}", "no certificate")
    assert len(err.splitlines()) == 1


def test_cli_names_the_argument_or_line_that_is_not_utf8(tmp_path: Path) -> None:
    import io

    from fillmask_client.cli import BadInput

    args = build_parser().parse_args(["good [MASK]", "\udcff [MASK]"])  # how Python decodes a non-UTF-8 argv
    with pytest.raises(BadInput, match="TEXT argument 2 is not valid UTF-8"):
        collect_texts(args, io.BytesIO(b""))
    stdin = io.BytesIO(b"a [MASK]\r\nb [MASK]\rc \xff\n")  # every line ending counts
    with pytest.raises(BadInput, match=r"standard input: line 3 is not valid UTF-8 \(byte 0xff\)"):
        collect_texts(build_parser().parse_args(["-"]), stdin)
    assert collect_texts(build_parser().parse_args([]), io.BytesIO("été [MASK]\r\n\n".encode())) == ["été [MASK]"]



async def test_cli_options_and_texts_mix_and_argparse_errors_are_one_line(server: Any) -> None:
    # Options between texts (they used to end the texts: "unrecognized arguments: TWO_MASKS").
    code, out, err = await run_cli(TEXT, "--url", server.url, "-k", "2", TWO_MASKS, "-q", "--", "-1 is [MASK].")
    assert (code, err) == (0, ""), err
    assert [block.splitlines()[0] for block in out.split("\n\n")] == [TEXT, TWO_MASKS, "-1 is [MASK]."]
    # argparse's own errors are one line too (they were a usage block, then the error).
    code, out, err = await run_cli("--url", server.url, "-k", "two", TEXT)
    assert_usage_error(code, err, "--top-k", "'two'", "see fillmask-client --help")
    code, out, err = await run_cli("--url", server.url, "--no-such-flag", TEXT)
    assert_usage_error(code, err, "--no-such-flag")
    code, out, err = await run_cli("--concurrency", "0", TEXT)
    assert_usage_error(code, err, "--concurrency must be at least 1")
    from fillmask_client import __version__

    assert await run_cli("--version") == (0, f"fillmask-client {__version__}\n", "")


async def test_cli_json_lines_follow_the_input_over_several_connections_whatever_their_ids(server: Any) -> None:
    """The README's rule for --json (a newcomer joined results by ``id``, which repeats across connections):
    the n-th line is the n-th text's."""
    texts = [f"item {n} is the [MASK] one." for n in range(30)]
    code, out, err = await run_cli("--url", server.url, "--json", "-k", "1", "--connections", "3", *texts)
    assert code == 0, err
    frames = [orjson.loads(line) for line in out.splitlines()]
    assert [frame["type"] for frame in frames] == ["result"] * len(texts)
    sequences = [frame["predictions"][0]["sequence"] for frame in frames]  # (a ##piece joins "the": no space)
    assert all(sequence.startswith(f"item {n} is the") for n, sequence in enumerate(sequences)), sequences
    assert len({frame["id"] for frame in frames}) < len(texts)  # (why the README says to join by line)


async def test_cli_json_prints_a_line_for_a_text_the_client_refuses_to_send(server: Any) -> None:
    huge = TEXT + " word" * (server.config.max_frame_bytes // 5)  # over limits.max_frame_bytes once encoded
    code, out, err = await run_cli("--url", server.url, "--json", "-q", "-", stdin=f"{TEXT}\n{huge}\n{TEXT}\n")
    assert code == 1, err
    first, refused, third = (orjson.loads(line) for line in out.splitlines())  # one line per text, in order
    assert first["type"] == third["type"] == "result"
    assert refused["type"] == "error" and refused["code"] == "frame_too_large" and refused["source"] == "client"
    assert "max_frame_bytes" in refused["message"]
    # Every field protocol/schemas/error.json requires (the id null: nothing was sent, so no id).
    schema = orjson.loads((ROOT / "protocol" / "schemas" / "error.json").read_bytes())
    assert set(schema["required"]) <= refused.keys() and refused["id"] is None
    assert "text 2" in err and "frame_too_large" in err


async def test_cli_stops_with_141_when_its_standard_output_is_closed(server: Any) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (say `head -1`) has gone before the first line is written
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fillmask_client", "--url", server.url, "-q", TEXT, TEXT, cwd=ROOT,
            stdin=asyncio.subprocess.DEVNULL, stdout=write_end, stderr=asyncio.subprocess.PIPE)
    finally:
        os.close(write_end)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 141, err  # not 0: not every answer reached the reader
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err


# --- the pool: several connections, going away, resends (issue 11 item 3) ----------------------


def test_connection_states_move_only_as_the_table_says() -> None:
    moves = {(state, event): transition(state, event) for state in ConnState for event in Event}
    assert {key: to for key, to in moves.items() if to is not key[0]} == {
        (ConnState.CONNECTING, Event.HELLO): ConnState.OPEN,
        (ConnState.CONNECTING, Event.GOING_AWAY): ConnState.DRAINING,
        (ConnState.CONNECTING, Event.CLOSE): ConnState.CLOSED,
        (ConnState.OPEN, Event.GOING_AWAY): ConnState.DRAINING,
        (ConnState.OPEN, Event.CLOSE): ConnState.CLOSED,
        (ConnState.DRAINING, Event.CLOSE): ConnState.CLOSED,
    }  # everything else (a second hello, a notice while draining, anything once closed) changes nothing
    # The same names as the demo page's client (web_demo/client.js), so both read alike.
    assert [state.value for state in ConnState] == ["connecting", "open", "draining", "closed"]


async def test_sync_client_takes_exactly_the_async_clients_options(server: Any) -> None:
    assert inspect.signature(SyncFillMaskClient) == inspect.signature(FillMaskClient)
    backoff = ReconnectBackoff(base=0.01, cap=0.5)

    def use() -> None:  # in a thread: the server runs on this test's event loop
        with SyncFillMaskClient(server.url, backoff=backoff, reconnect=True, open_timeout=5) as client:
            assert client._client._pool.backoff is backoff and client._client.open_timeout == 5
            assert client.fill_mask(TEXT, top_k=1)
        with pytest.raises(TypeError):
            SyncFillMaskClient(server.url, no_such_option=1)

    await asyncio.to_thread(use)


async def test_a_connection_goes_open_draining_closed_as_the_server_drains(make_server: Any) -> None:
    async with make_server() as srv, FillMaskClient(srv.url) as client:
        conn = client._pool.slots[0].conn
        assert conn is not None and conn.state is ConnState.OPEN and conn.usable
        with srv.engine.paused():
            call = asyncio.create_task(client.fill_mask(TEXT, top_k=1))
            await wait_until(lambda: srv.engine.queued() == 1)
            drain = asyncio.create_task(srv.drain(timeout=10))
            await wait_until(lambda: conn.state is ConnState.DRAINING)
            assert not conn.usable and conn.notice is not None and conn.notice.reason == "shutting_down"
        assert await call  # the answer it owed still came
        await drain
        await wait_until(lambda: conn.state is ConnState.CLOSED)
        assert conn.lost is not None and conn.lost.code == 1001


def test_least_loaded_takes_the_fewest_in_flight_and_breaks_ties_in_turn() -> None:
    assert least_loaded([3, 1, 2]) == 1
    assert least_loaded([None, 5, None]) == 1  # None: that slot takes no calls (going away, lost, dialling)
    assert least_loaded([None, None]) is None
    assert least_loaded([]) is None
    # Equal loads: the first at or after `start`, going round, so a caller moving `start` rotates.
    assert [least_loaded([0, 0, 0], start) for start in range(4)] == [0, 1, 2, 0]
    assert least_loaded([1, 0, 1, 0], start=2) == 3 and least_loaded([1, 0, 1, 0], start=0) == 1
    assert least_loaded([0, None, 0], start=1) == 2


def test_reconnect_backoff_is_full_jitter_doubling_to_a_cap_and_honours_the_servers_window() -> None:
    backoff = ReconnectBackoff(base=0.1, cap=1.0)
    assert [backoff.window(n) for n in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert backoff.window(10_000) == 1.0  # no overflow on a long outage
    # Full jitter: anywhere from 0 to the window, so clients cut off together spread over all of it.
    assert backoff.delay(3, rand=lambda: 0.0) == 0.0
    assert backoff.delay(3, rand=lambda: 0.5) == 0.4
    # going_away's reconnect_within_ms (§10) is the window of the first attempt only, even above the cap.
    assert backoff.window(0, first_window=2.5) == 2.5 and backoff.delay(0, 2.5, rand=lambda: 0.5) == 1.25
    assert backoff.window(1, first_window=2.5) == 0.2
    rng = random.Random(1)
    delays = [backoff.delay(0, 1.0, rand=rng.random) for _ in range(1000)]
    assert 0.0 <= min(delays) < 0.01 and 0.99 < max(delays) < 1.0  # spread over the whole window
    with pytest.raises(ValueError):
        ReconnectBackoff(base=-1)


def results_of(srv: Any) -> float:
    """The server's count of ``result`` frames (§11), from its own registry."""
    return srv.metrics.registry.get_sample_value("fillmask_requests_total", {"outcome": "result", "code": ""}) or 0.0


def refused_of(srv: Any, reason: str) -> float:
    return srv.metrics.registry.get_sample_value("fillmask_requests_total",
                                                 {"outcome": "overloaded", "code": reason}) or 0.0


async def test_pool_opens_n_connections_and_sends_each_call_on_the_least_loaded(make_server: Any) -> None:
    async with make_server() as srv, FillMaskClient(srv.url, connections=4) as client:
        assert len(srv.connections) == 4 and client.usable_connections == 4
        with srv.engine.paused():
            calls = [asyncio.create_task(client.fill_mask(TEXT, top_k=1)) for _ in range(8)]
            await wait_until(lambda: srv.engine.queued() == 8)
            assert sorted(len(conn.session.inflight) for conn in srv.connections) == [2, 2, 2, 2]
        assert all(len(answer) == 1 for answer in await asyncio.wait_for(asyncio.gather(*calls), 5))
        assert "4 of 4 connections usable" in repr(client)


async def test_pool_over_a_list_of_servers_prefers_the_one_with_fewer_calls_in_flight(
    make_server: Any, client_warnings: Callable[[], list[str]]
) -> None:
    async with make_server() as a, make_server() as b, FillMaskClient([a.url, b.url]) as client:
        with a.engine.paused():
            with b.engine.paused():
                first = [asyncio.create_task(client.fill_mask(TEXT, top_k=1)) for _ in range(6)]
                await wait_until(lambda: a.engine.queued() == 3 and b.engine.queued() == 3)
            await asyncio.wait_for(asyncio.gather(*first[1::2]), 5)  # b answers its three, a holds its own
            assert a.engine.queued() == 3 and client.in_flight == 3
            with b.engine.paused():
                more = [asyncio.create_task(client.fill_mask(TEXT, top_k=1)) for _ in range(3)]
                await wait_until(lambda: b.engine.queued() == 3)
                assert a.engine.queued() == 3  # all three went to b: 0, 1, 2 in flight there against 3 on a
        await asyncio.wait_for(asyncio.gather(*first, *more), 5)
    assert (results_of(a), results_of(b)) == (3, 6)
    assert not client_warnings()


async def test_a_connection_going_away_gets_no_new_calls_but_answers_those_it_accepted(
    make_server: Any, client_warnings: Callable[[], list[str]]
) -> None:
    async with make_server() as a, make_server() as b, FillMaskClient([a.url, b.url]) as client:
        with a.engine.paused():
            with b.engine.paused():  # b holds its two as well until both queues are counted: no race
                held = [asyncio.create_task(client.fill_mask(TEXT, top_k=k)) for k in (1, 2, 3, 4)]
                await wait_until(lambda: a.engine.queued() == 2 and b.engine.queued() == 2)
            drain = asyncio.create_task(a.drain(timeout=10))  # going_away (§10), then waits for its two
            await wait_until(lambda: client.usable_connections == 1)  # the client read going_away
            later = [asyncio.create_task(client.fill_mask(TEXT, top_k=5)) for _ in range(10)]
            assert all(len(answer) == 5 for answer in await asyncio.wait_for(asyncio.gather(*later), 5))
            assert a.engine.queued() == 2  # nothing new was sent to the server going away
        # Its two calls were answered where they were accepted, on the draining connection: not resent.
        assert [len(answer) for answer in await asyncio.wait_for(asyncio.gather(*held), 5)] == [1, 2, 3, 4]
        await asyncio.wait_for(drain, 5)
        assert (results_of(a), results_of(b), refused_of(a, "shutting_down")) == (2, 12, 0)
        assert client.in_flight == 0
    assert not client_warnings()


async def test_calls_a_draining_server_did_not_run_are_resent_elsewhere_exactly_once(
    make_server: Any, client_warnings: Callable[[], list[str]]
) -> None:
    async with make_server() as a, make_server() as b, FillMaskClient([a.url, b.url]) as client:
        with a.engine.paused():
            with b.engine.paused():  # until both queues are counted, or b's quick answers would race the count
                calls = [asyncio.create_task(client.fill_mask(TEXT, top_k=k)) for k in range(1, 9)]
                await wait_until(lambda: a.engine.queued() == 4 and b.engine.queued() == 4)
            # The drain gives up on a's queued four after 0.1 s: answered 503 shutting_down, never run (§10.4).
            await asyncio.wait_for(a.drain(timeout=0.1), 5)
        answers = await asyncio.wait_for(asyncio.gather(*calls), 5)
    assert [len(answer) for answer in answers] == list(range(1, 9))  # every caller one result, no error
    assert (refused_of(a, "shutting_down"), results_of(a), results_of(b)) == (4, 0, 8)
    assert not client_warnings()


async def test_calls_on_a_dropped_connection_are_resent_on_another(
    make_server: Any, client_warnings: Callable[[], list[str]]
) -> None:
    async with make_server() as a, make_server() as b, FillMaskClient([a.url, b.url]) as client:
        with a.engine.paused():
            with b.engine.paused():  # until both queues are counted, or b's quick answers would race the count
                calls = [asyncio.create_task(client.fill_mask(TEXT, top_k=k)) for k in range(1, 7)]
                await wait_until(lambda: a.engine.queued() == 3 and b.engine.queued() == 3)
            for conn in list(a.connections):
                conn.ws.transport.abort()  # a crashed replica: the TCP connection drops, no close frame (1006)
            answers = await asyncio.wait_for(asyncio.gather(*calls), 5)
        assert [len(answer) for answer in answers] == list(range(1, 7))
        assert results_of(b) == 6 and client.usable_connections == 1  # without reconnect, not replaced
    assert not client_warnings()


async def test_without_reconnect_a_lone_connection_going_away_fails_calls_at_once(make_server: Any) -> None:
    async with make_server() as srv, FillMaskClient(srv.url) as client:
        with srv.engine.paused():
            held = asyncio.create_task(client.fill_mask(TEXT))
            await wait_until(lambda: srv.engine.queued() == 1)
            drain = asyncio.create_task(srv.drain(timeout=5))
            await wait_until(lambda: client.usable_connections == 0)
            with pytest.raises(OverloadedError) as refused:  # not sent: §10 says send nothing more there
                await client.fill_mask(TEXT)
            assert (refused.value.status, refused.value.reason) == (503, "shutting_down")
            assert refused.value.frame is not None and refused.value.frame["type"] == "going_away"
            assert srv.engine.queued() == 1
        assert len(await asyncio.wait_for(held, 5)) == 5  # the accepted call still got its result
        await asyncio.wait_for(drain, 5)


async def test_without_reconnect_a_client_whose_connection_ended_says_so_and_how_to_go_on(make_server: Any) -> None:
    """A newcomer's trial: after the server drained, ``connect()`` returned None and did nothing, and each
    call failed with "lost (1001 going away ...)" even with a new server up, without saying that this
    client never redials."""
    async with make_server() as srv:
        client = FillMaskClient(srv.url)
        await client.connect()
        await asyncio.wait_for(srv.drain(timeout=5), 10)
        await wait_until(lambda: client.usable_connections == 0 and client.in_flight == 0)
        for attempt in (client.connect(), client.fill_mask(TEXT), client.fill_mask(TEXT)):
            with pytest.raises(ConnectionLostError) as lost:
                await asyncio.wait_for(attempt, 10)
            assert "reconnect=True" in lost.value.message and lost.value.code == 1001, lost.value.message
        await client.close()
        with pytest.raises(ConnectionLostError) as closed:  # closed by its owner: no advice to redial
            await client.fill_mask(TEXT)
        assert "reconnect=True" not in closed.value.message


async def test_a_failed_text_of_fill_mask_many_says_which(make_server: Any) -> None:
    """A newcomer's trial: ``fill_mask_many``'s error did not say which text failed (the wire id is not
    the list's index). A note, shown in the traceback; ``str()`` stays the server's words."""
    async with make_server() as srv, FillMaskClient(srv.url) as client:
        with pytest.raises(RequestError) as failed:
            await client.fill_mask_many([TEXT] * 3 + ["no mask here"] + [TEXT] * 3)
        assert failed.value.code == "no_mask"
        assert failed.value.__notes__ == ["fill_mask_many: text 3 of 7 (from 0): 'no mask here'"]


async def test_a_client_used_on_another_event_loop_says_so_at_once(server: Any) -> None:
    """A newcomer's trial: a client fixture on a module-scoped loop, used by tests on their own loops,
    waited for ever (its connection's reader runs only on the loop it connected on)."""
    other = asyncio.new_event_loop()
    client = FillMaskClient(server.url)

    async def iterate() -> list[Any]:
        return [outcome async for outcome in client.fill_mask_iter([TEXT])]

    try:
        await asyncio.to_thread(other.run_until_complete, client.connect())
        for attempt in (client.fill_mask(TEXT), client.fill_mask_many([TEXT]), iterate(), client.connect(),
                        client.close()):
            with pytest.raises(UsageError, match="another event loop"):
                await asyncio.wait_for(attempt, 10)  # (at once; the old client waited for ever)
    finally:
        await asyncio.to_thread(other.run_until_complete, client.close())
        other.close()
    # Closed, it says so on any loop (a pytest trial: "connected on another event loop" sent the user
    # after the wrong cause), and closing it again is still nothing.
    for attempt in (client.fill_mask(TEXT), client.fill_mask_many([TEXT]), iterate(), client.connect()):
        with pytest.raises(ConnectionLostError, match="was closed"):
            await asyncio.wait_for(attempt, 10)
    await asyncio.wait_for(client.close(), 10)


async def test_redial_waits_a_random_share_of_the_servers_reconnect_window(make_server: Any) -> None:
    windows: list[tuple[int, float | None]] = []

    class Recorded(ReconnectBackoff):
        def delay(self, attempt: int, first_window: float | None = None, rand: Any = random.random) -> float:
            windows.append((attempt, first_window))
            return super().delay(attempt, first_window, rand)

    async with make_server() as a, make_server() as b, \
            FillMaskClient([a.url, b.url], reconnect=True, backoff=Recorded()) as client:
        await asyncio.wait_for(a.drain(timeout=5), 5)
        await wait_until(lambda: bool(windows))
        # The first attempt is spread over going_away's reconnect_within_ms (1000 ms, §10), not made at once.
        assert windows[0] == (0, 1.0)
        assert len(await client.fill_mask(TEXT, top_k=2)) == 2  # meanwhile b carries the calls


async def test_pool_keeps_every_call_answered_through_a_rolling_restart(
    make_server: Any, client_warnings: Callable[[], list[str]]
) -> None:
    # Two servers on fixed ports, restarted in turn (drain: going_away, finish, 1001; then a new process
    # on the same port) while 16 workers keep calling. Every call gets exactly one result.
    async with make_server() as a0, make_server() as b0:
        ports = [a0.port, b0.port]
        urls = [a0.url, b0.url]
    done: list[int] = []
    failed: list[BaseException] = []
    stop = asyncio.Event()

    async def worker(client: FillMaskClient, n: int) -> None:
        while not stop.is_set():
            top_k = 1 + (n + len(done)) % 5
            try:
                answer = await client.fill_mask(TEXT, top_k=top_k)
            except FillMaskError as exc:
                failed.append(exc)
                return
            assert len(answer) == top_k
            done.append(top_k)

    servers = {port: make_server(port=port) for port in ports}
    running = {port: await servers[port].__aenter__() for port in ports}
    client = FillMaskClient(urls, reconnect=True, reconnect_timeout=20)
    try:
        await client.connect()
        workers = [asyncio.create_task(worker(client, n)) for n in range(16)]
        for port in ports:
            before = len(done)
            await wait_until(lambda before=before: len(done) >= before + 50)
            await servers[port].__aexit__(None, None, None)  # drain, close with 1001
            servers[port] = make_server(port=port)
            running[port] = await servers[port].__aenter__()
            await wait_until(lambda srv=running[port]: len(srv.connections) == 1)  # redialled
        await wait_until(lambda: len(done) >= 300)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 10)
    finally:
        stop.set()
        await client.aclose()
        for port in ports:
            await servers[port].__aexit__(None, None, None)
    assert failed == []
    assert not client_warnings()


async def test_pool_with_every_server_down_raises_a_clear_error_not_a_hang(make_server: Any) -> None:
    async with make_server() as a, make_server() as b:
        urls = [a.url, b.url]
        client = FillMaskClient(urls, reconnect=True, reconnect_timeout=1.0)
        await client.connect()
    started = time.monotonic()
    with pytest.raises(ConnectError) as down:
        await asyncio.wait_for(client.fill_mask(TEXT), 10)
    assert time.monotonic() - started < 5  # the reconnect_timeout, not the 10 s guard
    assert "could not reconnect within 1 s" in str(down.value) and "cannot connect" in str(down.value)
    await client.aclose()
    with pytest.raises(ConnectError):  # and a fresh client is refused at once
        await FillMaskClient(urls, connections=2).connect()


async def test_sync_client_with_a_pool(make_server: Any) -> None:
    async with make_server() as a, make_server() as b:
        client = await asyncio.to_thread(SyncFillMaskClient, [a.url, b.url], connections=2)
        try:
            assert len(a.connections) == len(b.connections) == 2
            many = await asyncio.to_thread(client.fill_mask_many, [TEXT] * 20, top_k=2)
            assert [len(answer) for answer in many] == [2] * 20
        finally:
            await asyncio.to_thread(client.close)
        assert results_of(a) + results_of(b) == 20 and results_of(a) > 0 and results_of(b) > 0


# --- connect failures: what waiting can fix, and what it cannot (newcomer's report) ---------------


@contextlib.asynccontextmanager
async def websocket_peer(after_handshake: Callable[[Any], Any]) -> AsyncIterator[str]:
    """A WebSocket server that is not ours (websockets' own, on a real socket): ``after_handshake(ws)``
    is all it does with each connection. Yields its ``ws://`` URL."""

    async def handle(ws: Any) -> None:
        await after_handshake(ws)
        await ws.wait_closed()

    async with serve(handle, "127.0.0.1", 0) as peer:
        yield f"ws://127.0.0.1:{peer.sockets[0].getsockname()[1]}/"


async def say_nothing(ws: Any) -> None:
    """Accept the WebSocket and never send ``hello``."""


async def say_hello_in_protocol_2(ws: Any) -> None:
    await ws.send(orjson.dumps({"type": "hello", "protocol": 2, "model": "other"}).decode())


@contextlib.contextmanager
def http_file_server(directory: Path, protocol: str = "HTTP/1.0") -> Iterator[str]:
    """Python's own ``http.server`` (what ``python3 -m http.server`` runs), in a thread: an HTTP server
    that is not a WebSocket server. Yields its ``ws://`` URL."""
    handler = type("Handler", (http.server.SimpleHTTPRequestHandler,), {
        "protocol_version": protocol, "log_message": lambda self, *args: None})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(directory)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"ws://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


async def connect_failure_of(url: str, wait: float = 10.0, open_timeout: float = 10.0) -> tuple[ConnectError, float]:
    """The ``ConnectError`` that ``connect(wait=wait)`` raises, and how many seconds it took."""
    started = time.monotonic()
    with pytest.raises(ConnectError) as failed:
        await asyncio.wait_for(FillMaskClient(url, open_timeout=open_timeout).connect(wait=wait), wait + 5)
    return failed.value, time.monotonic() - started


def test_which_connect_failures_are_worth_waiting_for() -> None:
    def transient(kind: str, status: int | None = None) -> bool:
        return ConnectError("x", url="ws://x/", kind=kind, http_status=status).transient

    # What a server that is starting, or a balancer with no replica ready, gives: waiting may fix it.
    for kind in ("refused", "reset", "timeout", "unreachable", "unresolved", "gone_before_hello", "no_hello"):
        assert transient(kind), kind
    for status in (408, 429, 502, 503, 504):
        assert transient("http", status), status
    # Wrong address, wrong scheme, wrong server, wrong credentials: the same answer every time.
    for kind in ("tls", "tls_expected", "certificate", "not_websocket", "not_http", "bad_hello",
                 "closed_before_hello", "other"):
        assert not transient(kind), kind
    for status in (200, 301, 400, 401, 403, 404, 421, 426, 500, 501):
        assert not transient("http", status), status
    assert ConnectError("x", url="ws://x/").kind == "other"  # a ConnectError built without a kind is final


async def test_connect_fails_at_once_on_what_waiting_cannot_fix(server: Any, tmp_path: Path) -> None:
    tls_to_plain, took = await connect_failure_of(f"wss://127.0.0.1:{server.port}/")
    assert took < 2 and not tls_to_plain.transient, (took, tls_to_plain)
    assert "use ws:// instead of wss://" in str(tls_to_plain) and "still" not in str(tls_to_plain)
    assert "_ssl.c" not in str(tls_to_plain) and "[SSL" not in str(tls_to_plain), tls_to_plain  # no internals

    async with websocket_peer(say_hello_in_protocol_2) as url:
        other_version, took = await connect_failure_of(url)
    assert took < 2 and other_version.kind == "bad_hello", (took, other_version)
    assert str(other_version) == f"cannot use {url}: server speaks protocol 2, this client speaks 1"

    (tmp_path / "index.html").write_text("<p>not a WebSocket server</p>")
    for protocol in ("HTTP/1.0", "HTTP/1.1"):  # websockets parses the first as not HTTP/1.1, the second as a 200
        with http_file_server(tmp_path, protocol) as url:
            plain_http, took = await connect_failure_of(url)
        message = str(plain_http)
        assert took < 2 and plain_http.kind == "not_websocket", (took, plain_http)
        assert "HTTP server" in message and "not a WebSocket" in message and "wss://" not in message, message

    # A hello that does not come is waited for like a handshake that does not finish (a server that just
    # started may be busy): it is transient, but says what happened, not "TimeoutError: ".
    async with websocket_peer(say_nothing) as url:
        silent, took = await connect_failure_of(url, wait=0, open_timeout=0.5)
    assert took < 2 and silent.kind == "no_hello" and silent.transient, (took, silent)
    assert str(silent) == (f"cannot use {url}: connected, but no hello frame came within 0.5 s "
                           "(is this a fill-mask server?)")

    # One step earlier, a port that takes the TCP connection and never answers the handshake: the
    # message says the connection was made (it said only "timed out after 0.5 s", as for a dead host).
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up

    mute_peer = await asyncio.start_server(mute, "127.0.0.1", 0)
    try:
        url = f"ws://127.0.0.1:{mute_peer.sockets[0].getsockname()[1]}/"
        stalled, took = await connect_failure_of(url, wait=0, open_timeout=0.5)
        # With wss:// the connection is made once TLS is: a port that takes TCP and says nothing may
        # not speak TLS (a review: it read as a host that is down).
        secure, _ = await connect_failure_of(url.replace("ws://", "wss://"), wait=0, open_timeout=0.5)

        # And what a timeout says is of the hop that stalled: here a redirect's (a second review).
        async def to_the_mute_port(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(f"HTTP/1.1 302 Found\r\nLocation: {url.replace('ws://', 'wss://')}\r\n"
                         "Content-Length: 0\r\n\r\n".encode())
            await writer.drain()
            writer.close()

        redirector = await asyncio.start_server(to_the_mute_port, "127.0.0.1", 0)
        try:
            redirected, _ = await connect_failure_of(f"ws://127.0.0.1:{redirector.sockets[0].getsockname()[1]}/",
                                                     wait=0, open_timeout=1)
        finally:
            redirector.close()
    finally:
        mute_peer.close()
    for failure in (secure, redirected):
        assert failure.kind == "timeout" and "no TLS session was made" in str(failure), failure
    assert took < 2 and stalled.kind == "timeout" and stalled.transient, (took, stalled)
    assert str(stalled) == (f"cannot connect to {url}: timed out after 0.5 s: connected, but no answer to the "
                            "WebSocket handshake came (a server too busy to answer, or a port that does not "
                            "speak WebSocket?)")


async def test_connect_keeps_waiting_through_what_a_starting_server_or_balancer_gives() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()  # a TCP proxy whose backend is not up yet: accepts, then closes at once

    async def no_replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    for handler in (hang_up, no_replica):
        proxy = await asyncio.start_server(handler, "127.0.0.1", 0)
        try:
            waited, took = await connect_failure_of(f"ws://127.0.0.1:{proxy.sockets[0].getsockname()[1]}/", wait=1)
        finally:
            proxy.close()
        assert waited.transient and took >= 0.9 and "(still, after trying for 1 s)" in str(waited), (took, waited)
    refused, took = await connect_failure_of(f"ws://127.0.0.1:{free_port()}/", wait=1)
    assert refused.kind == "refused" and took >= 0.9 and "still, after trying for 1 s" in str(refused)


async def test_connect_wait_is_how_long_async_with_and_the_blocking_client_keep_trying() -> None:
    """``connect_wait`` is ``connect(wait=)`` for the clients that connect for you: ``async with`` and
    ``SyncFillMaskClient`` (whose constructor connects)."""
    url = f"ws://127.0.0.1:{free_port()}/"
    started = time.monotonic()
    with pytest.raises(ConnectError, match=r"still, after trying for 1 s"):
        async with FillMaskClient(url, connect_wait=1):
            pass
    assert time.monotonic() - started >= 0.9
    started = time.monotonic()
    with pytest.raises(ConnectError, match=r"still, after trying for 1 s"):
        await asyncio.to_thread(SyncFillMaskClient, url, connect_wait=1)
    assert time.monotonic() - started >= 0.9
    with pytest.raises(ConnectError) as once:  # the default: one try, at once
        async with FillMaskClient(url):
            pass
    assert "still" not in str(once.value)
    with pytest.raises(UsageError, match="connect_wait must be a finite number of seconds >= 0"):
        FillMaskClient(url, connect_wait=math.inf)


async def test_closing_the_blocking_client_while_other_threads_call_ends_every_call(server: Any) -> None:
    """Found by an audit: a call handed to the client's loop just as ``close()`` stopped it waited
    forever. Now each call made while another thread closes the client ends: a result, the
    ``ConnectionLostError`` of a call the close cut short, or of a call made after (once a
    ``RuntimeError``, which is no ``FillMaskError``)."""

    def trials() -> tuple[Counter[str], int]:
        seen: Counter[str] = Counter()
        hung = 0
        for trial in range(8):
            client = SyncFillMaskClient(server.url)
            stop = threading.Event()

            def caller(client: SyncFillMaskClient = client, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    try:
                        client.fill_mask(TEXT, top_k=1)
                        seen["result"] += 1
                    except BaseException as exc:  # (anything else is counted, and fails the test below)
                        seen[type(exc).__name__] += 1
                        if not isinstance(exc, ConnectionLostError) or ("was closed" in str(exc) and client._closing):
                            return  # made after close: no more

            threads = [threading.Thread(target=caller, daemon=True) for _ in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(0.02 + 0.01 * trial)
            client.close()
            stop.set()
            for thread in threads:
                thread.join(10)
                hung += thread.is_alive()
        return seen, hung

    seen, hung = await asyncio.to_thread(trials)
    assert hung == 0 and seen["result"] > 0 and set(seen) <= {"result", "ConnectionLostError"}, seen


async def test_a_token_no_http_header_can_carry_is_a_usage_error_that_does_not_show_it() -> None:
    url = "ws://127.0.0.1:9/"
    for token in ("sec\nret", "secrét", " secret", "secret\r"):
        with pytest.raises(UsageError) as refused:
            FillMaskClient(url, token=token)
        assert "printable ASCII" in str(refused.value) and token.strip() not in str(refused.value)
    FillMaskClient(url, token="s3cret-value_1+/=~")  # what tokens are made of is accepted
    code, out, err = await run_cli("--url", url, "--token", "sec\nret", TEXT)
    assert (code, out) == (2, "") and len(err.splitlines()) == 1 and "printable ASCII" in err and "sec" not in err, err
    # An empty one was told it was not printable ASCII, in words that named no flag (a newcomer's trial).
    with pytest.raises(UsageError, match="token is empty: give the server's token, or token=None to send none"):
        FillMaskClient(url, token="")
    code, out, err = await run_cli("--url", url, "--token", "", TEXT)
    assert (code, out) == (2, "") and err.startswith("fillmask-client: --token is empty: give the server's token"), err


def test_the_commands_wait_for_a_server_outlasts_a_model_load() -> None:
    """A server takes seconds to load its model before its port opens (README: 8-20 s on two cores);
    the command's default --timeout waits longer than that, and says so in --help."""
    assert build_parser().parse_args([]).timeout == 30
    assert "(default: 30)" in " ".join(build_parser().format_help().split())


async def test_close_is_the_async_clients_close_too_and_safe_twice(server: Any) -> None:
    client = FillMaskClient(server.url)
    with pytest.raises(ConnectionLostError, match=r"not connected to .*: await client.connect\(\) first"):
        await client.fill_mask(TEXT)  # before connect(): says what to do, not that a connection was lost
    await client.connect()
    assert await client.fill_mask(TEXT, top_k=1)
    await client.close()
    await client.close()
    await client.aclose()
    with pytest.raises(ConnectionLostError):
        await client.fill_mask(TEXT)


async def test_cli_exits_at_once_with_the_cause_of_a_permanent_connect_failure(server: Any) -> None:
    started = time.monotonic()
    code, out, err = await run_cli("--url", f"wss://127.0.0.1:{server.port}/", TEXT)  # --timeout 30 (default)
    assert time.monotonic() - started < 5 and (code, out) == (3, ""), err
    [line] = err.splitlines()  # no "waiting for the server" lines: it did not wait
    assert line.startswith("fillmask-client: cannot connect to wss://") and "use ws:// instead of wss://" in line

    async with websocket_peer(say_nothing) as url:
        code, out, err = await run_cli("--url", url, "--timeout", "2.5", TEXT)
    assert (code, out) == (3, ""), err
    *waiting, last = err.splitlines()
    # While it waited for the hello it was connected, and said so.
    assert waiting and waiting[0] == "fillmask-client: waiting for the server… (1s): connected, no hello frame yet", err
    assert last == (f"fillmask-client: cannot use {url}: connected, but no hello frame came within 2.5 s "
                    "(is this a fill-mask server?)")


async def test_cli_takes_the_servers_url_from_fillmask_url_and_a_url_flag_wins(server: Any) -> None:
    code, out, _ = await run_cli("-k", "1", TEXT, env={"FILLMASK_URL": server.url})
    assert code == 0 and out.startswith(TEXT + "\n"), out
    code, out, _ = await run_cli("--url", server.url, "-k", "1", TEXT, env={"FILLMASK_URL": "ws://127.0.0.1:9/"})
    assert code == 0 and out.startswith(TEXT + "\n"), out
    code, _, err = await run_cli(TEXT, env={"FILLMASK_URL": "http://127.0.0.1:8765/"})
    assert code == 2 and "$FILLMASK_URL: invalid server URL" in err and "'ws://127.0.0.1:8765/'" in err, err


async def test_cli_401_names_the_commands_own_token_flag(make_server: Any) -> None:
    async with make_server(token="s3cret-value") as srv:
        code, out, err = await run_cli("--url", srv.url, TEXT, env={"FILLMASK_TOKEN": ""})
        assert (code, out) == (3, "") and len(err.splitlines()) == 1, err
        assert "(HTTP 401)" in err and "--token TOKEN" in err and "FILLMASK_TOKEN" in err, err
        assert "query parameter" not in err and "Authorization" not in err, err  # the library's advice
        code, out, err = await run_cli("--url", srv.url, "-k", "1", TEXT, env={"FILLMASK_TOKEN": "s3cret-value"})
        assert (code, err) == (0, "") and out.startswith(TEXT)  # the variable it names does work


async def test_cli_names_ten_failed_texts_of_a_reason_then_counts_the_rest(server: Any) -> None:
    """A newcomer's find: a run of 2,000 texts that a busy server mostly refused printed a line for each
    refused text. Ten are named for each failure reason, then one line says more failed so; the summary
    counts them all, and ``--json`` still prints a line for every text."""
    from fillmask_client.cli import NAMED_PER_REASON

    texts = [TEXT, *(f"no mask in text {n}" for n in range(NAMED_PER_REASON + 15)), TEXT]
    code, _, err = await run_cli("--url", server.url, "-k", "1", *texts)
    named = [line for line in err.splitlines() if "no_mask" in line and line.startswith("fillmask-client: text ")]
    assert code == 1 and len(named) == NAMED_PER_REASON, err
    assert err.count("more texts failed with no_mask: the summary counts them (--json prints") == 1, err
    assert f"{len(texts)} texts: 2 answered, {NAMED_PER_REASON + 15} failed ({NAMED_PER_REASON + 15} no_mask)" in err
    assert len(err.splitlines()) == NAMED_PER_REASON + 2, err
    code, out, err = await run_cli("--url", server.url, "-k", "1", "--json", *texts)
    assert code == 1 and len(out.splitlines()) == len(texts) and "(--json prints" not in err, err
    # --quiet drops the summary, so the texts not named are counted in a line of their own (a review's find).
    code, _, err = await run_cli("--url", server.url, "-k", "1", "--quiet", *texts)
    assert code == 1 and "more texts failed with no_mask: their count follows at the end" in err, err
    assert err.splitlines()[-1] == "fillmask-client: 15 more texts failed with no_mask", err
    assert len(err.splitlines()) == NAMED_PER_REASON + 2, err


async def test_ctrl_c_ends_a_run_of_several_texts_with_its_summary(make_server: Any) -> None:
    """And SIGTERM (``timeout(1)``, a supervisor): an application developer's trial found it ended the run
    with 143 and no summary; it now says how far the run got too, ``terminated; ...``, and exits 143."""
    texts = ["no mask here", *(f"Text {n} is the [MASK] one." for n in range(4))]
    async with make_server() as srv:
        for json_flag, sent, status, word in (([], signal.SIGINT, 130, "interrupted"),
                                              (["--json"], signal.SIGINT, 130, "interrupted"),
                                              ([], signal.SIGTERM, 143, "terminated")):
            with srv.engine.paused():
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "fillmask_client", "--url", srv.url, "-c", "3", *json_flag, cwd=ROOT,
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
                assert proc.stdin is not None and proc.stderr is not None
                proc.stdin.write("\n".join(texts).encode())
                proc.stdin.close()
                failed = await asyncio.wait_for(proc.stderr.readline(), 20)
                assert b"text 1" in failed and b"no_mask" in failed
                await wait_until(lambda: srv.engine.queued() == 3)  # -c 3: text 1 failed, texts 2 to 4 queued
                proc.send_signal(sent)
                out, err = await asyncio.wait_for(proc.communicate(), 20)
                await wait_until(lambda: srv.engine.queued() == 0)  # it closed its connection: nothing left
            assert proc.returncode == status, err
            assert err.decode() == f"fillmask-client: {word}; 5 texts: 0 answered, 1 failed (1 no_mask), " \
                                   "4 not answered\n"
            if json_flag:  # what was printed before the interrupt stays printed
                assert [frame["code"] for frame in map(orjson.loads, out.splitlines())] == ["no_mask"]


# --- a newcomer's trial: URLs with spaces, connections past a server's handshake bound, TLS by address,
# --- an endless input ----------------------------------------------------------------------------------


async def test_a_url_with_a_space_or_a_control_character_is_a_usage_error_before_anything_is_sent() -> None:
    """"ws://127.0.0.1:PORT/ " (a copy's stray space), a space in the path or the token, or two URLs in
    $FILLMASK_URL were sent as they were: the server answered 400, and the command exited 3. The
    README says a malformed URL is a usage error (2), said before anything is sent."""
    connected = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connected
        connected += 1
        writer.close()

    listener = await asyncio.start_server(count, "127.0.0.1", 0)
    try:
        url = f"ws://127.0.0.1:{listener.sockets[0].getsockname()[1]}/"
        bad = {url + " ": "contains a space at its end", url + "a b": "contains a space at character",
               url + "?token=se same": "contains a space at character", url + "\t": "control character (U+0009)"}
        for each, words in bad.items():
            with pytest.raises(UsageError, match=re.escape(words)):
                FillMaskClient(each)
            code, out, err = await run_cli("--url", each, "--timeout", "1", TEXT)
            assert_usage_error(code, err, "--url: invalid server URL", words, "%")
            assert out == "" and "se same" not in err  # (the token stays hidden)
        code, out, err = await run_cli("--timeout", "1", TEXT, env={"FILLMASK_URL": f"{url} {url}"})
        assert_usage_error(code, err, "$FILLMASK_URL", "more than one URL", "--url URL, repeated")
        assert connected == 0  # nothing was sent
    finally:
        listener.close()


async def test_hundreds_of_connections_open_past_the_servers_bound_on_unfinished_handshakes(
        make_server: Any) -> None:
    """--connections 300 opened 256: the client dialled all at once, and the server resets handshakes past
    its bound of unfinished ones (256); the line saying so lacked the command's prefix (a library logger's
    bare line). The client now has a bounded number of handshakes under way at once."""
    async with make_server() as srv:  # (--max-connections 1000, the default)
        assert srv.config.max_connections >= 300
        async with FillMaskClient(srv.url, connections=300) as client:
            assert client.usable_connections == 300
            assert len(await client.fill_mask_many([TEXT] * 10)) == 10
    async with make_server(max_connections=3) as srv:  # the library's warning, said as the command's line
        code, out, err = await run_cli("--url", srv.url, "--connections", "5", "-k", "1", TEXT)
        assert code == 0 and out.startswith(TEXT), err
        assert err.startswith("fillmask-client: 2 of 5 connections could not be opened: ") and len(
            err.splitlines()) == 1, err


async def test_a_certificate_for_another_address_says_so_not_to_pass_cafile(make_server: Any, tmp_path: Path) -> None:
    """A certificate for DNS:localhost only, reached as wss://127.0.0.1:PORT/ with it trusted: the advice
    was to pass --cafile, which the user had done. OpenSSL's IP address mismatch (64) now reads as its
    host name mismatch (62) does, in an address's words."""
    cert, key = await self_signed(tmp_path, "DNS:localhost")
    async with make_server(certfile=str(cert), keyfile=str(key)) as srv:
        assert srv.url.startswith("wss://127.0.0.1:")
        with pytest.raises(ConnectError) as mismatch:
            await FillMaskClient(srv.url, ssl=ssl.create_default_context(cafile=str(cert))).connect()
        message = str(mismatch.value)
        assert mismatch.value.kind == "certificate" and not mismatch.value.transient, message
        assert "it is not for the address '127.0.0.1'; connect with a host name or address it was issued for" in (
            message) and "cafile" not in message, message
        code, _, err = await run_cli("--url", srv.url, "--cafile", str(cert), "-q", TEXT)
        assert code == 3 and "connect with a host name or address it was issued for" in err, err
        assert "--cafile" not in err and len(err.splitlines()) == 1, err


class EndlessInput(io.RawIOBase):
    """An input that never ends (``/dev/urandom``, a pipe that is never closed): one good line, then bytes
    that are not UTF-8, for ever; it fails the test once read far past the first of those."""

    BOUND = 64 * 2**20

    def __init__(self) -> None:
        super().__init__()
        self.served = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        assert self.served < self.BOUND, "read on past the first byte that is not UTF-8"
        head = b"good [MASK]\n" if self.served == 0 else b""
        data = (head + b"\xff" * len(buffer))[: len(buffer)]
        buffer[: len(data)] = data
        self.served += len(data)
        return len(data)


def test_an_endless_input_that_is_not_utf8_is_refused_at_its_first_bad_byte(tmp_path: Path) -> None:
    """--file /dev/urandom hung until killed (holding ever more memory): the whole input was read before
    it was decoded. It is now decoded as it is read, and refused at its first byte that is not UTF-8,
    with the words a finite file gets."""
    for stream in (io.BufferedReader(EndlessInput()), EndlessInput()):
        with pytest.raises(BadInput, match=r"^standard input: line 2 is not valid UTF-8 \(byte 0xff\); save it"):
            collect_texts(build_parser().parse_args(["-"]), stream)  # type: ignore[arg-type]

    # The command, reading a FIFO that a thread keeps writing (up to a bound it should never reach).
    fifo = tmp_path / "endless"
    os.mkfifo(fifo)
    bound = 64 * 2**20
    wrote = 0

    def feed() -> None:
        nonlocal wrote
        with contextlib.suppress(BrokenPipeError), open(fifo, "wb") as pipe:
            pipe.write(b"first [MASK]\n")
            while wrote < bound:
                pipe.write(b"\xff" * 65536)
                wrote += 65536

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        command = subprocess.run([sys.executable, "-m", "fillmask_client", "--file", str(fifo)], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    finally:
        if writer.is_alive():  # (a command that never opened the FIFO: let the writer's open return)
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(30)
    assert_usage_error(command.returncode, command.stderr, f"--file {fifo}: line 2 is not valid UTF-8 (byte 0xff)")
    assert wrote < bound, "the command read the whole input before it looked at it"
