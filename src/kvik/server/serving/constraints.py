"""A request's output constraint, from whichever field the client used: OpenAI's `response_format`
(json_schema, json_object), vLLM's `structured_outputs`, or vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. At most one may be given; what the grammar engine
cannot enforce is a 400 that names the field and the feature, never a silent free-text answer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvik.core.errors import InvalidRequestError
from kvik.core.sampling_params import StructuredOutputs
from kvik.engine.structured.grammar import check_constraint
from kvik.protocol.openai import _SamplingFields


@dataclass(slots=True)
class RequestedConstraint:
    constraint: StructuredOutputs
    param: str  # the request field it came from, for error messages


def requested_constraint(body: _SamplingFields) -> RequestedConstraint | None:
    """The constraint the request asks for (not yet checked against the grammar engine)."""
    if body.guided_whitespace_pattern is not None:
        raise InvalidRequestError("guided_whitespace_pattern: is not supported; kvik writes JSON with "
                                  "fixed separators", param="guided_whitespace_pattern")
    found: list[RequestedConstraint] = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise InvalidRequestError("response_format.json_schema: is required when type is "
                                      "'json_schema'", param="response_format")
        found.append(RequestedConstraint(StructuredOutputs(json=response_format.json_schema.schema_),
                                         "response_format.json_schema.schema"))
    elif response_format is not None and response_format.type == "json_object":
        found.append(RequestedConstraint(StructuredOutputs(json_object=True), "response_format"))
    fields = body.structured_outputs
    if fields is not None:
        found.append(RequestedConstraint(StructuredOutputs(
            json=fields.json_, regex=fields.regex, choice=fields.choice, grammar=fields.grammar,
            json_object=bool(fields.json_object)), "structured_outputs"))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append(RequestedConstraint(StructuredOutputs(**{kind: value}), name))
    if len(found) > 1:
        raise InvalidRequestError(f"{found[1].param}: give one output constraint, not several "
                                  f"({', '.join(c.param for c in found)})", param=found[1].param)
    return found[0] if found else None


async def checked(constraint: StructuredOutputs, param: str) -> StructuredOutputs:
    """Check a constraint off the event loop (a large schema can take milliseconds)."""
    await asyncio.to_thread(check_constraint, constraint, param)
    return constraint
