"""benchmarks/kernels_vs_vllm.py: what runs without a GPU (flags, FLOP and byte accounting,
the MHA inputs and argument sets built for FA3 and vLLM's Triton kernel, checked against
the torch references on tiny CPU inputs and against vLLM's signatures), and one short GPU
run of each family. The MLA problems (FlashMLA, its fp8 path, FA3-MLA):
test_kernel_problems_mla.py; the report's tables and targets: test_kernel_report.py."""

import importlib
import importlib.util
import inspect
import itertools
import math
import re

import pytest
import torch
from vllm_source import vllm_parameters

from atom_plugin.attention.mha import reference
from atom_plugin.attention.mha.params import AttentionParams
from benchmarks import attention
from benchmarks import kernel_problems as kp
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
    assert cfg.mla_dtypes == ("bf16", "fp8")
    assert cfg.mla_shapes == ((1, 16384), (32, 8192), (128, 4096))
    assert cfg.mha_shapes == tuple(
        (b, c) for b in (1, 8, 32, 128, 256) for c in (1024, 4096, 16384, 65536)
    )
    assert cfg.decode_heads == (kp.Heads(32, 8, 128),) and cfg.kv_cap_gib == 40
    assert cfg.prefill == (
        kp.PrefillCase(1, 1024),
        kp.PrefillCase(1, 8192),
        kp.PrefillCase(1, 32768),
        kp.PrefillCase(4, 2048),
        kp.PrefillCase(4, 2048, 6144),
    )
    assert cfg.prefill_heads == (kp.Heads(32, 8, 128), kp.Heads(64, 8, 128), kp.Heads(32, 8, 64))
    assert cfg.out is None and cfg.iters == 20 and cfg.mla_shared is False
    assert kv.parse_args(["--mla-shared-prefix"]).mla_shared is True


def grid_rows(cfg) -> tuple[int, int, int]:
    """Rows a run of `cfg` makes: MLA, MHA decode (under the K/V cap), prefill."""
    mla = len(cfg.mla_heads) * len(cfg.mla_qlens) * len(cfg.mla_shapes) * len(cfg.mla_dtypes)
    dec = sum(len(kv.decode_plan(cfg.mha_shapes, h, cfg.kv_cap_gib)[0]) for h in cfg.decode_heads)
    return mla, dec, len(cfg.prefill) * len(cfg.prefill_heads)


