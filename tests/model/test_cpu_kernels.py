"""The compiled CPU decode-attention kernel against PyTorch's SDPA on gathered blocks."""

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


@pytest.mark.parametrize("heads,kv_heads,block_size", [(12, 4, 16), (4, 4, 4), (8, 1, 8)])
def test_decode_kernel_matches_sdpa(kernels, heads, kv_heads, block_size):
    generator = torch.Generator().manual_seed(heads + kv_heads)
    dim, num_blocks, batch = 64, 128, 7
    key_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator)
    value_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator)
    lengths = torch.tensor([1, 5, block_size, block_size + 1, 3 * block_size - 1, 40, 2])
    width = int((lengths.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=generator)[:batch * width].view(batch, width)
    query = torch.randn(batch, heads, dim, generator=generator)
    out = torch.empty_like(query)
    kernels.decode_attention(query, key_cache, value_cache, tables, lengths, dim**-0.5, out)

    keys = key_cache.index_select(1, tables.reshape(-1)).view(kv_heads, batch, -1, dim).transpose(0, 1)
    values = value_cache.index_select(1, tables.reshape(-1)).view(kv_heads, batch, -1, dim).transpose(0, 1)
    mask = (torch.arange(width * block_size)[None, :] < lengths[:, None])[:, None, None, :]
    expected = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=mask,
                                              scale=dim**-0.5, enable_gqa=heads != kv_heads).squeeze(2)
    assert torch.allclose(out, expected, atol=1e-5)
