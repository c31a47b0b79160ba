"""The demo page (web_demo/) in a real headless Chromium, against the real server on the tiny model.

Each test opens the page as a person would (served by the server itself at ``GET /``), drives it
with the keyboard and mouse through Playwright, and checks what is rendered against what the server
sent: the frames the page sent and received (captured from the browser's own WebSocket) and,
independently, a reference request made over a separate connection. Controls are exercised at
desktop (1280x900) and phone (375x812) sizes. The pure helpers of ``web_demo/lib.js`` and
``web_demo/live.js`` are also called directly in the page (``page.evaluate``); ``web_demo/client.js``
(the connection, without DOM) has unit tests of its own under Node (``tests/web_demo_client.test.cjs``).

Needs Debian's ``chromium`` and the ``playwright`` Python package (``bash scripts/setup.sh --test``).
Without them the tests skip and say how to install them, except in CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
import pytest
from websockets.asyncio.client import connect

from fillmask_server.config import BROWSER_BLOCKED_PORTS
from fillmask_server.protocol import STATS_INTERVAL_MS
from tests.wire import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
CLIENT_JS_TESTS = ROOT / "tests" / "web_demo_client.test.cjs"
CLIENT_JS_PROPERTIES = ROOT / "tests" / "web_demo_client_properties.test.cjs"  # seeded random sessions
# Where a Node.js without a built-in WebSocket (18, 20) finds the ws package (npm ci there).
WS_PACKAGE_DIR = ROOT / "examples" / "js-client" / "node_modules"
ARTIFACTS = ROOT / "test-artifacts"
README_SCREENSHOT = ROOT / "web_demo" / "screenshot.png"
README_PHONE_SCREENSHOT = ROOT / "web_demo" / "screenshot-phone.png"
INSTALL_HINT = ("install them with `bash scripts/setup.sh --test` (Debian's chromium and the playwright "
                "package), or set FILLMASK_CHROMIUM to a Chromium binary")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 375, "height": 812}
PORTRAIT = {"width": 1280, "height": 1200}  # the README's picture: room for the burst's cards too
SIZES = pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])


def _unavailable(reason: str) -> None:
    """Skip with a how-to where the browser truly is missing; in CI that is a failure."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the demo-page test: {INSTALL_HINT}", pytrace=False)
    pytest.skip(f"{reason}; {INSTALL_HINT}")


def _node_or_skip() -> str:
    node = shutil.which("node")
    if node is None:
        _unavailable("Node.js is not installed")
    assert node is not None
    return node


def _find_chromium() -> str | None:
    configured = os.environ.get("FILLMASK_CHROMIUM")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    for candidate in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        found = shutil.which(candidate)
        if found:
            return found
    return None


@contextlib.asynccontextmanager
async def chromium_launched() -> AsyncIterator[Any]:
    """Chromium through Playwright, closed on the way out; a skip (a failure in CI) where either is
    missing. A launch failure with the browser present is a real failure, not a skip."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        _unavailable("the playwright Python package is not installed")
    executable = _find_chromium()
    if executable is None:
        _unavailable("no Chromium found (looked for FILLMASK_CHROMIUM, /usr/bin/chromium, chromium)")
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            await chromium.close()


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    """One Chromium for the module."""
    async with chromium_launched() as chromium:
        yield chromium


class Page:
    """One browser tab on the demo page, with the frames its WebSockets sent and received."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.frames: list[dict[str, Any]] = []  # received, in order
        self.sent: list[dict[str, Any]] = []
        self.raw_in: list[str] = []
        self.raw_out: list[str] = []
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        # A Content-Security-Policy violation is only a console message: count it as an error too.
        page.on("console", lambda message: self.errors.append(message.text)
                if "Content Security Policy" in message.text else None)
        page.on("websocket", self._watch)

    def _watch(self, ws: Any) -> None:
        ws.on("framereceived", self._received)
        ws.on("framesent", self._sent)

    def _received(self, payload: str) -> None:
        self.raw_in.append(payload)
        self.frames.append(orjson.loads(payload))

    def _sent(self, payload: str) -> None:
        self.raw_out.append(payload)
        self.sent.append(orjson.loads(payload))

    def by(self, test_id: str) -> Any:
        return self.page.get_by_test_id(test_id)

    def card(self, request_id: int) -> Any:
        return self.page.locator(f'[data-testid="request-card"][data-id="{request_id}"]')

    def burst(self, n: int) -> Any:
        return self.page.locator(f'[data-testid="burst-card"][data-burst="{n}"]')

    async def frame_for(self, request_id: int) -> dict[str, Any]:
        """The one frame the page received about ``request_id`` (its terminal frame, §8)."""
        await wait_until(lambda: any(f.get("id") == request_id for f in self.frames))
        frames = [f for f in self.frames if f.get("id") == request_id]
        assert len(frames) == 1, frames
        return frames[0]

    def sent_for(self, request_id: int) -> dict[str, Any]:
        frames = [f for f in self.sent if f.get("type") == "fill_mask" and f.get("id") == request_id]
        assert len(frames) == 1, frames
        return frames[0]

    async def ask(self, text: str) -> None:
        """Type ``text`` into the sentence box and press Enter."""
        box = self.by("text-input")
        await box.fill(text)
        await box.press("Enter")

    async def send_burst(self, n: int) -> None:
        await self.by("burst-size").fill(str(n))
        await self.by("burst-send").click()

    async def wait_connected(self) -> None:
        from playwright.async_api import expect

        await expect(self.by("conn-status")).to_have_attribute("data-state", "connected", timeout=10_000)


@pytest.fixture
async def open_page(browser: Any) -> AsyncIterator[Callable[..., Any]]:
    """``await open_page(url, viewport=...)``: a fresh browser context on ``url``, connected."""
    contexts = []
    pages: list[Page] = []

    async def opener(url: str, viewport: dict[str, int] = DESKTOP, wait: bool = True) -> Page:
        context = await browser.new_context(viewport=viewport, color_scheme="light", reduced_motion="reduce",
                                            permissions=["clipboard-read", "clipboard-write"])
        contexts.append(context)
        page = Page(await context.new_page())
        pages.append(page)
        await page.page.goto(url)
        if wait:
            await page.wait_connected()
        return page

    yield opener
    for context in contexts:
        await context.close()
    for page in pages:
        assert not page.errors, f"JavaScript errors on the page: {page.errors}"


async def reference(url: str, frame: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(hello, answer) for one request sent on a connection of our own (no request: answer None)."""
    async with connect(url) as ws:
        hello = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        if frame is None:
            return hello, None
        await ws.send(orjson.dumps(frame).decode())
        return hello, orjson.loads(await asyncio.wait_for(ws.recv(), 10))


async def run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``argv`` in the checkout; ``env``: variables to set on top of this process's."""
    process = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE,
                                                   env={**os.environ, **env} if env else None)
    out, err = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode or 0, out.decode(), err.decode()


def expected_filled(text: str, mask: str, fills: list[str]) -> str:
    """The user's text with each mask replaced by its chosen word (word pieces join the word before)."""
    parts = text.split(mask)
    out = parts[0]
    for fill, part in zip(fills, parts[1:], strict=True):
        if fill.startswith("##") and len(fill) > 2:
            fill = fill[2:]
            out = out[:-1] if out.endswith((" ", "\t")) else out
        out += fill + part
    return out


async def rendered(card: Any) -> dict[str, Any]:
    """A card's predictions as shown: its filled-in sentence and each prediction list's rows."""
    return await card.evaluate("""card => ({
        filled: (card.querySelector('[data-testid=filled-sentence]') || {}).textContent,
        marks: Array.from(card.querySelectorAll('[data-testid=filled-sentence] mark')).map(m => m.textContent),
        lists: Array.from(card.querySelectorAll('[data-testid=prediction-list]')).map(list =>
            Array.from(list.querySelectorAll('[data-testid=prediction]')).map(li => ({
                rank: Number(li.dataset.rank),
                token: Number(li.dataset.token),
                token_str: li.dataset.tokenStr,
                score: Number(li.dataset.score),
                sequence: li.dataset.sequence,
                shown_token: li.querySelector('[data-testid=prediction-token]').textContent,
                special: li.querySelector('[data-testid=prediction-token]').classList.contains('special'),
                note: li.querySelector('[data-testid=prediction-token]').title,
                shown_score: li.querySelector('[data-testid=prediction-score]').textContent,
                bar_percent: parseFloat(li.querySelector('.fill').style.width),
                visible: li.getBoundingClientRect().height > 0,
            }))),
    })""")


def assert_rendered_as_sent(shown: dict[str, Any], text: str, mask: str, predictions: list[Any]) -> None:
    """The rows show exactly the frame's predictions, in its order, with honest scores and bars; the
    filled-in sentence is the text with each mask's top candidate, without special tokens (§4)."""
    groups = predictions if predictions and isinstance(predictions[0], list) else [predictions]
    assert len(shown["lists"]) == len(groups)
    for rows, group in zip(shown["lists"], groups, strict=True):
        assert [row["rank"] for row in rows] == list(range(1, len(group) + 1))
        for row, pred in zip(rows, group, strict=True):
            assert row["visible"]
            assert (row["token"], row["token_str"]) == (pred["token"], pred["token_str"])
            if pred["token_str"].isascii() and pred["token_str"].isprintable() and pred["token_str"].strip():
                assert row["shown_token"] == pred["token_str"]
            assert row["score"] == pred["score"]  # the exact number the frame carried
            assert row["shown_score"].endswith("%")
            percent = float(row["shown_score"][:-1])
            assert percent == pytest.approx(pred["score"] * 100, rel=5e-3), row  # 3 significant digits
            assert row["bar_percent"] == pytest.approx(pred["score"] * 100, abs=1e-3)  # CSS keeps ~6 digits
    tops = [rows[0]["shown_token"] for rows in shown["lists"]]
    assert shown["filled"] == "Filled in: " + expected_filled(text, mask, tops)
    assert len(shown["marks"]) == len(groups)
    for special in ("[CLS]", "[SEP]", mask):
        assert special not in shown["filled"], shown["filled"]


def assert_same_as_reference(got: list[Any], expected: list[Any]) -> None:
    """Same tokens in the same order as an independent request; scores within protocol.md §4's 1e-4."""
    groups = got if got and isinstance(got[0], list) else [got]
    expected_groups = expected if expected and isinstance(expected[0], list) else [expected]
    assert len(groups) == len(expected_groups)
    for g, e in zip(groups, expected_groups, strict=True):
        assert [(p["token"], p["token_str"], p["sequence"]) for p in g] == \
               [(p["token"], p["token_str"], p["sequence"]) for p in e]
        for p, q in zip(g, e, strict=True):
            assert abs(p["score"] - q["score"]) <= 1e-4


def assert_metric(card_metrics: dict[str, dict[str, str]], key: str, value: float) -> None:
    metric = card_metrics[key]
    assert float(metric["value"]) == value
    shown = float(metric["text"].split()[0])
    # Half the last digit shown, and a hair more: 1.45 is 1.4499999... in binary, shown as 1.4.
    assert shown == pytest.approx(value, abs=(0.05 if value < 10 else 0.5) + 1e-9)


async def metrics(card: Any) -> dict[str, dict[str, str]]:
    return await card.evaluate("""card => Object.fromEntries(
        Array.from(card.querySelectorAll('[data-testid=metrics] .metric')).map(m => [m.dataset.testid,
            {value: m.dataset.value, text: m.querySelector('.metric-value').textContent}]))""")


async def position(locator: Any) -> dict[str, float]:
    """Where an element is in the window, and where the sticky header ends."""
    return await locator.evaluate("""e => { const r = e.getBoundingClientRect();
        return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, height: innerHeight,
                width: innerWidth, header: document.querySelector('.top-bar').getBoundingClientRect().bottom}; }""")


async def assert_in_view(locator: Any, below_header: bool = True) -> None:
    """The element is wholly inside the window (and not under the sticky header)."""
    box = await position(locator)
    top = box["header"] if below_header else 0
    assert top - 1 <= box["top"] and box["bottom"] <= box["height"] + 1, box
    assert box["left"] >= 0 and box["right"] <= box["width"] + 1, box


