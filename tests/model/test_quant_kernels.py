"""The compiled weight-only and KV-cache kernels against plain PyTorch on the same numbers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvik.model.layers.cpu_kernels import cpu_kernels
from kvik.model.layers.kv_cache import PagedKVCache, quantize_kv
from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.quant.reference import Int4Weight, Int8Weight


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels()
    if module is None:
        pytest.skip("no C++ toolchain: the PyTorch path is used instead")
    return module


# What the kernels run with outside these tests (KVIK_INT8_ACTIVATIONS=0 turns int8 activations off).
INT8_ACTIVATIONS_DEFAULT = os.environ.get("KVIK_INT8_ACTIVATIONS", "1") != "0"
FORMATS = [("bfloat16", 0, False), ("int8", 0, False),  # int8 group 0: a scale per output row
           ("int8", 32, False), ("int8", 128, False),
           ("int4", 32, False), ("int4", 64, True), ("int4", 128, False)]


@pytest.fixture(params=["int8-activations", "vector", "portable"])
def code_path(kernels, request):
    """The AVX512-VNNI kernels on int8-rounded activations (where this CPU has them), the AVX2
    kernels (where it has AVX2) and the plain loops every other CPU runs."""
    kernels.set_portable_kernels(request.param == "portable")
    kernels.set_int8_activations(request.param == "int8-activations")
    if request.param == "int8-activations" and "vnni" not in kernels.simd_isa():
        pytest.skip("this CPU has no AVX512-VNNI/VBMI: int8 and int4 weights take float32 activations")
    yield request.param
    kernels.set_portable_kernels(False)
    kernels.set_int8_activations(INT8_ACTIVATIONS_DEFAULT)


def round_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the VNNI kernels see it, written out independently: each row's blocks of 32 inputs
    rounded to int8 with scale max |x| / 127 (half to even), then scaled back."""
    blocks = x.reshape(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("kind,group,zero_point", FORMATS)
@pytest.mark.parametrize("out_features,in_features,bias",
                         [(1280, 768, False), (100, 200, True), (16, 64, True), (48, 576, False)])
def test_weight_only_linear_matches_torch(kernels, code_path, kind, group, zero_point, out_features,
                                          in_features, bias):
    """Rows 1-4 (decode), 5-15 (the small-batch kernel in passes of four), 16+ (the register tiles
    on AVX-512, 12 rows by two blocks with partial tiles and a lone last block, or the widened GEMM
    elsewhere, or the VNNI kernel): all equal F.linear on the dequantized weight, computed by
    PyTorch from the packed buffers, and on the int8-rounded activations where the layer takes those."""
    torch.manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    layer = WeightOnlyLinear.from_linear(linear, kind, group, zero_point)
    reference = layer.dequantize()  # PyTorch's own unpacking and dequantization
    layer.enable_kernels(kernels)
    widened = layer.kernel_weight().dequantize_transposed()  # the kernel's
    assert torch.allclose(widened.t(), reference, rtol=1e-6, atol=1e-7)
    rounded = layer.kernel_weight().int8_activations()
    assert rounded == (code_path == "int8-activations" and kind != "bfloat16" and in_features % 32 == 0)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 7, 16, 17, 64):
            x = torch.randn(rows, in_features)
            expected = F.linear(round_activations(x) if rounded else x, reference, layer.bias)
            assert torch.allclose(layer(x), expected, rtol=1e-4, atol=1e-4), rows
        x = torch.randn(2, 3, in_features)  # any leading shape
        assert layer(x).shape == (2, 3, out_features)


