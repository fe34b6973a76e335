"""Start-up sizing (kvik.engine.sizing): context length, token budget and KV blocks, as pure functions."""

from __future__ import annotations

import pytest
import torch

from kvik.core.errors import ConfigError, InsufficientMemoryError
from kvik.engine import sizing
from kvik.engine.sizing import (DEFAULT_MAX_NUM_BATCHED_TOKENS, resolve_max_model_len, resolve_token_budget,
                                size_kv_cache)
from kvik.model.config import ModelConfig
from kvik.model.pooling import PoolingConfig

CPU = torch.device("cpu")


def config(max_positions: int = 4096, sliding_window: int | None = None) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=100, hidden_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                       max_position_embeddings=max_positions, norm_eps=1e-5, tie_word_embeddings=False,
                       sliding_window=sliding_window)


def test_context_length_comes_from_the_user_the_model_a_window_or_the_trained_length() -> None:
    pooling = PoolingConfig("last", True, 64)
    assert resolve_max_model_len(config(), None, pooling, ("generate",)) == 4096
    assert resolve_max_model_len(config(), 1000, pooling, ("generate",)) == 1000
    assert resolve_max_model_len(config(sliding_window=2048), None, pooling, ("generate",)) == 2048
    trained = PoolingConfig("mean", True, 64, max_seq_length=256)
    assert resolve_max_model_len(config(), None, trained, ("embed",)) == 256
    assert resolve_max_model_len(config(), None, trained, ("generate", "embed")) == 4096
    with pytest.raises(ConfigError, match="exceeds the model's context length 4096"):
        resolve_max_model_len(config(), 4097, pooling, ("generate",))


def test_without_chunked_prefill_a_whole_prompt_must_fit_one_step() -> None:
    assert resolve_token_budget(None, 512, chunked_prefill=True) == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert resolve_token_budget(256, 4096, chunked_prefill=True) == 256
    assert resolve_token_budget(None, 8192, chunked_prefill=False) == 8192
    assert resolve_token_budget(None, 512, chunked_prefill=False) == DEFAULT_MAX_NUM_BATCHED_TOKENS
    with pytest.raises(ConfigError, match="below max_model_len 4096"):
        resolve_token_budget(1024, 4096, chunked_prefill=False)


def kv(**overrides) -> sizing.KVCacheSize:
    args = dict(bytes_per_block=1000, device=CPU, kv_cache_memory=None, kv_cache_fraction=0.5,
                max_model_len=160, block_size=16, max_num_seqs=4, weight_bytes=0)
    args.update(overrides)
    return size_kv_cache(**args)


def test_kv_blocks_fill_the_budget_refuse_too_little_and_stop_where_only_the_prefix_cache_gains(
        monkeypatch) -> None:
    free = {"bytes": 100_000}
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: free["bytes"])
    # Half of what is free, in whole blocks.
    assert kv() == sizing.KVCacheSize(50, 50_000)
    # An explicit budget, within what is free.
    assert kv(kv_cache_memory=30_500) == sizing.KVCacheSize(30, 30_000)
    with pytest.raises(InsufficientMemoryError, match="lower --kv-cache-memory"):
        kv(kv_cache_memory=100_001)
    # One sequence of 160 tokens needs 10 blocks of 16.
    with pytest.raises(InsufficientMemoryError, match="needs 10"):
        kv(kv_cache_memory=9_999)
    # Capped at two blocks tables' worth per sequence slot: 2 x 4 x 10.
    free["bytes"] = 10**9
    assert kv().num_blocks == 80
