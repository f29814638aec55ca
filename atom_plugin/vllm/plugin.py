"""vLLM entry points (`vllm.platform_plugins`, `vllm.general_plugins`).

vLLM calls the platform function on the first use of `current_platform` in
every process, before configs are unpickled, so the backend names registered
there exist wherever a config naming them arrives. Both functions are
idempotent: vLLM may call them several times in one process.
"""

from __future__ import annotations

import functools

from atom_plugin.vllm.registration import (
    plugin_disabled,
    register_attention_backends,
    register_tool_parsers,
)

_PLATFORM_CLASSES = {
    "cpu": "atom_plugin.vllm.platform_cpu.AtomCpuPlatform",
    "rocm": "atom_plugin.vllm.platform_rocm.AtomRocmPlatform",
    "cuda": "atom_plugin.vllm.platform_cuda.AtomCudaPlatform",
}


def detect_builtin_platform() -> str | None:
    """The built-in vLLM platform this process would get without the plugin."""
    from vllm import platforms

    for name in ("rocm", "cuda", "cpu"):
        if platforms.builtin_platform_plugins[name]() is not None:
            return name
    return None


def register_platform() -> str | None:
    """Platform plugin: register backend names, return the platform subclass path."""
    if plugin_disabled():
        return None
    specs = register_attention_backends()
    name = detect_builtin_platform()
    path = _PLATFORM_CLASSES.get(name) if name else None
    _announce(name, path, tuple(spec.name for spec in specs))
    return path


def register_general() -> None:
    """General plugin: backend names (again, harmlessly) and tool parsers."""
    if plugin_disabled():
        return
    register_attention_backends()
    register_tool_parsers()


@functools.cache
def _announce(platform: str | None, path: str | None, backends: tuple[str, ...]) -> None:
    from vllm.logger import init_logger

    logger = init_logger("vllm.atom_plugin")
    if path is None:
        logger.warning(
            "atom-plugin: no supported vLLM platform detected (%s); backends %s are "
            "registered but vLLM's own platform stays active",
            platform,
            ", ".join(backends),
        )
    else:
        logger.info(
            "atom-plugin: platform %s (%s), attention backends %s",
            platform,
            path,
            ", ".join(backends),
        )
