"""The compiled CPU attention kernels (decode, over the paged cache; prefill, causal over a chunk's
keys) against PyTorch's SDPA, and the packed GEMV and the roofline read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvik.model.layers.cpu_kernels import cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels()
    if module is None:
        pytest.skip("no C++ toolchain: the PyTorch path is used instead")
    return module


@pytest.fixture(params=["vector", "plain"])
def attention_path(kernels, request):
    """decode_attention's AVX-512 single pass (where the CPU has AVX-512 and the head_dim is 16, 32,
    64 or 128) and the plain loops every other case runs."""
    kernels.set_plain_attention(request.param == "plain")
    yield request.param
    kernels.set_plain_attention(False)


def _sdpa_reference(query, key_cache, value_cache, tables, lengths, scale):
    kv_heads, _, block_size, dim = key_cache.shape
    batch, heads, width = query.shape[0], query.shape[1], tables.shape[1]
    keys = key_cache.index_select(1, tables.reshape(-1)).view(kv_heads, batch, -1, dim).transpose(0, 1)
    values = value_cache.index_select(1, tables.reshape(-1)).view(kv_heads, batch, -1, dim).transpose(0, 1)
    mask = (torch.arange(width * block_size)[None, :] < lengths[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=heads != kv_heads).squeeze(2)


# Groups of 1-8 query heads per KV head (the single pass takes up to 4 at a time in registers, 2 at
# head_dim 128), blocks of 4-32 tokens (its scores are summed 16 tokens at a time), head_dims it
# takes (16-128) and one it leaves to the plain loops (80).
@pytest.mark.parametrize("heads,kv_heads,block_size,dim", [
    (12, 4, 16, 64), (4, 4, 4, 64), (8, 1, 8, 64), (10, 2, 32, 64), (14, 2, 16, 128), (8, 4, 16, 128),
    (6, 6, 16, 16), (9, 3, 32, 32), (4, 1, 16, 80)])
def test_decode_kernel_matches_sdpa(kernels, attention_path, heads, kv_heads, block_size, dim):
    generator = torch.Generator().manual_seed(heads + kv_heads + dim)
    lengths = torch.tensor([1, 5, block_size, block_size + 1, 3 * block_size - 1, 40, 2, 300])
    batch, width = len(lengths), int((lengths.max() + block_size - 1) // block_size)
    num_blocks = batch * width + 7
    key_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator)
    value_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator)
    # Keys that grow along the pool, so a sequence's running peak moves from block to block.
    key_cache += torch.linspace(0, 3, num_blocks)[None, :, None, None]
    tables = torch.randperm(num_blocks, generator=generator)[:batch * width].view(batch, width)
    query = torch.randn(batch, heads, dim, generator=generator)
    out = torch.empty_like(query)
    kernels.decode_attention(query, key_cache, value_cache, tables, lengths, dim**-0.5, out)
    expected = _sdpa_reference(query, key_cache, value_cache, tables, lengths, dim**-0.5)
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lengths", [[300], [1], [17, 2, 260]], ids=["long", "one-token", "three"])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1)])
def test_decode_kernel_splits_pairs_that_do_not_divide_among_threads(kernels, attention_path, threads, lengths,
                                                                      heads, kv_heads):
    """One sequence of a model with 3 KV heads on 2 threads (or 1 on 2, 3 on 3...): the AVX-512 pass
    cuts each (sequence, KV head) pair's blocks into ranges and merges their partial softmax sums.
    Ranges with no blocks (a one-token sequence cut in three) are part of the merge."""
    generator = torch.Generator().manual_seed(len(lengths) + heads)
    block_size, dim = 16, 64
    lengths = torch.tensor(lengths)
    batch, width = len(lengths), int((lengths.max() + block_size - 1) // block_size)
    num_blocks = batch * width + 3
    key_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator)
    key_cache += torch.linspace(0, 3, num_blocks)[None, :, None, None]
    value_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator)
    tables = torch.randperm(num_blocks, generator=generator)[:batch * width].view(batch, width)
    query = torch.randn(batch, heads, dim, generator=generator)
    out = torch.empty_like(query)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.decode_attention(query, key_cache, value_cache, tables, lengths, dim**-0.5, out)
    finally:
        torch.set_num_threads(previous)
    expected = _sdpa_reference(query, key_cache, value_cache, tables, lengths, dim**-0.5)
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-4)


def test_decode_kernel_refuses_a_block_id_out_of_range(kernels, attention_path):
    key_cache = torch.randn(2, 8, 16, 64)
    tables = torch.tensor([[0, 3, 8]])  # 8 is past the pool
    out = torch.empty(1, 4, 64)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.decode_attention(torch.randn(1, 4, 64), key_cache, key_cache.clone(), tables, torch.tensor([40]),
                                 0.125, out)


def _causal_reference(query, key, value, scale):
    """SDPA with query i at position L - n + i over keys 0 ... L - n + i (the chunk's context first)."""
    n, length = query.shape[0], key.shape[0]
    mask = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
    return F.scaled_dot_product_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                          value.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                          enable_gqa=query.shape[1] != key.shape[1])[0].transpose(0, 1)