@pytest.mark.parametrize("kind,group,zero_point", FORMATS)
def test_two_threads_compute_what_one_does(kernels, code_path, kind, group, zero_point):
    """The suite runs on one thread (OMP_NUM_THREADS=1, tests/conftest.py); serving splits each
    kernel's blocks over every core. Each block of outputs is one thread's work whatever the split,
    so two threads must give what one does: state a task reads from the wrong thread (a
    thread_local named inside a parallel task, say) would show here and nowhere else."""
    torch.manual_seed(0)
    layer = WeightOnlyLinear.from_linear(torch.nn.Linear(768, 1280), kind, group, zero_point)
    layer.enable_kernels(kernels)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        inputs = [torch.randn(rows, 768) for rows in (1, 4, 17, 64)]
        single = [layer(x) for x in inputs]
        torch.set_num_threads(2)
        try:
            double = [layer(x) for x in inputs]
        finally:
            torch.set_num_threads(threads)
    for x, one, two in zip(inputs, single, double):
        assert torch.allclose(one, two, rtol=1e-5, atol=1e-5), x.shape[0]


@pytest.mark.parametrize("kind,group,zero_point", FORMATS[1:])
def test_int8_activations_are_per_row_and_bounded(kernels, kind, group, zero_point):
    """On the VNNI path each row's result depends on that row alone (any batch, bit for bit), rows
    of zeros and of huge or tiny values come out right, and the distance to float32 activations
    stays within the rounding's bound: |y - y_float| <= sum_k |W_jk| * scale_block(k) / 2."""
    if "vnni" not in kernels.simd_isa():
        pytest.skip("this CPU has no AVX512-VNNI/VBMI")
    torch.manual_seed(7)
    layer = WeightOnlyLinear.from_linear(torch.nn.Linear(576, 80), kind, group, zero_point)
    reference = layer.dequantize()
    layer.enable_kernels(kernels)
    x = torch.randn(37, 576)
    x[3] = 0.0
    x[5] *= 1e6
    x[6] *= 1e-6
    x[7, 100] = 50.0  # one outlier in its block
    with torch.inference_mode():
        batch = layer(x)
        for row in (0, 3, 5, 6, 7, 36):
            assert torch.equal(batch[row], layer(x[row:row + 1])[0])
        assert torch.equal(batch[3], layer.bias)
        exact = F.linear(x.double(), reference.double(), layer.bias.double())
        step = x.reshape(37, -1, 32).abs().amax(-1).double() / 127  # (rows, blocks)
        bound = (reference.abs().double().reshape(80, -1, 32).sum(-1) @ step.t()).t() / 2  # (rows, out)
        error = (batch.double() - exact).abs()
        assert torch.all(error <= bound * 1.001 + 1e-5 * exact.abs() + 1e-6)


