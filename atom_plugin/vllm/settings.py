"""The plugin's own settings, read from vLLM's `--additional-config` JSON.

vllm serve MODEL --additional-config '{"atom_plugin": {"tbo": "all"}}'

Every key is checked here, at start: an unknown key or a bad value is refused
with a message that names it and the valid choices.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from atom_plugin.tbo.mode import TBO_MODES, TboConfig

CONFIG_KEY = "atom_plugin"

# Defaults below which a step stays unsplit: the smallest decode batch and prefill batch
# whose split step is at least as fast as the whole one when communication takes 30% of
# the step, so a default never makes a server slower (figures: docs/benchmarks.md,
# "TBO thresholds").
DEFAULT_TBO_DECODE_MIN_REQUESTS = 192
DEFAULT_TBO_PREFILL_MIN_TOKENS = 12288


@dataclass(frozen=True)
class PluginSettings:
    # Add the plugin's V1 logits processors on a GPU. With any custom processor
    # vLLM's V1 runner keeps every request's output tokens and, under async
    # scheduling, waits for the host copy each decode step: a cost every request
    # pays. Model Runner V2 (the GPU default) has no such cost. On CPU they are
    # always added (V1 is the CPU runner).
    v1_logits_processors: bool = False
    # Two-batch overlap: which steps may split into two micro-batches (ATOM's
    # --enable-tbo values), and the smallest decode batch / prefill batch that does.
    tbo: str = "off"
    tbo_decode_min_requests: int = DEFAULT_TBO_DECODE_MIN_REQUESTS
    tbo_prefill_min_tokens: int = DEFAULT_TBO_PREFILL_MIN_TOKENS

    def __post_init__(self) -> None:
        if self.tbo not in TBO_MODES:
            raise ValueError(
                f"atom_plugin setting tbo={self.tbo!r} is not one of {', '.join(TBO_MODES)}"
            )
        self.tbo_config()  # the thresholds' own checks, at start

    def tbo_config(self) -> TboConfig | None:
        """The TBO rule for `tbo`, or None when TBO is off."""
        return TboConfig.for_mode(
            self.tbo,
            decode_min_requests=self.tbo_decode_min_requests,
            prefill_min_tokens=self.tbo_prefill_min_tokens,
        )

    @classmethod
    def from_vllm_config(cls, vllm_config) -> PluginSettings:
        raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY, {})
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: object) -> PluginSettings:
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
            _check_type(name, value, type(getattr(cls, name)))
        return cls(**raw)


def _check_type(name: str, value: object, kind: type) -> None:
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"atom_plugin setting {name} must be true or false, not {value!r}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"atom_plugin setting {name} must be a positive integer, not {value!r}")
    if kind is str and not isinstance(value, str):
        raise ValueError(f"atom_plugin setting {name} must be a string, not {value!r}")
