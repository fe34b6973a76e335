"""`LLM`: the offline API, shaped like vLLM's.

    from kvik import LLM, SamplingParams
    llm = LLM(model="path/or/hub-id", max_num_seqs=32)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=16))

Pooling models (an encoder like all-MiniLM-L6-v2, a `*ForSequenceClassification` reward model) and
decoders' last-token embeddings: `llm.embed(texts)` and `llm.classify(texts)`.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from kvik.core.config import EngineArgs
from kvik.core.errors import InvalidRequestError, KvikError
from kvik.core.outputs import PoolingRequestOutput, RequestOutput
from kvik.core.pooling_params import PoolingParams
from kvik.core.sampling_params import OutputKind, SamplingParams
from kvik.engine.llm_engine import LLMEngine

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs.from_kwargs(model, **engine_args))
        self._ids = itertools.count()
        self._hf_tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The HF (transformers) tokenizer of the model, loaded on first use."""
        if self._hf_tokenizer is None:
            from transformers import AutoTokenizer

            from kvik.core.gguf_tokenizer import gguf_tokenizer_dir

            args = self.engine.core.args
            source = args.tokenizer or self.engine.info.model_path
            if source.lower().endswith(".gguf") and Path(source).is_file():
                source = str(gguf_tokenizer_dir(Path(source)))
            self._hf_tokenizer = AutoTokenizer.from_pretrained(source, revision=args.revision)
        return self._hf_tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come in prompt order.
        `lora`: with enable_lora, the adapter name for all prompts or one name (None: the base
        model) per prompt; different adapters share the batch."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                         and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, not a batch
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(f"sampling_params: {len(params_list)} given for "
                                          f"{len(prompts)} prompts; give one or one per prompt")
        if lora is None or isinstance(lora, str):
            lora_names = [lora] * len(prompts)
        else:
            lora_names = list(lora)
            if len(lora_names) != len(prompts):
                raise InvalidRequestError(f"lora: {len(lora_names)} names given for {len(prompts)} prompts; "
                                          "give one or one per prompt")
        request_ids = []
        try:
            for prompt, params, lora_name in zip(prompts, params_list, lora_names):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params.clone(output_kind=OutputKind.FINAL_ONLY),
                                        lora_name=lora_name)
                request_ids.append(request_id)
        except Exception:
            for request_id in request_ids:  # leave the engine as we found it
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts, prompts = [], []
        for conversation in conversations:
            text = self.engine.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, chat_template=chat_template)
            texts.append(text)
            # The template already wrote any special tokens the model expects.
            prompts.append(self.engine.tokenizer.encode(text, add_special_tokens=False))
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def load_lora_adapter(self, name: str, path: str) -> Any:
        """Serve the PEFT adapter directory `path` as `name` (needs enable_lora)."""
        return self.engine.core.add_lora(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        self.engine.core.remove_lora(name)

    def update_weights(self, named_tensors: Any) -> Any:
        """Load new weights in place, without files: `named_tensors` maps HF checkpoint names to
        tensors (a dict or (name, tensor) pairs, e.g. a trainer's `state_dict()`). Call between
        generate() calls; the prefix cache is emptied. Returns a `WeightUpdate`
        (see kvik.engine.weight_sync)."""
        from kvik.engine.weight_sync import update_engine_weights

        return update_engine_weights(self.engine.core, named_tensors)

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None
              ) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`.data`), batched through the scheduler like generation."""
        return self._pool(prompts, PoolingParams(task="embed", dimensions=dimensions))

    def classify(self, prompts: Prompt | Sequence[Prompt]) -> list[PoolingRequestOutput]:
        """The classification head's logits per prompt (`.data`, one per label; a reward model's
        score is `.data[0]`)."""
        return self._pool(prompts, PoolingParams(task="classify"))

    def _pool(self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams) -> list[PoolingRequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                         and isinstance(prompts[0], int)):
            prompts = [prompts]
        request_ids = []
        try:
            for prompt in prompts:
                request_id = str(next(self._ids))
                self.engine.add_pooling_request(request_id, prompt, pooling)
                request_ids.append(request_id)
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm=False)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as progress:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        failed = [request_id for request_id in request_ids if request_id not in finished]
        if failed:
            reasons = "; ".join(self.engine.failures.pop(r, "no output") for r in failed)
            raise KvikError(f"{len(failed)} of {len(request_ids)} requests failed: {reasons}")
        return [finished[request_id] for request_id in request_ids]
