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
`enum`/`const` of one of those types; properties of type object and array, whose
value is JSON (K3 writes it so), as a `JsonSpec`: nested objects under the same
rules, arrays with an `items` schema of any of these types, JSON strings, numbers,
booleans, null and enums. Everything else (type unions, `anyOf`/`oneOf`/`allOf`/
`$ref`, string length and pattern, numeric bounds, array length, `prefixItems`,
`patternProperties`, an array without `items`, ...) is unsupported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from atom_plugin.k3.call_automaton import (
    MAX_JSON_DEPTH,
    ArgSpec,
    CallSpec,
    CallSpecError,
    JsonProp,
    JsonSpec,
    ToolSpec,
)
from atom_plugin.k3.grammar import CLOSE, CONTROL_TOKENS, END_OF_MSG, OPEN, SEP, escape_attr

# JSON type -> K3 `type=` attribute (integer is written as number, as K3's encoder does).
K3_TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean"}
K3_TYPES.update(null="null", object="object", array="array")
# Keywords that describe but do not constrain.
_NOTES = frozenset({"description", "title", "default", "examples", "$comment", "deprecated"})
_OBJECT_KEYS = _NOTES | {"type", "properties", "required", "additionalProperties", "$schema"}
_VALUE_KEYS = _NOTES | {"type", "enum", "const", "format"}
_ARRAY_KEYS = _NOTES | {"type", "items"}
_KEYWORDS = {"object": _OBJECT_KEYS, "array": _ARRAY_KEYS}
_ANY_KEYS = _OBJECT_KEYS | _ARRAY_KEYS | _VALUE_KEYS
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


class _Encoder:
    """A request's texts, each encoded on its own (as the model's encoder does) and once.

    `prime(texts)` encodes those not seen yet; a Hugging Face fast tokenizer takes them in
    one batch of its backend. The ids are checked where a text is used (`enc(text)`), so a
    text that cannot be encoded fails there, as if it had been encoded there.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.unknown = getattr(tokenizer, "unk_token_id", None)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        fast = getattr(tokenizer, "is_fast", False) is True and backend is not None
        # `encode_batch_fast` gives the same ids without computing offsets.
        self._batch = getattr(backend, "encode_batch_fast", backend.encode_batch) if fast else None
        self._ids: dict[str, tuple[int, ...]] = {}

    def prime(self, texts: Iterable[str]) -> None:
        if self._batch is None:
            return
        new = [t for t in dict.fromkeys(texts) if t not in self._ids]
        if new:
            batch = self._batch(new, add_special_tokens=False)
            self._ids.update(zip(new, (tuple(e.ids) for e in batch), strict=True))

    def __call__(self, text: str) -> tuple[int, ...]:
        ids = self._ids.get(text)
        if ids is None:
            ids = self._ids[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return _checked(text, ids, self.unknown)

    def many(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        self.prime(texts)
        return [self(t) for t in texts]


def _checked(text: str, ids: tuple[int, ...], unknown: int | None) -> tuple[int, ...]:
    if not ids:
        raise UnsupportedSchema(f"{text!r} encodes to no ids")
    if unknown is not None and unknown in ids:
        raise UnsupportedSchema(f"{text!r} encodes to the tokenizer's unknown token {unknown}")
    return ids


def _no_control(what: str, text: str) -> None:
    if "<|" not in text:  # every K3 marker starts so
        return
    inside = [t for t in CONTROL_TOKENS if t in text]
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


def _json_type(where: str, schema: Any) -> str:
    """The JSON type of a property's schema, once its keywords are all supported."""
    if not isinstance(schema, Mapping):
        raise UnsupportedSchema(f"{where}: schema {schema!r} is not an object")
    json_type = schema.get("type")
    choices = _choices(where, schema)
    if json_type is None and choices:
        json_type = _type_of(choices[0])
    known = json_type in K3_TYPES if isinstance(json_type, str) else False
    extra = sorted(
        set(schema) - _KEYWORDS.get(json_type, _VALUE_KEYS) if known else set(schema) - _ANY_KEYS
    )
    if extra:
        raise UnsupportedSchema(f"{where}: unsupported keywords {', '.join(extra)}")
    if not known:
        raise UnsupportedSchema(f"{where}: type {json_type!r} is not one of {', '.join(K3_TYPES)}")
    return json_type


def _choices(where: str, schema: Mapping) -> list | None:
    """The values `enum` and `const` allow together, None when neither is given."""
    choices = schema.get("enum")
    if "const" in schema:
        choices = (
            [schema["const"]] if choices is None else [v for v in choices if v == schema["const"]]
        )
    if choices is not None and (not isinstance(choices, list) or not choices):
        raise UnsupportedSchema(f"{where}: enum {choices!r} is not a non-empty list")
    return choices


def _scalar_choices(where: str, schema: Mapping, json_type: str) -> list | None:
    """The values a scalar allows (booleans and null are finite), None for any."""
    choices = _choices(where, schema)
    if json_type == "boolean" and choices is None:
        choices = [True, False]
    if json_type == "null":
        choices = [None]
    if json_type == "string" and all(isinstance(v, str) for v in choices or ()):
        return choices
    for value in choices or ():
        if _type_of(value) != json_type and not (
            json_type == "number" and _type_of(value) == "integer"
        ):
            raise UnsupportedSchema(f"{where}: enum value {value!r} is not of type {json_type}")
    return choices