# Chunks of 1-300 tokens with and without context before them (the kernel takes 64 query tokens per
# item and 32 keys per step, so lengths either side of both), groups of 1-8 query heads per KV head,
# each head_dim it takes; inputs are strided views, as the model passes them (q, k and v are column
# ranges of one projection output; cached keys are a transposed gather).
@pytest.mark.parametrize("n,context,heads,kv_heads,dim", [
    (1, 0, 4, 2, 64), (5, 0, 4, 4, 16), (37, 0, 12, 4, 64), (64, 0, 12, 4, 64), (65, 0, 9, 3, 32),
    (300, 0, 12, 4, 64), (33, 37, 8, 2, 128), (64, 200, 12, 4, 64), (1, 95, 8, 1, 64), (100, 31, 6, 6, 16)])
@pytest.mark.parametrize("threads,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_prefill_kernel_matches_sdpa(kernels, n, context, heads, kv_heads, dim, threads, dtype):
    if not kernels.prefill_attention_supported(dim):
        pytest.skip("prefill_attention needs AVX-512 (the engine keeps SDPA without it)")
    generator = torch.Generator().manual_seed(n + context + heads + dim)
    length = n + context
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=generator) * 2
    query = qkv[:, :heads * dim].view(n, heads, dim)
    own_keys = qkv[:, heads * dim:(heads + kv_heads) * dim].view(n, kv_heads, dim)
    own_values = qkv[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim)
    # Context keys in the gather's layout, (Hkv, L, D) transposed; scores that grow along the keys,
    # so each row's running peak moves from step to step.
    context_keys = torch.randn(kv_heads, context, dim, generator=generator) + torch.linspace(0, 2, context)[None, :, None]
    key = torch.cat([context_keys, own_keys.transpose(0, 1)], dim=1).transpose(0, 1)
    value = torch.cat([torch.randn(kv_heads, context, dim, generator=generator), own_values.transpose(0, 1)],
                      dim=1).transpose(0, 1)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full((n, heads, dim), float("nan"), dtype=dtype)
        kernels.prefill_attention(query, key, value, out, dim**-0.5)
    finally:
        torch.set_num_threads(previous)
    # bfloat16: the same float32 arithmetic on the same (bfloat16) inputs, then one rounding of the
    # output, so at most a bfloat16 step apart from the reference rounded alike.
    expected = _causal_reference(query.float(), key.float(), value.float(), dim**-0.5).to(dtype)
    tolerance = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    assert torch.allclose(out.float(), expected.float(), **tolerance)


