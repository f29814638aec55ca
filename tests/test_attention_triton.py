"""The Triton MHA kernels against the torch reference.

Without CUDA they run in Triton's interpreter (small shapes); with CUDA the same
tests run on the GPU, and the `gpu` tests add realistic sizes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the kernels' @triton.jit
    os.environ["TRITON_INTERPRET"] = "1"

from attention_cases import make_batch, tolerance  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tbo_harness.ubatch_metadata import prepare_ubatch_decode  # noqa: E402

from atom_plugin.attention.mha import (
    ops,  # noqa: E402
    reference,  # noqa: E402
)
from atom_plugin.attention.mha.params import AttentionParams  # noqa: E402
from atom_plugin.attention.mha.plan import TritonPlan  # noqa: E402
from atom_plugin.attention.mha.planner import plan_for_caches  # noqa: E402
from atom_plugin.attention.mha.triton import paged_attention, write_kv  # noqa: E402
from atom_plugin.attention.mha.triton_decode import paged_decode  # noqa: E402
from atom_plugin.attention.mha.triton_prefill import paged_prefill  # noqa: E402
from atom_plugin.attention.triton_common import (  # noqa: E402
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    SATURATING_PROGRAMS_PER_SM,
    choose_num_splits,
    device_sm_count,
    occupancy,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def params(scale=0.2, **kw) -> AttentionParams:
    return AttentionParams(scale=scale, **kw)


def expected(b, **kw):
    out = torch.zeros_like(b.query)
    reference.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, params(**kw), out)
    return out


def actual(b, num_splits=None, **kw):
    """The decode then the prefill kernel; `num_splits` None takes the plan's choice."""
    out = torch.full_like(b.query, 3.0)
    if num_splits is None:
        num_splits = plan_for_caches(b.meta, b.key_cache, "triton").num_splits
    caches = (b.key_cache, b.value_cache)
    paged_decode(b.query, *caches, b.meta, params(**kw), out, num_splits=num_splits)
    paged_prefill(b.query, *caches, b.meta, params(**kw), out)
    return out


def check(b, dtype=torch.float32, cache_dtype=None, num_splits=None, **kw):
    want = expected(b, **kw)
    got = actual(b, num_splits=num_splits, **kw)
    t = b.meta.num_actual_tokens
    torch.testing.assert_close(got[:t].float(), want[:t].float(), **tolerance(dtype, cache_dtype))
    assert torch.all(got[t:] == 3.0), "padding rows past num_actual_tokens were written"


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_context_edges(block_size, group):
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    b = make_batch(
        [(1, s) for s in lens], hq=group, hkv=1, d=16, block_size=block_size, device=DEV, seed=group
    )
    check(b, num_splits=3)


@pytest.mark.parametrize("splits", [2, 3, 4, 5, 8, 9, 17, 33, 64])
def test_decode_reduce_tile_holds_every_split(splits):
    """The reduce's split tile is sized to the split count (the next power of two): every
    split count at and past each tile boundary merges all its splits."""
    b = make_batch([(1, 64 * 70), (1, 300), (1, 1)], hq=4, hkv=1, d=16, block_size=16, device=DEV)
    check(b, num_splits=splits)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_decodes_then_prefills(group):
    bs = 16
    reqs = [(1, 1), (1, 40), (bs, bs), (3, bs + 1), (bs + 1, 2 * bs + 7), (1, 5)]
    b = make_batch(reqs, hq=2 * group, hkv=2, d=32, block_size=bs, device=DEV, seed=7, pad_tokens=2)
    check(b, num_splits=2)


@pytest.mark.parametrize("window", [1, 7, 16])
def test_sliding_window(window):
    reqs = [(1, 3), (1, 30), (9, 9), (6, 37)]
    b = make_batch(reqs, hq=4, hkv=2, d=16, block_size=16, device=DEV, seed=window)
    check(b, num_splits=3, sliding_window=window)


def test_sinks_with_window():
    reqs = [(1, 18), (1, 1), (5, 21)]
    b = make_batch(reqs, hq=8, hkv=2, d=16, block_size=16, device=DEV, seed=11)
    sinks = torch.randn(8, device=DEV) * 2
    for splits in (1, 2):  # one split finishes in the split kernel, more go through the reduction
        check(b, num_splits=splits, sinks=sinks)
        check(b, num_splits=splits, sinks=sinks, sliding_window=4)


