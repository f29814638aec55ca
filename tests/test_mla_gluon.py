"""The Gluon warpgroup-MMA MLA decode (`gluon.lockstep`): when the plan picks it, and on the
GPU against the torch reference. Gluon kernels do not run in Triton's CPU interpreter,
so the kernel itself is tested on a Hopper GPU only (`gpu`); the choice is tested here."""

import pytest
import torch
from mla_cases import (
    EDGE_REQS,
    FP8,
    check_splits_without_keys,
    gpu_edge_batch,
    make_mla_batch,
    plan_for,
    query_in_parts,
    ramp_scores,
    run_decode,
    tolerance,
)

from atom_plugin.attention.mla import launch_plan as mla_launch_plan
from atom_plugin.attention.mla.gluon.probe import MLAStepLayout, gluon_mla_problems
from atom_plugin.attention.mla.plan import plan_mla_decode
from atom_plugin.attention.mla.triton import mla_decode_triton

BF16_64 = MLAStepLayout(torch.bfloat16, 64)
CPU = torch.device("cpu")


def test_plan_without_a_layout_keeps_to_triton():
    launch = mla_launch_plan.plan_launch(32, 32, 1, 128, 4096, CPU)
    assert launch.kernel == "per_token"
    with pytest.raises(ValueError, match="no step layout"):
        mla_launch_plan.plan_launch(32, 32, 1, 128, 4096, CPU, config={"kernel": "gluon"})


def test_gluon_refusal_names_the_device():
    problems = gluon_mla_problems(CPU, BF16_64)
    assert problems == ["device cpu (the Gluon kernel runs on CUDA GPUs)"]
    with pytest.raises(ValueError, match="device cpu"):
        mla_launch_plan.plan_launch(
            32, 32, 1, 128, 4096, CPU, config={"kernel": "gluon"}, layout=BF16_64
        )


@pytest.mark.parametrize(
    "heads, reqs, context, q_len, packed_splits, want",
    [
        (64, 32, 4096, 1, 4, "gluon"),
        (128, 1, 4096, 1, 16, "gluon"),
        (16, 32, 4096, 1, 8, "packed"),  # 16 heads, one token: the packed kernel
        (16, 128, 4096, 1, 2, "packed"),
        (16, 32, 8192, 2, 4, "gluon"),  # speculative rows fill the 64 query rows
        (16, 1, 32768, 1, 256, "gluon"),  # batch 1: more splits than one merge pass
        (16, 1, 4096, 1, 64, "per_token"),  # the smallest steps
    ],
)
def test_choice_with_gluon(heads, reqs, context, q_len, packed_splits, want):
    got = mla_launch_plan.choose_kernel(heads, reqs, context, packed_splits, True, q_len)
    assert got == want
    if want == "gluon":  # and without the Gluon kernel, the Triton choice as before
        assert mla_launch_plan.choose_kernel(heads, reqs, context, packed_splits, False, q_len) in (
            "packed",
            "per_token",
        )


@pytest.mark.parametrize(
    "fp8, heads, context, splits, want",
    [
        (False, 128, 32768, 2, "alternate"),  # 256 tiles a program
        (False, 128, 4096, 2, "alternate"),  # 32
        (False, 64, 4096, 4, "lockstep"),  # 16
        (False, 64, 32768, 128, "lockstep"),  # batch 1: 4
        (False, 16, 32768, 4, "lockstep"),  # 16 heads
        (True, 128, 32768, 2, "lockstep"),  # fp8
    ],
)
def test_gluon_schedule_rule(triton_version, fp8, heads, context, splits, want):
    triton_version((3, 7))
    assert mla_launch_plan.gluon_schedule(None, fp8, heads, context, splits) == want
    assert mla_launch_plan.gluon_schedule("lockstep", fp8, heads, context, splits) == "lockstep"
    # Triton 3.8 compiles the alternate schedule with spills in its loop: lockstep throughout,
    # unless a config names it
    triton_version((3, 8))
    assert mla_launch_plan.gluon_schedule(None, fp8, heads, context, splits) == "lockstep"
    if not fp8:
        assert mla_launch_plan.gluon_schedule("alternate", fp8, heads, context, splits) == (
            "alternate"
        )


