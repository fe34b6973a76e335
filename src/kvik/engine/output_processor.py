"""After each step: append sampled tokens, detokenize, decide who finished, build `RequestOutput`s.

Stop conditions, in order: an end-of-sequence token (unless ignore_eos), a stop token id, a stop
string in the new text (cut from the text unless include_stop_str_in_output), max_tokens or the
context length. While a sequence runs, the last `len(longest stop string) - 1` characters are held
back, so streamed text never shows the start of a stop string that is then cut.
"""

from __future__ import annotations

import time

from kvik.core.outputs import CompletionOutput, Logprob, RequestOutput
from kvik.core.sampling_params import OutputKind
from kvik.core.tokenizer import Tokenizer
from kvik.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from kvik.engine.request import Request, RequestGroup, RequestStatus


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append_token(self, request: Request, token_id: int, logprobs: dict[int, Logprob] | None,
                     chosen_logprob: float | None) -> RequestStatus | None:
        """Record a sampled token; return the finished status, or None if the sequence goes on."""
        params = request.params
        if logprobs is not None:
            for token, entry in logprobs.items():
                entry.decoded_token = self.tokenizer.token_text(token)
        request.append_token(token_id, logprobs)
        if chosen_logprob is not None:
            request.cumulative_logprob += chosen_logprob
        now = time.time()
        metrics = request.group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now

        num_output = request.num_output_tokens
        may_stop = num_output >= params.min_tokens
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            return self._finish(request, RequestStatus.FINISHED_STOPPED, None)
        if may_stop and token_id in params.stop_token_ids:
            return self._finish(request, RequestStatus.FINISHED_STOPPED, token_id)
        detokenizer = self._detokenizer(request)
        delta = detokenizer.add(token_id)
        if may_stop and params.stop and delta:
            found = find_stop_string(detokenizer.text, len(delta), params.stop)
            if found is not None:
                stop, index = found
                cut = index + len(stop) if params.include_stop_str_in_output else index
                detokenizer.text = detokenizer.text[:cut]
                return self._finish(request, RequestStatus.FINISHED_STOPPED, stop, flush=False)
        if num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return self._finish(request, RequestStatus.FINISHED_LENGTH, None)
        return None

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        if request.detokenizer is None:
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens)
        return request.detokenizer

    def _finish(self, request: Request, status: RequestStatus, stop_reason: int | str | None,
                flush: bool = True) -> RequestStatus:
        if flush:
            self._detokenizer(request).flush()
        request.finish_reason = status.value
        request.stop_reason = stop_reason
        return status

    # -- building outputs --

    def make_output(self, group: RequestGroup) -> RequestOutput | None:
        """The RequestOutput for a group that changed this step, in its params' output kind."""
        kind = group.params.output_kind
        finished = group.finished
        if kind is OutputKind.FINAL_ONLY and not finished:
            return None
        outputs = []
        for request in group.sequences:
            completion = self._completion(request, delta=kind is OutputKind.DELTA)
            if completion is not None:
                outputs.append(completion)
        prompt_logprobs = group.prompt_logprobs
        if kind is OutputKind.DELTA:
            if group.prompt_logprobs_sent or (prompt_logprobs is not None and
                                              len(prompt_logprobs) < len(group.prompt_token_ids)):
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                group.prompt_logprobs_sent = True
        if finished:
            group.metrics.finished_time = time.time()
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=outputs, finished=finished,
            num_cached_tokens=group.num_cached_tokens, metrics=group.metrics,
        )

    @staticmethod
    def _visible_text(request: Request) -> str:
        text = request.detokenizer.text if request.detokenizer is not None else ""
        if not request.status.finished and request.params.stop:
            hold = max(len(s) for s in request.params.stop) - 1
            return text[:max(0, len(text) - hold)]
        return text

    def _completion(self, request: Request, delta: bool) -> CompletionOutput | None:
        text = self._visible_text(request)
        token_ids = request.output_token_ids
        logprobs = request.output_logprobs
        finish_reason = request.finish_reason if request.status.finished else None
        if not delta:
            return CompletionOutput(request.index, text, token_ids,
                                    request.cumulative_logprob if logprobs is not None else None,
                                    list(logprobs) if logprobs is not None else None, finish_reason,
                                    request.stop_reason)
        if request.final_output_sent:
            return None
        new_text = text[request.num_text_sent:]
        new_tokens = token_ids[request.num_output_tokens_sent:]
        if not new_text and not new_tokens and finish_reason is None:
            return None
        new_logprobs = logprobs[request.num_logprobs_sent:] if logprobs is not None else None
        request.num_text_sent = len(text)
        request.num_output_tokens_sent = len(token_ids)
        request.num_logprobs_sent = len(logprobs) if logprobs is not None else 0
        request.final_output_sent = finish_reason is not None
        return CompletionOutput(request.index, new_text, new_tokens,
                                request.cumulative_logprob if logprobs is not None else None,
                                new_logprobs, finish_reason, request.stop_reason)
