"""Which requests get the Kimi-K3 required channel, and its ids for a tokenizer.

`required_channel_for(tokenizer)` runs once at startup. It encodes each piece
on its own, as the model's encoder does: control tokens as special tokens, tag
names as plain text. When the tokenizer cannot carry the channel faithfully it
warns once and returns None, and then nothing is constrained.

A named tool choice gets the same channel with the call opening completed:
`named_channel(channel, tokenizer, name)` appends the name's ids and those of
the attribute's closing quote, each piece encoded on its own again.

The channel travels to the worker inside `SamplingParams.extra_args` under
`EXTRA_ARGS_KEY` (a chat request's `vllm_xargs` is copied there), so the
logits processors need neither the request's tools nor its tool choice. A
channel may carry its calls (`calls`: the wire form of a `CallTable`, compiled
where the request came in, call_cache.py); a processor reads them for its
vocabulary's token classes, which it builds once from the engine's tokenizer,
and compiles nothing. Parsed channels are kept in LRUs bounded in entries and
bytes, so repeated requests cost a lookup and no client grows them without limit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from atom_plugin.k3.bounded_cache import MISSING, BoundedCache
from atom_plugin.k3.call_table import CallTable, CheckedCalls, read_wire
from atom_plugin.k3.grammar import (
    CLOSE,
    CONTROL_TOKENS,
    END_OF_MSG,
    OPEN,
    SEP,
    escape_attr,
)
from atom_plugin.k3.required_channel import RequiredChannel
from atom_plugin.k3.token_classes import TokenClasses

logger = logging.getLogger("atom_plugin.k3")

# Tool-call formats (vLLM `--tool-call-parser` names) whose output is K3's.
K3_FORMATS: frozenset[str] = frozenset({"kimi_k3", "atom_kimi_k3"})
EXTRA_ARGS_KEY = "atom_required_channel"

AFTER_PIECES: tuple[str, ...] = (CLOSE, "response", SEP)
HEAD_PIECES: tuple[str, ...] = (OPEN, "tools", SEP)
OPENING_PIECES: tuple[str, ...] = (*HEAD_PIECES, OPEN, 'call tool="')
NAME_END_PIECE = '"'

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("Kimi-K3 required channel disabled: %s", message)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _encode_pieces(tokenizer: Any, pieces: Sequence[str]) -> list[int]:
    return [i for piece in pieces for i in _encode(tokenizer, piece)]


def required_channel_for(tokenizer: Any) -> RequiredChannel | None:
    """The channel in this tokenizer's ids, or None (with one warning) if it cannot hold."""
    control: dict[str, int] = {}
    for token in CONTROL_TOKENS:
        ids = _encode(tokenizer, token)
        if len(ids) != 1:
            _warn_once(f"control token {token!r} encodes to {len(ids)} ids {ids}, not one")
            return None
        control[token] = ids[0]
    after = _encode_pieces(tokenizer, AFTER_PIECES)
    head = _encode_pieces(tokenizer, HEAD_PIECES)
    for name, pieces, separate in (
        ("after", AFTER_PIECES, after),
        ("the opening's head", HEAD_PIECES, head),
    ):
        whole = _encode(tokenizer, "".join(pieces))
        if separate != whole:
            _warn_once(
                f"{name} {''.join(pieces)!r} encodes as {whole} but its pieces encode as "
                f"{separate}: the ids the model writes would not match"
            )
            return None
    end_ids = {control[END_OF_MSG]}
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        end_ids.add(eos)
    try:
        return RequiredChannel(
            after=after,
            opening=_encode_pieces(tokenizer, OPENING_PIECES),
            opens_at=len(head),
            end_ids=end_ids,
        )
    except ValueError as err:
        _warn_once(str(err))
        return None


class ToolChoiceError(ValueError):
    """A named tool choice that the channel cannot force (the server answers 400)."""


def _field(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, Mapping) else getattr(value, key, None)


