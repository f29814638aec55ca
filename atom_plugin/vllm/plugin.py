"""vLLM entry points (`vllm.platform_plugins`, `vllm.general_plugins`).

vLLM calls the platform function on the first use of `current_platform` in
every process, before configs are unpickled, so the backend names registered
there exist wherever a config naming them arrives. Both functions are
idempotent: vLLM may call them several times in one process.
"""

from __future__ import annotations

import functools

from atom_plugin.vllm.compat import unsupported_message
from atom_plugin.vllm.guard import running_vllm, setup_step
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
    """Platform plugin: register backend names, return the platform subclass path (None:
    vLLM keeps its own platform, also when the plugin cannot set itself up here)."""
    if plugin_disabled():
        return None
    with setup_step("its platform and attention backends"):
        register_attention_backends()
        name = detect_builtin_platform()
        path = _PLATFORM_CLASSES.get(name) if name else None
        if path is not None:
            from vllm.utils.import_utils import resolve_obj_by_qualname

            # vLLM imports it next: a class that cannot import stands aside
            resolve_obj_by_qualname(path)
        return path
    return None


def register_general() -> None:
    """General plugin: backend names (again, harmlessly), tool parsers, one log line.

    It runs after vLLM has set up its logging, which the platform plugin does not.
    """
    if plugin_disabled():
        return
    with setup_step("its attention backends and tool parsers"):
        specs = register_attention_backends()
        register_tool_parsers()
        _announce(tuple(spec.name for spec in specs))


@functools.cache
def _announce(backends: tuple[str, ...]) -> None:
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    logger = init_logger("vllm.atom_plugin")
    outside_range = unsupported_message(running_vllm())
    if outside_range:
        logger.warning(outside_range)
    platform = type(current_platform)
    if platform.__module__.startswith("atom_plugin."):
        logger.info(
            "atom-plugin: platform %s (%s), attention backends %s",
            current_platform.device_type,
            platform.__name__,
            ", ".join(backends),
        )
    else:
        logger.warning(
            "atom-plugin: vLLM's platform %s is not one the plugin extends (cpu, rocm, "
            "cuda); attention backends %s are registered but --attention-backend "
            "atom_aiter may not route to them",
            platform.__name__,
            ", ".join(backends),
        )