@pytest.mark.parametrize("sink_dtype", [torch.bfloat16, torch.float16])
def test_half_sinks_read_as_float32(sink_dtype):
    reqs = [(1, 18), (1, 1), (5, 21)]
    b = make_batch(reqs, hq=8, hkv=2, d=16, block_size=16, device=DEV, seed=12)
    sinks = (torch.randn(8, device=DEV) * 2).to(sink_dtype)
    for splits in (1, 2):
        check(b, num_splits=splits, sinks=sinks)  # the reference reads sinks.float()
        torch.testing.assert_close(
            actual(b, num_splits=splits, sinks=sinks),
            actual(b, num_splits=splits, sinks=sinks.float()),
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize(
    "dtype,d", [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 256)]
)
def test_half_dtypes_and_head_sizes(dtype, d):
    reqs = [(1, 20), (1, 33), (4, 18)]
    b = make_batch(reqs, hq=4, hkv=1, d=d, block_size=16, dtype=dtype, device=DEV, seed=d)
    check(b, dtype=dtype, num_splits=2)


def test_fp8_cache_with_scales():
    reqs = [(1, 17), (1, 40), (6, 20)]
    b = make_batch(
        reqs, hq=4, hkv=2, d=32, block_size=16, dtype=torch.bfloat16, cache_dtype=FP8,
        device=DEV, seed=5,
    )  # fmt: skip
    ks = torch.tensor([0.7], device=DEV)
    vs = torch.tensor([1.3], device=DEV)
    check(b, dtype=torch.bfloat16, cache_dtype=FP8, num_splits=2, k_scale=ks, v_scale=vs)


def test_inert_rows_and_empty_padding_rows():
    b = make_batch([(1, 9), (1, 12), (1, 4), (4, 4)], hq=2, hkv=1, d=16, block_size=16, device=DEV)
    b.meta.seq_lens[1] = 0  # a padded decode row
    b.meta.seq_lens[3] = 0  # a prefill row made inert
    for splits in (1, 2):
        out = actual(b, num_splits=splits)
        assert torch.all(out[1] == 0) and torch.all(out[3:7] == 0)
        check(b, num_splits=splits)
    # a decode row owning no token writes nothing (rows: 1, 0, 1, 4 tokens)
    b.meta.query_start_loc.copy_(torch.tensor([0, 1, 1, 2, 6], dtype=torch.int32))
    b.meta.num_actual_tokens = 6
    check(b, num_splits=2)


@pytest.mark.parametrize(
    "cache_dtype,dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (FP8, torch.float16)],
)
def test_write_kv_matches_reference(cache_dtype, dtype):
    b = make_batch(
        [(3, 7), (5, 5)], hq=2, hkv=2, d=16, block_size=16, dtype=dtype, cache_dtype=cache_dtype,
        device=DEV, drop_slots=(0, 4), pad_tokens=3,
    )  # fmt: skip
    ks = torch.tensor([0.05], device=DEV)
    vs = torch.tensor([3.0], device=DEV)
    raw = b.raw_cache.clone()
    d = b.key_cache.shape[-1]
    kc, vc = raw.transpose(1, 2).split(d, dim=-1)
    key = b.key * 20  # saturates the fp8 range after scaling
    reference.write_kv(key, b.value, kc, vc, b.meta.slot_mapping, ks, vs)
    write_kv(key, b.value, b.key_cache, b.value_cache, b.meta.slot_mapping, ks, vs)
    assert torch.equal(b.raw_cache.view(torch.uint8), raw.view(torch.uint8))


def same_fp8_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-equal fp8 caches, except that a zero's sign may differ: on the H200 the
    compiled store wrote +0 where torch's cast keeps -0 (both read back as 0)."""
    return torch.equal(got.float(), want.float())


NO_FNUZ_ON_NVIDIA = pytest.mark.skipif(
    torch.cuda.is_available() and torch.version.hip is None,
    reason="Triton on NVIDIA GPUs has no e4m3fnuz (ROCm's fp8 format)",
)


