"""An OpenAI-compatible upstream whose answers the browser tests choose: a real HTTP server process.

    python tests/web/scripted_upstream.py --port 8001 [--chunk-delay 0.05]

Put behind `kvik gateway`, it lets a test force exactly the text a model "says" (hostile HTML, a
`javascript:` link, Markdown, math), reasoning, tool calls, or a slow endless answer to stop. The
last user message picks the script by keyword:

    xss       an <img onerror>, a <script>, a javascript: link and a normal link
    markdown  a table, a Python code block, inline and display math
    think     `reasoning_content` deltas first, then the answer
    tool      a streamed tool call to `get_weather` (finish_reason tool_calls)
    slow      200 words, 0.2 s apart (for stop)
    anything  `Reply N to: <message>`, word by word (N counts the requests, so regenerate differs)

When the conversation ends in a tool result, the answer quotes it. Streams include usage when asked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

XSS = ('Careful: <img src=x onerror="window.__xss=1"> and <script>window.__xss=2</script> '
       'and [click me](javascript:window.__xss=3) and [a fine link](https://example.com/docs).')
MARKDOWN = """Here is a table:

| Planet | Moons |
|--------|------:|
| Earth  | 1     |
| Mars   | 2     |

```python
def area(r):
    return 3.14159 * r ** 2
```

Euler says $e^{i\\pi} + 1 = 0$ and

$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$
"""


def build_app(chunk_delay_s: float) -> FastAPI:
    app = FastAPI()
    served = {"count": 0}

    def last_user(messages: list[dict[str, Any]]) -> str:
        for message in reversed(messages):
            if message.get("role") == "user":
                return str(message.get("content") or "")
        return ""

    def script(body: dict[str, Any]) -> tuple[list[dict[str, Any]], float, str]:
        """(deltas, seconds between them, finish reason) for this request."""
        messages = body.get("messages") or []
        served["count"] += 1
        if messages and messages[-1].get("role") == "tool":
            return _words(f"The tool said: {messages[-1].get('content')}"), chunk_delay_s, "stop"
        text = last_user(messages)
        lowered = text.lower()
        if "xss" in lowered:
            return _pieces(XSS, 12), chunk_delay_s, "stop"
        if "markdown" in lowered:
            return _pieces(MARKDOWN, 16), chunk_delay_s, "stop"
        if "think" in lowered:
            reasoning = [{"reasoning_content": d["content"]} for d in _words("The user wants a short answer, so")]
            return reasoning + _words("Short answer: yes."), chunk_delay_s, "stop"
        if "tool" in lowered:
            calls = [{"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]}]
            calls += [{"tool_calls": [{"index": 0, "function": {"arguments": part}}]}
                      for part in ('{"city": ', '"Paris"', "}")]
            return calls, chunk_delay_s, "tool_calls"
        if "slow" in lowered:
            return _words(" ".join(f"w{i}" for i in range(200))), 0.2, "length"
        return _words(f"Reply {served['count']} to: {text}"), chunk_delay_s, "stop"

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        deltas, delay, finish = script(body)
        model = body.get("model")
        base = {"id": f"chatcmpl-scripted-{served['count']}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model}
        usage = {"prompt_tokens": sum(len(str(m.get("content", "")).split()) for m in body.get("messages") or []),
                 "completion_tokens": len(deltas)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if not body.get("stream"):
            text = "".join(d.get("content", "") for d in deltas)
            return JSONResponse({**base, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            yield _frame({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None}]})
            for delta in deltas:
                await asyncio.sleep(delay)
                yield _frame({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            yield _frame({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
            if include_usage:
                yield _frame({**base, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model", "owned_by": "tests"}]})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    return app


def _words(text: str) -> list[dict[str, Any]]:
    words = text.split(" ")
    return [{"content": word if i == 0 else " " + word} for i, word in enumerate(words)]


def _pieces(text: str, size: int) -> list[dict[str, Any]]:
    return [{"content": text[i:i + size]} for i in range(0, len(text), size)]


def _frame(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunk-delay", type=float, default=0.04, help="seconds between streamed pieces")
    args = parser.parse_args()
    uvicorn.run(build_app(args.chunk_delay), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
