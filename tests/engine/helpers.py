"""Small constructors for engine unit tests (no model needed)."""

from __future__ import annotations

from kvik.core.sampling_params import SamplingParams
from kvik.engine.request import Request, RequestGroup

_counter = iter(range(10**9))


def make_request(prompt: list[int], params: SamplingParams | None = None, outputs: list[int] = (),
                 request_id: str | None = None, index: int = 0) -> Request:
    params = params or SamplingParams()
    request_id = request_id or f"r{next(_counter)}"
    group = RequestGroup(request_id, list(prompt), params, arrival_time=0.0)
    request = Request(seq_id=f"{request_id}#{index}", group=group, index=index, params=params,
                      max_tokens=params.max_tokens or 10**6, all_token_ids=list(prompt) + list(outputs),
                      num_prompt_tokens=len(prompt), arrival_order=next(_counter))
    group.sequences.append(request)
    return request
