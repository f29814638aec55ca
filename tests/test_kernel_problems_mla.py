"""The MLA problems `benchmarks.kernels_vs_vllm` poses (benchmarks/kernel_problems.py): the
arguments built for FlashMLA (bf16 and fp8 paths) and for FA3 with q_v, each checked on
tiny CPU inputs against a torch definition of the kernel and against vLLM's signatures;
the peaked queries and the output check that catches a misread block."""

import itertools

import pytest
import torch
from vllm_source import vllm_parameters

from atom_plugin.attention.mla.plan import plan_mla_decode
from atom_plugin.attention.mla.reference import mla_decode_reference
from benchmarks import kernel_problems as kp
from benchmarks.kernel_cases import FLASHMLA_FP8_TOL


def flashmla_semantics(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                       is_fp8_kvcache):  # fmt: skip
    """FlashMLA's dense decode as its docstring defines it, from the keyword arguments."""
    assert not is_fp8_kvcache and causal
    b, sq, h, _ = q.shape
    bs = k_cache.shape[1]
    out = torch.zeros(b, sq, h, head_dim_v)
    for i in range(b):
        s = int(cache_seqlens[i])
        pos = torch.arange(s)
        rows = k_cache[block_table[i, pos // bs].long(), pos % bs, 0].float()  # [s, 576]
        logits = torch.einsum("qhd,kd->qhk", q[i].float(), rows) * softmax_scale
        visible = pos[None, :] < (s - sq + torch.arange(sq) + 1)[:, None]  # bottom-right causal
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        out[i] = torch.einsum("qhk,kd->qhd", logits.softmax(-1), rows[:, :head_dim_v])
    return out.reshape(b * sq, h, head_dim_v)


def mla_reference(shape, token_kv_lens=None):
    T = shape.batch * shape.q_len
    plan = plan_mla_decode(
        shape.meta, T, shape.heads, kernel_impl="torch", token_kv_lens=token_kv_lens
    )
    ref = torch.zeros(T, shape.heads, kp.LORA)
    mla_decode_reference(shape.q, shape.kv, shape.meta, plan, scale=shape.scale, output=ref)
    return ref


@pytest.mark.parametrize("q_len", [1, 2])
def test_flashmla_arguments_pose_the_plugins_problem(q_len):
    shape = kp.make_mla_shape(3, 150, 16, q_len, device="cpu", seed=3)
    args = kp.flashmla_kwargs(shape)
    assert args["q"].shape == (3, q_len, 16, 576)
    assert args["q"].data_ptr() == shape.q.data_ptr() and args["q"].is_contiguous()
    assert args["k_cache"].shape == (shape.kv.shape[0], 64, 1, 576)
    assert args["k_cache"].data_ptr() == shape.kv.data_ptr()
    assert args["block_table"].dtype == torch.int32 and args["block_table"].shape == (3, 3)
    assert args["cache_seqlens"].dtype == torch.int32
    assert args["cache_seqlens"].tolist() == [150] * 3
    assert args["head_dim_v"] == 512 and args["causal"] is True
    assert args["softmax_scale"] == pytest.approx(192**-0.5)
    got = flashmla_semantics(**args)
    torch.testing.assert_close(got, mla_reference(shape), atol=1e-4, rtol=1e-4)


def test_fp8_mla_check_poses_the_same_problem():
    """An fp8 row's check: FlashMLA's arguments over the cache dequantized to bf16 give
    the plugin's problem on the fp8 cache (the reference reading it with its scale)."""
    shape = kp.make_mla_shape(2, 150, 16, 1, device="cpu", seed=4, cache="fp8")
    assert shape.kv.dtype == torch.float8_e4m3fn and shape.kv_scale is not None
    latents = kp.bf16_latents(shape)
    assert latents.dtype == torch.bfloat16 and latents.shape == shape.kv.shape
    torch.testing.assert_close(
        latents.float(), shape.kv.float() * shape.kv_scale, rtol=1e-2, atol=0
    )
    args = kp.flashmla_kwargs(shape, latents)
    assert args["k_cache"].data_ptr() == latents.data_ptr()
    T = shape.batch * shape.q_len
    plan = plan_mla_decode(shape.meta, T, shape.heads, kernel_impl="torch")
    ref = torch.zeros(T, shape.heads, kp.LORA)
    mla_decode_reference(
        shape.q, shape.kv, shape.meta, plan, scale=shape.scale, output=ref, kv_scale=shape.kv_scale
    )
    kp.assert_close(flashmla_semantics(**args).to(torch.bfloat16), ref, "dequantized check")
    bf16 = kp.make_mla_shape(2, 150, 16, 1, device="cpu", seed=4)
    assert kp.bf16_latents(bf16) is bf16.kv


def flashmla_fp8_semantics(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                           causal, descale_q, descale_k):  # fmt: skip
    """FlashMLA's fp8 dense decode: the e4m3 query and cache, each times its descale,
    through the dense decode's definition."""
    assert q.dtype == k_cache.dtype == torch.float8_e4m3fn
    assert descale_q.shape == descale_k.shape == (1,) and descale_q.dtype == torch.float32
    return flashmla_semantics(
        q.float() * descale_q, k_cache.float() * descale_k, block_table, cache_seqlens,
        head_dim_v, softmax_scale, causal, is_fp8_kvcache=False,
    )  # fmt: skip


@pytest.mark.parametrize("q_len, shared", [(1, False), (2, False), (1, True)])
def test_flashmla_fp8_arguments_pose_the_plugins_problem(q_len, shared):
    """FlashMLA's fp8 path gets the plugin's problem: the query it takes in e4m3 at
    Q_FP8_SCALE holds exactly the plugin's bf16 query (the shape's query lies on that
    grid), the cache is the plugin's fp8 cache with its scale; the names are vLLM's.
    `shared`: every request reads the same blocks (--mla-shared-prefix)."""
    shape = kp.make_mla_shape(3, 150, 16, q_len, device="cpu", seed=6, cache="fp8", shared=shared)
    rows = shape.meta.block_table.tolist()
    assert (rows[0] == rows[1] == rows[2]) is shared and shape.kv.shape[0] == (4 if shared else 10)
    args = kp.flashmla_fp8_kwargs(shape)
    assert args["q"].shape == (3, q_len, 16, 576) and args["q"].dtype == torch.float8_e4m3fn
    dequantized = (args["q"].float() * args["descale_q"]).to(torch.bfloat16)
    assert torch.equal(dequantized.view_as(shape.q), shape.q)  # no rounding left to do
    assert args["descale_q"].item() == kp.Q_FP8_SCALE != 1.0
    assert args["k_cache"].shape == (shape.kv.shape[0], 64, 1, 576)
    assert args["k_cache"].data_ptr() == shape.kv.data_ptr()
    assert args["descale_k"].item() == pytest.approx(shape.kv_scale.item())
    assert set(args) | {"tile_scheduler_metadata", "num_splits"} == vllm_parameters(
        "v1/attention/ops/flashmla.py", "flash_mla_with_kvcache_fp8"
    )
    T = shape.batch * q_len
    plan = plan_mla_decode(shape.meta, T, shape.heads, kernel_impl="torch")
    ref = torch.zeros(T, shape.heads, kp.LORA)
    mla_decode_reference(
        shape.q, shape.kv, shape.meta, plan, scale=shape.scale, output=ref, kv_scale=shape.kv_scale
    )
    torch.testing.assert_close(flashmla_fp8_semantics(**args), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="takes an fp8 cache, not torch.bfloat16"):
        kp.flashmla_fp8_call(kp.make_mla_shape(1, 64, 16, 1, device="cpu"))


def fa3_mla_semantics(q, k, v, q_v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k,
                      block_table, softmax_scale, causal, return_softmax_lse, fa_version,
                      num_splits):  # fmt: skip
    """flash_attn_varlen_func with q_v over a paged cache as its docstring defines it:
    logits q.k + q_v.v (one KV head shared by every query head), output softmax . v."""
    assert causal and not return_softmax_lse and fa_version == 3
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    bs = k.shape[1]
    cu = cu_seqlens_q.tolist()
    assert max_seqlen_q == max(b - a for a, b in itertools.pairwise(cu))
    assert max_seqlen_k == int(seqused_k.max())
    for i in range(len(cu) - 1):
        t0, t1, s = cu[i], cu[i + 1], int(seqused_k[i])
        pos = torch.arange(s)
        blocks = block_table[i, pos // bs].long()
        kk, vv = k[blocks, pos % bs, 0].float(), v[blocks, pos % bs, 0].float()
        logits = torch.einsum("qhd,kd->qhk", q[t0:t1].float(), kk)
        logits += torch.einsum("qhd,kd->qhk", q_v[t0:t1].float(), vv)
        ql = t1 - t0
        visible = pos[None, :] <= (s - ql + torch.arange(ql))[:, None]  # bottom-right
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        out[t0:t1] = torch.einsum("qhk,kd->qhd", (logits * softmax_scale).softmax(-1), vv)
    return out


@pytest.mark.parametrize("q_len, heads", [(1, 16), (2, 16), (1, 128)])
def test_fa3_mla_arguments_pose_the_plugins_problem(q_len, heads):
    """FA3 with q_v as FlashAttnMLAImpl.forward_mqa calls it: the rope part of the query
    as q and of the cache as k, the latent part of each as q_v and v, every cache view
    [blocks, 64, 1, cols] over the one [blocks, 64, 576] cache; the scheduler metadata
    for one KV head of size 64 with values of size 512; the same problem as the plugin's."""
    shape = kp.make_mla_shape(3, 150, heads, q_len, device="cpu", seed=6)
    T, blocks, el = 3 * q_len, shape.kv.shape[0], shape.kv.element_size()
    args = kp.fa3_mla_kwargs(shape, 32)
    assert args["q"].shape == (T, heads, 64) and args["q"].stride() == (heads * 576, 576, 1)
    assert args["q"].data_ptr() == shape.q.data_ptr() + 512 * el  # a view of the rope part
    assert args["q_v"].shape == (T, heads, 512) and args["q_v"].is_contiguous()
    torch.testing.assert_close(args["q_v"], shape.q[..., :512], atol=0, rtol=0)
    for name, cols, offset in (("k", 64, 512), ("v", 512, 0)):  # views of the one cache
        view = args[name]
        assert view.shape == (blocks, 64, 1, cols)
        assert view.data_ptr() == shape.kv.data_ptr() + offset * el
        assert [view.stride(i) for i in (0, 1, 3)] == [64 * 576, 576, 1]  # axis 2 has size 1
    assert args["cu_seqlens_q"].tolist() == list(range(0, T + 1, q_len))
    assert args["seqused_k"].tolist() == [150] * 3 and args["max_seqlen_k"] == 150
    assert args["block_table"].dtype == torch.int32 and args["block_table"].shape == (3, 3)
    assert args["max_seqlen_q"] == q_len and args["num_splits"] == 32
    assert args["softmax_scale"] == pytest.approx(192**-0.5)
    sched = kp.fa3_mla_scheduler_kwargs(shape, 32)
    assert sched["batch_size"] == 3 and sched["max_seqlen_q"] == q_len
    assert sched["max_seqlen_k"] == 150 and sched["num_heads_q"] == heads
    assert (sched["num_heads_kv"], sched["headdim"], sched["headdim_v"]) == (1, 64, 512)
    assert sched["qkv_dtype"] == torch.bfloat16 and sched["page_size"] == 64
    assert sched["causal"] is True and sched["num_splits"] == 32
    assert sched["cache_seqlens"] is shape.meta.seq_lens
    assert sched["cu_seqlens_q"] is shape.meta.query_start_loc
    torch.testing.assert_close(
        fa3_mla_semantics(**args), mla_reference(shape), atol=1e-4, rtol=1e-4
    )
    interface = "vllm_flash_attn/flash_attn_interface.py"
    assert set(args) | {"scheduler_metadata"} <= vllm_parameters(
        interface, "flash_attn_varlen_func"
    )
    assert set(sched) <= vllm_parameters(interface, "get_scheduler_metadata")


def test_fa3_mla_takes_no_fp8_cache():
    shape = kp.make_mla_shape(1, 64, 16, 1, device="cpu", cache="fp8")
    with pytest.raises(ValueError, match="bf16 cache here, not torch.float8_e4m3fn"):
        kp.fa3_mla_call(shape, 32)


def test_mla_queries_are_peaked():
    shape = kp.make_mla_shape(2, 512, 16, 1, device="cpu")
    logits = torch.einsum("thd,kd->thk", shape.q.float(), shape.kv.flatten(0, 1).float())
    std = (logits * shape.scale).std().item()
    assert std == pytest.approx(kp.LOGIT_STD, rel=0.15)


def test_mla_misread_or_dropped_block_fails_the_check():
    """A dropped last block or one block read from the wrong place moves some row by far
    more than the tolerance; rounding the output to bf16 does not."""
    shape = kp.make_mla_shape(4, 512, 16, 1, device="cpu", seed=5)
    ref = mla_reference(shape)
    assert kp.assert_close(ref.to(torch.bfloat16), ref, "bf16 rounding") < kp.ATOL
    dropped = mla_reference(shape, token_kv_lens=torch.full((4,), 512 - 64, dtype=torch.int32))
    with pytest.raises(kp.OutputMismatch, match="beyond"):
        kp.assert_close(dropped.to(torch.bfloat16), ref, "dropped")
    used = set(shape.meta.block_table.flatten().tolist())
    spare = next(b for b in range(shape.kv.shape[0]) if b not in used)
    shape.meta.block_table[2, 3] = spare
    misread = mla_reference(shape)
    with pytest.raises(kp.OutputMismatch, match="beyond"):
        kp.assert_close(misread.to(torch.bfloat16), ref, "misread")
    with pytest.raises(kp.OutputMismatch, match="beyond"):  # FlashMLA fp8's looser check too
        kp.assert_close(misread.to(torch.bfloat16), ref, "misread", *FLASHMLA_FP8_TOL)


def test_assert_close_rejects_non_finite_and_shape():
    a = torch.zeros(2, 3)
    with pytest.raises(kp.OutputMismatch, match="shapes"):
        kp.assert_close(a, torch.zeros(3, 2), "x")
    b = a.clone()
    b[0, 0] = float("nan")
    with pytest.raises(kp.OutputMismatch, match="non-finite"):
        kp.assert_close(b, a, "x")
