"""The conformance suite: every registered hook implementation through its contract.

`atom-plugin conformance [--plugin NAME]` and `pytest --pyargs atom_plugin.conformance`
run the same checks over the project's own implementations and any installed through
the `atom_plugin` entry points (docs/conformance.md lists the contract items). Each
check yields findings; a failing one names the implementation, the contract item and
the case.
"""

from __future__ import annotations

import pluggy

from atom_plugin.conformance.findings import Check, Finding, MissingDependency, checks_of, load

__all__ = ["PLUGIN_ENV", "Check", "Finding", "MissingDependency", "checks", "checks_of", "load"]

PLUGIN_ENV = "ATOM_PLUGIN_CONFORMANCE_PLUGIN"  # the pytest entry point's --plugin


def checks(pm: pluggy.PluginManager | None = None, plugin: str | None = None) -> list[Check]:
    """Every implementation's check, or those of the plugin named `plugin`."""
    from atom_plugin import manager
    from atom_plugin.conformance import attention, logits, probes, tool_parsers

    pm = pm or manager.new_plugin_manager()
    names = {name for name, _ in pm.list_name_plugin()}
    if plugin is not None and plugin not in names:
        raise ValueError(f"--plugin {plugin!r} is not one of {', '.join(sorted(names))}")
    found = []
    for name, module in sorted(pm.list_name_plugin(), key=lambda item: item[0]):
        if plugin is not None and name != plugin:
            continue
        for capability in (attention, tool_parsers, logits, probes):
            found.extend(capability.checks_for(module, name))
    return found
