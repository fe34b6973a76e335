"""`kvik bench compare --device/--dtype`: the flags resolve `auto` as kvik's engine does, and the
offline systems, the single-stream decode and the model shape follow the dtype. Run on the CPU
(bfloat16 weights there); the CUDA-only branches are covered where they are pure formatting."""

from __future__ import annotations

import json

import pytest
import torch

from kvik.bench.compare import CompareConfig, offline_lines, run_system, single_stream_decode
from kvik.bench.offline import random_workload, resolve_device_dtype, run_hf_static, run_kvik
from kvik.bench.roofline import ModelShape, Roofline
from kvik.cli.bench import compare_config
from kvik.cli.main import build_parser, main

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks cuda on this machine")


def parse_compare(*flags: str):
    return build_parser().parse_args(["bench", "compare", "--model", "unused", *flags])


@needs_cpu_only
def test_auto_resolves_to_the_cpu_in_float32_without_a_gpu():
    config = compare_config(parse_compare())
    assert (config.device, config.dtype) == ("cpu", "float32")
    assert resolve_device_dtype() == ("cpu", "float32")


def test_explicit_device_and_dtype_reach_the_config():
    config = compare_config(parse_compare("--device", "cpu", "--dtype", "bfloat16"))
    assert (config.device, config.dtype) == ("cpu", "bfloat16")
    args = build_parser().parse_args(["bench", "offline", "--device", "cpu", "--dtype", "float16"])
    assert (args.device, args.dtype) == ("cpu", "float16")


def test_unknown_dtype_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_compare("--dtype", "int8")
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@needs_cpu_only
def test_cuda_without_a_gpu_is_a_clean_error(capsys):
    assert main(["bench", "compare", "--model", "unused", "--device", "cuda"]) == 2
    assert "cuda" in capsys.readouterr().err


def test_bytes_per_param_follow_the_dtype(tiny_llama):
    shapes = {dtype: ModelShape.from_model_dir(str(tiny_llama), dtype)
              for dtype in ("float32", "bfloat16", "float16")}
    assert [shapes[d].bytes_per_param for d in ("float32", "bfloat16", "float16")] == [4, 2, 2]
    assert ModelShape.from_model_dir(str(tiny_llama)).bytes_per_param == 4  # the default, as before
    assert shapes["bfloat16"].decode_bytes_per_token() * 2 == shapes["float32"].decode_bytes_per_token()


def test_decode_in_bfloat16_reports_a_fraction(tiny_llama):
    bytes_per_token = ModelShape.from_model_dir(str(tiny_llama), "bfloat16").decode_bytes_per_token()
    result = single_stream_decode(str(tiny_llama), bytes_per_token, prompt_len=8, tokens=8, windows=2,
                                  device="cpu", dtype="bfloat16")
    assert result["decode_bandwidth_fraction"] > 0 and len(result["window_fractions"]) == 2


@pytest.fixture(scope="module")
def workload(tiny_llama):
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    return random_workload(3, (4, 9), (2, 5), seed=1, vocab=vocab)


def test_hf_static_in_bfloat16(tiny_llama, workload):
    result = run_hf_static(str(tiny_llama), workload, batch_size=2, device="cpu", dtype="bfloat16")
    assert result.output_tokens == workload.output_tokens
    assert result.prompt_tokens == workload.prompt_tokens
    # Two batches, each run to its longest request.
    longest = [max(workload.max_tokens[:2]), workload.max_tokens[2]]
    assert result.extra["computed_output_tokens"] == 2 * longest[0] + longest[1]
    assert (result.device, result.dtype, result.peak_device_bytes) == ("cpu", "bfloat16", None)


def test_kvik_in_bfloat16(tiny_llama, workload):
    result = run_kvik(str(tiny_llama), workload, {"show_progress": False, "kv_cache_memory": 2**24,
                                                  "device": "cpu", "dtype": "bfloat16"})
    assert result.output_tokens == workload.output_tokens
    assert (result.device, result.dtype, result.peak_device_bytes) == ("cpu", "bfloat16", None)
    assert result.extra["engine_args"]["dtype"] == "bfloat16"