@pytest.mark.parametrize("group", [0, 32])
def test_extreme_codes_come_out_exact(kernels, code_path, group):
    """The kernels' integer tricks at the ends of the ranges: int8 codes of -128 (a Q8_0 file may
    hold them; kvik's own quantizer stops at -127) and 127 (the VNNI kernel flips their sign bit
    into vpdpbusd's unsigned operand), int4 nibbles of 0 and 15 (the high ones multiplied in place
    as 16 x their value), against activations at their own extremes (rounded codes of +-127)."""
    torch.manual_seed(3)
    rows, columns = 48, 256
    values = torch.randint(-128, 128, (rows, columns), dtype=torch.int8)
    values[0], values[1], values[2, ::2], values[2, 1::2] = -128, 127, -128, 127
    scales = (torch.rand(rows, columns // group) + 0.5).half() if group else torch.rand(rows) + 0.5
    layer8 = WeightOnlyLinear.from_int8(Int8Weight(values, scales, group))
    nibbles = torch.randint(0, 16, (rows, columns), dtype=torch.uint8)
    nibbles[0], nibbles[1], nibbles[2, ::2], nibbles[2, 1::2] = 0, 15, 0, 15
    layer4 = WeightOnlyLinear.from_int4(Int4Weight(nibbles, (torch.rand(rows, columns // 64) + 0.5).half(),
                                                   None, 64))
    x = torch.randn(5, columns)
    x[1] = 1.0  # every code 127
    x[2, ::2], x[2, 1::2] = -1.0, 1.0
    for layer in (layer8, layer4):
        reference = layer.dequantize()
        layer.enable_kernels(kernels)
        rounded = layer.kernel_weight().int8_activations()
        with torch.inference_mode():
            for count in (1, 2, 5):  # one row, a pass of rows, a prompt's unpacked operands
                inputs = round_activations(x[:count]) if rounded else x[:count]
                expected = F.linear(inputs.double(), reference.double())
                # float32 sums of terms up to ~190 in size: their rounding, relative to the terms'
                # magnitudes (an integer slip in a product would be off by a whole weight step)
                bound = 1e-5 * F.linear(inputs.abs().double(), reference.abs().double()) + 1e-4
                error = (layer(x[:count]).double() - expected).abs()
                assert torch.all(error <= bound), (layer.kind, count, float((error / bound).max()))


@pytest.mark.parametrize("kind,group,zero_point", [("bfloat16", 0, False), ("int8", 0, False),
                                                    ("int8", 32, False), ("int4", 64, True)])
def test_prompt_tiles_cover_every_row(kernels, kind, group, zero_point):
    """Prompts on float32 activations on AVX-512 run in register tiles, in chunks of rows sized to
    stay in L2 (128 rows at 2048 inputs): every row of a prompt that spans chunks and ends in a
    partial tile comes out right, with the bias, for outputs that are not a whole number of blocks
    (int8/int4 with float activations: a checkpoint served as it is, or a CPU without VNNI)."""
    torch.manual_seed(3)
    layer = WeightOnlyLinear.from_linear(torch.nn.Linear(2048, 88), kind, group, zero_point)
    layer.enable_kernels(kernels)
    layer.kernel_weight().allow_int8_activations = False
    if "avx-512" not in kernels.simd_isa():
        assert not layer.kernel_weight().prompt_tiles()
        pytest.skip("no AVX-512: prompts take the widened GEMM")
    assert layer.kernel_weight().prompt_tiles()
    x = torch.randn(300, 2048)
    with torch.inference_mode():
        expected = F.linear(x, layer.dequantize(), layer.bias)
        for rows in (9, 16, 129, 300):  # int4 takes the tiles from 9 rows, the others from 16
            assert torch.allclose(layer(x[:rows]), expected[:rows], rtol=1e-4, atol=1e-4), rows


def test_bfloat16_gemm_path_matches(kernels):
    """The path CPUs with bfloat16 arithmetic take for prefill (forced here: the kernel's bfloat16
    tiles where it was built with AVX512-BF16, else oneDNN's bfloat16 GEMM; the same result within
    bfloat16's rounding of the activations)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80)
    layer = WeightOnlyLinear.from_linear(linear, "bfloat16")
    layer.enable_kernels(kernels, bf16_gemm=True)
    x = torch.randn(40, 96)
    with torch.inference_mode():
        expected = F.linear(x, layer.dequantize(), layer.bias)
        assert torch.allclose(layer(x), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("out_features,in_features,bias", [(88, 2048, True), (100, 97, False), (16, 64, True)])
def test_bfloat16_prompt_tiles_multiply_rounded_rows_exactly(kernels, out_features, in_features, bias):
    """On CPUs with AVX512-BF16, bfloat16 batches of 12+ rows (prompts, and decode steps of a dozen
    requests or more) round their rows to bfloat16 and multiply in vdpbf16ps tiles straight from
    the stored blocks: each product exact, so the result is F.linear on the rounded rows up to
    float32 summation, for any row count (partial tiles), an odd number of inputs (the last one
    paired with zero) and a lone or partial last block. 11 rows and fewer keep float32
    activations, and a weight not allowed bfloat16 activations never takes the tiles."""
    torch.manual_seed(in_features)
    layer = WeightOnlyLinear.from_linear(torch.nn.Linear(in_features, out_features, bias=bias), "bfloat16")
    layer.enable_kernels(kernels)
    assert not layer.kernel_weight().bf16_prompt_tiles()  # not allowed: float32 activations
    layer.enable_kernels(kernels, bf16_gemm=True)
    if not layer.kernel_weight().bf16_prompt_tiles():
        pytest.skip("the kernels were built without AVX512-BF16")
    reference = layer.dequantize()
    x = torch.randn(300, in_features)
    with torch.inference_mode():
        for rows in (12, 16, 33, 37, 300):
            rounded = x[:rows].bfloat16().float()
            expected = F.linear(rounded, reference, layer.bias)
            assert torch.allclose(layer(x[:rows]), expected, rtol=1e-5, atol=1e-5), rows
        # 11 rows: the float32 path, on the rows as they are.
        assert torch.allclose(layer(x[:11]), F.linear(x[:11], reference, layer.bias), rtol=1e-4, atol=1e-4)


def test_kernel_rejects_inconsistent_weights(kernels):
    layer = WeightOnlyLinear.from_linear(torch.nn.Linear(64, 32), "int4", 32)
    with pytest.raises(RuntimeError, match="scales"):
        kernels.LinearWeight.weight_only(3, layer.data, layer.scales[:1], None, 32, 64, 32, None)
    with pytest.raises(RuntimeError, match="elements"):
        kernels.LinearWeight.weight_only(2, layer.data, layer.scales, None, 32, 65, 0, None)


def _cache(dtype, kv_heads, num_blocks, block_size, dim, generator) -> PagedKVCache:
    cache = PagedKVCache.empty(1, kv_heads, num_blocks, block_size, dim, dtype, torch.device("cpu")).layer(0)
    cache.data.zero_()
    if cache.scales is not None:
        cache.scales.zero_()
    keys = torch.randn(num_blocks * block_size, kv_heads, dim, generator=generator) * 2
    values = torch.randn(num_blocks * block_size, kv_heads, dim, generator=generator)
    cache.write(keys, values, torch.arange(num_blocks * block_size))
    return cache


@pytest.mark.parametrize("plain", [False, True], ids=["vector", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads,kv_heads,block_size,dim", [(12, 4, 16, 64), (8, 1, 8, 64), (6, 2, 32, 128)])
def test_decode_attention_reads_narrow_caches(kernels, dtype, heads, kv_heads, block_size, dim, plain):
    """The kernel on a bfloat16, int8 or float8 cache equals SDPA on the same cache widened by
    PyTorch, in its AVX-512 single pass (bfloat16 and int8, where the CPU has AVX-512) and its plain
    loops."""
    generator = torch.Generator().manual_seed(heads)
    num_blocks, batch = 64, 5
    cache = _cache(dtype, kv_heads, num_blocks, block_size, dim, generator)
    lengths = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 40])
    width = int((lengths.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=generator)[:batch * width].view(batch, width)
    query = torch.randn(batch, heads, dim, generator=generator)
    out = torch.empty_like(query)
    scales = (None, None) if cache.scales is None else (cache.scales[0], cache.scales[1])
    kernels.set_plain_attention(plain)
    try:
        kernels.decode_attention(query, cache.data[0], cache.data[1], tables, lengths, dim**-0.5, out, *scales)
    finally:
        kernels.set_plain_attention(False)

    keys, values = cache.gather(0, tables, torch.float32), cache.gather(1, tables, torch.float32)
    mask = (torch.arange(width * block_size)[None, :] < lengths[:, None])[:, None, None, :]
    expected = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=mask,
                                              scale=dim**-0.5, enable_gqa=heads != kv_heads).squeeze(2)
    assert torch.allclose(out, expected, atol=1e-5)


def test_decode_attention_widens_every_float8_pattern(kernels):
    """Keys and values made of every finite float8 e4m3fn byte (subnormals and +-448 included),
    read by the kernel's vector widening, equal SDPA on PyTorch's own widening; a NaN byte (0x7f)
    in a key makes the output of that sequence's query heads on that KV head NaN, as in PyTorch."""
    from kvik.model.layers.kv_cache import FLOAT8

    generator = torch.Generator().manual_seed(3)
    kv_heads, num_blocks, block_size, dim, heads = 2, 16, 8, 64, 4
    cache = PagedKVCache.empty(1, kv_heads, num_blocks, block_size, dim, FLOAT8, torch.device("cpu")).layer(0)
    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    raw = finite[torch.randint(len(finite), cache.data.shape, generator=generator)]
    raw.view(-1)[:len(finite)] = finite  # each pattern at least once
    cache.data.view(torch.uint8).copy_(raw)
    lengths = torch.tensor([block_size * num_blocks // 2, 5, block_size * 3])
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:8] for _ in range(3)])
    query = torch.randn(3, heads, dim, generator=generator) * 1e-3  # keys reach 448: keep scores moderate
    out = torch.empty_like(query)
    kernels.decode_attention(query, cache.data[0], cache.data[1], tables, lengths, dim**-0.5, out)
    keys, values = cache.gather(0, tables, torch.float32), cache.gather(1, tables, torch.float32)
    mask = (torch.arange(tables.shape[1] * block_size)[None, :] < lengths[:, None])[:, None, None, :]
    expected = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=mask,
                                              scale=dim**-0.5, enable_gqa=True).squeeze(2)
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-3)
    cache.data[0].view(torch.uint8)[0, tables[1, 0], 2, 7] = 0x7F  # a key of sequence 1, within its 5
    kernels.decode_attention(query, cache.data[0], cache.data[1], tables, lengths, dim**-0.5, out)
    assert out[1, :2].isnan().all()  # query heads 0-1 read KV head 0
    assert not out[1, 2:].isnan().any() and not out[0].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_compiled_cache_write_equals_pytorch_write(kernels, dtype):
    """Both paths store the same bytes, so a sequence written by one and read by the other (the
    decode stack and the module path share a cache) sees no difference."""
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 2, 64, generator=generator) * 3
    rows[2, 1] = 0.0  # an all-zero head: scale 0
    rows[4, 0, :3] = torch.tensor([500.0, -1e4, 447.9])  # past float8's 448: stored as +-448
    rows[5, 1, :2] = torch.tensor([1e-9, -3e-3])  # below float8's smallest: zero and a subnormal
    slots = torch.tensor([0, 5, 9, 17, 30, 31])
    torch_cache = PagedKVCache.empty(1, 2, 4, 8, 64, dtype, torch.device("cpu")).layer(0).zero_()
    compiled = PagedKVCache.empty(1, 2, 4, 8, 64, dtype, torch.device("cpu")).layer(0).zero_()
    torch_cache.write(rows, -rows, slots)
    scales = (None, None) if compiled.scales is None else (compiled.scales[0], compiled.scales[1])
    kernels.write_kv(rows, compiled.data[0], scales[0], slots)
    kernels.write_kv(-rows, compiled.data[1], scales[1], slots)
    assert torch.equal(torch_cache.data.view(torch.uint8), compiled.data.view(torch.uint8))
    if dtype == torch.int8:
        assert torch.equal(torch_cache.scales, compiled.scales)


