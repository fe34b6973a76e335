"""`bench/train_draft.py` end to end on the tiny model: the target answers prompts, `kvik data` shards
the transcripts and copy documents with the target's tokenizer, `kvik train` trains the cut-down
target, and the engine speculates with the result (greedy output unchanged)."""

from __future__ import annotations

import json

from tests.bench.scripts import run_bench_script


def test_train_draft_makes_a_draft_the_engine_speculates_with(tiny_llama, tmp_path):
    work = tmp_path / "work"
    result = run_bench_script("train_draft.py", "--model", str(tiny_llama), "--layers", "1", "--prompts", "6",
                              "--max-tokens", "12", "--copies", "12", "--steps", "2", "--work", str(work),
                              timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    draft = work / "draft"
    config = json.loads((draft / "config.json").read_text())
    target = json.loads((tiny_llama / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and target["num_hidden_layers"] == 2
    assert config["vocab_size"] == target["vocab_size"] and config["hidden_size"] == target["hidden_size"]
    assert (draft / "tokenizer.json").read_bytes() == (tiny_llama / "tokenizer.json").read_bytes()
    documents = [json.loads(line)["text"] for line in (work / "documents.jsonl").read_text().splitlines()]
    assert sum("<|im_start|>assistant" in d for d in documents) == 6
    assert any("copied exactly" in d for d in documents) and any("unchanged:" in d for d in documents)

    from kvik import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "the same words again and again and again"
    plain = LLM(str(tiny_llama), show_progress=False).generate(prompt, params)[0].outputs[0].token_ids
    speculating = LLM(str(tiny_llama), show_progress=False, speculative_method="draft",
                      speculative_model=str(draft), num_speculative_tokens=3)
    assert speculating.generate(prompt, params)[0].outputs[0].token_ids == plain
    assert speculating.engine.stats().spec_decode_num_draft_tokens > 0


def test_train_draft_refuses_bad_flags(tiny_llama, tmp_path):
    result = run_bench_script("train_draft.py", "--model", str(tiny_llama), "--layers", "2", "--work", str(tmp_path))
    assert result.returncode != 0 and "--layers must be 1 to 1" in result.stderr + result.stdout
    result = run_bench_script("train_draft.py", "--steps", "0", timeout=60)
    assert result.returncode == 2 and "--steps" in result.stderr and "Traceback" not in result.stderr
