"""ATOM_AITER meets vLLM 0.32's attention-backend contract (real vLLM classes, in process)."""

from __future__ import annotations

import pytest
import torch
from tbo_harness.ubatch_metadata import prepare_ubatch_decode
from vllm.config import VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata, MultipleOf
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec

from atom_plugin.attention import select
from atom_plugin.attention.mha import ops
from atom_plugin.attention.mha import planner as mha_planner
from atom_plugin.attention.mha.plan import AiterPlan, TorchPlan, TritonPlan
from atom_plugin.attention.triton_common import choose_num_splits, device_sm_count
from atom_plugin.vllm.attention import mha as vllm_mha
from atom_plugin.vllm.attention.mha import AtomAiterBackend
from atom_plugin.vllm.registration import register_attention_backends

BLOCK, HQ, HKV, D = 16, 4, 2, 64


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_attention_backends()


def test_name_matches_the_enum_member():
    member = AttentionBackendEnum["ATOM_AITER"]
    assert AtomAiterBackend.get_name() == member.name
    assert member.get_class() is AtomAiterBackend
    assert not AtomAiterBackend.is_mla()


def test_declares_block_sizes_head_sizes_and_dtypes():
    assert all(AtomAiterBackend.supports_block_size(b) for b in (16, 32, 64, 128))
    assert not AtomAiterBackend.supports_block_size(24)
    sizes = AtomAiterBackend.get_supported_kernel_block_sizes()
    assert sizes and all(isinstance(s, int | MultipleOf) for s in sizes)
    assert set(AtomAiterBackend.get_supported_head_sizes()) >= {64, 128, 256}
    assert set(AtomAiterBackend.supported_dtypes) >= {torch.float16, torch.bfloat16}
    assert "fp8_e4m3" in AtomAiterBackend.supported_kv_cache_dtypes


def test_validate_configuration_gives_reasons():
    common = dict(
        head_size=128,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        has_sink=True,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=None,
        attn_type="decoder",
        has_sliding_window=True,
    )
    assert AtomAiterBackend.validate_configuration(use_mla=False, **common) == []
    assert "MLA not supported" in AtomAiterBackend.validate_configuration(use_mla=True, **common)
    bad_head = {**common, "head_size": 72}
    assert "head_size not supported" in AtomAiterBackend.validate_configuration(
        use_mla=False, **bad_head
    )


def make_builder():
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    builder_cls = AtomAiterBackend.get_builder_cls()
    return builder_cls(spec, ["layer.0"], VllmConfig(), torch.device("cpu"))