@pytest.mark.parametrize("schedule", mla_launch_plan.SIXTEEN_BIT_SCHEDULES)
def test_gluon_warp_specialized_schedules_refuse_fp8(schedule):
    with pytest.raises(ValueError, match=f"{schedule} schedule takes 16-bit caches"):
        mla_launch_plan._config(128, True, "gluon", {"schedule": schedule})
    with pytest.raises(ValueError, match="schedule must be None"):
        mla_launch_plan._config(128, False, "gluon", {"schedule": "seesaw"})


def test_gluon_config_keys():
    with pytest.raises(ValueError, match=r"unknown gluon MLA decode config keys \['BLOCK_N'\]"):
        mla_launch_plan._config(128, False, "gluon", {"BLOCK_N": 32})


# rows16 compiles from Triton 3.7 (the plan refuses it below; tested on CPU)
NEEDS_ROWS16_TRITON = pytest.mark.skipif(
    bool(mla_launch_plan.rows16_problems(None)), reason="the rows16 schedule needs Triton 3.7"
)
GLUON_PATHS = [  # (cache, schedule): alternate and scorer take 16-bit caches, rows16 fp8 ones
    ("bf16", "lockstep"),
    ("bf16", "alternate"),
    ("bf16", "scorer"),
    ("fp8", "lockstep"),
    pytest.param("fp8", "rows16", marks=NEEDS_ROWS16_TRITON),
]


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("cache, schedule", GLUON_PATHS)
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_gpu_gluon_decode_edges(heads, cache, q_len, schedule):
    """Contexts 1, page - 1, page, page + 1 and long, shuffled tables, padding rows and
    tokens, NaN in every unused cache row (a dropped mask turns the output NaN), fp8
    with scale 0.5, 2-token causal rows; at the planned split count, 1 and 200."""
    reqs = [(min(n, q_len), ctx) for n, ctx in EDGE_REQS]
    b = gpu_edge_batch(reqs, heads, cache)
    want_out, want_lse = run_decode("torch", b, 512)
    tol = tolerance(torch.bfloat16, FP8[0] if cache == "fp8" else None)
    config = {"kernel": "gluon", "schedule": schedule}
    for splits in (None, 1, 200):
        plan = plan_for(b, "triton", config=config, num_splits=splits, layout=BF16_64)
        assert (plan.launch.kernel, plan.launch.schedule) == ("gluon", schedule)
        out, lse = run_decode("triton", b, 512, plan=plan)
        T = b.meta.num_actual_tokens
        assert not out[:T].isnan().any(), f"NaN read past a mask (splits={splits})"
        # every row is written, a padding token's with zeros (its output was the sentinel)
        assert (out[T:] == 0).all() and (lse[T:] == float("-inf")).all()
        torch.testing.assert_close(out, want_out, **tol)
        torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


# (query tokens, context) and how fast its scores move (log2 units a 64-key tile): past the
# rescale threshold every tile, below it (so the running max lags and then moves), and
# falling (the first tile holds the max)
RAMP_REQS = [(1, 2051), (1, 1500), (1, 700), (2, 777)]
RAMP_SLOPES = [12.0, 3.0, -10.0, 20.0]


@pytest.mark.gpu
@pytest.mark.parametrize("cache, schedule", GLUON_PATHS)
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_gluon_decode_running_max(heads, cache, schedule):
    """Scores that grow by hundreds of log2 units over a context, lag their running max
    or fall after the first tile: every Gluon schedule matches the reference at the
    plan's split count and at one split (every tile in one program). The rows16
    schedule moves its running max only when a row outgrows it by more than a factor
    2^8 (`rows16.RESCALE_LOG2`); a row whose max it never moved would take exp2 of
    scores past fp16's range."""
    b = gpu_edge_batch(RAMP_REQS, heads, cache)
    ramp_scores(b, RAMP_SLOPES)
    want_out, want_lse = run_decode("torch", b, 512)
    assert want_lse[: b.meta.num_actual_tokens].isfinite().all()
    tol = tolerance(torch.bfloat16, FP8[0] if cache == "fp8" else None)
    config = {"kernel": "gluon", "schedule": schedule}
    for splits in (None, 1):
        plan = plan_for(b, "triton", config=config, num_splits=splits, layout=BF16_64)
        assert (plan.launch.kernel, plan.launch.schedule) == ("gluon", schedule)
        out, lse = run_decode("triton", b, 512, plan=plan)
        torch.testing.assert_close(out, want_out, **tol)
        torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.gpu
