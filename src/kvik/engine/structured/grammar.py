"""Constraints as llguidance grammars, and the check that refuses what cannot be enforced.

Torch-free: the API server imports this to turn a request's constraint into a 400 before anything is
queued; the core compiles the same grammar text into matchers (`kvik.engine.structured.matcher`).

Why llguidance (and not xgrammar), measured with `bench/grammar_engines.py` on this project's CPU
machine with a real 49,152-token BPE vocabulary (SmolLM2's), on the twenty schemas of
`kvik.bench.json_schemas` plus ten probes of other keywords:
- coverage: llguidance enforced all twenty and refused six probes by name ("Unimplemented keys:
  ["uniqueItems"]", "not", "contains", "if"/"then", "propertyNames", "dependentRequired"), so a
  client gets a 400 naming the keyword; xgrammar 0.2.9 produced schema-invalid JSON for `allOf` and
  for four probes (uniqueItems, minProperties, not, contains) it silently ignored: a 200 with wrong
  output, which the issue forbids.
- speed: compile (grammar + first mask) median 1.3 ms per schema for llguidance against 20-30 ms
  for xgrammar; mask per decode step median 63 us (p90 0.3 ms) against 115 us (p90 0.34 ms).
- fit: llguidance has no dependencies (xgrammar needs torch and triton), so the torch-free API
  server can validate schemas itself.

JSON is generated compactly with fixed separators (", " and ": ", as `json.dumps` writes), not with
free whitespace: a model (a random one certainly) can otherwise fill its budget with blanks. A
schema's own `x-guidance` options override that.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from kvik.core.errors import InvalidRequestError
from kvik.core.sampling_params import StructuredOutputs

JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}

# Grammar texts checked so far (one entry per distinct constraint); repeated schemas cost nothing.
CHECK_CACHE_SIZE = 1024


class UnsupportedConstraintError(InvalidRequestError):
    """The constraint is malformed or uses a feature the grammar engine cannot enforce."""

    code = "unsupported_constraint"


def json_schema_grammar(schema: str | dict) -> str:
    """The llguidance grammar for a JSON schema (text or dict), with kvik's JSON options."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise UnsupportedConstraintError(f"the JSON schema is not a JSON object ({exc})") from exc


def to_grammar(constraint: StructuredOutputs) -> str:
    """The llguidance grammar text for a constraint (not yet checked)."""
    import llguidance

    kind = constraint.kind
    if kind == "json":
        return json_schema_grammar(constraint.json)
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind == "regex":
        # \d and \w mean ASCII digits and word characters, as in JSON Schema patterns and JavaScript
        # (Rust's default would let U+1FBF0 pass for a digit).
        lark_regex = llguidance.regex_to_lark(constraint.regex, "dw")
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{lark_regex}/")
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(choice) for choice in constraint.choice)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:
        return llguidance.grammar_from("grammar", constraint.grammar)  # Lark, or GBNF converted
    except ValueError as exc:
        raise UnsupportedConstraintError(f"the grammar is neither Lark nor GBNF ({exc})") from exc


@lru_cache(maxsize=CHECK_CACHE_SIZE)
def _grammar_error(grammar: str) -> str | None:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return messages[0] if is_error else None


def check_constraint(constraint: StructuredOutputs, param: str = "structured_outputs") -> str:
    """Return the grammar text for `constraint`, or raise a 400 that names `param` and what the
    grammar engine cannot enforce. Can take milliseconds for large schemas: the server calls it off
    the event loop."""
    try:
        grammar = to_grammar(constraint)
    except UnsupportedConstraintError as exc:
        raise UnsupportedConstraintError(f"{param}: {exc.message}", param=param) from exc
    error = _grammar_error(grammar)
    if error is not None:
        raise UnsupportedConstraintError(f"{param}: {describe(constraint.kind, error)}", param=param)
    return grammar


def describe(kind: str, error: str) -> str:
    """llguidance's message, reworded for a client who sent a JSON schema, regex or grammar."""
    first = error.strip().splitlines()[0]
    if first.startswith("Unimplemented keys:"):
        keys = first.removeprefix("Unimplemented keys:").strip()
        return (f"the JSON schema uses keyword(s) {keys} that kvik's grammar engine cannot enforce; "
                "remove them or enforce them after generation")
    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[kind]
    # Regex errors put the reason on a later "error: ..." line, under a caret drawing.
    reason = next((line.strip().removeprefix("error:").strip() for line in error.splitlines()[1:]
                   if line.strip().startswith("error:")), None)
    if reason:
        first = f"{first.split(' (in ')[0].rstrip(':')}: {reason}"
    if kind == "regex":  # the position is in kvik's one-line wrapper grammar, not the client's regex
        first = re.sub(r"^at \d+\(\d+\): ", "", first)
    return f"the {what} cannot be used for constrained decoding: {first}"
