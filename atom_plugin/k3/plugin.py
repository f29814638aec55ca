"""Hook implementations for the Kimi-K3 tool parser and required-channel processors."""

from atom_plugin.hookspecs import hookimpl
from atom_plugin.k3.samples import K3_SAMPLES
from atom_plugin.specs import LogitsProcessorSpec, ToolParserSpec


@hookimpl
def atom_tool_parsers() -> list[ToolParserSpec]:
    return [
        ToolParserSpec(
            name="atom_kimi_k3",
            class_path="atom_plugin.vllm.k3.tool_parser:AtomKimiK3ToolParser",
            samples=K3_SAMPLES,
        )
    ]


# The required-channel processor for each of vLLM's model runners.
CHANNEL_PROCESSORS = {
    "v1": "atom_plugin.vllm.k3.logits_v1:AtomK3LogitsProcessorV1",
    "mrv2": "atom_plugin.vllm.k3.logits_mrv2:AtomK3LogitsProcessorMRV2",
}


@hookimpl
def atom_logits_processors() -> list[LogitsProcessorSpec]:
    return [
        LogitsProcessorSpec("atom_k3_required_channel", class_path, runner)
        for runner, class_path in CHANNEL_PROCESSORS.items()
    ]
