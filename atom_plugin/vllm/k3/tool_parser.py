"""vLLM tool parser `atom_kimi_k3`: vLLM's `kimi_k3` with the required channel.

For `tool_choice="required"` or a named function with tools, vLLM's `kimi_k3`
asks xgrammar for a structural tag (a grammar over the whole turn). This parser
instead attaches the required channel to the request (`vllm_xargs`, which vLLM
copies into `SamplingParams.extra_args`); the plugin's logits processors then
force the tools channel open where the model would end its message, and then
every call: tool names from the request's tools (the named one for a named
choice), arguments from each tool's JSON schema, the channel's close, and one
call when `parallel_tool_calls` is false (`atom_plugin.k3.schema`). Each
distinct tool set is compiled here, in the API server, once
(`atom_plugin.k3.call_cache`: a bounded LRU), and the request carries the
finished call table: the engine only lays out its rows. A request whose schemas
the channel cannot enforce, or whose call automaton is beyond the channel's
limits (`atom_plugin.k3.call_table.LIMITS`), keeps vLLM's structural tag (the
reason is logged once). A name that is not one of the request's tools is
refused with a 400. Set `ATOM_K3_STRUCTURAL_TAG=1` to
keep vLLM's structural tag instead. `auto` with tools (and no structured
outputs of its own) gets the optional channel (`RequiredChannel.as_optional`)
in place of whatever tag vLLM would give it (its call envelope for strict tools
or `parallel_tool_calls=false`): nothing is forced or banned until the model
writes `<|open|>tools<|sep|>` itself, and from there the call opening is forced
and every call is held to the schemas as for required. An auto request whose
schemas the channel cannot hold is left to vLLM (its tag, or none).

The channel is used only where it is live in this engine (`vllm.k3.enforcement`: the
processor is installed for the engine's runner). Elsewhere a required or named
request keeps vLLM's structural tag, and one that vLLM gives no tag is refused
with a 400 naming the reason and the setting that fixes it: such a request is
never served unconstrained.

Output is read by the plugin's own K3 parser (`atom_plugin.k3.tool_parser`),
which also splits off the think channel and never raises on malformed output.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.exceptions import VLLMValidationError
from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser

from atom_plugin.k3.call_cache import CallCache, CompiledCalls
from atom_plugin.k3.call_table import CallSpecError
from atom_plugin.k3.channel_for import (
    ToolChoiceError,
    channel_extra_args,
    channel_for_choice,
    named_tool,
    required_channel_for,
    wants_auto_channel,
    wants_channel,
)
from atom_plugin.k3.required_channel import RequiredChannel
from atom_plugin.k3.token_classes import classes_for_tokenizer
from atom_plugin.k3.tool_parser import K3Delta, K3StreamParser, K3ToolCall, parse_k3
from atom_plugin.vllm.k3.enforcement import (
    ChannelDecision,
    channel_state,
    keep_structural_tag,
    unenforced_message,
    unsupported_message,
)

NAME = "atom_kimi_k3"
logger = logging.getLogger("atom_plugin.k3")
compile_logger = logging.getLogger("vllm.atom_plugin.k3")  # vLLM's handler, INFO
NO_CHANNEL_FOR_TOKENIZER = ChannelDecision(
    off="the tokenizer's K3 markers give no channel (see the atom_plugin.k3 warning)",
    fix="a tokenizer whose K3 control tokens are one id each",
)


_logged: set[str] = set()


def _log_unsupported_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.warning(
            "Kimi-K3 channel: a request's tool schemas cannot be enforced by the channel "
            "(%s); such requests keep vLLM's kimi_k3 structural tag",
            reason,
        )


class _PerTokenizer:
    """A value built once per tokenizer object (a server has one, kept alive here). Callers
    for a tokenizer wait for its one build; the map's lock is never held while building."""

    def __init__(self, build: Callable[[Any], Any]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[Any, threading.Lock, list]] = {}

    def _entry(self, tokenizer: Any) -> tuple[tuple[Any, threading.Lock, list], bool]:
        """The tokenizer's entry (its build's lock and value, once built), and whether it
        was made by this call."""
        with self._lock:
            hit = self._entries.get(id(tokenizer))
            new = hit is None or hit[0] is not tokenizer
            if new:
                hit = self._entries[id(tokenizer)] = (tokenizer, threading.Lock(), [])
        return hit, new

    def get(self, tokenizer: Any) -> Any:
        (_, lock, value), _ = self._entry(tokenizer)
        with lock:
            if not value:
                value.append(self._build(tokenizer))
        return value[0]

    def warm(self, tokenizer: Any) -> None:
        """Build on a thread, off the request path, unless it is built or being built."""
        _, new = self._entry(tokenizer)
        if new:
            threading.Thread(target=self.get, args=(tokenizer,), daemon=True).start()


