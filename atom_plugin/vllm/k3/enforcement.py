"""What enforces Kimi-K3's `tool_choice="required"` and named tool choices in this engine.

Either the plugin's channel (its logits processor, installed for the engine's model
runner) or vLLM's own kimi_k3 structural tag (xgrammar). The platform decides it for
each engine config (`decide`, from `check_and_update_config`) and records the decision
for its process (`record`); the tool parser `atom_kimi_k3`, which runs in the API server
and never sees the config, reads it back (`channel_state`).

vLLM 0.32 runs the platform's `check_and_update_config` in each process that builds a
`VllmConfig`: the API server builds the engine's config from the command line and hands
it to the engine core, which checks its copy again. The processors the engine loads are
the ones in that config, so the API server's record is the engine's decision. A process
that built no config (a parser used on its own) has no record: there the channel is off.
"""

from __future__ import annotations

from dataclasses import dataclass

from atom_plugin.vllm.compat.runners import sampling_replay, standalone_cpu_runner
from atom_plugin.vllm.registration import env_flag
from atom_plugin.vllm.settings import PluginSettings

CHANNEL_PROCESSOR = "atom_k3_required_channel"  # the LogitsProcessorSpec name
KEEP_STRUCTURAL_TAG_ENV = "ATOM_K3_STRUCTURAL_TAG"
V1_OPT_IN = '--additional-config \'{"atom_plugin": {"v1_logits_processors": true}}\''
USE_MRV2 = "Model Runner V2 (vLLM's GPU default: leave VLLM_USE_V2_MODEL_RUNNER unset)"


def keep_structural_tag() -> bool:
    """`ATOM_K3_STRUCTURAL_TAG`: 1 keeps vLLM's structural tag for required and named requests."""
    return env_flag(KEEP_STRUCTURAL_TAG_ENV)


@dataclass(frozen=True)
class ChannelDecision:
    """Whether the channel serves required and named requests, and if not why and what fixes it."""

    off: str | None  # None: the channel is live
    fix: str | None = None
    processor: str | None = None  # the channel's class path in the engine, when live
    runner: str | None = None

    @property
    def live(self) -> bool:
        return self.off is None


NO_ENGINE = ChannelDecision(
    off="no vLLM engine config was checked by the atom-plugin platform in this process",
    fix="serve the model with vLLM and the plugin's platform active (ATOM_PLUGIN_DISABLE unset)",
)

_recorded: ChannelDecision = NO_ENGINE


def processor_refusal(vllm_config, runner: str, platform) -> tuple[str, str] | None:
    """Why the plugin's logits processors stay off in this engine on `platform` (the
    platform class), and the setting that fixes it; None where vLLM takes them."""
    if vllm_config.model_config.runner_type == "pooling":
        return "pooling models take no logits processors", "none: pooling models make no tool calls"
    if sampling_replay(vllm_config):
        return (
            "sampling distribution replay (return_sampling_mask) refuses custom logits processors",
            "turn return_sampling_mask off",
        )
    if standalone_cpu_runner(platform):
        return (
            "vLLM's standalone CPU model runner (a CPU without Triton) refuses custom logits "
            "processors",
            "run on an x86 CPU with triton-cpu, or on a GPU",
        )
    if runner == "v1" and vllm_config.speculative_config is not None:
        fix = "drop --speculative-config"
        if platform.device_type != "cpu":
            fix += f", or use {USE_MRV2}, which takes them with speculative decoding"
        return "the V1 model runner refuses custom logits processors with speculative decoding", fix
    if runner == "v1" and platform.device_type != "cpu":
        if not PluginSettings.from_vllm_config(vllm_config).v1_logits_processors:
            return (
                "on a GPU the V1 model runner makes every request pay for custom processors, "
                "so they wait for an opt-in",
                f"{V1_OPT_IN}, or use {USE_MRV2}",
            )
    return None


