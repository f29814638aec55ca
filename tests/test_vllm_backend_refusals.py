"""`--attention-backend atom_aiter` on a model whose attention the plugin's backends cannot
run: the start stops with the layer's value and what the backend takes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atom_plugin.vllm.attention.mha import AtomAiterBackend
from atom_plugin.vllm.attention.mla import AtomAiterMLABackend
from atom_plugin.vllm.attention.refusal import backend_refusal
from tests.engine import IN_PROCESS_ENGINE, START_CHECK, config_errors, run_config_script

FLAG = "--attention-backend atom_aiter"


def layer(**fields):
    base = dict(
        head_size=128,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=False,
        use_sparse=False,
    )
    return SimpleNamespace(**{**base, **fields})


def refusal(backend, selector, *reasons):
    return backend_refusal(backend, selector, list(reasons), FLAG, "0.34.0")


def test_each_reason_names_the_value_and_what_the_backend_takes():
    text = refusal(AtomAiterBackend, layer(dtype=torch.float64), "dtype not supported")
    assert text.startswith(f"{FLAG}: ATOM_AITER cannot run this model's attention on vLLM 0.34.0")
    assert "dtype float64; it takes float16, bfloat16, float32" in text
    text = refusal(
        AtomAiterBackend, layer(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype not supported"
    )
    assert "KV cache dtype fp8_e5m2; it takes auto, float16, bfloat16, fp8, fp8_e4m3" in text
    text = refusal(AtomAiterBackend, layer(block_size=24), "block_size not supported")
    assert "block size 24; it takes any multiple of 16" in text
    text = refusal(
        AtomAiterMLABackend, layer(use_mla=True, use_sparse=True), "sparse not supported"
    )
    assert "ATOM_AITER_MLA" in text and "it runs dense MLA only" in text
    assert text.endswith(f"Without {FLAG} vLLM chooses one of its own backends")


def test_reasons_are_joined_and_unknown_ones_kept_as_vllm_wrote_them():
    text = refusal(
        AtomAiterBackend, layer(head_size=72), "head_size not supported", "PCP not supported"
    )
    assert "head size 72; it takes 64, 128, 256; PCP not supported." in text


@pytest.mark.vllm
def test_start_stops_with_the_layers_value_and_what_the_backend_takes(tmp_path):
    from scripts.tiny_llama import build_tiny_llama
    from tests.models.tiny_deepseek import build_tiny_deepseek

    llama72 = build_tiny_llama(tmp_path / "llama", hidden_size=288, head_dim=72)
    mla320 = build_tiny_deepseek(tmp_path / "mla", kv_lora_rank=256)
    cases = {
        "mha": {"attention_backend": "atom_aiter"},
        "mla": {"model": str(mla320), "attention_backend": "atom_aiter"},
        "mha without the flag": {},
    }
    proc = run_config_script(START_CHECK, llama72, cases, **IN_PROCESS_ENGINE)
    errors = config_errors(proc)
    assert errors["mha without the flag"] is None
    assert errors["mha"] == (
        f"PluginRefusal: {FLAG}: ATOM_AITER cannot run this model's attention on vLLM 0.32.0: "
        f"head size 72; it takes 64, 128, 256. Without {FLAG} vLLM chooses one of its own backends"
    )
    assert "ATOM_AITER_MLA cannot run" in errors["mla"], errors["mla"]
    assert "head size (kv_lora_rank + qk_rope_head_dim) 320; it takes 576" in errors["mla"]