def _options(where: str, texts: list[str], enc: _Encoder) -> tuple[tuple[int, ...], ...]:
    what = f"{where}: enum value"
    for text in texts:
        _no_control(what, text)
    return tuple(dict.fromkeys(enc.many(texts)))


def _value(tool: str, key: str, schema: Any, enc: _Encoder) -> tuple[str, str, tuple, Any]:
    """(K3 type, kind, options, JSON spec or None) of one property."""
    where = f"tool {tool!r} property {key!r}"
    json_type = _json_type(where, schema)
    if json_type in ("object", "array"):
        return K3_TYPES[json_type], "json", (), _json(where, schema, enc)
    choices = _scalar_choices(where, schema, json_type)
    if choices is None:
        return K3_TYPES[json_type], "text" if json_type == "string" else json_type, (), None
    texts = [v if json_type == "string" else json.dumps(v) for v in choices]
    return K3_TYPES[json_type], "options", _options(where, texts, enc), None


def _json(where: str, schema: Any, enc: _Encoder, depth: int = 0) -> JsonSpec:
    """A value written as JSON (a property of type object or array, and what is inside)."""
    if depth > MAX_JSON_DEPTH:
        raise UnsupportedSchema(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
    json_type = _json_type(where, schema)
    if json_type == "object":
        props = []
        properties = _properties(where, schema)
        names = [json.dumps(key, ensure_ascii=False) for key, _, _ in properties]
        enc.prime(["{", "}", *(f"{n}: " for n in names), *(f", {n}: " for n in names)])
        for (key, prop, required), name in zip(properties, names, strict=True):
            value = _json(f"{where} key {key!r}", prop, enc, depth + 1)
            props.append(JsonProp(enc(f"{name}: "), enc(f", {name}: "), required, value))
        return JsonSpec("object", open=enc("{"), close=enc("}"), props=tuple(props))
    if json_type == "array":
        items = schema.get("items")
        if not isinstance(items, Mapping):
            raise UnsupportedSchema(f"{where}: an array without an items schema ({items!r})")
        return JsonSpec(
            "array",
            open=enc("["),
            close=enc("]"),
            sep=enc(", "),
            items=_json(f"{where} items", items, enc, depth + 1),
        )
    choices = _scalar_choices(where, schema, json_type)
    if choices is not None:
        texts = [json.dumps(v, ensure_ascii=False) for v in choices]
        return JsonSpec("options", options=_options(where, texts, enc))
    if json_type == "string":
        return JsonSpec("string", open=enc('"'), close=enc('"'))
    return JsonSpec(json_type)


def _properties(where: str, schema: Mapping) -> list[tuple[str, Any, bool]]:
    """(key, schema, required) of an object schema's properties, in order."""
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    if not isinstance(properties, Mapping) or not isinstance(required, list):
        raise UnsupportedSchema(f"{where}: properties or required malformed")
    unknown = [k for k in required if k not in properties]
    if unknown:
        raise UnsupportedSchema(f"{where}: required keys {unknown} are not properties")
    for key in properties:
        _no_control(f"{where} key", key)
    return [(key, prop, key in required) for key, prop in properties.items()]


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


def _tool_spec(name: str, parameters: Any, enc: _Encoder) -> ToolSpec:
    _no_control("tool name", name)
    schema = {} if parameters is None else parameters
    if not isinstance(schema, Mapping):
        raise UnsupportedSchema(f"tool {name!r}: parameters {schema!r} are not an object")
    extra = sorted(set(schema) - _OBJECT_KEYS)
    if extra:
        raise UnsupportedSchema(f"tool {name!r}: unsupported keywords {', '.join(extra)}")
    if schema.get("type", "object") != "object":
        raise UnsupportedSchema(f"tool {name!r}: parameters of type {schema['type']!r}")
    values = [
        (key, required, *_value(name, key, prop, enc))
        for key, prop, required in _properties(f"tool {name!r}", schema)
    ]
    heads = enc.many(
        [f'argument key="{escape_attr(key)}" type="{k3_type}"' for key, _, k3_type, *_ in values]
    )
    args = [
        ArgSpec(head, required, kind, options, json_spec)
        for head, (_, required, _, kind, options, json_spec) in zip(heads, values, strict=True)
    ]
    return ToolSpec(enc(escape_attr(name)), tuple(args))


def _control_id(enc: _Encoder, token: str) -> int:
    ids = enc(token)
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
    enc = _Encoder(tokenizer)
    # The fixed pieces and every tool's name in one batch (the rest is batched per tool).
    enc.prime([*CONTROL_TOKENS, *_SEQUENCES.values(), *(escape_attr(n) for n, _ in named)])
    return CallSpec(
        pieces=tuple((k, _control_id(enc, t)) for k, t in pieces),
        sequences=tuple((k, enc(t)) for k, t in _SEQUENCES.items()),
        tools=tuple(_tool_spec(n, p, enc) for n, p in named),
        parallel=bool(parallel),
    )