def test_grids_row_counts_and_overrides():
    assert grid_rows(kv.parse_args([])) == (36, 19, 15)  # as the docstring says
    full = kv.parse_args(["--grid", "full"])
    assert grid_rows(full) == (108, 59, 60)
    assert (256, 65536) in full.mha_shapes and (8, 32768) in full.mha_shapes
    assert kp.PrefillCase(4, 4096, 12288) in full.prefill
    assert {h.d for h in full.prefill_heads} == {64, 128}
    assert {h.q // h.kv for h in full.prefill_heads} == {4, 8}  # GQA 4 and 8
    news = [c.tokens for c in full.prefill]
    assert min(news) == 1024 and max(news) == 32768
    mixed = kv.parse_args(["--grid", "full", "--prefill", "2x1K", "--mla-dtypes", "fp8"])
    assert mixed.prefill == (kp.PrefillCase(2, 1024),) and mixed.mla_dtypes == ("fp8",)
    assert mixed.mla_shapes == full.mla_shapes


def test_heads_parse():
    assert kv.parse_heads("32/8/128, 64/8/64,32/8/128", "--x") == (
        kp.Heads(32, 8, 128),
        kp.Heads(64, 8, 64),
    )
    h = kp.Heads(32, 4, 64)
    assert str(h) == "32/4/64" and h.scale == pytest.approx(64**-0.5)


@pytest.mark.parametrize("text", ["32/6/128", "32/8/96", "32/8", "32/0/128", "a/8/128", "32-8-128"])
def test_bad_heads_name_the_value_and_the_form(text):
    with pytest.raises(ValueError) as info:
        kv.parse_heads(f"32/8/128,{text}", "--prefill-heads")
    msg = str(info.value)
    assert msg.startswith(f"--prefill-heads: {text!r} is not Q/KV/D")
    assert "Q a positive multiple of KV, D one of 64, 128" in msg


def test_prefill_cases_parse():
    got = kv.parse_prefill("1x8K, 4x2K+6K,2X1k+512", "--prefill")
    assert got == (
        kp.PrefillCase(1, 8192),
        kp.PrefillCase(4, 2048, 6144),
        kp.PrefillCase(2, 1024, 512),
    )
    fresh, chunked = got[0], got[1]
    assert str(fresh) == "1 x 8192 fresh" and fresh.reqs() == [(8192, 8192)]
    assert str(chunked) == "4 x 2048 over 6144 cached"
    assert chunked.reqs() == [(2048, 8192)] * 4 and chunked.tokens == 8192
    assert chunked.seq_len == 8192


@pytest.mark.parametrize("text", ["4x2K+", "4x2K+6K+1K", "4x", "x2K", "4x2K+-1", "4+6K", "4x2.5K"])
def test_bad_prefill_names_the_value_and_the_form(text):
    with pytest.raises(ValueError) as info:
        kv.parse_prefill(f"1x8K,{text}", "--prefill")
    msg = str(info.value)
    assert msg.startswith(f"--prefill: {text!r} is not REQUESTSxNEW or REQUESTSxNEW+CACHED")
    assert "4x2K+6K" in msg  # the example of the valid form


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--only", "mla,foo"], "--only: 'foo' is not one of anchors, mla, mha-decode, prefill"),
        (["--mla-heads", "8"], "--mla-heads: '8' is not one of 16, 64, 128"),
        (["--mla-qlens", "3"], "--mla-qlens: '3' is not one of 1, 2"),
        (["--mla-shapes", "8by4K"], "--mla-shapes: '8by4K' is not BATCHxCONTEXT"),
        (["--prefill", "128x8K"], "--prefill: 128 requests in '128x8K' exceed 64"),
        (["--prefill", "1x64K"], "--prefill: 65536 new tokens in '1x64K' exceed 32768"),
        (["--prefill", "1x32K+128K"], "--prefill: context 163840 in '1x32K+128K' exceeds"),
        (["--prefill", "4x2K+"], "--prefill: '4x2K+' is not REQUESTSxNEW or REQUESTSxNEW+CACHED"),
        (["--prefill-heads", "32/3/128"], "--prefill-heads: '32/3/128' is not Q/KV/D"),
        (["--decode-heads", "32/8/256"], "--decode-heads: '32/8/256' is not Q/KV/D"),
        (["--mla-dtypes", "fp16"], "--mla-dtypes: 'fp16' is not one of bf16, fp8"),
        (["--grid", "huge"], "--grid: 'huge' is not one of default, full"),
        (["--kv-cap-gib", "0"], "--kv-cap-gib: 0.0 must be positive"),
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


def test_mla_fp8_bytes_and_limit():
    kv_rows = 8 * 4096 * 576
    q, o = 8 * 128 * 576, 8 * 128 * 512
    assert kp.mla_bytes(8, 4096, 128, 1, kv_elem=1) == kv_rows + 2 * (q + o)
    # the larger of FLOP / matmul rate and bytes / copy bandwidth, in us
    assert kp.limit_us(2e12, 1e9, copy_gbps=1000.0, mm_tflops=1000.0) == pytest.approx(2000.0)
    assert kp.limit_us(1e12, 4e9, copy_gbps=1000.0, mm_tflops=1000.0) == pytest.approx(4000.0)
    assert kp.limit_us(1, 1, None, 1000.0) is None


def test_mha_flops_and_bytes():
    assert kp.mha_decode_flops(8, 4096) == 4 * 32 * 128 * 8 * 4096
    kv_bytes = 2 * 8 * 4096 * 8 * 128 * 2  # K and V, 8 KV heads, bf16
    assert kp.mha_decode_bytes(8, 4096) == kv_bytes + 2 * 8 * 32 * 128 * 2
    h = kp.Heads(64, 4, 64)
    assert kp.mha_decode_flops(8, 4096, h) == 4 * 64 * 64 * 8 * 4096
    assert kp.mha_decode_bytes(8, 4096, h) == (2 * 8 * 4096 * 4 * 64 + 2 * 8 * 64 * 64) * 2
    assert kp.prefill_flops([(4, 4)], h) == 4 * 64 * 64 * kp.causal_pairs([(4, 4)])
    assert kp.mha_cache_bytes(2, 17, h, block_size=16) == 2 * 32 * 2 * 4 * 64 * 2  # 2 blocks


def test_decode_cap_skips_with_a_note():
    shapes = ((128, 65536), (256, 65536), (256, 1024))
    keep, note = kv.decode_plan(shapes, kp.Heads(32, 8, 128), 40.0)
    assert keep == [(128, 65536), (256, 1024)]  # 32 GiB and 1 GiB of K/V
    assert note == (
        "Skipped at 32/8/128 (K/V above the 40 GiB cap, --kv-cap-gib): 256 x 65536 (64 GiB)."
    )
    keep, note = kv.decode_plan(shapes, kp.Heads(32, 4, 128), 40.0)  # half the K/V
    assert keep == list(shapes) and note == ""


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


@pytest.mark.parametrize("heads", [kp.Heads(32, 8, 128), kp.Heads(32, 4, 64)])
def test_pool_per_head_config_holds_its_largest_case(heads):
    """A chunked case needs blocks for its cached prefix too: 4 x (40 new + 60 cached)
    is 4 requests of 7 blocks, more than 2 x 90 fresh (2 x 6) or a decode 3 x 80."""
    cases = [kp.PrefillCase(2, 90), kp.PrefillCase(4, 40, 60), (3, 80)]
    tokens = kp.pool_tokens(cases, block_size=16)
    assert tokens == 4 * 7 * 16
    pool = attention.KVPool(tokens, 16, device="cpu", hkv=heads.kv, d=heads.d)
    assert pool.raw.shape == (28, heads.kv, 16, 2 * heads.d)
    assert pool.key_cache.shape == (28, 16, heads.kv, heads.d)
    meta = pool.meta(cases[1].reqs())
    assert meta.block_table.shape == (4, 7)
    assert len(set(meta.block_table.flatten().tolist())) == 28  # no block shared
    assert meta.query_start_loc.tolist() == [0, 40, 80, 120, 160]
    assert meta.seq_lens.tolist() == [100] * 4


# ---------------------------------------------------------------- FA3 inputs


def varlen_semantics(q, k, v, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal,
                     window_size, softcap, alibi_slopes, **kw):  # fmt: skip
    """flash_attn_varlen_func (and vLLM's unified_attention, the same arguments) over a
    paged cache as its docstring defines it."""
    assert causal and list(window_size) == [-1, -1] and softcap == 0
    assert alibi_slopes is None and kw.get("s_aux") is None and kw.get("sinks") is None
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


def mha_problem(reqs, heads, seed=1):
    torch.manual_seed(0)
    cap = max(s for _, s in reqs)
    pool = attention.KVPool(
        kp.mha_pool_tokens([(len(reqs), cap)], []), 16, device="cpu", hkv=heads.kv, d=heads.d
    )
    meta = pool.meta(reqs, seed=seed)
    q = kp.peaked_mha_query(meta.num_actual_tokens, device="cpu", heads=heads)
    ref = torch.zeros(q.shape)
    params = AttentionParams(scale=heads.scale)
    reference.paged_attention(q, pool.key_cache, pool.value_cache, meta, params, ref)
    return pool, meta, q, ref


CHUNKED = [(24, 64), (16, 40), (1, 33)]  # new tokens over a cached prefix, mixed with decode


@pytest.mark.parametrize(
    "reqs, splits, heads",
    [
        ([(1, 40), (1, 17), (1, 64)], 32, kp.DEFAULT_HEADS),
        ([(24, 24), (16, 16)], 0, kp.DEFAULT_HEADS),
        (CHUNKED, 0, kp.DEFAULT_HEADS),
        (CHUNKED, 0, kp.Heads(32, 4, 64)),
        ([(40, 40), (8, 56)], 0, kp.Heads(64, 8, 128)),
    ],
)
def test_fa3_arguments_pose_the_plugins_problem(reqs, splits, heads):
    pool, meta, q, ref = mha_problem(reqs, heads)
    out = torch.empty_like(q)
    args = kp.fa3_kwargs(pool, meta, q, out, splits)
    # vLLM's K view of its layout
    assert args["k"].shape == (pool.num_blocks, 16, heads.kv, heads.d)
    assert args["k"].data_ptr() == pool.raw.data_ptr()
    assert args["v"].data_ptr() == pool.raw.data_ptr() + heads.d * 2  # V: the second half
    assert args["block_table"].dtype == torch.int32
    assert args["block_table"].shape == (len(reqs), -(-max(s for _, s in reqs) // 16))
    assert args["cu_seqlens_q"].dtype == torch.int32 and args["seqused_k"].dtype == torch.int32
    assert args["max_seqlen_q"] == max(q for q, _ in reqs)
    assert args["max_seqlen_k"] == max(s for _, s in reqs)
    assert args["cu_seqlens_q"].tolist() == [0, *itertools.accumulate(ql for ql, _ in reqs)]
    assert args["seqused_k"].tolist() == [s for _, s in reqs]  # full lengths, cached included
    assert args["softmax_scale"] == pytest.approx(heads.d**-0.5)
    assert args["fa_version"] == 3 and args["num_splits"] == splits and args["out"] is out
    sched = kp.fa3_scheduler_kwargs(pool, meta, splits, heads.q)
    assert (sched["num_heads_q"], sched["num_heads_kv"], sched["headdim"]) == (
        heads.q,
        heads.kv,
        heads.d,
    )
    assert sched["page_size"] == 16 and sched["batch_size"] == len(reqs)
    assert sched["max_seqlen_q"] == max(ql for ql, _ in reqs)
    assert sched["num_splits"] == splits and sched["causal"] is True
    assert sched["cache_seqlens"] is meta.seq_lens
    assert sched["cu_seqlens_q"] is meta.query_start_loc
    torch.testing.assert_close(varlen_semantics(**args), ref, atol=1e-4, rtol=1e-4)
    interface = "vllm_flash_attn/flash_attn_interface.py"
    assert set(args) | {"scheduler_metadata"} <= vllm_parameters(
        interface, "flash_attn_varlen_func"
    )
    assert set(sched) <= vllm_parameters(interface, "get_scheduler_metadata")


@pytest.mark.parametrize(
    "reqs, heads",
    [
        ([(1, 40), (1, 17), (1, 64)], kp.DEFAULT_HEADS),
        ([(1, 50)] * 3, kp.Heads(32, 4, 64)),
        (CHUNKED, kp.DEFAULT_HEADS),
    ],
)
def test_triton_arguments_pose_the_plugins_problem(reqs, heads):
    """vLLM's unified_attention arguments as TritonAttentionImpl.forward passes them:
    the scratch its metadata builder makes (threshold 128 // KV heads, 16 segments,
    head size padded to a power of two), unit descales [requests, KV heads]."""
    from vllm.v1.attention.backends import triton_attn

    pool, meta, q, ref = mha_problem(reqs, heads)
    scratch = kp.triton_scratch(
        heads.q,
        pool,
        triton_attn.MIN_LAUNCH_GRID_SIZE_2D,
        triton_attn.NUM_PAR_SOFTMAX_SEGMENTS,
        "cpu",
    )
    rows = 128 // heads.kv
    assert scratch["seq_threshold_3D"] == rows and scratch["num_par_softmax_segments"] == 16
    assert scratch["softmax_segm_output"].shape == (rows, heads.q, 16, heads.d)
    assert scratch["softmax_segm_max"].shape == (rows, heads.q, 16)
    assert scratch["softmax_segm_expsum"].dtype == torch.float32
    out = torch.empty_like(q)
    args = kp.triton_kwargs(pool, meta, q, out, scratch)
    assert args["k"].shape == (pool.num_blocks, 16, heads.kv, heads.d) and args["out"] is out
    assert args["k_descale"].shape == (len(reqs), heads.kv) and args["q_descale"] is None
    assert args["k_descale"].dtype == torch.float32 and bool((args["v_descale"] == 1).all())
    assert args["window_size"] == (-1, -1) and args["causal"] is True
    assert args["softmax_scale"] == pytest.approx(heads.d**-0.5)
    torch.testing.assert_close(varlen_semantics(**args), ref, atol=1e-4, rtol=1e-4)
    sig = inspect.signature(
        importlib.import_module("vllm.v1.attention.ops.triton_unified_attention").unified_attention
    )
    assert set(args) <= set(sig.parameters)
    required = {n for n, p in sig.parameters.items() if p.default is inspect.Parameter.empty}
    assert required <= set(args)


def test_mha_queries_are_peaked():
    torch.manual_seed(0)
    pool = attention.KVPool(256, 16, device="cpu")
    q = kp.peaked_mha_query(64, device="cpu").float()
    k = pool.key_cache.flatten(0, 1)[:, 0].float()  # KV head 0's keys
    std = (q[:, :4] @ k.T * kp.MHA_SCALE).std().item()  # its four query heads
    assert std == pytest.approx(kp.LOGIT_STD, rel=0.15)
    assert math.isclose(kp.peaked_std(128, 128**-0.5), kp.LOGIT_STD)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_short_gpu_run(tmp_path):
    out = tmp_path / "k.md"
    argv = ["--out", str(out), "--mla-heads", "16", "--mla-qlens", "1,2", "--iters", "3"]
    argv += ["--mla-shapes", "2x1K", "--mla-dtypes", "bf16,fp8", "--mha-shapes", "2x1K,32x1K"]
    argv += ["--decode-heads", "32/8/128", "--prefill", "1x1K,2x512+512"]
    argv += ["--prefill-heads", "32/8/128,32/4/64"]
    status = kv.main(argv)
    text = out.read_text()
    assert "FAILED" not in text
    # one summary per table: MLA bf16, MLA fp8, MHA decode, prefill
    assert len(re.findall(r"^Target: \d+ of \d+ met", text, flags=re.M)) == 4, text
    assert re.search(r"^Target plugin/FA3-MLA <= 1.0: \d+ of 2 met\.$", text, flags=re.M), text
    flashmla_fp8 = r"^Target plugin/FlashMLA fp8 <= 1.0: \d+ of 2 met\.$"  # both rows judged
    assert re.search(flashmla_fp8, text, flags=re.M), text
    assert status == 0, text
