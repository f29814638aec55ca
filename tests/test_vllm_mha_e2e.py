"""ATOM_AITER end to end on a real vLLM (the CPU build): in-process engine and `vllm serve`."""

from __future__ import annotations

import subprocess

import pytest

from scripts.serve import VllmServer, vllm_command
from tests.engine import engine_env, generate

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32  # vLLM's CPU backend (the reference) needs multiples of 32
# Different lengths; the last is longer than two KV blocks.
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Two-batch overlap hides communication behind computation, and vLLM serves",
    " ".join(str(i) for i in range(60)),
]
GREEDY = {"max_tokens": 12, "temperature": 0.0}


def llm_kwargs(model, **extra):
    return {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 256,
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        # A small token budget splits the long prompt over several steps, so
        # steps mix one request's prefill chunk with other requests' decodes.
        "max_num_batched_tokens": 32,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,
        **extra,
    }


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama):
    """vLLM as if the plugin were absent: its own CPU backend, plugin disabled."""
    run = generate(llm_kwargs(tiny_llama), PROMPTS, GREEDY, env=engine_env(ATOM_PLUGIN_DISABLE="1"))
    assert run["platform"] == "CpuPlatform"
    assert "atom-plugin" not in run["log"]
    return run["tokens"]


def test_prompts_cover_more_than_two_blocks(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert len(tok(PROMPTS[-1])["input_ids"]) > 2 * BLOCK_SIZE + 1
    assert len(tok(PROMPTS[-1])["input_ids"]) > llm_kwargs(tiny_llama)["max_num_batched_tokens"]


def test_greedy_tokens_equal_vllm_cpu_backend(tiny_llama, reference_tokens):
    run = generate(
        llm_kwargs(tiny_llama, attention_config={"backend": "atom_aiter"}), PROMPTS, GREEDY
    )
    assert run["platform"] == "AtomCpuPlatform"
    assert "Using ATOM_AITER backend (atom-plugin)" in run["log"]
    assert run["tokens"] == reference_tokens
    assert all(len(t) == GREEDY["max_tokens"] for t in run["tokens"])


def test_vllm_serve_answers_completions(tiny_llama, tmp_path):
    args = ["--attention-backend", "atom_aiter", "--dtype", "float32", "--max-model-len", "256"]
    with VllmServer(tiny_llama, args, log_path=tmp_path / "serve.log") as server:
        body = {"model": str(tiny_llama), "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        answer = server.post("/v1/completions", body)
        log = server.log_text()
    assert answer["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == 5
    assert "Using ATOM_AITER backend (atom-plugin)" in log
    assert "atom-plugin: platform cpu" in log


def test_misspelt_backend_fails_listing_atom_aiter(tiny_llama):
    proc = subprocess.run(
        [
            *vllm_command(),
            "serve",
            str(tiny_llama),
            "--attention-backend",
            "atom_aitr",
        ],
        capture_output=True,
        text=True,
        env=engine_env(),
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Unknown attention backend: 'ATOM_AITR'" in output
    valid = output.split("Valid options are:", 1)[1].splitlines()[0]
    assert "ATOM_AITER" in [name.strip() for name in valid.split(",")]
