"""A chat or completions request becomes engine input here, once, in one place.

Everything a request could get wrong is found before anything is queued: the model name, the chat
template policy, the size of the text (refused before tokenizing when it cannot fit the context),
rendering and tokenizing (off the event loop for large inputs), the prompt's tokens, the output
budget, the sampling parameters, the output constraint (structured outputs, forced tool calls) and
the tools. The result, a `PreparedRequest`, is what the serving classes stream and what admission
counts; for chat it carries how to read the output (`AssistantPlan`: reasoning, tool calls).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvik.core.chat_template import check_template_kwargs
from kvik.core.errors import InvalidRequestError
from kvik.core.sampling_params import OutputKind, SamplingParams, StructuredOutputs
from kvik.engine.async_llm import AsyncLLM
from kvik.engine.input_processor import text_size
from kvik.engine.messages import EngineCoreRequest
from kvik.engine.preprocess_pool import RenderedPrompt
from kvik.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields
from kvik.server.reasoning import ThinkingState
from kvik.server.serving.assistant import AssistantPlan
from kvik.server.serving.constraints import checked, requested_constraint
from kvik.server.serving.tools import plan_tools, template_tools
from kvik.server.serving.tracking import CallRecord
from kvik.server.state import ServerState
from kvik.server.tracing import annotate_request

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for the completions API


@dataclass(slots=True)
class PreparedPrompt:
    text: str | None  # the prompt as text (rendered chat, or the completion prompt)
    token_ids: list[int]
    request: EngineCoreRequest
    record: CallRecord


@dataclass(slots=True)
class PreparedRequest:
    request_id: str
    model: str
    arrival: float
    engine: AsyncLLM
    prompts: list[PreparedPrompt] = field(default_factory=list)
    assistant: AssistantPlan = field(default_factory=AssistantPlan)  # chat: how to read the output

    @property
    def num_sequences(self) -> int:
        return sum(p.request.params.n for p in self.prompts)


def messages_for_template(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the chat template; text parts joined, `developer` treated as `system`
    (most templates know only the latter)."""
    converted = []
    for position, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"messages[{position}].content: part type {part.type!r} is not supported; "
                        "kvik serves text-only models, send text parts", param=f"messages.{position}.content")
                texts.append(part.text)
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                 "content": content or ""}
        for extra in ("name", "tool_call_id", "reasoning_content"):
            value = getattr(message, extra)
            if value is not None:
                entry[extra] = value
        if message.tool_calls:
            entry["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
        converted.append(entry)
    return converted


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends a call's arguments as a JSON string; chat templates (transformers' convention)
    expect the object, and write it with `tojson`. Arguments that are not a JSON object stay text."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def logit_bias_ids(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    parsed = {int(key): value for key, value in bias.items()}
    bad = [t for t in parsed if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                  f"[0, {vocab_size})", param="logit_bias")
    return parsed


def sampling_params(req: _SamplingFields, max_tokens: int, vocab_size: int, *, logprobs: int | None,
                    prompt_logprobs: int | None = None, structured_outputs: StructuredOutputs | None = None,
                    skip_special_tokens: bool | None = None) -> SamplingParams:
    """OpenAI defaults where the request is silent: temperature 1, top_p 1."""
    return SamplingParams(
        n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty or 1.0,
        logit_bias=logit_bias_ids(req.logit_bias, vocab_size), seed=req.seed, max_tokens=max_tokens,
        min_tokens=min(req.min_tokens, max_tokens), stop=list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
        output_kind=OutputKind.DELTA, structured_outputs=structured_outputs,
    )


def scheduling(body: _SamplingFields) -> dict[str, Any]:
    """The request's scheduling fields for the engine: priority, and its fair-share tenant."""
    return {"priority": body.priority, "tenant": body.tenant or "", "tenant_weight": body.tenant_weight}


