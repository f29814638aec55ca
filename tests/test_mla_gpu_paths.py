"""Every path of the MLA decode plan at DeepSeek sizes on a CUDA GPU against the torch
reference: the edges of a context (page - 1, page, page + 1, long), padding, NaN in unused
cache rows, fp8 caches, the packed kernel's launch variants, decode context parallelism,
and decodes replayed from CUDA graphs."""

import pytest
import torch
from mla_cases import (
    EDGE_REQS,
    FP8,
    gpu_edge_batch,
    make_mla_batch,
    plan_for,
    run_decode,
    tolerance,
)

from atom_plugin.attention.mla import cache_view as mla_cache_view
from atom_plugin.attention.mla import launch_plan as mla_launch_plan
from atom_plugin.attention.mla.plan import plan_mla_decode
from atom_plugin.attention.mla.triton import mla_decode_triton


# context 1, page - 1, page, page + 1 (page 64), long ones, and 2-token causal rows
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [64, 16])  # TMA tiles / pointer loads only
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_gpu_decode_edges(heads, cache, block_size):
    """Shuffled tables, padding rows (context 0) and tokens, NaN in every unused cache
    row, fp8 with a non-unit scale (0.5), at the planned split count, one split and 200
    splits (the merge's loop over chunks of splits)."""
    b = gpu_edge_batch(EDGE_REQS, heads, cache, block_size)
    want_out, want_lse = run_decode("torch", b, 512)
    tol = tolerance(torch.bfloat16, FP8[0] if cache == "fp8" else None)
    for splits in (None, 1, 200):
        plan = plan_for(b, "triton", num_splits=splits)
        # 16 heads pack both tokens; above, the per-token kernel runs at these sizes
        # unless the packed plan needs more splits than one merge pass (the 200 here)
        packed = heads == 16 or (splits or 0) > mla_launch_plan.MERGE_BLOCK_S
        assert plan.launch.kernel == ("packed" if packed else "per_token")
        assert plan.launch.tokens == (2 if heads == 16 else 1)
        tma = mla_cache_view.use_tma(plan.launch.tma, b.kv_cache, 512, 64, plan.launch.block_n)
        fp8_pointer_loads = cache == "fp8" and heads > 16  # the default there
        assert tma is (block_size % plan.launch.block_n == 0 and not fp8_pointer_loads)
        out, lse = run_decode("triton", b, 512, plan=plan)
        T = b.meta.num_actual_tokens
        assert not out[:T].isnan().any(), f"NaN read past a mask (splits={splits})"
        torch.testing.assert_close(out, want_out, **tol)
        torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)
    other = {"packed": "per_token", "per_token": "packed"}[plan.launch.kernel]
    out, lse = run_decode("triton", b, 512, config={"kernel": other})
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


