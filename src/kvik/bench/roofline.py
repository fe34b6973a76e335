"""What this machine can do at best: matmul FLOP/s and memory bandwidth, on the CPU (float32) or on
a CUDA device (in the dtype the models run in), and the FLOPs and bytes a Llama-shaped model needs
per token, so measured throughput can be read as a fraction of the roofline it is bound by."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

# The dtypes `kvik bench compare --dtype` takes, by name: what the models' weights are stored in.
from kvik.engine.device import TORCH_DTYPES as DTYPES
from kvik.model.huge_pages import huge_page_empty


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as in DTYPES (4 for float32, 2 for bfloat16/float16)."""
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


@dataclass(slots=True)
class Roofline:
    matmul_flops: float  # FLOP/s of a large GEMM in matmul_dtype, best of several runs
    read_bandwidth: float  # bytes/s streaming a large tensor once (stream_reader)
    copy_bandwidth: float  # bytes/s moved by a large copy (read + write counted)
    threads: int  # CPU threads (torch's intra-op pool)
    device: str = "cpu"  # where it was measured: cpu or cuda
    device_name: str = ""  # the GPU's name on CUDA (torch.cuda.get_device_name); "" on the CPU
    matmul_dtype: str = "float32"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """The printed roofline line (the CPU's as it always was; a GPU's names the card and dtype)."""
        if self.device == "cpu":
            return (f"roofline: matmul {self.matmul_flops / 1e9:.1f} GFLOP/s, read "
                    f"{self.read_bandwidth / 1e9:.1f} GB/s, copy {self.copy_bandwidth / 1e9:.1f} GB/s "
                    f"({self.threads} threads)")
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[self.matmul_dtype]
        return (f"roofline ({self.device}, {self.device_name}): matmul {self.matmul_flops / 1e12:.1f} "
                f"TFLOP/s {short}, read {self.read_bandwidth / 1e9:.1f} GB/s, copy "
                f"{self.copy_bandwidth / 1e9:.1f} GB/s")


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm caches, page in memory
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def _best_cuda_time(fn: Callable[[], Any], repeats: int, iterations: int) -> float:
    """Seconds of one `fn()` on the current CUDA device, the best of `repeats` timings of
    `iterations` back-to-back calls each. CUDA launches return before the work is done, so each
    timing starts and ends at a synchronize; running several calls per timing keeps the launch
    and synchronize overhead out of kernels that take well under a millisecond."""
    for _ in range(3):  # warm-up: cuBLAS handles and heuristics, the allocator, clocks
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - started) / iterations)
    return best


def stream_reader(buffer: torch.Tensor) -> Callable[[], Any]:
    """A function that reads `buffer` (contiguous) once, as fast as this machine streams memory,
    and returns only when the read is done.

    On the CPU: kvik's read kernel (read_bandwidth_cpu.cpp: a contiguous range per thread, 64-byte
    loads, lines asked for 4 KiB ahead, as the decode kernels read weights), or `buffer.sum()`
    where the CPU kernels are unavailable. The kernel is the bound to report against: `sum()` read
    200 MB at 23-27 GB/s on the 2-core AVX-512 machine, the kernel at 31-35 GB/s.

    On CUDA: `buffer.sum()` followed by a synchronize, since the launch alone returns before the
    GPU has read anything (a timer around it would measure the launch)."""
    if buffer.device.type == "cuda":
        def read_cuda() -> torch.Tensor:
            total = buffer.sum()
            torch.cuda.synchronize(buffer.device)
            return total

        return read_cuda
    from kvik.model.layers.cpu_kernels import cpu_kernels

    kernels = cpu_kernels() if buffer.device.type == "cpu" else None
    if kernels is not None and buffer.is_contiguous() and buffer.numel() * buffer.element_size() % 4 == 0:
        return lambda: kernels.stream_read(buffer)
    return lambda: buffer.sum()


