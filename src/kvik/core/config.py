"""Engine configuration: one dataclass of user-facing arguments, validated once.

`EngineArgs` is what `LLM(model=..., **engine_args)` and the `kvik serve` flags fill in. The engine
resolves the values that depend on the model or the hardware (`max_model_len`, the device, the dtype,
the number of KV blocks) at start-up and records them on itself.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from typing import Any

from kvik.core.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("int8", "int4")
QUANTIZATION_GROUP_SIZES = (0, 32, 64, 128)  # 0: int8 only, a scale per output channel
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8")
ACTIVATIONS = ("auto", "float32", "int8")
SPECULATIVE_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
MAX_SCHEDULER_STEPS = 64
DEFAULT_SCHEDULER_STEPS = 8
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class EngineArgs:
    model: str
    tokenizer: str | None = None  # defaults to the model's directory
    revision: str | None = None  # hub revision when `model` is a hub id
    device: str = "auto"  # auto: CUDA when available, else CPU
    # auto: bfloat16 (float16 without bf16 support) on CUDA, float32 on CPU; a pre-quantized
    # checkpoint keeps its int4 layers under auto only (kvik.model.quant.keeps_checkpoint_int4).
    dtype: str = "auto"
    # Weight-only quantization at load: int8 or int4, a scale per group of inputs (int8: or per
    # output channel).
    quantization: str | None = None
    # Inputs per scale: int4 32/64/128 (None: 64); int8 32/64/128 or 0, one per output channel (None: 32).
    quantization_group_size: int | None = None
    quantization_zero_point: bool = False  # int4: asymmetric groups with a zero point
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; int8 has a scale per token and head
    # Inputs of int8/int4 linear layers on AVX512-VNNI CPUs: int8 (rounded per 32 inputs) or float32;
    # auto: int8 when --quantization is set, float32 for a checkpoint's int4 layers served as they are.
    activations: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16  # tokens per KV block
    # KV cache budget: bytes when set, else this fraction of free device memory (after the weights).
    kv_cache_memory: int | None = None
    kv_cache_fraction: float | None = None
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int | None = None  # per-step token budget; default 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Multi-step decoding: forwards a decode step may run back to back, each sampling from the one
    # before, before the scheduler runs again (kvik.engine.multi_step). Saves the per-token Python
    # bookkeeping; tokens then reach clients in groups of up to this many. None: 8, or 1 with
    # speculative decoding or LoRA, which it does not combine with (scheduler_steps()).
    num_scheduler_steps: int | None = None
    threads: int | None = None  # CPU intra-op threads; default: torch's choice
    # CUDA: run every step eagerly, without recording decode steps as CUDA graphs.
    enforce_eager: bool = False
    show_progress: bool = True  # progress bar while loading weights
    # Speculative decoding (kvik.engine.spec_decode): "ngram" (prompt lookup) or "draft" (a smaller
    # model with the same tokenizer, `speculative_model`); None turns it off.
    speculative_method: str | None = None
    num_speculative_tokens: int = 3  # drafts per step at most (adaptive k chooses up to this)
    speculative_model: str | None = None
    # Weight-only quantization of the draft model (int8/int4, default groups). Without
    # speculative_model the draft is the target's own weights quantized: lossless speculation whose
    # draft steps read the quantized copy's bytes.
    speculative_quantization: str | None = None
    prompt_lookup_min: int = 2  # n-gram sizes the lookup tries, longest first
    prompt_lookup_max: int = 4
    speculative_adaptive: bool = True  # False: always propose num_speculative_tokens
    # fcfs: arrival order. priority: requests' `priority` tiers, then fair share between tenants.
    scheduling_policy: str = "priority"
    # priority: prompt tokens a step may compute for a tier worse than one active in the last 30 s,
    # bounding how long a better tier's arrival waits behind worse prefill. None: 16 on a CPU, off
    # on a GPU (kvik.engine.scheduling_policy.make_policy); 0: off.
    lower_tier_prefill_chunk: int | None = None
    # Multi-LoRA serving (kvik.engine.lora_manager): adapters to load at start as "name=path" (a
    # {name: path} dict is accepted too), slots in device memory, the largest rank, and adapters
    # kept in CPU memory (None: every loaded one).
    enable_lora: bool = False
    lora_modules: list[str] | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora_modules, dict):
            self.lora_modules = [f"{name}={path}" for name, path in self.lora_modules.items()]
        if isinstance(self.kv_cache_memory, str):  # the Python API takes the CLI's sizes too
            try:
                self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(f"kv_cache_memory: {exc}") from None
        self.validate()

    def validate(self) -> None:
        for name, expected in _FIELD_TYPES.items():
            value = getattr(self, name)
            if value is None:
                continue
            # bool is an int to Python, never to a user: max_num_seqs=True is a mistake.
            if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
                raise ConfigError(f"{name}: expected {_TYPE_NAMES.get(expected, 'a number')}, "
                                  f"got {type(value).__name__} {value!r}")
        if not self.model:
            raise ConfigError("model: give a local model directory or a hub id")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization: {self.quantization!r} is not one of "
                              f"{', '.join(QUANTIZATIONS)}")
        group = self.quantization_group_size
        if group is not None and group not in QUANTIZATION_GROUP_SIZES:
            raise ConfigError(f"quantization_group_size: {group} is not one of "
                              f"{', '.join(map(str, QUANTIZATION_GROUP_SIZES))}")
        if group is not None and self.quantization not in ("int4", "int8"):
            raise ConfigError("quantization_group_size applies to quantization='int4' or 'int8' only "
                              "(--quantization int4 / int8)")
        if group == 0 and self.quantization != "int8":
            raise ConfigError("quantization_group_size: 0 (a scale per output channel) is for "
                              "quantization='int8'; int4 takes 32, 64 or 128")
        if self.quantization_zero_point and self.quantization != "int4":
            raise ConfigError("quantization_zero_point applies to quantization='int4' only (--quantization int4)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of "
                              f"{', '.join(KV_CACHE_DTYPES)}")
        if self.activations not in ACTIVATIONS:
            raise ConfigError(f"activations: {self.activations!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: {self.device!r} is not one of {', '.join(DEVICES)} or cuda:N")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"block_size: {self.block_size} must be a power of two up to 128")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "kv_cache_memory",
                     "threads", "num_scheduler_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}: must be at least 1, got {value}")
        if self.lower_tier_prefill_chunk is not None and self.lower_tier_prefill_chunk < 0:
            raise ConfigError(f"lower_tier_prefill_chunk: must be 0 (off) or more, got {self.lower_tier_prefill_chunk}")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            raise ConfigError(f"kv_cache_fraction: must be in (0, 1], got {self.kv_cache_fraction}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy: {self.scheduling_policy!r} is not one of "
                              f"{', '.join(SCHEDULING_POLICIES)}")
        if self.kv_cache_memory is not None and self.kv_cache_fraction is not None:
            raise ConfigError("kv_cache_memory and kv_cache_fraction: give one, not both")
        steps = self.num_scheduler_steps
        if steps is not None and steps > MAX_SCHEDULER_STEPS:
            raise ConfigError(f"num_scheduler_steps: at most {MAX_SCHEDULER_STEPS}, got {steps}")
        if steps is not None and steps > 1 and (self.speculative_method is not None or self.enable_lora):
            raise ConfigError("num_scheduler_steps: multi-step decoding does not combine with speculative "
                              "decoding or LoRA adapters; leave it at 1 with those")
        self._validate_speculative()
        self._validate_lora()

    def scheduler_steps(self) -> int:
        """num_scheduler_steps, its default resolved: 8, or 1 with speculative decoding or LoRA."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        return 1 if self.speculative_method is not None or self.enable_lora else DEFAULT_SCHEDULER_STEPS

    def lora_module_pairs(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, path) pairs."""
        pairs = []
        for item in self.lora_modules or []:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"lora_modules: {item!r} is not NAME=PATH")
            pairs.append((name, path))
        return pairs

    def _validate_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("lora_modules: adapters need enable_lora (--enable-lora)")
        names = [name for name, _ in self.lora_module_pairs()]
        if len(set(names)) != len(names):
            raise ConfigError(f"lora_modules: adapter names repeat ({', '.join(names)})")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}: must be at least 1, got {value}")

    def _validate_speculative(self) -> None:
        method = self.speculative_method
        if method is not None and method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_method: {method!r} is not one of {', '.join(SPECULATIVE_METHODS)}")
        quantization = self.speculative_quantization
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ConfigError(f"speculative_quantization: {quantization!r} is not one of "
                              f"{', '.join(QUANTIZATIONS)}")
        if method == "draft" and not self.speculative_model and quantization is None:
            raise ConfigError("speculative_model: the draft method needs a draft model directory "
                              "(--speculative-model), or --speculative-quantization to draft with a "
                              "quantized copy of the target")
        if self.speculative_model and method != "draft":
            raise ConfigError("speculative_model: only used with speculative_method 'draft'")
        if quantization is not None and method != "draft":
            raise ConfigError("speculative_quantization: only used with speculative_method 'draft'")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens: must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                              f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min/max: need 1 <= min <= max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        return cls(model=model, **kwargs)

    # -- command-line integration, shared by `kvik serve`, `kvik generate` and `kvik bench` --

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_required: bool = False,
                     several_models: bool = False, lora: bool = False) -> None:
        group = parser.add_argument_group("engine")
        model_help = "model directory in HF format (GPTQ/AWQ included), a .gguf file, or a hub id to download"
        if several_models:  # `kvik serve`: --model NAME=PATH, repeated, serves several models
            group.add_argument("--model", required=model_required, default=None, action="append",
                               help=model_help + "; repeat as --model NAME=PATH to serve several models, "
                                                 "loaded on demand")
        else:
            group.add_argument("--model", required=model_required, default=None, help=model_help)
        group.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
        group.add_argument("--revision", default=None, help="hub revision for a hub id")
        group.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
        group.add_argument("--dtype", default="auto", choices=DTYPES,
                           help="weights and KV dtype (default: auto: bfloat16 on CUDA, float32 on CPU). "
                                "On the CPU, bfloat16 narrows the weights and KV cache; arithmetic stays "
                                "float32 unless the CPU has bfloat16 instructions. A pre-quantized checkpoint "
                                "(GPTQ, AWQ, GGUF Q4_0/Q4_1/Q4_K) keeps its int4 layers under auto; an "
                                "explicit dtype dequantizes them to it")
        group.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                           help="quantize the weights at load: int8 or int4, a float16 scale per group of "
                                "inputs (int4: the LM head int8). int4 on a pre-quantized checkpoint keeps its "
                                "own int4 layers and quantizes the rest")
        group.add_argument("--quantization-group-size", type=int, default=None,
                           choices=QUANTIZATION_GROUP_SIZES,
                           help="inputs per scale. int4: 32, 64 (default) or 128. int8: 32 (default, "
                                "llama.cpp's Q8_0 layout), 64, 128, or 0 for one float32 scale per output "
                                "channel (6%% fewer bytes, further from float32)")
        group.add_argument("--quantization-zero-point", action="store_true",
                           help="int4: asymmetric groups with a zero point each (default: symmetric)")
        group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                           help="KV cache storage (default: auto, the model's dtype); int8 stores a "
                                "float16 scale per token and head and holds ~3.9x float32's tokens; fp8 "
                                "(float8 e4m3, values saturated at +-448, no scales) holds 4x, with 3 "
                                "mantissa bits against int8's 7")
        group.add_argument("--activations", default="auto", choices=ACTIVATIONS,
                           help="inputs of int8/int4 linear layers on CPUs with AVX512-VNNI: int8 (rounded "
                                "per 32 inputs, integer dot products, as llama.cpp; faster) or float32 "
                                "(default: auto: int8 with --quantization, float32 for a pre-quantized "
                                "checkpoint's int4 layers served as they are). Other CPUs: float32. "
                                "--dtype bfloat16 on CPUs with AVX512-BF16: auto/int8 round the inputs of "
                                "batches of 12+ rows to bfloat16, float32 keeps them float32")
        group.add_argument("--seed", type=int, default=0, help="seed for requests without their own")
        group.add_argument("--max-model-len", type=int, default=None,
                           help="context length (default: the model's max_position_embeddings)")
        group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        group.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                           help="KV cache budget in bytes; suffixes KiB/MiB/GiB/KB/MB/GB accepted")
        group.add_argument("--kv-cache-fraction", type=float, default=None,
                           help="KV cache budget as a fraction of free device memory after the weights "
                                "(default: 0.9 on CUDA, 0.25 of available RAM on CPU)")
        group.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
        group.add_argument("--max-num-batched-tokens", type=int, default=None,
                           help="token budget per step (default: 2048; with --no-chunked-prefill "
                                "at least max-model-len)")
        group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                           help="disable automatic prefix caching")
        group.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                           help="schedule each prompt whole (needs a token budget >= max-model-len)")
        group.add_argument("--num-scheduler-steps", type=int, default=None,
                           help="multi-step decoding: forwards a decode step may run back to back, each "
                                "sampling from the one before, before the scheduler runs again (1 to "
                                f"{MAX_SCHEDULER_STEPS}; default {DEFAULT_SCHEDULER_STEPS}, or 1 with "
                                "speculative decoding or LoRA, which it does not combine with). Runs happen "
                                "while nobody waits, for sequences without penalties, min_tokens or a "
                                "grammar, and last at most ~25 ms; tokens reach clients in groups of up to "
                                "this many. It saves the per-token bookkeeping: 6-22%% of the time per token "
                                "served at one request on a CPU")
        group.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
        group.add_argument("--enforce-eager", action="store_true",
                           help="CUDA: launch every step's kernels one by one instead of replaying "
                                "decode steps as CUDA graphs (default: graphs, recorded per batch "
                                "shape on first use)")
        spec = parser.add_argument_group("speculative decoding")
        spec.add_argument("--speculative-method", default=None, choices=SPECULATIVE_METHODS,
                          help="propose draft tokens and verify them in one forward: ngram (prompt "
                               "lookup, no second model) or draft (--speculative-model and/or "
                               "--speculative-quantization); default off")
        spec.add_argument("--num-speculative-tokens", type=int, default=3,
                          help="most draft tokens per sequence and step (default: 3; on CPU a step "
                               "of up to 4 rows takes the compiled decode path)")
        spec.add_argument("--speculative-model", default=None,
                          help="draft model directory for --speculative-method draft (same tokenizer; "
                               "default with --speculative-quantization: the target itself)")
        spec.add_argument("--speculative-quantization", default=None, choices=QUANTIZATIONS,
                          help="quantize the draft model's weights at load (int8: groups of 32, int4: "
                               "groups of 64); without --speculative-model the draft is the target "
                               "quantized: drafts read the copy's bytes, output stays the target's")
        spec.add_argument("--prompt-lookup-min", type=int, default=2,
                          help="shortest n-gram the ngram method looks up (default: 2)")
        spec.add_argument("--prompt-lookup-max", type=int, default=4,
                          help="longest n-gram the ngram method looks up (default: 4)")
        spec.add_argument("--no-speculative-adaptive", dest="speculative_adaptive", action="store_false",
                          help="always propose --num-speculative-tokens drafts instead of adapting k "
                               "to each sequence's acceptance rate (and pausing when it is low)")
        group.add_argument("--scheduling-policy", default="priority", choices=SCHEDULING_POLICIES,
                           help="priority (default): requests' `priority` first (lower is served "
                                "first; better tiers preempt worse ones), then fair share of tokens "
                                "between tenants; fcfs: arrival order only")
        group.add_argument("--lower-tier-prefill-chunk", type=int, default=None, metavar="TOKENS",
                           help="priority policy: while a better tier has sent a request in the last "
                                "30 s, worse tiers compute at most TOKENS prompt tokens a step, so a "
                                "better tier's request never waits behind one long step of their "
                                "prefill (default: 16 on a CPU, where a step's time grows with its "
                                "tokens; off on a GPU; 0: off)")

        if lora:
            EngineArgs._add_lora_cli_args(parser)

    @staticmethod
    def _add_lora_cli_args(parser: argparse.ArgumentParser) -> None:
        lora = parser.add_argument_group("LoRA adapters (docs/lora.md)")
        lora.add_argument("--enable-lora", action="store_true",
                          help="serve LoRA adapters on the base model (Llama family); a request picks "
                               "one by its `model` field, and requests for different adapters share a batch")
        lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                          help="adapters to load at start: PEFT adapter directories (adapter_config.json + "
                               "adapter_model.safetensors, what `kvik train` writes), served as NAME")
        lora.add_argument("--max-loras", type=int, default=4,
                          help="adapters held in device memory at once (default: 4); others wait in CPU "
                               "memory and take the least recently used idle slot when requested")
        lora.add_argument("--max-lora-rank", type=int, default=16,
                          help="largest adapter rank accepted (default: 16); smaller ranks are zero-padded")
        lora.add_argument("--max-cpu-loras", type=int, default=None,
                          help="adapters kept in CPU memory (default: all loaded ones); others are read "
                               "from their directory again when needed")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, default_model: str | None = None) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if not values.get("model"):
            values["model"] = default_model
        return cls(**values)


# What each field must hold, so a wrong type is a ConfigError naming the field, not a TypeError from
# deep inside validation.
_FIELD_TYPES: dict[str, Any] = {
    "model": str, "tokenizer": str, "revision": str, "device": str, "dtype": str, "seed": int,
    "max_model_len": int, "block_size": int, "kv_cache_memory": int, "kv_cache_fraction": (int, float),
    "max_num_seqs": int, "max_num_batched_tokens": int, "enable_prefix_caching": bool, "num_scheduler_steps": int,
    "enable_chunked_prefill": bool, "threads": int, "enforce_eager": bool, "show_progress": bool, "quantization": str,
    "quantization_group_size": int, "quantization_zero_point": bool, "kv_cache_dtype": str, "activations": str,
    "speculative_method": str, "num_speculative_tokens": int, "speculative_model": str,
    "speculative_quantization": str,
    "prompt_lookup_min": int, "prompt_lookup_max": int, "speculative_adaptive": bool, "scheduling_policy": str,
    "lower_tier_prefill_chunk": int,
    "enable_lora": bool, "lora_modules": list, "max_loras": int, "max_lora_rank": int, "max_cpu_loras": int,
}
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false", list: "a list"}

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "ki": 1024, "kib": 1024, "mi": 1024**2,
          "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912; a plain number is bytes."""
    match = _BYTES.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 2GiB, 512MB or 1048576")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])
