"""kvik against llama.cpp on the same GGUF files (not part of CI: llama.cpp is built by
bench/llamacpp/build.sh in a scratch directory, and this package drives its binaries).

- `ggufs`: the GGUF files of a model, converted by llama.cpp's own convert_hf_to_gguf.py and
  llama-quantize;
- `measure`: each workload on each engine (llama-bench, llama-server; kvik's engine and kvik serve);
- `harness`: the precision pairs, run side by side, printed as ratios.
"""