def pretty_json(value: Any, indent: str = "") -> str:
    """What the frame log shows for a frame (lib.js prettyJson), written again from its rule: containers
    that hold containers get one member per line, indented by two; those that hold only scalars stay on one line."""
    if not isinstance(value, dict | list):
        return orjson.dumps(value).decode()
    members = list(value.values()) if isinstance(value, dict) else value
    brackets = "{}" if isinstance(value, dict) else "[]"
    if not members:
        return brackets
    flat = not any(isinstance(m, dict | list) for m in members)
    inner = "" if flat else indent + "  "
    keys = [orjson.dumps(k).decode() + ": " for k in value] if isinstance(value, dict) else [""] * len(members)
    parts = [inner + k + pretty_json(m, inner) for k, m in zip(keys, members, strict=True)]
    if flat:
        return brackets[0] + ", ".join(parts) + brackets[1]
    return brackets[0] + "\n" + ",\n".join(parts) + "\n" + indent + brackets[1]


def tokens_of(predictions: list[Any]) -> list[Any]:
    groups = predictions if predictions and isinstance(predictions[0], list) else [predictions]
    return [[p["token"] for p in g] for g in groups]


# ---------------------------------------------------------------------------- client.js


def test_client_js_unit_tests() -> None:
    """web_demo/client.js under Node (no browser): the state table and its one transition function,
    backoff, drains, ids, and the overloaded reasons and error codes checked against protocol/schemas; and
    500 seeded random sessions against a scripted socket and clock, checking the invariants of its header
    comment after every step (they found a ``connect()`` from a lost request's callback orphaning a socket)."""
    node = _node_or_skip()
    done = subprocess.run([node, "--test", str(CLIENT_JS_TESTS), str(CLIENT_JS_PROPERTIES)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"^# pass [1-9]", done.stdout, re.M) and re.search(r"^# fail 0$", done.stdout, re.M), done.stdout
    assert re.search(r"^# todo 0$", done.stdout, re.M), done.stdout


# ---------------------------------------------------------------------------- predictions


async def test_page_renders_the_servers_predictions(server: Any, open_page: Any) -> None:
    """Typed with the keyboard and the mask button, sent with Enter: what is drawn is what the server sent."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    hello, _ = await reference(server.url, None)
    mask = hello["mask_token"]
    await expect(page.by("model-name")).to_have_text(hello["model"])
    await expect(page.by("mask-token")).to_have_text(mask)

    box = page.by("text-input")
    await box.fill("")
    await box.press_sequentially("Paris is the ")
    await page.by("insert-mask").click()
    await box.press_sequentially(" of France.")
    text = f"Paris is the {mask} of France."
    assert await box.input_value() == text
    await box.press("Alt+m")  # the shortcut, in the sentence box: a mask at the cursor
    assert (await box.input_value()).count(mask) == 2
    await box.fill(text)
    await page.by("options").locator("summary").click()
    await page.by("targets").press("Alt+m")  # in another field it is not for the sentence (a review)
    assert await box.input_value() == text
    await page.by("options").locator("summary").click()
    await page.by("top-k").fill("7")
    await box.press("Enter")

    card = page.card(1)
    await expect(card).to_have_attribute("data-state", "done")
    await expect(card.get_by_test_id("card-id")).to_have_text("#1")
    result = await page.frame_for(1)
    assert result["type"] == "result" and len(result["predictions"]) == 7
    assert_rendered_as_sent(await rendered(card), text, mask, result["predictions"])
    _, expected = await reference(server.url, {"type": "fill_mask", "id": "ref", "text": text, "top_k": 7})
    assert_same_as_reference(result["predictions"], expected["predictions"])

    shown = await metrics(card)
    assert_metric(shown, "metric-queue-ms", result["queue_ms"])
    assert_metric(shown, "metric-inference-ms", result["inference_ms"])
    assert int(shown["metric-batch-size"]["value"]) == result["batch_size"] >= 1
    assert int(shown["metric-batch-id"]["value"]) == result["batch_id"]

    # Two masks: one ranked list per mask, in text order, and ONE clean filled-in sentence (the
    # pipeline's sequence for several masks keeps [CLS], [SEP] and the other mask: not shown as such).
    two = f"The {mask} sat on the {mask}."
    await page.ask(two)
    card = page.card(2)
    await expect(card).to_have_attribute("data-state", "done")
    await expect(card.locator(".mask-title")).to_have_text(["Mask 1 of 2", "Mask 2 of 2"])
    result = await page.frame_for(2)
    assert "[CLS]" in result["predictions"][0][0]["sequence"]  # what the wire carries, unchanged (§4)
    shown_two = await rendered(card)
    assert_rendered_as_sent(shown_two, two, mask, result["predictions"])
    _, expected = await reference(server.url, {"type": "fill_mask", "id": "ref", "text": two, "top_k": 7})
    assert_same_as_reference(result["predictions"], expected["predictions"])

    # Choosing another row of the first list (keyboard: arrow down) changes only the first mask's word.
    first_list = card.get_by_test_id("prediction-list").first
    await first_list.locator(".pred-button").first.focus()
    await page.page.keyboard.press("ArrowDown")
    await expect(first_list.locator(".pred-button").nth(1)).to_be_focused()
    second = shown_two["lists"][0][1]["shown_token"]
    top_of_second_mask = shown_two["lists"][1][0]["shown_token"]
    await expect(card.get_by_test_id("filled-sentence")).to_have_text(
        "Filled in: " + expected_filled(two, mask, [second, top_of_second_mask]))


async def test_error_frame_is_shown_on_its_card(server: Any, open_page: Any) -> None:
    """A sentence without a mask is sent anyway; the server's error message appears on that card."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    text = "This sentence has nothing to fill."
    await page.ask(text)
    card = page.card(1)
    await expect(card).to_have_attribute("data-state", "error")
    _, expected = await reference(server.url, {"type": "fill_mask", "id": 1, "text": text})
    assert expected["code"] == "no_mask"
    await expect(card.get_by_test_id("card-message")).to_have_text(expected["message"])
    await expect(card.get_by_test_id("card-status")).to_contain_text("no_mask")
    await expect(card.get_by_test_id("card-status")).to_have_attribute("title", "no_mask: the text has no mask token")
    await expect(card.get_by_test_id("predictions")).to_be_empty()
    await expect(page.by("inflight")).to_have_attribute("data-count", "0")


async def test_a_result_the_page_cannot_read_ends_its_card_as_an_error(server: Any, open_page: Any) -> None:
    """A ``result`` whose predictions are not lists of objects threw while its card was drawn, and the
    card stayed "Waiting" for good with a Cancel that did nothing (found by a review). The stand-in
    server here answers the first two requests so; a second request on it still works. Its third
    answer tells the page to wait 1e12 ms, which is held to a minute (it said "1000000000.0 s")."""
    from playwright.async_api import expect
    from websockets.asyncio.server import serve

    async with connect(server.url) as ws:
        hello = await ws.recv()

    async def bad_server(ws: Any) -> None:
        await ws.send(hello)
        async for message in ws:
            frame = orjson.loads(message)
            if frame.get("type") == "fill_mask" and frame["id"] == 3:  # a wait hint far too long
                await ws.send(orjson.dumps({"type": "overloaded", "id": 3, "status": 503, "reason": "queue_full",
                                            "retry_after_ms": 1e12}).decode())
            elif frame.get("type") == "fill_mask":
                predictions = [None] if frame["id"] == 1 else {"a": 1}
                await ws.send(orjson.dumps({"type": "result", "id": frame["id"], "predictions": predictions,
                                            "queue_ms": 1, "inference_ms": 1, "batch_size": 1,
                                            "batch_tokens": 8, "batch_id": 1}).decode())

    async with serve(bad_server, "127.0.0.1", 0) as stand_in:
        port = stand_in.sockets[0].getsockname()[1]
        page = await open_page(f"{server.http_url}/?ws=ws://127.0.0.1:{port}/")
        for number in (1, 2):
            await page.ask("Paris is the [MASK] of France.")
            card = page.card(number)
            await expect(card).to_have_attribute("data-state", "error")
            await expect(card.get_by_test_id("card-message")).to_contain_text("cannot read")
        await expect(page.by("inflight")).to_have_attribute("data-count", "0")
        await page.ask("Paris is the [MASK] of France.")  # told to wait 1e12 ms: held to a minute, as the client
        await expect(page.card(3).get_by_test_id("card-message")).to_contain_text("retry after 60.0 s")


async def test_the_page_is_served_with_its_security_headers(server: Any) -> None:
    """Defence in depth beside showing server text as text only (a review found no injection, and no
    such headers): its scripts only from the server, never framed by another site, no type guessing.
    Every page test fails on a console message about the policy (``Page``), so the page runs under it."""
    import urllib.request

    def headers(path: str) -> Any:
        with urllib.request.urlopen(server.http_url + path, timeout=5) as answer:
            return answer.headers

    for path in ("/", "/app.js", "/style.css"):
        got = await asyncio.to_thread(headers, path)
        policy = got["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy, path
        assert got["X-Content-Type-Options"] == "nosniff"


async def test_tokens_are_shown_readably(server: Any, open_page: Any) -> None:
    """Unused vocabulary entries are marked as such, and no token is drawn as a missing-glyph box: a
    character this device has no font for is shown as its code point (U+....), with a note."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    await page.by("options").locator("summary").click()
    targets = ["[unused12]", "ு", "漢", "ཀ", "capital"]  # ཀ is not in the vocabulary: [UNK]
    await page.by("targets").fill(", ".join(targets))
    await page.by("top-k").fill("10")
    await page.ask("A [MASK] here.")
    card = page.card(1)
    await expect(card).to_have_attribute("data-state", "done")
    result = await page.frame_for(1)
    rows = {row["token_str"]: row for row in (await rendered(card))["lists"][0]}
    assert set(rows) == {p["token_str"] for p in result["predictions"]} >= {"[unused12]", "[UNK]", "capital"}
    assert rows["[unused12]"]["special"] and "unused" in rows["[unused12]"]["note"]
    assert rows["[UNK]"]["special"]
    assert rows["capital"]["shown_token"] == "capital" and not rows["capital"]["note"]
    boxes = await card.evaluate("""card => {
        const missing = FillMask.lib.glyphProbe('600 16px ' + getComputedStyle(document.body).fontFamily);
        return Array.from(card.querySelectorAll('[data-testid=prediction]')).map(li => ({
            raw: li.dataset.tokenStr,
            raw_missing: [...li.dataset.tokenStr].some(missing),
            shown_missing: [...li.querySelector('.tok').textContent].some(missing),
        }));
    }""")
    for b in boxes:
        assert not b["shown_missing"], b
        if b["raw_missing"]:  # on this device: shown by code point, with a note saying why
            row = rows[b["raw"]]
            assert "U+" in row["shown_token"] and "no font" in row["note"], row
    # result.targets (§4), when the server sends it, is one note per target scored as another token
    # (the scored token shown readably, as the predictions are).
    notes = card.get_by_test_id("targets-note")
    await expect(notes).to_have_count(len(result.get("targets", [])))
    assert await notes.evaluate_all("ns => ns.map(n => ({given: n.dataset.given, scored: n.dataset.scored}))") == \
        result.get("targets", [])
    for note, target in zip(await notes.all_text_contents(), result.get("targets", []), strict=True):
        assert note.startswith(f'Note: target "{target["given"]}" was scored as "'), note

    if not result.get("targets"):
        await expect(card.get_by_test_id("card-notes")).to_be_hidden()


async def test_pure_helpers_in_the_browser(server: Any, open_page: Any) -> None:
    """lib.js called directly: counting, filling, readable tokens, accounting, snippets, diagnosis."""
    page = await open_page(server.http_url + "/")
    got = await page.page.evaluate("""() => {
        const L = FillMask.lib;
        const never = () => false;
        const join = (segs) => segs.map(s => s.text).join('');
        return {
            chars: [L.codePoints('😀a'), L.codePoints('é'), L.codePoints('')],
            targets: [L.parseTargets(''), L.parseTargets(' , ,'), L.parseTargets(' capital ,city,, ')],
            filled: [
                join(L.filledSegments('The [MASK] sat on the [MASK].', '[MASK]', ['cat', 'mat'])),
                join(L.filledSegments('A big [MASK] here', '[MASK]', ['##gest'])),
                join(L.filledSegments('Hello <mask> world', '<mask>', [' there'])),
                L.filledSegments('[MASK] and [MASK]', '[MASK]', ['x', 'y']).map(s => s.mask),
                join(L.excerptSegments(L.filledSegments('abcdef [MASK] ghijkl [MASK] mn', '[MASK]', ['X', 'Y']), 2)),
                join(L.excerptSegments(L.filledSegments('ab [MASK] c', '[MASK]', ['X']), 2)),
            ],
            tokens: ['\\u0085', '\\uE000', '\\u200d', ' ', '##\\u0BC1', '[unused12]', 'capital', '']
                .map(t => L.readableToken(t, never)),
            tally: L.tally(['done', 'cancelled', 'cancelled', 'overloaded', 'error', 'lost', 'pending']),
            tallyText: L.tallyText(L.tally(['done', 'done', 'cancelled', 'pending'])),
            clip: [L.clipText('short [MASK]', 300, '[MASK]'), L.clipText('ab[MASK]cd', 4, '[MASK]'),
                   L.clipText('😀😀😀', 2, '[MASK]'), L.clipText('x'.repeat(12345), 300, '[MASK]').more],
            pretty: [L.prettyJson({type: 'x', a: [1, 'b'], o: {p: [{q: null}]}, e: [], f: {}}),
                     L.logText('not json {'), L.formatCount(50012),
                     L.logText(JSON.stringify({token_str: '\u202eevil\u202c', s: 'a\u200bb\u0085\ud83d\ude00'})),
                     L.logText('raw \u2028 \udb40\udc01')],
            frameLog: (() => {
                const log = new L.FrameLog(10, 1000);
                for (let i = 0; i < 3; i++) log.add('in', '{"type": "result"}', 'result', i);
                for (let i = 0; i < 5; i++) log.add('in', '{"type": "stats"}', 'stats', i);
                const removed = log.takeRemoved();
                for (let i = 0; i < 9; i++) log.add('out', '{"type": "fill_mask"}', 'fill_mask', i);
                return {types: log.entries.map(e => e.type).join(' '), removed, again: log.takeRemoved(),
                        dropped: log.dropped};
            })(),
            diagnosis: [
                {pageProtocol: 'file:', pageOrigin: 'null', reachable: true},
                {pageProtocol: 'file:', pageOrigin: 'null', reachable: false},
                {reachable: true, ready: 'ready'},
                {reachable: true, ready: 'draining'},
                {reachable: true, restarting: true},
                {reachable: false, everConnected: true, attempts: 4},
                {reachable: false, everConnected: true, attempts: 5},
                {reachable: true, ready: 'ready', url: 'ws://127.0.0.1:8765/?token=***'},
                {reachable: true, ready: null, fillMask: false},
                {pageProtocol: 'file:', pageOrigin: 'null', reachable: true, url: 'ws://127.0.0.1:8765/?token=***'},
                {reachable: true, ready: null, unavailable: true, everConnected: true, attempts: 1},
                {reachable: true, ready: 'ready', tokenRequired: false},
                {reachable: true, ready: 'ready', tokenRequired: true},
            ].map(f => L.diagnose(Object.assign({url: 'ws://127.0.0.1:8765/', pageProtocol: 'http:',
                                                 pageOrigin: 'http://127.0.0.1:8765'}, f))),
        };
    }""")
    assert got["chars"] == [len("😀a"), len("é"), 0] == [2, 1, 0]
    assert got["targets"] == [None, [], ["capital", "city"]]
    assert got["filled"][:3] == ["The cat sat on the mat.", "A biggest here", "Hello there world"]
    assert got["filled"][3] == [0, -1, 1]
    assert got["filled"][4:] == ["…f X g…l Y mn", "ab X c"]  # a long text: only the words around each mask
    control, private, joiner, space, mark, unused, word, empty = got["tokens"]
    assert control["text"] == "⟨U+0085⟩" and "control" in control["note"]
    assert private["text"] == "⟨U+E000⟩" and "private" in private["note"]
    assert joiner["text"] == "⟨U+200D⟩"
    assert space["text"] in ("␣", "(space)") and "U+0020" in space["note"]
    assert mark["text"] == "##◌\u0bc1"  # a combining mark alone sits on a dotted circle
    assert unused["special"] and unused["text"] == "[unused12]"
    assert word == {"text": "capital", "note": "", "special": False}
    assert empty["text"] == "∅"
    assert got["tally"] == {"sent": 7, "waiting": 1, "answered": 1, "cancelled": 2, "overloaded": 1,
                            "errors": 1, "lost": 1}
    assert got["tallyText"] == "4 sent: 2 answered, 1 cancelled, 1 waiting"
    short, straddle, emoji, more = got["clip"]
    assert short == {"text": "short [MASK]", "more": 0, "total": 12}
    assert straddle == {"text": "ab[MASK]", "more": 2, "total": 10}  # a mask token is never cut in two
    assert emoji == {"text": "😀😀", "more": 1, "total": 3}  # by code points, never half a surrogate pair
    assert more == 12345 - 300
    pretty, not_json, count, spoof, raw = got["pretty"]
    # Invisible and reordering characters are escaped in the log (a token U+202E "evil" read "live"):
    assert spoof == '{"token_str": "\\u202eevil\\u202c", "s": "a\\u200bb\\u0085😀"}', spoof
    assert orjson.loads(spoof) == {"token_str": "\u202eevil\u202c", "s": "a\u200bb\x85😀"}  # still JSON
    assert raw == "raw \\u2028 \\udb40\\udc01"
    assert pretty == '{\n  "type": "x",\n  "a": [1, "b"],\n  "o": {\n    "p": [\n      {"q": null}\n    ]\n  },' \
                     '\n  "e": [],\n  "f": {}\n}'
    assert not_json == "not json {" and count == "50,012"
    # Stats frames keep at most a fifth of the log (2 of 10), their oldest dropping first; the rest
    # fall off the front as before.
    assert got["frameLog"]["removed"] == [4, 5, 6] and got["frameLog"]["again"] == []
    assert got["frameLog"]["types"] == " ".join(["stats"] + ["fill_mask"] * 9) and got["frameLog"]["dropped"] == 7
    (from_disk, down, token, draining, restarting, lost_lately, lost_for_a_while, wrong, elsewhere, wrong_from_disk,
     balancer_between, full, needs_token) = got["diagnosis"]
    # A trial: a full server (--max-connections) was called one probably started with --token. The
    # page's own server's /metrics says whether it has one.
    assert full["kind"] == "reconnecting" and "--max-connections" in full["notice"], full
    assert "--token" not in full["notice"] and full["label"] == "Server full; reconnecting", full
    assert "--allowed-origins" in full["notice"], full  # (a review: or this origin is not allowed, behind a proxy)
    assert "it was started with --token;" in needs_token["notice"], needs_token
    assert from_disk["kind"] == "refused" and "--allowed-origins same-origin,localhost,null" in from_disk["notice"]
    assert down["kind"] == "offline" and "Is it running?" in down["notice"]
    assert token["kind"] == "refused" and "--token" in token["notice"] and "?token=" in token["notice"]
    assert draining["kind"] == "reconnecting" and "shutting down" in draining["notice"]
    assert restarting == {"kind": "reconnecting", "label": "Server is restarting; reconnecting", "notice": ""}
    # A page that was connected: "Reconnecting" at first, then (a newcomer's trial saw it say nothing
    # more for good) that the server does not answer.
    assert lost_lately == {"kind": "reconnecting", "label": "Reconnecting", "notice": ""}
    assert lost_for_a_while["kind"] == "offline" and "Lost the connection" in lost_for_a_while["notice"]
    # A web-demo trial's finds: an address that holds a token got "add ?token=TOKEN" all the same, and a
    # page served by some other server (a static file server) was told the fill-mask server wanted a token.
    assert "refused the token in this address" in wrong["notice"] and "add ?token" not in wrong["notice"]
    assert elsewhere["label"] == "No fill-mask server here" and "not a fill-mask server" in elsewhere["notice"]
    assert "--token" not in elsewhere["notice"]
    assert "refused the token in this address" in wrong_from_disk["notice"]
    assert "add ?token" not in wrong_from_disk["notice"]
    # A balancer's own 503 while its replicas restart (no fill-mask answer either, and it was read as a
    # refusal for a token, a review's find): the page says nothing is ready there, and keeps trying.
    assert balancer_between["kind"] == "reconnecting" and "nothing behind it is ready" in balancer_between["notice"]

    # Snippets survive any text: the shell and Python read back exactly what was typed, and the
    # command's own parser reads every value, one that starts with '-' too (found by a review).
    from fillmask_client.cli import build_parser

    nasty = "It's a \"[MASK]\" -- $HOME `x` \\n ünï 😀"
    for text, targets in ((nasty, ["it's", "b"]), ("-starts with a dash [MASK]", ["-ish", "well"])):
        frame = {"type": "fill_mask", "id": 3, "text": text, "top_k": 2, "targets": targets, "deadline_ms": 50}
        url = "ws://127.0.0.1:1/?token=a b"
        cli = await page.page.evaluate("([u, f]) => FillMask.lib.snippet('cli', u, f)", [url, frame])
        argv = shlex.split(cli, comments=True)
        assert argv[0] == ".venv/bin/fillmask-client" and text in argv
        if text.startswith("-"):
            assert argv[-2:] == ["--", text]
        args = build_parser().parse_intermixed_args(argv[1:])
        assert (args.texts, args.targets, args.url, args.top_k, args.deadline_ms) == (
            [text], [",".join(targets)], ["ws://127.0.0.1:1/"], 2, 50)  # the token left out (below)
        assert "a b" not in cli and "a%20b" not in cli and "export FILLMASK_TOKEN=" in cli
        python = await page.page.evaluate("([f]) => FillMask.lib.snippet('python', 'ws://x/', f)", [frame])
        call = next(n for n in ast.walk(ast.parse(python)) if isinstance(n, ast.Call)
                    and getattr(n.func, "attr", "") == "fill_mask")
        assert ast.literal_eval(call.args[0]) == text
        assert {k.arg: ast.literal_eval(k.value) for k in call.keywords} == \
               {"top_k": 2, "targets": targets, "deadline_ms": 50}


async def test_character_counter_counts_as_the_server_does(make_server: Any, open_page: Any) -> None:
    """Code points (§3: Python's len), not UTF-16 units: emoji count once, and the limit in hello holds."""
    from playwright.async_api import expect

    async with make_server(max_text_chars=12) as small:
        page = await open_page(small.http_url + "/")
        counter = page.by("text-count")
        fits = "😀😀😀 [MASK]."       # 11 code points, 14 UTF-16 units
        too_long = "😀😀😀😀😀 [MASK]."  # 13 code points
        await page.by("text-input").fill(fits)
        await expect(counter).to_have_attribute("data-chars", str(len(fits)))
        await expect(counter).to_contain_text(f"{len(fits)} / 12 characters")
        await expect(counter).not_to_have_class("help counter warn")
        await page.by("text-input").press("Enter")
        await expect(page.card(1)).to_have_attribute("data-state", "done")
        await page.by("text-input").fill(too_long)
        await expect(counter).to_contain_text(f"{len(too_long)} / 12 characters")
        await expect(counter).to_have_class("help counter warn")
        await page.by("text-input").press("Enter")
        await expect(page.card(2)).to_have_attribute("data-state", "error")
        assert (await page.frame_for(2))["code"] == "text_too_long"


async def test_random_weights_badge(server: Any, make_server: Any, open_page: Any, tiny_model_dir: Path,
                                    tmp_path: Path) -> None:
    """hello.random_weights true: a badge says the words are arbitrary; a trained checkpoint: no badge."""
    from playwright.async_api import expect

    hello, _ = await reference(server.url, None)
    assert hello["random_weights"] is True
    page = await open_page(server.http_url + "/")
    await expect(page.by("random-weights")).to_be_visible()
    await expect(page.by("random-weights-help")).to_contain_text("arbitrary words")
    await page.ask("A [MASK] day.")
    await expect(page.card(1).get_by_test_id("metric-random")).to_be_visible()

    # The same files with config.json saying nothing of random weights: a trained checkpoint to the server.
    trained = tmp_path / "trained"
    trained.mkdir()
    for item in tiny_model_dir.iterdir():
        if item.name != "config.json":
            (trained / item.name).symlink_to(item)
    config = orjson.loads((tiny_model_dir / "config.json").read_bytes())
    config.pop("fillmask_random_weights")
    (trained / "config.json").write_bytes(orjson.dumps(config))
    async with make_server(model=str(trained)) as srv:
        page = await open_page(f"{server.http_url}/?ws={srv.url}")
        await expect(page.by("model-name")).to_have_text("trained")
        await page.ask("A [MASK] day.")
        await expect(page.card(1)).to_have_attribute("data-state", "done")
        await expect(page.by("random-weights")).to_be_hidden()
        await expect(page.by("random-weights-help")).to_be_hidden()
        await expect(page.card(1).get_by_test_id("metric-random")).to_have_count(0)


# ---------------------------------------------------------------------------- controls


def test_the_burst_sentences_fit_one_batch_under_the_default_length_ratio(tiny_model_dir: Path) -> None:
    """The page's burst sentences (app.js) are all within --max-length-ratio of each other in tokens, so
    that a burst can run as one batch (test_burst_is_batched, below, shows it through the page)."""
    from transformers import AutoTokenizer

    from fillmask_server.batching import AUTO_GROWTH
    from fillmask_server.config import Config

    source = (ROOT / "web_demo" / "app.js").read_text()
    block = source[source.index("const BURST_SENTENCES = ["):]
    sentences = re.findall(r"'([^']*MASK[^']*)'", block[: block.index("];")])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # BERT's uncased vocabulary, as bert-base's
    lengths = [len(tokenizer(s.replace("MASK", tokenizer.mask_token))["input_ids"]) for s in sentences]
    assert len(sentences) >= 16
    ratio = Config().max_length_ratio or AUTO_GROWTH  # 0: the cost model's band, at most AUTO_GROWTH wide
    assert max(lengths) <= min(lengths) * ratio, sorted(zip(lengths, sentences, strict=True))


async def test_a_server_that_stops_answering_is_shown_as_such(server: Any, open_page: Any) -> None:
    """A web-demo trial's find: a server that stopped answering (SIGSTOP) kept the page at "Connected"
    with a "Waiting" card for good. While requests wait and none has been answered for a while (10 s;
    shortened here), the status says for how long; an answer clears it."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    await page.page.evaluate("window.FillMaskDemo.stallMs = 300")
    status = page.by("conn-status")
    await page.by("options").locator("summary").click()
    await page.by("top-k").fill("")  # (no top_k sent: the card names the server's default, below)
    with server.engine.paused():  # the connection stays open, and nothing is answered
        await page.ask("Nobody [MASK] here.")
        await expect(status).to_have_attribute("data-stalled", "true")
        await expect(page.page.locator("#conn-detail")).to_contain_text("no answer for")
        await expect(page.page.locator("#conn-text")).to_have_text("Connected")  # (still usable: it is connected)
    await expect(page.card(1)).to_have_attribute("data-state", "done")
    await expect(status).not_to_have_attribute("data-stalled", "true")
    # Sent without a top_k, its card names the server's default (a trial could not tell what was used).
    await expect(page.card(1).get_by_test_id("card-tag")).to_have_text("top 5 (server default)")
    await expect(page.page.locator("#conn-detail")).to_have_text("")


async def test_burst_is_batched(server: Any, open_page: Any) -> None:
    """A burst sent while the engine is held runs as one batch: every card shows a batch size above 1
    (the page's burst sentences are all within the default --max-length-ratio of each other)."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    n = 6
    with server.engine.paused():
        await page.send_burst(n)
        await wait_until(lambda: server.engine.runnable() == n)  # tokenized too: the model takes all n at once
        await expect(page.by("inflight")).to_have_attribute("data-count", str(n))
    summary = page.burst(1).get_by_test_id("burst-summary")
    await expect(summary).to_have_attribute("data-done", str(n))
    await expect(summary).to_have_attribute("data-answered", str(n))

    cards = page.page.locator('[data-testid="request-card"]')
    await expect(cards).to_have_count(n)
    texts = await cards.get_by_test_id("card-text").all_text_contents()
    assert len(set(texts)) == n, texts  # the sentences vary
    sizes = [int(v) for v in await cards.get_by_test_id("metric-batch-size").evaluate_all(
        "nodes => nodes.map(n => n.dataset.value)")]
    frames = [f for f in page.frames if f.get("type") == "result"]
    assert sorted(sizes) == sorted(f["batch_size"] for f in frames)
    assert min(sizes) > 1, (sizes, server.engine.core.cost.coefficients)
    assert int(await summary.get_attribute("data-max-batch")) == max(sizes)
    chips = page.burst(1).get_by_test_id("batch-chip")
    await expect(chips.first).to_be_visible()
    assert await chips.count() == len({f["batch_id"] for f in frames})  # one chip per batch_id


async def test_the_page_keeps_at_most_500_request_cards_bursts_included(server: Any, open_page: Any) -> None:
    """A burst counted as one of the 100 cards kept, so a long session kept up to 6,400 request cards
    (2.4 GB of renderer memory, found by a review). The oldest finished bursts now go once more than
    500 request cards are on the page."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    for number in range(1, 10):  # 9 bursts of 64: 576 request cards sent
        await page.send_burst(64)
        await expect(page.burst(number).get_by_test_id("burst-summary")).to_have_attribute("data-done", "64")
    cards = page.page.locator('[data-testid="request-card"]')
    await expect(cards).to_have_count(448)  # the oldest burst went at 512, leaving 7 of 64
    await expect(page.burst(9)).to_be_visible()


async def test_a_burst_is_never_larger_than_the_server_allows_in_flight(make_server: Any, open_page: Any) -> None:
    """The burst field allowed 64 whatever the server's max_inflight_per_connection, and the rest of a
    larger burst was answered too_many_inflight (found by a review)."""
    from playwright.async_api import expect

    async with make_server(max_inflight_per_connection=4) as srv:
        page = await open_page(srv.http_url + "/")
        await expect(page.by("burst-size")).to_have_attribute("max", "4")
        await expect(page.by("burst-size")).to_have_value("4")  # the default 8 was over it
        await page.send_burst(4)
        summary = page.burst(1).get_by_test_id("burst-summary")
        await expect(summary).to_have_attribute("data-answered", "4")


async def test_cancel_of_a_queued_request(server: Any, open_page: Any) -> None:
    """Cancel on a queued request sends a cancel frame; the card shows the server's `cancelled`."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    with server.engine.paused():
        await page.ask("Cancel me before the [MASK] runs.")
        await wait_until(lambda: server.engine.queued() == 1)
        card = page.card(1)
        await expect(card).to_have_attribute("data-state", "pending")
        await card.get_by_test_id("cancel").click()
        await expect(card).to_have_attribute("data-state", "cancelled")
    assert await page.frame_for(1) == {"type": "cancelled", "id": 1}
    await expect(card.get_by_test_id("card-status")).to_have_text("Cancelled")
    await expect(card.get_by_test_id("cancel")).to_be_hidden()
    await expect(page.by("inflight")).to_have_attribute("data-count", "0")


async def test_a_frame_larger_than_the_server_takes_is_never_sent(server: Any, open_page: Any) -> None:
    """A web-demo trial's find: a 68 KB text was sent although hello's max_frame_bytes is 65,536, the
    server closed the connection with 1009, and every card in flight on it became "Not answered". The
    page now measures the frame's UTF-8 bytes as the server does: one byte over the limit gets a card of
    its own that says why and sends nothing (no Retry; a Retry made too big is refused the same way), the
    request waiting beside it is answered, and a frame of exactly the limit still goes (the server
    answers text_too_long on its card)."""
    from playwright.async_api import expect

    limit = server.config.max_frame_bytes
    page = await open_page(server.http_url + "/")

    def frame_bytes(request_id: int, text: str) -> int:
        return len(orjson.dumps({"type": "fill_mask", "id": request_id, "text": text, "top_k": 5}))

    def text_of(request_id: int, size: int) -> str:  # é and 😀: 2 and 4 bytes, 1 and 2 UTF-16 units
        head = "[MASK] " + "é😀" * 1000
        return head + "x" * (size - frame_bytes(request_id, head))

    with server.engine.paused():
        await page.ask("The [MASK] waits in the queue.")                  # 1
        await wait_until(lambda: server.engine.queued() == 1)
        big = "Paris is the [MASK] of France. " * 2200                   # 2: the trial's 68 KB
        await page.ask(big)
        card = page.card(2)
        await expect(card).to_have_attribute("data-state", "error")
        await expect(card.get_by_test_id("card-status")).to_have_text("Not sent")
        await expect(card.get_by_test_id("card-message")).to_have_text(
            f"Not sent: as JSON this request is {frame_bytes(2, big):,} bytes, and the server takes frames of at "
            f"most {limit:,} bytes (limits.max_frame_bytes). Shorten the text.")
        await expect(card.get_by_test_id("retry")).to_be_hidden()
        await expect(card.get_by_test_id("cancel")).to_be_hidden()
        await page.ask(text_of(3, limit))                                  # 3: exactly the limit: sent
        assert (await page.frame_for(3))["code"] == "text_too_long"
        await page.ask(text_of(4, limit + 1))                              # 4: a byte more: not sent
        await expect(page.card(4).get_by_test_id("card-status")).to_have_text("Not sent")
        await expect(page.card(1)).to_have_attribute("data-state", "pending")
        # Retry builds its frame again: one grown too big (here: the limit lowered, as another server's
        # hello could) is refused as a new request is.
        await page.ask("Retry [MASK] me.")                                  # 5
        await wait_until(lambda: server.engine.queued() == 2)
        await page.page.evaluate("f => FillMaskDemo.receive(JSON.stringify(f))", {
            "type": "overloaded", "id": 5, "status": 503, "reason": "queue_full", "retry_after_ms": 0})
        await expect(page.card(5).get_by_test_id("retry")).to_be_enabled()
        await page.page.evaluate("FillMaskDemo.client.current.hello.limits.max_frame_bytes = 60")
        await page.card(5).get_by_test_id("retry").click()                # 6
        await expect(page.card(6).get_by_test_id("card-message")).to_contain_text("the server takes frames of "
                                                                                   "at most 60 bytes")
    await expect(page.card(1)).to_have_attribute("data-state", "done")
    await expect(page.by("conn-status")).to_have_attribute("data-state", "connected")
    assert [f["id"] for f in page.sent if f["type"] == "fill_mask"] == [1, 3, 5]
    assert max(len(raw.encode()) for raw in page.raw_out) == limit
    assert not [f for f in page.frames if f.get("type") == "error" and f.get("id") is None]


async def test_invalid_top_k_and_burst_size_are_refused_with_a_notice(server: Any, open_page: Any) -> None:
    """A web-demo trial's find: "e", "-", "3e" or "--5" in Top k (which the browser reads as empty) sent
    the request without top_k, its card saying "server default", and a burst of "2.5" went as 3. Both now
    get a notice, as Deadline does, and nothing is sent."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    top_k = page.by("top-k")
    notice = page.by("notice")
    for typed in ("e", "-", "3e", "--5"):
        await top_k.click()
        await top_k.press("Control+a")
        await top_k.press_sequentially(typed)  # (fill refuses text that is not a number)
        await page.ask("Top [MASK] here.")
        await expect(notice).to_have_text("Top k: give a whole number from 1 to 100, or leave the field empty for "
                                          "the server's default.")
        await expect(top_k).to_be_focused()
        await page.page.evaluate("document.getElementById('notice').hidden = true")  # the next one shows afresh
    await top_k.fill("3")
    await page.by("burst-size").fill("2.5")
    await page.by("burst-send").click()
    await expect(notice).to_have_text("A burst is a whole number of sentences, 2 to 64; nothing was sent.")
    await expect(page.by("burst-status")).to_have_text("A burst is a whole number of sentences, 2 to 64; nothing "
                                                        "was sent.")
    await page.ask("Top [MASK] here.")
    await expect(page.card(1)).to_have_attribute("data-state", "done")
    await expect(page.card(1).get_by_test_id("card-tag")).to_have_text("top 3")
    assert [(f["id"], f["top_k"]) for f in page.sent if f["type"] == "fill_mask"] == [(1, 3)]  # nothing before it
    await expect(page.page.locator('[data-testid="burst-card"]')).to_have_count(0)


@SIZES
async def test_targets_deadline_and_copy_as_code(server: Any, open_page: Any, viewport: dict[str, int]) -> None:
    """Targets and deadline go into the request; its card can be copied as Python, JavaScript and a
    command line, each of which, run as is, asks the server the same question. On a phone the new
    result and the connection state are in view."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/", viewport=viewport)
    await page.by("options").locator("summary").click()
    await page.by("targets").fill(" capital, city ,")
    await page.by("deadline-ms").fill("5000")
    await expect(page.by("options-brief")).to_have_text("(2 targets, deadline 5000 ms)")
    text = "Paris is the [MASK] of France."
    await page.ask(text)
    card = page.card(1)
    await expect(card).to_have_attribute("data-state", "done")
    assert page.sent_for(1) == {"type": "fill_mask", "id": 1, "text": text, "top_k": 5,
                                "targets": ["capital", "city"], "deadline_ms": 5000}
    result = await page.frame_for(1)
    assert {p["token_str"] for p in result["predictions"]} == {"capital", "city"}
    await expect(card.get_by_test_id("card-tag")).to_have_text("top 5 · targets: capital, city · deadline 5000 ms")

    # The newest result and the connection state are in view, right after the answer (phones too),
    # and the result is close below the button, not a screen away.
    await assert_in_view(card.get_by_test_id("filled-sentence"))
    await assert_in_view(card.get_by_test_id("prediction").last)
    await assert_in_view(page.by("conn-status"), below_header=False)
    if viewport is PHONE:
        # Between them: the help line, the folded live view's summary (shown from the hello on) and
        # the requests' heading; a third of the window at most.
        gap = (await position(card))["top"] - (await position(page.by("submit")))["bottom"]
        assert gap < PHONE["height"] / 3, gap

    snippets = {}
    for language in ("python", "js", "cli"):
        await card.get_by_test_id(f"copy-{language}").click()
        shown = card.get_by_test_id("snippet")
        await expect(shown).to_be_visible()
        await expect(card.get_by_test_id("copy-status")).to_have_text("copied")
        snippets[language] = await shown.text_content()
        assert await page.page.evaluate("navigator.clipboard.readText()") == snippets[language]
    await card.get_by_test_id("copy-cli").click()  # a second click on the shown language hides it
    await expect(card.get_by_test_id("snippet")).to_be_hidden()

    expected = tokens_of(result["predictions"])
    rc, out, err = await run(sys.executable, "-c", snippets["python"])
    assert rc == 0, err
    assert tokens_of(ast.literal_eval(out.strip())) == expected
    # The CLI by its path in the checkout (works without an activated venv), and a comment saying so.
    assert snippets["cli"].startswith("# ") and "venv activated" in snippets["cli"].splitlines()[0]
    argv = shlex.split(snippets["cli"], comments=True)
    assert argv[0] == ".venv/bin/fillmask-client"
    rc, out, err = await run(str(Path(sys.executable).parent / "fillmask-client"), *argv[1:])
    assert rc == 0, err
    for p in result["predictions"]:
        assert p["token_str"] in out
    # JavaScript under Node.js without a built-in WebSocket (20 here): the snippet says it needs the ws
    # package, and with it runs as saved to a file.
    assert "Node.js 18 or 20 with the ws package" in snippets["js"]
    if viewport is DESKTOP:
        node = _node_or_skip()
        if not (WS_PACKAGE_DIR / "ws").is_dir():
            _unavailable(f"the ws package is not installed in {WS_PACKAGE_DIR} (npm ci there)")
        script = Path(os.environ.get("TMPDIR", "/tmp")) / f"fillmask-ask-{os.getpid()}.js"
        script.write_text(snippets["js"].replace("console.log(", "console.log(JSON.stringify(", 1)
                          .replace(": frame);", ": frame));", 1))
        try:
            node_run = await asyncio.to_thread(subprocess.run, [node, str(script)], capture_output=True, text=True,
                                               timeout=30, env={**os.environ, "NODE_PATH": str(WS_PACKAGE_DIR)})
        finally:
            script.unlink()
        assert node_run.returncode == 0, node_run.stderr
        assert tokens_of(orjson.loads(node_run.stdout)) == expected
    # JavaScript: run as pasted into a browser console, on a page of the server's own origin.
    scratch = await page.page.context.new_page()
    await scratch.goto(server.http_url + "/healthz")
    answer = await scratch.evaluate("""code => new Promise((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error('no answer within 10 s')), 10000);
        new Function('console', code)({log: (x) => { clearTimeout(timer); resolve(x); }});
    })""", snippets["js"])
    await scratch.close()
    assert tokens_of(answer) == expected

    # A deadline that passes while the request waits in the queue: 504 on its card (§6).
    await page.by("targets").fill("")
    await page.by("deadline-ms").fill("1")
    with server.engine.paused():
        await page.ask("Too [MASK] to wait.")
        await expect(page.card(2)).to_have_attribute("data-state", "overloaded")
    frame = await page.frame_for(2)
    assert (frame["status"], frame["reason"]) == (504, "deadline_exceeded")
    assert page.sent_for(2)["deadline_ms"] == 1 and "targets" not in page.sent_for(2)
    await expect(page.card(2).get_by_test_id("card-message")).to_contain_text("deadline passed")

    # A result with targets that were not one token each (fed to the page while the real answer waits):
    # a note for each, in order, next to the predictions.
    await page.by("targets").fill("new york, Capital, zzzzqqq")
    await page.by("deadline-ms").fill("")
    with server.engine.paused():
        await page.ask("I live in [MASK].")
        await wait_until(lambda: server.engine.queued() == 1)
        frame = {"type": "result", "id": 3, "predictions": [
                     {"score": 0.5, "token": 2047, "token_str": "new", "sequence": "i live in new."},
                     {"score": 0.25, "token": 3007, "token_str": "capital", "sequence": "i live in capital."},
                     {"score": 0.125, "token": 1062, "token_str": "z", "sequence": "i live in z."}],
                 "targets": [{"given": "new york", "scored": "new"}, {"given": "Capital", "scored": "capital"},
                             {"given": "zzzzqqq", "scored": "z"}],
                 "queue_ms": 1.0, "inference_ms": 2.0, "batch_size": 1, "batch_tokens": 8, "batch_id": 10**6}
        await page.page.evaluate("f => FillMaskDemo.receive(JSON.stringify(f))", frame)
        noted = page.card(3)
        await expect(noted).to_have_attribute("data-state", "done")
        await expect(noted.get_by_test_id("targets-note")).to_have_text([
            'Note: target "new york" was scored as "new", its first piece (it is not one token of the vocabulary).',
            # (A browser trial: an uncased model's "capital" was called "not one token of the vocabulary".)
            'Note: target "Capital" was scored as "capital", the vocabulary\'s spelling of it.',
            'Note: target "zzzzqqq" was scored as "z", its first piece (it is not one token of the vocabulary).'])
        await expect(noted.get_by_test_id("prediction")).to_have_count(3)
        await assert_in_view(noted.get_by_test_id("targets-note").last)
    await page.frame_for(3)  # the real answer comes and changes nothing: the card is settled
    await expect(noted.get_by_test_id("targets-note")).to_have_count(3)


@SIZES
async def test_cancel_all_and_burst_accounting(server: Any, open_page: Any, viewport: dict[str, int]) -> None:
    """A burst is one card whatever its size, counting answered, cancelled, ... separately; "Cancel
    burst" cancels its queued requests, "Cancel all" every queued request of the page."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/", viewport=viewport)
    await expect(page.by("cancel-all")).to_be_disabled()
    with server.engine.paused():
        await page.ask("My own [MASK] first.")           # 1
        await wait_until(lambda: server.engine.queued() == 1)
        await page.send_burst(6)                          # 2..7
        await wait_until(lambda: server.engine.queued() == 7)
        await page.ask("And my own [MASK] after.")       # 8
        await wait_until(lambda: server.engine.queued() == 8)
        # The burst takes one card: the user's cards stay next to it, its requests are folded away.
        top_level = page.page.locator("#cards > li")
        await expect(top_level).to_have_count(3)
        assert await top_level.evaluate_all("items => items.map(i => i.dataset.testid + (i.dataset.id || ''))") == \
            ["request-card8", "burst-card", "request-card1"]
        await expect(page.burst(1).locator('[data-testid="request-card"]').first).to_be_hidden()
        await assert_in_view(page.card(8))
        # "Cancel burst" cancels that burst's requests only; "Cancel all" then the rest.
        await page.burst(1).get_by_test_id("burst-cancel").click()
        await expect(page.by("inflight")).to_have_attribute("data-count", "2")
        await expect(page.card(1)).to_have_attribute("data-state", "pending")
        await expect(page.by("cancel-all")).to_be_enabled()
        await page.by("cancel-all").click()
        await expect(page.by("inflight")).to_have_attribute("data-count", "0")
    assert [f["id"] for f in page.sent if f["type"] == "cancel"] == [2, 3, 4, 5, 6, 7, 1, 8]
    for request_id in range(1, 9):
        assert await page.frame_for(request_id) == {"type": "cancelled", "id": request_id}
    summary = page.burst(1).get_by_test_id("burst-summary")
    await expect(summary).to_have_text(re.compile(r"^6 sent: 0 answered, 6 cancelled in \d+ ms\.$"))
    await expect(summary).to_have_attribute("data-cancelled", "6")
    await expect(summary).to_have_attribute("data-answered", "0")
    await expect(page.by("cancel-all")).to_be_disabled()

    # A second burst: one of its requests cancelled from its own card, the rest answered.
    with server.engine.paused():
        await page.send_burst(4)                          # 9..12
        await wait_until(lambda: server.engine.queued() == 4)
        burst = page.burst(2)
        await burst.get_by_test_id("burst-requests").locator("summary").click()
        await page.card(9).get_by_test_id("cancel").click()
        await expect(page.card(9)).to_have_attribute("data-state", "cancelled")
    summary = burst.get_by_test_id("burst-summary")
    await expect(summary).to_have_attribute("data-done", "4")
    await expect(summary).to_contain_text("4 sent: 3 answered, 1 cancelled in ")
    assert [int(await summary.get_attribute(f"data-{k}")) for k in ("answered", "cancelled", "overloaded",
                                                                     "errors", "lost", "waiting")] == [3, 1, 0, 0, 0, 0]
    await expect(page.by("burst-status")).to_contain_text("Burst 2: 4 sent: 3 answered, 1 cancelled")
    await expect(burst.get_by_test_id("burst-cancel")).to_be_hidden()


def indents(text: str) -> list[int]:
    """The indentation of each line: the shape of indented JSON, whatever the digits of its numbers."""
    return [len(line) - len(line.lstrip(" ")) for line in text.split("\n")]


@SIZES
async def test_raw_frame_log(server: Any, open_page: Any, viewport: dict[str, int]) -> None:
    """The log holds every frame sent and received, newest last, as indented JSON in a block as wide as
    the layout that scrolls sideways (never wrapped mid-word), and keeps only the newest ones. A card
    shows the first 300 characters of a long text, and all of it on request."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/", viewport=viewport)
    await first_stats_frame_soon(server, page)  # the live view's first
    await silence_stats(server)  # and last: the comparisons below need a fixed set of frames
    await page.ask("Log this [MASK].")
    await expect(page.card(1)).to_have_attribute("data-state", "done")
    await page.ask("And this [MASK].")
    await expect(page.card(2)).to_have_attribute("data-state", "done")
    # Hello, the stats frame (or two: see first_stats_frame_soon), two results, in this order on one socket.
    await wait_until(lambda: sum('"type":"result"' in text for text in page.raw_in) == 2)
    kinds = [orjson.loads(text)["type"] for text in page.raw_in]
    assert kinds[0] == "hello" and set(kinds[1:-2]) == {"stats"} and kinds[-2:] == ["result", "result"], kinds

    log = page.by("frame-log")
    await log.locator("summary").click()
    entries = log.get_by_test_id("log-entry")
    await expect(entries.last).to_be_visible()
    shown = await entries.evaluate_all("items => items.map(i => [i.dataset.dir, i.querySelector('code').textContent, "
                                       "Number(i.dataset.seq)])")
    # Each direction complete and in order; entries oldest first (a server with stats adds its frames).
    for direction, raw in (("out", page.raw_out), ("in", page.raw_in)):
        texts = [text for d, text, _ in shown if d == direction]
        assert [orjson.loads(t) for t in texts] == [orjson.loads(r) for r in raw]
        assert [indents(t) for t in texts] == [indents(pretty_json(orjson.loads(r))) for r in raw]
    result_text = next(text for d, text, _ in shown if d == "in" and '"type": "result"' in text)
    predictions = orjson.loads(result_text)["predictions"]
    assert sum('"token_str": ' in line for line in result_text.split("\n")) == len(predictions) > 1  # one a line
    assert shown[0][:2] == ["event", f"connecting to {server.url}"]
    seqs = [seq for _, _, seq in shown]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    results = [orjson.loads(text)["id"] for d, text, _ in shown if d == "in" and '"type": "result"' in text]
    assert results == [1, 2]
    await expect(page.by("log-count")).to_have_text(f"({len(shown)})")
    # Lines are never wrapped: the block scrolls sideways; on a desktop it spans both columns.
    block = await page.by("log-list").evaluate("""list => {
        const code = list.querySelector('[data-dir=in] code');
        return {white: getComputedStyle(code).whiteSpace, overflow: getComputedStyle(list).overflowX,
                width: list.getBoundingClientRect().width,
                cards: document.querySelector('#cards').getBoundingClientRect(),
                scrolls: list.scrollWidth > list.clientWidth}; }""")
    assert block["white"] == "pre" and block["overflow"] == "auto", block
    if viewport is DESKTOP:
        assert block["width"] > block["cards"]["width"] + 300, block  # wider than the requests column
    else:  # the whole window's width, and a prediction's line, longer than that, scrolls
        assert block["width"] >= PHONE["width"] - 60 and block["scrolls"], block
    assert await page.page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]

    # Bounded: with room for 3, the list keeps the 3 newest frames, the last request's among them.
    await page.page.evaluate("FillMaskDemo.frameLog.max = 3")
    await page.ask("Bounded [MASK].")
    await expect(page.card(3)).to_have_attribute("data-state", "done")
    await expect(entries).to_have_count(3)
    texts = await entries.locator("code").all_text_contents()
    assert any(orjson.loads(t).get("id") == 3 and orjson.loads(t)["type"] == "result" for t in texts), texts
    await expect(page.by("log-dropped")).to_contain_text("older frames dropped")
    await page.by("log-clear").click()
    await expect(entries).to_have_count(0)

    # A 50,000-character text (refused: too long): its card shows the first 300 characters, not all.
    long_text = "[MASK] " + "word " * 9_999 + "end."
    assert len(long_text) > 50_000
    await page.ask(long_text)
    card = page.card(4)
    await expect(card).to_have_attribute("data-state", "error")
    assert (await page.frame_for(4))["code"] == "text_too_long"
    box = card.get_by_test_id("card-text")
    toggle = card.get_by_test_id("text-toggle")
    shown_text = await box.text_content()
    assert shown_text == long_text[:300] + "…", shown_text
    await expect(box.locator("mark.mask")).to_have_count(1)
    await expect(toggle).to_have_text(f"Show all {len(long_text):,} characters")
    assert (await position(card))["bottom"] - (await position(card))["top"] < 600
    await toggle.click()
    await expect(box).to_have_text(long_text)
    await expect(toggle).to_have_attribute("aria-expanded", "true")
    await toggle.click()
    await expect(box).to_have_text(long_text[:300] + "…")
    await expect(page.by("log-count")).to_have_text("(2)")  # the 50 KB frame cut to 2,000 characters in the log
    assert "more characters)" in await page.by("frame-log").get_by_test_id("log-entry").first.text_content()
    await expect(page.card(1).get_by_test_id("text-toggle")).to_be_hidden()  # a short text has no toggle


# ---------------------------------------------------------------------------- live view


async def silence_stats(server: Any) -> None:
    """Stop the server's own stats frames to the page, which subscribed on connecting (§13): a test that
    compares frames or feeds its own stats frames must not race the next real one, a second away."""
    await wait_until(lambda: any(conn.stats_task is not None for conn in server.connections))
    for conn in list(server.connections):
        conn.session.stats_interval_ms = None
        server._follow_stats(conn)


async def first_stats_frame_soon(server: Any, page: Page) -> None:
    """Have the server send the page its first stats frame a quarter of a second (§13's least interval)
    after this call rather than the page's interval (1 s) after its subscription, and wait until the
    page has it; the frames after it come at the page's interval again, each covering the time since
    the one before (``_follow_stats``), as they would have. What the page sent is unchanged: the server
    is told the interval as a subscription would tell it. (Should this wait be held up past the quarter
    second, a second early frame may come before the page's interval is back.)"""
    await wait_until(lambda: any(conn.stats_task is not None for conn in server.connections))
    seen = sum('"type":"stats"' in text for text in page.raw_in)
    asked = {conn: conn.session.stats_interval_ms for conn in list(server.connections) if conn.stats_task is not None}
    for conn in asked:
        conn.session.stats_interval_ms = STATS_INTERVAL_MS["min"]
        server._follow_stats(conn)
    await wait_until(lambda: sum('"type":"stats"' in text for text in page.raw_in) > seen)
    for conn, interval in asked.items():
        if conn.stats_task is not None and conn.session.stats_interval_ms == STATS_INTERVAL_MS["min"]:
            conn.session.stats_interval_ms = interval
            server._follow_stats(conn)


def stats_frame(batches: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    frame = {"type": "stats", "window_s": 1.0, "queue_depth": 3, "in_flight": 12, "connections": 4,
             "requests_per_s": 812.5, "latency_ms": {"p50": 12.1, "p99": 40.2},
             "batch_size": {"mean": 21.3, "max": 32}, "engine_busy": 0.83, "batches": batches}
    frame.update(fields)
    return frame


async def tiles(page: Page) -> dict[str, tuple[str, str]]:
    return await page.by("live-tiles").evaluate("""box => Object.fromEntries(Array.from(box.children).map(
        t => [t.dataset.testid.slice(5), [t.dataset.value, t.querySelector('dd').textContent]]))""")


@SIZES
async def test_live_panel_renders_stats_frames(server: Any, open_page: Any, viewport: dict[str, int]) -> None:
    """live.js fed stats frames (the contract's shape) through the page's own frame handler: tiles,
    nulls, the batch timeline by batch_id (deduplicated, ours marked), folding, and the log filter."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/", viewport=viewport)
    await silence_stats(server)  # only the frames fed below reach the panel
    await page.ask("Mine [MASK].")
    await expect(page.card(1)).to_have_attribute("data-state", "done")  # after any real stats frame
    ours = (await page.frame_for(1))["batch_id"]
    real_stats = sum('"type":"stats"' in text for text in page.raw_in)

    def batch(batch_id: int, size: int) -> dict[str, Any]:
        return {"batch_id": batch_id, "size": size, "tokens": size * 16, "inference_ms": 6.1}

    first = stats_frame([batch(ours + 1, 32), batch(ours + 2, 8)])
    second = stats_frame([batch(ours + 2, 8), batch(ours + 3, 1)], queue_depth=0, requests_per_s=0.5,
                         latency_ms={"p50": None, "p99": None}, batch_size={"mean": None, "max": None},
                         engine_busy=0.0)
    panel = page.by("live-panel")
    await page.page.evaluate("f => FillMaskDemo.receive(JSON.stringify(f))", first)
    await expect(panel).to_be_visible()
    if viewport is PHONE:  # folded on a phone: the summary line carries the key numbers
        await expect(page.by("live-tiles")).to_be_hidden()
        await expect(page.by("live-brief")).to_have_text("queue 3 · 813 req/s · p99 40 ms · busy 83%")
        await panel.locator("summary").click()
    await expect(page.by("live-tiles")).to_be_visible()
    assert await tiles(page) == {
        "queue": ["3", "3"], "inflight": ["12", "12"], "rps": ["812.5", "813"], "p50": ["12.1", "12 ms"],
        "p99": ["40.2", "40 ms"], "batch": ["21.3", "21 / 32"], "busy": ["0.83", "83%"],
        "connections": ["4", "4"]}
    assert await page.by("stat-busy").locator(".stat-meter span").evaluate("e => e.style.width") == "83%"

    # A frame with the batch that answered our request (a real batch_id) and one seen before.
    second["batches"].insert(0, batch(ours, 1))
    await page.page.evaluate("f => FillMaskDemo.receive(JSON.stringify(f))", second)
    shown = await tiles(page)
    assert shown["p50"] == ["", "–"] and shown["p99"] == ["", "–"] and shown["batch"] == ["", "–"]
    assert shown["rps"] == ["0.5", "0.5"] and shown["busy"] == ["0", "0%"]
    bars = page.by("live-timeline").get_by_test_id("timeline-batch")
    assert await bars.evaluate_all("bs => bs.map(b => [Number(b.dataset.batchId), Number(b.dataset.size), "
                                   "b.classList.contains('ours')])") == \
        [[ours, 1, True], [ours + 1, 32, False], [ours + 2, 8, False], [ours + 3, 1, False]]
    await expect(page.by("live-axis")).to_have_text(f"#{ours}#{ours + 3}")
    await expect(page.by("live-last")).to_have_text(f"Last batch #{ours + 3}: 1 request, 16 tokens, 6.1 ms")
    await expect(page.by("live-window")).to_have_text("over the last 1.0 s")
    await expect(page.by("notice")).to_be_hidden()

    # The stats frames are in the frame log, and can be hidden there.
    log = page.by("frame-log")
    await log.locator("summary").click()
    stats_entries = log.locator('[data-testid="log-entry"][data-type="stats"]')
    await expect(stats_entries).to_have_count(real_stats + 2)
    await expect(stats_entries.first).to_be_visible()
    await page.by("log-hide-stats").check()
    await expect(stats_entries.first).to_be_hidden()
    # However long the live view runs, stats frames keep at most a fifth of the log's 500 places: the
    # requests' own frames stay, in the log and on the open list.
    others = log.locator('[data-testid="log-entry"]:not([data-type="stats"])')
    before = await others.count()
    await page.page.evaluate("f => { for (let i = 0; i < 130; i++) FillMaskDemo.receive(JSON.stringify(f)); }", second)
    await expect(stats_entries).to_have_count(100)
    assert await others.count() == before > 0


async def test_live_panel_hidden_quietly_when_server_lacks_stats(server: Any, open_page: Any) -> None:
    """A server whose hello has no ``stats`` (§2; an older version) offers no live view: the page asks for
    nothing, shows no panel and no notice. The server here is a stand-in that only says hello."""
    from playwright.async_api import expect
    from websockets.asyncio.server import serve

    async with connect(server.url) as ws:
        hello = orjson.loads(await ws.recv())
    old_hello = orjson.dumps({key: value for key, value in hello.items() if key != "stats"}).decode()
    received: list[str] = []

    async def old_server(ws: Any) -> None:
        await ws.send(old_hello)
        async for message in ws:
            received.append(message)

    async with serve(old_server, "127.0.0.1", 0) as stand_in:
        port = stand_in.sockets[0].getsockname()[1]
        page = await open_page(f"{server.http_url}/?ws=ws://127.0.0.1:{port}/")
        await expect(page.by("model-name")).to_have_text(hello["model"])
        await expect(page.by("live-panel")).to_be_hidden()
        await expect(page.by("notice")).to_be_hidden()
        await asyncio.sleep(0.3)
        assert [m for m in received if "stats" in m] == []


async def test_update_every_takes_effect_before_the_first_stats_frame(server: Any, open_page: Any) -> None:
    """A web-demo trial's find: "Update every" changed before the first stats frame came (within a second of
    connecting) sent nothing, and frames kept coming every second. The server here is a stand-in that
    says the real hello and sends no stats frame, so the page never has one. The 0.25 s window read
    "over the last 0.3 s"."""
    from playwright.async_api import expect
    from websockets.asyncio.server import serve

    async with connect(server.url) as ws:
        hello = await ws.recv()
    received: list[dict[str, Any]] = []

    async def quiet_server(ws: Any) -> None:
        await ws.send(hello)
        async for message in ws:
            received.append(orjson.loads(message))

    async with serve(quiet_server, "127.0.0.1", 0) as stand_in:
        port = stand_in.sockets[0].getsockname()[1]
        page = await open_page(f"{server.http_url}/?ws=ws://127.0.0.1:{port}/")
        await wait_until(lambda: received == [{"type": "subscribe_stats", "interval_ms": 1000}])
        await page.by("live-interval").select_option("250")
        await wait_until(lambda: received[-1:] == [{"type": "subscribe_stats", "interval_ms": 250}])
        await page.page.evaluate("f => FillMaskDemo.receive(JSON.stringify(f))", stats_frame([], window_s=0.25))
        await expect(page.by("live-window")).to_have_text("over the last 0.25 s")


@SIZES
async def test_live_panel_follows_the_servers_stats(server: Any, open_page: Any, viewport: dict[str, int]) -> None:
    """Against the real server's stats frames: the interval control, queue depth while the engine is
    held, and the batches that answered this page marked on the timeline. On a desktop the live view is
    beside the requests (folding or unfolding it never moves them); on a phone, above them."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/", viewport=viewport)
    panel = page.by("live-panel")
    await expect(panel).to_be_visible()
    assert page.sent[0] == {"type": "subscribe_stats", "interval_ms": 1000}
    await page.ask("Where is the [MASK] shown?")
    await expect(page.card(1)).to_have_attribute("data-state", "done")
    await first_stats_frame_soon(server, page)
    await expect(page.by("stat-queue")).to_have_attribute("data-value", "0")  # a real stats frame came
    requests = page.page.locator("section.results")
    if viewport is DESKTOP:
        before = await position(requests)
        assert (await position(panel))["right"] <= before["left"], "the live view is beside the requests"
        await panel.locator("summary").click()  # fold it
        await expect(page.by("live-tiles")).to_be_hidden()
        assert (await position(requests))["top"] == before["top"]
        await panel.locator("summary").click()  # and unfold it again
        await expect(page.by("live-tiles")).to_be_visible()
        assert (await position(requests))["top"] == before["top"]
    else:
        assert (await position(panel))["bottom"] <= (await position(requests))["top"]
        await panel.locator("summary").click()
    await page.by("live-interval").select_option("250")
    await wait_until(lambda: {"type": "subscribe_stats", "interval_ms": 250} in page.sent)
    with server.engine.paused():
        await page.send_burst(4)
        await wait_until(lambda: server.engine.queued() == 4)
        await expect(page.by("stat-queue")).to_have_attribute("data-value", "4", timeout=10_000)
    await expect(page.burst(1).get_by_test_id("burst-summary")).to_have_attribute("data-answered", "4")
    batch_ids = {f["batch_id"] for f in page.frames if f.get("type") == "result"}
    for batch_id in batch_ids:
        bar = page.by("live-timeline").locator(f'[data-batch-id="{batch_id}"]')
        await expect(bar).to_have_class("tl-bar ours", timeout=10_000)
    last = [f for f in page.frames if f.get("type") == "stats"][-1]
    assert set(last) >= {"window_s", "queue_depth", "in_flight", "connections", "requests_per_s", "latency_ms",
                         "batch_size", "engine_busy", "batches"}


