"""Start-up sizing of an engine: its context length, its token budget per step and its KV cache.

Pure functions of the model's config, the user's flags and the memory left after the weights, so
they read (and are tested) apart from `EngineCore`, which loads everything they size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvik.core.errors import ConfigError, InsufficientMemoryError
from kvik.engine.device import default_kv_fraction, free_memory_bytes
from kvik.model.config import ModelConfig
from kvik.model.pooling import PoolingConfig

logger = logging.getLogger("kvik.engine")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def resolve_max_model_len(cfg: ModelConfig, requested: int | None, pooling: PoolingConfig,
                          tasks: tuple[str, ...]) -> int:
    """The context length: the user's, else the model's (capped to a sliding window, or for an
    embedding model to the length it was trained on)."""
    limit = cfg.max_position_embeddings
    if cfg.sliding_window and cfg.sliding_window < limit:
        # kvik has no sliding-window attention: within the window, full attention is exact.
        logger.warning("model uses a sliding window of %d tokens; context capped to it", cfg.sliding_window)
        limit = cfg.sliding_window
    if requested is None:
        # sentence-transformers models declare the longest input they were trained on.
        trained = pooling.max_seq_length
        return min(limit, trained) if trained and tasks == ("embed",) else limit
    if requested > limit:
        raise ConfigError(f"max_model_len: {requested} exceeds the model's context length {limit}")
    return requested


def resolve_token_budget(requested: int | None, max_model_len: int, *, chunked_prefill: bool) -> int:
    """Tokens per step. Without chunked prefill (or for an encoder, which has no KV cache to chunk
    into) a whole prompt must fit one step."""
    if not chunked_prefill:
        budget = requested or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
        if budget < max_model_len:
            raise ConfigError(f"max_num_batched_tokens: {budget} is below max_model_len "
                              f"{max_model_len}; without chunked prefill (or for an "
                              "encoder, which has no KV cache) a whole prompt must fit one step")
        return budget
    return requested or DEFAULT_MAX_NUM_BATCHED_TOKENS


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    nbytes: int


def size_kv_cache(*, bytes_per_block: int, device: torch.device, kv_cache_memory: int | None,
                  kv_cache_fraction: float | None, max_model_len: int, block_size: int, max_num_seqs: int,
                  weight_bytes: int) -> KVCacheSize:
    """As many blocks as the budget holds (--kv-cache-memory, else a fraction of the memory free
    after loading), refused if one sequence of max_model_len would not fit, and capped where more
    blocks could only feed the prefix cache."""
    free = free_memory_bytes(device)
    if kv_cache_memory is not None:
        budget = kv_cache_memory
        if budget > free:
            raise InsufficientMemoryError(
                f"kv_cache_memory: {budget / 2**20:.0f} MiB requested but only {free / 2**20:.0f} "
                f"MiB is free on {device} after loading the model "
                f"({weight_bytes / 2**20:.0f} MiB); lower --kv-cache-memory")
    else:
        budget = int(free * (kv_cache_fraction or default_kv_fraction(device)))
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = budget // bytes_per_block
    if num_blocks < blocks_per_seq:
        raise InsufficientMemoryError(
            f"the KV cache budget of {budget / 2**20:.1f} MiB holds {num_blocks} blocks of "
            f"{block_size} tokens, but one sequence of max_model_len={max_model_len} needs "
            f"{blocks_per_seq} ({blocks_per_seq * bytes_per_block / 2**20:.1f} MiB) next to the "
            f"{weight_bytes / 2**20:.0f} MiB model; raise --kv-cache-memory or lower "
            "--max-model-len")
    # More blocks than every sequence slot can fill only feeds the prefix cache; stop there.
    num_blocks = min(num_blocks, 2 * max_num_seqs * blocks_per_seq)
    logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", num_blocks, block_size,
                num_blocks * bytes_per_block / 2**20)
    return KVCacheSize(num_blocks, num_blocks * bytes_per_block)
