"""The demo page (web_demo/) in a real headless Chromium, against the real server on the tiny model.

Each test opens the page as a person would (served by the server itself at ``GET /``), drives it
with the keyboard and mouse through Playwright, and checks what is rendered against what the server
sent: the frames the page received (captured from the browser's own WebSocket) and, independently, a
reference request made over a separate connection.

Needs Debian's ``chromium`` and the ``playwright`` Python package (``bash scripts/setup.sh --test``).
Without them the tests skip and say how to install them, except in CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from websockets.asyncio.client import connect

from tests.wire import wait_until

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
README_SCREENSHOT = ROOT / "web_demo" / "screenshot.png"
INSTALL_HINT = ("install them with `bash scripts/setup.sh --test` (Debian's chromium and the playwright "
                "package), or set FILLMASK_CHROMIUM to a Chromium binary")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 375, "height": 812}
PORTRAIT = {"width": 1280, "height": 1200}  # the README's picture: room for the burst's cards too


def _unavailable(reason: str) -> None:
    """Skip with a how-to where the browser truly is missing; in CI that is a failure."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the demo-page test: {INSTALL_HINT}", pytrace=False)
    pytest.skip(f"{reason}; {INSTALL_HINT}")


def _find_chromium() -> str | None:
    configured = os.environ.get("FILLMASK_CHROMIUM")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    for candidate in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        found = shutil.which(candidate)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        _unavailable("the playwright Python package is not installed")
    executable = _find_chromium()
    if executable is None:
        _unavailable("no Chromium found (looked for FILLMASK_CHROMIUM, /usr/bin/chromium, chromium)")
    async with async_playwright() as playwright:
        # A launch failure with the browser present is a real failure, not a skip.
        chromium = await playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield chromium
        await chromium.close()


class Page:
    """One browser tab on the demo page, with the frames its WebSocket received."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.frames: list[dict[str, Any]] = []
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.on("websocket", self._watch)

    def _watch(self, ws: Any) -> None:
        ws.on("framereceived", lambda payload: self.frames.append(orjson.loads(payload)))

    def by(self, test_id: str) -> Any:
        return self.page.get_by_test_id(test_id)

    def card(self, request_id: int) -> Any:
        return self.page.locator(f'[data-testid="request-card"][data-id="{request_id}"]')

    async def frame_for(self, request_id: int) -> dict[str, Any]:
        """The one frame the page received about ``request_id`` (its terminal frame, §8)."""
        await wait_until(lambda: any(f.get("id") == request_id for f in self.frames))
        frames = [f for f in self.frames if f.get("id") == request_id]
        assert len(frames) == 1, frames
        return frames[0]

    async def ask(self, text: str) -> None:
        """Type ``text`` into the sentence box and press Enter."""
        box = self.by("text-input")
        await box.fill(text)
        await box.press("Enter")

    async def wait_connected(self) -> None:
        from playwright.async_api import expect

        await expect(self.by("conn-status")).to_have_attribute("data-state", "connected", timeout=10_000)


@pytest.fixture
async def open_page(browser: Any) -> AsyncIterator[Callable[..., Any]]:
    """``await open_page(url, viewport=...)``: a fresh browser context on ``url``, connected."""
    contexts = []
    pages: list[Page] = []

    async def opener(url: str, viewport: dict[str, int] = DESKTOP, wait: bool = True) -> Page:
        context = await browser.new_context(viewport=viewport, color_scheme="light", reduced_motion="reduce")
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



async def rendered(card: Any) -> list[dict[str, Any]]:
    """Each prediction list of a card, as shown: one dict per list with its rows and filled-in sentence."""
    return await card.evaluate("""card => Array.from(card.querySelectorAll('[data-testid=prediction-list]'))
        .map(list => ({
            filled: list.querySelector('[data-testid=filled-sentence]').textContent,
            highlighted: (list.querySelector('[data-testid=filled-sentence] mark') || {}).textContent || null,
            rows: Array.from(list.querySelectorAll('[data-testid=prediction]')).map(li => ({
                rank: Number(li.dataset.rank),
                token: Number(li.dataset.token),
                token_str: li.dataset.tokenStr,
                score: Number(li.dataset.score),
                sequence: li.dataset.sequence,
                shown_token: li.querySelector('[data-testid=prediction-token]').textContent,
                shown_score: li.querySelector('[data-testid=prediction-score]').textContent,
                bar_percent: parseFloat(li.querySelector('.fill').style.width),
                visible: li.getBoundingClientRect().height > 0,
            })),
        }))""")


def assert_rendered_as_sent(lists: list[dict[str, Any]], predictions: list[Any]) -> None:
    """The rows show exactly the frame's predictions, in its order, with honest scores and bars."""
    groups = predictions if predictions and isinstance(predictions[0], list) else [predictions]
    assert len(lists) == len(groups)
    for shown, group in zip(lists, groups, strict=True):
        assert [row["rank"] for row in shown["rows"]] == list(range(1, len(group) + 1))
        for row, pred in zip(shown["rows"], group, strict=True):
            assert row["visible"]
            assert (row["token"], row["token_str"], row["shown_token"]) == (pred["token"], pred["token_str"],
                                                                           pred["token_str"])
            assert row["score"] == pred["score"]  # the exact number the frame carried
            assert row["shown_score"].endswith("%")
            percent = float(row["shown_score"][:-1])
            assert percent == pytest.approx(pred["score"] * 100, rel=5e-3), row  # 3 significant digits
            assert row["bar_percent"] == pytest.approx(pred["score"] * 100, abs=1e-3)  # CSS keeps ~6 digits
        # The first row is selected: its sequence is the filled-in sentence.
        assert shown["filled"] == "Filled in: " + group[0]["sequence"]
        if group[0]["token_str"].isalpha() and group[0]["token_str"] in group[0]["sequence"]:
            assert shown["highlighted"] == group[0]["token_str"]


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
    assert shown == pytest.approx(value, abs=0.05 if value < 10 else 0.5)