# ---------------------------------------------------------------------------- connection


async def assert_live_not_connected(page: Page) -> None:
    """The live view says "not connected" in its summary line (seen folded or open) and is greyed out."""
    from playwright.async_api import expect

    panel = page.by("live-panel")
    await expect(panel).to_have_attribute("data-connected", "false")
    await expect(page.by("live-stale")).to_be_visible()
    await expect(page.by("live-stale")).to_have_text("not connected")
    look = await panel.evaluate("""p => ({body: getComputedStyle(p.querySelector('.live-body')).opacity,
        brief: getComputedStyle(p.querySelector('.live-brief')).filter})""")
    assert float(look["body"]) < 0.6 and "grayscale" in look["brief"], look


async def test_overloaded_and_reconnect(server: Any, make_server: Any, open_page: Any) -> None:
    """Via ?ws=: a full queue shows `overloaded` with its retry-after; a restarted server is reconnected to."""
    from playwright.async_api import expect

    async with make_server(max_queue=1) as small:
        port = small.port
        page = await open_page(f"{server.http_url}/?ws={small.url}")
        await expect(page.by("ws-url")).to_have_value(small.url)
        with small.engine.paused():
            await page.ask("The first [MASK] waits in the queue.")
            await wait_until(lambda: small.engine.queued() == 1)
            await page.ask("The second [MASK] finds the queue full.")
            card = page.card(2)
            await expect(card).to_have_attribute("data-state", "overloaded")
            frame = await page.frame_for(2)
            assert (frame["status"], frame["reason"]) == (503, "queue_full")
            message = card.get_by_test_id("card-message")
            await expect(message).to_contain_text("queue is full")
            await expect(message).to_contain_text("retry after")
            assert int(await message.get_attribute("data-retry-after-ms")) == frame["retry_after_ms"]
            await expect(card.get_by_test_id("retry")).to_be_visible()
        await expect(page.card(1)).to_have_attribute("data-state", "done")
    # The server drained and closed with 1001: the page says so and retries with backoff ...
    status = page.by("conn-status")
    await expect(status).to_have_attribute("data-state", "reconnecting")
    await expect(status).to_contain_text("restarting")
    # ... the live view's last figures stay, greyed out, under "not connected" ...
    await assert_live_not_connected(page)
    # ... and finds a new server on the same address by itself.
    async with make_server(max_queue=1, port=port):
        await expect(status).to_have_attribute("data-state", "connected", timeout=20_000)
        await expect(page.by("live-panel")).to_have_attribute("data-connected", "true")
        await expect(page.by("live-stale")).to_be_hidden()
        await page.ask("Back [MASK] again.")
        await expect(page.card(3)).to_have_attribute("data-state", "done")


