"""`LLM.update_weights`: new weights in place, no files. After an update the engine's greedy tokens
equal those of a fresh engine loaded from the same weights saved to disk, on the CPU fast path
(oneDNN-packed linears, fused q/k/v and gate/up, compiled decode stack) and on plain PyTorch, for an
untied Llama, a tied Qwen2 and GPT-2 (Conv1D, tied head); the prefix cache never serves KV computed
with the old weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvik import LLM, SamplingParams
from kvik.core.errors import InvalidRequestError

PROMPTS = ["Hello there", "The capital of France is", "a b c d e f g h i j k l m n o p q r s t u v w",
           "Once upon a time"]
# Long enough to fill prefix-cache blocks (16 tokens each) that a second request would hit.
SHARED = "You are a helpful assistant. Answer briefly and precisely, and never make things up. "
GREEDY = SamplingParams(temperature=0, max_tokens=10)


def _perturbed_model(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The model's HF state dict with every tensor changed (what a training step would do)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.3 * param.std().clamp_min(0.05))
    return model


def _tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(params=["packed", "packed-reorder", "plain"])
def kernels(request, monkeypatch) -> str:
    """packed: written straight into oneDNN's layout; packed-reorder: assembled and packed again by
    oneDNN (the path for layouts kvik cannot address); plain: PyTorch's dense weights."""
    if request.param == "plain":
        monkeypatch.setenv("KVIK_CPU_KERNELS", "0")
    if request.param == "packed-reorder":
        from kvik.engine import weight_sync

        monkeypatch.setattr(weight_sync, "_packed_view", lambda module: None)
    return request.param


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_update_equals_a_fresh_engine_loaded_from_disk(arch: str, kernels: str, model_dir_factory,
                                                      tmp_path: Path) -> None:
    base = model_dir_factory(arch)
    llm = LLM(str(base), device="cpu", dtype="float32", show_progress=False)
    prompts = [SHARED + p for p in PROMPTS]
    before = _tokens(llm, prompts)  # fills the prefix cache with the old weights' KV
    assert llm.engine.core.kv.pool.cached

    trained = _perturbed_model(base, seed=1)
    update = llm.update_weights(trained.state_dict())
    assert update.prefix_blocks_dropped > 0 and not llm.engine.core.kv.pool.cached
    if kernels != "plain":
        assert update.repacked > 0

    saved = tmp_path / "saved"
    trained.save_pretrained(saved, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (saved / name).write_bytes((base / name).read_bytes())
    fresh = LLM(str(saved), device="cpu", dtype="float32", show_progress=False)
    expected = _tokens(fresh, prompts)
    assert expected != before, "the perturbation should change the greedy output"
    assert _tokens(llm, prompts) == expected
    # Again with the prefix cache warm from the new weights: the cached KV is the new one.
    assert _tokens(llm, prompts) == expected


def test_sampled_logprobs_follow_the_new_weights(model_dir_factory, tmp_path: Path) -> None:
    base = model_dir_factory("llama")
    llm = LLM(str(base), device="cpu", dtype="float32", show_progress=False)
    trained = _perturbed_model(base, seed=2)
    llm.update_weights(trained.state_dict().items())
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, logprobs=0)
    output = llm.generate(PROMPTS[1], params)[0].outputs[0]
    ids = llm.engine.tokenizer.encode(PROMPTS[1])
    with torch.no_grad():
        logits = trained(torch.tensor([ids + list(output.token_ids)])).logits[0]
    reference = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)
    for position, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert entry[token].logprob == pytest.approx(float(reference[position, token]), abs=1e-4)


def test_one_piece_of_a_fused_weight_alone(model_dir_factory, tmp_path: Path, monkeypatch) -> None:
    """Only k_proj of one layer changes: it lands in its rows of the packed qkv_proj."""
    base = model_dir_factory("llama")
    llm = LLM(str(base), device="cpu", dtype="float32", show_progress=False)
    trained = _perturbed_model(base, seed=4)
    name = "model.layers.1.self_attn.k_proj.weight"
    from transformers import AutoModelForCausalLM

    expected_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    expected_model.state_dict()[name].copy_(trained.state_dict()[name])
    llm.update_weights({name: trained.state_dict()[name]})
    saved = tmp_path / "saved"
    expected_model.save_pretrained(saved, safe_serialization=True)
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (saved / file).write_bytes((base / file).read_bytes())
    fresh = LLM(str(saved), device="cpu", dtype="float32", show_progress=False)
    assert _tokens(llm, PROMPTS) == _tokens(fresh, PROMPTS)

    # Where kvik cannot address the packed layout, a fused weight must come whole.
    from kvik.engine import weight_sync

    if llm.engine.core.cpu_kernels is not None:
        monkeypatch.setattr(weight_sync, "_packed_view", lambda module: None)
        with pytest.raises(InvalidRequestError, match="q, k and v together"):
            llm.update_weights({name: trained.state_dict()[name]})


def test_bad_updates_are_refused_and_the_engine_must_be_idle(model_dir_factory) -> None:
    base = model_dir_factory("llama")
    llm = LLM(str(base), device="cpu", dtype="float32", show_progress=False)
    state = _perturbed_model(base, seed=3).state_dict()
    with pytest.raises(InvalidRequestError, match="no parameter"):
        llm.update_weights({"model.layers.9.mlp.nonsense.weight": torch.zeros(1)})
    with pytest.raises(InvalidRequestError, match="shape"):
        llm.update_weights({"model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(InvalidRequestError, match="shape"):
        llm.update_weights({"model.norm.weight": torch.zeros(3)})
    llm.engine.add_request("busy", "Hello", GREEDY)
    with pytest.raises(InvalidRequestError, match="unfinished"):
        llm.update_weights(state)
    llm.engine.abort_request("busy")
    llm.update_weights(state)  # idle again: accepted
