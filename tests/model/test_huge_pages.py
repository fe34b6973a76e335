"""Weights copied onto huge-page arenas (kvik.model.huge_pages): same outputs, every holder of a
tensor (the compiled kernels included) reads the copy, shared storage stays shared."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvik.model.huge_pages import HUGE_PAGE, MIN_TENSOR_BYTES, huge_page_empty, move_to_huge_pages
from kvik.model.layers.cpu_kernels import cpu_kernels
from kvik.model.quant.linear import WeightOnlyLinear


def test_an_arena_starts_on_a_huge_page() -> None:
    buffer = huge_page_empty(3 * HUGE_PAGE + 5)
    assert buffer.numel() == 3 * HUGE_PAGE + 5 and buffer.data_ptr() % HUGE_PAGE == 0


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 128)  # 150 KiB: moved
        self.head = nn.Linear(128, 300, bias=False)
        self.head.weight = self.embed.weight  # tied (one Parameter): moved once, still tied
        self.norm = nn.Parameter(torch.randn(128))  # small: stays
        self.proj = nn.Linear(256, 512)  # 512 KiB weight: moved
        self.view_a = nn.Parameter(torch.randn(64, 1024))
        self.view_b = nn.Parameter(self.view_a.data[:32])  # a view of another's storage: both stay


def test_moved_weights_keep_their_values_and_shared_ones_stay_shared() -> None:
    torch.manual_seed(0)
    model = Tiny()
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    addresses = {name: t.data_ptr() for name, t in model.state_dict().items()}
    moved = move_to_huge_pages(model)
    after = model.state_dict()
    assert moved == (512 * 256 + 300 * 128) * 4
    assert all(torch.equal(after[name], before[name]) for name in before)
    for name in ("proj.weight", "embed.weight"):
        assert after[name].data_ptr() != addresses[name], name
    for name in ("norm", "view_a", "view_b", "proj.bias"):
        assert after[name].data_ptr() == addresses[name], name
    assert model.head.weight is model.embed.weight
    assert model.view_b.data_ptr() == model.view_a.data_ptr()
    assert model.proj.weight.numel() * 4 >= MIN_TENSOR_BYTES and isinstance(model.proj.weight, nn.Parameter)


def test_the_compiled_kernel_reads_the_moved_copy() -> None:
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ toolchain")
    torch.manual_seed(1)
    holder = nn.Sequential(WeightOnlyLinear.from_linear(nn.Linear(512, 1024), "int8", 32, False))
    layer = holder[0]
    layer.enable_kernels(kernels)
    x = torch.randn(1, 512)
    with torch.inference_mode():
        expected = layer(x)
    old = layer.data.data_ptr()
    assert move_to_huge_pages(holder) > 0 and layer.data.data_ptr() != old
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)
        layer.data.zero_()  # in place, as weight sync writes: the kernel sees it
        assert torch.equal(layer(x), layer.bias.expand(1, -1))
