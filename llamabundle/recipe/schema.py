"""The recipe's JSON schema, generated from the model's dataclasses (committed as data/schemas/recipe.schema.json; a
test fails when it drifts): what editors and other languages validate a recipe with."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

from ..data import SCHEMA_DRAFT, schema_id
from .model import SCHEMA_VERSION, SOURCE_KINDS, Recipe, Source, word_or_form


def json_schema() -> dict[str, Any]:
    """The recipe's JSON schema, generated from the dataclasses above (committed; a test checks drift)."""
    schema = _schema_for(Recipe)
    schema["properties"]["recipe"] = {"const": SCHEMA_VERSION, "description": "recipe schema version"}
    return {"$schema": SCHEMA_DRAFT, "$id": schema_id("recipe"), "title": "llamabundle recipe", **schema}


def _schema_for(tp: Any, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    meta = meta or {}
    out: dict[str, Any] = {}
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if set(args) == set(get_args(Source)):
            out = {"oneOf": [_source_schema(c) for c in SOURCE_KINDS.values()]}
        elif (pair := word_or_form(tuple(args))) is not None:  # a word or a mapping (ui:)
            out = {"oneOf": [_schema_for(a) for a in pair]}
        else:
            out = _schema_for(args[0], meta)
    elif dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = [f for f in dataclasses.fields(tp) if not f.metadata.get("internal")]
        out = {
            "type": "object",
            "additionalProperties": False,
            "properties": {f.name: _schema_for(hints[f.name], f.metadata) for f in fields},
            "required": [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING],
        }
    elif origin is tuple:
        elem = get_args(tp)[0]
        if get_origin(elem) is tuple:
            out = {"type": "object",  # one type a value, not a union (`type: [...]`): ajv's strict mode refuses those
                   "additionalProperties": {"anyOf": [{"type": "string"}, {"type": "boolean"}, {"type": "integer"}]},
                   "propertyNames": {"pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"}}
        else:
            item = _schema_for(elem)
            if meta.get("pattern"):
                item["pattern"] = meta["pattern"]
            out = {"type": "array", "items": item}
    elif origin is Literal:
        out = {"enum": list(get_args(tp))}
    elif tp is str:
        out = {"type": "string"}
        if meta.get("pattern"):
            out["pattern"] = meta["pattern"]
    elif tp is int:
        out = {"type": "integer"}
    if meta.get("doc"):
        out["description"] = meta["doc"]
    return out


def _source_schema(cls: type[Source]) -> dict[str, Any]:
    body = _schema_for(cls)
    options: list[dict[str, Any]] = [body]
    if cls.short is not None:
        options.append(body["properties"][cls.short])
    return {"type": "object", "additionalProperties": False, "required": [cls.kind],
            "properties": {cls.kind: options[0] if len(options) == 1 else {"oneOf": options}}}
