"""Write random-weight models in HF format, with a byte-level BPE tokenizer trained locally.

Tests, the demo and the benchmarks use these instead of hub downloads. The directory is exactly what
`save_pretrained` writes (config.json, model.safetensors or shards + index, generation_config.json)
plus tokenizer.json and tokenizer_config.json with a ChatML chat template, so HF transformers loads the
same weights as the independent reference in tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvik.core.tokenizer_files import train_tokenizer, write_tokenizer

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gpt2")


@dataclass(frozen=True, slots=True)
class ModelSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # tokenizer vocabulary; the model's may be padded above it
    max_position_embeddings: int
    init_std: float


SIZES: dict[str, ModelSize] = {
    # Fast enough for hundreds of test generations on 2 CPU cores. A larger init std than HF's 0.02
    # makes the random logits peaked, so greedy choices are far from ties and float noise between two
    # correct implementations cannot flip a token.
    "tiny": ModelSize(64, 2, 4, 2, 128, 512, 2048, 0.15),
    "small": ModelSize(256, 4, 8, 4, 688, 2048, 4096, 0.08),
    # The fixed reference model of the benchmarks (about 125M parameters).
    "bench": ModelSize(768, 12, 12, 4, 2048, 32000, 4096, 0.02),
    # Llama-3.2-1B's body (hidden 2048, 16 layers, 32 heads over 8 KV heads, MLP 8192) with the
    # bench vocabulary: 1.1B parameters, for GPU benchmarks where 125M is all launch overhead.
    "1b": ModelSize(2048, 16, 32, 8, 8192, 32000, 4096, 0.02),
}


def _padded(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def hf_config(arch: str, size: ModelSize, tokenizer_vocab: int, eos_id: int) -> Any:
    """The transformers config for `arch` at `size` (vocab padded for Qwen, as Qwen ships it)."""
    import transformers

    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=tokenizer_vocab, n_positions=size.max_position_embeddings,
            n_embd=size.hidden_size, n_layer=size.num_layers, n_head=size.num_heads,
            n_inner=size.intermediate_size, activation_function="gelu_new",
            bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True,
        )
    common: dict[str, Any] = dict(
        vocab_size=tokenizer_vocab, hidden_size=size.hidden_size,
        num_hidden_layers=size.num_layers, num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads, intermediate_size=size.intermediate_size,
        max_position_embeddings=size.max_position_embeddings, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=eos_id, hidden_act="silu",
    )
    if arch == "llama":
        # Llama-3 rope scaling, so the scaled frequencies are exercised by the parity tests.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
        return transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 1000000.0})
    # Qwen pads the embedding matrix beyond the tokenizer (151936 rows for ~151665 tokens).
    common["vocab_size"] = _padded(tokenizer_vocab + 1, 64)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1000000.0})
    if arch == "qwen3":
        # head_dim deliberately not hidden/heads, as in the real Qwen3 family.
        return transformers.Qwen3Config(**common, head_dim=2 * size.hidden_size // size.num_heads,
                                        tie_word_embeddings=True, attention_bias=False,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1000000.0})
    raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")


def _randomize(model: Any, std: float, seed: int) -> None:
    """Deterministic random weights. Norm scales and biases get noise too, so a loader that forgot
    one of them would change the outputs and fail the parity tests."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                values = torch.randn(param.shape, generator=generator) * std
            elif "norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
            else:
                values = 0.05 * torch.randn(param.shape, generator=generator)
            param.copy_(values.to(param.dtype))


def make_model(out_dir: str | Path, arch: str = "llama", size: str = "tiny", *, seed: int = 0,
               dtype: str = "float32", max_shard_size: str | None = None,
               tokenizer_dir: str | Path | None = None) -> Path:
    """Write a random-weight `arch` model of `size` to `out_dir` and return the path.

    `tokenizer_dir`: use that HF tokenizer (tokenizer.json + tokenizer_config.json) instead of
    training one, and size the embeddings to its vocabulary (benchmarks whose cost depends on a
    real vocabulary, such as grammar masks)."""
    import torch
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if tokenizer_dir is None:
        tokenizer = train_tokenizer(spec.vocab_size)
        special = write_tokenizer(out, tokenizer, spec.max_position_embeddings)
        vocab_size = max(spec.vocab_size, tokenizer.get_vocab_size())
    else:
        special, vocab_size = _copy_tokenizer(Path(tokenizer_dir), out)
    config = hf_config(arch, spec, vocab_size, special["eos"])
    config.dtype = dtype
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model, spec.init_std, seed)
    model = model.to(getattr(torch, dtype))
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    generation = {"eos_token_id": list(dict.fromkeys([special["eos"], special["im_end"]]))}
    if arch == "gpt2":
        generation["bos_token_id"] = special["eos"]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def _copy_tokenizer(source: Path, out: Path) -> tuple[dict[str, int], int]:
    """Copy a tokenizer directory; return its end-of-sequence ids (as write_tokenizer names them)
    and its vocabulary size."""
    import shutil

    from tokenizers import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = tokenizer.token_to_id(eos) if eos else None
    if eos_id is None:
        raise ValueError(f"tokenizer at {source}: no eos_token in tokenizer_config.json")
    im_end = tokenizer.token_to_id("<|im_end|>")
    return {"eos": eos_id, "im_end": eos_id if im_end is None else im_end}, tokenizer.get_vocab_size()
