"""The weight-only kernels' prefetch distance: it changes no result, and the load-time tuning sets it
from KVIK_WEIGHT_PREFETCH or from timing the model's own weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvik.model.layers.cpu_kernels import cpu_kernels
from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.transforms.prefetch import CANDIDATES, tune_weight_prefetch


@pytest.fixture()
def kernels(monkeypatch):
    module = cpu_kernels()
    if module is None:
        pytest.skip("no C++ toolchain: the PyTorch path is used instead")
    monkeypatch.delenv("KVIK_WEIGHT_PREFETCH", raising=False)
    before = module.weight_prefetch_bytes()
    yield module
    module.set_weight_prefetch_bytes(before)  # one setting per process: leave it as found


def linears(kernels, kind: str, shapes, group: int | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    layers = nn.Sequential(*(WeightOnlyLinear.from_linear(nn.Linear(i, o, bias=False), kind, group)
                             for o, i in shapes))
    for layer in layers:
        layer.enable_kernels(kernels)
    return layers


@pytest.mark.parametrize("kind,group", [("bfloat16", 0), ("int8", 0), ("int8", 32), ("int4", 64)])
def test_distance_changes_no_result(kernels, kind, group):
    """1-4 rows (the decode kernels), 5-15 (passes of four) and 40 (tiles or the VNNI prompt path),
    on every distance from none to far past the end of the weight: the same bits."""
    layer = linears(kernels, kind, [(96, 256)], group)[0]
    x = torch.randn(40, 256)
    outputs = {}
    for ahead in (0, 64, 1024, 4096, 2**20):
        kernels.set_weight_prefetch_bytes(ahead)
        assert kernels.weight_prefetch_bytes() == ahead
        outputs[ahead] = [layer(x[:rows]) for rows in (1, 3, 4, 7, 40)]
    for ahead, result in outputs.items():
        for got, want in zip(result, outputs[0]):
            assert torch.equal(got, want), ahead


@pytest.mark.parametrize("bad", [-1, 2**20 + 1])
def test_distance_out_of_range_is_refused(kernels, bad):
    with pytest.raises(RuntimeError, match="0 to 1 MiB"):
        kernels.set_weight_prefetch_bytes(bad)


def test_tuning_times_every_candidate_and_keeps_the_fastest(kernels):
    model = linears(kernels, "int8", [(256, 512), (512, 256)] * 3)
    choice = tune_weight_prefetch(model, kernels, min_bytes=0, rounds=3)
    assert choice.source == "measured"
    assert set(choice.gbps) == set(CANDIDATES) and all(rate > 0 for rate in choice.gbps.values())
    assert choice.bytes_ahead == max(choice.gbps, key=choice.gbps.get)  # fastest = most GB/s
    assert kernels.weight_prefetch_bytes() == choice.bytes_ahead
    assert "measured" in choice.describe() and "GB/s" in choice.describe()


def test_small_models_keep_the_distance(kernels):
    """Weights that fit in cache would be timed from cache: nothing is measured or changed."""
    kernels.set_weight_prefetch_bytes(2048)
    choice = tune_weight_prefetch(linears(kernels, "int4", [(64, 128)]), kernels)
    assert choice.bytes_ahead == 2048 and choice.source.startswith("kept") and not choice.gbps
    assert kernels.weight_prefetch_bytes() == 2048


def test_environment_sets_the_distance(kernels, monkeypatch):
    model = linears(kernels, "int8", [(64, 128)])
    monkeypatch.setenv("KVIK_WEIGHT_PREFETCH", "512")
    choice = tune_weight_prefetch(model, kernels, min_bytes=0)
    assert (choice.bytes_ahead, choice.source) == (512, "KVIK_WEIGHT_PREFETCH")
    assert kernels.weight_prefetch_bytes() == 512
    for bad in ("lots", "-5", "4194304"):
        monkeypatch.setenv("KVIK_WEIGHT_PREFETCH", bad)
        with pytest.raises(ValueError, match="KVIK_WEIGHT_PREFETCH.*byte count"):
            tune_weight_prefetch(model, kernels)
    assert kernels.weight_prefetch_bytes() == 512


def test_nothing_to_tune(kernels):
    assert tune_weight_prefetch(nn.Sequential(nn.Linear(8, 8)), kernels) is None
    assert tune_weight_prefetch(linears(kernels, "int8", [(64, 128)]), None) is None


def test_the_tuning_threshold_is_above_the_last_level_cache():
    from kvik.model.transforms.prefetch import last_level_cache_bytes, min_tuning_bytes

    assert last_level_cache_bytes() >= 2**20 and min_tuning_bytes() > last_level_cache_bytes()
