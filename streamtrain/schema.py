"""Reading the Avro schema that describes the click stream, and what kind of value each field holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fastavro

ID_KINDS = {"integer", "string", "integer_list", "string_list"}
NUMBER_KINDS = {"integer", "float", "boolean"}

_KIND_OF_PRIMITIVE = {
    "int": "integer",
    "long": "integer",
    "float": "float",
    "double": "float",
    "boolean": "boolean",
    "string": "string",
    "bytes": "string",
}


def load_schema(path: str | Path) -> dict[str, Any]:
    """The schema as parsed JSON, after fastavro has checked that it is valid Avro."""
    schema = json.loads(Path(path).read_text())
    fastavro.parse_schema(schema)
    if schema.get("type") != "record":
        raise ValueError("the top-level schema must be a record")
    return schema


def without_logical_types(schema: Any) -> Any:
    """The same wire format with logical types dropped, so timestamps decode as plain longs."""
    if isinstance(schema, dict):
        return {k: without_logical_types(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [without_logical_types(s) for s in schema]
    return schema


def field_kind(schema: dict[str, Any], name: str) -> str | None:
    """'integer', 'float', 'boolean', 'string', or '<kind>_list' for arrays; None if absent.

    A union with null has the kind of its other branch: a null becomes an empty feature.
    """
    for field in schema["fields"]:
        if field["name"] == name:
            return _kind(field["type"])
    return None


def _kind(avro_type: Any) -> str:
    if isinstance(avro_type, list):
        branches = [t for t in avro_type if t != "null"]
        return _kind(branches[0]) if len(branches) == 1 else "union"
    if isinstance(avro_type, dict):
        if avro_type["type"] == "array":
            return _kind(avro_type["items"]) + "_list"
        return _kind(avro_type["type"])
    return _KIND_OF_PRIMITIVE.get(avro_type, avro_type)