def named_tool(tool_choice: Any) -> str | None:
    """The function a named tool choice names, or None for any other choice.

    Chat Completions: `{"type": "function", "function": {"name": N}}`; Responses:
    `{"type": "function", "name": N}`; the same as vLLM's request objects.
    """
    if tool_choice is None or isinstance(tool_choice, str):
        return None
    if _field(tool_choice, "type") != "function":
        return None
    function = _field(tool_choice, "function")
    name = _field(function, "name") if function is not None else _field(tool_choice, "name")
    return name if isinstance(name, str) else None


def tool_names(tools: Sequence[Any] | None, namespace: str = "") -> list[str]:
    """The names of a request's function tools (Chat Completions or Responses shape).

    A Responses namespace's tools are named `<namespace>__<name>`, as vLLM flattens them.
    """
    names = []
    for tool in tools or ():
        kind = _field(tool, "type")
        if kind == "namespace" and isinstance(_field(tool, "name"), str):
            names += tool_names(_field(tool, "tools"), f"{namespace}{_field(tool, 'name')}__")
            continue
        if kind not in (None, "function"):
            continue
        function = _field(tool, "function")
        name = _field(function, "name") if function is not None else _field(tool, "name")
        if isinstance(name, str):
            names.append(namespace + name)
    return names


def wants_channel(tool_choice: Any, tools: Sequence[Any] | None, tool_format: str | None) -> bool:
    """The gate: `tool_choice="required"` or a named function, with tools, in a K3 format."""
    forces_a_call = tool_choice == "required" or named_tool(tool_choice) is not None
    return forces_a_call and bool(tools) and tool_format in K3_FORMATS


def wants_auto_channel(
    tool_choice: Any, tools: Sequence[Any] | None, tool_format: str | None
) -> bool:
    """`tool_choice="auto"` (or unset) with tools in a K3 format: the optional channel, which
    constrains the calls once the model opens the tools channel itself."""
    return tool_choice in (None, "auto") and bool(tools) and tool_format in K3_FORMATS


def named_channel(channel: RequiredChannel, tokenizer: Any, name: str) -> RequiredChannel:
    """`channel` forcing the call opening through `tool="NAME"` (the name escaped as K3 does).

    A name holding a control token cannot be an attribute value: ToolChoiceError.
    """
    inside = [token for token in CONTROL_TOKENS if token in name]
    if inside or not name:
        raise ToolChoiceError(
            f"tool_choice names the function {name!r}, which cannot be forced as a Kimi-K3 "
            f"call: {'it holds the control token(s) ' + ', '.join(inside) if inside else 'empty'}"
        )
    return channel.extended(_encode_pieces(tokenizer, (escape_attr(name), NAME_END_PIECE)))


def channel_for_choice(
    channel: RequiredChannel, tokenizer: Any, tool_choice: Any, tools: Sequence[Any] | None
) -> RequiredChannel:
    """The channel for a request that passed the gate: `channel` itself for `required`,
    the named channel for a named choice; a name not among `tools` is a ToolChoiceError."""
    name = named_tool(tool_choice)
    if name is None:
        return channel
    names = tool_names(tools)
    if name not in names:
        raise ToolChoiceError(
            f"tool_choice names the function {name!r}, which is not one of the request's "
            f"tools: {', '.join(repr(n) for n in names) or 'none'}"
        )
    return named_channel(channel, tokenizer, name)


def channel_extra_args(
    channel: RequiredChannel, calls: CallTable | Mapping[str, Any] | None = None
) -> dict[str, str]:
    """The `extra_args` / `vllm_xargs` entry that asks the processors for `channel`,
    going on into `calls` (a call table or its wire form) after its opening when given."""
    value: dict[str, Any] = {
        "after": list(channel.after),
        "opening": list(channel.opening),
        "opens_at": channel.opens_at,
        "end_ids": sorted(channel.end_ids),
    }
    if channel.optional:
        value["optional"] = True
    if calls is not None:
        value["calls"] = calls.to_wire() if isinstance(calls, CallTable) else dict(calls)
    return {EXTRA_ARGS_KEY: json.dumps(value, separators=(",", ":"))}


