"""End to end on vLLM (CPU) with the scripted GPT-2: the channel makes the tool call.

The script writes a short reply, closes the response channel and then tries to
close the whole message (`<|close|>message<|sep|><|end_of_msg|>`). Positions after
that hold the rest of a call of `get_time` (`get_time" index="0"<|sep|>...`),
written for the case where the plugin forced `<|open|>tools<|sep|><|open|>call
tool="` in place of the close. So with tool_choice="required" the reply is a call
of the tool the script picks (`get_time`); with the named choice `get_weather` the
name is forced too and the reply is a call of `get_weather`; with "auto" (no
channel) there is no call.

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
import torch
from models.scripted_gpt2 import build_scripted_dir

from atom_plugin.k3.plugin import CHANNEL_PROCESSORS
from atom_plugin.k3.tool_parser import K3StreamParser, parse_k3
from tests.engine import IN_PROCESS_ENGINE
from tests.engine import engine_env as shared_engine_env

pytestmark = pytest.mark.vllm

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "get_time")
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "Hi"}]
OPENING = ["<|open|>", "tools", "<|sep|>", "<|open|>", "call", ' tool="']
CLOSE_MESSAGE = ["<|close|>", "message", "<|sep|>", "<|end_of_msg|>"]
CALL_REST = [
    "get_time", '"', ' index="', "0", '"', "<|sep|>",
    "<|open|>", "argument", ' key="', "city", '"', ' type="', "string", '"', "<|sep|>",
    "Paris", "<|close|>", "argument", "<|sep|>",
    "<|close|>", "call", "<|sep|>", "<|close|>", "tools", "<|sep|>",
    *CLOSE_MESSAGE,
]  # fmt: skip
# Output positions 4..9 are where the opening is forced; the script tries to end there.
SCRIPT = ["Sure", "<|close|>", "response", "<|sep|>", *CLOSE_MESSAGE, "Hi", "Hi", *CALL_REST]
assert len(CLOSE_MESSAGE) + 2 == len(OPENING)
MAX_MODEL_LEN = 128
# The model runner a served engine takes: vLLM's CPU build (0.32) runs V1; on a GPU every
# supported release defaults to Model Runner V2, the only runner of vLLM 0.34.
RUNNER = "mrv2" if torch.cuda.is_available() else "v1"
# Two servers share the GPU in this module, each with a KV cache of a fixed size (one sized
# from measured memory would count the other's allocations as its own).
GPU_MEMORY = (
    ("--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", str(1 << 30))
    if RUNNER == "mrv2"
    else ()
)


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


def expect_call(content, tool_calls, name):
    assert [call["name"] for call in tool_calls] == [name]
    assert json.loads(tool_calls[0]["arguments"]) == {"city": "Paris"}
    assert content == "Sure"


# The tool each choice's reply calls: the script's own for required, the named one else.
CALLED = {"required": "get_time", "named": "get_weather"}
CHOICES = {"required": "required", "named": NAMED}


OFFLINE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from atom_plugin.k3.channel_for import (
        channel_extra_args, channel_for_choice, required_channel_for)

    if __name__ == "__main__":
        model, messages, tools, named, max_len, additional, *more = json.loads(sys.argv[1])
        llm = LLM(model=model, dtype="float32", max_model_len=max_len, enforce_eager=True,
                  max_num_seqs=4, additional_config=additional, **(more[0] if more else {}))
        tokenizer = llm.get_tokenizer()
        channel = required_channel_for(tokenizer)
        named = channel_for_choice(channel, tokenizer, named, tools)
        base = dict(max_tokens=60, temperature=0.0, skip_special_tokens=False,
                    spaces_between_special_tokens=False)
        params = [SamplingParams(**base, logprobs=1, extra_args=channel_extra_args(channel)),
                  SamplingParams(**base),
                  SamplingParams(**base, extra_args=channel_extra_args(named))]
        outs = llm.chat([messages] * 3, params, tools=tools, use_tqdm=False)
        # Streaming on the same engine: the named request again, its output in deltas.
        engine = llm.llm_engine
        engine.add_request("stream", {"prompt_token_ids": outs[2].prompt_token_ids},
                           SamplingParams(**base, output_kind=RequestOutputKind.DELTA,
                                          extra_args=channel_extra_args(named)))
        deltas = []
        while engine.has_unfinished_requests():
            deltas += [o.outputs[0].text for o in engine.step() if o.outputs]
        print("RESULT " + json.dumps({
            "texts": [o.outputs[0].text for o in outs],
            "deltas": deltas,
            "prompt_lens": [len(o.prompt_token_ids) for o in outs],
            "sampled_logprobs": [lp[t].logprob for t, lp in
                                 zip(outs[0].outputs[0].token_ids, outs[0].outputs[0].logprobs)],
            "processors": llm.llm_engine.vllm_config.model_config.logits_processors,
            "tbo": llm.collective_rpc("atom_tbo_stats") if additional else None,
            "engine_core": type(llm.llm_engine.engine_core).__name__,
        }), flush=True)
    """
)


