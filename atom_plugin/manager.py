"""The plugin manager: the project's own parts plus anything installed under
the ``atom_plugin`` entry-point group."""

from __future__ import annotations

import functools
import importlib

import pluggy

from atom_plugin import hookspecs
from atom_plugin.specs import (
    AttentionBackendSpec,
    HealthProbeSpec,
    LogitsProcessorSpec,
    MicroBatchRunnerSpec,
    ToolParserSpec,
)

# The project's own hook implementations, one module per capability.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "atom_plugin.attention.plugin",
    "atom_plugin.k3.plugin",
    "atom_plugin.tbo.plugin",
    "atom_plugin.doctor.plugin",
)


def new_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh manager with the built-in parts (and, by default, third-party ones)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    if load_entry_points:
        pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    return pm


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager; tests may register extra implementations on it."""
    return new_plugin_manager()


def _flatten(results: list[list | None]) -> list:
    return [item for group in results if group for item in group]


def _unique_by(items: list, key: str, what: str) -> list:
    seen: dict[str, object] = {}
    for item in items:
        k = getattr(item, key)
        if k in seen and seen[k] != item:
            raise ValueError(f"two {what}s are named {k!r}: {seen[k]} and {item}")
        seen[k] = item
    return list(seen.values())


def attention_backends(pm: pluggy.PluginManager | None = None) -> list[AttentionBackendSpec]:
    pm = pm or get_plugin_manager()
    return _unique_by(_flatten(pm.hook.atom_attention_backends()), "name", "attention backend")


def logits_processors(pm: pluggy.PluginManager | None = None) -> list[LogitsProcessorSpec]:
    pm = pm or get_plugin_manager()
    return _unique_by(_flatten(pm.hook.atom_logits_processors()), "class_path", "logits processor")


def tool_parsers(pm: pluggy.PluginManager | None = None) -> list[ToolParserSpec]:
    pm = pm or get_plugin_manager()
    return _unique_by(_flatten(pm.hook.atom_tool_parsers()), "name", "tool parser")


def microbatch_runner(pm: pluggy.PluginManager | None = None) -> MicroBatchRunnerSpec | None:
    pm = pm or get_plugin_manager()
    return pm.hook.atom_microbatch_runner()


def health_probes(pm: pluggy.PluginManager | None = None) -> list[HealthProbeSpec]:
    pm = pm or get_plugin_manager()
    return _unique_by(_flatten(pm.hook.atom_health_probes()), "smi", "health probe")