async def test_going_away_keeps_the_cards_and_reconnects(server: Any, make_server: Any, open_page: Any) -> None:
    """§10: on going_away the page says the server is restarting and sends nothing more there; the
    answers still owed arrive on the old connection (cards not lost), then a new server is found.
    At phone size, where the live view is folded: its summary line says "not connected" meanwhile."""
    from playwright.async_api import expect

    async with make_server(shutdown_timeout=10) as old:
        port = old.port
        page = await open_page(f"{server.http_url}/?ws={old.url}", viewport=PHONE)
        await expect(page.by("live-stale")).to_be_hidden()
        status = page.by("conn-status")
        with old.engine.paused():
            await page.ask("Still [MASK] after the restart.")
            await page.ask("And this [MASK] too.")
            await wait_until(lambda: old.engine.queued() == 2)
            drain = asyncio.create_task(old.drain())
            await expect(status).to_contain_text("Server is restarting; reconnecting")
            await expect(page.by("submit")).to_be_disabled()
            await assert_live_not_connected(page)
            await expect(page.by("live-tiles")).to_be_hidden()  # folded: the summary line says it
            await expect(page.card(1)).to_have_attribute("data-state", "pending")
            await expect(page.card(2)).to_have_attribute("data-state", "pending")
            # A cancel could no longer reach the old server: no Cancel that does nothing (a review).
            await expect(page.card(1).get_by_test_id("cancel")).to_be_hidden()
            await expect(page.card(1).get_by_test_id("card-message")).to_contain_text("still coming")
        await expect(page.card(1)).to_have_attribute("data-state", "done")
        await expect(page.card(2)).to_have_attribute("data-state", "done")
        await drain
    assert [f["type"] for f in page.frames if f.get("type") == "going_away"] == ["going_away"]
    assert [(await page.frame_for(i))["type"] for i in (1, 2)] == ["result", "result"]
    # Nothing was sent on the old connection after going_away: only the stats subscription and the
    # two requests before it (the draining server refused the new connection's handshakes).
    assert [f["type"] for f in page.sent] == ["subscribe_stats", "fill_mask", "fill_mask"]
    async with make_server(port=port):
        await expect(status).to_have_attribute("data-state", "connected", timeout=20_000)
        await page.ask("Back [MASK].")
        await expect(page.card(3)).to_have_attribute("data-state", "done")
    await expect(page.card(1)).to_have_attribute("data-state", "done")  # the old cards are still there
    await expect(page.by("notice")).to_be_hidden()


