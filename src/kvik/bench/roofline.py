"""What this machine can do at best: float32 matmul FLOP/s and memory bandwidth, and the FLOPs and
bytes a Llama-shaped model needs per token, so measured throughput can be read as a fraction of the
roofline it is bound by."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch


@dataclass(slots=True)
class Roofline:
    matmul_flops: float  # float32 FLOP/s of a large GEMM, best of several runs
    read_bandwidth: float  # bytes/s streaming a large tensor once (stream_reader)
    copy_bandwidth: float  # bytes/s moved by a large copy (read + write counted)
    threads: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm caches, page in memory
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def stream_reader(buffer: torch.Tensor) -> Callable[[], Any]:
    """A function that reads `buffer` (contiguous, on the CPU) once, as fast as this machine streams
    memory: kvik's read kernel (read_bandwidth_cpu.cpp: a contiguous range per thread, 64-byte loads,
    lines asked for 4 KiB ahead, as the decode kernels read weights), or `buffer.sum()` where the
    CPU kernels are unavailable. The kernel is the bound to report against: `sum()` read 200 MB at
    23-27 GB/s on the 2-core AVX-512 machine, the kernel at 31-35 GB/s."""
    from kvik.model.layers.cpu_kernels import cpu_kernels

    kernels = cpu_kernels() if buffer.device.type == "cpu" else None
    if kernels is not None and buffer.is_contiguous() and buffer.numel() * buffer.element_size() % 4 == 0:
        return lambda: kernels.stream_read(buffer)
    return lambda: buffer.sum()


def measure_roofline(repeats: int = 5, gemm_size: int = 2048, stream_bytes: int = 2**30) -> Roofline:
    a = torch.randn(gemm_size, gemm_size)
    b = torch.randn(gemm_size, gemm_size)
    out = torch.empty(gemm_size, gemm_size)
    gemm = _best_time(lambda: torch.mm(a, b, out=out), repeats)
    # The best GEMM this torch build has: kvik's CPU path runs oneDNN on prepacked weights, which
    # beats the default BLAS on some CPUs, so the roofline must include it to stay a ceiling.
    try:
        from kvik.model.transforms.onednn_linear import OneDNNLinear, onednn_available

        if onednn_available():
            linear = torch.nn.Linear(gemm_size, gemm_size, bias=False)
            packed = OneDNNLinear(linear)
            with torch.inference_mode():
                gemm = min(gemm, _best_time(lambda: packed(a), repeats))
    except ImportError:
        pass
    flops = 2 * gemm_size**3 / gemm
    big = torch.ones(stream_bytes // 4)
    read = _best_time(stream_reader(big), repeats)
    target = torch.empty_like(big)
    copy = _best_time(lambda: target.copy_(big), repeats)
    return Roofline(matmul_flops=flops, read_bandwidth=stream_bytes / read,
                    copy_bandwidth=2 * stream_bytes / copy, threads=torch.get_num_threads())


@dataclass(slots=True)
class ModelShape:
    """The dimensions that decide FLOPs and bytes per token of a Llama-shaped model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: int = 4

    @classmethod
    def from_model_dir(cls, path: str) -> ModelShape:
        import json
        from pathlib import Path

        raw = json.loads((Path(path) / "config.json").read_text())
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        return cls(hidden, raw["num_hidden_layers"], heads, raw.get("num_key_value_heads") or heads,
                   raw.get("head_dim") or hidden // heads, raw["intermediate_size"], raw["vocab_size"])

    @property
    def layer_matmul_params(self) -> int:
        attention = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        attention += self.heads * self.head_dim * self.hidden
        return attention + 3 * self.hidden * self.intermediate

    @property
    def body_matmul_params(self) -> int:
        return self.layers * self.layer_matmul_params

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    def flops(self, token_positions: list[int], logits_rows: int) -> float:
        """FLOPs to process tokens at the given positions (context = position + 1 each) and
        compute `logits_rows` LM-head rows: 2 per matmul parameter passed, plus attention's
        QK^T and PV (2 * 2 * context * heads * head_dim per layer)."""
        dense = 2 * self.body_matmul_params * len(token_positions) + 2 * self.lm_head_params * logits_rows
        contexts = sum(p + 1 for p in token_positions)
        attention = 4 * contexts * self.heads * self.head_dim * self.layers
        return dense + attention

    def decode_bytes_per_token(self) -> int:
        """Weights read by one single-stream decode step (embedding row not counted)."""
        return (self.body_matmul_params + self.lm_head_params) * self.bytes_per_param
