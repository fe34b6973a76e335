"""`kvik data run`: clean, deduplicate, tokenize and shard a corpus (see kvik.data.pipeline);
`kvik data comparisons` and `kvik data agreement`: preference data (see kvik.data.comparisons)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "data",
        help="clean, deduplicate and tokenize a corpus into training shards; preference data",
        description="Data pipeline: normalisation, quality filters (Gopher, C4, FineWeb), PII "
                    "scrubbing, exact and MinHash near-duplicate removal, then tokenization into "
                    "binary shards with a manifest that `kvik train` reads; and preference data: "
                    "`comparisons` (validate, filter, split, version) and `agreement` reports.",
    )
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    run_parser = actions.add_parser(
        "run", help="run the pipeline",
        description="Run the pipeline from a pipeline.yaml, or from flags alone for the common "
                    "case (flags override the file).")
    run_parser.add_argument("--config", help="pipeline.yaml")
    run_parser.add_argument("--input", action="append", default=None, metavar="PATH",
                            help="input file or glob (repeatable; .jsonl, .parquet, else text; "
                                 "pkg://package/glob reads files shipped inside a package)")
    run_parser.add_argument("--text-field", default=None, help="JSONL/Parquet field with the text")
    run_parser.add_argument("--output", default=None, help="output directory")
    run_parser.add_argument("--workers", type=int, default=None,
                            help="worker processes of the local executor")
    run_parser.add_argument("--tokenizer", default=None,
                            help="existing HF tokenizer directory (default: train a BPE tokenizer)")
    run_parser.add_argument("--vocab-size", type=int, default=None,
                            help="vocabulary of the trained tokenizer")
    run_parser.add_argument("--val-fraction", type=float, default=None,
                            help="fraction of documents held out for validation")
    run_parser.add_argument("--executor", choices=("local", "ray"), default="local",
                            help="where cleaning and deduplication run: worker processes here "
                                 "(local) or a Ray cluster (ray, needs kvik[ray] on every node); "
                                 "the outputs are the same bytes either way")
    run_parser.add_argument("--ray-address", default=None, metavar="ADDRESS",
                            help="Ray cluster to join, e.g. 10.0.0.5:6379 (default: $RAY_ADDRESS, "
                                 "else the latest cluster started here, else a new local one)")
    run_parser.add_argument("--dedup-shards", type=int, default=None, metavar="N",
                            help="ray: actors each dedup index is split into, exact by digest and "
                                 "near by MinHash band (default: one per node)")
    run_parser.add_argument("--no-tokenize", action="store_true",
                            help="stop after cleaning (documents.jsonl, dropped.jsonl, report)")
    run_parser.add_argument("--quiet", action="store_true", help="no progress bar")
    run_parser.set_defaults(func=run)
    _register_comparisons(actions)


def _register_comparisons(actions: argparse._SubParsersAction) -> None:
    prepare = actions.add_parser(
        "comparisons", help="validate, filter, split and version a comparisons JSONL file",
        description="Check every line of a comparisons file (prompt, responses, annotators' choices "
                    "or rankings), drop or flag items whose annotators disagree, split by prompt "
                    "into train/val, and write the splits with a manifest (content hash) and an "
                    "agreement report, for `kvik train` tasks reward, dpo and ppo.")
    prepare.add_argument("input", help="comparisons JSONL")
    prepare.add_argument("--output", required=True, help="output directory")
    prepare.add_argument("--val-fraction", type=float, default=0.1,
                         help="fraction of prompts held out (default 0.1)")
    prepare.add_argument("--seed", type=int, default=0, help="seed of the split (default 0)")
    prepare.add_argument("--min-labels", type=int, default=1,
                         help="items with fewer labels are low-agreement (default 1)")
    prepare.add_argument("--min-agreement", type=float, default=0.0,
                         help="items whose annotators agree with their majority less than this "
                              "fraction are low-agreement (default 0: keep all with a majority)")
    prepare.add_argument("--low-agreement", choices=("drop", "flag"), default="drop",
                         help="drop low-agreement items (to dropped.jsonl) or keep them flagged")
    prepare.set_defaults(func=run_comparisons)
    agreement = actions.add_parser(
        "agreement", help="inter-annotator agreement of a comparisons file, with a chart",
        description="Cohen's kappa per annotator pair, Fleiss' kappa and Krippendorff's alpha "
                    "(nominal, missing labels allowed), agreement of each annotator with the "
                    "others' majority and a confusion table; writes agreement.{txt,json,png}.")
    agreement.add_argument("input", help="comparisons JSONL")
    agreement.add_argument("--output", default=None,
                           help="directory for the report (default: beside the input)")
    agreement.set_defaults(func=run_agreement)


def run_comparisons(args: argparse.Namespace) -> int:
    from kvik.data.comparisons import ComparisonsConfig, prepare_comparisons

    result = prepare_comparisons(ComparisonsConfig(
        input=args.input, output_dir=args.output, val_fraction=args.val_fraction, seed=args.seed,
        min_labels=args.min_labels, min_agreement=args.min_agreement,
        low_agreement=args.low_agreement))
    manifest = result.manifest
    for name, split in manifest["splits"].items():
        print(f"{name:<6}{split['items']:>8} items {split['pairs']:>8} pairs")
    for reason, count in manifest["dropped"].items():
        print(f"dropped {count} ({reason})")
    print((result.output_dir / "agreement.txt").read_text(), end="")
    print(f"version {manifest['version']}; wrote {result.output_dir}")
    return 0


def run_agreement(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvik.core.comparisons import read_comparisons
    from kvik.data.agreement import measure_agreement, report_text, write_agreement_report

    source = Path(args.input)
    out = Path(args.output) if args.output else source.parent
    report = measure_agreement(read_comparisons(source))
    write_agreement_report(report, out)
    print(report_text(report), end="")
    print(f"wrote {out / 'agreement.txt'}, agreement.json, agreement.png")
    return 0


def _overrides(args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    """Flags as config keys; nested sections are merged, not replaced."""
    out: dict[str, Any] = {}
    if args.input:
        field = {"text_field": args.text_field} if args.text_field else {}
        out["inputs"] = [{"path": path, **field} for path in args.input]
    if args.output:
        out["output_dir"] = args.output
    if args.workers:
        out["workers"] = args.workers
    tokenizer = dict(base.get("tokenizer") or {})
    if args.tokenizer:
        tokenizer["path"] = args.tokenizer
    if args.vocab_size:
        tokenizer["vocab_size"] = args.vocab_size
    if tokenizer:
        out["tokenizer"] = tokenizer
    if args.val_fraction is not None:
        out["shards"] = {**(base.get("shards") or {}), "val_fraction": args.val_fraction}
    return out


def run(args: argparse.Namespace) -> int:
    from kvik.data.config import pipeline_config_from_dict, read_config_file
    from kvik.data.executors import ExecutorSpec
    from kvik.data.pipeline import run_pipeline

    base = read_config_file(args.config) if args.config else {}
    config = pipeline_config_from_dict({**base, **_overrides(args, base)})
    executor = ExecutorSpec(args.executor, ray_address=args.ray_address, dedup_shards=args.dedup_shards)
    result = run_pipeline(config, tokenize=not args.no_tokenize, progress=not args.quiet,
                          executor=executor)
    print((result.output_dir / "report.txt").read_text(), end="")
    print(f"wrote {result.output_dir}")
    return 0
