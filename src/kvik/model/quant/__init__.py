"""Weight-only quantization as a model -> model pass: bfloat16, int8 per output channel, int4 per group.

`quantize_model(model, QuantScheme("int4", group_size=64))` swaps every nn.Linear for a
WeightOnlyLinear; the model files know nothing of it. `resolve_precision` decides what a device
computes in for a requested dtype and quantization. Plain-PyTorch definitions of each format are in
`reference`, the blocked layout the CPU kernels read in `packing`; pre-quantized checkpoints' own int4
codes reach the same layers through `prequantized`.
"""

from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.quant.quantize import quantize_model
from kvik.model.quant.scheme import (Precision, QuantScheme, cpu_has_native_bf16, int8_activations,
                                     keeps_checkpoint_int4, resolve_precision)

__all__ = ["Precision", "QuantScheme", "WeightOnlyLinear", "cpu_has_native_bf16", "int8_activations",
           "keeps_checkpoint_int4", "quantize_model", "resolve_precision"]
