"""The plugin's own settings, read from vLLM's `--additional-config` JSON.

vllm serve MODEL --additional-config '{"atom_plugin": {"v1_logits_processors": true}}'
"""

from __future__ import annotations

from dataclasses import dataclass, fields

CONFIG_KEY = "atom_plugin"


@dataclass(frozen=True)
class PluginSettings:
    # Add the plugin's V1 logits processors on a GPU. With any custom processor
    # vLLM's V1 runner keeps every request's output tokens and, under async
    # scheduling, waits for the host copy each decode step: a cost every request
    # pays. Model Runner V2 (the GPU default) has no such cost. On CPU they are
    # always added (V1 is the CPU runner).
    v1_logits_processors: bool = False

    @classmethod
    def from_vllm_config(cls, vllm_config) -> PluginSettings:
        raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY, {})
        if not isinstance(raw, dict):
            raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be an object, got {raw!r}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(
                f"unknown atom_plugin setting(s) {', '.join(unknown)}; "
                f"valid settings: {', '.join(known)}"
            )
        for name, value in raw.items():
            if not isinstance(value, bool):
                raise ValueError(f"atom_plugin setting {name} must be true or false, not {value!r}")
        return cls(**raw)
