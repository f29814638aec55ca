"""`vllm serve` with TBO on answers completions and chat (streaming too) as with TBO off.

Requests go one at a time, each asking for three choices (`n=3`, `top_k=1`: the
argmax, as greedy): vLLM adds the three child requests at once, so the batches repeat
from server to server
whatever the arrival times, and every decode step holds three requests (a split).
`/collective_rpc` (vLLM's dev mode) reads the split counts from the worker.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from scripts.serve import VllmServer

pytestmark = pytest.mark.vllm

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = "Two-batch overlap hides communication behind computation " + " ".join(map(str, range(20)))
MESSAGES = [{"role": "user", "content": "Say something about " + " ".join(map(str, range(12)))}]
TBO_ALL = {"atom_plugin": {"tbo": "all", "tbo_decode_min_requests": 3, "tbo_prefill_min_tokens": 2}}


def stream_chat(server: VllmServer, body: dict) -> list[str]:
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    texts = [""] * body["n"]
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
    return texts


def answers(
    model, tmp_path, tag: str, additional_config: dict | None, *extra, n=3, env=None
) -> dict:
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = [
        "--attention-backend", "atom_aiter", "--dtype", "float32", "--max-model-len", "256",
        "--max-num-batched-tokens", "32", "--chat-template", str(template), "--enforce-eager",
        *extra,
    ]  # fmt: skip
    if additional_config:
        args += ["--additional-config", json.dumps(additional_config)]
    env = {"VLLM_SERVER_DEV_MODE": "1", **(env or {})}
    with VllmServer(model, args, log_path=tmp_path / f"{tag}.log", env=env) as server:
        # n > 1 needs sampling; top_k=1 samples the argmax, as greedy does
        common = {"model": str(model), "max_tokens": 8, "temperature": 1.0, "top_k": 1, "n": n}
        completion = server.post("/v1/completions", {**common, "prompt": PROMPT})
        chat = server.post("/v1/chat/completions", {**common, "messages": MESSAGES})
        streamed = stream_chat(server, {**common, "messages": MESSAGES})
        stats = None
        if additional_config:
            rpc = server.post("/collective_rpc", {"method": "atom_tbo_stats"})
            stats = rpc["results"][0]
        log = server.log_text()
    return {
        "completion": [c["text"] for c in completion["choices"]],
        "chat": [c["message"]["content"] for c in chat["choices"]],
        "streamed": streamed,
        "stats": stats,
        "log": log,
    }


@pytest.fixture(scope="module")
def tbo_off(tiny_llama, tmp_path_factory):
    return answers(tiny_llama, tmp_path_factory.mktemp("off"), "off", None)


def test_served_answers_with_tbo_equal_tbo_off(tiny_llama, tmp_path, tbo_off):
    off = tbo_off
    on = answers(tiny_llama, tmp_path, "tbo", TBO_ALL)
    assert "atom-plugin: two-batch overlap all" in on["log"]
    for kind in ("completion", "chat", "streamed"):
        assert on[kind] == off[kind], kind
        assert all(on[kind]), kind
    assert on["streamed"] == on["chat"]
    assert on["stats"]["decode"] > 0 and on["stats"]["prefill"] > 0, on["stats"]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "split-graphs"])
def test_two_data_parallel_ranks_agree_on_every_split(
    tiny_llama, tmp_path, tbo_off, engine_faults, graphs
):
    """DP = 2 on vLLM's CPU build: eight choices spread over both engines, whose every
    step is decided by the plugin's one all_gather (a rank that skipped it would hang).
    With split graphs (the CPU stand-in, buckets 4 and 8) both ranks pad to one agreed
    bucket and replay it split; a rank left idle keeps the step whole on both."""
    env = engine_faults(rerun_graphs=[4, 8]) if graphs else None
    on = answers(tiny_llama, tmp_path, "dp2", TBO_ALL, "--data-parallel-size", "2", n=8, env=env)
    for kind in ("completion", "chat", "streamed"):
        assert set(on[kind]) == {tbo_off[kind][0]}, kind
    assert on["stats"]["decode"] > 0 and on["stats"]["prefill"] > 0, on["stats"]
    assert (on["stats"]["replayed"] > 0) == graphs, on["stats"]
