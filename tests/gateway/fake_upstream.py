"""A small OpenAI-compatible upstream for the gateway tests and benchmark: a real HTTP server process.

    python tests/gateway/fake_upstream.py --port 8001 --name a [--no-record]

It answers `/v1/chat/completions` and `/v1/completions` (streaming or not, always with `usage`),
`/v1/models` and `/health`, and it records every request body it received (`GET /_received`, with
the number of clients that disconnected before their answer) so tests can check what left the
gateway. It validates bodies with kvik's own OpenAI schemas and answers bad ones 400, as a real
server does. `POST /_control` changes its behaviour: fail the next N requests (or those containing a
marker) with a status, delay answers, stream slowly, break streams with an error event or without
`[DONE]`, report unhealthy. `POST /_reset` restores the defaults.

Token accounting is simple and predictable for limit tests: prompt tokens are whitespace-separated
words in the messages or prompt; completion tokens are `max_tokens` (default 5) words of the reply.
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
from pydantic import ValidationError

from kvik.protocol.openai import ChatCompletionRequest, CompletionRequest

RETRY_AFTER_S = 7  # sent with 429 and 503 answers
MAX_REPLY_WORDS = 256

DEFAULT_CONTROL: dict[str, Any] = {
    "fail_status": None,  # status to answer with while fail_count > 0 (or forever when fail_count is None)
    "fail_count": 0,
    "delay_s": 0.0,  # before answering (before the first chunk when streaming)
    "chunk_delay_s": 0.0,  # between streamed chunks
    "healthy": True,
    "fail_when_contains": None,  # a request whose body contains this text fails with fail_status (500 if None)
    "stream_fail_after": None,  # after this many content chunks, break the stream (see stream_fail_mode)
    # "error_then_done": an error event, then usage and [DONE] (kvik serve before the fix);
    # "error_then_close": an error event, then close (the fixed server); "close": close without [DONE].
    "stream_fail_mode": "error_then_close",
}
STREAM_ERROR = {"error": {"message": "generation failed: told to fail", "type": "server_error",
                          "param": None, "code": None}}


def build_app(name: str, record: bool) -> FastAPI:
    app = FastAPI()
    received: list[dict[str, Any]] = []
    control: dict[str, Any] = dict(DEFAULT_CONTROL)
    disconnects = [0]  # clients that left before their answer was complete

    def words(body: dict[str, Any]) -> int:
        if "messages" in body:
            text = " ".join(str(m.get("content", "")) for m in body["messages"])
        else:
            prompt = body.get("prompt", "")
            text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        return len(text.split())

    def reply_words(body: dict[str, Any]) -> list[str]:
        return [f"{name}{i}" for i in range(min(MAX_REPLY_WORDS, int(body.get("max_tokens") or 5)))]

    def invalid(body: Any, chat: bool) -> Response | None:
        schema = ChatCompletionRequest if chat else CompletionRequest
        try:
            schema.model_validate(body)
        except ValidationError as exc:
            error = exc.errors()[0]
            message = f"{error['loc']}: {error['msg']}"
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                           "code": None}}, status_code=400)
        return None

    async def failure(raw: bytes) -> Response | None:
        marker = control["fail_when_contains"]
        if marker is not None:
            if marker.encode() not in raw:
                return None
            status = control["fail_status"] or 500
            return JSONResponse({"error": {"message": f"{name} cannot handle this request", "type": "server_error",
                                           "param": None, "code": None}}, status_code=status)
        if control["fail_status"] is None or control["fail_count"] == 0:
            return None
        if control["fail_count"] is not None:
            control["fail_count"] -= 1
        status = control["fail_status"]
        # Like kvik serve at capacity: an overloaded replica says when to come back.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else {}
        return JSONResponse({"error": {"message": f"{name} told to fail", "type": "server_error",
                                       "param": None, "code": None}}, status_code=status, headers=headers)

    async def answer(request: Request, chat: bool) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        if record:
            received.append(body)
        failed = await failure(raw)
        if failed is not None:
            return failed
        bad = invalid(body, chat)
        if bad is not None:
            return bad
        if control["delay_s"] and not body.get("stream"):
            # Watch the client while "generating", as a real server does to abort.
            deadline = time.monotonic() + control["delay_s"]
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    disconnects[0] += 1
                    return Response(status_code=499)
                await asyncio.sleep(0.02)
        elif control["delay_s"]:
            await asyncio.sleep(control["delay_s"])
        prompt_tokens, out = words(body), reply_words(body)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(out),
                 "total_tokens": prompt_tokens + len(out)}
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        base = {"id": f"cmpl-{name}-{len(received)}", "created": created, "model": body.get("model"),
                "system_fingerprint": name}
        if not body.get("stream"):
            text = " ".join(out)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            return JSONResponse({**base, "object": kind, "choices": [choice], "usage": usage})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        fail_after, fail_mode = control["stream_fail_after"], control["stream_fail_mode"]

        async def events():
            finished = False
            try:
                async for event in stream_events():
                    yield event
                finished = True
            finally:
                if not finished:
                    disconnects[0] += 1

        async def stream_events():
            for i, word in enumerate(out):
                if fail_after is not None and i == fail_after:
                    if fail_mode != "close":
                        yield f"data: {json.dumps(STREAM_ERROR)}\n\n"
                    if fail_mode == "error_then_done":
                        if include_usage:
                            usage_chunk = {**base, "object": kind + ".chunk", "choices": [], "usage": usage}
                            yield f"data: {json.dumps(usage_chunk)}\n\n"
                        yield "data: [DONE]\n\n"
                    return
                piece = word if i == 0 else " " + word
                choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None}
                          if chat else {"index": 0, "text": piece, "finish_reason": None})
                yield f"data: {json.dumps({**base, 'object': kind + '.chunk', 'choices': [choice]})}\n\n"
                if control["chunk_delay_s"]:
                    await asyncio.sleep(control["chunk_delay_s"])
            last = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                    else {"index": 0, "text": "", "finish_reason": "length"})
            yield f"data: {json.dumps({**base, 'object': kind + '.chunk', 'choices': [last]})}\n\n"
            if include_usage:
                yield f"data: {json.dumps({**base, 'object': kind + '.chunk', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": name}]})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok" if control["healthy"] else "unhealthy"},
                            status_code=200 if control["healthy"] else 503)

    @app.get("/_received")
    async def get_received() -> Response:
        return JSONResponse({"name": name, "count": len(received), "bodies": received,
                             "disconnects": disconnects[0]})

    @app.post("/_control")
    async def set_control(request: Request) -> Response:
        changes = await request.json()
        unknown = set(changes) - set(DEFAULT_CONTROL)
        if unknown:
            return JSONResponse({"error": f"unknown control(s) {sorted(unknown)}"}, status_code=400)
        control.update(changes)
        return JSONResponse(control)

    @app.post("/_reset")
    async def reset() -> Response:
        received.clear()
        disconnects[0] = 0
        control.clear()
        control.update(DEFAULT_CONTROL)
        return JSONResponse({"ok": True})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--name", default="upstream")
    parser.add_argument("--no-record", action="store_true", help="do not keep request bodies (benchmarks)")
    args = parser.parse_args()
    uvicorn.run(build_app(args.name, record=not args.no_record), host=args.host, port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
