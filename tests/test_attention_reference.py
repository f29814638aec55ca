"""The torch reference and the op front door, checked against independent definitions."""

import pytest
import torch
import torch.nn.functional as F
from attention_cases import make_batch
from tbo_harness.ubatch_metadata import prepare_ubatch_decode

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha import ops, reference
from atom_plugin.attention.mha.params import AttentionParams


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("ATOM_PLUGIN_KERNELS", "torch")


def dense_kv(batch, i, s):
    """Request i's K/V gathered by hand from the raw vLLM-layout cache: [Hkv, s, D]."""
    raw = batch.raw_cache
    d = batch.key_cache.shape[-1]
    bs = raw.shape[2]
    rows = [raw[int(batch.meta.block_table[i, p // bs]), :, p % bs] for p in range(s)]
    kv = torch.stack(rows, dim=1).float()  # [Hkv, s, 2D]
    return kv[..., :d], kv[..., d:]


def run_ref(batch, **kw):
    out = torch.full_like(batch.query, 7.0)
    params = AttentionParams(scale=0.3, **kw)
    ops.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, params, out)
    return out


@pytest.mark.parametrize("group", [1, 4])
def test_matches_sdpa_on_mixed_batch(group):
    reqs = [(1, 1), (1, 17), (5, 5), (4, 33)]
    b = make_batch(reqs, hq=2 * group, hkv=2, d=8, block_size=16, seed=1)
    out = run_ref(b)
    qsl = b.meta.query_start_loc.tolist()
    for i, (q_len, s) in enumerate(reqs):
        k, v = dense_kv(b, i, s)
        q = b.query[qsl[i] : qsl[i + 1]].float().transpose(0, 1)
        mask = torch.arange(s)[None, :] <= torch.arange(s - q_len, s)[:, None]
        want = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True
        ).transpose(0, 1)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], want, atol=1e-5, rtol=1e-5)


def test_window_of_one_sees_only_itself():
    reqs = [(1, 9), (3, 20)]
    b = make_batch(reqs, hq=4, hkv=2, d=8, block_size=4, seed=2)
    out = run_ref(b, sliding_window=1)
    qsl = b.meta.query_start_loc.tolist()
    for i, (q_len, s) in enumerate(reqs):
        _, v = dense_kv(b, i, s)
        want = v[:, s - q_len :].repeat_interleave(2, dim=0).transpose(0, 1)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], want)


def test_window_wider_than_context_changes_nothing():
    b = make_batch([(1, 9), (3, 20)], hq=4, hkv=2, d=8, block_size=4, seed=3)
    torch.testing.assert_close(run_ref(b, sliding_window=20), run_ref(b))
    assert not torch.allclose(run_ref(b, sliding_window=5), run_ref(b))


def test_sink_on_single_key_scales_the_value():
    b = make_batch([(1, 1)], hq=2, hkv=1, d=8, block_size=16, seed=4)
    sinks = torch.tensor([0.5, -1.0])
    out = run_ref(b, sinks=sinks)
    k, v = dense_kv(b, 0, 1)
    logit = (b.query[0].float() @ k[0, 0]) * 0.3  # [Hq]
    want = v[0, 0][None, :] / (1 + torch.exp(sinks - logit))[:, None]
    torch.testing.assert_close(out[0], want)


def test_inert_rows_give_zeros_and_padding_is_untouched():
    b = make_batch([(1, 5), (1, 7)], hq=2, hkv=2, d=8, block_size=4, seed=5, pad_tokens=2)
    b.meta.seq_lens[1] = 0
    out = run_ref(b)
    assert torch.all(out[1] == 0)
    assert torch.all(out[2:] == 7.0)
    assert torch.all(out[0] != 7.0)


def test_write_kv_lands_in_vllm_layout_and_skips_negative_slots():
    b = make_batch([(3, 6), (2, 2)], hq=2, hkv=2, d=8, block_size=4, seed=6, drop_slots=(1,))
    before = b.raw_cache.clone()
    ops.write_kv(b.key, b.value, b.key_cache, b.value_cache, b.meta.slot_mapping)
    slots = b.meta.slot_mapping.tolist()
    touched = torch.zeros(b.raw_cache.shape[0], b.raw_cache.shape[2], dtype=torch.bool)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        blk, off = divmod(s, 4)
        touched[blk, off] = True
        torch.testing.assert_close(b.raw_cache[blk, :, off, :8], b.key[t])
        torch.testing.assert_close(b.raw_cache[blk, :, off, 8:], b.value[t])
    untouched = ~touched[:, None, :, None].expand_as(b.raw_cache)
    assert torch.equal(b.raw_cache[untouched], before[untouched])


def test_write_kv_fp8_stores_scaled_saturated_values():
    b = make_batch(
        [(4, 4)], hq=2, hkv=2, d=8, block_size=4, seed=7, cache_dtype=torch.float8_e4m3fn
    )
    key = b.key * 1000  # some entries saturate at +-448 after scaling
    ks, vs = torch.tensor([0.5]), torch.tensor([2.0])
    ops.write_kv(key, b.value, b.key_cache, b.value_cache, b.meta.slot_mapping, ks, vs)
    blk = int(b.meta.block_table[0, 0])
    got_k = b.raw_cache[blk, :, :, :8].transpose(0, 1).float()
    got_v = b.raw_cache[blk, :, :, 8:].transpose(0, 1).float()
    want_k = (key.float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    want_v = (b.value.float() / 2.0).to(torch.float8_e4m3fn).float()
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)
    assert got_k.abs().max() == 448