async def test_page_opened_from_disk_says_why_it_is_refused(make_server: Any, open_page: Any) -> None:
    """file://…/index.html?ws=… sends `Origin: null`: refused by default, and the page says so and how
    to fix it (not "is it running?"); with nothing listening it says it cannot reach the server; with
    `null` allowed it works."""
    from playwright.async_api import expect

    page_url = (ROOT / "web_demo" / "index.html").as_uri()
    async with make_server() as strict:
        refused = strict.metrics.handshakes_refused.labels("origin")
        page = await open_page(f"{page_url}?ws={strict.url}", wait=False)
        await wait_until(lambda: refused._value.get() >= 1)
        await expect(page.by("conn-status")).to_have_attribute("data-state", "refused")
        # (From disk it cannot read the server's answers: it says the likely cause, not that it knows it.)
        await expect(page.by("conn-status")).to_contain_text("Refused, or no fill-mask server")
        notice = page.by("notice")
        await expect(notice).to_contain_text("If it is a fill-mask server, it refused this page")
        await expect(notice).to_contain_text("--allowed-origins same-origin,localhost,null")
        await expect(notice).not_to_contain_text("Is it running?")
        assert not strict.connections

    nobody = f"ws://127.0.0.1:{free_port()}/"
    page = await open_page(f"{page_url}?ws={nobody}", wait=False)
    await expect(page.by("notice")).to_contain_text(f"Cannot reach the server at {nobody}. Is it running?")
    await expect(page.by("conn-status")).to_have_attribute("data-state", "offline")

    async with make_server(allowed_origins="same-origin,localhost,null") as open_to_disk:
        page = await open_page(f"{page_url}?ws={open_to_disk.url}")
        await page.ask("Opened from [MASK].")
        await expect(page.card(1)).to_have_attribute("data-state", "done")


