"""Tool-call requests made the way vLLM's chat server makes them, for the K3 channel tests:
the tool-call format's parser (through vLLM's ParserManager) adjusts a real
ChatCompletionRequest, which becomes SamplingParams. Imports vLLM."""

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager
from vllm.tool_parsers import ToolParserManager

from atom_plugin.k3.call_automaton import CallAutomaton
from atom_plugin.k3.channel_for import required_channel_for
from atom_plugin.k3.schema import call_spec_for
from atom_plugin.k3.token_classes import classes_for_tokenizer
from atom_plugin.vllm.registration import register_tool_parsers

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def calls_channel(tokenizer, tools=TOOLS, name=None, parallel=True):
    """The required channel going on into the calls of `tools`, as the parser sends it."""
    spec = call_spec_for(tokenizer, tools, name, parallel)
    calls = CallAutomaton(spec, classes_for_tokenizer(tokenizer))
    return required_channel_for(tokenizer).with_calls(calls)


def registered_formats():
    """The tool-call formats vLLM's ParserManager knows, the plugin's registered."""
    register_tool_parsers()
    names = ToolParserManager.list_registered()
    assert "atom_kimi_k3" in names and "kimi_k3" in names
    return names


def sampling_params_through(fmt, tokenizer, tool_choice):
    """What vLLM's chat server makes of a request under tool-call format `fmt`."""
    parser_cls = ParserManager.get_parser(tool_parser_name=fmt, enable_auto_tools=True)
    parser = parser_cls(tokenizer, TOOLS)
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        model="m",
        tools=TOOLS,
        tool_choice=tool_choice,
    )
    return parser.adjust_request(request).to_sampling_params(16, {})


def build_requests_by_format(formats, tokenizer):
    """(format, tool_choice) -> SamplingParams, for every format that builds here."""
    made, unbuildable = {}, []
    for fmt in formats:
        for choice in ("required", "auto"):
            try:
                made[fmt, choice] = sampling_params_through(fmt, tokenizer, choice)
            except (ImportError, RuntimeError, ValueError, AttributeError):
                # The parser needs tokens (or a package) this tokenizer lacks.
                unbuildable.append(fmt)
                break
        if (fmt, "auto") in made:
            try:
                made[fmt, "named"] = sampling_params_through(fmt, tokenizer, NAMED)
            except ValueError:  # e.g. a format whose named choice needs what is missing here
                pass
    assert len({f for f, _ in made}) >= 35, f"too few formats built; not built: {unbuildable}"
    assert ("atom_kimi_k3", "named") in made and ("kimi_k3", "named") in made
    return made
