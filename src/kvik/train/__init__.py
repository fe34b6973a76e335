"""Training behind `kvik train`: causal-LM pretraining on `kvik data` shards, supervised
fine-tuning on chat JSONL, reward models, DPO (and IPO, SimPO) on comparisons, PPO and GRPO with
rollouts from kvik's engine; LoRA through PEFT; one process or many under torchrun (DDP, FSDP2);
atomic checkpoints with exact resume. Writes HF-format directories that `kvik serve` loads. Each
task is a module of its own (lm, reward, dpo, ppo) behind the interface in `kvik.train.task`.

`kvik.train.demo.trained_demo_model_path()` is cheap to import (no torch): the server uses it to
find the Shakespeare demo model.
"""