async def test_a_wss_address_of_a_plain_server_is_told_to_use_ws(server: Any, open_page: Any) -> None:
    """A web-demo trial's find: wss:// typed for a server without TLS said "Cannot reach the server...
    Is it running?", where the command line says to use ws://. The page now finds the same host and
    port answering plain HTTP, and says so; ws:// then connects."""
    from playwright.async_api import expect

    page = await open_page(f"{server.http_url}/?ws={server.url.replace('ws://', 'wss://')}", wait=False)
    await expect(page.by("notice")).to_contain_text("answers plain HTTP, not TLS: connect with ws://")
    await page.by("ws-url").fill(server.url)
    await page.by("ws-url").press("Enter")
    await page.wait_connected()


async def test_a_malformed_address_says_so_next_to_the_form(server: Any, open_page: Any) -> None:
    """A web-demo trial's find: "ws://", "ws://[::1" or "ws://127.0.0.1:99999/" typed under "Server and
    limits" left the status on "Reconnecting" for good (no countdown, a Retry now that did nothing), said
    why only at the top of the page, out of view, and went into ?ws=, so a reload was stuck the same way.
    Now the reason is under the field, the connection that was open stays open (a review: the typo cost
    every request in flight), and the page's address keeps the last good one; an address in a link
    that is no WebSocket URL is said in the status and taken out of the address."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    await page.page.get_by_text("Server and limits").click()
    field = page.by("ws-url")
    error = page.by("ws-error")
    # (And a port browsers refuse, which the page called a server not running: a demo-page trial.)
    assert set(await page.page.evaluate("[...FillMask.lib.BLOCKED_PORTS]")) == BROWSER_BLOCKED_PORTS
    for bad, why in (("ws://", "it has no host"), ("ws://[::1", "its IPv6 address has no closing ]"),
                     ("ws://127.0.0.1:99999/", "its port, 99999, is above 65535"),
                     ("ws://127.0.0.1:6000/", "its port, 6000, is one that browsers refuse to connect to (the "
                      "Fetch standard blocks it: another protocol's port); start the server on another port")):
        await field.fill(bad)
        await field.press("Enter")
        await expect(error).to_have_text(f'"{bad}" is not a WebSocket URL: {why}. Enter one like '
                                         "ws://127.0.0.1:8765/ and press Connect.")
        await expect(field).to_have_attribute("aria-invalid", "true")
        await assert_in_view(error)
        assert "ws=" not in page.page.url, page.page.url
        await expect(page.by("conn-status")).to_have_attribute("data-state", "connected")  # still
    await page.ask("Still [MASK] here.")  # on the connection that stayed open
    await expect(page.card(1)).to_have_attribute("data-state", "done")
    await field.fill(server.url)
    await field.press("Enter")
    await page.wait_connected()
    await expect(error).to_be_hidden()
    assert f"ws={quote(server.url, safe='')}" in page.page.url, page.page.url
    # A ws:// address from an https page: Chromium's constructor throws a SecurityError for it (a
    # review: it was called "not a WebSocket URL", with advice to type ws://). Made here as Chromium
    # makes it, on this http page.
    await page.page.evaluate("""() => { FillMaskDemo.client.WebSocket = function () {
        const err = new Error('insecure'); err.name = 'SecurityError'; throw err; }; }""")
    await field.fill("ws://elsewhere.example:8765/")
    await field.press("Enter")
    await expect(error).to_have_text('This page was loaded over https, and browsers let it open only wss:// '
                                     'connections: "ws://elsewhere.example:8765/" is refused. Use the wss:// '
                                     'address (a server started with --certfile), or open the page over http.')
    await expect(page.by("conn-status")).to_have_attribute("data-state", "connected")
    # One in the page's address (a link, a bookmark from before): the same, and said at the top too.
    stuck = await open_page(f"{server.http_url}/?ws={quote('ws://[::1', safe='')}", wait=False)
    await expect(stuck.page.locator("#conn-text")).to_have_text("Not a WebSocket URL")
    await expect(stuck.by("reconnect-now")).to_be_hidden()
    await expect(stuck.by("notice")).to_contain_text('"ws://[::1" is not a WebSocket URL')
    await expect(stuck.by("ws-error")).to_be_visible()
    assert "ws=" not in stuck.page.url, stuck.page.url  # a reload tries the page's own server


async def test_another_origin_that_is_no_fill_mask_server_is_not_called_a_refusal(server: Any, open_page: Any,
                                                                                   tmp_path: Path) -> None:
    """A web-demo trial's find: ?ws= pointing at a plain HTTP server on another origin (python -m http.server)
    said "Refused by the server ... start it with --allowed-origins", wrong advice: a page cannot read
    another origin's answers (nor, in any browser, a handshake's status), so it cannot tell an Origin
    refusal from a server that is not a fill-mask server. The page says what it knows, and both causes."""
    import functools
    import http.server
    import threading

    from playwright.async_api import expect

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{plain.server_address[1]}"
        page = await open_page(f"{server.http_url}/?ws=ws://127.0.0.1:{plain.server_address[1]}/", wait=False)
        notice = page.by("notice")
        await expect(notice).to_contain_text(f"Something answers HTTP at {base}, but it did not take a WebSocket "
                                             "connection from this page, and browsers do not tell a page why.")
        await expect(notice).to_contain_text("If it is a fill-mask server, it refused this page")
        await expect(notice).to_contain_text("If it is not a fill-mask server, set the fill-mask server's address")
        await expect(notice).not_to_contain_text("is running but refused this page")
        await expect(page.page.locator("#conn-text")).to_have_text("Refused, or no fill-mask server")
    finally:
        plain.shutdown()
        plain.server_close()


async def test_a_full_server_is_not_called_a_token_problem_and_the_page_gets_in_once_there_is_room(
        make_server: Any, open_page: Any) -> None:
    """A demo-page trial: with --max-connections 1, a second tab said the server was probably started
    with --token (it was not). The page asks its own server's /metrics, which answers 401 only with a
    token, and says the server is full; it keeps trying and connects once the first tab has gone."""
    from playwright.async_api import expect

    async with make_server(max_connections=1) as full:
        first = await open_page(full.http_url + "/")
        second = await open_page(full.http_url + "/", wait=False)
        await expect(second.page.locator("#conn-text")).to_have_text("Server full; reconnecting", timeout=15_000)
        await expect(second.by("notice")).to_contain_text("--max-connections")
        assert "--token" not in (await second.by("notice").text_content() or "")
        await first.page.close()
        await second.wait_connected()


async def test_token_refusal_is_diagnosed_and_fixed_from_the_page(make_server: Any, open_page: Any) -> None:
    """The page served by a server with --token cannot connect without it: the page says so (it can
    read /readyz on its own origin), and the address with ?token= set on the page connects. The token
    then stays in memory: not in the page's address (history, a reload's request line), the status
    tooltip or the frame log (a TLS audit found it in all three)."""
    from playwright.async_api import expect

    async with make_server(token="s3cret") as guarded:
        page = await open_page(guarded.http_url + "/", wait=False)
        await expect(page.by("conn-status")).to_have_attribute("data-state", "refused")
        await expect(page.by("notice")).to_contain_text("--token")
        await page.by("ws-url").fill(f"{guarded.url}?token=s3cret")
        await page.by("ws-url").press("Enter")
        await page.wait_connected()
        await expect(page.by("notice")).to_be_hidden()
        await page.ask("With the [MASK].")
        await expect(page.card(1)).to_have_attribute("data-state", "done")
        assert "s3cret" not in page.page.url and "ws=" in page.page.url, page.page.url
        assert "s3cret" not in (await page.by("conn-status").get_attribute("title") or "")
        assert "s3cret" not in await page.page.evaluate("document.body.innerText + JSON.stringify(localStorage) + "
                                                   "JSON.stringify(sessionStorage)")
        # An address that holds it (a bookmark made before): used once, then no longer kept.
        kept = await open_page(f"{guarded.http_url}/?ws={quote(guarded.url + '?token=s3cret', safe='')}")
        assert "s3cret" not in kept.page.url and "ws=" in kept.page.url, kept.page.url
        # Nor in copied code (a web-demo trial found it in every snippet, pasted into chats and issues):
        # the Python and the command read FILLMASK_TOKEN, and run with it.
        snippets = {}
        for language in ("python", "js", "cli"):
            await page.card(1).get_by_test_id(f"copy-{language}").click()
            await expect(page.card(1).get_by_test_id("copy-status")).to_have_text("copied")
            snippets[language] = await page.card(1).get_by_test_id("snippet").text_content() or ""
            clipboard = await page.page.evaluate("navigator.clipboard.readText()")
            assert clipboard == snippets[language] and "s3cret" not in clipboard, clipboard
            assert "FILLMASK_TOKEN" in clipboard, clipboard
        rc, out, err = await run(sys.executable, "-c", snippets["python"], env={"FILLMASK_TOKEN": "s3cret"})
        assert rc == 0 and "token_str" in out, err
        argv = shlex.split(snippets["cli"], comments=True)
        rc, out, err = await run(str(Path(sys.executable).parent / "fillmask-client"), *argv[1:],
                                 env={"FILLMASK_TOKEN": "s3cret"})
        assert rc == 0, err


# ---------------------------------------------------------------------------- keyboard and high contrast

FOCUSED = """() => { const e = document.activeElement; const r = e.getBoundingClientRect();
    return {name: (e.getAttribute('aria-label') || e.textContent || e.id).trim().slice(0, 40), top: r.top,
            bottom: r.bottom, inHeader: Boolean(e.closest('.top-bar')), skip: e.classList.contains('skip-link'),
            header: document.querySelector('.top-bar').getBoundingClientRect().bottom}; }"""


@pytest.mark.parametrize("viewport", [DESKTOP, {"width": 640, "height": 450}], ids=["desktop", "zoomed_200"])
async def test_keyboard_focus_is_never_hidden_under_the_sticky_header(server: Any, open_page: Any,
                                                                      viewport: dict[str, int]) -> None:
    """A demo-page trial: Shift+Tab up a page of answers scrolled each focused element to the window's
    top edge, under the sticky header (3 Tab stops wholly hidden at 1280 x 900, 9 at 200% zoom, here a
    640 x 450 window). The page now pads its scrolling by the header's height, which it follows as
    zoom or a wrapped line change it."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/", viewport=viewport)
    for n in range(1, 5):
        await page.ask("The [MASK] sat on the [MASK] mat.")
        await expect(page.card(n)).to_have_attribute("data-state", "done")
    await page.by("frame-log").locator("summary").focus()
    seen = []
    for _ in range(80):  # bounded: the page has fewer Tab stops than this above its log
        await page.page.keyboard.press("Shift+Tab")
        focused = await page.page.evaluate(FOCUSED)
        if focused["skip"]:
            break
        seen.append(focused)
        if not focused["inHeader"]:
            assert focused["top"] >= focused["header"] - 1, focused
    assert len(seen) >= 20 and sum(not f["inHeader"] for f in seen) >= 15, seen  # the cards' stops were walked


