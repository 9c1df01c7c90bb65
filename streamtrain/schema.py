"""Reading the Avro schema that describes the click stream, and what kind of value each field holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fastavro

ID_KINDS = {"integer", "string", "boolean", "enum", "integer_list", "string_list", "boolean_list", "enum_list"}
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


def field_schema(schema: dict[str, Any], path: str) -> Any:
    """The type of the field at a dotted path ("user.id" is field id of record field user), with
    named types resolved and a union with null reduced to its other branch; None if absent."""
    return _field(schema, path)[0]


def field_nullable(schema: dict[str, Any], path: str) -> bool:
    """Whether the field at a dotted path may hold null (a union with null), or any record on the way does."""
    names: dict[str, Any] = {}
    node: Any = fastavro.parse_schema(schema, named_schemas=names, _write_hint=False)
    nullable = False
    for name in path.split("."):
        nullable = nullable or _takes_null(node)
        node = _non_null(node, names)
        if not isinstance(node, dict) or node.get("type") not in ("record", "error"):
            return False
        field = next((f for f in node["fields"] if f["name"] == name), None)
        if field is None:
            return False
        node = field["type"]
    return nullable or _takes_null(node)


def _takes_null(avro_type: Any) -> bool:
    return avro_type == "null" or (isinstance(avro_type, list) and "null" in avro_type)


def _field(schema: dict[str, Any], path: str) -> tuple[Any, dict[str, Any]]:
    """(the field's type as ``field_schema`` gives it, the schema's named types by full name)."""
    names: dict[str, Any] = {}
    node: Any = fastavro.parse_schema(schema, named_schemas=names, _write_hint=False)
    for name in path.split("."):
        node = _non_null(node, names)
        if not isinstance(node, dict) or node.get("type") not in ("record", "error"):
            return None, names
        field = next((f for f in node["fields"] if f["name"] == name), None)
        if field is None:
            return None, names
        node = field["type"]
    return _non_null(node, names), names


def _non_null(avro_type: Any, names: dict[str, Any]) -> Any:
    if isinstance(avro_type, str):
        avro_type = names.get(avro_type, avro_type)
    if isinstance(avro_type, list):
        branches = [t for t in avro_type if t != "null"]
        return _non_null(branches[0], names) if len(branches) == 1 else avro_type
    if isinstance(avro_type, dict) and avro_type.get("type") in _KIND_OF_PRIMITIVE and "logicalType" not in avro_type:
        return avro_type["type"]
    return avro_type


def field_kind(schema: dict[str, Any], name: str) -> str | None:
    """'integer', 'float', 'boolean', 'string', 'enum', '<kind>_list' for arrays, 'record', ...;
    None if absent. ``name`` may be a dotted path into nested records.

    A union with null has the kind of its other branch: a null becomes an empty feature.
    """
    avro_type, names = _field(schema, name)
    return None if avro_type is None else _kind(avro_type, names)


def _kind(avro_type: Any, names: dict[str, Any]) -> str:
    avro_type = _non_null(avro_type, names)
    if isinstance(avro_type, list):
        return "union"
    if isinstance(avro_type, dict):
        if avro_type["type"] == "array":
            return _kind(avro_type["items"], names) + "_list"
        type_name: str = avro_type["type"]  # a primitive, or "record", "enum", "map", "fixed"
        return _KIND_OF_PRIMITIVE.get(type_name, type_name)
    return _KIND_OF_PRIMITIVE.get(avro_type, avro_type)
