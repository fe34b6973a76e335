"""`EngineCore`: the model, the KV cache, the scheduler and the sampler, in token ids only.

One step reads schedule() -> execute() -> sample() -> update_from_output(), then, with speculative
decoding on, propose() drafts for the next step (verified in it next to sampling). The core runs either in
the caller's thread (the offline `LLM`, through `LLMEngine`) or in a process of its own behind a
socket (`kvik serve`, through `kvik.engine.core_process`); it does not know which. It trusts the
front end to have validated requests (`kvik.engine.input_processor`) and still refuses, one request
at a time, anything that would break it.

Pooling requests (embeddings, classification scores) share the step: the runner pools the hidden
states of the prompts that completed and the scheduler ends those requests with the vector. What a
model can do (`tasks`: generate, embed, classify) comes from its class; an encoder (BERT) has no KV
cache and can only pool.

Not thread-safe: one thread drives it.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from kvik.core.config import EngineArgs
from kvik.core.errors import ConfigError, InvalidRequestError, KvikError
from kvik.core.pooling_params import PoolingParams
from kvik.core.sampling_params import SamplingParams
from kvik.core.tokenizer import TokenizerSpec
from kvik.engine import cuda_graphs
from kvik.engine.device import select_device
from kvik.engine.host_memory import keep_step_memory
from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.lora_manager import AdapterManager
from kvik.engine.messages import (EngineCoreOutput, EngineCoreRequest, EngineInfo, EngineStats, LoRAAdapterInfo,
                                  PoolingInfo)
from kvik.engine.model_runner import ModelRunner
from kvik.engine.model_setup import load_served_model
from kvik.engine.multi_step import run_more_steps
from kvik.engine.request import Request, RequestGroup, RequestStatus
from kvik.engine.sampler import Sampler, prompt_logprobs_for
from kvik.engine.scheduler import SampledTokens, Scheduler
from kvik.engine.spec_decode import SpecDecoder, build_spec_decoder
from kvik.engine.structured.matcher import GrammarBackend
from kvik.engine.scheduling_policy import make_policy
from kvik.engine.sizing import resolve_max_model_len, resolve_token_budget, size_kv_cache
from kvik.model.loader import load_model_config, resolve_model_path
from kvik.model.models.registry import model_class as architecture_class
from kvik.model.pooling import LAST, label_names, load_pooling_config

logger = logging.getLogger("kvik.engine")


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        if args.threads:
            torch.set_num_threads(args.threads)
        self.device = select_device(args.device)
        path = resolve_model_path(args.model, args.revision)
        self.model_path = path
        self.model_config = cfg = load_model_config(path)
        self.tokenizer_spec = TokenizerSpec.from_pretrained(args.tokenizer or str(path), args.revision)
        model_class = architecture_class(cfg.architecture)
        self.tasks: tuple[str, ...] = getattr(model_class, "supported_tasks", ("generate",))
        self.uses_kv_cache: bool = getattr(model_class, "uses_kv_cache", True)
        self.pooling = load_pooling_config(path, cfg, getattr(model_class, "default_pooling", LAST),
                                           getattr(model_class, "default_normalize", True))
        self.max_model_len = resolve_max_model_len(cfg, args.max_model_len, self.pooling, self.tasks)
        self.max_num_batched_tokens = resolve_token_budget(
            args.max_num_batched_tokens, self.max_model_len,
            chunked_prefill=args.enable_chunked_prefill and self.uses_kv_cache)
        served = load_served_model(args, path, cfg, self.device, self.tasks)
        self.model, self.precision, self.weight_bytes = served.model, served.precision, served.weight_bytes
        self.dtype = self.precision.compute_dtype
        self.transforms, self.cpu_kernels = served.transforms, served.transforms.kernels
        self.adapters, lora_model = served.adapters, served.lora
        # Speculative decoding; a draft model loads now, so its weights and KV share the budget.
        if args.speculative_method is not None and "generate" not in self.tasks:
            raise ConfigError(f"speculative_method: {cfg.architecture} does not generate text "
                              f"(it can {', '.join(self.tasks)}); speculative decoding needs a generative model")
        self.spec: SpecDecoder | None = build_spec_decoder(
            args, tokenizer=self.tokenizer_spec, vocab_size=cfg.vocab_size, device=self.device,
            dtype=self.dtype, max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            target_step_bytes=self.transforms.linear_weight_bytes)

        num_blocks, self.kv_cache_bytes = 0, 0  # an encoder has no KV cache
        if self.uses_kv_cache:
            per_block = ModelRunner.bytes_per_block(cfg.num_layers, args.block_size, cfg.num_kv_heads,
                                                    cfg.head_dim, self.precision.kv_cache_dtype)
            if self.spec is not None:  # a draft model keeps as many blocks of its own
                per_block += self.spec.kv_bytes_per_block
            kv_size = size_kv_cache(
                bytes_per_block=per_block, device=self.device, kv_cache_memory=args.kv_cache_memory,
                kv_cache_fraction=args.kv_cache_fraction, max_model_len=self.max_model_len,
                block_size=args.block_size, max_num_seqs=args.max_num_seqs, weight_bytes=self.weight_bytes)
            num_blocks, self.kv_cache_bytes = kv_size.num_blocks, kv_size.nbytes
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        # A decode step has a row per sequence, or per draft plus one when verifying drafts.
        decode_rows = args.max_num_seqs * (1 + (args.num_speculative_tokens if self.spec is not None else 0))
        graphs = cuda_graphs.decode_graph_settings(
            self.device, enforce_eager=args.enforce_eager, max_model_len=self.max_model_len,
            max_rows=min(decode_rows, self.max_num_batched_tokens))
        self.runner = ModelRunner(self.model, num_blocks=num_blocks, block_size=args.block_size,
                                  num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, device=self.device,
                                  kv_cache_dtype=self.precision.kv_cache_dtype, pooling=self.pooling,
                                  lora=lora_model, graphs=graphs)
        spec_eos = [self.tokenizer_spec.eos_token_id] if self.tokenizer_spec.eos_token_id is not None else []
        self.eos_token_ids = list(dict.fromkeys(cfg.eos_token_ids + spec_eos))
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, self.max_num_batched_tokens,
                                   args.enable_chunked_prefill, eos_token_ids=frozenset(self.eos_token_ids),
                                   max_model_len=self.max_model_len, uses_kv_cache=self.uses_kv_cache,
                                   policy=make_policy(args.scheduling_policy, self.device.type,
                                                      lower_tier_prefill_chunk=args.lower_tier_prefill_chunk),
                                   adapters=self.adapters, num_scheduler_steps=args.scheduler_steps())
        # Structured outputs: llguidance's tokenizer view is built in the background now, so no
        # request waits for it and requests without constraints never touch it.
        self.grammars = GrammarBackend(self.tokenizer_spec.backend_json, cfg.vocab_size,
                                       self.tokenizer_spec.vocab_size, self.eos_token_ids)
        self.sampler = Sampler(cfg.vocab_size, self.eos_token_ids, self.device, seed=args.seed,
                               grammars=self.grammars)
        if self.spec is not None:
            self.spec.start(num_blocks, self.sampler, graphs)
        if args.scheduler_steps() > 1:
            self.runner.prepare_greedy_head()
        if self.device.type == "cpu":
            keep_step_memory()  # after the weights and the KV pool have their memory
        self.groups: dict[str, RequestGroup] = {}
        self._arrival_counter = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def info(self) -> EngineInfo:
        return EngineInfo(
            model_path=str(self.model_path), architecture=self.model_config.architecture,
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.eos_token_ids), num_kv_blocks=self.kv.pool.num_blocks,
            block_size=self.args.block_size, max_num_seqs=self.args.max_num_seqs,
            device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
            weight_bytes=self.weight_bytes, tokenizer=self.tokenizer_spec, tasks=list(self.tasks),
            pooling=self._pooling_info(), precision=self.precision.describe(),
            kv_cache_bytes=self.kv_cache_bytes, enable_lora=self.adapters is not None,
            max_loras=self.args.max_loras if self.adapters else 0,
            max_lora_rank=self.args.max_lora_rank if self.adapters else 0,
            lora_adapters=self.adapters.list() if self.adapters else [])

    def _pooling_info(self) -> PoolingInfo | None:
        if not any(task in self.tasks for task in ("embed", "classify")):
            return None
        pooling = self.pooling
        labels = label_names(self.model_config) if "classify" in self.tasks else []
        return PoolingInfo(method=pooling.method, normalize=pooling.normalize,
                           hidden_size=pooling.hidden_size, matryoshka=pooling.matryoshka,
                           matryoshka_dimensions=list(pooling.matryoshka_dimensions), labels=labels)

    def warm_up(self) -> None:
        """One forward through every layer: the first step pays for lazy initialisation (allocator,
        kernels) that a user's first request should not."""
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        pooling = None if "generate" in self.tasks else PoolingParams(task=self.tasks[0])
        self.add_request(EngineCoreRequest("warmup", [1, 2, 3, 4], params, 2, time.time(), pooling=pooling))
        while self.has_unfinished_requests():
            self.step()
        self.kv.pool.reset_prefix_cache()

    # -- requests --

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit a validated request; raises InvalidRequestError (the request fails alone) if it
        would break the engine anyway."""
        request_id, token_ids, params = request.request_id, request.prompt_token_ids, request.params
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        pooling = request.pooling
        task = pooling.task if pooling is not None else "generate"
        if task not in self.tasks:
            raise InvalidRequestError(f"request {request_id}: this model does not {task} (it can "
                                      f"{', '.join(self.tasks)})")
        vocab = self.model_config.vocab_size
        # A pooling prompt may fill the context: nothing is generated after it.
        limit = self.max_model_len + (1 if pooling is not None else 0)
        if not token_ids or len(token_ids) >= limit or any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"request {request_id}: prompt is empty, too long or has token ids "
                                      "outside the vocabulary", param="prompt")
        lora_id = self._lora_id(request)
        if pooling is not None:
            if lora_id:
                raise InvalidRequestError(f"request {request_id}: LoRA adapters serve generation, not "
                                          f"{task}", param="model")
            self._add_pooling_request(request, pooling)
            return
        max_tokens = min(request.max_tokens, self.max_model_len - len(token_ids))
        constraint = params.structured_outputs
        group = RequestGroup(request_id, list(token_ids), params, request.arrival_time,
                             cache_salt=request.cache_salt.encode() if request.cache_salt else b"",
                             salt_from_token=request.salt_from_token, priority=request.priority,
                             tenant=request.tenant, tenant_weight=request.tenant_weight, lora_id=lora_id)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for index in range(params.n):
            sequence = Request(
                seq_id=f"{request_id}#{index}", group=group, index=index, params=params,
                max_tokens=max_tokens, all_token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                arrival_order=next(self._arrival_counter),
                wants_prompt_logprobs=index == 0 and params.prompt_logprobs is not None,
                # Compiled once (then copied from the cache) before sequence 0 is queued, so a
                # grammar error fails this request alone.
                grammar=self.grammars.new_state(constraint) if constraint is not None else None,
            )
            if index > 0 and self.args.enable_prefix_caching:
                sequence.wait_for_prompt_of = group.sequences[0]
            group.sequences.append(sequence)
            self.scheduler.add(sequence)
        self.groups[request_id] = group
        self.prompt_tokens_total += len(token_ids)

    def _lora_id(self, request: EngineCoreRequest) -> int:
        if request.lora_name is None:
            return 0
        if self.adapters is None:
            raise InvalidRequestError(f"request {request.request_id}: LoRA adapter {request.lora_name!r} "
                                      "requested, but this engine serves none (--enable-lora)", param="model")
        try:
            return self.adapters.entry(request.lora_name).lora_id
        except KvikError as exc:
            raise InvalidRequestError(f"request {request.request_id}: {exc.message}", param="model") from None

    # -- LoRA adapters (utility calls) --

    def add_lora(self, name: str, path: str) -> LoRAAdapterInfo:
        """Register a PEFT adapter directory under `name` (checked against the base model)."""
        return self._require_adapters().add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter; refused (ConflictError) while requests use it."""
        adapters = self._require_adapters()
        lora_id = adapters.entry(name).lora_id
        adapters.remove(name, in_use=any(g.lora_id == lora_id for g in self.groups.values()))
        return True

    def list_loras(self) -> list[LoRAAdapterInfo]:
        return self._require_adapters().list() if self.adapters is not None else []

    def _require_adapters(self) -> AdapterManager:
        if self.adapters is None:
            raise InvalidRequestError("this server does not serve LoRA adapters; start it with --enable-lora")
        return self.adapters

    def _add_pooling_request(self, request: EngineCoreRequest, pooling: PoolingParams) -> None:
        token_ids = list(request.prompt_token_ids)
        pad = self.model_config.raw.get("pad_token_id")
        if pooling.task == "classify" and isinstance(pad, int):
            # HF classifies at the last token that is not padding (the first token if all are).
            while len(token_ids) > 1 and token_ids[-1] == pad:
                token_ids.pop()
        params = request.params.clone(n=1)
        group = RequestGroup(request.request_id, token_ids, params, request.arrival_time,
                             cache_salt=request.cache_salt.encode() if request.cache_salt else b"",
                             salt_from_token=request.salt_from_token, priority=request.priority,
                             tenant=request.tenant, tenant_weight=request.tenant_weight)
        sequence = Request(
            seq_id=f"{request.request_id}#0", group=group, index=0, params=params, max_tokens=0,
            all_token_ids=token_ids, num_prompt_tokens=len(token_ids),
            arrival_order=next(self._arrival_counter), pooling=pooling,
            needs_whole_prompt=not self.uses_kv_cache or self.pooling.method != LAST)
        group.sequences.append(sequence)
        self.scheduler.add(sequence)
        self.groups[request.request_id] = group
        self.prompt_tokens_total += len(token_ids)

    def abort(self, request_id: str, index: int = -1) -> bool:
        """Stop a request's sequences (one, or all with index -1) and free their blocks now; False
        if nothing was running under that id."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        for sequence in group.sequences:
            if (index < 0 or sequence.index == index) and not sequence.status.finished:
                sequence.finish_reason = RequestStatus.FINISHED_ABORTED.value
                self.scheduler.finish(sequence, RequestStatus.FINISHED_ABORTED)
        if group.finished:
            del self.groups[request_id]
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def fail_all(self, message: str) -> list[EngineCoreOutput]:
        """After a failed step: end every request with an error and free its blocks."""
        outputs = []
        for request_id, group in list(self.groups.items()):
            for sequence in group.sequences:
                if not sequence.status.finished:
                    self.scheduler.finish(sequence, RequestStatus.FINISHED_ERROR)
                    outputs.append(EngineCoreOutput(request_id, sequence.index, finish_reason="error",
                                                    error=message))
            del self.groups[request_id]
        return outputs

    def reset_prefix_cache(self) -> int:
        return self.kv.pool.reset_prefix_cache()

    # -- the step --

    def step(self) -> list[EngineCoreOutput]:
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            failed = self.scheduler.take_failed()  # sequences whose adapter could not be loaded
            for output in failed:
                group = self.groups.get(output.request_id)
                if group is not None and group.finished:
                    del self.groups[output.request_id]
            return failed
        result = self.runner.execute(scheduled.chunks)
        for piece in result.prompt_slices:
            request = piece.chunk.request
            group = request.group
            targets = group.prompt_token_ids[piece.first_token:piece.first_token + piece.num_rows]
            rows = result.logits[piece.row_start:piece.row_start + piece.num_rows]
            group.prompt_logprobs.extend(prompt_logprobs_for(rows, targets, group.params.prompt_logprobs))
            request.num_prompt_logprobs_done = piece.first_token + piece.num_rows - 1
        requests: list[Request] = [chunk.request for chunk in result.sample_chunks]
        new_tokens: dict[Request, SampledTokens] = {}
        forwards = 1
        if requests:
            sampled = self.sampler(result.logits[:len(requests)], requests)
            new_tokens = {r: SampledTokens([t], [lp] if lp else None)
                          for r, t, lp in zip(requests, sampled.token_ids, sampled.logprobs)}
            if scheduled.num_steps > 1:
                forwards = run_more_steps(self.runner.decode_next, self.sampler, result.sample_chunks,
                                          scheduled.num_steps, sampled.token_ids, new_tokens,
                                          eos_token_ids=self.scheduler.eos_token_ids, max_model_len=self.max_model_len,
                                          greedy_steps=self.runner.greedy_steps)
        # Constrained sequences never get drafts (SpecDecoder.propose skips them): their tokens all
        # come from the sampler above.
        failed = self._advance_grammars(requests, sampled.token_ids) if requests else []
        if result.verify_slices:
            new_tokens.update(self.spec.verify(result.logits, result.verify_slices))
        pooled = {chunk.request: float32_bytes(vector) for chunk, vector in result.pooled}
        outputs = self.scheduler.update_from_output(scheduled, new_tokens, pooled)
        outputs.extend(failed)
        outputs.extend(self.scheduler.take_failed())
        for output in outputs:
            self.generation_tokens_total += len(output.new_token_ids)
            group = self.groups.get(output.request_id)
            if group is not None and group.finished:
                del self.groups[output.request_id]
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        self.scheduler.observe_step(time.perf_counter() - started, forwards)
        return outputs

    def _advance_grammars(self, requests: list[Request], token_ids: list[int]) -> list[EngineCoreOutput]:
        """Advance each constrained sequence's matcher by its new token. The mask makes a rejection
        impossible short of a bug; such a sequence fails with an error instead of going on with
        output its constraint does not allow."""
        failed = []
        for request, token_id in zip(requests, token_ids):
            if request.grammar is None or request.grammar.accept(token_id):
                continue
            message = f"structured outputs: the grammar rejected token {token_id} ({request.grammar.error})"
            logger.error("request %s: %s", request.group.request_id, message)
            request.finish_reason = RequestStatus.FINISHED_ERROR.value
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            failed.append(EngineCoreOutput(request.group.request_id, request.index, finish_reason="error",
                                           error=message))
        return failed

    def stats(self) -> EngineStats:
        stats = EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage, num_blocks=self.kv.pool.num_blocks,
            num_free_blocks=self.kv.num_free_blocks(), prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total, generation_tokens=self.generation_tokens_total,
            preemptions_by_priority=dict(self.scheduler.num_preemptions_by_priority),
            waiting_by_priority=self._waiting_by_priority(),
        )
        if self.adapters is not None:
            adapters = self.adapters
            stats.lora_adapters = len(adapters.adapters)
            stats.lora_adapters_in_slots = sum(1 for owner in adapters.slot_owner if owner)
            stats.lora_slot_loads = adapters.counters.slot_loads
            stats.lora_disk_loads = adapters.counters.disk_loads
        if self.spec is not None:
            spec = self.spec.stats
            stats.spec_decode_num_drafts = spec.num_drafts
            stats.spec_decode_num_draft_tokens = spec.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = spec.num_accepted_tokens
            stats.spec_decode_num_accepted_tokens_per_pos = list(spec.accepted_per_position)
        return stats

    def _waiting_by_priority(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for request in self.scheduler.waiting:
            counts[request.group.priority] = counts.get(request.group.priority, 0) + 1
        return counts


def float32_bytes(vector: torch.Tensor) -> bytes:
    """A 1-D float32 CPU tensor as little-endian bytes (what the wire and base64 carry)."""
    return vector.contiguous().numpy().astype("<f4", copy=False).tobytes()
