"""Registering what the hooks return with vLLM's registries (idempotent)."""

from __future__ import annotations

import os

from atom_plugin import manager
from atom_plugin.specs import AttentionBackendSpec

DISABLE_ENV = "ATOM_PLUGIN_DISABLE"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """An on/off environment switch: unset, empty, 0, false, no or off is off."""
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name}={value!r} is not understood; use one of {', '.join(_TRUE + _FALSE[1:])}"
    )


def plugin_disabled() -> bool:
    """True when ATOM_PLUGIN_DISABLE asks vLLM to run as if the plugin were absent."""
    return env_flag(DISABLE_ENV)


def dotted(class_path: str) -> str:
    """'pkg.mod:Name' -> 'pkg.mod.Name', the form vLLM's registries resolve."""
    module, _, name = class_path.partition(":")
    return f"{module}.{name}"


def register_attention_backends() -> list[AttentionBackendSpec]:
    """Add every hook-supplied backend to vLLM's AttentionBackendEnum once."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    specs = manager.attention_backends()
    for spec in specs:
        member = AttentionBackendEnum.__members__.get(spec.name)
        if member is None:
            AttentionBackendEnum.register(spec.name, dotted(spec.class_path))
        elif member.value != dotted(spec.class_path):
            raise ValueError(
                f"attention backend {spec.name} is already registered as {member.value}, "
                f"not {dotted(spec.class_path)}"
            )
    return specs


def register_tool_parsers() -> None:
    """Make every hook-supplied tool parser known to vLLM (imported on first use)."""
    from vllm.tool_parsers import ToolParserManager

    for spec in manager.tool_parsers():
        module, _, name = spec.class_path.partition(":")
        ToolParserManager.register_lazy_module(spec.name, module, name)


def backend_for(selected_name: str, use_mla: bool) -> AttentionBackendSpec | None:
    """The plugin backend that serves a layer when `selected_name` was chosen.

    The MHA name also serves MLA layers (`--attention-backend atom_aiter` on a
    DeepSeek model): the layer kind picks the class. Names that are not the
    plugin's give None.
    """
    specs = {spec.name: spec for spec in manager.attention_backends()}
    selected = specs.get(selected_name)
    if selected is None:
        return None
    if selected.kind == "mla" or not use_mla:
        return selected
    mla = [spec for spec in specs.values() if spec.kind == "mla"]
    if not mla:
        raise ValueError(f"{selected_name} was selected for an MLA layer but no MLA backend exists")
    return mla[0]