def measure_roofline(device: str = "cpu", dtype: str = "float32", repeats: int = 5,
                     gemm_size: int | None = None, stream_bytes: int | None = None) -> Roofline:
    """The roofline of `device` ('cpu' or 'cuda'). The CPU's is float32 whatever `dtype` is (as it
    always was: 2048^3 GEMMs, a 1 GiB buffer); a GPU's matmul runs in `dtype`, the dtype the
    compared systems run in, on 8192^3 GEMMs and a 2 GiB buffer."""
    if device == "cuda":
        return _measure_cuda_roofline(dtype, repeats, gemm_size or 8192, stream_bytes or 2 * 2**30)
    if device != "cpu":
        raise ValueError(f"measure_roofline: device must be 'cpu' or 'cuda', not {device!r}")
    return _measure_cpu_roofline(repeats, gemm_size or 2048, stream_bytes or 2**30)


def _measure_cpu_roofline(repeats: int, gemm_size: int, stream_bytes: int) -> Roofline:
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
    # On huge pages where the system has them, as the engine's weights and KV pool are.
    big = huge_page_empty(stream_bytes // 4 * 4).view(torch.float32).fill_(1.0)
    read = _best_time(stream_reader(big), repeats)
    target = huge_page_empty(stream_bytes // 4 * 4).view(torch.float32)
    copy = _best_time(lambda: target.copy_(big), repeats)
    return Roofline(matmul_flops=flops, read_bandwidth=stream_bytes / read,
                    copy_bandwidth=2 * stream_bytes / copy, threads=torch.get_num_threads())


def _measure_cuda_roofline(dtype: str, repeats: int, gemm_size: int, stream_bytes: int) -> Roofline:
    cuda = torch.device("cuda")
    torch_dtype = DTYPES[dtype]
    a = torch.randn(gemm_size, gemm_size, device=cuda, dtype=torch_dtype)
    b = torch.randn(gemm_size, gemm_size, device=cuda, dtype=torch_dtype)
    out = torch.empty(gemm_size, gemm_size, device=cuda, dtype=torch_dtype)
    # An 8192^3 bf16 GEMM is ~1.4 ms on an H200; ten per timing keep the synchronize negligible.
    gemm = _best_cuda_time(lambda: torch.mm(a, b, out=out), repeats, iterations=10)
    flops = 2 * gemm_size**3 / gemm
    del a, b, out
    # Bandwidth in the same dtype as the weights the decode reads; a 2 GiB buffer is far larger
    # than the GPU's L2 (tens of MiB), so every read comes from HBM.
    big = torch.ones(stream_bytes // dtype_bytes(dtype), device=cuda, dtype=torch_dtype)
    read = _best_cuda_time(lambda: big.sum(), repeats, iterations=10)
    target = torch.empty_like(big)
    copy = _best_cuda_time(lambda: target.copy_(big), repeats, iterations=10)
    del big, target
    # Give the cached blocks back: this process lives on while the compared systems run in their
    # own processes on the same card.
    torch.cuda.empty_cache()
    return Roofline(matmul_flops=flops, read_bandwidth=stream_bytes / read,
                    copy_bandwidth=2 * stream_bytes / copy, threads=torch.get_num_threads(),
                    device="cuda", device_name=torch.cuda.get_device_name(cuda), matmul_dtype=dtype)


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
    bytes_per_param: int = 4  # of the weights as the compared systems hold them: 2 in bf16/fp16

    @classmethod
    def from_model_dir(cls, path: str, dtype: str = "float32") -> ModelShape:
        """The shape from an HF model directory's config.json, its weights counted in `dtype` (the
        dtype the systems load them in, not the checkpoint's)."""
        import json
        from pathlib import Path

        raw = json.loads((Path(path) / "config.json").read_text())
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        return cls(hidden, raw["num_hidden_layers"], heads, raw.get("num_key_value_heads") or heads,
                   raw.get("head_dim") or hidden // heads, raw["intermediate_size"], raw["vocab_size"],
                   bytes_per_param=dtype_bytes(dtype))

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
