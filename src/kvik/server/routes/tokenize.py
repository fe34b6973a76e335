"""vLLM-style tokenizer routes at the root: /tokenize, /detokenize, /tokenizer_info."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kvik.core.errors import InvalidRequestError
from kvik.engine.input_processor import text_size
from kvik.protocol.openai import DetokenizeRequest, TokenizeRequest
from kvik.server.json_body import ParsedBodyRoute
from kvik.server.routes.responses import ERROR_RESPONSES
from kvik.server.serving.preprocess import messages_for_template
from kvik.server.state import ServerState

router = APIRouter(route_class=ParsedBodyRoute)


@router.post("/tokenize", responses=ERROR_RESPONSES, summary="Tokenize a prompt or chat messages")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    engine, _ = await state.engine_for(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        messages = messages_for_template(body.messages)
        size = text_size([m["content"] for m in messages])
        engine.input_processor.check_text_size(size, "messages")
        tools = [tool.model_dump(exclude_unset=True) for tool in body.tools] if body.tools else None
        rendered = await engine.render_chat(messages, add_generation_prompt=body.add_generation_prompt,
                                            tools=tools, input_bytes=size)
        tokens = rendered.token_ids
    else:
        if not body.prompt:
            raise InvalidRequestError("prompt: is empty", param="prompt")
        tokens = (await engine.tokenize([body.prompt], body.add_special_tokens))[0]
    result: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.info.max_model_len,
                              "tokens": tokens}
    if body.return_token_strs:
        result["token_strs"] = [engine.tokenizer.token_text(t) for t in tokens]
    return result


@router.post("/detokenize", responses=ERROR_RESPONSES, summary="Turn token ids back into text")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    engine, _ = await state.engine_for(body.model)
    vocab = engine.info.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"tokens: id {bad} is outside the vocabulary [0, {vocab})",
                                  param="tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}


@router.get("/tokenizer_info", responses=ERROR_RESPONSES, summary="The tokenizer's configuration")
async def tokenizer_info(request: Request, model: str | None = None) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    engine, _ = await state.engine_for(model)
    spec = engine.info.tokenizer
    special = spec.special_tokens
    return {
        "tokenizer_class": spec.tokenizer_class, "model_max_length": engine.info.max_model_len,
        "vocab_size": engine.tokenizer.vocab_size, "model_vocab_size": engine.info.vocab_size,
        "eos_token": special.get("eos_token"), "eos_token_id": spec.eos_token_id,
        "bos_token": special.get("bos_token"), "bos_token_id": spec.bos_token_id,
        "pad_token": special.get("pad_token"), "chat_template": spec.chat_template,
        "add_bos_token": spec.add_bos_token,
    }
