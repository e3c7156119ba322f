"""The demo page in headless Chromium (Debian's, through Playwright): two prompts stream side by
side, each pane shows its text and numbers, the engine panel fills in, the layout survives a
narrow window. Screenshots go to test-artifacts/ (gitignored) for a human to look at."""

import re
from pathlib import Path

import pytest

from pdflash.engine.async_engine import AsyncEngine
from pdflash.server import BackgroundServer, ServerSettings, create_app
from pdflash.target.tiny import write_tiny_drafter

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (Debian's chromium: apt-get install chromium)"
)


@pytest.fixture(scope="module")
def server(tiny_target, tmp_path_factory):
    drafter = write_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target)
    engine = AsyncEngine.from_pretrained(
        tiny_target, drafter, block_size=4, offload={"expert_cache_fraction": 0.5, "link_gbps": 16.0}
    )
    app = create_app(engine, ServerSettings(model_name="tiny-demo", stats_interval_s=0.2))
    with BackgroundServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def test_two_prompts_stream_side_by_side(server, browser):
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(server.url + "/")
    expect(page.locator("#connection")).to_have_text("connected")
    expect(page.locator("#model")).to_have_text("model: tiny-demo")

    page.get_by_label("Max tokens").fill("48")
    page.get_by_label("Prompt 1", exact=True).fill("def quicksort(xs):")
    page.get_by_role("button", name="Start", exact=True).first.click()  # pane 1: by mouse
    prompt2 = page.get_by_label("Prompt 2", exact=True)
    prompt2.fill("Once upon a time")
    prompt2.press("Enter")  # pane 2: by keyboard

    panes = page.locator(".pane")
    for i in (0, 1):
        expect(panes.nth(i).locator(".status")).to_contain_text("finished: length, 48 tokens", timeout=30_000)
        assert panes.nth(i).locator(".output").inner_text() != ""
        expect(panes.nth(i).locator(".s-tokens")).to_have_text("48")
        assert float(panes.nth(i).locator(".s-tps").inner_text()) > 0
        assert float(panes.nth(i).locator(".s-tau").inner_text()) >= 1
        assert panes.nth(i).locator(".acceptance span").count() > 0  # one bar per verify round
        shown = panes.nth(i).locator(".acceptance-text").inner_text()  # "emitted/verified" per round
        assert re.search(r"policy chose\): (\d+/\d+ ?)+$", shown), shown
    expect(panes.nth(2).locator(".status")).to_have_text("")  # the third pane was not started

    expect(page.locator("#stat-link")).to_have_text("emulated")
    assert page.locator("#stat-fetched").inner_text().endswith("B")
    assert page.locator("#stat-hit").inner_text().endswith("%")
    assert page.locator("#stat-projected").inner_text() not in ("–", "0 B")
    assert page.locator("#stat-vetoed").inner_text().isdigit()  # the policy's vetoed drafts, counted

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)
    assert not errors, errors
    page.close()


def test_narrow_window_has_no_horizontal_scroll_and_keyboard_reaches_the_controls(server, browser):
    page = browser.new_page(viewport={"width": 380, "height": 800})
    page.goto(server.url + "/")
    page.locator("#connection").filter(has_text="connected").wait_for()
    width = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert width[0] <= width[1], f"horizontal overflow: content {width[0]}px in a {width[1]}px window"
    boxes = [page.locator(".pane").nth(i).bounding_box() for i in range(2)]
    assert boxes[1]["y"] > boxes[0]["y"] and abs(boxes[1]["x"] - boxes[0]["x"]) < 1  # panes stack

    focused = set()
    for _ in range(12):
        page.keyboard.press("Tab")
        focused.add(page.evaluate("document.activeElement.id || document.activeElement.textContent.trim()"))
    assert {"max-tokens", "temperature", "start-all", "prompt-1", "Start"} <= focused, focused
    page.screenshot(path=str(ARTIFACTS / "demo-narrow.png"), full_page=True)
    page.close()


@pytest.fixture(scope="module")
def keyed_server(tiny_target):
    engine = AsyncEngine.from_pretrained(tiny_target)
    app = create_app(engine, ServerSettings(model_name="tiny-keyed", api_key="sk-demo", max_model_len=1024))
    with BackgroundServer(app) as running:
        yield running


def test_with_an_api_key_the_page_asks_for_it_once_and_streams(keyed_server, browser):
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    asked = []
    page.on("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept("sk-demo")))
    page.goto(keyed_server.url + "/")
    page.wait_for_function("localStorage.getItem('pdflash-api-key') === 'sk-demo'")
    assert asked == ["This server needs an API key:"]
    page.reload()  # the key is kept: no second question; max tokens now bounded by the context
    expect(page.get_by_label("Max tokens")).to_have_attribute("max", "1023")
    expect(page.locator("#connection")).to_have_text("connected")
    page.get_by_label("Max tokens").fill("8")
    page.get_by_role("button", name="Start", exact=True).first.click()
    expect(page.locator(".pane").nth(0).locator(".status")).to_contain_text("finished: length, 8 tokens")
    assert asked == ["This server needs an API key:"]
    page.close()
