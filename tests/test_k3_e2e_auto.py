"""End to end on vLLM (CPU) through `vllm serve`: `tool_choice="auto"` once the model opens
the tools channel itself.

The scripted GPT-2 (tests/models/scripted_gpt2.py) writes its response, then
`<|open|>tools<|sep|><|open|>call tool="` itself, then the same faulty calls as in
test_k3_e2e_calls.py: `get_time` with the argument `Paris="Sure"` and a second call. With
`auto` the request gets the optional channel (nothing forced or banned until the model
writes `<|open|>tools<|sep|>`), so from there every call is held to the request's tools and
schemas: against each schema of test_k3_e2e_calls.CASES, with `parallel_tool_calls=false`,
streamed and not, the reply is one call of `get_weather` that validates. Without the
optional channel (tried on 2026-12-02), vLLM's own kimi_k3 tag holds these requests
(`parallel_tool_calls=false` raises its strict level to the call envelope): the name and the
single call, not the arguments, and every case fails with `get_weather({"Paris": "Sure"})`.
"""

from __future__ import annotations

import pytest

from tests.test_k3_e2e_calls import (
    CALLS,
    CASES,
    assert_one_constrained_call,
    reply,
    scripted_server,
)

pytestmark = pytest.mark.vllm

OPENS_TOOLS = ["<|open|>", "tools", "<|sep|>", "<|open|>", "call", ' tool="']
SCRIPT = ["Sure", "<|close|>", "response", "<|sep|>", *OPENS_TOOLS, *CALLS]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from scripted_server(tmp_path_factory.mktemp("scripted-k3-auto"), SCRIPT)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(CASES))
def test_auto_calls_are_schema_valid_and_single_once_the_model_opens_the_channel(
    server, case, stream
):
    tools = CASES[case]
    content, calls = reply(server, tools, "auto", stream)
    assert_one_constrained_call(case, tools, content, calls)
