"""The hooks of atom-plugin: one per thing the plugin gives a host.

Third-party packages implement them in a module listed under the setuptools
entry-point group ``atom_plugin``; `atom_plugin.manager` loads those modules.
"""

from __future__ import annotations

import pluggy

from atom_plugin.specs import (
    AttentionBackendSpec,
    HealthProbeSpec,
    LogitsProcessorSpec,
    MicroBatchRunnerSpec,
    ToolParserSpec,
)

PROJECT = "atom_plugin"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def atom_attention_backends() -> list[AttentionBackendSpec]:
    """Attention backends to register with the host under their names."""


@hookspec
def atom_logits_processors() -> list[LogitsProcessorSpec]:
    """Logits processors, each for the model runner it was written for."""


@hookspec
def atom_tool_parsers() -> list[ToolParserSpec]:
    """Tool-call parsers to register with the host."""


@hookspec(firstresult=True)
def atom_microbatch_runner() -> MicroBatchRunnerSpec | None:
    """The two-batch-overlap micro-batch runner (the first implementation wins)."""


@hookspec
def atom_health_probes() -> list[HealthProbeSpec]:
    """GPU health probes that `atom-plugin doctor` can run."""