NARROW = {"BLOCK_N": 32, "num_warps": 4, "per_sm": 2}  # 16 heads, one query token
WIDE = {"BLOCK_N": 64, "num_warps": 8, "per_sm": 1}  # 16 heads, speculative tokens


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize(
    "cfg",
    [
        None,  # the default for the step's query length
        {"num_stages": 3},  # one tile ahead (the default before)
        NARROW,
        WIDE,
        {"merge_dv": 512},  # one merge program per (token, head)
    ],
)
def test_gpu_packed_variants(cfg, q_len, cache):
    """The packed kernel's launch variants at 16 heads against the reference: edges,
    NaN in unused rows, one-token rows or 2-token causal rows (the two defaults), at
    the planned split count, 1 and 200."""
    reqs = [(min(n, q_len), ctx) for n, ctx in EDGE_REQS]
    b = gpu_edge_batch(reqs, 16, cache)
    want_out, want_lse = run_decode("torch", b, 512)
    tol = tolerance(torch.bfloat16, FP8[0] if cache == "fp8" else None)
    for splits in (None, 1, 200):
        plan = plan_for(b, "triton", config=cfg, num_splits=splits)
        assert plan.launch.kernel == "packed"
        if cfg is None:
            want = WIDE if q_len > 1 else NARROW
            assert (plan.launch.block_n, plan.launch.num_warps) == (
                want["BLOCK_N"],
                want["num_warps"],
            )
        out, lse = run_decode("triton", b, 512, plan=plan)
        T = b.meta.num_actual_tokens
        assert not out[:T].isnan().any(), f"NaN read past a mask (splits={splits})"
        torch.testing.assert_close(out, want_out, **tol)
        torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_fp8_bf16_math(heads):
    """fp8 tiles through TMA widened to bf16 (the default takes fp16 at 16 heads and
    pointer loads above)."""
    b = make_mla_batch(
        EDGE_REQS,
        heads=heads,
        block_size=64,
        dtype=torch.bfloat16,
        cache_dtype=FP8[0],
        device="cuda",
        pad_rows=2,
        nan_unused=True,
        col_offset=16,
    )
    want_out, _ = run_decode("torch", b, 512)
    out, _ = run_decode("triton", b, 512, config={"fp8_math": "bf16", "tma": None})
    torch.testing.assert_close(out, want_out, **tolerance(torch.bfloat16, FP8[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_dcp_token_kv_lens(heads):
    """Decode context parallelism: per-token local row counts, multi-token rows."""
    b = make_mla_batch(
        [(1, 300), (2, 1000), (2, 70)],
        heads=heads,
        block_size=64,
        dtype=torch.bfloat16,
        device="cuda",
        nan_unused=True,
    )
    lens = torch.tensor([150, 500, 501, 0, 35], dtype=torch.int32, device="cuda")
    want_out, want_lse = run_decode("torch", b, 512, token_kv_lens=lens)
    out, lse = run_decode("triton", b, 512, token_kv_lens=lens)
    torch.testing.assert_close(out, want_out, **tolerance(torch.bfloat16))
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


def _graph_batch(rows):
    return make_mla_batch(
        rows, heads=16, block_size=64, dtype=torch.bfloat16, device="cuda", nan_unused=True
    )


def _replay_matches_the_reference(b, plan, seq_lens, next_step=lambda: None):
    """Captures `b`'s decode on `plan` in a CUDA graph, writes `seq_lens` in place (the next
    step's), runs `next_step` (its planning, if any) and replays: the output must be the
    torch reference's for the new lengths."""
    out = torch.zeros(b.q.shape[0], 16, 512, dtype=torch.bfloat16, device="cuda")

    def step():
        mla_decode_triton(b.q, b.kv_cache, b.meta, scale=0.3, output=out, plan=plan)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    b.meta.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
    next_step()
    graph.replay()
    want, _ = run_decode("torch", b, 512)
    torch.testing.assert_close(out, want, **tolerance(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_decode_replays_from_a_cuda_graph():
    """Captured once with the plan in persistent buffers and a launch fixed for the
    bucket (planned for the longest context, 96 splits), the graph replays a later
    step's plan (shorter contexts)."""
    b = _graph_batch([(1, 5000), (2, 3000), (1, 64)])
    T = b.q.shape[0]
    bufs = tuple(torch.zeros(64, dtype=torch.int32, device="cuda") for _ in range(2))
    # more splits than one merge pass: the chunked, column-split merge runs in the graph
    plan = plan_mla_decode(
        b.meta, T, 16, kernel_impl="triton", context=163840, out=bufs, num_splits=96
    )
    assert plan.launch.num_splits > mla_launch_plan.MERGE_BLOCK_S
    _replay_matches_the_reference(
        b,
        plan,
        [4000, 1500, 1],
        lambda: plan_mla_decode(b.meta, T, 16, kernel_impl="triton", out=bufs),
    )


@pytest.mark.gpu
def test_gpu_uniform_decode_replays_seq_lens_written_in_place():
    """A uniform decode's plan is views (identity rows, and the seq_lens vLLM keeps in a
    persistent buffer): the graph captured on them replays a later step whose seq_lens
    were written in place, as vLLM's runner writes them, with no plan op in between."""
    b = _graph_batch([(1, 5000), (1, 3000), (1, 64)])
    identity = torch.arange(64, dtype=torch.int32, device="cuda")
    plan = plan_mla_decode(
        b.meta, b.q.shape[0], 16, kernel_impl="triton", context=163840, identity=identity
    )
    assert plan.token_kv_len.data_ptr() == b.meta.seq_lens.data_ptr()
    assert plan.token_req.data_ptr() == identity.data_ptr()
    _replay_matches_the_reference(b, plan, [4000, 1, 64])
