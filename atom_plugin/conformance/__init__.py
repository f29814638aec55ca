"""The conformance suite: every registered hook implementation through its contract.

`atom-plugin conformance [--plugin NAME]` and `pytest --pyargs atom_plugin.conformance`
run the same checks over the project's own implementations and any installed through
the `atom_plugin` entry points (docs/conformance.md lists the contract items). Each
check yields findings; a failing one names the implementation, the contract item and
the case.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pluggy

PLUGIN_ENV = "ATOM_PLUGIN_CONFORMANCE_PLUGIN"  # the pytest entry point's --plugin


class MissingDependency(RuntimeError):
    """A package the suite needs is not installed (the message names it)."""


@dataclass(frozen=True)
class Finding:
    implementation: str  # e.g. "attention backend ATOM_AITER (atom_plugin.attention.plugin)"
    item: str  # the contract item
    case: str  # the case it was checked on ("-" when it has none)
    ok: bool
    detail: str = ""

    def __str__(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        text = f"{mark} {self.implementation} | {self.item} | {self.case}"
        return f"{text}: {self.detail}" if self.detail else text


@dataclass(frozen=True)
class Check:
    """One implementation's run through one capability's contract."""

    implementation: str  # what it is and the plugin that registered it
    run: Callable[[], Iterator[Finding]]


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


def load(class_path: str):
    """'package.module:Name' -> the object (import errors propagate to the caller)."""
    module, _, name = class_path.partition(":")
    return getattr(importlib.import_module(module), name)


def checks_of(module, plugin: str, hook: str, describe, check) -> list[Check]:
    """A Check for each spec that `plugin`'s implementation of `hook` returns (none
    implemented: none), labelled `describe(spec)` and the plugin; it runs `check(spec, label)`."""
    impl = getattr(module, hook, None)
    found = []
    for spec in (impl() or []) if impl is not None else []:
        label = f"{describe(spec)} ({plugin})"
        found.append(Check(label, functools.partial(check, spec, label)))
    return found
