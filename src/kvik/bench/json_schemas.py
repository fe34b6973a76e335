"""Twenty JSON schemas that exercise what structured-output clients send: nested objects, arrays with
min/max items, enums, integer and number ranges, anyOf/oneOf/allOf, $ref and $defs (recursive too),
string patterns and formats, const, nullable types, tuples (prefixItems) and optional properties.

Shared by the structured-output tests (every sample must validate against its schema) and
`bench/structured_decode.py` (grammar compile time, constrained decode throughput). Strings carry a
`maxLength` and arrays a `maxItems` where real schemas would too, so a random-weight model at
temperature 1 finishes its object in a few hundred tokens.
"""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_record": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "active"],
        "additionalProperties": False,
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 8},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 10},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["first", "address"],
                "additionalProperties": False,
            },
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "tags_array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum_choice": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "integer_ranges": {
        "type": "object",
        "properties": {
            "percent": {"type": "integer", "minimum": 0, "maximum": 100},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "delta": {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 10},
        },
        "required": ["percent", "year", "delta"],
        "additionalProperties": False,
    },
    "any_of_scalar": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                           {"type": "string", "maxLength": 5}, {"type": "null"}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    "ref_defs": {
        "$defs": {
            "point": {"type": "object",
                      "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                     "y": {"type": "integer", "minimum": -50, "maximum": 50}},
                      "required": ["x", "y"], "additionalProperties": False},
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "string_patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
        },
        "required": ["code", "hex"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {"type": "object",
                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                 "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False},
        "minItems": 2,
        "maxItems": 4,
    },
    "number_range": {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -40, "maximum": 60},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["temperature", "ratio"],
        "additionalProperties": False,
    },
    "const_and_version": {
        "type": "object",
        "properties": {"kind": {"const": "event"}, "version": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["kind", "version"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {"nickname": {"type": ["string", "null"], "maxLength": 6},
                       "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 10}},
        "required": ["nickname", "score"],
        "additionalProperties": False,
    },
    "recursive_tree": {
        "$defs": {
            "node": {"type": "object",
                     "properties": {"label": {"type": "string", "maxLength": 4},
                                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                 "maxItems": 1}},
                     "required": ["label", "children"], "additionalProperties": False},
        },
        "$ref": "#/$defs/node",
    },
    "one_of_shapes": {
        "type": "object",
        "properties": {"shape": {"oneOf": [
            {"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1, "maximum": 9}},
             "required": ["circle"], "additionalProperties": False},
            {"type": "object", "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
             "required": ["square"], "additionalProperties": False},
        ]}},
        "required": ["shape"],
        "additionalProperties": False,
    },
    "formats": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"},
                       "id": {"type": "string", "format": "uuid"}},
        "required": ["day", "id"],
        "additionalProperties": False,
    },
    "optional_properties": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                       "b": {"type": "boolean"},
                       "c": {"type": "string", "maxLength": 4}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 5},
                        {"type": "integer", "minimum": 0, "maximum": 9},
                        {"type": "boolean"}],
        "items": False,
        "minItems": 3,
    },
    "string_lengths": {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 4},
                       "initial": {"type": "string", "minLength": 1, "maxLength": 1}},
        "required": ["word", "initial"],
        "additionalProperties": False,
    },
    "all_of_merge": {
        "allOf": [
            {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["id"]},
            {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
             "required": ["name"]},
        ],
        "type": "object",
        "properties": {"id": {}, "name": {}},
        "additionalProperties": False,
    },
    "matrix": {
        "type": "object",
        "properties": {
            "rows": {"type": "array", "minItems": 1, "maxItems": 2,
                     "items": {"type": "array", "minItems": 2, "maxItems": 2,
                               "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
            "labels": {"type": "array", "maxItems": 2,
                       "items": {"enum": ["x", "y", "z"]}},
        },
        "required": ["rows", "labels"],
        "additionalProperties": False,
    },
}

assert len(SCHEMAS) == 20
