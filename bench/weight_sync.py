"""Trainer -> engine weight sync: `LLM.update_weights` (in memory) against writing the weights with
save_pretrained and loading a new engine from the directory (what a sync through files costs).

    .venv/bin/python bench/weight_sync.py [--size small|bench] [--pairs 3] [--json]

Both paths start from the same trained HF model in memory and end with an engine ready to generate
on the new weights; runs alternate A B A B and the ratio is reported per pair and as the median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="kvik make-model size (small: ~3M, bench: ~125M)")
    parser.add_argument("--model", default=None, help="an existing HF model directory instead")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from kvik import LLM, SamplingParams
    from kvik.model.make_model import make_model

    scratch = Path(tempfile.mkdtemp(prefix="kvik-weight-sync-"))
    try:
        model_dir = Path(args.model) if args.model else make_model(scratch / "model", "llama", args.size)
        trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine_args = {"device": "cpu", "dtype": "float32", "show_progress": False,
                       "kv_cache_memory": 64 * 2**20}
        llm = LLM(str(model_dir), **engine_args)
        probe = SamplingParams(temperature=0, max_tokens=1)
        llm.generate("warm up", probe)
        in_memory, via_files = [], []
        for pair in range(args.pairs):
            with torch.no_grad():
                for param in trained.parameters():
                    param.mul_(1.0001)  # a training step's worth of change
            started = time.perf_counter()
            llm.update_weights(trained.state_dict())
            llm.generate("ready", probe)
            in_memory.append(time.perf_counter() - started)

            started = time.perf_counter()
            out = scratch / f"step-{pair}"
            trained.save_pretrained(out, safe_serialization=True)
            for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                if (model_dir / name).exists():
                    shutil.copyfile(model_dir / name, out / name)
            reloaded = LLM(str(out), **engine_args)
            reloaded.generate("ready", probe)
            via_files.append(time.perf_counter() - started)
            del reloaded
            shutil.rmtree(out)
        params = sum(p.numel() for p in trained.parameters())
        result = {"model": str(args.model or f"make-model llama {args.size}"), "parameters": params,
                  "update_weights_s": in_memory, "save_and_reload_s": via_files,
                  "speedup_median": statistics.median(b / a for a, b in zip(in_memory, via_files))}
        if args.json:
            print(json.dumps(result, indent=2))
            return
        print(f"{result['model']}: {params / 1e6:.1f}M parameters, {os.cpu_count()} CPUs")
        for i, (a, b) in enumerate(zip(in_memory, via_files)):
            print(f"pair {i}: update_weights {a * 1000:8.1f} ms   save+reload {b * 1000:8.1f} ms   "
                  f"x{b / a:.1f}")
        print(f"median speed-up of the in-memory sync: x{result['speedup_median']:.1f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