_FIELDS = ("after", "opening", "opens_at", "end_ids")
_OPTIONS = ("optional", "calls")
# Checked channels by their JSON string, and channels ready for a step by (string, stop
# ids, classes): requests of one server repeat a few (one per tool set, name, stop ids).
_parsed = BoundedCache(max_entries=256, max_bytes=512 << 20)
_ready = BoundedCache(max_entries=256, max_bytes=512 << 20)


def channel_args(
    extra_args: Mapping[str, Any] | None,
) -> tuple[RequiredChannel, CheckedCalls | None] | None:
    """The channel a request asked for and its calls (None without), None if it asked for
    no channel; ValueError if malformed (CallsTooLarge beyond the call tables' limits).
    Checks the calls' arrays without tying them to a vocabulary."""
    if not extra_args or EXTRA_ARGS_KEY not in extra_args:
        return None
    raw = extra_args[EXTRA_ARGS_KEY]
    if isinstance(raw, str):
        hit = _parsed.get(raw)
        if hit is not MISSING:
            return hit
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
        if not isinstance(value, Mapping) or not set(_FIELDS) <= set(value) <= {
            *_FIELDS,
            *_OPTIONS,
        }:
            raise ValueError(
                f"expected exactly the keys {', '.join(_FIELDS)} (and {', '.join(_OPTIONS)})"
            )
        channel = RequiredChannel(
            **{k: value[k] for k in _FIELDS}, optional=value.get("optional", False)
        )
        calls = CheckedCalls(*read_wire(value["calls"])) if "calls" in value else None
    except (TypeError, ValueError) as err:
        shown = raw if len(str(raw)) < 300 else f"{str(raw)[:300]}..."
        raise ValueError(
            f"extra_args[{EXTRA_ARGS_KEY!r}]={shown!r} is not a required channel: {err}"
        ) from err
    if isinstance(raw, str):
        _parsed.put(raw, (channel, calls), len(raw) + (calls.nbytes if calls else 0))
    return channel, calls


def channel_from_extra_args(
    extra_args: Mapping[str, Any] | None, classes: TokenClasses | None = None
) -> RequiredChannel | None:
    """The channel a request asked for, None if it asked for none; ValueError if malformed.

    A channel with calls is tied to `classes` (the vocabulary's token classes, which
    must be those it was compiled for), and is a ValueError without them.
    """
    args = channel_args(extra_args)
    if args is None:
        return None
    channel, calls = args
    return channel if calls is None else _with_calls(channel, calls, classes)


def _with_calls(
    channel: RequiredChannel, calls: CheckedCalls, classes: TokenClasses | None
) -> RequiredChannel:
    if classes is None:
        raise ValueError(
            f"extra_args[{EXTRA_ARGS_KEY!r}] carries calls, which need the vocabulary's token "
            "classes: none were given"
        )
    return channel.with_calls(calls.bind(classes))


def request_channel(
    params: Any, classes: Callable[[], TokenClasses] | None = None
) -> RequiredChannel | None:
    """A request's channel (from its `SamplingParams`) with the engine's stop ids banned too.

    `classes` gives the vocabulary's token classes; it is called only for a channel with
    calls (a channel with calls and no `classes` is a ValueError). A channel already
    seen (same string, stop ids) is a lookup.
    """
    raw = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
    if raw is None:
        return None
    stop_ids = tuple(sorted(params.all_stop_token_ids))
    key = (raw, stop_ids) if isinstance(raw, str) else None
    if key is not None:
        hit = _ready.get(key)
        if hit is not MISSING and (
            hit.calls is None or (classes is not None and hit.calls.token_classes is classes())
        ):
            return hit
    channel, calls = channel_args(params.extra_args)
    if calls is not None:
        channel = _with_calls(channel, calls, None if classes is None else classes())
    channel = channel.ending_on(stop_ids)
    if key is not None:
        _ready.put(key, channel, len(raw) + (calls.nbytes if calls else 0))
    return channel
