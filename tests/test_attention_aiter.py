"""The AITER MHA calls (ATOM_PLUGIN_KERNELS=aiter) through the fake `aiter` module.

The fake asserts AITER's documented shapes and layouts and computes in torch;
results must equal the reference. No ROCm run happens here.
"""

import sys
from pathlib import Path

import pytest
import torch
from attention_cases import make_batch, tolerance

from atom_plugin.attention.mha import aiter as aiter_mha
from atom_plugin.attention.mha import ops, reference
from atom_plugin.attention.mha.aiter import context_slots
from atom_plugin.attention.mha.params import AttentionParams
from atom_plugin.attention.mha.plan import AiterPlan
from atom_plugin.attention.mha.planner import plan_for_caches, plan_mha

FAKE = Path(__file__).parent / "fake_aiter"
FP8 = torch.float8_e4m3fn


@pytest.fixture
def fake_aiter(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE))
    for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
        monkeypatch.delitem(sys.modules, name)
    import aiter

    monkeypatch.setenv("ATOM_PLUGIN_KERNELS", "aiter")
    aiter.CALLS.clear()
    return aiter


def expected(b, **kw):
    out = torch.zeros_like(b.query)
    params = AttentionParams(**kw)
    reference.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, params, out)
    return out


def through_ops(b, **kw):
    out = torch.full_like(b.query, 5.0)
    ops.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, AttentionParams(**kw), out)
    return out


MIXED = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 40), (6, 6), (3, 21), (17, 33)]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_mixed_batch_matches_reference(fake_aiter, group, window):
    b = make_batch(MIXED, hq=2 * group, hkv=2, d=16, block_size=16, seed=group, pad_tokens=2)
    b.meta.seq_lens[1] = 0  # an inert decode row
    got = through_ops(b, scale=0.25, sliding_window=window)
    want = expected(b, scale=0.25, sliding_window=window)
    t = b.meta.num_actual_tokens
    torch.testing.assert_close(got[:t], want[:t], **tolerance(torch.float32))
    assert torch.all(got[t:] == 5.0)
    assert fake_aiter.CALLS == ["paged_attention_v1", "flash_attn_varlen_func"]


def test_prefill_context_planned_once_per_step(fake_aiter, monkeypatch):
    b = make_batch(MIXED, hq=4, hkv=2, d=16, block_size=16, seed=6)
    builds = []

    def counted(*args):
        builds.append(args)
        return context_slots(*args)

    monkeypatch.setattr(aiter_mha, "context_slots", counted)
    b.meta.plan = plan_for_caches(b.meta, b.key_cache)
    assert isinstance(b.meta.plan, AiterPlan) and b.meta.plan.prefill is not None
    assert b.meta.plan.decode_partitions == 1  # max_seq_len 40 fits one 256-token partition
    want = expected(b, scale=0.25)
    t = b.meta.num_actual_tokens
    for _ in range(2):  # two layers' calls with the step's one metadata
        got = through_ops(b, scale=0.25)
        torch.testing.assert_close(got[:t], want[:t], **tolerance(torch.float32))
    assert len(builds) == 1


