"""MLA kernels (Triton under TRITON_INTERPRET=1 on CPU, natively on a GPU) against the
torch reference, and the reference against a direct per-token computation."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mla_cases import (  # noqa: E402
    FP8,
    SENTINEL,
    gpu_edge_batch,
    make_mla_batch,
    plan_for,
    query_in_parts,
    run_decode,
    tolerance,
)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from atom_plugin.attention.mla import cache_view as mla_cache_view  # noqa: E402
from atom_plugin.attention.mla import ops as mla_ops  # noqa: E402
from atom_plugin.attention.mla.gluon.probe import MLAStepLayout  # noqa: E402
from atom_plugin.attention.mla.plan import plan_mla_decode  # noqa: E402
from atom_plugin.attention.mla.reference import (  # noqa: E402
    mla_decode_reference,
    write_mla_kv_reference,
)
from atom_plugin.attention.mla.triton import mla_decode_triton, write_mla_kv_triton  # noqa: E402


def _direct(batch, lora, scale=0.3):
    """Per token, straight from the definition: gather its visible rows, softmax, sum."""
    meta = batch.meta
    qsl, seq = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    bs = batch.kv_cache.shape[1]
    T, H, _ = batch.q.shape
    out = torch.zeros(T, H, lora)
    lse = torch.full((T, H), float("-inf"))
    for r in range(meta.num_reqs):
        q_len = qsl[r + 1] - qsl[r]
        for j in range(q_len):
            t = qsl[r] + j
            n = seq[r] - q_len + j + 1 if seq[r] else 0
            if n <= 0:
                continue
            rows = torch.stack(
                [
                    batch.kv_cache[int(meta.block_table[r, p // bs]), p % bs].float()
                    for p in range(n)
                ]
            )
            if batch.kv_scale is not None:
                rows = rows * batch.kv_scale.float()
            s = batch.q[t].float() @ rows.T * scale
            lse[t] = torch.logsumexp(s, -1)
            out[t] = torch.softmax(s, -1) @ rows[:, :lora]
    return out, lse


BS = 16
SINGLE = [(1, 1), (1, BS - 1), (1, BS), (1, BS + 1), (1, 7 * BS + 5)]
MULTI = [(1, 9), (3, 40), (4, 4), (2, BS + 1)]  # speculative verification rows


# The interpreter tests build their batches on CPU tensors; on a CUDA machine the
# `gpu` tests below run the same kernels on the device at realistic sizes.
INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors for the Triton interpreter; see the gpu tests"
)


@pytest.mark.parametrize("reqs", [SINGLE, MULTI], ids=["single", "multi_token"])
def test_reference_matches_definition(reqs):
    b = make_mla_batch(reqs, heads=4, lora=32, rope=16, block_size=BS, pad_rows=1, pad_tokens=2)
    out, lse = run_decode("torch", b, 32)
    want_out, want_lse = _direct(b, 32)
    T = b.meta.num_actual_tokens
    torch.testing.assert_close(out[:T], want_out[:T], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:T], want_lse[:T], atol=1e-5, rtol=1e-5)
    assert (out[T:] == 0).all() and (lse[T:] == float("-inf")).all(), "padding tokens: zeros"


@INTERPRETER_ONLY
@pytest.mark.parametrize(
    "reqs,heads,splits,cfg",
    [
        (SINGLE, 16, None, None),
        (SINGLE, 20, 3, None),  # heads not a multiple of BLOCK_H
        (MULTI, 16, 1, None),
        (MULTI, 32, 5, {"BLOCK_H": 32, "BLOCK_N": 16}),
        # whole tiles through TMA descriptors, the partial last tile of a split masked
        (SINGLE, 16, 3, {"tma": True, "BLOCK_N": 16}),
        (MULTI, 20, 1, {"tma": True, "BLOCK_N": 16}),
        (SINGLE, 16, 70, {"BLOCK_N": 16}),  # most splits empty; the merge takes 2 chunks
        (MULTI, 16, 3, {"kernel": "per_token"}),  # the kernel from before packing
        (SINGLE, 20, 2, {"kernel": "per_token", "tma": True, "BLOCK_N": 16}),
        ([(1, 4000), (2, 90)], 16, 100, {"BLOCK_N": 16}),  # 84 non-empty splits
        # the merge split into narrow column slices, one pass and chunked
        (SINGLE, 16, 5, {"BLOCK_N": 16, "merge_dv": 16}),
        (SINGLE, 16, 70, {"BLOCK_N": 16, "merge_dv": 32}),
    ],
)
def test_triton_decode_matches_reference(reqs, heads, splits, cfg):
    b = make_mla_batch(reqs, heads=heads, lora=64, rope=16, block_size=BS, pad_rows=1, pad_tokens=2)
    want_out, want_lse = run_decode("torch", b, 64)
    out, lse = run_decode("triton", b, 64, num_splits=splits, config=cfg)
    torch.testing.assert_close(out, want_out, **tolerance(torch.float32))
    torch.testing.assert_close(lse, want_lse, **tolerance(torch.float32))


@INTERPRETER_ONLY
@pytest.mark.parametrize("reqs", [SINGLE, MULTI], ids=["single", "multi_token"])
@pytest.mark.parametrize("cfg", [{"kernel": "packed"}, {"kernel": "per_token"}])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_takes_the_query_in_parts(reqs, cfg, splits):
    """The stage-1 kernels read the latent and rope parts where they lie (the rope part
    strided as vLLM's view is): the same output as the joined query, on every path."""
    b = make_mla_batch(reqs, heads=16, lora=32, rope=16, block_size=BS, pad_rows=1, pad_tokens=2)
    plan = plan_for(b, "triton", num_splits=splits, config=cfg)
    parts = query_in_parts(b.q, 32)
    assert parts[1].stride(1) != 16, "the rope part must be a strided view"
    whole, whole_lse = run_decode("triton", b, 32, plan=plan)
    for path, path_plan in (("triton", plan), ("torch", plan_for(b, "torch"))):
        out = torch.full_like(whole, SENTINEL)
        lse = {"triton": mla_decode_triton, "torch": mla_decode_reference}[path](
            parts, b.kv_cache, b.meta, path_plan, scale=0.3, output=out, kv_lora_rank=32
        )
        torch.testing.assert_close(out, whole, **tolerance(torch.float32))
        torch.testing.assert_close(lse, whole_lse, **tolerance(torch.float32))


def test_a_query_in_parts_of_the_wrong_widths_is_refused():
    b = make_mla_batch(SINGLE, heads=4, lora=32, rope=16, block_size=BS)
    out = torch.zeros(b.q.shape[0], 4, 32)
    latent, rope = query_in_parts(b.q, 32)
    with pytest.raises(ValueError, match=r"a split q must be \(\[T, H, 32\], \[T, H, 16\]\)"):
        mla_ops.mla_decode(
            (rope, latent), b.kv_cache, b.meta, scale=0.3, output=out, kv_lora_rank=32
        )


@INTERPRETER_ONLY
def test_triton_decode_deepseek_shapes():
    """kv_lora_rank 512 + rope 64 = 576, block sizes 1 and 64, multi-token rows."""
    for bs in (1, 64):
        b = make_mla_batch([(1, 1), (1, 65), (2, 70)], heads=16, block_size=bs, seed=bs)
        want_out, want_lse = run_decode("torch", b, 512)
        out, lse = run_decode("triton", b, 512, num_splits=2)
        torch.testing.assert_close(out, want_out, **tolerance(torch.float32))
        torch.testing.assert_close(lse, want_lse, **tolerance(torch.float32))


@INTERPRETER_ONLY
def test_triton_decode_dcp_token_kv_lens():
    """Per-token key counts (decode context parallelism) override the causal counts."""
    b = make_mla_batch([(1, 30), (2, 33)], heads=16, lora=32, rope=16)
    lens = torch.tensor([7, 0, 12], dtype=torch.int32)
    want_out, want_lse = run_decode("torch", b, 32, token_kv_lens=lens)
    for splits in (2, 1):  # one split: `_mla_fill_keyless` writes the keyless token's rows
        out, lse = run_decode("triton", b, 32, token_kv_lens=lens, num_splits=splits)
        torch.testing.assert_close(out, want_out, **tolerance(torch.float32))
        torch.testing.assert_close(lse, want_lse, **tolerance(torch.float32))
        assert (out[1] == 0).all() and torch.isinf(lse[1]).all()


@INTERPRETER_ONLY
@pytest.mark.parametrize(
    "heads,splits,cfg,tokens",
    [
        (16, None, {"kernel": "packed"}, 4),  # 16 heads x up to 4 tokens in one program
        (16, 2, {"BLOCK_N": 16}, 4),  # a split holding one key: the earlier rows see none
        (16, 3, {"BLOCK_N": 16, "tma": True}, 4),
        (16, 1, {"BLOCK_M": 32}, 2),  # 4-token rows in two chunks of 2 tokens
        (32, 2, {"BLOCK_H": 16, "BLOCK_M": 16}, 1),  # no packing: a program per token
    ],
)
def test_triton_decode_packs_a_requests_tokens(heads, splits, cfg, tokens):
    """Speculative rows (causal) with a request's tokens packed into one program's query
    rows; NaN in every unused cache row, so a key read past a row's mask shows."""
    reqs = [(2, 17), (4, 33), (1, 1), (3, 3), (4, 48)]
    b = make_mla_batch(
        reqs, heads=heads, lora=32, rope=16, pad_rows=2, pad_tokens=2, nan_unused=True
    )
    plan = plan_mla_decode(
        b.meta, b.q.shape[0], heads, kernel_impl="triton", config=cfg, num_splits=splits
    )
    assert plan.launch.tokens == tokens  # the packing this case is about is what runs
    want_out, want_lse = run_decode("torch", b, 32)
    out, lse = run_decode("triton", b, 32, plan=plan)
    torch.testing.assert_close(out, want_out, **tolerance(torch.float32))
    torch.testing.assert_close(lse, want_lse, **tolerance(torch.float32))
    assert not out.isnan().any()


# Prefill rows on the decode kernel (vLLM hands the decode rows of up to
# PREFILL_ROWS_ON_DECODE new tokens): a prefix-cache hit's remainder over its context, a
# short prompt from position 0, beside decode rows and inert padding.
PREFILL_ROWS = [(1, 30), (13, 50), (9, 9), (1, 1), (6, 23)]


@INTERPRETER_ONLY
@pytest.mark.parametrize(
    "cfg,tokens,chunks",
    [
        ({"kernel": "packed"}, 4, 4),  # 16 heads x 4 tokens a program, 13 tokens in 4 chunks
        ({"kernel": "packed", "BLOCK_N": 16}, 4, 4),
        ({"kernel": "per_token"}, 1, 1),
    ],
)
def test_triton_decode_runs_prefill_rows(cfg, tokens, chunks):
    b = make_mla_batch(
        PREFILL_ROWS, heads=16, lora=32, rope=16, pad_rows=1, pad_tokens=2, nan_unused=True
    )
    plan = plan_mla_decode(b.meta, b.q.shape[0], 16, kernel_impl="triton", config=cfg)
    assert (plan.launch.tokens, plan.launch.token_chunks) == (tokens, chunks)
    want_out, want_lse = _direct(b, 32)
    out, lse = run_decode("triton", b, 32, plan=plan)
    T = b.meta.num_actual_tokens
    torch.testing.assert_close(out[:T], want_out[:T], **tolerance(torch.float32))
    torch.testing.assert_close(lse[:T], want_lse[:T], **tolerance(torch.float32))
    # every row is written, a padding token's with zeros (its output was the sentinel)
    assert (out[T:] == 0).all() and (lse[T:] == float("-inf")).all()


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("kernel", ["packed", "per_token", None])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_decode_runs_prefill_rows(heads, kernel, cache):
    """DeepSeek sizes: rows of 16, 64 and 128 new tokens over 2K-4K contexts and a
    128-token prompt from position 0, beside decode rows; the Triton kernels and the
    plan's own choice (the Gluon kernel on Hopper)."""
    reqs = [(1, 2100), (16, 2064), (64, 4000), (128, 128), (128, 3000), (1, 5)]
    b = gpu_edge_batch(reqs, heads, cache)
    want_out, want_lse = run_decode("torch", b, 512)
    config = {"kernel": kernel} if kernel else None
    out, lse = run_decode("triton", b, 512, config=config, layout=MLAStepLayout(torch.bfloat16, 64))
    tol = tolerance(torch.bfloat16, FP8[0] if cache == "fp8" else None)
    T = b.meta.num_actual_tokens
    assert not out[:T].isnan().any()
    torch.testing.assert_close(out[:T], want_out[:T], **tol)
    torch.testing.assert_close(lse[:T], want_lse[:T], atol=1e-2, rtol=1e-3)


@INTERPRETER_ONLY
@settings(max_examples=6, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3), st.integers(0, 60)), min_size=1, max_size=4),
    st.sampled_from([1, 8, 16]),
    st.integers(1, 6),
)
def test_triton_decode_random_batches(raw_reqs, bs, splits):
    reqs = [(q, s + q) for q, s in raw_reqs]
    b = make_mla_batch(reqs, heads=16, lora=32, rope=16, block_size=bs, seed=len(reqs) * bs)
    want_out, want_lse = run_decode("torch", b, 32)
    out, lse = run_decode("triton", b, 32, num_splits=splits)
    torch.testing.assert_close(out, want_out, **tolerance(torch.float32))
    torch.testing.assert_close(lse, want_lse, **tolerance(torch.float32))


