"""Which JSON-schema keywords llama.cpp's own grammar enforces (``response_format``, tool ``parameters``).

llama-server turns a schema into a grammar itself (``common/json-schema.cpp`` in its sources): types,
objects (properties, required, additionalProperties), arrays (items, prefixItems, minItems, maxItems),
enum, const, anyOf/oneOf, $ref, string pattern, minLength/maxLength and the formats date, time, date-time
and uuid, integer bounds. It reads no bound of a ``number``, no ``multipleOf`` and no other string format:
those would be accepted and not followed, so deploykit refuses them before a request reaches the engine,
on top of what it refuses for every engine (``engine.grammar.unenforced``).
"""

from __future__ import annotations

from typing import Any

from ..grammar import subschemas, unenforced

FORMATS = frozenset({"date", "time", "date-time", "uuid"})
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def unenforced_by_llamacpp(schema: Any) -> tuple[str, str] | None:
    """The first keyword of ``schema`` that llama.cpp would not enforce, with where it is, or None."""
    common = unenforced(schema)
    if common is not None:
        return common
    for where, node in subschemas(schema, "#"):
        if "multipleOf" in node:
            return "multipleOf", where
        if node.get("type") != "integer" and any(k in node for k in _BOUNDS):
            return f"{next(k for k in _BOUNDS if k in node)} on a {node.get('type', 'untyped')} value", where
        if "format" in node and node["format"] not in FORMATS:
            return f"format: {node['format']}", where
    return None