def test_gpu_gluon_fp16():
    """A float16 model: query and cache in fp16 run fp16 matmuls."""
    b = make_mla_batch(
        EDGE_REQS,
        heads=64,
        block_size=64,
        dtype=torch.float16,
        device="cuda",
        pad_rows=2,
        nan_unused=True,
    )
    want_out, want_lse = run_decode("torch", b, 512)
    layout = MLAStepLayout(torch.float16, 64)
    plan = plan_mla_decode(b.meta, b.q.shape[0], 64, kernel_impl="triton", layout=layout)
    assert plan.launch.kernel == "gluon"
    out, lse = run_decode("triton", b, 512, plan=plan)
    torch.testing.assert_close(out, want_out, **tolerance(torch.float16))
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.gpu
def test_gpu_gluon_not_chosen_for_16_key_pages():
    """A 16-row page cannot feed 64-key TMA tiles: the plan keeps the Triton kernels and
    says why; naming the kernel is refused with the same reason."""
    layout = MLAStepLayout(torch.bfloat16, 16)
    problems = gluon_mla_problems(torch.device("cuda"), layout)
    assert any("block size 16" in p for p in problems), problems
    b = gpu_edge_batch(EDGE_REQS, 128, "bf16", block_size=16)
    plan = plan_for(b, "triton", layout=layout)
    assert plan.launch.kernel == "per_token"
    with pytest.raises(ValueError, match="block size 16"):
        plan_mla_decode(
            b.meta,
            b.q.shape[0],
            128,
            kernel_impl="triton",
            layout=layout,
            config={"kernel": "gluon"},
        )