def decide(
    runner: str, refusal: tuple[str, str] | None, installed, channel_paths
) -> ChannelDecision:
    """The decision for an engine whose logits processors are `installed` (the config's list
    after the platform's check); `channel_paths` are the channel's classes for `runner`."""
    if refusal is not None:
        return ChannelDecision(off=f"its logits processor is off: {refusal[0]}", fix=refusal[1])
    present = [path for path in channel_paths if path in (installed or [])]
    if not present:
        return ChannelDecision(
            off=f"no {CHANNEL_PROCESSOR} logits processor for the {runner} runner is installed",
            fix="register the atom_plugin entry points (reinstall atom-plugin)",
        )
    return ChannelDecision(off=None, processor=present[0], runner=runner)


def record(decision: ChannelDecision) -> ChannelDecision:
    """Record this process's decision; returns the one it replaces."""
    global _recorded
    before, _recorded = _recorded, decision
    return before


def channel_state() -> ChannelDecision:
    """This process's decision, with `ATOM_K3_STRUCTURAL_TAG` read now."""
    if keep_structural_tag():
        return ChannelDecision(
            off=f"{KEEP_STRUCTURAL_TAG_ENV}=1 keeps vLLM's structural tag",
            fix=f"unset {KEEP_STRUCTURAL_TAG_ENV}",
        )
    return _recorded


def strict_tool_calling() -> bool:
    """vLLM attaches its kimi_k3 structural tag only with VLLM_ENFORCE_STRICT_TOOL_CALLING on."""
    from vllm import envs

    return bool(envs.VLLM_ENFORCE_STRICT_TOOL_CALLING)


def enforcement_line(decision: ChannelDecision) -> str:
    """The start-up line: which of the two enforces required (and named) K3 tool choices."""
    subject = 'atom-plugin: Kimi-K3 tool_choice="required" and named tool choices (atom_kimi_k3)'
    if decision.live:
        return (
            f"{subject} are enforced by the plugin's channel "
            f"({decision.processor}, {decision.runner} runner)"
        )
    if strict_tool_calling():
        return (
            f"{subject} are enforced by vLLM's kimi_k3 structural tag, not the plugin's "
            f"channel: {decision.off}; a request that gets no structural tag is refused (400). "
            f"For the channel: {decision.fix}"
        )
    return (
        f"{subject} are refused (400): the plugin's channel is off ({decision.off}) and vLLM "
        "attaches no structural tag (VLLM_ENFORCE_STRICT_TOOL_CALLING=0). For vLLM's tag: "
        f"set VLLM_ENFORCE_STRICT_TOOL_CALLING=1; for the channel: {decision.fix}"
    )


def unenforced_message(decision: ChannelDecision, choice: str) -> str:
    """The 400 for a required or named request that neither the channel nor a tag enforces."""
    if strict_tool_calling():
        tag = "vLLM gives this request no kimi_k3 structural tag"
    else:
        tag = "vLLM attaches no structural tag (VLLM_ENFORCE_STRICT_TOOL_CALLING=0)"
    return (
        f"tool_choice={choice} cannot be enforced in this engine: the atom-plugin channel is off "
        f"({decision.off}) and {tag}. Fix: {decision.fix}; or, for vLLM's structural tag, "
        "set VLLM_ENFORCE_STRICT_TOOL_CALLING=1"
    )


def unsupported_message(reason: str, choice: str) -> str:
    """The 400 for a required or named request whose schemas the channel cannot enforce,
    where vLLM gives no structural tag either."""
    return (
        f"tool_choice={choice} cannot be enforced: the atom-plugin channel cannot enforce this "
        f"request's tool schemas ({reason}) and vLLM attaches no structural tag "
        "(VLLM_ENFORCE_STRICT_TOOL_CALLING=0). Fix: set VLLM_ENFORCE_STRICT_TOOL_CALLING=1 "
        "for vLLM's tag, or use schemas the channel supports (docs/kimi-k3.md)"
    )
