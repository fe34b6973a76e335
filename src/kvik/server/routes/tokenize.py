"""vLLM-style tokenizer routes at the root: /tokenize, /detokenize, /tokenizer_info."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kvik.core.errors import InvalidRequestError
from kvik.protocol.openai import DetokenizeRequest, TokenizeRequest
from kvik.server.routes.responses import ERROR_RESPONSES
from kvik.server.serving_chat import messages_for_template
from kvik.server.state import ServerState

router = APIRouter()


@router.post("/tokenize", responses=ERROR_RESPONSES, summary="Tokenize a prompt or chat messages")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    engine = state.require_engine().engine
    state.resolve_model(body.model)
    tokenizer = engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
    try:
        if body.messages is not None:
            text = tokenizer.apply_chat_template(messages_for_template(body.messages),
                                                 add_generation_prompt=body.add_generation_prompt)
            tokens = tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    except InvalidRequestError:
        raise
    except Exception as exc:  # e.g. lone surrogates
        raise InvalidRequestError(f"prompt: could not be tokenized ({exc})", param="prompt")
    result: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.max_model_len,
                              "tokens": tokens}
    if body.return_token_strs:
        result["token_strs"] = [tokenizer.token_text(t) for t in tokens]
    return result


@router.post("/detokenize", responses=ERROR_RESPONSES, summary="Turn token ids back into text")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    engine = state.require_engine().engine
    state.resolve_model(body.model)
    vocab = engine.model_config.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"tokens: id {bad} is outside the vocabulary [0, {vocab})",
                                  param="tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}


@router.get("/tokenizer_info", responses=ERROR_RESPONSES, summary="The tokenizer's configuration")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    engine = state.require_engine().engine
    hf = engine.tokenizer.hf
    return {
        "tokenizer_class": type(hf).__name__, "model_max_length": engine.max_model_len,
        "vocab_size": engine.tokenizer.vocab_size, "model_vocab_size": engine.model_config.vocab_size,
        "eos_token": hf.eos_token, "eos_token_id": hf.eos_token_id, "bos_token": hf.bos_token,
        "bos_token_id": hf.bos_token_id, "pad_token": hf.pad_token, "chat_template": hf.chat_template,
        "add_bos_token": getattr(hf, "add_bos_token", None),
    }
