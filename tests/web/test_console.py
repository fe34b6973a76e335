"""The admin console in headless chromium: an admin creates a key that then works in the chat; the
usage, replica, live-traffic and audit views show what happened. Screenshots go to docs/img/."""

from __future__ import annotations

import pytest

from tests.gateway.harness import ADMIN_KEY, Gateway
from tests.web.conftest import SCREENSHOTS
from tests.web.page_helpers import content, csp_violations, open_page, send, sign_in, wait_done, wait_until

pytestmark = pytest.mark.timeout(300)


def console_sign_in(page, key: str) -> None:
    page.wait_for_selector("#signin:not([hidden])")
    page.fill("#api-key", key)
    page.click("#signin-form button[type=submit]")


def test_console_creates_a_key_that_works_in_the_chat(browser, gateway: Gateway) -> None:
    user_key = gateway.create_key(name="not-an-admin")
    console = open_page(browser, gateway.url + "/console")
    console_sign_in(console, user_key)
    wait_until(console, "document.querySelector('#signin-error').textContent.includes('not an admin key')")

    console_sign_in(console, ADMIN_KEY)
    console.wait_for_selector("#signin", state="hidden")
    console.fill("#key-name", "console-made")
    console.check("#key-models input[value=scripted]")
    console.fill("#key-rpm", "100")
    console.click("#key-form button[type=submit]")
    secret = console.locator("#new-secret-value")
    secret.wait_for()
    key = secret.inner_text()
    assert key.startswith("kvik-")
    row = console.locator("#keys-table tr", has_text="console-made")
    assert "scripted" in row.inner_text() and "100" in row.inner_text()

    # The new key chats, and sees only the model it was allowed.
    chat = open_page(browser, gateway.url + "/")
    sign_in(chat, key)
    assert chat.locator("#model-select option").all_inner_texts() == ["scripted"]
    answer = send(chat, "made in the console")
    assert wait_done(chat, answer) == "completed"
    assert content(answer).endswith("to: made in the console")

    # Edit the key's limits in place; the change is audited.
    row.get_by_role("button", name="Edit console-made").click()
    console.fill("#keys-table input[aria-label='Requests / minute of console-made']", "7")
    console.get_by_role("button", name="Save").click()
    wait_until(console, "[...document.querySelectorAll('#keys-table tr')].some(r => r.textContent.includes('console-made') && r.children[5].textContent === '7')")

    # Usage and cost: the request shows up for the key and model.
    console.click("#tab-usage")
    usage_row = console.locator("#usage-table tr", has_text="console-made")
    usage_row.wait_for()
    assert "scripted" in usage_row.inner_text()
    console.wait_for_selector("#usage-chart .uplot")

    console.click("#tab-replicas")
    console.wait_for_selector("#replicas-table tbody tr")
    assert console.locator("#replicas-table tbody tr").count() == 2
    assert console.locator("#replicas-table .badge", has_text="healthy").count() == 2

    console.click("#tab-live")
    console.wait_for_selector("#live-tiles .tile")
    console.wait_for_selector("#latency-chart .uplot")

    console.click("#tab-audit")
    console.wait_for_selector("#requests-table tbody tr")
    console.select_option("#audit-status", "2xx")
    console.click("#requests-filter button[type=submit]")
    wait_until(console, "document.querySelectorAll('#requests-table tbody tr[data-status]').length > 0 && "
                        "[...document.querySelectorAll('#requests-table tbody tr[data-status]')].every(r => r.dataset.status < 300)")
    actions = console.locator("#actions-table tbody tr")
    actions.first.wait_for()
    kinds = actions.all_inner_texts()
    assert any("key.update" in k for k in kinds) and any("key.create" in k for k in kinds)

    console.click("#tab-keys")
    console.evaluate("document.querySelector('#new-secret').hidden = true; document.querySelector('#notice').hidden = true")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    console.screenshot(path=str(SCREENSHOTS / "console-keys.png"))
    console.click("#tab-live")
    console.wait_for_timeout(2500)  # two polls, so the charts have lines
    console.screenshot(path=str(SCREENSHOTS / "console-live.png"))

    # Revoking the key ends its chat access.
    console.click("#tab-keys")
    console.once("dialog", lambda dialog: dialog.accept())
    console.locator("#keys-table tr", has_text="console-made").get_by_role("button", name="Revoke console-made").click()
    console.wait_for_selector("#keys-table tr:has-text('console-made')", state="detached")
    with gateway.client(key) as client:
        assert client.get("/v1/models").status_code == 401
    for page in (console, chat):
        assert not page.errors, page.errors
        assert csp_violations(page) == []
        page.context.close()