@pytest.mark.gpu
def test_gpu_gluon_dcp_token_kv_lens():
    """Decode context parallelism: per-token local row counts, multi-token rows."""
    b = make_mla_batch(
        [(1, 300), (2, 1000), (2, 70)],
        heads=128,
        block_size=64,
        dtype=torch.bfloat16,
        device="cuda",
        nan_unused=True,
    )
    lens = torch.tensor([150, 500, 501, 0, 35], dtype=torch.int32, device="cuda")
    ref_plan = plan_mla_decode(b.meta, b.q.shape[0], 128, kernel_impl="torch", token_kv_lens=lens)
    want_out, want_lse = run_decode("torch", b, 512, plan=ref_plan)
    plan = plan_mla_decode(
        b.meta, b.q.shape[0], 128, kernel_impl="triton", token_kv_lens=lens, layout=BF16_64
    )
    assert plan.launch.kernel == "gluon"
    out, lse = run_decode("triton", b, 512, plan=plan)
    torch.testing.assert_close(out, want_out, **tolerance(torch.bfloat16))
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize(
    "config",
    [
        {"kernel": "packed"},
        {"kernel": "per_token"},
        {"kernel": "gluon", "schedule": "lockstep"},
        {"kernel": "gluon", "schedule": "alternate"},
        {"kernel": "gluon", "schedule": "scorer"},
        pytest.param({"kernel": "gluon", "schedule": "rows16"}, marks=NEEDS_ROWS16_TRITON),
    ],
    ids=["packed", "per_token", "lockstep", "alternate", "scorer", "rows16"],
)
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_decode_takes_the_query_in_parts(heads, config, cache):
    """As vLLM hands the query (its latent part apart from a strided view of its rope
    part), every stage-1 kernel gives exactly what it gives for the joined query."""
    if cache == "fp8" and config.get("schedule") in mla_launch_plan.SIXTEEN_BIT_SCHEDULES:
        pytest.skip(f"the {config['schedule']} schedule takes 16-bit caches only")
    if cache == "bf16" and config.get("schedule") == "rows16":
        pytest.skip("the rows16 schedule takes fp8 caches only")
    b = gpu_edge_batch([(2, 777), (1, 65), (1, 2051)], heads, cache)
    plan = plan_for(b, "triton", config=config, layout=BF16_64)
    assert plan.launch.kernel == config["kernel"]
    whole, whole_lse = run_decode("triton", b, 512, plan=plan)
    out = torch.full_like(whole, 7.0)
    parts = query_in_parts(b.q, 512)
    lse = mla_decode_triton(
        parts, b.kv_cache, b.meta, plan, scale=0.3, output=out, kv_scale=b.kv_scale
    )
    assert torch.equal(out, whole) and torch.equal(lse, whole_lse)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cache, config",
    [
        ("bf16", {"kernel": "per_token"}),
        ("fp8", {"kernel": "packed"}),
        ("bf16", {"kernel": "gluon", "schedule": "lockstep"}),
        ("fp8", {"kernel": "gluon", "schedule": "lockstep"}),
        ("bf16", {"kernel": "gluon", "schedule": "alternate"}),
        ("bf16", {"kernel": "gluon", "schedule": "scorer"}),
        pytest.param("fp8", {"kernel": "gluon", "schedule": "rows16"}, marks=NEEDS_ROWS16_TRITON),
    ],
)
def test_gpu_splits_without_keys_are_neither_written_nor_read(nan_partials, cache, config):
    """256 splits over contexts of 1 to 700 keys (as a graph planned for a long context
    replays short ones): the splits past a row's keys leave their partials as they were
    (NaN here), and the merge, which does not read them, matches the reference."""
    b = gpu_edge_batch([(1, 700), (1, 1), (1, 65)], 16, cache)
    want_out, want_lse = run_decode("torch", b, 512)
    plan = plan_for(b, "triton", config=config, num_splits=256, layout=BF16_64)
    out, lse = run_decode("triton", b, 512, plan=plan)
    tol = tolerance(torch.bfloat16, FP8[0] if cache == "fp8" else None)
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)
    check_splits_without_keys(nan_partials, b.meta.num_actual_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("cache, schedule", GLUON_PATHS)
def test_gpu_gluon_replays_from_a_cuda_graph(cache, schedule):
    """Captured with the plan in persistent buffers and a launch planned for the
    longest context (96 splits: the chunked merge too), the graph replays a later step
    with shorter contexts."""
    b = gpu_edge_batch([(1, 5000), (2, 3000), (1, 64)], 64, cache)
    T = b.q.shape[0]
    bufs = tuple(torch.zeros(64, dtype=torch.int32, device="cuda") for _ in range(2))
    plan = plan_mla_decode(
        b.meta,
        T,
        64,
        kernel_impl="triton",
        context=163840,
        out=bufs,
        num_splits=96,
        kv_dtype=b.kv_cache.dtype,
        layout=BF16_64,
        config={"kernel": "gluon", "schedule": schedule},
    )
    assert (plan.launch.kernel, plan.launch.schedule) == ("gluon", schedule)
    out = torch.zeros(T, 64, 512, dtype=torch.bfloat16, device="cuda")

    def step():
        mla_decode_triton(b.q, b.kv_cache, b.meta, plan, scale=0.3, output=out, kv_scale=b.kv_scale)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    b.meta.seq_lens[:3].copy_(torch.tensor([4000, 1500, 1], dtype=torch.int32))
    plan_mla_decode(b.meta, T, 64, kernel_impl="triton", out=bufs)  # the next step's plan
    graph.replay()
    want, _ = run_decode("torch", b, 512)
    T = b.meta.num_actual_tokens
    torch.testing.assert_close(
        out[:T], want[:T], **tolerance(torch.bfloat16, FP8[0] if cache == "fp8" else None)
    )