async def test_in_forced_colours_the_chosen_candidate_and_the_score_bars_stay_visible(server: Any,
                                                                                      open_page: Any) -> None:
    """A demo-page trial (high contrast, as Windows' contrast themes force it): the chosen candidate
    was marked by its background alone and the score bars were a fill on a track, both dropped in
    forced colours, so neither could be seen. The chosen one now has a border of its own, and the
    bars are drawn in the system's colours."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    # (The same trial: "Cancel all", disabled with nothing in flight, looked like a live link.)
    await expect(page.by("cancel-all")).to_be_disabled()
    assert await page.by("cancel-all").evaluate("b => getComputedStyle(b).textDecorationLine") == "none"
    await page.page.emulate_media(forced_colors="active")
    await page.ask("The [MASK] sat on the mat.")
    await expect(page.card(1)).to_have_attribute("data-state", "done")
    looks = await page.card(1).evaluate("""card => [...card.querySelectorAll('.pred-button')].map(b => {
        const s = getComputedStyle(b), fill = getComputedStyle(b.querySelector('.fill'));
        const bar = getComputedStyle(b.querySelector('.bar'));
        return {chosen: b.getAttribute('aria-pressed') === 'true', border: s.borderTopWidth + ' ' + s.borderTopColor,
                fill: fill.backgroundColor, page: getComputedStyle(document.body).backgroundColor,
                barBorder: bar.borderTopWidth}; })""")
    chosen = [look["border"] for look in looks if look["chosen"]]
    others = {look["border"] for look in looks if not look["chosen"]}
    assert len(chosen) == 1 and chosen[0] not in others, looks
    assert all(look["fill"] != look["page"] and look["barBorder"] != "0px" for look in looks), looks


# ---------------------------------------------------------------------------- pictures


async def test_screenshots_desktop_and_phone(server: Any, open_page: Any) -> None:
    """A representative session, photographed at desktop and at 375 px; the phone layout never scrolls sideways."""
    from playwright.async_api import expect

    ARTIFACTS.mkdir(exist_ok=True)
    for name, viewport in (("desktop", PORTRAIT), ("phone", PHONE)):
        page = await open_page(server.http_url + "/", viewport=viewport)
        await page.ask("There is no mask in this one.")
        with server.engine.paused():
            await page.send_burst(4)
            await wait_until(lambda: server.engine.queued() == 4)
        await expect(page.burst(1).get_by_test_id("burst-summary")).to_have_attribute("data-done", "4")
        await page.ask("The [MASK] sat on the [MASK].")
        await page.by("options").locator("summary").click()
        await page.by("targets").fill("capital, city, heart")
        await page.ask("Paris is the [MASK] of France.")
        await expect(page.card(7)).to_have_attribute("data-state", "done")
        await expect(page.by("inflight")).to_have_attribute("data-count", "0")
        await page.card(7).get_by_test_id("copy-python").click()
        await page.page.get_by_text("Server and limits").click()
        await expect(page.by("limits")).to_contain_text(f"up to {server.config.max_batch_size} requests")
        await page.page.get_by_text("Server and limits").click()
        await page.by("frame-log").locator("summary").click()
        await expect(page.by("frame-log").get_by_test_id("log-entry").last).to_be_visible()
        await page.page.evaluate("document.activeElement.blur(); window.scrollTo(0, 0)")
        width = await page.page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"{name}: the page is {width}px wide in a {viewport['width']}px window"
        path = ARTIFACTS / f"web-demo-{name}.png"
        await page.page.screenshot(path=str(path), full_page=name == "phone")
        assert path.stat().st_size > 10_000
        if os.environ.get("FILLMASK_UPDATE_SCREENSHOT"):
            if name == "desktop":
                shutil.copyfile(path, README_SCREENSHOT)
            else:  # the README's phone picture: the window itself, right after the answer came
                await page.page.evaluate("window.scrollTo(0, 0)")
                await page.ask("Paris is the [MASK] of France.")
                await expect(page.card(8)).to_have_attribute("data-state", "done")
                await page.page.screenshot(path=str(README_PHONE_SCREENSHOT))


async def test_the_status_line_wraps_between_its_parts_not_inside_them_on_a_phone(server: Any,
                                                                                   open_page: Any) -> None:
    """A browser trial: at 360 px "Server not reachable · in 1 s · Retry now" wrapped inside its parts
    ("in 1 / s", "Retry / now"). Each part now stays on one line, and the line wraps between them."""
    from playwright.async_api import expect

    page = await open_page(f"{server.http_url}/?ws=ws://127.0.0.1:{free_port()}/",
                           viewport={"width": 360, "height": 740}, wait=False)
    await expect(page.by("reconnect-now")).to_be_visible(timeout=15_000)
    await expect(page.page.locator("#conn-detail")).not_to_be_empty(timeout=15_000)
    heights = await page.page.evaluate("""() => ['conn-text', 'conn-detail', 'reconnect-now'].map((id) => {
        const el = document.getElementById(id);
        return [el.getBoundingClientRect().height, parseFloat(getComputedStyle(el).lineHeight) || 20];
    })""")
    for height, line in heights:
        assert height < 1.6 * line, heights  # one line each
    width = await page.page.evaluate("document.documentElement.scrollWidth")
    assert width <= 360, width  # and nothing sideways
