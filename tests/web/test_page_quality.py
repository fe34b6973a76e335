"""Weight, speed, accessibility and the bare-server mode of the chat page, in headless chromium.

Figures are printed (run with -s to see them): page weight on the wire, and time from send to the
first token painted next to the API's own time to first token for the same request."""

from __future__ import annotations

import statistics
import time

import httpx
import pytest

from tests.gateway.harness import Gateway, KvikServe
from tests.support.sse import sse_lines
from tests.web.conftest import SCREENSHOTS
from tests.web.page_helpers import content, csp_violations, open_page, send, sign_in, wait_done, wait_until

pytestmark = pytest.mark.timeout(300)
PAGE_WEIGHT_LIMIT = 300 * 1024
TTFT_PROMPT = "Say something short."
SAMPLES = 5

CONTRAST = """(selectors) => {
  const parse = (c) => (c.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const background = (el) => {
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) return c.slice(0, 3);
    }
    return [255, 255, 255];
  };
  const worst = [];
  for (const sel of selectors) {
    for (const el of document.querySelectorAll(sel)) {
      if (!el.offsetParent || !el.textContent.trim()) continue;
      const a = lum(parse(getComputedStyle(el).color).slice(0, 3));
      const b = lum(background(el));
      const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
      worst.push([sel, Math.round(ratio * 100) / 100]);
    }
  }
  return worst;
}"""
TEXT_SELECTORS = ["body", ".msg-role", ".msg-meta", ".user-text", ".md p", ".btn", ".btn.primary",
                  ".conversation-open", ".chat-title", ".code-lang", "td", "th", ".hljs-keyword", ".hljs-string",
                  ".hljs-comment", ".hljs-number"]


def test_page_weight_on_first_load(browser, gateway: Gateway) -> None:
    context = browser.new_context()
    page = context.new_page()
    responses = []
    page.on("response", lambda response: responses.append(response))
    page.goto(gateway.url + "/", wait_until="networkidle")
    weights = {}
    for response in responses:
        path = response.url.split(gateway.url, 1)[-1]
        if path == "/" or path.startswith("/assets/"):
            weights[path] = (response.request.sizes()["responseBodySize"], response.headers.get("content-encoding"))
    total = sum(size for size, _ in weights.values())
    print(f"\nfirst load: {total / 1024:.1f} KiB on the wire in {len(weights)} files: {weights}")
    assert any(path.endswith(".js") for path in weights) and any(path.endswith(".css") for path in weights)
    assert all(encoding in ("br", "gzip") for path, (_, encoding) in weights.items() if path != "/assets/favicon")
    assert total < PAGE_WEIGHT_LIMIT
    context.close()


def test_send_to_first_token_painted_tracks_the_api_ttft(browser, kvik_server: KvikServe) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": TTFT_PROMPT}], "max_tokens": 8,
            "stream": True, "temperature": 0}
    api_ttft = []
    with httpx.Client(base_url=kvik_server.url, timeout=30) as client:
        for _ in range(SAMPLES):
            started = time.perf_counter()
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in sse_lines(response):
                    if '"content":"' in line and '"content":""' not in line:
                        api_ttft.append((time.perf_counter() - started) * 1000)
                        break
    page = open_page(browser, kvik_server.url + "/")
    page.click("#settings-button")
    page.fill("#setting-temperature", "0")
    page.dispatch_event("#setting-temperature", "change")
    page.fill("#setting-max_tokens", "8")
    page.dispatch_event("#setting-max_tokens", "change")
    received, painted = [], []
    for _ in range(SAMPLES):
        page.click("#new-chat")  # a new chat keeps the settings: one message, as the API requests
        answer = send(page, TTFT_PROMPT)
        assert wait_done(page, answer) == "completed"
        received.append(float(answer.get_attribute("data-ttft-ms")))
        painted.append(float(answer.get_attribute("data-paint-ms")))
    api, got, paint = (statistics.median(v) for v in (api_ttft, received, painted))
    print(f"\nTTFT medians over {SAMPLES}: API (HTTP client) {api:.1f} ms; page first token received "
          f"{got:.1f} ms, painted {paint:.1f} ms; painted - API = {paint - api:.1f} ms")
    # The target is 50 ms; on a busy two-core test machine only a generous bound is asserted.
    assert paint - api < 500
    assert paint >= got
    page.context.close()