def test_fp8_read_applies_scale():
    b = make_batch(
        [(2, 9)], hq=2, hkv=1, d=8, block_size=4, seed=8, cache_dtype=torch.float8_e4m3fn
    )
    ks, vs = torch.tensor([0.25]), torch.tensor([3.0])
    out = run_ref(b, k_scale=ks, v_scale=vs)
    k, v = dense_kv(b, 0, 9)
    q = b.query.float().transpose(0, 1)
    mask = torch.arange(9)[None, :] <= torch.arange(7, 9)[:, None]
    want = F.scaled_dot_product_attention(
        q, k * 0.25, v * 3.0, attn_mask=mask, scale=0.3, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_named():
    b = make_batch([(1, 3)], hq=4, hkv=2, d=8, block_size=4, seed=9)
    out = torch.empty_like(b.query)
    one = AttentionParams(scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        run_ref(b, sliding_window=0)
    with pytest.raises(ValueError, match="sinks"):
        run_ref(b, sinks=torch.zeros(3))
    for bad in (torch.float64, torch.int32):
        with pytest.raises(ValueError, match=f"sinks dtype {bad} is not one of"):
            run_ref(b, sinks=torch.zeros(4, dtype=bad))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ops.paged_attention(b.query[:, :3], b.key_cache, b.value_cache, b.meta, one, out[:, :3])
    fp8 = make_batch([(1, 3)], hq=4, hkv=2, d=8, block_size=4, cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        ops.paged_attention(fp8.query, fp8.key_cache, fp8.value_cache, fp8.meta, one, out)
    with pytest.raises(ValueError, match="slot_mapping has 1 slots"):
        ops.write_kv(b.key[:0], b.value[:0], b.key_cache, b.value_cache, b.meta.slot_mapping)


def test_unknown_kernel_choice_is_rejected(monkeypatch):
    b = make_batch([(1, 3)], hq=2, hkv=2, d=8, block_size=4)
    monkeypatch.setenv("ATOM_PLUGIN_KERNELS", "cuda")
    with pytest.raises(ValueError, match="aiter, triton, torch"):
        run_ref(b)


def test_reference_agrees_with_op_front_door():
    b = make_batch([(1, 4), (2, 6)], hq=2, hkv=1, d=8, block_size=4, seed=10)
    out = torch.empty_like(b.query)
    params = AttentionParams(scale=0.3)
    reference.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, params, out)
    torch.testing.assert_close(run_ref(b), out)


# --- prepare_ubatch_decode -------------------------------------------------------------


def decode_meta(real, rows, seed=0):
    b = make_batch([(1, 3 + i) for i in range(rows)], hq=2, hkv=1, d=8, block_size=4, seed=seed)
    m = b.meta
    return PagedAttentionMetadata(
        num_reqs=real,
        num_actual_tokens=real,
        max_query_len=1,
        max_seq_len=m.max_seq_len,
        num_decodes=real,
        num_decode_tokens=real,
        query_start_loc=m.query_start_loc[: real + 1],
        seq_lens=m.seq_lens[:real],
        block_table=m.block_table,  # the builder's padded rows
        slot_mapping=m.slot_mapping[:real],
    )


def test_ubatch_cut_matches_split_and_padding_is_inert():
    m = decode_meta(real=5, rows=8)
    u0, u1 = prepare_ubatch_decode(m, 8)
    assert (u0.num_reqs, u1.num_reqs) == (4, 4)
    assert u0.seq_lens.tolist() == m.seq_lens[:4].tolist()
    assert u1.seq_lens.tolist() == [m.seq_lens[4].item(), 0, 0, 0]
    assert u1.slot_mapping.tolist() == [m.slot_mapping[4].item(), -1, -1, -1]
    assert u1.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(u1.block_table, m.block_table[4:8])
    assert u1.num_decodes == u1.num_actual_tokens == 4


def test_ubatch_attention_equals_whole_batch_rows():
    m = decode_meta(real=6, rows=6, seed=3)
    b = make_batch([(1, 3 + i) for i in range(6)], hq=2, hkv=1, d=8, block_size=4, seed=3)
    whole = torch.empty_like(b.query)
    half = AttentionParams(scale=0.5)
    ops.paged_attention(b.query, b.key_cache, b.value_cache, m, half, whole)
    u0, u1 = prepare_ubatch_decode(m, 6)
    for u, (a, z) in ((u0, (0, 3)), (u1, (3, 6))):
        part = torch.empty_like(b.query[a:z])
        ops.paged_attention(b.query[a:z], b.key_cache, b.value_cache, u, half, part)
        torch.testing.assert_close(part, whole[a:z])


def test_ubatch_rejects_prefills_and_too_many_rows():
    m = decode_meta(real=4, rows=4)
    with pytest.raises(ValueError, match="split_bs=5 exceeds the 4 rows"):
        prepare_ubatch_decode(m, 5)
    b = make_batch([(1, 3), (2, 5)], hq=2, hkv=1, d=8, block_size=4)
    with pytest.raises(ValueError, match="pure-decode.*max_query_len=2"):
        prepare_ubatch_decode(b.meta, 2)
    with pytest.raises(ValueError, match="cannot split 1"):
        prepare_ubatch_decode(m, 1)
