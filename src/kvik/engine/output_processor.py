"""The front end's half of generation: turn the core's token ids into text and `RequestOutput`s.

For every sequence the core reports, in order: record the new tokens and their logprobs (with each
token's text), detokenize incrementally, look for stop strings in the new text (cut from the text
unless include_stop_str_in_output; only after min_tokens), and finish the sequence when the core
finished it (end of sequence, stop token id, max_tokens, context length) or a stop string did. A
sequence stopped by a stop string is still running in the core: its (request id, index) is returned
so the caller aborts it there. While a sequence runs, the last `len(longest stop string) - 1`
characters are held back, so streamed text never shows the start of a stop string that is then cut.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvik.core.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestMetrics, RequestOutput
from kvik.core.sampling_params import OutputKind, SamplingParams
from kvik.core.tokenizer import Tokenizer
from kvik.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from kvik.engine.messages import EngineCoreOutput, TokenLogprobs


@dataclass(slots=True, eq=False)
class SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_sent: int = 0
    num_text_sent: int = 0
    num_logprobs_sent: int = 0
    final_sent: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    sequences: list[SequenceState]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    # Traced requests (kvik.engine.request_spans) time their detokenization, in seconds.
    traced: bool = False
    detokenize_seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)


@dataclass(slots=True, eq=False)
class PoolingState:
    request_id: str
    prompt_token_ids: list[int]
    metrics: RequestMetrics


@dataclass(slots=True)
class ProcessedOutputs:
    outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    # Sequences a stop string finished here while the core still runs them: abort them there.
    aborts: list[tuple[str, int]] = field(default_factory=list)
    # Requests the core failed (a step raised): (request id, message).
    failures: list[tuple[str, str]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState | PoolingState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> RequestState:
        detokenizers = [IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                        for _ in range(params.n)]
        state = RequestState(request_id, prompt, prompt_token_ids, params,
                             RequestMetrics(arrival_time=arrival_time),
                             [SequenceState(i, d) for i, d in enumerate(detokenizers)])
        self.requests[request_id] = state
        return state

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int], arrival_time: float
                            ) -> PoolingState:
        state = PoolingState(request_id, prompt_token_ids, RequestMetrics(arrival_time=arrival_time))
        self.requests[request_id] = state
        return state

    def abort_request(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- core outputs in --

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        changed: dict[str, RequestState] = {}
        now = time.time()
        for core in core_outputs:
            state = self.requests.get(core.request_id)
            if state is None:
                continue  # aborted here while the core was stepping
            if core.error is not None:
                result.failures.append((core.request_id, core.error))
                del self.requests[core.request_id]
                changed.pop(core.request_id, None)
                continue
            if isinstance(state, PoolingState):
                if core.pooled is not None:
                    metrics = state.metrics
                    metrics.first_scheduled_time = core.first_scheduled_time
                    metrics.finished_time = now
                    result.outputs.append(PoolingRequestOutput(
                        state.request_id, state.prompt_token_ids, core.pooled, core.num_cached_tokens,
                        metrics))
                    del self.requests[core.request_id]
                continue
            changed[core.request_id] = state
            state.num_cached_tokens = core.num_cached_tokens
            if core.first_scheduled_time is not None:
                state.metrics.first_scheduled_time = core.first_scheduled_time
            if core.prompt_logprobs is not None:
                state.prompt_logprobs = [None if e is None else self._entry(e) for e in core.prompt_logprobs]
            sequence = state.sequences[core.index]
            if sequence.finished:
                continue  # a stop string ended it; the core had not heard yet
            if state.traced:
                started = time.perf_counter()
                self._append(state, sequence, core, now)
                state.detokenize_seconds += time.perf_counter() - started
            else:
                self._append(state, sequence, core, now)
            if sequence.finished and core.finish_reason is None:
                result.aborts.append((core.request_id, core.index))
        for request_id, state in changed.items():
            output = self._make_output(state)
            if output is not None:
                result.outputs.append(output)
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[request_id]
        return result

    def _append(self, state: RequestState, sequence: SequenceState, core: EngineCoreOutput,
                now: float) -> None:
        params = state.params
        metrics = state.metrics
        for position, token_id in enumerate(core.new_token_ids):
            sequence.token_ids.append(token_id)
            if core.new_logprobs is not None:
                entry = core.new_logprobs[position]
                if sequence.logprobs is None:
                    sequence.logprobs = []
                sequence.logprobs.append(self._entry(entry))
                sequence.cumulative_logprob += entry.logprobs[0]
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if core.finish_reason == "stop" and position == len(core.new_token_ids) - 1:
                break  # an end-of-sequence or stop token ends the text without adding to it
            delta = sequence.detokenizer.add(token_id)
            if params.stop and delta and len(sequence.token_ids) >= params.min_tokens:
                detokenizer = sequence.detokenizer
                found = find_stop_string(detokenizer.text, len(delta), params.stop)
                if found is not None:
                    stop, index = found
                    detokenizer.text = detokenizer.text[:index + len(stop) if params.include_stop_str_in_output
                                                         else index]
                    sequence.finish_reason, sequence.stop_reason = "stop", stop
                    return
        if core.finish_reason is not None:
            sequence.detokenizer.flush()
            sequence.finish_reason, sequence.stop_reason = core.finish_reason, core.stop_reason

    def _entry(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        text = self.tokenizer.token_text
        return {token: Logprob(value, rank, text(token))
                for token, value, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)}

    # -- RequestOutputs out --

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind is OutputKind.FINAL_ONLY and not finished:
            return None
        outputs = []
        for sequence in state.sequences:
            completion = self._completion(state, sequence, delta=kind is OutputKind.DELTA)
            if completion is not None:
                outputs.append(completion)
        prompt_logprobs = state.prompt_logprobs
        if kind is OutputKind.DELTA:
            if state.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=outputs, finished=finished,
            num_cached_tokens=state.num_cached_tokens, metrics=state.metrics,
        )

    @staticmethod
    def _visible_text(state: RequestState, sequence: SequenceState) -> str:
        text = sequence.detokenizer.text
        if not sequence.finished and state.params.stop:
            hold = max(len(s) for s in state.params.stop) - 1
            return text[:max(0, len(text) - hold)]
        return text

    def _completion(self, state: RequestState, sequence: SequenceState, delta: bool
                    ) -> CompletionOutput | None:
        text = self._visible_text(state, sequence)
        token_ids, logprobs = sequence.token_ids, sequence.logprobs
        cumulative = sequence.cumulative_logprob if logprobs is not None else None
        if not delta:
            return CompletionOutput(sequence.index, text, list(token_ids), cumulative,
                                    list(logprobs) if logprobs is not None else None,
                                    sequence.finish_reason, sequence.stop_reason)
        if sequence.final_sent:
            return None
        new_text = text[sequence.num_text_sent:]
        new_tokens = token_ids[sequence.num_tokens_sent:]
        if not new_text and not new_tokens and sequence.finish_reason is None:
            return None
        new_logprobs = logprobs[sequence.num_logprobs_sent:] if logprobs is not None else None
        sequence.num_text_sent = len(text)
        sequence.num_tokens_sent = len(token_ids)
        sequence.num_logprobs_sent = len(logprobs) if logprobs is not None else 0
        sequence.final_sent = sequence.finished
        return CompletionOutput(sequence.index, new_text, new_tokens, cumulative, new_logprobs,
                                sequence.finish_reason, sequence.stop_reason)