def test_float8_kv_round_trip():
    """fp8 KV: within e4m3's half-step of every value (relative 1/16, absolute 2^-10 near zero), the
    largest magnitude 448, NaN kept NaN; one byte a value, no scales."""
    from kvik.model.layers.kv_cache import FLOAT8

    cache = PagedKVCache.empty(1, 2, 4, 8, 64, FLOAT8, torch.device("cpu")).layer(0).zero_()
    assert cache.scales is None and cache.nbytes == 2 * 2 * 4 * 8 * 64
    rows = torch.randn(10, 4, 64) * torch.logspace(-3, 2, 10)[:, None, None]
    back = cache.round_trip(rows)
    assert torch.all((back - rows).abs() <= torch.maximum(rows.abs() / 16, torch.tensor(2.0**-10)))
    edge = cache.round_trip(torch.tensor([1e6, -500.0, float("nan")]))
    assert edge[:2].tolist() == [448.0, -448.0] and edge[2].isnan()


def test_int8_kv_round_trip():
    rows = torch.randn(10, 4, 64) * torch.logspace(-3, 2, 10)[:, None, None]  # very different ranges
    quantized, scales = quantize_kv(rows)
    assert quantized.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (10, 4)
    restored = quantized.float() * scales.float()[..., None]
    step = scales.float()[..., None]
    assert torch.all((restored - rows).abs() <= step / 2 * 1.01)
    assert torch.all(quantized.abs().amax(-1) >= 126)  # each row uses its full range


