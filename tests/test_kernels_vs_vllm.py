"""benchmarks/kernels_vs_vllm.py: what runs without a GPU (flags, FLOP and byte accounting,
the inputs and argument sets built for FlashMLA and FA3, checked against the torch
references on tiny CPU inputs), and one short GPU run of each family."""

import math

import pytest
import torch

from atom_plugin.attention.mha import reference
from atom_plugin.attention.mha.params import AttentionParams
from atom_plugin.attention.mla.plan import plan_mla_decode
from atom_plugin.attention.mla.reference import mla_decode_reference
from benchmarks import attention
from benchmarks import kernel_problems as kp
from benchmarks import kernel_tables as kt
from benchmarks import kernels_vs_vllm as kv

# ---------------------------------------------------------------- flags


def test_sizes_and_shapes_parse():
    assert kv.parse_size("4096", "--x") == 4096
    assert kv.parse_size("16K", "--x") == 16384
    assert kv.parse_shapes("1x16K, 8x4096,32X2k", "--x") == ((1, 16384), (8, 4096), (32, 2048))


@pytest.mark.parametrize("text", ["8x", "x4K", "8x4K,abc", "0x1K", "8x-1", "8x4Kx2", "8x1.5K"])
def test_bad_shape_names_the_value(text):
    with pytest.raises(ValueError) as info:
        kv.parse_shapes(text, "--mla-shapes")
    msg = str(info.value)
    assert "--mla-shapes" in msg
    bad = next(t for t in text.split(",") if t not in ("8x4K",))
    assert repr(bad) in msg


def test_shape_limits_name_the_value():
    with pytest.raises(ValueError, match="batch 512 in '512x1K' exceeds 256"):
        kv.parse_shapes("512x1K", "--mha-shapes")
    with pytest.raises(ValueError, match="context 262144 in '1x256K' exceeds 131072"):
        kv.parse_shapes("1x256K", "--mha-shapes")


def test_choices_parse_and_name_bad_values():
    assert kv.parse_choices("128,16,16", "--mla-heads", kv.MLA_HEADS) == (128, 16)
    assert kv.parse_choices("mla,prefill", "--only", kv.FAMILIES) == ("mla", "prefill")
    with pytest.raises(ValueError, match=r"--mla-heads: '32' is not one of 16, 64, 128"):
        kv.parse_choices("16,32", "--mla-heads", kv.MLA_HEADS)
    with pytest.raises(ValueError, match=r"--mla-qlens: 'two' is not one of 1, 2"):
        kv.parse_choices("two", "--mla-qlens", kv.MLA_QLENS)
    with pytest.raises(ValueError, match=r"'mha' is not one of anchors, mla, mha-decode, prefill"):
        kv.parse_choices("mha", "--only", kv.FAMILIES)


