"""A greedy step's LM head read from its int8 copy (kvik.model.transforms.screened_head): the index
must be the full bfloat16 product's argmax, bit for bit, on inputs built to make the copy lie."""

from __future__ import annotations

import pytest
import torch

from kvik.model.layers.cpu_kernels import cpu_kernels
from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.transforms.onednn_linear import OneDNNLinear, onednn_available, packed_gemv_layout
from kvik.model.transforms.screened_head import build_screened_head, drop_screen, screen_for


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels()
    if k is None or not hasattr(k, "screened_argmax"):
        pytest.skip("compiled CPU kernels unavailable")
    return k


def bf16_head(weight: torch.Tensor, kernels) -> WeightOnlyLinear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.float()
    head = WeightOnlyLinear.from_linear(linear, "bfloat16")
    head.enable_kernels(kernels)
    return head


def check(kernels, head, screen, x) -> int:
    """Screened against full on x; returns the blocks computed exactly (-1: it fell back)."""
    full = kernels.argmax_rows(head.kernel_weight()(x))
    got, blocks = kernels.screened_argmax(x, head.kernel_weight(), screen.coarse, screen.bound)
    assert got.tolist() == full.tolist()
    return blocks


@pytest.mark.parametrize("int8_activations", [True, False])
@pytest.mark.parametrize("vocab,hidden", [(1000, 64), (333, 72), (4096, 256)])
def test_the_index_is_the_full_products(kernels, vocab, hidden, int8_activations):
    g = torch.Generator().manual_seed(vocab + hidden)
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    weight[5] *= 40  # a row with a large scale, so a large rounding error
    weight[7] = 0.0
    head = bf16_head(weight, kernels)
    screen = build_screened_head(head, kernels)
    screen.coarse.allow_int8_activations = int8_activations
    computed = []
    for trial in range(60):
        rows = 1 + trial % 8
        x = torch.randn(rows, hidden, generator=g) * (0.01, 1.0, 30.0)[trial % 3]
        if trial % 4 == 1:
            x[:, trial % hidden] = 500.0  # an outlier input: the int8 activations' steps are coarse
        blocks = check(kernels, head, screen, x)
        assert blocks >= 0  # screened, not the fallback
        computed.append(blocks / -(-rows // 4))  # per pass of four rows
    blocks_total = -(-vocab // 16)
    assert sorted(computed)[len(computed) // 2] < blocks_total / 2  # most blocks skipped


@pytest.mark.parametrize("vocab,hidden", [(1000, 64), (333, 72), (4099, 256)])
def test_a_packed_float32_head_gives_the_full_products_index(kernels, vocab, hidden):
    if not onednn_available():
        pytest.skip("no oneDNN")
    g = torch.Generator().manual_seed(vocab)
    linear = torch.nn.Linear(hidden, vocab, bias=False)
    linear.weight.data = torch.randn(vocab, hidden, generator=g) * 0.05
    linear.weight.data[9] *= 40
    head = OneDNNLinear(linear)
    layout = packed_gemv_layout(vocab, hidden)
    if layout is None or not head.enable_gemv(kernels, layout):
        pytest.skip("the packed GEMV does not take this shape here")
    address, _, in_stride, block, _ = head.gemv_spec()
    dense = kernels.unpack_packed_float32(address, vocab, hidden, in_stride, block)
    assert torch.equal(dense, linear.weight.data)  # the bound is computed on the weights it serves
    screen = build_screened_head(head, kernels)
    computed = []
    for trial in range(40):
        rows = 1 + trial % 4  # one pass of rows: more take the full product (checked below)
        x = torch.randn(rows, hidden, generator=g) * (0.01, 1.0, 30.0)[trial % 3]
        if trial % 4 == 1:
            x[:, trial % hidden] = 500.0
        blocks = check(kernels, head, screen, x)
        assert blocks >= 0
        computed.append(blocks / -(-rows // 4))
    assert sorted(computed)[len(computed) // 2] < -(-vocab // layout[0]) / 2
    assert check(kernels, head, screen, torch.randn(8, hidden, generator=g)) == -1


def test_a_dropped_screen_stays_dropped(kernels):
    head = bf16_head(torch.randn(100, 32) * 0.1, kernels)
    assert screen_for(head, kernels) is not None
    drop_screen(head)  # weight sync: the weights changed under the copy
    assert screen_for(head, kernels) is None


def test_ties_and_near_ties_go_to_the_first_index(kernels):
    # Tie-breaking, not the bound: the tied rows round to the same codes, so the copy cannot order them.
    g = torch.Generator().manual_seed(1)
    hidden = 128
    weight = torch.randn(512, hidden, generator=g) * 0.02
    best = torch.randn(hidden, generator=g)
    weight[400] = best * 0.5
    weight[100] = weight[400]  # an exact tie: the full argmax answers 100
    # Rows a bfloat16 step away from it: the copy rounds them all alike, only W tells them apart.
    for j, row in enumerate((37, 250, 511)):
        near = (best * 0.5).bfloat16().float()
        near[j] = torch.nextafter(near[j].bfloat16(), torch.tensor(10.0).bfloat16()).float()
        weight[row] = near
    head = bf16_head(weight, kernels)
    screen = build_screened_head(head, kernels)
    for sign in (1.0, -1.0):
        for rows in (1, 3, 8):
            x = (best * sign).repeat(rows, 1) + torch.randn(rows, hidden, generator=g) * 1e-3
            assert check(kernels, head, screen, x) >= 0
    zero = torch.zeros(2, hidden)  # every logit 0: index 0
    assert check(kernels, head, screen, zero) >= 0


def test_non_finite_inputs_take_the_full_product(kernels):
    head = bf16_head(torch.randn(300, 64) * 0.1, kernels)
    screen = build_screened_head(head, kernels)
    for value in (float("nan"), float("inf")):
        x = torch.randn(2, 64)
        x[1, 3] = value
        assert check(kernels, head, screen, x) == -1


def test_only_a_bfloat16_head_without_bias_gets_a_copy(kernels, monkeypatch):
    weight = torch.randn(64, 32) * 0.1
    linear = torch.nn.Linear(32, 64)
    with_bias = WeightOnlyLinear.from_linear(linear, "bfloat16")
    with_bias.enable_kernels(kernels)
    assert build_screened_head(with_bias, kernels) is None
    int8 = WeightOnlyLinear.from_linear(torch.nn.Linear(32, 64, bias=False), "int8")
    int8.enable_kernels(kernels)
    assert build_screened_head(int8, kernels) is None
    monkeypatch.setenv("KVIK_SCREENED_HEAD", "0")
    assert build_screened_head(bf16_head(weight, kernels), kernels) is None
    monkeypatch.delenv("KVIK_SCREENED_HEAD")
    screen = build_screened_head(bf16_head(weight, kernels), kernels)
    assert screen is not None and screen.bound.shape == (2, 64) and bool((screen.bound > 0).all())
    with pytest.raises(RuntimeError, match="bound must be"):
        kernels.screened_argmax(torch.randn(1, 32), bf16_head(weight, kernels).kernel_weight(), screen.coarse,
                                screen.bound[0].contiguous())
