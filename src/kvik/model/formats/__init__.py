"""Checkpoint formats beyond plain HF safetensors: GGUF files and GPTQ/AWQ int4 checkpoints, each
read into the HF checkpoint names kvik's models load, dequantized to the serving dtype."""