@pytest.mark.parametrize(
    "fp8", [torch.float8_e4m3fn, pytest.param(torch.float8_e4m3fnuz, marks=NO_FNUZ_ON_NVIDIA)]
)
def test_fp8_write_rounds_like_the_torch_cast(fp8):
    # ties to even, carries into the next power of two, subnormals, signed zeros, saturation
    special = [1.0625, 1.1875, 7.8, -7.8, 15.5, 2**-10 * 3, -(2**-11), -1e-6, -0.0, 0.0, 1e4, -1e4]
    vals = torch.tensor(special + torch.randn(64 - len(special)).mul(30).tolist())
    key = vals.view(2, 2, 16).to(DEV)  # 2 tokens, 2 kv heads, head size 16
    b = make_batch([(2, 2)], hq=2, hkv=2, d=16, block_size=16, cache_dtype=fp8, device=DEV)
    one = torch.ones(1, device=DEV)
    write_kv(key, key, b.key_cache, b.value_cache, b.meta.slot_mapping, one, one)
    limit = torch.finfo(fp8).max
    want = key.float().cpu().clamp(-limit, limit).to(fp8)
    slots = b.meta.slot_mapping.tolist()
    got = torch.stack([b.key_cache[s // 16, s % 16] for s in slots]).cpu()
    assert same_fp8_values(got, want)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    data=st.data(),
    group=st.sampled_from([1, 2, 4, 8]),
    block_size=st.sampled_from([16, 32]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    with_sinks=st.booleans(),
    num_splits=st.integers(1, 4),
)
def test_random_batches(data, group, block_size, window, with_sinks, num_splits):
    n_dec = data.draw(st.integers(0, 3))
    n_pre = data.draw(st.integers(0 if n_dec else 1, 2))
    reqs = [(1, data.draw(st.integers(1, 70))) for _ in range(n_dec)]
    for _ in range(n_pre):
        s = data.draw(st.integers(1, 70))
        reqs.append((data.draw(st.integers(1, min(s, 20))), s))
    b = make_batch(reqs, hq=group, hkv=1, d=16, block_size=block_size, device=DEV, seed=len(reqs))
    sinks = torch.randn(group, device=DEV) if with_sinks else None
    check(b, num_splits=num_splits, sliding_window=window, sinks=sinks)


def test_ops_dispatch_to_triton(monkeypatch):
    monkeypatch.setenv("ATOM_PLUGIN_KERNELS", "triton")
    b = make_batch([(1, 9), (3, 12)], hq=4, hkv=2, d=16, block_size=16, device=DEV, seed=2)
    out = torch.zeros_like(b.query)
    ops.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, params(), out)
    torch.testing.assert_close(out, expected(b), **tolerance(torch.float32))


def test_plan_picks_the_decode_splits_and_ops_run_it():
    b = make_batch([(1, 900), (1, 9), (3, 12)], hq=4, hkv=2, d=16, block_size=16, device=DEV)
    plan = plan_for_caches(b.meta, b.key_cache, "triton")
    sms = device_sm_count(b.key_cache.device)
    assert plan.num_splits == choose_num_splits(2, 2, 900, sms)
    prefill_only = make_batch([(3, 12)], hq=4, hkv=2, d=16, block_size=16, device=DEV)
    assert plan_for_caches(prefill_only.meta, prefill_only.key_cache, "triton").num_splits == 1
    b.meta.plan = TritonPlan(num_splits=3)  # any count is correct: the ops run the plan's
    out = torch.zeros_like(b.query)
    ops.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, params(), out)
    torch.testing.assert_close(out, expected(b), **tolerance(torch.float32))


def test_ubatch_halves_through_triton():
    b = make_batch([(1, 3 + 5 * i) for i in range(5)], hq=4, hkv=1, d=16, block_size=16, device=DEV)
    whole = expected(b)
    u0, u1 = prepare_ubatch_decode(b.meta, 5)
    for u, (lo, hi) in ((u0, (0, 2)), (u1, (2, 5))):
        part = torch.zeros_like(b.query[lo:hi])
        plan = plan_for_caches(u, b.key_cache, "triton")
        paged_attention(b.query[lo:hi], b.key_cache, b.value_cache, u, params(), part, plan)
        torch.testing.assert_close(part, whole[lo:hi], **tolerance(torch.float32))


@pytest.mark.parametrize(
    "per_sm, rows, groups, context, want, measured",
    [  # the H200 split-count sweeps of 2026-12-02 (132 SMs): 3 programs an SM (Triton
        # 3.6) and 5 (Triton 3.7.1); `measured`: the best count there, for the record
        (3, 1, 8, 16384, 47, 48),  # the old rule's 33 was 1.03x slower
        (3, 8, 8, 16384, 6, 6),  # 8 splits (a thin second wave) 1.25x slower
        (3, 32, 8, 16384, 3, 3),  # two full waves; 2 splits 1.29x slower
        (3, 8, 4, 65536, 12, 12),
        (3, 32, 4, 16384, 3, 3),
        (5, 8, 8, 16384, 6, 8),  # 6 within 2% of 8
        (5, 32, 8, 16384, 2, 2),  # one wave of 3.9 an SM; 5 splits 1.03x slower
        (5, 32, 4, 16384, 3, 4),
        (3, 256, 4, 4096, 1, 1),  # the programs fill a wave unsplit
        (5, 256, 4, 4096, 1, 2),  # the same; here 2 splits were 4% faster
        (3, 1, 8, 1024, 4, 4),  # 256 keys a split at least
        (3, 1, 8, 300, 2, 2),
        (3, 1, 1, 10**7, 61, 61),  # bounded by 64 splits, of which 61 cost within 5%
    ],
)
def test_split_choice_on_the_swept_shapes(per_sm, rows, groups, context, want, measured):
    assert choose_num_splits(rows, groups, context, 132, per_sm) == want


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 512),
    groups=st.integers(1, 16),
    context=st.integers(1, 1 << 17),
    sms=st.integers(1, 200),
    per_sm=st.integers(1, 8),
)
def test_split_choice_bounds_and_saturated_waves(rows, groups, context, sms, per_sm):
    splits = choose_num_splits(rows, groups, context, sms, per_sm)
    cap = max(1, min(MAX_SPLITS, -(-context // MIN_TOKENS_PER_SPLIT)))
    assert 1 <= splits <= cap
    programs = rows * groups
    if programs >= min(SATURATING_PROGRAMS_PER_SM, per_sm) * sms:
        assert splits == 1  # every SM busy unsplit: nothing to gain


@pytest.mark.parametrize(
    "n_regs, shared, num_warps, want",
    [
        (139, 38928, 4, 3),  # the decode's production config compiled by Triton 3.6 (sm_90)
        (91, 38928, 4, 5),  # the same by Triton 3.7.1: the shared memory holds five
        (32, 0, 16, 4),  # threads: 2048 an SM
        (255, 200_000, 8, 1),  # at least one
    ],
)
def test_occupancy_of_a_compiled_kernel(n_regs, shared, num_warps, want):
    assert occupancy(n_regs, shared, num_warps, 2048, 233472) == want


def test_plan_splits_for_the_measured_occupancy(monkeypatch):
    from atom_plugin.attention import triton_common
    from atom_plugin.attention.mha import planner, triton_decode

    b = make_batch([(1, 16384)] * 32, hq=32, hkv=8, d=16, block_size=16, device="cpu")
    monkeypatch.setattr(triton_common, "device_sm_count", lambda device: 132)
    gpu = torch.device("cuda", 0)

    def plan():
        return planner.plan_mha(b.meta, device=gpu, num_kv_heads=8, block_size=16, impl="triton")

    monkeypatch.setattr(triton_decode, "_programs_per_sm", {})  # no launch seen: the default
    assert plan() == TritonPlan(num_splits=3)  # 768 programs: two full waves of 3 an SM
    monkeypatch.setattr(triton_decode, "_programs_per_sm", {0: 5})
    assert plan() == TritonPlan(num_splits=2)  # 512 programs: one wave of 5 an SM


# --- realistic sizes on the GPU ------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_first_split_launch_records_the_occupancy(monkeypatch):
    from atom_plugin.attention.mha import triton_decode

    monkeypatch.setattr(triton_decode, "_programs_per_sm", {})
    b = make_batch(
        [(1, 3000)] * 4, hq=32, hkv=8, d=128, block_size=16, dtype=torch.bfloat16, device="cuda"
    )
    explicit = dict(BLOCK_N=32, num_warps=4, num_stages=2)
    out = torch.zeros_like(b.query)
    paged_decode(b.query, b.key_cache, b.value_cache, b.meta, params(), out, num_splits=2,
                 config=explicit)  # fmt: skip
    paged_decode(b.query, b.key_cache, b.value_cache, b.meta, params(), out, num_splits=1)
    assert triton_decode._programs_per_sm == {}  # only the production config's split launch
    paged_decode(b.query, b.key_cache, b.value_cache, b.meta, params(), out, num_splits=2)
    index = b.query.device.index
    assert 1 <= triton_decode._programs_per_sm[index] <= 16
    assert triton_decode.programs_per_sm(b.query.device) == triton_decode._programs_per_sm[index]


@pytest.mark.gpu
@pytest.mark.parametrize("group,d,block_size", [(4, 128, 16), (8, 64, 32), (1, 256, 64)])
def test_gpu_decode_realistic(group, d, block_size):
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 6000, (48,), generator=gen).tolist()
    b = make_batch(
        [(1, s) for s in lens], hq=2 * group, hkv=2, d=d, block_size=block_size,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    check(b, dtype=torch.bfloat16)
    check(b, dtype=torch.bfloat16, num_splits=1)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 512])
def test_gpu_mixed_realistic(window):
    reqs = [(1, 3000)] * 8 + [(1024, 1024), (517, 4100), (1, 77), (2048, 2048)]
    b = make_batch(reqs, hq=32, hkv=8, d=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    sinks = torch.randn(32, device="cuda")
    check(b, dtype=torch.bfloat16, sliding_window=window, sinks=sinks)


@pytest.mark.gpu
def test_gpu_fp8_realistic():
    reqs = [(1, 4000)] * 16 + [(700, 2000)]
    b = make_batch(
        reqs, hq=32, hkv=8, d=128, block_size=16, dtype=torch.bfloat16, cache_dtype=FP8,
        device="cuda",
    )  # fmt: skip
    ks = torch.tensor([0.02], device="cuda")
    vs = torch.tensor([0.05], device="cuda")
    check(b, dtype=torch.bfloat16, cache_dtype=FP8, k_scale=ks, v_scale=vs)
    raw = b.raw_cache.clone()
    kc, vc = raw.transpose(1, 2).split(128, dim=-1)
    reference.write_kv(b.key, b.value, kc, vc, b.meta.slot_mapping, ks, vs)
    write_kv(b.key, b.value, b.key_cache, b.value_cache, b.meta.slot_mapping, ks, vs)
    assert same_fp8_values(b.raw_cache, raw)


@pytest.mark.parametrize("d", [32, 40])  # 40: head size below the power-of-two tile width
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize(
    "block_size, config",
    [
        (16, dict(BLOCK_Q=4, BLOCK_N=16, num_warps=4, num_stages=1)),
        (32, dict(BLOCK_Q=8, BLOCK_N=64, num_warps=4, num_stages=1)),
        # the register cap the CUDA production config takes
        (16, dict(BLOCK_Q=4, BLOCK_N=16, num_warps=4, num_stages=1, maxnreg=128)),
    ],
)
def test_prefill_tiles_below_the_diagonal(block_size, config, window, d):
    """Contexts many key tiles long, so the prefill kernel's unmasked loop (tiles
    wholly before a block's first query) runs, not only the causal diagonal."""
    b = make_batch(
        [(40, 150), (1, 90), (70, 70)], hq=8, hkv=2, d=d, block_size=block_size, device=DEV,
        seed=3,
    )  # fmt: skip
    # K and V in NaN-filled power-of-two-wide slots: the columns past d must stay masked
    w = 1 << (d - 1).bit_length()
    shape = (*b.raw_cache.shape[:3], 2 * w)
    slots = torch.full(shape, float("nan"), dtype=b.raw_cache.dtype, device=DEV).transpose(1, 2)
    slots[..., :d] = b.key_cache
    slots[..., w : w + d] = b.value_cache
    b.key_cache, b.value_cache = slots[..., :d], slots[..., w : w + d]
    b.meta.num_decodes = 0
    b.meta.num_decode_tokens = 0
    want = torch.zeros_like(b.query)
    window_params = params(sliding_window=window)
    reference.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, window_params, want)
    got = torch.zeros_like(b.query)
    paged_prefill(
        b.query, b.key_cache, b.value_cache, b.meta, window_params, got, first_req=0, config=config
    )
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 50])
def test_decode_table_blocks(window, block_size):
    """The decode split kernel's one block-table read per cache block (`table_blocks`),
    split and not, over contexts not a multiple of the tile, a window starting mid-block."""
    b = make_batch(
        [(1, 150), (1, 90), (1, 33), (1, 1)], hq=8, hkv=2, d=40, block_size=block_size,
        device=DEV, seed=5,
    )  # fmt: skip
    win = params(sliding_window=window)
    want = torch.zeros_like(b.query)
    reference.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, win, want)
    for splits in (1, 3):
        got = torch.zeros_like(b.query)
        config = dict(BLOCK_N=32, num_warps=4, num_stages=1, table_blocks=True)
        paged_decode(
            b.query, b.key_cache, b.value_cache, b.meta, win, got, num_splits=splits, config=config
        )
        torch.testing.assert_close(got, want, **tolerance(torch.float32))