def test_prefill_refuses_a_plan_of_other_blocks(fake_aiter):
    b = make_batch(MIXED, hq=4, hkv=2, d=16, block_size=16, seed=6)
    b.meta.plan = plan_mha(b.meta, device=torch.device("cpu"), num_kv_heads=2, block_size=32)
    with pytest.raises(ValueError, match="32-token blocks"):
        through_ops(b, scale=0.25)


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
def test_sinks_decode_falls_back_to_triton(fake_aiter, monkeypatch, sink_dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if torch.cuda.is_available():
        pytest.skip("the interpreter fallback is for CPU runs")
    b = make_batch(MIXED, hq=4, hkv=2, d=16, block_size=16, seed=3)
    sinks = torch.randn(4).to(sink_dtype)  # the fake takes sink_ptr in float32 only
    got = through_ops(b, scale=0.25, sinks=sinks)
    torch.testing.assert_close(
        got, expected(b, scale=0.25, sinks=sinks), **tolerance(torch.float32)
    )
    assert fake_aiter.CALLS == ["flash_attn_varlen_func"]


def test_fp8_cache_write_and_read(fake_aiter):
    b = make_batch(MIXED, hq=4, hkv=2, d=16, block_size=16, dtype=torch.bfloat16,
                   cache_dtype=FP8, seed=4, drop_slots=(2,))  # fmt: skip
    ks, vs = torch.tensor([0.5]), torch.tensor([0.25])
    raw_ref = b.raw_cache.clone()
    kc, vc = raw_ref.transpose(1, 2).split(16, dim=-1)
    reference.write_kv(b.key, b.value, kc, vc, b.meta.slot_mapping, ks, vs)
    ops.write_kv(b.key, b.value, b.key_cache, b.value_cache, b.meta.slot_mapping, ks, vs)
    assert torch.equal(b.raw_cache.view(torch.uint8), raw_ref.view(torch.uint8))
    got = through_ops(b, scale=0.25, k_scale=ks, v_scale=vs)
    want = expected(b, scale=0.25, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.bfloat16, FP8))
    assert fake_aiter.CALLS == [
        "reshape_and_cache_flash", "paged_attention_v1", "flash_attn_varlen_func"
    ]  # fmt: skip


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_asm_layout_write_and_decode(fake_aiter, cache_dtype):
    reqs = [(1, 1), (1, 16), (1, 17), (1, 50)]
    b = make_batch(reqs, hq=8, hkv=2, d=128, block_size=16, dtype=torch.bfloat16,
                   cache_dtype=cache_dtype, seed=5)  # fmt: skip
    nb = b.key_cache.shape[0]
    kshape, vshape = aiter_mha.asm_layout_shapes(nb, 16, 2, 128, cache_dtype)
    kx = torch.zeros(kshape, dtype=cache_dtype)
    vx = torch.zeros(vshape, dtype=cache_dtype)
    ks, vs = torch.tensor([0.5]), torch.tensor([0.25])
    # write every cached token of the batch into both layouts
    pos_slots = []
    for i, (_, s) in enumerate(reqs):
        for p in range(s):
            pos_slots.append(int(b.meta.block_table[i, p // 16]) * 16 + p % 16)
    slots = torch.tensor(pos_slots, dtype=torch.int64)
    keys = torch.randn(len(pos_slots), 2, 128).bfloat16()
    vals = torch.randn(len(pos_slots), 2, 128).bfloat16()
    aiter_mha.write_kv_asm_layout(keys, vals, kx, vx, slots, ks, vs)
    reference.write_kv(keys, vals, b.key_cache, b.value_cache, slots, ks, vs)
    out = torch.zeros_like(b.query)
    params = AttentionParams(scale=128**-0.5, k_scale=ks, v_scale=vs)
    aiter_mha.paged_decode_asm_layout(b.query, kx, vx, b.meta, params, out)
    want = expected(b, scale=128**-0.5, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.float(), want.float(), **tolerance(torch.bfloat16, cache_dtype))
    assert fake_aiter.CALLS == ["reshape_and_cache", "pa_fwd_asm"]


def test_asm_layout_refuses_what_pa_fwd_asm_cannot_do(fake_aiter):
    b = make_batch([(1, 5), (2, 7)], hq=2, hkv=1, d=128, block_size=16, dtype=torch.bfloat16)
    out = torch.zeros_like(b.query)
    caches = (b.key_cache, b.value_cache)
    with pytest.raises(ValueError, match="pure decode"):
        aiter_mha.paged_decode_asm_layout(b.query, *caches, b.meta, AttentionParams(128**-0.5), out)
    with pytest.raises(ValueError, match="scale=0.5"):
        aiter_mha.paged_decode_asm_layout(b.query, *caches, b.meta, AttentionParams(0.5), out)
    with pytest.raises(ValueError, match="no sliding window"):
        params = AttentionParams(128**-0.5, sliding_window=4)
        aiter_mha.paged_decode_asm_layout(b.query, *caches, b.meta, params, out)
    with pytest.raises(ValueError, match="multiples"):
        aiter_mha.asm_layout_shapes(4, 12, 1, 128, torch.bfloat16)
