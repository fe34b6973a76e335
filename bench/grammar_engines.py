"""Compare the two grammar engines built for constrained decoding, llguidance and xgrammar, on the
twenty schemas of the structured-output tests: compile time, token-mask time per decode step, and
schema coverage (which keywords each enforces, which it refuses, and which it silently ignores).

kvik uses llguidance; this script is how that choice was made and how to re-check it. xgrammar is
not a kvik dependency (it needs torch and triton): `pip install xgrammar` in a scratch environment
to run both; without it only llguidance is measured.

    python bench/grammar_engines.py --tokenizer DIR   # a HF tokenizer directory (tokenizer.json)

Each schema is walked by each engine: at every step the engine computes the allowed-token mask, a
seeded random allowed token is taken (the end-of-sequence token with probability 1/2 once allowed),
and the token is consumed; the finished text is then validated with `jsonschema`. "ignored" are
probe schemas that compiled but whose walk produced JSON the schema rejects.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any, Callable

import jsonschema

from kvik.bench.json_schemas import SCHEMAS

# Keywords outside the twenty schemas: an engine should enforce each or refuse it, never ignore it.
PROBES: dict[str, dict[str, Any]] = {
    "multipleOf": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100},
    "uniqueItems": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "minItems": 2,
                    "maxItems": 3},
    "minProperties": {"type": "object", "additionalProperties": {"type": "integer", "maximum": 9,
                                                                 "minimum": 0},
                      "propertyNames": {"pattern": "^[a-c]$"}, "minProperties": 2},
    "patternProperties": {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "boolean"}},
                          "additionalProperties": False, "maxProperties": 2},
    "if_then_else": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": ["a"], "if": {"properties": {"a": {"const": 1}}},
                     "then": {"required": ["b"]}},
    "not": {"type": "integer", "minimum": 0, "maximum": 5, "not": {"const": 3}},
    "contains": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "contains": {"const": 5}, "maxItems": 3},
    "format_email": {"type": "string", "format": "email", "maxLength": 20},
    "format_hostname": {"type": "string", "format": "hostname", "maxLength": 20},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "boolean"},
                                                           "b": {"type": "boolean"}},
                          "dependentRequired": {"a": ["b"]}, "additionalProperties": False},
}

MAX_STEPS = 400


class Engine:
    name = ""

    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any) -> Any: ...
    def allowed(self, mask: Any) -> list[int]: ...
    def consume(self, matcher: Any, token: int) -> None: ...
    def eos(self) -> int: ...


class Llguidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        import llguidance
        import numpy as np

        self.lg, self.np = llguidance, np
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        self.words = (self.tokenizer.vocab_size + 31) // 32
        self._eos = eos

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.lg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        matcher = self.lg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        self._mask_into(matcher)  # the first mask builds the lexer: part of compiling
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def _mask_into(self, matcher: Any) -> Any:
        mask = self.np.zeros(self.words, dtype=self.np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return mask

    def fill(self, matcher: Any) -> Any:
        return self._mask_into(matcher)

    def allowed(self, mask: Any) -> list[int]:
        bits = self.np.unpackbits(mask.view(self.np.uint8), bitorder="little")
        return self.np.flatnonzero(bits).tolist()

    def consume(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(matcher.get_error())

    def eos(self) -> int:
        return self._eos


class Xgrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer_dir: str, eos: int) -> None:
        import torch
        import transformers
        import xgrammar

        self.xgr, self.torch = xgrammar, torch
        hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab = info.vocab_size
        self._eos = eos

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any) -> Any:
        mask = self.xgr.allocate_token_bitmask(1, self.vocab)
        matcher.fill_next_token_bitmask(mask, 0)
        return mask

    def allowed(self, mask: Any) -> list[int]:
        bits = self.torch.zeros(1, self.vocab)
        self.xgr.apply_token_bitmask_inplace(bits, mask)
        return (bits[0] == 0).nonzero().flatten().tolist()

    def consume(self, matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError("token rejected")

    def eos(self) -> int:
        return self._eos


def walk(engine: Engine, compiled: Any, decode: Callable[[list[int]], str], seed: int
         ) -> tuple[str | None, list[float]]:
    """A seeded random walk through the grammar; returns the text (None if unfinished) and the
    mask time of each step in seconds."""
    rng = random.Random(seed)
    matcher = engine.matcher(compiled)
    tokens: list[int] = []
    times: list[float] = []
    for _ in range(MAX_STEPS):
        started = time.perf_counter()
        mask = engine.fill(matcher)
        times.append(time.perf_counter() - started)
        allowed = engine.allowed(mask)
        if not allowed:
            return None, times
        if engine.eos() in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return decode(tokens), times
        token = rng.choice([t for t in allowed if t != engine.eos()])
        engine.consume(matcher, token)
        tokens.append(token)
    return None, times


def measure(engine: Engine, schemas: dict[str, dict[str, Any]], decode: Callable[[list[int]], str],
            seeds: int) -> dict[str, Any]:
    compile_ms: dict[str, float] = {}
    refused: dict[str, str] = {}
    valid, invalid, unfinished = [], [], []
    step_times: list[float] = []
    for name, schema in schemas.items():
        started = time.perf_counter()
        try:
            compiled = engine.compile(schema)
        except Exception as exc:  # noqa: BLE001 - an engine's refusal is a result here
            refused[name] = str(exc).splitlines()[0][:160]
            continue
        compile_ms[name] = (time.perf_counter() - started) * 1000
        outcomes = []
        for seed in range(seeds):
            text, times = walk(engine, compiled, decode, seed)
            step_times.extend(times)
            if text is None:
                outcomes.append("unfinished")
                continue
            try:
                jsonschema.validate(json.loads(text), schema)
                outcomes.append("valid")
            except (ValueError, jsonschema.ValidationError):
                outcomes.append("invalid")
        (invalid if "invalid" in outcomes else valid if "valid" in outcomes else unfinished).append(name)
    return {"compile_ms": compile_ms, "refused": refused, "valid": valid, "invalid": invalid,
            "unfinished": unfinished, "mask_us_median": statistics.median(step_times) * 1e6,
            "mask_us_p90": sorted(step_times)[int(0.9 * len(step_times))] * 1e6, "steps": len(step_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer directory (tokenizer.json)")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(f"{args.tokenizer}/tokenizer.json")
    config = json.load(open(f"{args.tokenizer}/tokenizer_config.json"))
    eos = backend.token_to_id(config["eos_token"])
    tokenizer_json = backend.to_str()

    def decode(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=False)

    engines: list[Engine] = [Llguidance(tokenizer_json, eos)]
    try:
        engines.append(Xgrammar(args.tokenizer, eos))
    except ImportError:
        print("xgrammar is not installed: measuring llguidance only")
    print(f"tokenizer: {args.tokenizer} ({backend.get_vocab_size()} tokens)")
    for engine in engines:
        for label, schemas in (("20 schemas", SCHEMAS), ("probes", PROBES)):
            result = measure(engine, schemas, decode, args.seeds)
            times = result.pop("compile_ms")
            print(f"\n== {engine.name}: {label}")
            if times:
                print(f"compile: total {sum(times.values()):.1f} ms, median "
                      f"{statistics.median(times.values()):.2f} ms, max {max(times.values()):.1f} ms "
                      f"({max(times, key=times.get)})")
            print(f"mask per step: median {result['mask_us_median']:.0f} us, p90 "
                  f"{result['mask_us_p90']:.0f} us over {result['steps']} steps")
            for key in ("valid", "invalid", "unfinished"):
                print(f"{key}: {len(result[key])} {result[key] if key != 'valid' else ''}")
            for name, reason in result["refused"].items():
                print(f"refused {name}: {reason}")


if __name__ == "__main__":
    main()
