"""The naive baseline: FastAPI calling HF transformers `generate`, one request at a time.

This is the server the reference architecture starts from, kept deliberately simple so kvik's figures
have an honest baseline: a global lock admits one request to the model at a time (everyone else waits,
which is what makes its TTFT grow under load), `generate` runs in a worker thread so the event loop keeps
accepting and streaming, and a streamer pushes each new token id to an asyncio queue so the first chunk
leaves as soon as the first token exists. Serves /v1/completions (string or token-id prompt,
max_tokens, greedy or temperature sampling, stream with a usage chunk), /v1/models, /tokenizer_info and
/health.

    python -m kvik.bench.naive_server --model DIR --port 8001
    kvik bench naive-server --model DIR --port 8001

Heavy imports (torch, transformers, fastapi) happen inside functions: `kvik --help` imports this module.
"""

import argparse
import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the completions API


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF-format model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")


@dataclass(slots=True)
class Job:
    """One validated generation request."""

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    top_p: float


class NaiveModel:
    """An HF causal LM in float32 on the CPU, generating for one job at a time."""

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 2**31)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def generate(self, job: Job, on_token: Any, cancelled: threading.Event) -> None:
        """Run HF `generate` for `job`, calling `on_token(id)` from this thread for each new token."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        class TokenStreamer(BaseStreamer):
            # generate() first puts the whole prompt, then one tensor per step of new tokens.
            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value: Any) -> None:
                if not self.prompt_seen:
                    self.prompt_seen = True
                    return
                for token in value.reshape(-1).tolist():
                    on_token(int(token))

            def end(self) -> None:
                pass

        class StopWhenCancelled(StoppingCriteria):
            # A client that hung up should not hold the model (and the lock) until max_tokens.
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                return torch.full((input_ids.shape[0],), cancelled.is_set(), dtype=torch.bool)

        input_ids = torch.tensor([job.prompt_ids], dtype=torch.long)
        sampling = ({"do_sample": True, "temperature": job.temperature, "top_p": job.top_p, "top_k": 0}
                    if job.temperature > 0 else {"do_sample": False})
        pad = next(iter(self.eos_ids), 0)
        with torch.inference_mode():
            self.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                max_new_tokens=job.max_tokens,
                # ignore_eos: the EOS logit is masked until max_tokens, so output lengths are exact.
                min_new_tokens=job.max_tokens if job.ignore_eos else 0,
                streamer=TokenStreamer(), stopping_criteria=StoppingCriteriaList([StopWhenCancelled()]),
                pad_token_id=pad, **sampling)


class BadRequest(Exception):
    """A request the baseline cannot serve; answered with 400 and OpenAI's error envelope."""


