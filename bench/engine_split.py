#!/usr/bin/env python
"""Served throughput with the engine core in its own process (the default) against the engine on a
thread of the API server (`--engine-in-thread`, the layout kvik had before the split), in one run.

    python bench/engine_split.py [--model DIR] [--rounds 3] [--num-prompts 64]

Both layouts serve the same model with the same flags; rounds alternate (thread, process, thread,
process, ...) so machine noise hits both alike. Each round sends the same token-id workload (prompts
of 64-512 random tokens, 16-128 output tokens, all at once, like `kvik bench compare`'s offline
workload but through HTTP) and records total token throughput, TTFT and TPOT. Printed: per-round
figures and the median ratio process / thread for each (> 1 means the split is faster for
throughput; < 1 means lower latency for TTFT/TPOT).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from kvik.bench.load import LoadConfig
from kvik.bench.online import free_port, kvik_command, running_server
from kvik.bench.serve_load import run_serve_benchmark
from kvik.bench.stats import SLO
from kvik.bench.workloads import WorkloadSpec

LAYOUTS = {"thread": ["--engine-in-thread"], "process": []}
FIGURES = ("total_token_throughput", "p50_ttft_ms", "p50_tpot_ms")


def reference_model(root: Path) -> str:
    from kvik.model.make_model import make_model

    return str(make_model(root / "bench-model", "llama", "bench"))


def one_round(model: str, layout: str, args: argparse.Namespace, log_dir: Path, round_index: int) -> dict:
    spec = WorkloadSpec(kind="random", num_prompts=args.num_prompts, input_len_range=(64, 512),
                        output_len_range=(16, 128), seed=round_index)  # each round its own prompts
    port = free_port()
    command = kvik_command(model, port, "--kv-cache-memory", args.kv_cache_memory, *LAYOUTS[layout])
    with running_server(command, port, log_dir / f"{layout}-{round_index}.log") as url:
        config = LoadConfig(base_url=url, model="m", request_rate=float("inf"), seed=spec.seed)
        summary = run_serve_benchmark(spec, config, SLO(ttft_ms=10_000, tpot_ms=1_000), label=layout)["summary"]
    if summary["failed"]:
        raise RuntimeError(f"{layout}: {summary['failed']} request(s) failed; see {log_dir}")
    return {name: summary[name] for name in FIGURES}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the 125M reference model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--first", choices=list(LAYOUTS), default="thread",
                        help="which layout runs first in each round")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvik-split-"))
    model = args.model or reference_model(work)
    rounds: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    for index in range(args.rounds):
        for layout in sorted(LAYOUTS, key=lambda name: name != args.first):
            figures = one_round(model, layout, args, work, index)
            rounds[layout].append(figures)
            print(f"round {index + 1} {layout:<7} " + "  ".join(f"{k} {v:.1f}" for k, v in figures.items()),
                  flush=True)
    print("\nprocess / thread, median of the per-round ratios:")
    ratios = {}
    for name in FIGURES:
        per_round = [p[name] / t[name] for p, t in zip(rounds["process"], rounds["thread"]) if t[name]]
        ratios[name] = statistics.median(per_round)
        print(f"  {name:<24} {ratios[name]:.3f}  (rounds: {', '.join(f'{r:.3f}' for r in per_round)})")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
