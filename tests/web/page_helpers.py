"""Driving the chat page in a real browser: sign in, send, wait for answers, read what was painted."""

from __future__ import annotations

import time
from typing import Any

# Runs before the page's own scripts (Playwright injects it outside the page's CSP): records CSP
# violations, and every change of the newest answer's text with a timestamp.
RECORDER = """
window.__csp = [];
document.addEventListener('securitypolicyviolation', (e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));
window.__frames = [];
new MutationObserver(() => {
  const answers = document.querySelectorAll('#messages article.assistant');
  const last = answers[answers.length - 1];
  const text = last ? (last.querySelector('.content')?.textContent || '') : '';
  const frames = window.__frames;
  if (!frames.length || frames[frames.length - 1].text !== text) frames.push({t: performance.now(), text});
}).observe(document, {subtree: true, childList: true, characterData: true});
"""

ANSWER = "#messages article.assistant"


def open_page(browser: Any, url: str, *, viewport: dict[str, int] | None = None, color_scheme: str = "light") -> Any:
    context = browser.new_context(viewport=viewport or {"width": 1280, "height": 800}, color_scheme=color_scheme,
                                  accept_downloads=True)
    page = context.new_page()
    page.errors = []  # type: ignore[attr-defined]
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.add_init_script(RECORDER)
    page.goto(url)
    return page


def wait_until(page: Any, expression: str, timeout: float = 30.0) -> Any:
    """Poll a JavaScript expression until it is truthy. (Playwright's wait_for_function evaluates
    strings inside the page, which the page's CSP forbids, as it should; evaluate() does not.)"""
    deadline = time.monotonic() + timeout
    while True:
        value = page.evaluate(expression)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {expression}")
        time.sleep(0.03)


def sign_in(page: Any, key: str) -> None:
    page.wait_for_selector("#signin:not([hidden])")
    page.fill("#api-key", key)
    page.click("#signin-form button[type=submit]")
    page.wait_for_selector("#signin", state="hidden")
    page.wait_for_selector("#model-select option", state="attached")


def answers(page: Any) -> Any:
    return page.locator(ANSWER)


def send(page: Any, text: str, *, wait: bool = True, timeout: float = 30_000) -> Any:
    """Type and send a message; returns the locator of the answer it starts (finished when `wait`)."""
    page.wait_for_selector("body[data-ready]", state="attached")  # a conversation is open
    before = answers(page).count()
    page.fill("#composer-input", text)
    page.press("#composer-input", "Enter")
    wait_until(page, f"document.querySelectorAll('{ANSWER}').length > {before}", timeout / 1000)
    answer = by_id(page, answers(page).last.get_attribute("data-id"))
    if wait:
        wait_done(page, answer, timeout=timeout)
    return answer


def by_id(page: Any, message_id: str) -> Any:
    return page.locator(f'#messages article[data-id="{message_id}"]')


def wait_done(page: Any, answer: Any, timeout: float = 30_000) -> str:
    message_id = answer.get_attribute("data-id")
    page.wait_for_selector(f'#messages article[data-id="{message_id}"][data-status]', timeout=timeout)
    return answer.get_attribute("data-status")


def content(answer: Any) -> str:
    return answer.locator(".content").inner_text()


def csp_violations(page: Any) -> list[str]:
    return page.evaluate("window.__csp")