def streamed_calls(chunks):
    """Content and calls from the plugin's K3 stream parser, fed chunk by chunk."""
    parser, content, calls = K3StreamParser(), "", []
    for delta in [*(parser.feed(chunk) for chunk in chunks), parser.finish()]:
        content += delta.content
        calls += [{"name": c.name, "arguments": c.arguments_json} for c in delta.tool_calls]
    return content or None, calls


def run_offline(spec: list, env: dict) -> dict:
    """OFFLINE's result for `spec` (its argument list) in a process of its own."""
    proc = subprocess.run(
        [sys.executable, "-c", OFFLINE, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"engine failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    return json.loads(lines[0][len("RESULT ") :])


def parse_and_expect_calls(texts: list[str]):
    """The three requests' texts parsed (required, auto, named); the required and the named
    one each made the call CALLED names."""
    required, auto, named = (parse_k3(text) for text in texts)
    for parsed, choice in ((required, "required"), (named, "named")):
        expect_call(
            parsed.content or None,
            [{"name": c.name, "arguments": c.arguments_json} for c in parsed.tool_calls],
            CALLED[choice],
        )
    return required, auto, named


def run_k3_under_mrv2_on_gpu(tmp_path, tbo: dict) -> dict:
    """The scripted model's three requests (required, auto, named) in a GPU engine under
    Model Runner V2, `tbo` the plugin's settings: the channel's MRV2 processor ran and the
    required and named requests made their calls. Returns the run's result."""
    build_scripted_dir(tmp_path, SCRIPT, MESSAGES, tools=TOOLS)
    llm = {"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 1 << 30}
    spec = [str(tmp_path), MESSAGES, TOOLS, NAMED, 128, tbo, llm]
    env = shared_engine_env(
        **IN_PROCESS_ENGINE, ATOM_PLUGIN_DISABLE=None, ATOM_K3_STRUCTURAL_TAG=None
    )
    result = run_offline(spec, env)
    assert "atom_plugin.vllm.k3.logits_mrv2:AtomK3LogitsProcessorMRV2" in result["processors"]
    parse_and_expect_calls(result["texts"])
    return result


# With TBO every decode step of the three requests splits (1 + 2): the K3 channel sees
# the joined logits, as in an unsplit step.
TBO_DECODE = {"atom_plugin": {"tbo": "decode", "tbo_decode_min_requests": 3}}


@pytest.mark.parametrize("tbo", [None, TBO_DECODE], ids=["tbo-off", "tbo-decode"])
def test_offline_chat_required_and_named_call_tools_auto_does_not(model_dir, tbo):
    path, prompt_len = model_dir
    spec = [path, MESSAGES, TOOLS, NAMED, MAX_MODEL_LEN, tbo or {}]
    result = run_offline(spec, engine_env(**IN_PROCESS_ENGINE))  # its exact texts are compared
    assert result["engine_core"] == "InprocClient"
    assert result["prompt_lens"] == [prompt_len] * 3
    assert "atom_plugin.vllm.k3.logits_v1:AtomK3LogitsProcessorV1" in result["processors"]
    _, auto, _ = parse_and_expect_calls(result["texts"])
    assert "".join(OPENING) in result["texts"][0]
    assert "".join(OPENING) + 'get_weather"' in result["texts"][2]
    assert auto.tool_calls == () and auto.content == "Sure"
    # Streamed in-process: the same text in several deltas, the same named call.
    assert len(result["deltas"]) > 1 and "".join(result["deltas"]) == result["texts"][2]
    expect_call(*streamed_calls(result["deltas"]), "get_weather")
    # Logprobs are the model's, from before the mask: a forced id that the script did not
    # want has a low logprob (after the mask it would be 0), every other id a high one.
    logprobs = result["sampled_logprobs"]
    unwanted = [i for i, piece in enumerate(OPENING, start=4) if SCRIPT[i] != piece]
    assert len(unwanted) == 5
    for i, logprob in enumerate(logprobs):
        assert (logprob < -1.0) if i in unwanted else (logprob > -0.5), (i, logprobs)
    assert result["texts"][1] == "Sure<|close|>response<|sep|><|close|>message<|sep|>"
    if tbo:
        [stats] = result["tbo"]
        assert stats["decode"] > 0, stats


def serve(model_dir, name, *extra):
    from scripts.serve import VllmServer

    path, prompt_len = model_dir
    args = [
        *("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)),
        *("--enforce-eager", "--max-num-seqs", "4"),
        *("--tool-call-parser", "atom_kimi_k3", "--enable-auto-tool-choice"),
        *GPU_MEMORY,
        *extra,
    ]
    log = os.path.join(path, f"{name}.log")
    with VllmServer(path, args, log_path=log, env=engine_env()) as server:
        yield f"{server.url}/v1", path, prompt_len, log


@pytest.fixture(scope="module")
def server(model_dir):
    yield from serve(model_dir, "serve")


# The V1 runner refuses custom logits processors with speculative decoding: the channel
# is off in this engine, and vLLM's structural tag has to enforce required and named.
# Model Runner V2 takes them with speculative decoding: the channel holds the verification
# rows as if the drafts before each were accepted.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 2,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


@pytest.fixture(scope="module")
def spec_server(model_dir):
    yield from serve(model_dir, "spec", "--speculative-config", json.dumps(NGRAM))


def enforcement_lines(log_path):
    """The start-up line of each process that checked the engine config, by process."""
    with open(log_path) as log:
        lines = [line for line in log if "Kimi-K3 tool_choice=" in line]
    return {line.split(")")[0].split("(")[-1].split(" pid=")[0]: line for line in lines}


def chat(server, tool_choice, *, tools=TOOLS, max_tokens=60, **kw):
    """The greedy answer to MESSAGES offering `tools`, from the server (url, model, ...)."""
    from openai import OpenAI

    url, model = server[:2]
    request = {"model": model, "messages": MESSAGES, "tools": tools, "temperature": 0.0}
    client = OpenAI(base_url=url, api_key="none")
    return client.chat.completions.create(
        **request, tool_choice=tool_choice, max_tokens=max_tokens, **kw
    )


@pytest.mark.parametrize("choice", ["required", "named"])
def test_serve_required_and_named_return_their_calls(server, choice):
    response = chat(server, CHOICES[choice])
    assert response.usage.prompt_tokens == server[2]
    message = response.choices[0].message
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
    ]
    expect_call(message.content, calls, CALLED[choice])


def test_serve_auto_answers_without_a_tool_call(server):
    message = chat(server, "auto").choices[0].message
    assert not message.tool_calls
    assert message.content == "Sure"


def streamed_reply(chunks) -> tuple[str | None, list[tuple[str, str]]]:
    """The content (None if empty) and the (name, arguments) calls of a streamed chat reply."""
    content, calls = "", []
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                calls.append((call.function.name, ""))
            if call.function and call.function.arguments:
                calls[-1] = (calls[-1][0], calls[-1][1] + call.function.arguments)
    return content or None, calls


@pytest.mark.parametrize("choice", ["required", "named"])
def test_serve_streaming_gives_the_same_call(server, choice):
    content, calls = streamed_reply(chat(server, CHOICES[choice], stream=True))
    expect_call(content, [{"name": n, "arguments": a} for n, a in calls], CALLED[choice])


def test_serve_says_the_channel_enforces_required(server):
    lines = enforcement_lines(server[3])
    # The API server (where the parser reads the decision) and the engine core agree.
    assert set(lines) == {"APIServer", "EngineCore"}, lines
    for line in lines.values():
        assert f"are enforced by the plugin's channel ({CHANNEL_PROCESSORS[RUNNER]}" in line


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_channel_off_required_and_named_still_return_their_calls(spec_server, choice, stream):
    # Without the processor nothing reads the channel's arguments: a parser that dropped
    # vLLM's tag here would get the script's plain answer "Sure" and no call.
    if stream:
        test_serve_streaming_gives_the_same_call(spec_server, choice)
    else:
        test_serve_required_and_named_return_their_calls(spec_server, choice)


def test_channel_off_auto_still_answers_in_plain_text(spec_server):
    test_serve_auto_answers_without_a_tool_call(spec_server)


def test_spec_decoding_server_says_what_enforces_required(spec_server):
    lines = enforcement_lines(spec_server[3])
    assert set(lines) == {"APIServer", "EngineCore"}, lines
    if RUNNER == "mrv2":  # the channel stays on with speculative decoding
        test_serve_says_the_channel_enforces_required(spec_server)
        return
    for line in lines.values():
        assert "are enforced by vLLM's kimi_k3 structural tag, not the plugin's channel" in line
        assert "refuses custom logits processors with speculative decoding" in line
        assert "For the channel: drop --speculative-config" in line


def test_serve_refuses_a_name_that_is_not_a_tool(server):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        chat(server, {"type": "function", "function": {"name": "get_city"}})
    assert err.value.status_code == 400 and "tool_choice" in str(err.value)