def test_config_keys_are_checked():
    b = make_batch([(3, 40)], hq=4, hkv=1, d=32, block_size=32, device=DEV, seed=1)
    out = torch.zeros_like(b.query)
    valid = r"valid keys: \['BLOCK_Q', 'BLOCK_N', 'num_warps', 'num_stages', 'maxnreg'\]"
    with pytest.raises(ValueError, match=r"unknown config keys \['table_blocks'\]; " + valid):
        paged_prefill(
            b.query, b.key_cache, b.value_cache, b.meta, params(), out,
            config=dict(BLOCK_Q=4, BLOCK_N=16, num_warps=4, num_stages=1, table_blocks=True),
        )  # fmt: skip
    b = make_batch([(1, 40)], hq=4, hkv=1, d=32, block_size=32, device=DEV, seed=1)
    with pytest.raises(ValueError, match=r"unknown config keys \['tabel_blocks'\]; valid keys"):
        paged_decode(
            b.query, b.key_cache, b.value_cache, b.meta, params(), out, num_splits=1,
            config=dict(BLOCK_N=32, num_warps=4, num_stages=1, tabel_blocks=True),
        )  # fmt: skip
    with pytest.raises(ValueError, match="multiple of the cache block"):
        paged_decode(
            b.query, b.key_cache, b.value_cache, b.meta, params(), out, num_splits=1,
            config=dict(BLOCK_N=16, num_warps=4, num_stages=1, table_blocks=True),
        )  # fmt: skip


