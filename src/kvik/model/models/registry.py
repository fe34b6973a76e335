"""HF architecture name (config.json `architectures[0]`) -> kvik model class."""

from __future__ import annotations

from torch import nn

from kvik.core.errors import UnsupportedArchitectureError
from kvik.model.models.bert import BertModel
from kvik.model.models.gpt2 import GPT2LMHeadModel
from kvik.model.models.llama import LlamaForCausalLM, LlamaForSequenceClassification

# Mistral and the Qwen families are Llama variants told apart by ModelConfig flags.
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    # Pooling models: an encoder for embeddings, and classifiers (reward models) with a score head.
    "BertModel": BertModel,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": LlamaForSequenceClassification,
    "Qwen3ForSequenceClassification": LlamaForSequenceClassification,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; kvik supports "
            f"{', '.join(sorted(MODEL_CLASSES))}") from None