def test_bare_server_page_keeps_chats_in_the_browser(browser, kvik_server: KvikServe) -> None:
    page = open_page(browser, kvik_server.url + "/")
    assert page.locator("#signin").is_hidden()  # no key on this server
    answer = send(page, "kept in this browser")
    assert wait_done(page, answer) == "completed"
    assert "WebSocket" in answer.locator(".msg-meta").inner_text()
    page.reload()
    page.wait_for_selector("#conversation-list .conversation")
    assert page.locator("#conversation-list .conversation-open").first.inner_text() == "kept in this browser"
    assert page.evaluate("Object.keys(localStorage).some(k => k.startsWith('kvik.conversation.v1.'))")
    page.context.close()

    # No WebSocket in this browser: the page falls back to SSE by itself.
    context = browser.new_context()
    context.add_init_script("delete window.WebSocket;")
    page = context.new_page()
    page.goto(kvik_server.url + "/")
    answer = send(page, "over server-sent events")
    assert wait_done(page, answer) == "completed"
    assert "SSE" in answer.locator(".msg-meta").inner_text()
    context.close()


def test_accessibility_basics_and_screenshots(browser, gateway: Gateway) -> None:
    key = gateway.create_key(name="web-screens", models=["scripted", "tiny"])
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for scheme in ("light", "dark"):
        page = open_page(browser, gateway.url + "/", color_scheme=scheme)
        sign_in(page, key)
        page.select_option("#model-select", "scripted")
        send(page, "think about it")
        answer = send(page, "Show me some markdown please")
        assert content(answer)
        # Every control has a name a screen reader can say.
        unnamed = page.evaluate("""() => [...document.querySelectorAll('button, input, select, textarea, a[href]')]
            .filter(el => el.offsetParent && !(el.labels?.length || el.getAttribute('aria-label') || el.textContent.trim()
                                             || el.getAttribute('title')))
            .map(el => el.outerHTML.slice(0, 80))""")
        assert unnamed == []
        ratios = page.evaluate(CONTRAST, TEXT_SELECTORS)
        low = [(sel, ratio) for sel, ratio in ratios if ratio < 4.5]
        assert ratios and not low, low
        # Frame the last question and its answer (a table, code and math) for the README.
        page.evaluate("() => { const questions = document.querySelectorAll('#messages article.user'); "
                      "const box = document.querySelector('#messages'); "
                      "box.scrollTop = questions[questions.length - 1].offsetTop - box.offsetTop - 12; }")
        page.screenshot(path=str(SCREENSHOTS / f"chat-{scheme}.png"))
        assert csp_violations(page) == [] and not page.errors, page.errors
        page.context.close()

    # Keyboard: the skip link comes first, and Tab reaches the message box.
    page = open_page(browser, gateway.url + "/")
    sign_in(page, key)
    # Signing in ends with a new chat, which focuses the message box: let that happen first.
    wait_until(page, "document.activeElement.id === 'composer-input'")
    # Start keyboard navigation from the top of the document.
    page.evaluate("() => { const start = document.createElement('span'); start.tabIndex = -1; "
                  "document.body.prepend(start); start.focus(); }")
    order = []
    for _ in range(40):
        page.keyboard.press("Tab")
        order.append(page.evaluate("document.activeElement.id || document.activeElement.className"))
    assert order[0] == "skip-link"
    assert order.index("new-chat") < order.index("search") < order.index("composer-input")
    page.keyboard.press("Control+Shift+O")
    wait_until(page, "document.activeElement.id === 'composer-input'")
    page.context.close()

    # A phone-sized screen: the conversation list is a drawer behind a labelled button.
    page = open_page(browser, gateway.url + "/", viewport={"width": 390, "height": 844})
    sign_in(page, key)
    page.select_option("#model-select", "scripted")
    send(page, "hello from a phone")
    assert page.locator("#sidebar").bounding_box()["x"] < 0  # off-screen
    assert page.evaluate("document.documentElement.scrollWidth <= 390")
    page.screenshot(path=str(SCREENSHOTS / "chat-phone.png"))
    page.get_by_role("button", name="Show conversations").click()
    wait_until(page, "document.querySelector('#sidebar').getBoundingClientRect().x >= 0")
    page.context.close()