def test_parse_args_defaults():
    cfg = kv.parse_args([])
    assert cfg.families == kv.FAMILIES
    assert cfg.mla_heads == (16, 64, 128) and cfg.mla_qlens == (1, 2)
    assert cfg.mla_shapes == ((1, 16384), (8, 4096), (32, 8192), (128, 4096))
    assert (1, 32768) in cfg.mha_shapes and (128, 1024) in cfg.mha_shapes
    assert cfg.prefill == ((1, 8192), (4, 2048))
    assert cfg.out is None and cfg.iters == 20


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--only", "mla,foo"], "--only: 'foo' is not one of anchors, mla, mha-decode, prefill"),
        (["--mla-heads", "8"], "--mla-heads: '8' is not one of 16, 64, 128"),
        (["--mla-qlens", "3"], "--mla-qlens: '3' is not one of 1, 2"),
        (["--mla-shapes", "8by4K"], "--mla-shapes: '8by4K' is not BATCHxCONTEXT"),
        (["--prefill", "128x8K"], "--prefill: batch 128 in '128x8K' exceeds 64"),
        (["--iters", "0"], "--iters: 0 must be at least 1"),
    ],
)
def test_parse_args_rejects_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        kv.parse_args(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


# ---------------------------------------------------------------- accounting


def test_mla_flops_and_bytes():
    # 2 * q_tokens * sum(ctx) * heads * (576 + 512)
    assert kp.mla_flops(1, 1024, 16, 1) == 2 * 1024 * 16 * 1088
    assert kp.mla_flops(8, 4096, 128, 2) == 2 * 2 * 8 * 4096 * 128 * 1088
    kv_rows = 8 * 4096 * 576
    q = 8 * 2 * 128 * 576
    o = 8 * 2 * 128 * 512
    assert kp.mla_bytes(8, 4096, 128, 2) == 2 * (kv_rows + q + o)


def test_mha_flops_and_bytes():
    assert kp.mha_decode_flops(8, 4096) == 4 * 32 * 128 * 8 * 4096
    kv_bytes = 2 * 8 * 4096 * 8 * 128 * 2  # K and V, 8 KV heads, bf16
    assert kp.mha_decode_bytes(8, 4096) == kv_bytes + 2 * 8 * 32 * 128 * 2


@pytest.mark.parametrize("reqs", [[(4, 4)], [(2, 10)], [(3, 3), (1, 9), (5, 7)]])
def test_causal_pairs_count_the_mask(reqs):
    want = 0
    for ql, s in reqs:
        qpos = torch.arange(s - ql, s)[:, None]
        want += int((torch.arange(s)[None, :] <= qpos).sum())
    assert kp.causal_pairs(reqs) == want
    assert kp.prefill_flops(reqs) == 4 * 32 * 128 * want


def test_prefill_reqs_and_rate():
    assert kp.prefill_reqs(4, 2048) == [(2048, 2048)] * 4
    assert kp.causal_pairs(kp.prefill_reqs(1, 8192)) == 8192 * 8193 // 2
    assert kp.rate(2e12, 1e6, 1e12) == pytest.approx(2.0)  # 2e12 in one second
    assert kp.rate(1, None, 1e9) is None


def test_pool_holds_the_largest_case():
    tokens = kp.mha_pool_tokens(((8, 100), (1, 33)), ((4, 20),), block_size=16)
    assert tokens == 8 * 7 * 16  # 8 requests of 7 blocks
    pool = attention.KVPool(tokens, 16, device="cpu")
    meta = pool.meta([(1, 100)] * 8)
    assert pool.num_blocks >= 56
    assert meta.block_table.shape == (8, 7)
    assert len(set(meta.block_table.flatten().tolist())) == 56  # no block shared


# ---------------------------------------------------------------- FlashMLA inputs


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


def test_assert_close_rejects_non_finite_and_shape():
    a = torch.zeros(2, 3)
    with pytest.raises(kp.OutputMismatch, match="shapes"):
        kp.assert_close(a, torch.zeros(3, 2), "x")
    b = a.clone()
    b[0, 0] = float("nan")
    with pytest.raises(kp.OutputMismatch, match="non-finite"):
        kp.assert_close(b, a, "x")


# ---------------------------------------------------------------- FA3 inputs


def fa3_semantics(q, k, v, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, s_aux, **_):  # fmt: skip
    """flash_attn_varlen_func over a paged cache as its docstring defines it."""
    assert causal and window_size == [-1, -1] and softcap == 0
    assert alibi_slopes is None and s_aux is None
    out = torch.zeros(q.shape)
    bs, hkv = k.shape[1], k.shape[2]
    group = q.shape[1] // hkv
    cu = cu_seqlens_q.tolist()
    for i in range(len(cu) - 1):
        t0, t1, s = cu[i], cu[i + 1], int(seqused_k[i])
        pos = torch.arange(s)
        blocks = block_table[i, pos // bs].long()
        kk = k[blocks, pos % bs].float().repeat_interleave(group, dim=1)  # [s, Hq, D]
        vv = v[blocks, pos % bs].float().repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[t0:t1].float(), kk) * softmax_scale
        ql = t1 - t0
        visible = pos[None, :] <= (s - ql + torch.arange(ql))[:, None]  # bottom-right
        logits = logits.masked_fill(~visible[None], float("-inf"))
        out[t0:t1] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), vv)
    return out


