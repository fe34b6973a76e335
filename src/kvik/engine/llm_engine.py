"""`LLMEngine`: the synchronous engine for the offline API, with the core in the caller's thread.

`add_request`, then `step()` until done. A step runs the core (schedule, model, sample) and then the
front end's output processing (detokenize, stop strings) on its outputs; sequences that a stop
string ended are aborted in the core before the next step. The server uses the same pieces with the
core in its own process (`kvik.engine.async_llm`).

Not thread-safe: the caller's thread drives it.
"""

from __future__ import annotations

import time

from kvik.core.config import EngineArgs
from kvik.core.errors import InvalidRequestError
from kvik.core.outputs import PoolingRequestOutput, RequestOutput
from kvik.core.pooling_params import PoolingParams
from kvik.core.sampling_params import SamplingParams
from kvik.core.tokenizer import Tokenizer
from kvik.engine.core import EngineCore
from kvik.engine.input_processor import InputProcessor
from kvik.engine.messages import EngineStats
from kvik.engine.output_processor import OutputProcessor


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.core = EngineCore(args)
        self.info = self.core.info()
        self.tokenizer = Tokenizer(self.info.tokenizer)
        self.input_processor = InputProcessor(self.info, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        # request id -> why the core ended it with an error (a failed grammar, an adapter that could
        # not be reloaded); such requests produce no output.
        self.failures: dict[str, str] = {}

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, lora_name: str | None = None) -> None:
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        arrival_time = arrival_time or time.time()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.input_processor.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        request = self.input_processor.make_request(request_id, token_ids, params, arrival_time,
                                                    lora_name=lora_name)
        self.core.add_request(request)
        self.output_processor.add_request(request_id, text, token_ids, params, arrival_time)

    def add_pooling_request(self, request_id: str, prompt: str | list[int], pooling: PoolingParams,
                            arrival_time: float | None = None) -> None:
        """Queue a prompt to embed or classify; its `PoolingRequestOutput` comes from `step()`."""
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        arrival_time = arrival_time or time.time()
        token_ids = self.input_processor.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        request = self.input_processor.make_pooling_request(request_id, token_ids, pooling, arrival_time)
        self.core.add_request(request)
        self.output_processor.add_pooling_request(request_id, token_ids, arrival_time)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        known = self.output_processor.abort_request(request_id)
        return self.core.abort(request_id) or known

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        processed = self.output_processor.process(self.core.step())
        self.failures.update(processed.failures)
        for request_id, index in processed.aborts:
            self.core.abort(request_id, index)
        return processed.outputs

    def stats(self) -> EngineStats:
        return self.core.stats()