def test_prefill_kernel_refuses_what_it_cannot_run(kernels):
    if not kernels.prefill_attention_supported(64):
        pytest.skip("prefill_attention needs AVX-512")
    assert not kernels.prefill_attention_supported(80)
    q, kv = torch.randn(4, 4, 80), torch.randn(4, 2, 80)
    with pytest.raises(RuntimeError, match="head_dim 80 is not supported"):
        kernels.prefill_attention(q, kv, kv, torch.empty_like(q), 0.1)
    q, kv = torch.randn(4, 6, 64), torch.randn(4, 4, 64)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        kernels.prefill_attention(q, kv, kv, torch.empty_like(q), 0.1)
    q, kv = torch.randn(5, 4, 64), torch.randn(4, 2, 64)
    with pytest.raises(RuntimeError, match="L >= the query tokens"):
        kernels.prefill_attention(q, kv, kv, torch.empty_like(q), 0.1)
    q, kv = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    with pytest.raises(RuntimeError, match="all of one dtype"):
        kernels.prefill_attention(q.to(torch.bfloat16), kv, kv, torch.empty_like(q), 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.prefill_attention(q.half(), kv.half(), kv.half(), torch.empty_like(q).half(), 0.1)


@pytest.mark.parametrize("out_features,in_features,bias", [(1280, 768, False), (100, 70, True), (64, 16, True)])
def test_packed_gemv_matches_linear(kernels, out_features, in_features, bias):
    from kvik.model.transforms.onednn_linear import OneDNNLinear, onednn_available, packed_gemv_layout

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    layout = packed_gemv_layout(out_features, in_features)
    if layout is None:
        pytest.skip("oneDNN packs this shape in a layout the GEMV kernel does not read")
    torch.manual_seed(out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    packed = OneDNNLinear(linear)
    assert packed.enable_gemv(kernels, layout)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13):  # past GEMV_MAX_ROWS (8), oneDNN's path
            x = torch.randn(rows, in_features)
            assert torch.allclose(packed(x), linear(x), rtol=1e-4, atol=1e-4)
            # The kernel itself at any row count: passes of four rows over each block.
            got = kernels.gemv_packed(x, *packed._gemv_args, packed.bias)
            assert torch.allclose(got, linear(x), rtol=1e-4, atol=1e-4), rows
        x = torch.randn(2, 1, in_features)  # any leading shape
        assert packed(x).shape == (2, 1, out_features)


@pytest.mark.parametrize("threads", [1, 2])
def test_stream_read_reads_every_word(kernels, threads):
    """The benchmarks' roofline read (bench.roofline.stream_reader) must touch every byte: it returns
    the sum of the 32-bit words mod 2**32, checked on sizes that split unevenly between threads and
    end mid-256-byte step (the tail is summed apart)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(threads)
        for words in (1, 3, 64, 65, 1000, 123_457):
            buffer = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, generator=generator)
            assert kernels.stream_read(buffer) == int(buffer.to(torch.int64).sum()) % 2**32, words
        floats = torch.randn(4099, generator=generator)  # any dtype: its bytes as words
        assert kernels.stream_read(floats) == int(floats.view(torch.int32).to(torch.int64).sum()) % 2**32
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(RuntimeError, match="multiple of 4 bytes"):
        kernels.stream_read(torch.zeros(3, dtype=torch.uint8))


def test_stream_reader_falls_back_to_a_reduction(monkeypatch):
    from kvik.bench import roofline

    monkeypatch.setattr("kvik.model.layers.cpu_kernels.cpu_kernels", lambda: None)
    buffer = torch.ones(1000)
    assert roofline.stream_reader(buffer)() == 1000  # buffer.sum()


def test_argmax_rows_is_torch_argmax(kernels):
    """The sampler's argmax (greedy tokens, the sampled draw) must pick exactly what torch.argmax
    picks: the first index of the largest value, the first NaN if any, index 0 for a row of -inf."""
    generator = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 31, 32, 33, 100, 32000, 49152):
        rows = torch.randn(5, n, generator=generator)
        assert torch.equal(kernels.argmax_rows(rows), rows.argmax(dim=-1)), n
        # Ties everywhere: small integers, so the largest value repeats across lanes and the tail.
        tied = torch.randint(0, 4, (6, n), generator=generator).float()
        assert torch.equal(kernels.argmax_rows(tied), tied.argmax(dim=-1)), n
    n = 1000
    special = torch.randn(9, n, generator=generator)
    special[0] = float("-inf")  # a row the grammar masked entirely
    special[1, 700] = float("inf")
    special[2, 5] = float("nan")  # in the vector part
    special[3, 990:] = float("nan")  # in the tail (1000 = 62 vectors of 16 + 8)
    special[3, 999] = 100.0
    special[4, 0] = float("nan")
    special[5] = 0.0
    special[5, 600] = -0.0  # equal to 0.0: the first zero wins
    special[6, 0] = 50.0
    special[6, 17] = 50.0  # a tie between lanes: the smaller index
    special[7, 33] = 60.0
    special[7, 1] = 60.0
    special[8, 998] = 70.0  # the maximum in the tail
    expected = special.argmax(dim=-1)
    assert torch.equal(kernels.argmax_rows(special), expected)
    assert expected[:5].tolist() == [0, 700, 5, 990, 0]
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernels.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))


def _hold_lock_and_hang(target: str, lock: str, started) -> None:
    """A builder that takes the lock, then hangs mid-build (killed by the test)."""
    import time
    from pathlib import Path

    from kvik.model.layers.cpu_kernels import build_once

    def build(path: Path) -> None:
        Path(str(path) + ".partial").write_bytes(b"half a library")
        started.set()
        time.sleep(600)

    build_once(Path(target), Path(lock), build=build, load=lambda path: None)


def test_a_builder_killed_mid_build_never_blocks_the_next_start(tmp_path):
    """Issue 10, finding 10: torch's lock file outlived a killed build and hung every later start.
    The flock dies with its holder, and the library only ever appears whole."""
    import multiprocessing
    import os
    import signal
    import time

    from kvik.model.layers.cpu_kernels import build_once

    target, lock = tmp_path / "kernels.so", tmp_path / "kernels.lock"
    spawn = multiprocessing.get_context("spawn")
    started = spawn.Event()
    holder = spawn.Process(target=_hold_lock_and_hang, args=(str(target), str(lock), started))
    holder.start()
    assert started.wait(60), "the first builder never started"
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    assert lock.exists() and not target.exists()

    def build(path):
        scratch = path.with_suffix(".tmp")
        scratch.write_bytes(b"library")
        os.replace(scratch, path)
        return "built"

    began = time.monotonic()
    assert build_once(target, lock, build=build, load=lambda path: "loaded") == "built"
    assert time.monotonic() - began < 5
    assert target.read_bytes() == b"library"
    assert build_once(target, lock, build=build, load=lambda path: "loaded") == "loaded"