async def metrics(card: Any) -> dict[str, dict[str, str]]:
    return await card.evaluate("""card => Object.fromEntries(
        Array.from(card.querySelectorAll('[data-testid=metrics] .metric')).map(m => [m.dataset.testid,
            {value: m.dataset.value, text: m.querySelector('.metric-value').textContent}]))""")


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
    await page.by("top-k").fill("7")
    await box.press("Enter")

    card = page.card(1)
    await expect(card).to_have_attribute("data-state", "done")
    await expect(card.get_by_test_id("card-id")).to_have_text("#1")
    result = await page.frame_for(1)
    assert result["type"] == "result" and len(result["predictions"]) == 7
    assert_rendered_as_sent(await rendered(card), result["predictions"])
    _, expected = await reference(server.url, {"type": "fill_mask", "id": "ref", "text": text, "top_k": 7})
    assert_same_as_reference(result["predictions"], expected["predictions"])

    shown = await metrics(card)
    assert_metric(shown, "metric-queue-ms", result["queue_ms"])
    assert_metric(shown, "metric-inference-ms", result["inference_ms"])
    assert int(shown["metric-batch-size"]["value"]) == result["batch_size"] >= 1

    # Two masks: one ranked list per mask, in text order.
    two = f"The {mask} sat on the {mask}."
    await page.ask(two)
    card = page.card(2)
    await expect(card).to_have_attribute("data-state", "done")
    await expect(card.locator(".mask-title")).to_have_text(["Mask 1 of 2", "Mask 2 of 2"])
    result = await page.frame_for(2)
    assert_rendered_as_sent(await rendered(card), result["predictions"])
    _, expected = await reference(server.url, {"type": "fill_mask", "id": "ref", "text": two, "top_k": 7})
    assert_same_as_reference(result["predictions"], expected["predictions"])

    # Choosing another row (keyboard: arrow down) shows that row's filled-in sentence.
    first_list = card.get_by_test_id("prediction-list").first
    await first_list.locator(".pred-button").first.focus()
    await page.page.keyboard.press("ArrowDown")
    await expect(first_list.get_by_test_id("filled-sentence")).to_have_text(
        "Filled in: " + result["predictions"][0][1]["sequence"])
    await expect(first_list.locator(".pred-button").nth(1)).to_be_focused()


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
    await expect(card.get_by_test_id("predictions")).to_be_empty()
    await expect(page.by("inflight")).to_have_attribute("data-count", "0")


