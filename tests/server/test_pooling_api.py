"""/v1/embeddings and /classify on real `kvik serve` processes, through the official openai SDK:
the real all-MiniLM-L6-v2 against sentence-transformers, a Llama reward model against HF, and every
kind of bad input answered with a 4xx in OpenAI's error shape."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.pooling_models import make_reward_model, minilm_path
from tests.server.conftest import metric_value

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
         "Ünïcödé and emoji 🙂", "kvik " * 40]


@pytest.fixture(scope="module")
def minilm_server(server_factory):
    # A small sequence limit makes a long input list go through the engine in windows.
    return server_factory("--max-model-len", "256", "--max-num-seqs", "4", model_dir=minilm_path(),
                          name="minilm")


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory):
    return make_reward_model(tmp_path_factory.mktemp("reward") / "model", pad_token_id=0)


@pytest.fixture(scope="module")
def reward_server(server_factory, reward_path):
    return server_factory("--max-model-len", "256", model_dir=reward_path, name="reward")


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_embeddings_equal_sentence_transformers(minilm_server):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    reference = sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu")
    expected = reference.encode(TEXTS, convert_to_tensor=True)
    sdk = client(minilm_server)
    as_base64 = sdk.embeddings.create(model="minilm", input=TEXTS)  # the SDK asks for base64
    as_floats = sdk.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    tokens = reference.tokenizer(TEXTS)["input_ids"]
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == sum(map(len, tokens))
    assert [d.index for d in as_floats.data] == list(range(len(TEXTS)))
    for row, by_base64, by_float in zip(expected, as_base64.data, as_floats.data):
        assert_same_vector(by_base64.embedding, by_float.embedding)
        cosine = F.cosine_similarity(torch.tensor(by_float.embedding, dtype=torch.float64), row.double(), dim=0)
        assert cosine.item() >= 1 - 1e-5
    # Token ids in, the same vectors out.
    by_ids = sdk.embeddings.create(model="minilm", input=tokens, encoding_format="float")
    for by_id, by_text in zip(by_ids.data, as_floats.data, strict=True):
        assert_same_vector(by_id.embedding, by_text.embedding)


def assert_same_vector(got: list[float], want: list[float]) -> None:
    """Equal up to float32 rounding. Not bit-equal: an input's vector depends in its last bits on
    which other inputs share its engine step (the GEMMs block by row count), and a request's inputs
    reach the engine loop one message at a time, so two identical requests may be batched apart.
    A wrong decoding (byte order, width) or a different input is off by orders of magnitude more."""
    assert len(got) == len(want)
    worst = (torch.tensor(got, dtype=torch.float64) - torch.tensor(want, dtype=torch.float64)).abs().max().item()
    assert worst <= 1e-6, worst


def test_base64_is_little_endian_float32(minilm_server):
    body = httpx.post(f"{minilm_server.base_url}/embeddings",
                      json={"input": "hello", "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    floats = httpx.post(f"{minilm_server.base_url}/embeddings", json={"input": "hello"}).json()
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats["data"][0]["embedding"]
    assert body["object"] == "list" and body["model"] == "minilm"


def test_long_input_list_in_windows(minilm_server):
    texts = [f"sentence number {i}" for i in range(30)]
    got = client(minilm_server).embeddings.create(model="minilm", input=texts, encoding_format="float")
    alone = client(minilm_server).embeddings.create(model="minilm", input=texts[17], encoding_format="float")
    assert len(got.data) == 30 and [d.index for d in got.data] == list(range(30))
    assert torch.allclose(torch.tensor(got.data[17].embedding), torch.tensor(alone.data[0].embedding), atol=1e-6)
    metrics = httpx.get(f"{minilm_server.url}/metrics").text
    assert metric_value(metrics, "kvik:prompt_tokens_total") > 0


BAD_EMBEDDINGS = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": 5}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": [[1, "2"]]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": [10**9]}, "input"),
    ({}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "a lot"}, "dimensions"),
    ({"input": [101] * 257}, "input"),
    ({"input": "word " * 300}, "input"),
    ({"input": ["a"] * 2049}, "input"),
]


@pytest.mark.parametrize("payload,param", BAD_EMBEDDINGS)
def test_bad_embedding_requests_are_400(minilm_server, payload, param):
    response = httpx.post(f"{minilm_server.base_url}/embeddings", json=payload, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_unknown_model_is_404(minilm_server):
    response = httpx.post(f"{minilm_server.base_url}/embeddings", json={"model": "nope", "input": "x"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path,payload", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/responses", {"input": "hi"}),
    ("/classify", {"input": "hi"}),
])
def test_encoder_refuses_other_tasks(minilm_server, path, payload):
    response = httpx.post(f"{minilm_server.url}{path}", json=payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_task" and "embeddings (/v1/embeddings)" in error["message"]


@torch.no_grad()
def test_classify_equals_hf(reward_server, reward_path):
    import transformers

    reference = transformers.AutoModelForSequenceClassification.from_pretrained(reward_path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(reward_path)
    texts = ["a helpful answer", "an unhelpful answer that goes on and on"]
    for path in ("/classify", "/v1/classify"):
        body = httpx.post(f"{reward_server.url}{path}", json={"model": "reward", "input": texts}).json()
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
        for text, item in zip(texts, body["data"]):
            expected = reference(torch.tensor([tokenizer(text)["input_ids"]])).logits[0, 0].item()
            assert item["num_classes"] == 1 and item["label"] == "LABEL_0"
            assert abs(item["logits"][0] - expected) < 1e-4
            assert abs(item["probs"][0] - 1 / (1 + torch.exp(torch.tensor(-expected)).item())) < 1e-5


@pytest.mark.parametrize("path,payload", [
    ("/v1/embeddings", {"input": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_reward_model_refuses_other_tasks(reward_server, path, payload):
    response = httpx.post(f"{reward_server.url}{path}", json=payload)
    assert response.status_code == 400, response.text
    assert "classification scores (/classify)" in response.json()["error"]["message"]


@pytest.mark.parametrize("payload", [{"input": ""}, {"input": []}, {"input": {"a": 1}}, {"input": [1] * 300}])
def test_bad_classify_requests_are_400(reward_server, payload):
    response = httpx.post(f"{reward_server.url}/classify", json=payload)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "input"


def test_decoder_serves_last_token_embeddings_not_classification(server):
    got = client(server).embeddings.create(model=server.model_name, input=["hello", "world"],
                                           encoding_format="float")
    assert [len(d.embedding) for d in got.data] == [64, 64]
    norm = torch.tensor(got.data[0].embedding).norm().item()
    assert abs(norm - 1) < 1e-5
    response = httpx.post(f"{server.url}/classify", json={"input": "hi"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "unsupported_task"
