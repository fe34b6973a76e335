"""Entry point of the `kvik` command.

Each subcommand lives in its own module with a `register(subparsers)` function that adds its parser
and sets `func`. Registration must stay cheap: heavy imports (torch, fastapi) happen inside `func`,
so `kvik --help` and `kvik gateway` never load torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown by `kvik --help`.
SUBCOMMAND_MODULES = [
    "kvik.cli.serve",
    "kvik.cli.generate",
    "kvik.cli.make_model",
    "kvik.cli.gateway",
    "kvik.cli.bench",
    "kvik.cli.data",
    "kvik.cli.train",
    "kvik.cli.build_kernels",
    "kvik.cli.label",
    "kvik.cli.eval",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvik",
        description="kvik: paged-KV LLM engine, OpenAI-compatible server and gateway.",
    )
    from kvik import __version__

    parser.add_argument("--version", action="version", version=f"kvik {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # subcommand not part of this build
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    from kvik.core.errors import ConfigError

    try:
        result = args.func(args)
    except ConfigError as exc:
        print(f"kvik {args.command}: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
