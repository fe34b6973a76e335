"""The model hyper-parameters kvik needs, normalised from an HF `config.json`.

HF configs differ across families and transformers versions (`rope_theta` at the top level with
`rope_scaling`, or both inside `rope_parameters`; GPT-2's `n_embd`/`n_layer`), so every model class
reads this one dataclass instead of the raw dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvik.core.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # type + factors, without rope_theta
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling) from either the transformers>=5 or the older config layout."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = dict(raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = params or legacy
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_scaling: rope type {rope_type!r} is not supported; kvik implements "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    scaling["rope_type"] = rope_type
    return theta, scaling


def model_config_from_hf(raw: dict[str, Any], architecture: str) -> ModelConfig:
    """Build a `ModelConfig` from the parsed config.json of a supported architecture."""
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if architecture == "GPT2LMHeadModel":
        hidden = raw["n_embd"]
        return ModelConfig(
            architecture=architecture, model_type="gpt2", vocab_size=raw["vocab_size"],
            hidden_size=hidden, num_layers=raw["n_layer"], num_heads=raw["n_head"],
            num_kv_heads=raw["n_head"], head_dim=hidden // raw["n_head"],
            intermediate_size=raw.get("n_inner") or 4 * hidden,
            max_position_embeddings=raw["n_positions"], norm_eps=raw.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=raw.get("tie_word_embeddings", True),
            hidden_act=raw.get("activation_function", "gelu_new"), eos_token_ids=eos_ids, raw=raw,
        )
    try:
        hidden = raw["hidden_size"]
        num_heads = raw["num_attention_heads"]
        theta, scaling = _rope(raw)
        model_type = raw.get("model_type", "")
        # Qwen2 configs carry a sliding window that is off unless use_sliding_window is set.
        window = raw.get("sliding_window")
        if model_type.startswith("qwen") and not raw.get("use_sliding_window", False):
            window = None
        return ModelConfig(
            architecture=architecture, model_type=model_type, vocab_size=raw["vocab_size"],
            hidden_size=hidden, num_layers=raw["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            norm_eps=raw.get("rms_norm_eps", raw.get("layer_norm_eps", 1e-6)),  # the latter: BERT
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            hidden_act=raw.get("hidden_act", "silu"),
            attention_bias=raw.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            rope_theta=theta, rope_scaling=scaling, sliding_window=window, eos_token_ids=eos_ids,
            raw=raw,
        )
    except KeyError as exc:
        raise ConfigError(f"config.json: missing field {exc.args[0]!r} for {architecture}") from exc