def _chat_template_policy(state: ServerState, body: ChatCompletionRequest) -> tuple[str | None, dict[str, Any]]:
    """The request's own template (only if the operator trusts requests with one) and its
    template arguments (never the ones the server owns)."""
    kwargs = dict(body.chat_template_kwargs or {})
    template = body.chat_template
    if "chat_template" in kwargs:
        if template is not None:
            raise InvalidRequestError("chat_template: given twice (top level and in chat_template_kwargs)",
                                      param="chat_template")
        template = kwargs.pop("chat_template")
        if not isinstance(template, str):
            raise InvalidRequestError("chat_template_kwargs.chat_template: must be a string",
                                      param="chat_template_kwargs")
    if template is not None and not state.config.trust_request_chat_template:
        raise InvalidRequestError(
            "chat_template: this server does not run chat templates sent in requests (they are code); "
            "the model's own template is used when you leave it out. Operators can allow them with "
            "--trust-request-chat-template", param="chat_template")
    return template, check_template_kwargs(kwargs)


async def _system_prompt_tokens(engine: AsyncLLM, messages: list[dict[str, Any]], text: str,
                                template: str | None, tools: Any, kwargs: dict[str, Any]) -> int:
    """How many leading prompt tokens belong to the leading system message(s): blocks within them
    stay shared across tenants when a cache salt separates the rest. 0 when it cannot be told."""
    leading = []
    for message in messages:
        if message["role"] != "system":
            break
        leading.append(message)
    if not leading or len(leading) == len(messages):
        return 0
    try:
        prefix = await engine.render_chat(leading, add_generation_prompt=False, template=template,
                                          tools=tools, template_kwargs=kwargs, input_bytes=text_size(leading))
    except InvalidRequestError:
        return 0
    if not text.startswith(prefix.text):
        return 0
    # The last token of the prefix may merge differently with what follows; stop before it.
    return max(0, len(prefix.token_ids) - 1)


async def prepare_chat(state: ServerState, body: ChatCompletionRequest, *,
                       rendered: RenderedPrompt | None = None) -> PreparedRequest:
    """`rendered`: the conversation already rendered and tokenized by the caller (the Responses API
    continues a stored conversation with its exact token ids, for the prefix cache)."""
    arrival = time.time()
    engine, model = await state.engine_for(body.model)
    engine.input_processor.check_task("generate")  # before the template: an encoder has none
    template, kwargs = _chat_template_policy(state, body)
    messages = messages_for_template(body.messages)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if requested == 0:
        raise InvalidRequestError("max_tokens: must be at least 1 for chat", param="max_tokens")
    processor = engine.input_processor
    tools = template_tools(body)
    parsers = state.output_parsers(engine)
    tool_plan = await plan_tools(body, parsers.tools, parsers.tool_fallback)
    wanted = requested_constraint(body)
    input_bytes = text_size(messages) + (text_size(tools) if tools else 0)
    processor.check_text_size(text_size([m["content"] for m in messages]), "messages")
    if rendered is None:
        rendered = await engine.render_chat(messages, add_generation_prompt=body.add_generation_prompt,
                                            template=template, tools=tools, template_kwargs=kwargs,
                                            input_bytes=input_bytes, reserve_tokens=requested)
    ids = rendered.token_ids
    # The context check first, so an over-long conversation names `messages`, not `prompt`.
    max_tokens = processor.resolve_max_tokens(requested, len(ids), "messages")
    assistant = AssistantPlan(tools=tool_plan.parser, parallel_tool_calls=tool_plan.parallel)
    # Forced tool calls take precedence over a response format: the answer is the call.
    constraint = tool_plan.constraint
    if constraint is None and wanted is not None:
        constraint = await checked(wanted.constraint, wanted.param)
    if parsers.reasoning is not None:
        assistant.reasoning = parsers.reasoning
        assistant.thinking = parsers.reasoning.thinking_state(ids, engine.tokenizer.decode)
        if constraint is not None and assistant.thinking is not ThinkingState.CLOSED:
            constraint = dataclasses.replace(constraint, start_after_token_id=parsers.reasoning.end_token_id)
    # Markers that are special tokens (Mistral's [TOOL_CALLS]) must survive detokenizing.
    keep_special = assistant.tools is not None and assistant.tools.needs_special_tokens
    top_k = body.top_logprobs or 0
    params = sampling_params(body, max_tokens, processor.vocab_size, logprobs=top_k if body.logprobs else None,
                             structured_outputs=constraint, skip_special_tokens=False if keep_special else None)
    salt_from = 0
    if body.cache_salt:
        salt_from = await _system_prompt_tokens(engine, messages, rendered.text, template, tools, kwargs)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    request = processor.make_request(request_id, ids, params, arrival, max_tokens=max_tokens,
                                     cache_salt=body.cache_salt, salt_from_token=salt_from, where="messages",
                                     lora_name=state.lora_name(model), **scheduling(body))
    prepared = PreparedRequest(request_id, model, arrival, engine, assistant=assistant)
    prepared.prompts.append(PreparedPrompt(rendered.text, ids, request, CallRecord(prompt_tokens=len(ids))))
    annotate_request(prepared, "chat")
    return prepared