def parse_job(body: dict[str, Any], model: NaiveModel) -> Job:
    """Validate a completions body into a Job; only the fields a benchmark sends are supported."""
    from pydantic import ValidationError

    from kvik.protocol.openai import CompletionRequest

    try:
        request = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(str(exc)) from None
    prompt: Any = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest("prompt: the naive server takes one prompt per request")
        prompt = prompt[0]
    ids = list(model.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise BadRequest("prompt: is empty")
    if max(ids) >= model.vocab_size:
        raise BadRequest(f"prompt: token id {max(ids)} is outside the vocabulary [0, {model.vocab_size})")
    if request.n != 1:
        raise BadRequest("n: only 1 is supported")
    max_tokens = DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens
    if max_tokens < 1 or len(ids) + max_tokens > model.max_len:
        raise BadRequest(f"max_tokens: {max_tokens} with a {len(ids)}-token prompt does not fit in "
                         f"{model.max_len} positions")
    temperature = 1.0 if request.temperature is None else request.temperature
    return Job(ids, max_tokens, request.ignore_eos, temperature, request.top_p or 1.0)


class NaiveServing:
    """Runs jobs one at a time and turns their tokens into OpenAI completion chunks."""

    def __init__(self, model: NaiveModel, model_name: str) -> None:
        self.model, self.model_name = model, model_name
        self.lock = asyncio.Lock()  # the whole point of the baseline: one request in the model at once
        self.background: set[asyncio.Task[None]] = set()

    async def tokens(self, job: Job) -> AsyncIterator[int]:
        """The job's new token ids as `generate` produces them (after waiting for the lock)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        cancelled = threading.Event()

        async def run() -> None:
            async with self.lock:
                if not cancelled.is_set():
                    await asyncio.to_thread(self.model.generate, job,
                                            lambda t: loop.call_soon_threadsafe(queue.put_nowait, t),
                                            cancelled)

        task = asyncio.create_task(run())
        self.background.add(task)
        # Tokens were queued by call_soon_threadsafe before the thread returned, so the end marker
        # scheduled on completion always comes after the last token.
        task.add_done_callback(lambda t: (self.background.discard(t), queue.put_nowait(None)))
        try:
            while (token := await queue.get()) is not None:
                yield token
            task.result()  # re-raise a generate failure
        finally:
            cancelled.set()  # if the client left early, generate stops at its next step

    async def completion_events(self, job: Job, stream_usage: bool) -> AsyncIterator[dict[str, Any]]:
        """One chunk per token (the last one carries finish_reason), then the usage chunk if asked."""
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str | None, finish: str | None, **extra: Any) -> dict[str, Any]:
            choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None,
                                                "finish_reason": finish}]
            return {"id": request_id, "object": "text_completion", "created": created,
                    "model": self.model_name, "choices": choices, **extra}

        generated: list[int] = []
        sent, text, last = "", "", False
        async for token in self.tokens(job):
            generated.append(token)
            stopped = token in self.model.eos_ids and not job.ignore_eos
            last = stopped or len(generated) == job.max_tokens
            text = self.model.tokenizer.decode(generated, skip_special_tokens=True)
            # Hold back a trailing partial UTF-8 character until the next token completes it.
            piece = text[len(sent):] if last or not text.endswith("\ufffd") else ""
            sent += piece
            yield chunk(piece, ("stop" if stopped else "length") if last else None)
        if generated and not last:  # generate stopped on its own (a cancel, a stop rule of the model)
            yield chunk(text[len(sent):], "stop")
        if stream_usage:
            prompt_tokens, completion_tokens = len(job.prompt_ids), len(generated)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}
            yield chunk(None, None, usage=usage)


def create_app(model: NaiveModel, model_name: str) -> Any:
    """The FastAPI app around `model`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    from kvik.protocol.errors import error_body
    from kvik.protocol.sse import DONE_FRAME, sse_frame

    serving = NaiveServing(model, model_name)
    app = FastAPI(title="kvik naive baseline (HF generate, one request at a time)")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "kvik-naive"}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return {"vocab_size": len(model.tokenizer), "model_vocab_size": model.vocab_size}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            job = parse_job(body, model)
        except (BadRequest, json.JSONDecodeError) as exc:
            return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)
        stream_usage = bool(body.get("stream") and (body.get("stream_options") or {}).get("include_usage"))
        if body.get("stream"):
            async def frames() -> AsyncIterator[bytes]:
                async for event in serving.completion_events(job, stream_usage):
                    yield sse_frame(event)
                yield DONE_FRAME

            return StreamingResponse(frames(), media_type="text/event-stream")
        events = [event async for event in serving.completion_events(job, stream_usage=True)]
        chunks, usage = events[:-1], events[-1]["usage"]
        return {"id": events[0]["id"], "object": "text_completion", "created": events[0]["created"],
                "model": model_name,
                "choices": [{"index": 0, "text": "".join(c["choices"][0]["text"] for c in chunks),
                             "logprobs": None, "finish_reason": chunks[-1]["choices"][0]["finish_reason"]}],
                "usage": usage}

    return app


def serve(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted."""
    import uvicorn

    model = NaiveModel(args.model)
    app = create_app(model, args.served_model_name or args.model)
    print(f"naive baseline serving {args.model} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvik.bench.naive_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
