"""`kvik eval`: win rate of a policy against a reference judged by a reward model, and
lm-evaluation-harness tasks against a running `kvik serve`."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="evaluate models: reward-model win rate, lm-evaluation-harness",
        description="Evaluate trained models.")
    actions = parser.add_subparsers(dest="eval_command", metavar="ACTION", required=True)
    winrate = actions.add_parser(
        "winrate", help="how often a reward model prefers the policy's answers to the reference's",
        description="Both models answer the same held-out prompts (a model directory runs on "
                    "kvik's engine; an http(s) URL is an OpenAI-compatible server such as `kvik "
                    "serve`); the reward model scores every answer. Prints the win rate (ties "
                    "count half) with a 95%% Wilson interval.")
    winrate.add_argument("--policy", required=True, help="model directory or server URL")
    winrate.add_argument("--reference", required=True, help="model directory or server URL")
    winrate.add_argument("--reward-model", required=True, help="`kvik train` task reward output")
    winrate.add_argument("--prompts", required=True,
                         help='JSONL with a "prompt" per line, or a `kvik data comparisons` '
                              "directory (its val split is used)")
    winrate.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    winrate.add_argument("--max-tokens", type=int, default=64)
    winrate.add_argument("--temperature", type=float, default=0.0,
                         help="0 (default): greedy answers")
    winrate.add_argument("--seed", type=int, default=0)
    winrate.add_argument("--output", default=None,
                         help="directory for winrate.json and every scored answer")
    winrate.set_defaults(func=run_winrate)
    harness = actions.add_parser(
        "lm-eval", help="lm-evaluation-harness tasks against a running kvik serve",
        description="Run lm-evaluation-harness tasks through its local-completions client against "
                    "an OpenAI-compatible server (kvik serve). Needs `pip install 'kvik[eval]'`; "
                    "hub-hosted task data needs network access, local task YAMLs "
                    "(--include-path) do not.")
    harness.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    harness.add_argument("--model", required=True, help="the served model name")
    harness.add_argument("--tokenizer", required=True,
                         help="the model's tokenizer directory (requests are sent as token ids)")
    harness.add_argument("--tasks", required=True, help="comma-separated task names")
    harness.add_argument("--include-path", default=None, help="directory of extra task YAMLs")
    harness.add_argument("--limit", type=int, default=None, help="at most this many documents per task")
    harness.add_argument("--num-concurrent", type=int, default=1)
    harness.add_argument("--output", default=None, help="write the results JSON here")
    harness.set_defaults(func=run_lm_eval)


def run_lm_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from kvik.train.harness import run_harness

    results = run_harness(args.base_url, args.model, args.tokenizer,
                          [t for t in args.tasks.split(",") if t], include_path=args.include_path,
                          limit=args.limit, num_concurrent=args.num_concurrent)
    for task, metrics in results["results"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, (int, float)))
        print(f"{task}: {shown}")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


def _held_out_prompts(path: str) -> list[str]:
    import json
    from pathlib import Path

    from kvik.core.comparisons import MANIFEST, read_comparisons
    from kvik.train.rollouts import read_prompts

    directory = Path(path)
    if directory.is_dir() and (directory / MANIFEST).is_file():
        manifest = json.loads((directory / MANIFEST).read_text())
        items = read_comparisons(directory / manifest["splits"]["val"]["file"])
        return list(dict.fromkeys(item.prompt for item in items))
    return read_prompts(path)


def run_winrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvik.train.evaluate import evaluate_win_rate

    prompts = _held_out_prompts(args.prompts)[:args.limit]
    result = evaluate_win_rate(args.policy, args.reference, args.reward_model, prompts,
                               max_tokens=args.max_tokens, temperature=args.temperature,
                               seed=args.seed, out_dir=Path(args.output) if args.output else None)
    low, high = result.interval
    print(f"win rate {result.win_rate:.3f} (95% CI {low:.3f}-{high:.3f}) over {result.prompts} "
          f"prompts: {result.wins} wins, {result.ties} ties, {result.losses} losses; mean reward "
          f"policy {result.policy_mean_reward:.3f}, reference {result.reference_mean_reward:.3f}")
    return 0
