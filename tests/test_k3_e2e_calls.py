"""End to end on vLLM (CPU) through `vllm serve`: the channel constrains every call.

The scripted GPT-2 (tests/models/scripted_gpt2.py) writes `script[p]` after position
`p` whatever came before; where the channel masks that token, greedy sampling takes
the lowest allowed id (every other logit is 0), and the script goes on at the next
position. Its turn tries to close the message after its response (the channel forces
the tools channel open there, as in test_k3_e2e.py) and then writes a call of
`get_time` whose one argument is `Paris="Sure"` (type string), then a second call
without arguments, then the close.

One server answers every request; each request's tools give the same script a
different fault against its schema (`additionalProperties: false` throughout):

- "disallowed key": `city` (string) required: `Paris` is no property;
- "wrong type": `city` is an integer: the script writes a string;
- "missing key": `city` and `days` (integer) required: the script writes one argument;

and every request has `parallel_tool_calls=false`, against the script's second call.
Required and named, streamed and not, each reply is one call of `get_weather` whose
arguments validate against its schema. Without the argument constraint (the channel
of the opening only), the reply is `get_weather({"Paris": "Sure"})` and a second call.
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from models.scripted_gpt2 import build_scripted_dir

from tests.engine import engine_env as shared_engine_env
from tests.test_k3_e2e import MESSAGES, chat, streamed_reply

pytestmark = pytest.mark.vllm

CLOSE_MESSAGE = ["<|close|>", "message", "<|sep|>", "<|end_of_msg|>"]
CALLS = [
    "get_time", '"', ' index="', "0", '"', "<|sep|>",
    "<|open|>", "argument", ' key="', "Paris", '"', ' type="', "string", '"', "<|sep|>",
    "Sure", "<|close|>", "argument", "<|sep|>", "<|close|>", "call", "<|sep|>",
    "<|open|>", "call", ' tool="', "get_time", '"', ' index="', "1", '"', "<|sep|>",
    "<|close|>", "call", "<|sep|>", "<|close|>", "tools", "<|sep|>", *CLOSE_MESSAGE,
]  # fmt: skip
# Output positions 4..9 are where the opening is forced; the script tries to end there.
SCRIPT = ["Sure", "<|close|>", "response", "<|sep|>", *CLOSE_MESSAGE, "Hi", "Hi", *CALLS]
MAX_MODEL_LEN = 128


def weather(properties, required):
    schema = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]


CASES = {
    "disallowed-key": weather({"city": {"type": "string"}}, ["city"]),
    "wrong-type": weather({"city": {"type": "integer"}}, ["city"]),
    "missing-key": weather(
        {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city", "days"]
    ),
}
CHOICES = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from scripted_server(tmp_path_factory.mktemp("scripted-k3-calls"), SCRIPT)


def scripted_server(path, script):
    """`vllm serve` with `atom_kimi_k3` on the scripted K3 model writing `script`: yields
    the API's base URL and the model's folder."""
    from scripts.serve import VllmServer

    build_scripted_dir(path, script, MESSAGES, tools=CASES["disallowed-key"])
    args = [
        *("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)),
        *("--enforce-eager", "--max-num-seqs", "4"),
        *("--tool-call-parser", "atom_kimi_k3", "--enable-auto-tool-choice"),
    ]
    env = shared_engine_env(
        ATOM_PLUGIN_DISABLE=None, ATOM_K3_STRUCTURAL_TAG=None, VLLM_PLUGINS=None
    )
    with VllmServer(path, args, log_path=os.path.join(path, "serve.log"), env=env) as running:
        yield f"{running.url}/v1", str(path)


def reply(server, tools, tool_choice, stream):
    """(content, [(name, arguments JSON)]) of one chat request."""
    response = chat(
        server, tool_choice, tools=tools, max_tokens=80, parallel_tool_calls=False, stream=stream
    )
    if not stream:
        message = response.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return message.content, calls
    return streamed_reply(response)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("case", list(CASES))
def test_each_call_is_schema_valid_and_single(server, case, choice, stream):
    tools = CASES[case]
    content, calls = reply(server, tools, CHOICES[choice], stream)
    assert_one_constrained_call(case, tools, content, calls)


# What the constraint makes of the script's argument in each case (the lowest allowed id
# where the script's own one is masked): the key, the type, then the missing key added.
CONSTRAINED_ARGUMENTS = {
    "disallowed-key": {"city": "Sure"},
    "wrong-type": {"city": 0},
    "missing-key": {"city": "Sure", "days": 100},
}


def assert_one_constrained_call(case, tools, content, calls):
    """The reply says "Sure" and makes one schema-valid get_weather call with the
    arguments the constraint gives in `case`."""
    assert content == "Sure"
    assert [name for name, _ in calls] == ["get_weather"], calls
    arguments = json.loads(calls[0][1])
    jsonschema.validate(arguments, tools[0]["function"]["parameters"])
    assert arguments == CONSTRAINED_ARGUMENTS[case]
