"""A request's tools and their JSON schemas as a `CallSpec` (ids) for the call automaton.

`call_spec_for(tokenizer, tools, name=None, parallel=True)` encodes every fixed
piece on its own, control tokens as specials and the text between them as plain
text, as the model's encoder does: `argument key="K" type="T"` is one text piece
per property. It raises `UnsupportedSchema` (a `CallSpecError`) naming the tool,
the property and the construct when a schema holds something the automaton
cannot enforce; the caller then keeps vLLM's structural tag for the request.

Enforced (see docs/kimi-k3.md): an object's `properties` (keys only from them, in
their order, each at most once), `required`, `additionalProperties` (keys outside
`properties` are never written, so `false` holds and anything else is honoured
too), values of type string (raw text), integer, number, boolean, null, and
`enum`/`const` of one of those types. Everything else (nested objects and arrays,
type unions, `anyOf`/`oneOf`/`allOf`/`$ref`, string length and pattern, numeric
bounds, `patternProperties`, ...) is unsupported.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from atom_plugin.parsers.call_automaton import ArgSpec, CallSpec, CallSpecError, ToolSpec
from atom_plugin.parsers.k3_grammar import CLOSE, CONTROL_TOKENS, END_OF_MSG, OPEN, SEP, escape_attr

# JSON type -> K3 `type=` attribute (integer is written as number, as K3's encoder does).
K3_TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean"}
K3_TYPES["null"] = "null"
# Keywords that describe but do not constrain.
_NOTES = frozenset({"description", "title", "default", "examples", "$comment", "deprecated"})
_OBJECT_KEYS = _NOTES | {"type", "properties", "required", "additionalProperties", "$schema"}
_VALUE_KEYS = _NOTES | {"type", "enum", "const", "format"}
_SEQUENCES = {
    "call": 'call tool="',
    "index": '" index="',
    "index_end": '"',
    "argument": "argument",
    "call_end": "call",
    "tools_end": "tools",
    "message_end": "message",
}


class UnsupportedSchema(CallSpecError):
    """A tool schema construct the call automaton does not enforce."""


def _field(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, Mapping) else getattr(value, key, None)


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise UnsupportedSchema(f"{text!r} encodes to no ids")
    return ids


def _no_control(what: str, text: str) -> None:
    inside = [t for t in CONTROL_TOKENS if t in text]
    if inside or "<|" in text:
        raise UnsupportedSchema(f"{what} {text!r} holds a K3 marker ({', '.join(inside) or '<|'})")


def function_tools(tools: Sequence[Any] | None) -> list[tuple[str, Any]]:
    """(name, parameters) of a request's function tools (Chat Completions or Responses shape)."""
    out = []
    for tool in tools or ():
        if _field(tool, "type") not in (None, "function"):
            raise UnsupportedSchema(f"tool of type {_field(tool, 'type')!r} is not a function")
        function = _field(tool, "function")
        source = function if function is not None else tool
        name = _field(source, "name")
        if not isinstance(name, str) or not name:
            raise UnsupportedSchema(f"a function tool without a name: {tool!r}")
        out.append((name, _field(source, "parameters")))
    return out


def _value(tool: str, key: str, schema: Any, tokenizer: Any) -> tuple[str, str, tuple]:
    """(K3 type, kind, options) of one property."""
    where = f"tool {tool!r} property {key!r}"
    if not isinstance(schema, Mapping):
        raise UnsupportedSchema(f"{where}: schema {schema!r} is not an object")
    extra = sorted(set(schema) - _VALUE_KEYS)
    if extra:
        raise UnsupportedSchema(f"{where}: unsupported keywords {', '.join(extra)}")
    choices = schema.get("enum")
    if "const" in schema:
        choices = (
            [schema["const"]] if choices is None else [v for v in choices if v == schema["const"]]
        )
    json_type = schema.get("type")
    if json_type is None and choices:
        json_type = _type_of(choices[0])
    if json_type not in K3_TYPES:
        raise UnsupportedSchema(f"{where}: type {json_type!r} is not one of {', '.join(K3_TYPES)}")
    if json_type == "boolean" and choices is None:
        choices = [True, False]
    if json_type == "null":
        choices = [None]
    if choices is None:
        return K3_TYPES[json_type], "text" if json_type == "string" else json_type, ()
    if not isinstance(choices, list) or not choices:
        raise UnsupportedSchema(f"{where}: enum {choices!r} is not a non-empty list")
    options = []
    for value in choices:
        if _type_of(value) != json_type and not (
            json_type == "number" and _type_of(value) == "integer"
        ):
            raise UnsupportedSchema(f"{where}: enum value {value!r} is not of type {json_type}")
        text = value if json_type == "string" else json.dumps(value)
        _no_control(f"{where}: enum value", text)
        options.append(_encode(tokenizer, text))
    if len(set(options)) != len(options):
        options = list(dict.fromkeys(options))
    return K3_TYPES[json_type], "options", tuple(options)


def _type_of(value: Any) -> str | None:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "null" if value is None else None


def _tool_spec(name: str, parameters: Any, tokenizer: Any) -> ToolSpec:
    _no_control("tool name", name)
    schema = {} if parameters is None else parameters
    if not isinstance(schema, Mapping):
        raise UnsupportedSchema(f"tool {name!r}: parameters {schema!r} are not an object")
    extra = sorted(set(schema) - _OBJECT_KEYS)
    if extra:
        raise UnsupportedSchema(f"tool {name!r}: unsupported keywords {', '.join(extra)}")
    if schema.get("type", "object") != "object":
        raise UnsupportedSchema(f"tool {name!r}: parameters of type {schema['type']!r}")
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    if not isinstance(properties, Mapping) or not isinstance(required, list):
        raise UnsupportedSchema(f"tool {name!r}: properties or required malformed")
    unknown = [k for k in required if k not in properties]
    if unknown:
        raise UnsupportedSchema(f"tool {name!r}: required keys {unknown} are not properties")
    args = []
    for key, prop in properties.items():
        _no_control(f"tool {name!r} key", key)
        k3_type, kind, options = _value(name, key, prop, tokenizer)
        head = _encode(tokenizer, f'argument key="{escape_attr(key)}" type="{k3_type}"')
        args.append(ArgSpec(head, key in required, kind, options))
    return ToolSpec(_encode(tokenizer, escape_attr(name)), tuple(args))


def _control_id(tokenizer: Any, token: str) -> int:
    ids = _encode(tokenizer, token)
    if len(ids) != 1:
        raise UnsupportedSchema(f"control token {token!r} encodes to {list(ids)}, not one id")
    return ids[0]


def call_spec_for(
    tokenizer: Any, tools: Sequence[Any] | None, name: str | None = None, parallel: bool = True
) -> CallSpec:
    """The call spec of a request: its function tools (only `name` for a named choice)."""
    named = function_tools(tools)
    if name is not None:
        named = [(n, p) for n, p in named if n == name]
    if not named:
        raise UnsupportedSchema(f"no function tool to call (named {name!r})")
    pieces = (("open", OPEN), ("close", CLOSE), ("sep", SEP), ("end", END_OF_MSG))
    return CallSpec(
        pieces=tuple((k, _control_id(tokenizer, t)) for k, t in pieces),
        sequences=tuple((k, _encode(tokenizer, t)) for k, t in _SEQUENCES.items()),
        tools=tuple(_tool_spec(n, p, tokenizer) for n, p in named),
        parallel=bool(parallel),
    )
