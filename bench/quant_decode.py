#!/usr/bin/env python
"""Weight formats (float32, bfloat16, int8, int8 per output channel, int4) and KV cache dtypes side by
side, in one run.

    python bench/quant_decode.py                            # the 125M reference model, 3 rounds
    python bench/quant_decode.py --rounds 2 --decode-tokens 64
    python bench/quant_decode.py --quality-model DIR        # + KV agreement on a trained model
    python bench/quant_decode.py --model SmolLM2.Q4_1.gguf --formats float32,checkpoint,int4 --skip-kv

Single-stream decode tok/s and the bytes a step reads (a greedy step of a float32 or bfloat16
model reads its LM head's int8 copy: kvik.model.transforms.screened_head) as a fraction of the paired
read bandwidth (a read after every step) and of the STREAM read (steps in runs of 8, then reads of a
buffer of 4x the last-level cache or more), 512-token prompt tok/s, ratios to float32; KV tokens per GiB and
concurrent 1k-token sequences at a fixed budget. Writes the reference model (`kvik make-model
--size bench`) on first use; the quality model defaults to the trained Shakespeare demo (`kvik
train demo`) when there is one.
"""

from __future__ import annotations

import argparse
import sys

from kvik.bench.quant import DEFAULT_FORMATS, KV_DTYPES, WEIGHT_FORMATS, QuantBenchConfig, run
from kvik.cli.bench import reference_model_path
from kvik.core.config import parse_bytes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the 125M reference model)")
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                        help=f"weight formats, comma-separated, of {', '.join(WEIGHT_FORMATS)} (checkpoint: "
                             "a pre-quantized checkpoint's int4 layers as stored)")
    parser.add_argument("--skip-kv", action="store_true", help="weights only: no KV cache capacity figures")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--kv-budget", type=parse_bytes, default=2**30, help="KV budget for the capacity figure")
    parser.add_argument("--quality-model", default=None,
                        help="trained model for KV agreement (default: the Shakespeare demo if trained)")
    parser.add_argument("--json", default="bench-results/quant.json", help="write the results here")
    args = parser.parse_args(argv)
    quality = args.quality_model
    if quality is None:
        from kvik.train.demo import trained_demo_model_path

        demo = trained_demo_model_path()
        quality = str(demo) if demo else None
    config = QuantBenchConfig(model=args.model or reference_model_path(), formats=tuple(args.formats.split(",")),
                              rounds=args.rounds, decode_tokens=args.decode_tokens, prompt_len=args.prompt_len,
                              kv_budget=args.kv_budget, quality_model=quality, out=args.json,
                              kv_dtypes=() if args.skip_kv else KV_DTYPES)
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
