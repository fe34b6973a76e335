"""The llama.cpp comparison's pure parts (the runs themselves need a llama.cpp build and are not in CI):
pair selection, kvik flags from engine arguments, and ratios that read "> 1: kvik ahead"."""

from __future__ import annotations

import json

import pytest

from kvik.bench.llamacpp.harness import PAIRS, format_result, ratio_rows, select_pairs
from kvik.bench.llamacpp.measure import engine_flags


def test_engine_arguments_become_kvik_serve_flags():
    assert engine_flags({"dtype": "bfloat16", "kv_cache_memory": "2GiB", "enforce_eager": True,
                         "quantization": None}) == [
        "--dtype", "bfloat16", "--kv-cache-memory", "2GiB", "--enforce-eager"]


def test_pairs_are_chosen_by_name_or_read_from_a_file(tmp_path):
    assert [p["name"] for p in select_pairs(None, None)] == ["bf16 vs f16", "int8 vs q8_0", "int4 vs q4_0"]
    assert select_pairs("bf16 vs f16, int8 vs q8_0", None) == [PAIRS[1], PAIRS[2]]
    with pytest.raises(ValueError, match="unknown pair"):
        select_pairs("fp8 vs q8_0", None)
    own = [{"name": "mine", "gguf": "q4_k_m", "kvik": {"quantization": "int4", "group_size": 64}}]
    (tmp_path / "pairs.json").write_text(json.dumps(own))
    assert select_pairs(None, str(tmp_path / "pairs.json")) == own


def test_every_ratio_reads_greater_than_one_when_kvik_is_ahead():
    served = {"1": {"p50_ttft_ms": 50.0, "p99_ttft_ms": 80.0, "p50_tpot_ms": 10.0}}
    slower = {"1": {"p50_ttft_ms": 100.0, "p99_ttft_ms": 400.0, "p50_tpot_ms": 20.0}}
    result = {"model": "reference", "pair": PAIRS[0], "gguf": "/x/ref-f32.gguf",
              "kvik": {"decode_tokens_per_second": 90.0, "prompt_tokens_per_second": 1500.0,
                       "offline": {"tokens_per_second": 1000.0}, "served": served},
              "llamacpp": {"decode_tokens_per_second": 60.0, "prompt_tokens_per_second": 1000.0,
                           "offline": {"tokens_per_second": 500.0}, "served": slower}}
    ratios = {name: ratio for name, _, _, ratio in ratio_rows(result)}
    assert ratios == {"decode tg128, tok/s": 1.5, "prompt pp512, tok/s": 1.5,
                      "offline 32 req, total tok/s": 2.0, "served c=1 TTFT p50, ms": 2.0,
                      "served c=1 TTFT p99, ms": 5.0, "served c=1 TPOT p50, ms": 2.0}
    printed = "\n".join(format_result(result))
    assert "ref-f32.gguf" in printed and "1.50x" in printed


def test_ratios_are_plotted_per_model(tmp_path):
    """The run ends with a plot of every ratio per model and pair (the figures people look at)."""
    pytest.importorskip("matplotlib")
    from kvik.bench.llamacpp.harness import plot_ratios, target

    served = {"1": {"p50_ttft_ms": 50.0, "p99_ttft_ms": 80.0, "p50_tpot_ms": 10.0}}
    results = [{"model": model, "pair": pair, "gguf": f"/x/{model}.gguf",
                "kvik": {"decode_tokens_per_second": 90.0, "prompt_tokens_per_second": 1500.0,
                         "offline": {"tokens_per_second": 1000.0}, "served": served},
                "llamacpp": {"decode_tokens_per_second": 60.0, "prompt_tokens_per_second": 1000.0,
                             "offline": {"tokens_per_second": 500.0}, "served": served}}
               for model in ("reference", "smollm2") for pair in PAIRS[:2]]
    out = plot_ratios(results, tmp_path / "ratios.svg")
    text = out.read_text()
    assert text.startswith("<?xml") and "reference, same GGUF file" in text and "smollm2" in text
    assert target("decode tg128, tok/s") == 1.1 and target("served c=1 TTFT p50, ms") == 1.5