async def prepare_completion(state: ServerState, body: CompletionRequest) -> PreparedRequest:
    arrival = time.time()
    engine, model = await state.engine_for(body.model)
    engine.input_processor.check_task("generate")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of: only best_of == n is supported", param="best_of")
    if body.suffix:
        raise InvalidRequestError("suffix: is not supported (no model kvik serves does insertion)",
                                  param="suffix")
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequestError("max_tokens: must be at least 1 (0 only with echo)", param="max_tokens")
    score_only = body.echo and body.max_tokens == 0
    processor = engine.input_processor
    wanted = requested_constraint(body)
    constraint = await checked(wanted.constraint, wanted.param) if wanted is not None else None
    if constraint is not None and score_only:
        raise InvalidRequestError("max_tokens: 0 scores the prompt; an output constraint needs output",
                                  param="max_tokens")
    prompts = await _completion_prompts(engine, body.prompt, reserve_tokens=body.max_tokens or None)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    prepared = PreparedRequest(request_id, model, arrival, engine)
    k = body.logprobs
    for index, (text, ids) in enumerate(prompts):
        where = "prompt"
        try:
            processor.validate_prompt(ids, where)
            if score_only:  # one token is computed and dropped
                max_tokens = processor.resolve_max_tokens(1, len(ids), where)
            elif body.max_tokens is None:
                room = processor.max_model_len - len(ids)
                max_tokens = processor.resolve_max_tokens(min(DEFAULT_COMPLETION_MAX_TOKENS, room), len(ids), where)
            else:
                max_tokens = processor.resolve_max_tokens(body.max_tokens, len(ids), where)
        except InvalidRequestError as exc:
            if len(prompts) > 1:
                exc.message = f"prompt {index}: {exc.message}"
            raise
        params = sampling_params(body, max_tokens, processor.vocab_size, logprobs=k,
                                 prompt_logprobs=k if body.echo and k is not None else None,
                                 structured_outputs=constraint)
        request = processor.make_request(f"{request_id}-{index}", ids, params, arrival, max_tokens=max_tokens,
                                         cache_salt=body.cache_salt, lora_name=state.lora_name(model),
                                         **scheduling(body))
        prepared.prompts.append(PreparedPrompt(text, ids, request, CallRecord(prompt_tokens=len(ids))))
    annotate_request(prepared, "text_completion")
    return prepared


async def _completion_prompts(engine: AsyncLLM, prompt: Any, *, reserve_tokens: int | None = None
                             ) -> list[tuple[str, list[int]]]:
    """(text, token ids) per prompt, from any of the four accepted shapes; `reserve_tokens` of
    output must fit after each (checked in the tokenizer workers for large prompts)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InvalidRequestError("prompt: is empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    texts = [item for item in prompt if isinstance(item, str)]
    if any(not text for text in texts):
        raise InvalidRequestError("prompt: is empty; give at least one token", param="prompt")
    encoded = iter(await engine.tokenize(texts, reserve_tokens=reserve_tokens) if texts else [])
    tokenizer = engine.tokenizer
    return [(item, next(encoded)) if isinstance(item, str)
            else (tokenizer.decode(list(item), skip_special_tokens=False), list(item))
            for item in prompt]