def test_the_kernels_use_what_this_cpu_offers(kernels):
    """Built for the CPU that runs them: the int8-activation code exactly where /proc/cpuinfo lists
    AVX512-VNNI and VBMI too, AVX2 code where it lists avx2, fma and f16c (with a note on AVX-512
    CPUs), the plain loops elsewhere or when built for another target."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = set(next((line for line in cpuinfo if line.startswith("flags")), "").split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    isa = kernels.simd_isa()
    if os.environ.get("KVIK_CPU_KERNELS_MARCH") not in (None, "", "native"):
        assert isa in ("portable", "avx2", "avx2 (bfloat16 on avx-512)") or isa.startswith("avx512-vnni")
    elif {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"} <= flags:
        kernels.set_int8_activations(True)
        try:
            assert kernels.simd_isa().startswith("avx512-vnni")
            kernels.set_int8_activations(False)
            assert kernels.simd_isa() == "avx2 (bfloat16 on avx-512)"
        finally:
            kernels.set_int8_activations(INT8_ACTIVATIONS_DEFAULT)
    elif {"avx2", "fma", "f16c"} <= flags:
        assert isa == ("avx2 (bfloat16 on avx-512)" if "avx512f" in flags else "avx2")
    else:
        assert isa == "portable"


@pytest.mark.parametrize("march", ["x86-64-v2", "haswell", "skylake-avx512"])
def test_kernel_sources_compile_for_other_cpus(tmp_path, march):
    """The kernels are built with -march=native; on a CPU without AVX2/FMA/F16C the intrinsics are
    compiled out and the plain loops (tested above as "portable") remain, and without AVX512-VNNI/VBMI
    (Haswell's AVX2, Skylake's first AVX-512) the int8-activation kernels are compiled out. Every
    source that uses intrinsics must compile that way: a syntax-only pass per target, seconds
    rather than a build.
    (KVIK_CPU_KERNELS_MARCH=x86-64-v2 kvik build-kernels builds and loads such a library for real.)"""
    import platform
    import shutil
    import subprocess
    import sysconfig
    from importlib import resources

    from torch.utils.cpp_extension import include_paths

    from kvik.model.layers.cpu_kernels import SOURCES

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or platform.machine() != "x86_64":
        pytest.skip("needs an x86-64 C++ compiler")
    csrc = resources.files("kvik.model.layers").joinpath("csrc")
    includes = [f"-I{path}" for path in include_paths()] + [f"-I{csrc}", f"-I{sysconfig.get_paths()['include']}"]
    with_intrinsics = [name for name in SOURCES if "immintrin.h" in csrc.joinpath(name).read_text()]
    assert with_intrinsics, "no source includes immintrin.h: update this test"
    for source in with_intrinsics:
        result = subprocess.run([compiler, "-std=c++20", "-fsyntax-only", f"-march={march}", "-fopenmp",
                                 "-DTORCH_EXTENSION_NAME=kvik_syntax_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
                                 *includes, str(csrc.joinpath(source))],
                                capture_output=True, text=True, cwd=tmp_path)
        assert result.returncode == 0, f"{source} does not compile for {march}:\n{result.stderr[-3000:]}"
