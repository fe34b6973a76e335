"""The chat page at the gateway, in headless chromium: everything a person does in one conversation.

The `scripted` model (tests/web/scripted_upstream.py) answers `Reply N to: <message>` word by word,
N counting requests, so regenerated answers differ; `tiny` is a real `kvik serve`.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.gateway.harness import ADMIN_KEY, Gateway
from tests.web.page_helpers import (
    ANSWER,
    answers,
    by_id,
    content,
    csp_violations,
    open_page,
    send,
    sign_in,
    wait_done,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)
TITLE = "hello there, how are you on this fine day"


@pytest.fixture(scope="module")
def user_key(gateway: Gateway) -> str:
    return gateway.create_key(name="web-user", models=["scripted", "tiny"])


@pytest.fixture()
def page(browser, gateway: Gateway, user_key: str):
    page = open_page(browser, gateway.url + "/")
    sign_in(page, user_key)
    page.select_option("#model-select", "scripted")
    yield page
    assert not page.errors, page.errors
    assert csp_violations(page) == []
    page.context.close()


def test_sign_in_refuses_a_wrong_key(browser, gateway: Gateway, user_key: str) -> None:
    page = open_page(browser, gateway.url + "/")
    page.wait_for_selector("#signin:not([hidden])")
    page.fill("#api-key", "kvik-not-a-real-key")
    page.click("#signin-form button[type=submit]")
    wait_until(page, "document.querySelector('#signin-error').textContent.length > 0")
    assert "not accepted" in page.inner_text("#signin-error")
    assert page.evaluate("sessionStorage.getItem('kvik.apiKey')") is None
    sign_in(page, user_key)
    # The key lives in this tab's session storage only: never in localStorage, never in a cookie.
    assert page.evaluate("sessionStorage.getItem('kvik.apiKey')") == user_key
    assert user_key not in json.dumps(page.evaluate("({...localStorage})"))
    assert page.context.cookies() == []
    page.context.close()


def test_conversation_flow(page, gateway: Gateway) -> None:
    # Send: the answer streams in piece by piece over the WebSocket.
    answer = send(page, "hello there, how are you on this fine day")
    assert re.fullmatch(r"Reply \d+ to: hello there, how are you on this fine day", content(answer))
    painted = [f["text"].strip() for f in page.evaluate("window.__frames") if f["text"].startswith("Reply")]
    partial = {text for text in painted if text != content(answer).strip()}
    assert len(partial) >= 5, painted  # the text grew on screen in at least five steps
    assert "WebSocket" in answer.locator(".msg-meta").inner_text()
    assert int(answer.get_attribute("data-ttft-ms")) >= 0
    assert "tokens" in answer.locator(".msg-meta").inner_text()
    first_reply = content(answer)

    # Stop: a long answer ends early and stays ended.
    slow = send(page, "slow please", wait=False)
    wait_until(page, f"""(document.querySelector('article[data-id="{slow.get_attribute("data-id")}"] .content')
                         ?.textContent || '').split(' ').length >= 3""")
    page.keyboard.press("Escape")
    assert wait_done(page, slow) == "cancelled"
    stopped_words = len(content(slow).split())
    assert 3 <= stopped_words < 200
    page.wait_for_timeout(600)
    assert len(content(slow).split()) == stopped_words
    assert "stopped" in slow.locator(".msg-meta").inner_text()

    # Regenerate the first answer: a second version, and the first still reachable.
    answers(page).first.locator("button.regenerate").click()
    page.wait_for_selector("#messages article.assistant[aria-busy=false][data-status] >> nth=0")
    regenerated = answers(page).first
    wait_done(page, regenerated)
    assert re.fullmatch(r"Reply \d+ to: hello there, how are you on this fine day", content(regenerated))
    assert content(regenerated) != first_reply
    assert regenerated.locator(".branch-pos").inner_text() == "2 / 2"
    regenerated.get_by_role("button", name="Previous version").click()
    assert content(answers(page).first) == first_reply

    # Edit the first question and branch from it.
    first_question = page.locator("#messages article.user").first
    first_question.locator("button.edit").click()
    page.fill("#messages article.user textarea.edit-input", "an edited question")
    page.click("#messages button.save-edit")
    wait_until(page, "document.querySelector('#messages article.user .user-text')?.textContent === 'an edited question'")
    edited_answer = answers(page).first
    wait_done(page, edited_answer)
    assert re.fullmatch(r"Reply \d+ to: an edited question", content(edited_answer))
    user = page.locator("#messages article.user").first
    assert user.locator(".branch-pos").inner_text() == "2 / 2"
    user.get_by_role("button", name="Previous version").click()
    assert page.locator("#messages article.user .user-text").first.inner_text().startswith("hello there")
    page.locator("#messages article.user").first.get_by_role("button", name="Next version").click()
    assert page.locator("#messages article.user .user-text").first.inner_text() == "an edited question"

    # Switch model: the next answer comes from the real kvik serve.
    page.select_option("#model-select", "tiny")
    tiny_answer = send(page, "now from tiny")
    assert wait_done(page, tiny_answer) == "completed"
    assert tiny_answer.locator(".msg-role").inner_text() == "tiny"

    # Reload: the conversation is in the sidebar, stored at the gateway for this key.
    conversation_url = page.url
    assert "#c=conv_" in conversation_url
    page.reload()
    page.wait_for_selector("#conversation-list .conversation")
    assert page.locator("#conversation-list .conversation-open").first.inner_text() == TITLE
    page.wait_for_selector("#messages article.user")
    assert page.locator("#messages article.user .user-text").first.inner_text() == "an edited question"
    assert page.locator("#messages article.assistant .msg-role").last.inner_text() == "tiny"
    page.click("#new-chat")
    assert page.locator("#messages article").count() == 0
    page.locator("#conversation-list .conversation-open", has_text=TITLE).click()
    page.wait_for_selector("#messages article.user")
    assert page.locator("#messages article.user").count() == 2

    # Rename, search, export.
    page.get_by_role("button", name=f"Rename “{TITLE}”").click()
    page.fill("#conversation-list .rename-input", "Renamed chat")
    page.press("#conversation-list .rename-input", "Enter")
    wait_until(page, "document.querySelector('#chat-title').textContent === 'Renamed chat'")
    page.fill("#search", "zzz-no-such-text")
    page.wait_for_selector(".conversation-empty")
    page.fill("#search", "edited question")
    page.wait_for_selector("#conversation-list .conversation-open >> text=Renamed chat")
    with page.expect_download() as download_info:
        page.click("#export-md")
    markdown = open(download_info.value.path(), encoding="utf-8").read()
    assert markdown.startswith("# Renamed chat") and "an edited question" in markdown
    with page.expect_download() as download_info:
        page.click("#export-json")
    exported = json.load(open(download_info.value.path(), encoding="utf-8"))
    assert exported["title"] == "Renamed chat" and len(exported["messages"]) >= 7


def test_model_output_is_inert(page, gateway: Gateway) -> None:
    answer = send(page, "xss please")
    text = content(answer)
    assert '<img src=x onerror="window.__xss=1">' in text  # shown as text
    assert "<script>window.__xss=2</script>" in text
    assert page.evaluate("window.__xss") is None
    assert answer.locator("img, script, iframe, [onerror]").count() == 0
    assert answer.locator("a[href^='javascript']").count() == 0
    bad = answer.locator("a", has_text="click me")
    assert bad.count() == 0 or bad.get_attribute("href") in (None, "")
    good = answer.locator("a", has_text="a fine link")
    assert good.get_attribute("href") == "https://example.com/docs"
    assert good.get_attribute("rel") == "noopener noreferrer nofollow"
    assert good.get_attribute("target") == "_blank"


def test_markdown_reasoning_and_tools(page, gateway: Gateway) -> None:
    answer = send(page, "markdown please")
    assert answer.locator("table th").all_inner_texts() == ["Planet", "Moons"]
    block = answer.locator(".code-block")
    assert block.locator(".code-lang").inner_text() == "python"
    assert block.locator("code .hljs-keyword").first.inner_text() == "def"
    assert block.get_by_role("button", name="Copy python code").count() == 1
    assert answer.locator("math").count() == 2  # inline and display math, as MathML

    thinking = send(page, "think first")
    assert content(thinking) == "Short answer: yes."
    reasoning = thinking.locator("details.reasoning")
    assert reasoning.get_attribute("open") is None  # collapsed
    reasoning.locator("summary").click()
    assert "short answer, so" in reasoning.inner_text()

    call = send(page, "use a tool")
    assert "Tool call: get_weather" in call.locator(".tool-call summary").inner_text()
    assert json.loads(call.locator(".tool-call pre").inner_text()) == {"city": "Paris"}
    call.locator("textarea.tool-result-input").fill("18 C and sunny")
    before = answers(page).count()
    call.get_by_role("button", name="Send tool results").click()
    page.wait_for_selector("#messages article.tool")
    # The tool message appears before the answer to it: wait for the new answer, not the last one.
    wait_until(page, f"document.querySelectorAll({ANSWER!r}).length > {before}")
    final = by_id(page, answers(page).last.get_attribute("data-id"))
    wait_done(page, final)
    assert content(final) == "The tool said: 18 C and sunny"


def test_rate_limit_is_explained_kindly(browser, gateway: Gateway) -> None:
    key = gateway.create_key(name="web-slow", models=["scripted"], rpm=1)
    page = open_page(browser, gateway.url + "/")
    sign_in(page, key)
    assert page.locator("#model-select option").all_inner_texts() == ["scripted"]  # the allow-list
    assert wait_done(page, send(page, "first")) == "completed"
    second = send(page, "second")
    assert wait_done(page, second) == "failed"
    message = second.locator(".msg-error").inner_text()
    assert "rate limit" in message and "Try again in" in message
    page.context.close()


def test_conversations_belong_to_their_key(gateway: Gateway, user_key: str) -> None:
    other = gateway.create_key(name="web-other")
    with gateway.client(user_key) as mine, gateway.client(other) as theirs:
        created = mine.post("/ui/conversations", json={"title": "private", "data": {"messages": {}}})
        assert created.status_code == 201
        conversation_id = created.json()["id"]
        assert theirs.get(f"/ui/conversations/{conversation_id}").status_code == 404
        assert theirs.delete(f"/ui/conversations/{conversation_id}").status_code == 404
        assert all(row["id"] != conversation_id for row in theirs.get("/ui/conversations").json()["data"])
        assert mine.get(f"/ui/conversations/{conversation_id}").json()["title"] == "private"
    assert httpx.get(gateway.url + "/ui/conversations").status_code == 401
    with gateway.client(ADMIN_KEY) as admin:
        assert admin.get(f"/ui/conversations/{conversation_id}").status_code == 404
