"""`kvik make-model`: write a random-weight HF-format model directory for tests, demos and benchmarks."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvik.model.make_model import ARCHITECTURES, SIZES

    parser = subparsers.add_parser(
        "make-model",
        help="write a random-weight model directory in HF format",
        description="Write a random-weight model (config.json, model.safetensors, tokenizer.json, "
                    "tokenizer_config.json with a chat template) that HF transformers and kvik load.",
    )
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--size", choices=list(SIZES), default="tiny",
                        help="tiny: tests; small: demos; bench: the 125M benchmark reference model; "
                             "1b: a Llama-3.2-1B shape (1.1B parameters) for GPU benchmarks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--max-shard-size", default=None,
                        help="split the weights into shards of this size with an index (e.g. 200KB)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvik.model.make_model import make_model

    path = make_model(args.out_dir, args.arch, args.size, seed=args.seed, dtype=args.dtype,
                      max_shard_size=args.max_shard_size)
    print(f"wrote a random-weight {args.arch} ({args.size}) model to {path}")
    return 0