@pytest.mark.parametrize("scale", [0.0, -0.2])
def test_prefill_rejects_a_scale_not_above_zero(scale):
    b = make_batch([(3, 3)], hq=2, hkv=1, d=16, block_size=16, device=DEV)
    with pytest.raises(ValueError, match=repr(scale)):
        paged_prefill(b.query, b.key_cache, b.value_cache, b.meta, params(scale), b.query)


def test_host_int_helpers_match_triton():
    """The launch code's cdiv / next_power_of_2 give triton's values at plain-int cost."""
    import triton

    from atom_plugin.attention.triton_common import cdiv, next_power_of_2

    for n in range(0, 2100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 256):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_production_configs():
    """On CUDA the prefill's first candidate is the register-capped 128-row program; the
    decode reads the block table per cache block where its 64-key tile covers whole blocks."""
    from atom_plugin.attention.mha import triton_decode, triton_prefill

    first = triton_prefill._configs(128, 4, cuda=True)[0]
    assert first["maxnreg"] == 128 and first["BLOCK_Q"] * 4 == 128
    assert all("maxnreg" not in c for c in triton_prefill._configs(128, 4, cuda=False))
    assert triton_prefill._configs(256, 4, cuda=True) == triton_prefill._configs(256, 4, False)
    assert triton_decode._config(128, 16)["table_blocks"]
    assert not triton_decode._config(128, 128)["table_blocks"]
    assert "table_blocks" not in triton_decode._config(256, 16)


def test_decode_config_must_be_whole():
    b = make_batch([(1, 40)], hq=4, hkv=1, d=32, block_size=32, device=DEV, seed=1)
    with pytest.raises(ValueError, match="lacks \\['num_stages', 'num_warps'\\]"):
        paged_decode(
            b.query, b.key_cache, b.value_cache, b.meta, params(), torch.zeros_like(b.query),
            num_splits=1, config=dict(BLOCK_N=32),
        )  # fmt: skip
