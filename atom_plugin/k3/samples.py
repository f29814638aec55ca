"""Whole Kimi-K3 assistant turns, the samples `atom_kimi_k3` gives the conformance suite
(a reply, tool calls with typed arguments after a reply, a call-only turn)."""

from __future__ import annotations

from atom_plugin.k3.grammar import CLOSE, END_OF_MSG, OPEN, SEP

_END = f"{CLOSE}message{SEP}{END_OF_MSG}"


def _arg(key: str, type_: str, value: str) -> str:
    return f'{OPEN}argument key="{key}" type="{type_}"{SEP}{value}{CLOSE}argument{SEP}'


def _call(name: str, index: int, *args: str) -> str:
    return f'{OPEN}call tool="{name}" index="{index}"{SEP}{"".join(args)}{CLOSE}call{SEP}'


def _tools(*calls: str) -> str:
    return f"{OPEN}tools{SEP}{''.join(calls)}{CLOSE}tools{SEP}"


K3_SAMPLES: tuple[str, ...] = (
    f"The capital of France is Paris.{CLOSE}response{SEP}{_END}",
    f"Let me check.{CLOSE}response{SEP}"
    + _tools(
        _call(
            "get_weather",
            0,
            _arg("city", "string", 'Paris "centre"'),
            _arg("days", "number", "3"),
            _arg("opts", "object", '{"metric": true}'),
        ),
        _call("get_time", 1, _arg("zone", "string", "CET")),
    )
    + _END,
    f"{CLOSE}response{SEP}" + _tools(_call("ping", 0)) + _END,
)
