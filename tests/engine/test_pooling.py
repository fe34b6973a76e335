"""Pooling through the engine (embeddings, classification) against independent references:
sentence-transformers on the real all-MiniLM-L6-v2 weights, and HF transformers' own forward for
decoder embeddings and a Llama reward model. Pooling requests share the scheduler with generation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvik import LLM, SamplingParams
from kvik.core.errors import InvalidRequestError
from kvik.core.pooling_params import PoolingParams
from tests.pooling_models import make_matryoshka_bert, make_reward_model, minilm_path

TEXTS = [
    "A man is eating food.",
    "Paged attention keeps the KV cache in fixed-size blocks, so memory is not wasted on padding "
    "and many sequences can share a prompt's blocks through the prefix cache.",
    "Ünïcödé, emoji 🙂 and punctuation?!",
    "short",
    "The quick brown fox jumps over the lazy dog. " * 8,
]


def cosine(a: list[float] | torch.Tensor, b: list[float] | torch.Tensor) -> float:
    return F.cosine_similarity(torch.as_tensor(a, dtype=torch.float64),
                               torch.as_tensor(b, dtype=torch.float64), dim=0).item()


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM(str(minilm_path()), show_progress=False)


def test_minilm_equals_sentence_transformers(minilm):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    reference = sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu")
    expected = reference.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    got = minilm.embed(TEXTS)
    assert minilm.engine.info.max_model_len == reference.max_seq_length == 256
    for output, row in zip(got, expected):
        assert len(output.data) == 384
        assert cosine(output.data, row) >= 1 - 1e-5
        assert torch.allclose(torch.tensor(output.data), row.float(), atol=1e-5)
        assert abs(torch.tensor(output.data).norm().item() - 1) < 1e-5  # modules.json has Normalize


def test_minilm_batch_of_mixed_lengths_equals_one_at_a_time(minilm):
    batched = minilm.embed(TEXTS)
    for text, output in zip(TEXTS, batched):
        alone = minilm.embed(text)[0]
        assert alone.prompt_token_ids == output.prompt_token_ids
        assert cosine(alone.data, output.data) >= 1 - 1e-6
        assert torch.allclose(torch.tensor(alone.data), torch.tensor(output.data), atol=1e-6)


def test_encoder_refuses_generation_and_too_long_input(minilm):
    with pytest.raises(InvalidRequestError, match="does not support text generation"):
        minilm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="maximum context length is 256"):
        minilm.embed([1] * 257)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        minilm.embed("hello", dimensions=128)  # MiniLM is not a Matryoshka model
    assert len(minilm.embed([101] * 256)[0].data) == 384  # exactly the context: allowed
    stats = minilm.engine.stats()  # an encoder has no KV blocks at all
    assert stats.num_blocks == 0 and stats.kv_cache_usage == 0.0 and stats.prompt_tokens > 0


@torch.no_grad()
def test_decoder_last_token_embeddings_equal_hf(model_dir_factory):
    import transformers

    path = model_dir_factory("llama")
    reference = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    # A small token budget chunks the 60-token prompt over several steps; the repeat hits the
    # prefix cache. Last-token pooling is exact either way.
    llm = LLM(str(path), max_num_batched_tokens=16, max_model_len=256, show_progress=False)
    prompts = [list(range(3, 63)), [7, 8, 9], list(range(3, 63))]
    outputs = llm.embed(prompts)
    assert llm.engine.stats().prefix_cache_hits > 0
    for prompt, output in zip(prompts, outputs):
        hidden = reference(torch.tensor([prompt])).last_hidden_state[0, -1]
        assert cosine(output.data, hidden) >= 1 - 1e-5
        assert torch.allclose(torch.tensor(output.data), F.normalize(hidden, dim=0), atol=1e-5)


def test_pooling_and_generation_share_steps_without_changing_tokens(model_dir_factory):
    path = model_dir_factory("llama")
    llm = LLM(str(path), max_model_len=256, show_progress=False)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], greedy)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("gen", [5, 6, 7, 8], greedy.clone())
    for index in range(3):
        engine.add_pooling_request(f"emb{index}", list(range(10, 30 + index)), PoolingParams(task="embed"))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["gen"].outputs[0].token_ids == alone
    assert all(len(finished[f"emb{i}"].data) == 64 for i in range(3))
    with pytest.raises(InvalidRequestError, match="does not support classification"):
        llm.classify("hello")


@torch.no_grad()
def test_reward_model_scores_equal_hf(tmp_path):
    import transformers

    pad = 0
    path = make_reward_model(tmp_path / "reward", pad_token_id=pad)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), show_progress=False)
    assert llm.engine.info.tasks == ["classify"] and llm.engine.info.pooling.labels == ["LABEL_0"]
    # Trailing pad tokens: HF scores the last token that is not padding.
    prompts = [[5, 9, 33, 41, 7], [12, 13], [5, 9, 33, pad, pad], list(range(20, 120))]
    outputs = llm.classify(prompts)
    for prompt, output in zip(prompts, outputs):
        expected = reference(torch.tensor([prompt])).logits[0]
        assert len(output.data) == 1
        assert torch.allclose(torch.tensor(output.data), expected, atol=1e-4), (output.data, expected)
    assert outputs[0].data != outputs[1].data
    with pytest.raises(InvalidRequestError, match="does not support text generation"):
        llm.generate("hello")
    with pytest.raises(InvalidRequestError, match="does not support embeddings"):
        llm.embed("hello")


@torch.no_grad()
def test_matryoshka_truncates_and_renormalises(tmp_path):
    import transformers

    path = make_matryoshka_bert(tmp_path / "bert", [16, 32])
    reference = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), show_progress=False)
    text = "Matryoshka embeddings keep their meaning when cut short."
    ids = llm.engine.tokenizer.encode(text)
    mean = reference(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
    full, short = llm.embed(text)[0], llm.embed(text, dimensions=16)[0]
    assert torch.allclose(torch.tensor(full.data), F.normalize(mean, dim=0), atol=1e-5)
    assert torch.allclose(torch.tensor(short.data), F.normalize(mean[:16], dim=0), atol=1e-5)
    with pytest.raises(InvalidRequestError, match="allows 16, 32"):
        llm.embed(text, dimensions=12)