_channels = _PerTokenizer(required_channel_for)
_call_caches = _PerTokenizer(
    lambda tokenizer: CallCache(tokenizer, classes_for_tokenizer(tokenizer))
)


def call_cache_of(tokenizer: Any) -> CallCache:
    """The tokenizer's compiled tool sets; the first call builds its token classes."""
    return _call_caches.get(tokenizer)


def _tool_call(call: K3ToolCall) -> ToolCall:
    return ToolCall(
        type="function", function=FunctionCall(name=call.name, arguments=call.arguments_json)
    )


class AtomKimiK3ToolParser(KimiK3ToolParser):
    # The parser reads each delta once and keeps its own state, so vLLM's parser
    # composition feeds it deltas and calls finish_streaming() at the end (and,
    # without a reasoning parser, takes content without markers from it too).
    engine_based_streaming = True

    def __init__(self, tokenizer: Any, tools: list | None = None):
        super().__init__(tokenizer, tools)
        keep_structural_tag()  # a bad setting fails when vLLM builds the parser at startup
        self.channel: RequiredChannel | None = _channels.get(tokenizer)
        if self.channel is not None:
            _call_caches.warm(tokenizer)  # vLLM builds a parser at start-up
        self._stream = K3StreamParser()
        self._sent_calls = 0
        self._calls: tuple[Any, CompiledCalls | CallSpecError] | None = None

    def forces_call(self, request: Any) -> bool:
        """Required or named + tools, and no structured outputs (a tag included) of its own."""
        return (
            wants_channel(request.tool_choice, request.tools, NAME)
            and request.extract_structured_outputs() is None
        )

    def channel_decision(self) -> ChannelDecision:
        """Whether the channel serves this server's requests (the engine's decision)."""
        return NO_CHANNEL_FOR_TOKENIZER if self.channel is None else channel_state()

    def uses_channel(self, request: Any) -> bool:
        """The gate: a request that forces a call, where the channel is live in this engine,
        whose tools' schemas the channel can enforce."""
        if not (self.forces_call(request) and self.channel_decision().live):
            return False
        calls = self.compiled_calls(request)
        if isinstance(calls, CallSpecError):
            _log_unsupported_once(str(calls))
            return False
        return True

    def compiled_calls(self, request: Any) -> CompiledCalls | CallSpecError:
        """The request's call table (compiled once per tool set), or why its schemas
        cannot be enforced (kept per request)."""
        if self._calls is None or self._calls[0] is not request:
            cache = call_cache_of(self.model_tokenizer)
            calls, compiled = cache.calls_for(
                request.tools,
                named_tool(request.tool_choice),
                getattr(request, "parallel_tool_calls", True) is not False,
            )
            if compiled and isinstance(calls, CompiledCalls):
                compile_logger.info(
                    "atom-plugin: Kimi-K3 calls of a new tool set compiled in the API server: "
                    "%d states in %.1f ms (tool sets compiled: %d; cache: %s)",
                    calls.num_states,
                    1e3 * calls.seconds,
                    cache.compiles,
                    cache.stats(),
                )
            self._calls = (request, calls)
        return self._calls[1]

    def channel_for(self, request: Any) -> RequiredChannel:
        """The channel of a request that uses one; a name it cannot force is vLLM's 400.

        The call automaton forces a named choice's tool name itself, so the name only
        checks here and the channel is the required one.
        """
        try:
            channel_for_choice(
                self.channel, self.model_tokenizer, request.tool_choice, request.tools
            )
        except ToolChoiceError as err:
            raise VLLMValidationError(
                str(err), parameter="tool_choice", value=named_tool(request.tool_choice)
            ) from err
        return self.channel

    def get_structural_tag(self, request: Any, **kwargs: Any):
        # vLLM asks for the tag before adjust_request; the channel replaces it.
        if self.forces_call(request) and self.channel_decision().live:
            self.channel_for(request)  # a bad name is refused before anything else happens
        if self.uses_channel(request) or self.opens_on_auto(request):
            return None
        return super().get_structural_tag(request, **kwargs)

    def opens_on_auto(self, request: Any) -> bool:
        """Auto with tools, no structured outputs (no tag: tools not strict), the channel
        live, and schemas the channel can hold: the optional channel."""
        return (
            wants_auto_channel(request.tool_choice, request.tools, NAME)
            and request.extract_structured_outputs() is None
            and self.channel_decision().live
            and not isinstance(self.compiled_calls(request), CallSpecError)
        )

    def adjust_request(self, request: Any) -> Any:
        # vLLM attached its structural tag before this call, if it gives one: a request
        # that still forces a call without structured outputs has no tag.
        if not self.forces_call(request):
            request = super().adjust_request(request)
            if self.opens_on_auto(request):
                channel = self.channel.as_optional()
                extra = channel_extra_args(channel, self.compiled_calls(request).wire)
                request.vllm_xargs = {**(request.vllm_xargs or {}), **extra}
            return request
        decision = self.channel_decision()
        calls = self.compiled_calls(request) if decision.live else None
        if not decision.live or isinstance(calls, CallSpecError):
            choice = named_tool(request.tool_choice) or request.tool_choice
            message = (
                unenforced_message(decision, repr(choice))
                if not decision.live
                else unsupported_message(str(calls), repr(choice))
            )
            raise VLLMValidationError(message, parameter="tool_choice", value=choice)
        # vLLM's kimi_k3 refuses named choices that have no structural tag (it has no
        # other way to force the call); the channel forces it, so only the marker
        # settings of its required path are kept: the markers reach the parser verbatim.
        channel = self.channel_for(request)
        request.skip_special_tokens = False
        if hasattr(request, "spaces_between_special_tokens"):
            request.spaces_between_special_tokens = False
        extra = channel_extra_args(channel, calls.wire)
        request.vllm_xargs = {**(request.vllm_xargs or {}), **extra}
        return request

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        parsed = parse_k3(model_output)
        return ExtractedToolCallInformation(
            tools_called=bool(parsed.tool_calls),
            tool_calls=[_tool_call(c) for c in parsed.tool_calls],
            content=parsed.content or None,
        )

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        return self._delta_message(self._stream.feed(delta_text))

    def finish_streaming(self) -> DeltaMessage | None:
        """What the stream held back: a call cut short comes back as content."""
        return self._delta_message(self._stream.finish())

    def _delta_message(self, delta: K3Delta) -> DeltaMessage | None:
        if not delta:
            return None
        calls = []
        for call in delta.tool_calls:
            tool_call = _tool_call(call)  # its id, and the arguments encoded once
            function = tool_call.function
            calls.append(
                DeltaToolCall(
                    index=self._sent_calls,
                    id=tool_call.id,
                    type="function",
                    function=DeltaFunctionCall(
                        name=function.name, arguments=function.arguments
                    ).model_dump(exclude_none=True),
                )
            )
            self._sent_calls += 1
        return DeltaMessage(
            content=delta.content or None,
            reasoning=delta.reasoning or None,
            tool_calls=calls,
        )
