"""Hook implementations for the Kimi-K3 tool parser and required-channel processors."""

from atom_plugin.hookspecs import hookimpl
from atom_plugin.specs import LogitsProcessorSpec, ToolParserSpec


@hookimpl
def atom_tool_parsers() -> list[ToolParserSpec]:
    return []


@hookimpl
def atom_logits_processors() -> list[LogitsProcessorSpec]:
    return []