@pytest.mark.parametrize(
    "reqs, splits", [([(1, 40), (1, 17), (1, 64)], 32), ([(24, 24), (16, 16)], 0)]
)
def test_fa3_arguments_pose_the_plugins_problem(reqs, splits):
    torch.manual_seed(0)
    pool = attention.KVPool(kp.mha_pool_tokens([(len(reqs), 64)], []), 16, device="cpu")
    meta = pool.meta(reqs, seed=1)
    q = kp.peaked_mha_query(meta.num_actual_tokens, device="cpu")
    out = torch.empty_like(q)
    args = kp.fa3_kwargs(pool, meta, q, out, splits)
    assert args["k"].shape == (pool.num_blocks, 16, 8, 128)  # vLLM's K view of its layout
    assert args["k"].data_ptr() == pool.raw.data_ptr()
    assert args["v"].data_ptr() == pool.raw.data_ptr() + 128 * 2  # V: the second half
    assert args["block_table"].dtype == torch.int32
    assert args["block_table"].shape == (len(reqs), -(-max(s for _, s in reqs) // 16))
    assert args["cu_seqlens_q"].dtype == torch.int32 and args["seqused_k"].dtype == torch.int32
    assert args["max_seqlen_q"] == max(q for q, _ in reqs)
    assert args["max_seqlen_k"] == max(s for _, s in reqs)
    assert args["fa_version"] == 3 and args["num_splits"] == splits and args["out"] is out
    sched = kp.fa3_scheduler_kwargs(pool, meta, splits)
    assert (sched["num_heads_q"], sched["num_heads_kv"], sched["headdim"]) == (32, 8, 128)
    assert sched["page_size"] == 16 and sched["batch_size"] == len(reqs)
    assert sched["num_splits"] == splits and sched["causal"] is True
    assert sched["cache_seqlens"] is meta.seq_lens
    assert sched["cu_seqlens_q"] is meta.query_start_loc
    ref = torch.zeros(q.shape)
    params = AttentionParams(scale=kp.MHA_SCALE)
    reference.paged_attention(q, pool.key_cache, pool.value_cache, meta, params, ref)
    torch.testing.assert_close(fa3_semantics(**args), ref, atol=1e-4, rtol=1e-4)


def test_mha_queries_are_peaked():
    torch.manual_seed(0)
    pool = attention.KVPool(256, 16, device="cpu")
    q = kp.peaked_mha_query(64, device="cpu").float()
    k = pool.key_cache.flatten(0, 1)[:, 0].float()  # KV head 0's keys
    std = (q[:, :4] @ k.T * kp.MHA_SCALE).std().item()  # its four query heads
    assert std == pytest.approx(kp.LOGIT_STD, rel=0.15)
    assert math.isclose(kp.peaked_std(128, 128**-0.5), kp.LOGIT_STD)


# ---------------------------------------------------------------- report


def test_tables_and_exit_status_for_failed_and_error_rows():
    ok = {"heads": 16, "q_len": 1, "batch": 1, "context": 1024, "status": "ok"}
    ok.update(flops=kp.mla_flops(1, 1024, 16, 1), bytes=kp.mla_bytes(1, 1024, 16, 1))
    ok.update(plugin_us=10.0, vllm_us=8.0, plugin_timing="graph", vllm_timing="graph")
    ok.update(kernel="gluon/lockstep", maxdiff=0.01)
    err = dict(ok, status="ERROR: vllm: RuntimeError: nope", vllm_error="RuntimeError: nope")
    del err["vllm_us"]
    text = kt.mla_table([ok, err], copy_gbps=4000.0)
    assert "| 1.25 |" in text  # plugin / FlashMLA
    assert "| error |" in text and "ERROR: vllm" in text
    assert kt.exit_status([ok]) == 0
    assert kt.exit_status([ok, err]) == 3
    assert kt.exit_status([err, dict(ok, status="FAILED: plugin vs FlashMLA: ...")]) == 1
    dec = dict(ok, batch=8, context=4096)
    dec.update(flops=kp.mha_decode_flops(8, 4096), bytes=kp.mha_decode_bytes(8, 4096))
    assert "| 8 | 4096 | 10.0 | 8.0 | 1.25 |" in kt.mha_decode_table([dec], 4000.0)
    pre = dict(ok, case="1 x 8192 fresh", tokens=8192, flops=kp.prefill_flops([(8192, 8192)]))
    assert "| 1 x 8192 fresh | 8192 | 10.0 | 8.0 | 1.25 |" in kt.prefill_table([pre], 800.0)
    assert "GB/s" in kt.anchors_table({"copy_gbps": 4000.0, "matmul_tflops": 700.0})


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_short_gpu_run(tmp_path):
    out = tmp_path / "k.md"
    argv = ["--out", str(out), "--mla-heads", "16", "--mla-qlens", "1,2", "--iters", "3"]
    argv += ["--mla-shapes", "2x1K", "--mha-shapes", "2x1K", "--prefill", "1x1K"]
    status = kv.main(argv)
    text = out.read_text()
    assert "FAILED" not in text
    assert status == 0, text