def dense_reference(q, k, v, scale):
    """Causal attention of the last len(q) positions over all of k/v (GQA by repeat)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    n_q, n_k = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos_q = torch.arange(n_k - n_q, n_k)[:, None]
    scores = scores.masked_fill(torch.arange(n_k)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def refuse_selection(monkeypatch):
    """Make every name of `select_kernel_impl` fail: what runs after this must not choose."""

    def refuse(device):
        raise AssertionError("select_kernel_impl was called on the per-layer path")

    for module in (select, mha_planner, ops, vllm_mha):
        monkeypatch.setattr(module, "select_kernel_impl", refuse)


@pytest.mark.parametrize("planned_only", [False, True], ids=["plain", "no-reselect"])
def test_builder_and_impl_on_a_mixed_batch(monkeypatch, planned_only):
    """A decode (context 20) and a chunked prefill (5 new over 14 cached) in one step.

    no-reselect: once the builder has planned the step, the layer calls (cache write
    and forward, twice: two layers) run with `select_kernel_impl` refusing."""
    torch.manual_seed(0)
    builder = make_builder()
    ctx = [20, 19]
    q_lens = [1, 5]
    num_blocks = 8
    block_table = torch.tensor([[5, 2, -1, -1], [7, 0, 3, -1]], dtype=torch.int32)
    full_k = [torch.randn(n, HKV, D) for n in ctx]
    full_v = [torch.randn(n, HKV, D) for n in ctx]

    def slot(req, pos):
        return int(block_table[req, pos // BLOCK]) * BLOCK + pos % BLOCK

    kv_cache = torch.zeros(num_blocks, HKV, BLOCK, 2 * D)
    impl = AtomAiterBackend.get_impl_cls()(
        num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HKV, kv_cache_dtype="auto"
    )
    # Earlier steps' KV is already cached; this step writes its own tokens first.
    for req, n in enumerate(ctx):
        cached = n - q_lens[req]
        slots = torch.tensor([slot(req, p) for p in range(cached)], dtype=torch.int64)
        impl.do_kv_cache_update(None, full_k[req][:cached], full_v[req][:cached], kv_cache, slots)
    new_slots = [slot(r, p) for r, n in enumerate(ctx) for p in range(n - q_lens[r], n)]
    qsl = torch.tensor([0, 1, 6], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(ctx, dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=6,
        max_query_len=5,
        max_seq_len=20,
        block_table_tensor=block_table,
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64),
    )
    meta = builder.build(common_prefix_len=0, common_attn_metadata=cam)
    assert (meta.num_decodes, meta.num_decode_tokens) == (1, 1)
    assert isinstance(meta.plan, TorchPlan)
    if planned_only:
        refuse_selection(monkeypatch)

    new_k = torch.cat([full_k[r][n - q_lens[r] :] for r, n in enumerate(ctx)])
    new_v = torch.cat([full_v[r][n - q_lens[r] :] for r, n in enumerate(ctx)])
    query = torch.randn(6, HQ * D)
    output = torch.full((6, HQ * D), 7.0)
    for _ in range(2 if planned_only else 1):
        impl.do_kv_cache_update(None, new_k, new_v, kv_cache, cam.slot_mapping)
        returned = impl.forward(None, query, new_k, new_v, kv_cache, meta, output)
        assert returned.data_ptr() == output.data_ptr()
    q = query.view(6, HQ, D)
    expected = torch.cat(
        [dense_reference(q[qsl[r] : qsl[r + 1]], full_k[r], full_v[r], D**-0.5) for r in range(2)]
    )
    torch.testing.assert_close(output.view(6, HQ, D), expected, rtol=1e-4, atol=1e-4)


def test_profiling_run_with_no_metadata_leaves_output():
    impl = AtomAiterBackend.get_impl_cls()(
        num_heads=HQ, head_size=D, scale=1.0, num_kv_heads=HKV, kv_cache_dtype="auto"
    )
    output = torch.zeros(3, HQ * D)
    kv_cache = torch.zeros(2, HKV, BLOCK, 2 * D)
    q = torch.randn(3, HQ * D)
    assert impl.forward(None, q, q, q, kv_cache, None, output) is output
    assert not output.any()


def test_unsupported_options_are_refused_by_name():
    impl_cls = AtomAiterBackend.get_impl_cls()
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        impl_cls(num_heads=HQ, head_size=D, scale=1.0, num_kv_heads=HKV, alibi_slopes=[1.0] * HQ)
    with pytest.raises(NotImplementedError, match="'encoder'"):
        impl_cls(num_heads=HQ, head_size=D, scale=1.0, num_kv_heads=HKV, attn_type="encoder")


def test_built_decode_metadata_cuts_at_the_shared_split():
    builder = make_builder()
    n = 5
    qsl = torch.arange(n + 1, dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([3, 4, 5, 6, 7], dtype=torch.int32),
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=7,
        block_table_tensor=torch.arange(n, dtype=torch.int32)[:, None],
        slot_mapping=torch.arange(n, dtype=torch.int64),
    )
    first, second = prepare_ubatch_decode(builder.build(0, cam), n)
    assert first.seq_lens.tolist() == [3, 4]
    assert second.seq_lens.tolist() == [5, 6, 7]
    assert second.query_start_loc.tolist()[0] == 0


@pytest.mark.parametrize(
    "impl,plan_type", [("torch", TorchPlan), ("triton", TritonPlan), ("aiter", AiterPlan)]
)
def test_builder_plans_the_path_kernels_setting_names(monkeypatch, impl, plan_type):
    """ATOM_PLUGIN_KERNELS is read where the step is planned; each path gets its plan."""
    monkeypatch.setenv("ATOM_PLUGIN_KERNELS", impl)
    qsl = torch.tensor([0, 1, 2, 5], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([700, 9, 20], dtype=torch.int32),
        num_reqs=3,
        num_actual_tokens=5,
        max_query_len=3,
        max_seq_len=700,
        block_table_tensor=torch.arange(3 * 44, dtype=torch.int32).view(3, 44),
        slot_mapping=torch.arange(5, dtype=torch.int64),
    )
    meta = make_builder().build(0, cam)
    assert type(meta.plan) is plan_type
    splits = choose_num_splits(2, HKV, 700, device_sm_count(torch.device("cpu")))
    if impl == "triton":
        assert meta.plan.num_splits == splits
    if impl == "aiter":
        assert (meta.plan.decode_partitions, meta.plan.sink_decode_splits) == (3, splits)
        assert meta.plan.prefill.cu_seqlens_k.tolist() == [0, 20]  # the prefill row's context
        blocks, offsets = meta.plan.prefill.slots
        assert blocks.tolist() == [88] * 16 + [89] * 4
        assert offsets.tolist() == list(range(16)) + list(range(4))
