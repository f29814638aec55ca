"""Whole Kimi-K3 assistant turns, the samples `atom_kimi_k3` gives the conformance suite
(a reply, tool calls with typed arguments after a reply, a call-only turn), and the
builders of the turn's parts they are written with (the parser's tests use them too)."""

from __future__ import annotations

from atom_plugin.k3.grammar import CLOSE, END_OF_MSG, OPEN, SEP, escape_attr

END = f"{CLOSE}message{SEP}{END_OF_MSG}"  # closes the assistant's message


def argument(key: str, type_: str, value: str) -> str:
    return f'{OPEN}argument key="{escape_attr(key)}" type="{type_}"{SEP}{value}{CLOSE}argument{SEP}'


def call(name: str, index: int, *args: str) -> str:
    """A tool call: `args` are `argument(...)` texts."""
    head = f'{OPEN}call tool="{escape_attr(name)}" index="{index}"{SEP}'
    return head + "".join(args) + f"{CLOSE}call{SEP}"


def tools(*calls: str) -> str:
    return f"{OPEN}tools{SEP}{''.join(calls)}{CLOSE}tools{SEP}"


K3_SAMPLES: tuple[str, ...] = (
    f"The capital of France is Paris.{CLOSE}response{SEP}{END}",
    f"Let me check.{CLOSE}response{SEP}"
    + tools(
        call(
            "get_weather",
            0,
            argument("city", "string", 'Paris "centre"'),
            argument("days", "number", "3"),
            argument("opts", "object", '{"metric": true}'),
        ),
        call("get_time", 1, argument("zone", "string", "CET")),
    )
    + END,
    f"{CLOSE}response{SEP}" + tools(call("ping", 0)) + END,
)
