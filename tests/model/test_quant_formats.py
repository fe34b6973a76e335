"""Weight formats in plain PyTorch: quantize/dequantize round trips, checked against the formats'
definitions written out independently here, and the blocked packing the CPU kernels read."""

from __future__ import annotations

import pytest
import torch

from kvik.model.quant import packing
from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.quant.reference import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8


def weight(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, columns, generator=generator) * 0.05
    w[3, 5] = 0.9  # an outlier: its row's scale must still cover it
    w[7] = 0.0  # an all-zero row: scale 0, values 0, no NaN
    return w


def test_int8_matches_its_definition():
    w = weight(40, 96)
    q = quantize_int8(w)
    # Independent definition: per row, s = max|w| / 127, q = round(w / s).
    for row in (0, 3, 39):
        s = w[row].abs().max() / 127
        assert torch.isclose(q.scales[row], s)
        assert torch.equal(q.values[row], torch.round(w[row] / s).to(torch.int8))
    assert q.values.abs().max() <= 127 and q.values[3, 5] == 127
    assert torch.equal(q.values[7], torch.zeros(96, dtype=torch.int8)) and q.scales[7] == 0
    error = (dequantize_int8(q) - w).abs()
    assert torch.all(error <= q.scales[:, None] / 2 + 1e-7)


@pytest.mark.parametrize("group_size", [32, 128])
def test_int8_with_groups_matches_its_definition(group_size):
    columns = 200  # the last group is short
    w = weight(24, columns, seed=group_size)
    q = quantize_int8(w, group_size)
    groups = -(-columns // group_size)
    assert q.group_size == group_size and q.scales.shape == (24, groups) and q.scales.dtype == torch.float16
    restored = dequantize_int8(q)
    # Independent definition: per row and group, s = float16(max|w| / 127), q = round(w / s).
    for row in (0, 3, 7, 23):
        for g in range(groups):
            part = w[row, g * group_size:(g + 1) * group_size]
            s = float(torch.tensor(float(part.abs().max()) / 127).half())
            assert float(q.scales[row, g]) == s
            expected = torch.zeros_like(part) if s == 0 else torch.clamp(torch.round(part / s), -127, 127)
            assert torch.equal(q.values[row, g * group_size:(g + 1) * group_size], expected.to(torch.int8))
            assert torch.all((restored[row, g * group_size:(g + 1) * group_size] - part).abs() <= s / 2 * 1.01 + 1e-7)
    # A scale per group is never worse than one per row: the row's step bounds every group's.
    assert (restored - w).pow(2).mean() < (dequantize_int8(quantize_int8(w)) - w).pow(2).mean()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("zero_point", [False, True])
def test_int4_matches_its_definition(group_size, zero_point):
    columns = 200  # not a multiple of any group size: the last group is short
    w = weight(24, columns, seed=group_size)
    q = quantize_int4(w, group_size, zero_point)
    groups = -(-columns // group_size)
    assert q.values.shape == (24, columns) and q.scales.shape == (24, groups)
    assert q.values.dtype == torch.uint8 and int(q.values.max()) <= 15
    restored = dequantize_int4(q)
    for row in (0, 3, 23):
        for g in range(groups):
            part = w[row, g * group_size:(g + 1) * group_size]
            s = float(q.scales[row, g])
            if zero_point:
                low, high = min(float(part.min()), 0.0), max(float(part.max()), 0.0)
                assert s == pytest.approx((high - low) / 15, rel=1e-3)  # float16 rounding
                z = round(-low / s)
                expected = (torch.clamp(torch.round(part / s) + z, 0, 15) - z) * s
                assert float(q.offsets[row, g]) == pytest.approx(-z * s, rel=1e-3, abs=1e-7)
            else:
                assert s == pytest.approx(float(part.abs().max()) / 7, rel=1e-3)
                expected = torch.clamp(torch.round(part / s), -8, 7) * s
            got = restored[row, g * group_size:(g + 1) * group_size]
            # The offset -z * s is stored as float16: off by up to 15 s * 2**-11.
            assert torch.allclose(got, expected, rtol=1e-3, atol=0.008 * s + 1e-7)
            # Every weight within half a step (plus float16 rounding of the scale and offset).
            assert torch.all((got - part).abs() <= s / 2 * 1.01 + 1e-6)
    assert torch.equal(restored[7], torch.zeros(columns))


def test_int4_error_is_smaller_with_smaller_groups():
    w = weight(64, 256)
    errors = [float((dequantize_int4(quantize_int4(w, g)) - w).pow(2).mean()) for g in (32, 64, 128)]
    assert errors[0] < errors[1] < errors[2]
    assert float((dequantize_int8(quantize_int8(w)) - w).pow(2).mean()) < errors[0] / 50


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_blocked_packing_round_trips(rows):
    w = weight(max(rows, 8), 70)[:rows]
    assert torch.equal(packing.unpack_bfloat16(packing.pack_bfloat16(w), rows), w.to(torch.bfloat16))

    q8 = quantize_int8(w)
    data, scales = packing.pack_int8(q8)
    assert data.shape == (packing.num_blocks(rows), 70, 16) and scales.shape == (packing.num_blocks(rows) * 16,)
    back = packing.unpack_int8(data, scales, rows)
    assert torch.equal(back.values, q8.values) and torch.equal(back.scales, q8.scales)

    q8 = quantize_int8(w, 32)
    data, scales = packing.pack_int8(q8)
    assert scales.shape == (packing.num_blocks(rows), 3, 16) and scales.dtype == torch.float16
    back = packing.unpack_int8(data, scales, rows, 32)
    assert torch.equal(back.values, q8.values) and torch.equal(back.scales, q8.scales)

    for zero_point in (False, True):
        q4 = quantize_int4(w, 32, zero_point)
        data, scales, offsets = packing.pack_int4(q4)
        assert data.shape == (packing.num_blocks(rows), 9, 64) and data.dtype == torch.uint8  # 70 inputs: 9 chunks
        back = packing.unpack_int4(data, scales, offsets, rows, 70, 32)
        assert torch.equal(back.values, q4.values) and torch.equal(back.scales, q4.scales)
        assert (back.offsets is None) == (not zero_point)


def test_int4_chunks_hold_each_rows_inputs_in_one_lane():
    """Byte 4j + i of chunk c: row j's input 8c + i in the low nibble, 8c + 4 + i in the high one."""
    rows, columns = 16, 12
    values = ((torch.arange(rows)[:, None] + torch.arange(columns)[None, :]) % 16).to(torch.uint8)
    q = quantize_int4(torch.zeros(rows, columns), 32)
    q.values = values
    data, _, _ = packing.pack_int4(q)
    assert data.shape == (1, 2, 64)
    for c in range(2):
        for j in range(rows):
            for i in range(4):
                low = values[j, 8 * c + i].item() if 8 * c + i < columns else 0
                high = values[j, 8 * c + 4 + i].item() if 8 * c + 4 + i < columns else 0
                assert data[0, c, 4 * j + i].item() == low | (high << 4), (c, j, i)


def test_an_unknown_format_name_is_refused():
    # "bf16" once packed the layer as int4 without a word.
    with pytest.raises(ValueError, match="bf16.*bfloat16, int8, int4"):
        WeightOnlyLinear.from_linear(torch.nn.Linear(64, 32), "bf16")
