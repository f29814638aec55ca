"""What every conformance check is made of: a `Check` (one implementation through one
capability's contract), the `Finding`s it yields, and the helpers each capability's
module builds its checks with."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass


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
