"""End to end on vLLM (CPU) with the scripted GPT-2: the required channel makes a tool call.

The script writes a short reply, closes the response channel and then tries to
close the whole message (`<|close|>message<|sep|><|end_of_msg|>`). Positions after
that hold the rest of a call (`get_weather" index="0"<|sep|>...`), written for
the case where the plugin forced `<|open|>tools<|sep|><|open|>call tool="` in place
of the close. So with tool_choice="required" the reply holds a tool call, and
with "auto" (no channel) it does not.

Both engines are real vLLM with the plugin installed: its platform hook adds the
processor for the runner in use and its general hook registers `atom_kimi_k3`.
Each engine runs in a fresh process; the offline one, whose texts are compared, with
its engine core in-process (see tests/engine.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from models.scripted_gpt2 import build_scripted_dir

from atom_plugin.parsers.k3_tool_parser import parse_k3
from tests.engine import IN_PROCESS_ENGINE
from tests.engine import engine_env as shared_engine_env

pytestmark = pytest.mark.vllm

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Hi"}]
OPENING = ["<|open|>", "tools", "<|sep|>", "<|open|>", "call", ' tool="']
CLOSE_MESSAGE = ["<|close|>", "message", "<|sep|>", "<|end_of_msg|>"]
CALL_REST = [
    "get_weather", '"', ' index="', "0", '"', "<|sep|>",
    "<|open|>", "argument", ' key="', "city", '"', ' type="', "string", '"', "<|sep|>",
    "Paris", "<|close|>", "argument", "<|sep|>",
    "<|close|>", "call", "<|sep|>", "<|close|>", "tools", "<|sep|>",
    *CLOSE_MESSAGE,
]  # fmt: skip
# Output positions 4..9 are where the opening is forced; the script tries to end there.
SCRIPT = ["Sure", "<|close|>", "response", "<|sep|>", *CLOSE_MESSAGE, "Hi", "Hi", *CALL_REST]
assert len(CLOSE_MESSAGE) + 2 == len(OPENING)
MAX_MODEL_LEN = 128


def engine_env(**extra: str) -> dict[str, str]:
    """The shared engine environment, with the plugin fully on."""
    return shared_engine_env(
        ATOM_PLUGIN_DISABLE=None, ATOM_K3_STRUCTURAL_TAG=None, VLLM_PLUGINS=None, **extra
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripted-k3")
    tokenizer, prompt_ids = build_scripted_dir(path, SCRIPT, MESSAGES, tools=TOOLS)
    return str(path), len(prompt_ids)


def expect_required(content, tool_calls):
    assert [call["name"] for call in tool_calls] == ["get_weather"]
    assert json.loads(tool_calls[0]["arguments"]) == {"city": "Paris"}
    assert content == "Sure"


OFFLINE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from atom_plugin.parsers.channel_for import channel_extra_args, required_channel_for

    if __name__ == "__main__":
        model, messages, tools, max_len = json.loads(sys.argv[1])
        llm = LLM(model=model, dtype="float32", max_model_len=max_len, enforce_eager=True,
                  max_num_seqs=4)
        channel = required_channel_for(llm.get_tokenizer())
        base = dict(max_tokens=60, temperature=0.0, skip_special_tokens=False,
                    spaces_between_special_tokens=False)
        params = [SamplingParams(**base, logprobs=1, extra_args=channel_extra_args(channel)),
                  SamplingParams(**base)]
        outs = llm.chat([messages, messages], params, tools=tools, use_tqdm=False)
        print("RESULT " + json.dumps({
            "texts": [o.outputs[0].text for o in outs],
            "prompt_lens": [len(o.prompt_token_ids) for o in outs],
            "sampled_logprobs": [lp[t].logprob for t, lp in
                                 zip(outs[0].outputs[0].token_ids, outs[0].outputs[0].logprobs)],
            "processors": llm.llm_engine.vllm_config.model_config.logits_processors,
            "engine_core": type(llm.llm_engine.engine_core).__name__,
        }), flush=True)
    """
)


def test_offline_chat_required_calls_a_tool_auto_does_not(model_dir):
    path, prompt_len = model_dir
    spec = json.dumps([path, MESSAGES, TOOLS, MAX_MODEL_LEN])
    proc = subprocess.run(
        [sys.executable, "-c", OFFLINE, spec],
        capture_output=True,
        text=True,
        env=engine_env(**IN_PROCESS_ENGINE),  # its exact texts are compared
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"engine failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    result = json.loads(lines[0][len("RESULT ") :])
    assert result["engine_core"] == "InprocClient"
    assert result["prompt_lens"] == [prompt_len, prompt_len]
    assert "atom_plugin.vllm.k3_logits_v1:AtomK3LogitsProcessorV1" in result["processors"]
    required, auto = (parse_k3(text) for text in result["texts"])
    expect_required(
        required.content or None,
        [{"name": c.name, "arguments": c.arguments_json} for c in required.tool_calls],
    )
    assert "".join(OPENING) in result["texts"][0]
    assert auto.tool_calls == () and auto.content == "Sure"
    # Logprobs are the model's, from before the mask: a forced id that the script did not
    # want has a low logprob (after the mask it would be 0), every other id a high one.
    logprobs = result["sampled_logprobs"]
    unwanted = [i for i, piece in enumerate(OPENING, start=4) if SCRIPT[i] != piece]
    assert len(unwanted) == 5
    for i, logprob in enumerate(logprobs):
        assert (logprob < -1.0) if i in unwanted else (logprob > -0.5), (i, logprobs)
    assert result["texts"][1] == "Sure<|close|>response<|sep|><|close|>message<|sep|>"


@pytest.fixture(scope="module")
def server(model_dir):
    from scripts.serve import VllmServer

    path, prompt_len = model_dir
    args = [
        *("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)),
        *("--enforce-eager", "--max-num-seqs", "4"),
        *("--tool-call-parser", "atom_kimi_k3", "--enable-auto-tool-choice"),
    ]
    serve = VllmServer(path, args, log_path=os.path.join(path, "serve.log"), env=engine_env())
    with serve:
        yield f"{serve.url}/v1", path, prompt_len


def chat(server, tool_choice, **kw):
    from openai import OpenAI

    url, path, _ = server
    client = OpenAI(base_url=url, api_key="none")
    return client.chat.completions.create(
        model=path,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0.0,
        max_tokens=60,
        **kw,
    )


def test_serve_required_returns_a_tool_call(server):
    response = chat(server, "required")
    assert response.usage.prompt_tokens == server[2]
    message = response.choices[0].message
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
    ]
    expect_required(message.content, calls)


def test_serve_auto_answers_without_a_tool_call(server):
    message = chat(server, "auto").choices[0].message
    assert not message.tool_calls
    assert message.content == "Sure"


def test_serve_required_streaming_gives_the_same_call(server):
    content, names, arguments = "", [], []
    for chunk in chat(server, "required", stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names.append(call.function.name)
                arguments.append("")
            if call.function and call.function.arguments:
                arguments[-1] += call.function.arguments
    expect_required(
        content or None,
        [{"name": n, "arguments": a} for n, a in zip(names, arguments, strict=True)],
    )
