"""The Responses API on a real `kvik serve`, through the official openai SDK: plain and streamed
responses with their typed events, stored conversations continued by previous_response_id (whose
prompt reuses the previous turn's KV through the prefix cache, seen in /metrics), GET/DELETE, and bad
input answered with a 4xx in OpenAI's error shape."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.server.conftest import metric_value

BLOCK_SIZE = 16
LONG_QUESTION = ("Please tell me a long story about a lighthouse keeper who collects shells, "
                 "counts the waves and writes letters to the sea every single evening.")


@pytest.fixture(scope="module")
def responses_server(server_factory, tmp_path_factory):
    store = tmp_path_factory.mktemp("responses") / "responses.sqlite"
    return server_factory("--responses-store", str(store))


@pytest.fixture(scope="module")
def sdk(responses_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=responses_server.base_url, api_key="unused", max_retries=0)


def prefix_hits(server) -> float:
    return metric_value(httpx.get(f"{server.url}/metrics").text, "kvik:prefix_cache_hits_total")


def test_create_without_stream(sdk):
    response = sdk.responses.create(model="tiny", input="Hello there", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.instructions == "Be brief." and response.max_output_tokens == 8
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text
    assert 0 < response.usage.output_tokens <= 8
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_same_prompt_as_chat(sdk, responses_server):
    """A Responses request is the chat request with the same messages."""
    items = [{"role": "developer", "content": "Answer in French."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
             {"role": "user", "content": "How are you?"}]
    response = sdk.responses.create(model="tiny", input=items, max_output_tokens=4, temperature=0, store=False)
    chat = openai.OpenAI(base_url=responses_server.base_url, api_key="unused").chat.completions.create(
        model="tiny", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "How are you?"}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


def test_stream_events(sdk):
    with sdk.responses.create(model="tiny", input="Tell me something", max_output_tokens=12,
                              temperature=0, stream=True) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", kinds[-1]]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    final = events[-1].response
    assert deltas and "".join(deltas) == final.output_text == events[-4].text
    assert events[0].response.status == "in_progress" and final.usage.output_tokens > 0
    stored = sdk.responses.retrieve(final.id)
    assert stored.output_text == final.output_text


def test_second_turn_reuses_the_first_turns_kv(sdk, responses_server):
    first = sdk.responses.create(model="tiny", input=LONG_QUESTION, max_output_tokens=20, temperature=0)
    before = prefix_hits(responses_server)
    second = sdk.responses.create(model="tiny", input="And what happened next?", temperature=0,
                                  max_output_tokens=8, previous_response_id=first.id)
    hits = prefix_hits(responses_server) - before
    cached = second.usage.input_tokens_details.cached_tokens
    # The second prompt starts with the first prompt and its answer, token for token: every full
    # block of those is found in the prefix cache. (The answer's closing end-of-turn token has no KV;
    # the template writes it again.)
    known = first.usage.input_tokens + first.usage.output_tokens - 1
    assert cached == hits == known // BLOCK_SIZE * BLOCK_SIZE, (cached, hits, known)
    assert cached > first.usage.input_tokens - BLOCK_SIZE
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    third = sdk.responses.create(model="tiny", input="Thanks!", max_output_tokens=4, temperature=0,
                                 previous_response_id=second.id)
    assert third.usage.input_tokens_details.cached_tokens >= cached


def test_get_and_delete(sdk):
    created = sdk.responses.create(model="tiny", input="Remember me", max_output_tokens=4, temperature=0)
    assert sdk.responses.retrieve(created.id).output_text == created.output_text
    sdk.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.responses.create(model="tiny", input="again", previous_response_id=created.id)
    assert raised.value.body["param"] == "previous_response_id"


def test_stored_responses_expire_after_the_retention(server_factory, tmp_path_factory):
    """`--responses-retention-days`: an expired response is 404 for GET, DELETE and
    previous_response_id on a real server (retention of ~1.7 s here)."""
    store = tmp_path_factory.mktemp("retention") / "responses.sqlite"
    server = server_factory("--responses-store", str(store), "--responses-retention-days", "0.00002")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    created = client.responses.create(model="tiny", input="Remember me briefly", max_output_tokens=2)
    assert client.responses.retrieve(created.id).id == created.id
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            client.responses.retrieve(created.id)
        except openai.NotFoundError:
            break
        time.sleep(0.25)
    else:
        pytest.fail("the response outlived its retention")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="again", previous_response_id=created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_the_store_sweeps_expired_rows_and_keeps_fresh_ones(tmp_path):
    import asyncio

    from kvik.server.serving.response_store import ResponseStore, StoredConversation, StoredResponse

    def record(response_id: str, age_days: float) -> StoredResponse:
        return StoredResponse(response_id, {"id": response_id}, StoredConversation([], "", [], "", []),
                              created_at=time.time() - age_days * 86400)

    async def scenario() -> None:
        store = ResponseStore(str(tmp_path / "r.sqlite"), retention_s=30 * 86400)
        await store.save(record("resp_first", 31))  # the first save sweeps: this row goes at once
        await store.save(record("resp_old", 31))  # the next sweep is a minute away
        await store.save(record("resp_new", 1))
        assert await store.load("resp_old") is None and not await store.delete("resp_old")
        assert (await store.load("resp_new")).response == {"id": "resp_new"}
        assert await store.sweep() == 1  # resp_old's row, gone from the file too
        assert await store.sweep() == 0
        forever = ResponseStore(str(tmp_path / "f.sqlite"), retention_s=0)
        await forever.save(record("resp_ancient", 10_000))
        assert await forever.load("resp_ancient") is not None
        store.close()
        forever.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_bad_retention_is_refused_by_the_command_line(value):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "kvik", "serve", "--responses-retention-days", value],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--responses-retention-days" in result.stderr, result.stderr


def test_input_items_list_the_conversation_before_the_answer(sdk, responses_server):
    """GET /v1/responses/{id}/input_items through the SDK: every item the response was made from
    (earlier turns and their answers included, instructions not), newest first by default, the same
    ids on every read, paged by `after`; bad parameters are 400s naming them."""
    first = sdk.responses.create(model="tiny", instructions="Be brief.", max_output_tokens=3, temperature=0,
                                 input=[{"role": "developer", "content": "Answer in English."},
                                        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}])
    second = sdk.responses.create(model="tiny", input="And then?", previous_response_id=first.id, max_output_tokens=3,
                                  temperature=0)
    listed = sdk.responses.input_items.list(second.id)
    newest_first = [(item.type, item.role, item.content[0].text) for item in listed.data]
    assert newest_first == [("message", "user", "And then?"), ("message", "assistant", first.output_text),
                            ("message", "user", "Hello"), ("message", "system", "Answer in English.")]
    assert listed.data[1].content[0].type == "output_text" and listed.data[0].content[0].type == "input_text"
    assert listed.first_id == listed.data[0].id and listed.last_id == listed.data[-1].id and not listed.has_more
    oldest_first = sdk.responses.input_items.list(second.id, order="asc")
    assert [item.id for item in oldest_first.data] == [item.id for item in reversed(listed.data)]
    paged = sdk.responses.input_items.list(second.id, limit=1)  # iterating fetches the next pages by `after`
    assert paged.has_more and [item.id for item in paged] == [item.id for item in listed.data]
    first_items = sdk.responses.input_items.list(first.id).data  # the first turn's: its input only
    assert [(i.role, i.content[0].text) for i in first_items] == [(i.role, i.content[0].text) for i in listed.data[2:]]

    url = f"{responses_server.base_url}/responses/{second.id}/input_items"
    for query, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "sideways"}, "order"),
                         ({"after": "msg_nope"}, "after"), ({"after": "x" * 200}, "after")):
        answer = httpx.get(url, params=query)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (query, answer.text)
    missing = httpx.get(f"{responses_server.base_url}/responses/resp_missing/input_items")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(sdk, responses_server):
    """`truncation: "auto"`: a conversation that outgrew the 512-token context continues with its
    oldest turns dropped (only as many as needed), where "disabled" (the default) is a 400; an input
    that cannot fit alone is still a 400."""
    def tokens(text: str) -> int:
        answer = httpx.post(f"{responses_server.url}/tokenize", json={"model": "tiny", "prompt": text})
        return len(answer.json()["tokens"])

    unit = "the lighthouse keeper counts waves and writes letters "
    per_unit = tokens(unit * 10) / 10
    chunk = unit * int(130 / per_unit)  # about 130 tokens a turn
    previous = None
    for turn in range(3):  # three turns of ~130 tokens, each with a short answer: ~400 tokens
        created = sdk.responses.create(model="tiny", input=f"turn {turn}: {chunk}", previous_response_id=previous,
                                       max_output_tokens=2, temperature=0)
        previous = created.id
    ask = {"model": "tiny", "input": f"turn 3: {chunk}", "previous_response_id": previous, "max_output_tokens": 2}
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(**ask)
    assert refused.value.body["code"] == "context_length_exceeded"
    fitted = sdk.responses.create(**ask, truncation="auto")
    assert fitted.truncation == "auto" and fitted.usage.input_tokens < 512
    kept = [item.content[0].text for item in sdk.responses.input_items.list(fitted.id, order="asc")
            if item.role == "user"]
    # Four turns of ~130 tokens do not fit 512, three do: only the oldest is dropped.
    assert [text[:7] for text in kept] == ["turn 1:", "turn 2:", "turn 3:"], fitted.usage.input_tokens
    # The next turn continues the truncated conversation.
    after = sdk.responses.create(model="tiny", input="and?", previous_response_id=fitted.id, max_output_tokens=2,
                                 truncation="auto")
    assert after.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as alone:
        sdk.responses.create(model="tiny", input=chunk * 5, max_output_tokens=2, truncation="auto")
    assert alone.value.body["code"] == "context_length_exceeded" and alone.value.body["param"] == "input"


def test_store_false_keeps_nothing(sdk):
    created = sdk.responses.create(model="tiny", input="Forget me", max_output_tokens=4, store=False)
    assert created.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(created.id)


def test_max_output_tokens_makes_it_incomplete(sdk):
    response = sdk.responses.create(model="tiny", input=LONG_QUESTION, max_output_tokens=1, temperature=0)
    if response.usage.output_tokens == 1 and response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].status == "incomplete"
    else:  # the model ended its answer at once
        assert response.status == "completed"


def test_another_tenants_response_is_not_found(responses_server):
    url = f"{responses_server.base_url}/responses"
    first = httpx.post(url, json={"input": "secret", "max_output_tokens": 2, "cache_salt": "tenant-a"}).json()
    response = httpx.post(url, json={"input": "more", "previous_response_id": first["id"],
                                     "cache_salt": "tenant-b"})
    assert response.status_code == 404
    response = httpx.post(url, json={"input": "more", "previous_response_id": first["id"],
                                     "max_output_tokens": 2, "cache_salt": "tenant-a"})
    assert response.status_code == 200


BAD_REQUESTS = [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({}, 400, "input"),
    ({"input": [{"type": "image_generation_call"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400, "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": 7}]}, 400, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "hi", "tools": [{"type": "function"}]}, 400, "tools"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "array", "uniqueItems": True}}}},
     400, "text.format.schema"),
    ({"input": "hi", "truncation": "sometimes"}, 400, "truncation"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ({"input": "word " * 600}, 400, "input"),
    ({"input": "hi", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"input": "hi", "previous_response_id": "resp_doesnotexist"}, 404, "previous_response_id"),
    ({"input": "hi", "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("payload,status,param", BAD_REQUESTS)
def test_bad_requests(responses_server, payload, status, param):
    response = httpx.post(f"{responses_server.base_url}/responses", json=payload, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error


def test_unknown_ids_are_404(responses_server):
    for method in ("GET", "DELETE"):
        response = httpx.request(method, f"{responses_server.base_url}/responses/resp_nope")
        assert response.status_code == 404 and response.json()["error"]["param"] == "response_id"


# A random-weight model ends an unbounded string only by chance: the city's length is bounded so
# that the forced call fits the output budget.
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                               "required": ["city"], "additionalProperties": False}, "strict": True}


def test_function_tool_call(sdk):
    response = sdk.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=200, extra_body={"seed": 1})
    assert response.status == "completed", response.output
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow_up = sdk.responses.create(model="tiny", previous_response_id=response.id, max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny"}], tools=[WEATHER_TOOL])
    assert follow_up.status in ("completed", "incomplete")
    # The conversation goes on with the tool's result (this template does not show tool calls).
    assert follow_up.usage.input_tokens > response.usage.input_tokens


def test_function_tool_call_streamed(sdk):
    with sdk.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER_TOOL],
                              tool_choice="required", max_output_tokens=300, stream=True,
                              extra_body={"seed": 2}) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "get_weather"
    assert "city" in json.loads(done.arguments)
    final = events[-1].response
    assert final.status == "completed"
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls[0].arguments == done.arguments and calls[0].call_id


def test_text_format_json_schema(sdk):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    response = sdk.responses.create(model="tiny", input="2+2?", max_output_tokens=64, extra_body={"seed": 3},
                                    text={"format": {"type": "json_schema", "name": "sum", "schema": schema,
                                                     "strict": True}})
    assert response.status == "completed", response.output_text
    assert isinstance(json.loads(response.output_text)["answer"], int)
    assert response.text.format.type == "json_schema"


def test_tool_loop_in_a_stored_conversation(llama3_server):
    """A Llama-3-style model (its template shows tools and calls): the forced call comes back as a
    function_call item, and the next turn, by previous_response_id with the tool's output, renders
    that call into its prompt through the template."""
    sdk = openai.OpenAI(base_url=llama3_server.base_url, api_key="unused", max_retries=0)
    first = sdk.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER_TOOL],
                                 tool_choice="required", parallel_tool_calls=False, max_output_tokens=200,
                                 extra_body={"seed": 4})
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    arguments = json.loads(calls[0].arguments)
    second = sdk.responses.create(model="tiny", previous_response_id=first.id, tools=[WEATHER_TOOL],
                                  max_output_tokens=4, input=[{"type": "function_call_output",
                                                               "call_id": calls[0].call_id, "output": "sunny"}])
    assert second.status in ("completed", "incomplete")
    call_tokens = len(tokenize(llama3_server, json.dumps(arguments)))
    assert second.usage.input_tokens > first.usage.input_tokens + call_tokens


def tokenize(server, text: str) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    return response.json()["tokens"]
