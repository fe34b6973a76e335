"""What a request may cost in tokens, estimated at admission without a tokenizer.

TPM limits and token budgets reserve this estimate when a request is admitted and settle the
difference when it ends (the replica's `usage`, or what was relayed), as OpenAI's limiter does, so
concurrent requests cannot all slip under a limit that each alone would fit.

The gateway has no tokenizer (it is torch-free and model-agnostic), so the prompt is estimated from
above: a byte-level BPE token covers at least one byte, so a text's UTF-8 length bounds its token
count, plus what a chat template adds per message. Typical text is 3 to 4 bytes per token: the
reservation is generous and the settlement gives the excess back. Limits clamp the reservation (see
the limiter), so a generous estimate never makes a request impossible.

A Responses request that continues a stored conversation (`previous_response_id`) is prompted
with earlier turns the gateway never sees in its body. It reserves them as well: the gateway keeps
the replica's count of each stored response's input and output tokens (`stored_responses`) and
adds it to the new input's estimate, so concurrent continuations of a long conversation cannot each
slip under a budget or TPM limit that their whole prompts overrun.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Role markers and separators a chat template adds around each message, and the generation prompt.
TEMPLATE_TOKENS_PER_MESSAGE = 8


@dataclass(slots=True, frozen=True)
class TokenEstimate:
    prompt: int  # an upper bound for byte-level tokenizers
    completion: int  # choices x max_tokens, or x the configured reserve when max_tokens is not set
    explicit: bool  # the client set max_tokens: asking for more than a limit allows can never fit

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    def continuing(self, context_tokens: int) -> TokenEstimate:
        """This estimate for a request that is also prompted with a stored conversation's tokens."""
        return TokenEstimate(self.prompt + context_tokens, self.completion, self.explicit)


def estimate_tokens(body: dict[str, Any], texts: list[str], reserve_completion_tokens: int, *,
                    generates: bool = True) -> TokenEstimate:
    """`texts` are the request's texts (`guardrails.text.request_texts`). An endpoint that does not
    generate (embeddings) reserves no completion tokens; its token-id inputs count exactly."""
    prompt = sum(len(text) if text.isascii() else len(text.encode(errors="surrogatepass")) for text in texts)
    if not generates:
        inputs = body.get("input")
        if isinstance(inputs, list) and inputs and all(isinstance(i, int) for i in inputs):
            prompt += len(inputs)
        elif isinstance(inputs, list) and all(isinstance(i, list) for i in inputs):
            prompt += sum(len(i) for i in inputs)
        return TokenEstimate(prompt=prompt, completion=0, explicit=False)
    messages = body.get("messages")
    if isinstance(messages, list):
        prompt += TEMPLATE_TOKENS_PER_MESSAGE * (len(messages) + 1)
    items = body.get("input")  # Responses API input items, each a message of the chat prompt
    if isinstance(items, list) and items and all(isinstance(i, dict) for i in items):
        prompt += TEMPLATE_TOKENS_PER_MESSAGE * (len(items) + 1)
    if body.get("tools"):
        prompt += len(json.dumps(body["tools"]))  # rendered into the prompt by the template
    prompt_field = body.get("prompt")
    prompts = 1
    if isinstance(prompt_field, list) and prompt_field:
        if all(isinstance(p, int) for p in prompt_field):
            prompt += len(prompt_field)  # token ids: exact
        elif all(isinstance(p, list) for p in prompt_field):
            prompt += sum(len(p) for p in prompt_field)
            prompts = len(prompt_field)
        else:
            prompts = len(prompt_field)  # a batch of string prompts, each answered with n choices
    choices = prompts * max(_count(body.get("n")), _count(body.get("best_of")))
    limits = [v for v in (body.get("max_tokens"), body.get("max_completion_tokens"), body.get("max_output_tokens"))
              if isinstance(v, int)]
    per_choice = max(limits) if limits else reserve_completion_tokens
    return TokenEstimate(prompt=prompt, completion=choices * per_choice, explicit=bool(limits))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1
