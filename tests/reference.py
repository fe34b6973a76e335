"""HF transformers as the independent reference for model outputs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=8)
def hf_model(path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation of one unpadded prompt and the log-softmax of each step's raw logits."""
    model = hf_model(path)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return tokens, logprobs


@torch.no_grad()
def hf_prompt_logprobs(path: Path, prompt_ids: list[int]) -> torch.Tensor:
    """(len-1, vocab): row i is the log-softmax predicting prompt token i + 1."""
    logits = hf_model(path)(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)
