"""Training behind `kvik train`: causal-LM pretraining on `kvik data` shards, supervised
fine-tuning on chat JSONL, LoRA through PEFT; one process or many under torchrun (DDP, FSDP2);
atomic checkpoints with exact resume. Writes HF-format directories that `kvik serve` loads.

`kvik.train.demo.trained_demo_model_path()` is cheap to import (no torch): the server uses it to
find the Shakespeare demo model.
"""