def _write_case(cache_dtype, lora=512, rope=64, n=9):
    gen = torch.Generator().manual_seed(3)
    kv_c = torch.randn(n + 2, lora, generator=gen)  # 2 padding rows past the slots
    k_pe = torch.randn(n + 2, rope, generator=gen)
    slots = torch.randperm(4 * 16, generator=gen)[:n].to(torch.int64)
    slots[[2, 5]] = -1
    backing = torch.zeros(4, 16, lora + rope + 8).to(cache_dtype)
    return kv_c, k_pe, slots, backing


@pytest.mark.parametrize(
    "impl", [write_mla_kv_reference, pytest.param(write_mla_kv_triton, marks=INTERPRETER_ONLY)]
)
def test_write_mla_kv(impl):
    kv_c, k_pe, slots, backing = _write_case(torch.float32)
    cache = backing[..., 3 : 3 + 576]
    before = backing.clone()
    impl(kv_c, k_pe, cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        torch.testing.assert_close(cache[s // 16, s % 16], torch.cat([kv_c[t], k_pe[t]]))
    written = torch.zeros(4, 16, dtype=torch.bool)
    for s in slots.tolist():
        if s >= 0:
            written[s // 16, s % 16] = True
    assert torch.equal(backing[~written], before[~written]), "only the valid slots change"
    assert torch.equal(backing[..., :3], before[..., :3]) and torch.equal(
        backing[..., 3 + 576 :], before[..., 3 + 576 :]
    ), "columns outside the strided view stay untouched"


def test_fp8_write_then_decode_reference():
    kv_c, k_pe, slots, backing = _write_case(torch.float8_e4m3fn, lora=32, rope=16)
    cache = backing[..., :48]
    scale = torch.tensor([0.25])
    write_mla_kv_reference(kv_c, k_pe, cache, slots, scale)
    s = int(slots[0])
    got = cache[s // 16, s % 16].float() * scale
    torch.testing.assert_close(got, torch.cat([kv_c[0], k_pe[0]]), atol=0.1, rtol=0.07)
    with pytest.raises(ValueError, match="scale"):
        write_mla_kv_reference(kv_c, k_pe, cache, slots)


@INTERPRETER_ONLY
def test_ops_dispatch(monkeypatch):
    b = make_mla_batch([(1, 20), (2, 9)], heads=16, lora=32, rope=16)
    want, _ = run_decode("torch", b, 32)
    for impl in ("torch", "triton"):
        monkeypatch.setenv("ATOM_PLUGIN_KERNELS", impl)
        out, _ = run_decode("ops", b, 32)
        torch.testing.assert_close(out, want, **tolerance(torch.float32))
    monkeypatch.setenv("ATOM_PLUGIN_KERNELS", "cuda")
    with pytest.raises(ValueError, match="aiter, triton, torch"):
        run_decode("ops", b, 32)


def test_shape_errors_name_the_values():
    b = make_mla_batch([(1, 4)], heads=2, lora=32, rope=16)
    with pytest.raises(ValueError, match=r"output must be \[1, 2, 32\]"):
        mla_decode_reference(
            b.q, b.kv_cache, b.meta, scale=1.0, output=torch.empty(1, 2, 16), kv_lora_rank=32
        )
    with pytest.raises(ValueError, match="kv_lora_rank=48"):
        mla_decode_reference(
            b.q, b.kv_cache, b.meta, scale=1.0, output=torch.empty(1, 2, 48), kv_lora_rank=48
        )


# ---- the same checks at realistic sizes on a GPU ----

GPU_REQS = [(1, 1), (1, 63), (1, 64), (1, 65), (1, 4099), (1, 777), (4, 2051), (2, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_triton_decode_deepseek(block_size, dtype):
    b = make_mla_batch(
        GPU_REQS,
        heads=128,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        pad_rows=2,
        pad_tokens=3,
    )
    want_out, want_lse = run_decode("torch", b, 512)
    out, lse = run_decode("triton", b, 512)
    torch.testing.assert_close(out, want_out, **tolerance(dtype))
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [
        {"BLOCK_H": 16, "num_warps": 4},
        {"BLOCK_H": 32, "num_warps": 4},
        {"BLOCK_H": 64, "num_warps": 8},
        {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8},  # fastest in the H200 sweep
        {"tma": True},
        {"tma": True, "BLOCK_N": 32, "num_stages": 3},
        {"tma": False},
    ],
)
def test_gpu_triton_decode_configs(cfg):
    b = make_mla_batch(GPU_REQS, heads=128, block_size=64, dtype=torch.bfloat16, device="cuda")
    want_out, _ = run_decode("torch", b, 512)
    out, _ = run_decode("triton", b, 512, config=cfg)
    torch.testing.assert_close(out, want_out, **tolerance(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_triton_fp8_cache_and_write():
    b = make_mla_batch(
        GPU_REQS,
        heads=128,
        block_size=64,
        dtype=torch.bfloat16,
        cache_dtype=torch.float8_e4m3fn,
        device="cuda",
    )
    want_out, _ = run_decode("torch", b, 512)
    out, _ = run_decode("triton", b, 512)
    torch.testing.assert_close(out, want_out, **tolerance(torch.bfloat16, FP8[0]))
    kv_c, k_pe, slots, backing = _write_case(torch.float8_e4m3fn)
    scale = torch.tensor([0.25], device="cuda")
    args = [x.cuda() for x in (kv_c, k_pe)]
    ref = backing.cuda()
    tri = ref.clone()
    write_mla_kv_reference(*args, ref[..., :576], slots.cuda(), scale)
    write_mla_kv_triton(*args, tri[..., :576], slots.cuda(), scale)
    torch.testing.assert_close(tri.float(), ref.float(), atol=0, rtol=0.07)


@pytest.mark.parametrize(
    "cfg,cache_dtype,col_offset,match",
    [
        ({"tma": True, "BLOCK_N": 32}, torch.float32, 8, "BLOCK_N=32 does not divide"),
        ({"tma": True, "BLOCK_N": 16}, torch.bfloat16, 4, "16-byte aligned"),
        ({"tma": "yes"}, torch.float32, 8, "tma must be None, True or False, got 'yes'"),
        ({"BLOCK_K": 16}, torch.float32, 8, r"unknown packed MLA decode config keys \['BLOCK_K'\]"),
        ({"fp8_math": "fp32"}, torch.float32, 8, "fp8_math must be 'fp16' or 'bf16', got 'fp32'"),
    ],
)
def test_triton_decode_config_errors(cfg, cache_dtype, col_offset, match):
    b = make_mla_batch(
        [(1, 5)], heads=16, lora=64, rope=16, cache_dtype=cache_dtype, col_offset=col_offset
    )
    with pytest.raises(ValueError, match=match):
        run_decode("triton", b, 64, config=cfg)


@pytest.mark.gpu
def test_gpu_tma_chosen_where_the_cache_allows():
    """The default reads whole tiles through TMA on a block-64, aligned cache, and falls
    back to pointer loads, with the same results, where the cache rules TMA out."""
    for col_offset, block_size, want_tma in ((8, 64, True), (4, 64, False), (8, 16, False)):
        b = make_mla_batch(
            GPU_REQS,
            heads=128,
            block_size=block_size,
            dtype=torch.bfloat16,
            device="cuda",
            col_offset=col_offset,
        )
        assert mla_cache_view.use_tma(None, b.kv_cache, 512, 64, 64) is want_tma
        want_out, _ = run_decode("torch", b, 512)
        out, _ = run_decode("triton", b, 512)
        torch.testing.assert_close(out, want_out, **tolerance(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2])
def test_gpu_one_split_writes_the_output(splits):
    """One split: stage 1 stores straight into the bf16 output, no merge kernel."""
    b = make_mla_batch(
        GPU_REQS, heads=128, block_size=64, dtype=torch.bfloat16, device="cuda", pad_tokens=3
    )
    want_out, want_lse = run_decode("torch", b, 512)
    out, lse = run_decode("triton", b, 512, num_splits=splits)
    torch.testing.assert_close(out, want_out, **tolerance(torch.bfloat16))
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


def test_benchmark_targets_follow_the_issue():
    """benchmarks/attention_mla's per-shape targets: 16 heads by copy bandwidth, 64 by
    the lesser limit, 128 by TFLOP/s; one-token shapes only."""
    from benchmarks.attention_mla import target_met, target_of

    assert target_of(16, 32, 4096, 1) == "85% copy" and target_of(16, 1, 32768, 1) == "50% copy"
    assert target_of(16, 1, 4096, 1) is None and target_of(16, 32, 8192, 2) is None
    assert target_of(64, 128, 4096, 1) == "70% limit" and target_of(64, 1, 4096, 1) is None
    assert target_of(128, 32, 32768, 1) == "550 TFLOP/s"
    row = {"target": "85% copy", "frac_copy": 0.84, "frac_limit": 0.9, "tflops": 100}
    assert target_met(row) is False and target_met({**row, "frac_copy": 0.85}) is True
    assert target_met({"target": "70% limit", "frac_limit": 0.71}) is True
    assert target_met({"target": "550 TFLOP/s", "tflops": 549}) is False


class _AtenOps(TorchDispatchMode):
    """Records the torch operators that run inside it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _Launches:
    """Stands in for a Triton kernel: records each launch and runs nothing (the
    interpreter would run the kernel through torch operators of its own)."""

    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(self.name)


@INTERPRETER_ONLY
@pytest.mark.parametrize(
    "splits, kernels",
    [
        (3, ["_mla_decode_stage1", "_mla_decode_stage2"]),
        # one split: stage 1 stores the output, the keyless tokens' rows written apart
        (1, ["_mla_fill_keyless", "_mla_decode_stage1"]),
    ],
)
def test_a_decode_launches_its_kernels_and_no_fills_or_copies(monkeypatch, splits, kernels):
    """What a layer-step runs on the query vLLM hands over (its parts apart): its kernels,
    and beside them only allocations and views: no concatenation of the query, no fill of
    the output or the lse."""
    b = make_mla_batch(SINGLE, heads=16, lora=32, rope=16, block_size=BS, pad_rows=1, pad_tokens=2)
    plan = plan_for(b, "triton", num_splits=splits, config={"kernel": "packed"})
    launches: list[str] = []
    names = (
        "_mla_decode_stage1",
        "_mla_decode_per_token",
        "_mla_decode_stage2",
        "_mla_fill_keyless",
    )
    for name in names:
        monkeypatch.setattr(f"atom_plugin.attention.mla.triton.{name}", _Launches(name, launches))
    parts = query_in_parts(b.q, 32)
    out = torch.empty(b.q.shape[0], 16, 32, dtype=b.q.dtype)
    with _AtenOps() as mode:
        mla_decode_triton(parts, b.kv_cache, b.meta, plan, scale=0.3, output=out, kv_lora_rank=32)
    assert launches == kernels
    assert "empty" in mode.ops  # the partials (the recorder sees what runs)
    assert set(mode.ops) <= {"empty", "slice", "unsqueeze", "select", "view"}, mode.ops