async def test_burst_is_batched(server: Any, open_page: Any) -> None:
    """A burst sent while the engine is held runs as one batch: every card shows a batch size above 1."""
    from playwright.async_api import expect

    page = await open_page(server.http_url + "/")
    n = 6
    with server.engine.paused():
        await page.by("burst-size").fill(str(n))
        await page.by("burst-send").click()
        await wait_until(lambda: server.engine.queued() == n)
        await expect(page.by("inflight")).to_have_attribute("data-count", str(n))
    summary = page.by("burst-summary")
    await expect(summary).to_have_attribute("data-done", str(n))

    cards = page.page.locator('[data-testid="request-card"]')
    await expect(cards).to_have_count(n)
    texts = await cards.get_by_test_id("card-text").all_text_contents()
    assert len(set(texts)) == n, texts  # the sentences vary
    sizes = [int(v) for v in await cards.get_by_test_id("metric-batch-size").evaluate_all(
        "nodes => nodes.map(n => n.dataset.value)")]
    frames = [f for f in page.frames if f.get("type") == "result"]
    assert sorted(sizes) == sorted(f["batch_size"] for f in frames)
    assert min(sizes) > 1, sizes
    assert int(await summary.get_attribute("data-max-batch")) == max(sizes)
    await expect(summary.get_by_test_id("batch-chip").first).to_be_visible()


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
    await expect(status).to_contain_text("Reconnecting")
    # ... and finds a new server on the same address by itself.
    async with make_server(max_queue=1, port=port):
        await expect(status).to_have_attribute("data-state", "connected", timeout=20_000)
        await page.ask("Back [MASK] again.")
        await expect(page.card(3)).to_have_attribute("data-state", "done")


async def test_screenshots_desktop_and_phone(server: Any, open_page: Any) -> None:
    """A representative session, photographed at desktop and at 375 px; the phone layout never scrolls sideways."""
    from playwright.async_api import expect

    ARTIFACTS.mkdir(exist_ok=True)
    for name, viewport in (("desktop", PORTRAIT), ("phone", PHONE)):
        page = await open_page(server.http_url + "/", viewport=viewport)
        await page.ask("There is no mask in this one.")
        with server.engine.paused():
            await page.by("burst-size").fill("4")
            await page.by("burst-send").click()
            await wait_until(lambda: server.engine.queued() == 4)
        await expect(page.by("burst-summary")).to_have_attribute("data-done", "4")
        await page.ask("The [MASK] sat on the [MASK].")
        await page.ask("Paris is the [MASK] of France.")
        await expect(page.card(7)).to_have_attribute("data-state", "done")
        await expect(page.by("inflight")).to_have_attribute("data-count", "0")
        await page.page.get_by_text("Server and limits").click()
        await expect(page.by("limits")).to_contain_text(f"up to {server.config.max_batch_size} requests")
        await page.page.evaluate("document.activeElement.blur()")
        width = await page.page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"{name}: the page is {width}px wide in a {viewport['width']}px window"
        path = ARTIFACTS / f"web-demo-{name}.png"
        await page.page.screenshot(path=str(path), full_page=name == "phone")
        assert path.stat().st_size > 10_000
        if name == "desktop" and os.environ.get("FILLMASK_UPDATE_SCREENSHOT"):
            shutil.copyfile(path, README_SCREENSHOT)


async def test_page_opened_from_disk_works_with_null_origin_allowed(make_server: Any, open_page: Any) -> None:
    """file://…/index.html?ws=… sends `Origin: null`: refused by default, served with `null` allowed."""
    from playwright.async_api import expect

    page_url = (ROOT / "web_demo" / "index.html").as_uri()
    async with make_server() as strict:
        refused = strict.metrics.handshakes_refused.labels("origin")
        page = await open_page(f"{page_url}?ws={strict.url}", wait=False)
        await wait_until(lambda: refused._value.get() >= 1)
        assert await page.by("conn-status").get_attribute("data-state") != "connected"
        assert not strict.connections
    async with make_server(allowed_origins="same-origin,localhost,null") as open_to_disk:
        page = await open_page(f"{page_url}?ws={open_to_disk.url}")
        await page.ask("Opened from [MASK].")
        await expect(page.card(1)).to_have_attribute("data-state", "done")
