"""The synchronous engine: `add_request`, then `step()` until done. One step reads
schedule() -> execute() -> sample() -> postprocess().

Not thread-safe: the offline `LLM` drives it from the caller's thread, the `AsyncEngine` from its own
engine thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from kvik.core.config import EngineArgs
from kvik.core.errors import (ConfigError, ContextLengthExceededError, InsufficientMemoryError,
                              InvalidRequestError)
from kvik.core.outputs import RequestMetrics, RequestOutput
from kvik.core.sampling_params import SamplingParams
from kvik.core.tokenizer import Tokenizer
from kvik.engine.device import default_kv_fraction, free_memory_bytes, select_device, select_dtype
from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.model_runner import ModelRunner, RunnerOutput
from kvik.engine.output_processor import OutputProcessor
from kvik.engine.request import Request, RequestGroup, RequestStatus
from kvik.engine.sampler import Sampler, prompt_logprobs_for
from kvik.engine.scheduler import Scheduler, SchedulerOutput
from kvik.model.loader import load_model, load_model_config, resolve_model_path
from kvik.model.quant import resolve_precision
from kvik.model.transforms import optimize_for_inference

logger = logging.getLogger("kvik.engine")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(slots=True)
class EngineStats:
    """A snapshot for metrics; token counters are totals since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks referenced by sequences
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        if args.threads:
            torch.set_num_threads(args.threads)
        self.device = select_device(args.device)
        # What runs in which dtype: on the CPU activations stay float32 and --dtype bfloat16 or
        # --quantization narrow the linear weights only (kvik.model.quant.resolve_precision).
        self.precision = resolve_precision(
            self.device, select_dtype(args.dtype, self.device), quantization=args.quantization,
            group_size=args.quantization_group_size, zero_point=args.quantization_zero_point,
            kv_cache_dtype=args.kv_cache_dtype)
        self.dtype = self.precision.compute_dtype
        path = resolve_model_path(args.model, args.revision)
        self.model_path = path
        self.model_config = cfg = load_model_config(path)
        self.tokenizer = Tokenizer(args.tokenizer or str(path), revision=args.revision)
        self.max_model_len = self._resolve_max_model_len()
        self.max_num_batched_tokens = self._resolve_token_budget()

        started = time.perf_counter()
        loaded = load_model(path, cfg, self.device, self.dtype, show_progress=args.show_progress)
        self.model = loaded.model
        self.weight_bytes = loaded.weight_bytes
        logger.info("loaded %s (%s, %.1f MiB) on %s as %s in %.1fs", path, cfg.architecture,
                    loaded.weight_bytes / 2**20, self.device, self.dtype, time.perf_counter() - started)
        # Quantization, oneDNN packing and the compiled CPU kernels, as module swaps.
        self.transforms = optimize_for_inference(self.model, self.device, self.dtype,
                                                 weights=self.precision.weights)
        self.cpu_kernels = self.transforms.kernels
        self.weight_bytes = self.transforms.weight_bytes

        num_blocks = self._num_kv_blocks()
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.runner = ModelRunner(self.model, self.kv, num_layers=cfg.num_layers,
                                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                  device=self.device, kv_cache_dtype=self.precision.kv_cache_dtype)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, self.max_num_batched_tokens,
                                   args.enable_chunked_prefill)
        eos = list(dict.fromkeys(cfg.eos_token_ids + ([self.tokenizer.eos_token_id]
                                                      if self.tokenizer.eos_token_id is not None else [])))
        self.eos_token_ids = eos
        self.sampler = Sampler(cfg.vocab_size, eos, self.device, seed=args.seed)
        self.output_processor = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self.groups: dict[str, RequestGroup] = {}
        self._arrival_counter = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- start-up sizing --

    def _resolve_max_model_len(self) -> int:
        cfg, requested = self.model_config, self.args.max_model_len
        limit = cfg.max_position_embeddings
        if cfg.sliding_window and cfg.sliding_window < limit:
            # kvik has no sliding-window attention: within the window, full attention is exact.
            logger.warning("model uses a sliding window of %d tokens; context capped to it",
                           cfg.sliding_window)
            limit = cfg.sliding_window
        if requested is None:
            return limit
        if requested > limit:
            raise ConfigError(f"max_model_len: {requested} exceeds the model's context length {limit}")
        return requested

    def _resolve_token_budget(self) -> int:
        requested = self.args.max_num_batched_tokens
        if not self.args.enable_chunked_prefill:
            budget = requested or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)
            if budget < self.max_model_len:
                raise ConfigError(f"max_num_batched_tokens: {budget} is below max_model_len "
                                  f"{self.max_model_len}; without chunked prefill a whole prompt "
                                  "must fit one step")
            return budget
        return requested or DEFAULT_MAX_NUM_BATCHED_TOKENS

    def _num_kv_blocks(self) -> int:
        cfg, args = self.model_config, self.args
        per_block = ModelRunner.bytes_per_block(cfg.num_layers, args.block_size, cfg.num_kv_heads,
                                                cfg.head_dim, self.precision.kv_cache_dtype)
        free = free_memory_bytes(self.device)
        if args.kv_cache_memory is not None:
            budget = args.kv_cache_memory
            if budget > free:
                raise InsufficientMemoryError(
                    f"kv_cache_memory: {budget / 2**20:.0f} MiB requested but only {free / 2**20:.0f} "
                    f"MiB is free on {self.device} after loading the model "
                    f"({self.weight_bytes / 2**20:.0f} MiB); lower --kv-cache-memory")
        else:
            budget = int(free * (args.kv_cache_fraction or default_kv_fraction(self.device)))
        blocks_per_seq = -(-self.max_model_len // args.block_size)
        num_blocks = budget // per_block
        if num_blocks < blocks_per_seq:
            raise InsufficientMemoryError(
                f"the KV cache budget of {budget / 2**20:.1f} MiB holds {num_blocks} blocks of "
                f"{args.block_size} tokens, but one sequence of max_model_len={self.max_model_len} needs "
                f"{blocks_per_seq} ({blocks_per_seq * per_block / 2**20:.1f} MiB) next to the "
                f"{self.weight_bytes / 2**20:.0f} MiB model; raise --kv-cache-memory or lower "
                "--max-model-len")
        # More blocks than every sequence slot can fill only feeds the prefix cache; stop there.
        cap = 2 * args.max_num_seqs * blocks_per_seq
        if num_blocks > cap:
            num_blocks = cap
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", num_blocks, args.block_size,
                    num_blocks * per_block / 2**20)
        return num_blocks

    # -- requests --

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: is empty; give at least one token", param="prompt")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raise a typed error if the prompt cannot run; the server calls this before streaming."""
        if not token_ids:
            raise InvalidRequestError("prompt: is empty; give at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})",
                                      param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"has {len(token_ids)} tokens, leaving no room for output. Shorten the prompt.",
                param="prompt")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids, params)
        group = RequestGroup(request_id, text, token_ids, params,
                             RequestMetrics(arrival_time=arrival_time or time.time()))
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        for index in range(params.n):
            request = Request(
                seq_id=f"{request_id}#{index}", group=group, index=index, params=params,
                max_tokens=max_tokens, all_token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                arrival_order=next(self._arrival_counter),
                wants_prompt_logprobs=index == 0 and params.prompt_logprobs is not None,
            )
            if index > 0 and self.args.enable_prefix_caching:
                request.wait_for_prompt_of = group.sequences[0]
            group.sequences.append(request)
            self.scheduler.add(request)
        self.groups[request_id] = group
        self.prompt_tokens_total += len(token_ids)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for request in group.sequences:
            if not request.status.finished:
                request.finish_reason = RequestStatus.FINISHED_ABORTED.value
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- the step --

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        result = self.runner.execute(scheduled.chunks)
        return self._postprocess(scheduled, result)

    def _postprocess(self, scheduled: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        now = time.time()
        changed: dict[str, RequestGroup] = {}
        for chunk in scheduled.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.end
            self.kv.cache_computed_blocks(request)
            if request.group.metrics.first_scheduled_time is None:
                request.group.metrics.first_scheduled_time = now
                request.group.num_cached_tokens = max(request.num_cached_tokens, 0)
        for piece in result.prompt_slices:
            request = piece.chunk.request
            group = request.group
            targets = group.prompt_token_ids[piece.first_token:piece.first_token + piece.num_rows]
            entries = prompt_logprobs_for(result.logits[piece.row_start:piece.row_start + piece.num_rows],
                                          targets, group.params.prompt_logprobs)
            for entry in entries:
                for token, logprob in entry.items():
                    logprob.decoded_token = self.tokenizer.token_text(token)
            group.prompt_logprobs.extend(entries)
            request.num_prompt_logprobs_done = piece.first_token + piece.num_rows - 1
        requests = [chunk.request for chunk in result.sample_chunks]
        sampled = self.sampler(result.logits[:len(requests)], requests)
        for row, request in enumerate(requests):
            status = self.output_processor.append_token(
                request, sampled.token_ids[row], sampled.logprobs[row], sampled.chosen_logprobs[row])
            self.generation_tokens_total += 1
            if status is not None:
                self.scheduler.finish(request, status)
            changed[request.group.request_id] = request.group
        outputs = []
        for request_id, group in changed.items():
            output = self.output_processor.make_output(group)
            if output is not None:
                outputs.append(output)
            if group.finished:
                self.groups.pop(request_id, None)
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage, num_blocks=self.kv.pool.num_blocks,
            num_free_blocks=self.kv.num_free_blocks(), prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total, generation_tokens=self.generation_tokens_total,
        )
