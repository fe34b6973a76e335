"""Multi-LoRA serving on the model side: reading PEFT adapters and the LoRA-aware linear layers.

`read_peft_adapter` turns an adapter directory (adapter_config.json + adapter_model.safetensors, as
`kvik train` and PEFT's save_pretrained write it) into per-module A/B matrices; `enable_lora` swaps a
loaded model's target linears for `LoRALinear`s that add every token's own adapter in a mixed batch.
The engine (kvik.engine.lora_manager) decides which adapter sits in which slot.
"""

from kvik.model.lora.adapter import LoRAAdapterWeights, read_peft_adapter
from kvik.model.lora.layers import LoRAContext, LoRALinear, LoRAModel, enable_lora

__all__ = ["LoRAAdapterWeights", "LoRAContext", "LoRALinear", "LoRAModel", "enable_lora", "read_peft_adapter"]