def test_a_child_system_gets_the_device_and_dtype(tiny_llama, tmp_path):
    config = CompareConfig(str(tiny_llama), num_requests=2, input_len_range=(4, 6), output_len_range=(2, 3),
                           kv_cache_memory=2**24, device="cpu", dtype="bfloat16")
    result = run_system(config, "kvik", tmp_path)
    assert (result["device"], result["dtype"]) == ("cpu", "bfloat16")
    assert result["extra"]["engine_args"]["device"] == "cpu"


def fake_result(seconds: float, peak_device: int | None) -> dict:
    return {"useful_tokens_per_second": 1000 / seconds, "output_tokens_per_second": 100 / seconds,
            "seconds": seconds, "peak_rss_bytes": 2**30, "peak_device_bytes": peak_device,
            "extra": {"weight_bytes": 2**28}}


def test_cuda_lines_hold_device_memory_against_the_budget(tiny_llama):
    config = CompareConfig(str(tiny_llama), num_requests=2, input_len_range=(4, 6), output_len_range=(2, 3),
                           kv_cache_memory=2**30, device="cuda", dtype="bfloat16")
    shape = ModelShape.from_model_dir(str(tiny_llama), "bfloat16")
    roofline = Roofline(7e14, 4e12, 4e12, 16, device="cuda", device_name="NVIDIA H200", matmul_dtype="bfloat16")
    assert roofline.describe().startswith("roofline (cuda, NVIDIA H200): matmul 700.0 TFLOP/s bf16, read 4000.0 GB/s")
    summary: dict[str, float] = {}
    results = {"kvik": fake_result(1.0, 2**30 + 2**28),
               "hf-static": fake_result(4.0, 2**29)}
    lines = offline_lines(config, shape, roofline, results, summary)
    assert lines[0].startswith("\noffline (cuda, bfloat16)")
    assert "device 1.25 GiB" in lines[1]
    assert summary["memory_ratio"] == 1.0  # device peak / (weights + KV), not RSS
    assert any(line.strip().startswith("peak device memory") for line in lines)
    assert any("kvik FLOP/s (" in line and " T) / matmul roofline" in line for line in lines)


def test_cpu_lines_read_as_before(tiny_llama):
    config = CompareConfig(str(tiny_llama), kv_cache_memory=2**30, device="cpu", dtype="float32")
    shape = ModelShape.from_model_dir(str(tiny_llama))
    roofline = Roofline(2e11, 3e10, 3e10, 2)
    assert roofline.describe() == "roofline: matmul 200.0 GFLOP/s, read 30.0 GB/s, copy 30.0 GB/s (2 threads)"
    summary: dict[str, float] = {}
    lines = offline_lines(config, shape, roofline, {"kvik": fake_result(1.0, None)}, summary)
    assert lines[0].startswith("\noffline (useful")
    assert "device" not in lines[1]
    assert summary["memory_ratio"] == 2**30 / (2**28 + 2**30)
    assert any(line.strip().startswith("peak RSS while generating") for line in lines)


@needs_cpu_only
def test_kvik_alone_keeps_its_own_auto_dtype(tiny_llama, tmp_path):
    """`kvik bench offline` without --dtype: kvik gets auto (which also keeps a quantized checkpoint's
    format), on the resolved device, as before the flags existed."""
    from kvik.bench.offline import main as offline_main

    out = tmp_path / "kvik.json"
    assert offline_main(["--system", "kvik", "--model", str(tiny_llama), "--num-requests", "2",
                         "--input-len-range", "4,6", "--output-len-range", "2,3",
                         "--engine-args", json.dumps({"kv_cache_memory": 2**24}), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["extra"]["engine_args"]["dtype"] == "auto" and result["device"] == "cpu"
