"""The gateway's OpenAPI document (`/openapi.json`), for clients and for fuzzing.

The proxy routes read raw bodies (validating them in full is the replica's job, and parsing twice
would cost large bodies twice), so FastAPI cannot derive their request schemas. They declare them
with `request_body`, naming a pydantic model whose JSON schema `add_components` puts under
`components/schemas`: the OpenAI request schemas kvik's server validates with, and the admin API's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF_TEMPLATE = "#/components/schemas/{model}"


def request_body(schema: str) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body follows the model named `schema`."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF_TEMPLATE.format(model=schema)}}}}}


def add_components(app: FastAPI, models: Sequence[type[BaseModel]], *,
                   served_models: Sequence[str]) -> Callable[[], dict[str, Any]]:
    """An `app.openapi` that adds the JSON schemas of `models` (and what they refer to). A `model`
    property of theirs is narrowed to the names this gateway serves (`served_models`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, definitions = models_json_schema([(model, "validation") for model in models],
                                                ref_template=REF_TEMPLATE)
            schemas = definitions.get("$defs", {})
            for schema in schemas.values():
                if "model" in schema.get("properties", {}):
                    schema["properties"]["model"] = {"type": "string", "enum": list(served_models)}
                    schema.setdefault("required", []).append("model")
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
            app.openapi_schema = document
        return app.openapi_schema

    return openapi
