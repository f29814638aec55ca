"""The Gluon Hopper prefill: its gate and cache views on the CPU, its output against the
torch reference on a Hopper GPU (`gpu`)."""

import functools
from types import SimpleNamespace

import pytest
import torch
from attention_cases import make_batch, tolerance
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_plugin.attention.kept import KeptPerCache
from atom_plugin.attention.mha import reference
from atom_plugin.attention.mha.gluon_prefill_launch import (
    cache_rows,
    gluon_prefill,
    gluon_prefill_problems,
)
from atom_plugin.attention.mha.params import AttentionParams

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rows_hold_the_cache(cache: torch.Tensor) -> None:
    """Every key's row of the view holds that key's head vector."""
    rows = cache_rows(cache)
    blocks, page, hkv, d = cache.shape
    b, off, h = torch.meshgrid(
        torch.arange(blocks), torch.arange(page), torch.arange(hkv), indexing="ij"
    )
    row = b * rows.rows_per_block + h * rows.rows_per_head + off
    col = (h * rows.cols_per_head)[..., None] + torch.arange(d)
    got = rows.view[row[..., None].expand_as(col), col]
    assert torch.equal(got, cache)


def test_plugin_layout_is_a_page_of_rows_per_head():
    raw = torch.randn(5, 3, 16, 2 * 64)  # the plugin's [blocks, kv heads, page, K|V]
    key_cache, value_cache = raw.transpose(1, 2).split(64, dim=-1)
    rows = cache_rows(key_cache)
    assert (rows.rows_per_block, rows.rows_per_head, rows.cols_per_head) == (48, 16, 0)
    _rows_hold_the_cache(key_cache)
    _rows_hold_the_cache(value_cache)


def test_vllm_layout_is_a_row_of_heads_per_key():
    cache = torch.randn(5, 16, 3, 64)  # [blocks, page, kv heads, D]
    rows = cache_rows(cache)
    assert (rows.rows_per_block, rows.rows_per_head, rows.cols_per_head) == (16, 0, 64)
    _rows_hold_the_cache(cache)


def test_a_cache_without_contiguous_head_vectors_is_named():
    cache = torch.randn(5, 16, 3, 64).transpose(2, 3).contiguous().transpose(2, 3)
    assert "not rows of one 2-d view" in cache_rows(cache)


def test_problems_name_each_reason():
    b = make_batch([(40, 40)], hq=6, hkv=2, d=96, block_size=4)
    params = AttentionParams(scale=0.1, sliding_window=8, sinks=torch.zeros(6))
    text = "; ".join(gluon_prefill_problems(b.query, b.key_cache, b.value_cache, params))
    for part in (
        "device cpu",
        "torch.float32",
        "head size 96",
        "query heads per kv head 3",
        "block size 4",
        "sliding window",
        "attention sinks",
    ):
        assert part in text


GPU_CASES = [
    # hq, hkv, d, block_size, cache layout
    (32, 8, 128, 16, "plugin"),
    (64, 8, 128, 16, "plugin"),
    (32, 8, 64, 16, "plugin"),
    (32, 4, 128, 64, "plugin"),
    (16, 16, 128, 16, "plugin"),
    (32, 8, 128, 256, "plugin"),
    (32, 8, 128, 16, "vllm"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (capability 9.0)")
@pytest.mark.parametrize("kv_major", [False, True], ids=["qblock-major", "kv-major"])
@pytest.mark.parametrize("hq,hkv,d,block_size,layout", GPU_CASES)
def test_gpu_prefill_matches_the_reference(hq, hkv, d, block_size, layout, kv_major, monkeypatch):
    """Decode rows first (left alone), then fresh and chunked prefills whose lengths fall
    on and beside the 128-row blocks and 128-key tiles; in either grid order."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl

    monkeypatch.setattr(gpl, "KV_MAJOR_WAVES", 10**6 if kv_major else 0)
    reqs = [(1, 300), (1, 77), (1000, 1000), (517, 4100), (128, 128), (129, 2000), (3000, 3000)]
    b = make_batch(reqs, hq=hq, hkv=hkv, d=d, block_size=block_size, dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip
    prefills = b.meta.num_reqs - b.meta.num_decodes
    sms = gpl._sm_count(b.query.device)
    grid = gpl.prefill_grid(b.meta.max_query_len, hkv, prefills, d, hq // hkv, sms)
    assert grid.kv_major is kv_major
    kc, vc = b.key_cache, b.value_cache
    if layout == "vllm":
        kc, vc = kc.contiguous(), vc.contiguous()
    params = AttentionParams(scale=d**-0.5 * 4)  # peaked: a dropped key would show
    assert gluon_prefill_problems(b.query, kc, vc, params) == []
    want = torch.zeros_like(b.query)
    reference.paged_attention(b.query, kc, vc, b.meta, params, want)
    got = torch.full_like(b.query, 3.0)
    counters = gpl.work_counters(b.query.device)
    gluon_prefill(b.query, kc, vc, b.meta, params, got, b.meta.num_decodes, counters)
    first = b.meta.num_decodes  # decode tokens: one each
    torch.testing.assert_close(
        got[first:].float(), want[first:].float(), **tolerance(torch.bfloat16)
    )
    assert torch.all(got[:first] == 3.0), "the decode rows were written"
    # shorter requests' blocks past their rows were drawn and skipped: every ticket drawn
    assert counters.for_current_stream().tolist() == [0]


def _gpu_case(reqs, seed=0):
    """A 32/8/128 bf16 batch on the GPU, its peaked attention's scale, and the reference
    output."""
    b = make_batch(reqs, hq=32, hkv=8, d=128, block_size=16, dtype=torch.bfloat16,
                   device="cuda", seed=seed)  # fmt: skip
    params = AttentionParams(scale=128**-0.5 * 4)
    want = torch.zeros_like(b.query)
    reference.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, params, want)
    return b, params, want


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (capability 9.0)")
@pytest.mark.parametrize(
    "reqs", [[(100, 100)], [(3000, 3000), (700, 2500)]], ids=["fewer-items-than-sms", "more"]
)
def test_gpu_prefill_launches_back_to_back_each_find_the_work_counter_at_zero(reqs):
    """The programs take their items from the stream's work counter, and the program that
    draws a launch's last ticket sets it back to zero: launches in a row each take every
    item."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl

    b, params, want = _gpu_case(reqs)
    counters = gpl.work_counters(b.query.device)
    for _ in range(3):
        got = torch.full_like(b.query, 3.0)
        gluon_prefill(b.query, b.key_cache, b.value_cache, b.meta, params, got, 0, counters)
        torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.bfloat16))
        assert counters.for_current_stream().tolist() == [0]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (capability 9.0)")
def test_gpu_prefills_on_two_streams_at_once_each_draw_from_their_streams_counter():
    """Two-batch overlap may run two micro-batches' prefills at once, each on a stream of
    its own: launches issued on two streams in turn, never waiting on each other, each
    take all their own items (a shared counter would hand one launch's items to the
    other and leave rows unwritten)."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl

    cases = [
        _gpu_case(reqs, seed)
        for seed, reqs in enumerate([[(3000, 3000), (700, 2500)], [(2048, 4096)] * 3])
    ]
    batches, params, wants = [c[0] for c in cases], cases[0][1], [c[2] for c in cases]
    counters = gpl.work_counters(batches[0].query.device)
    streams = [torch.cuda.Stream() for _ in batches]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    gots = [[] for _ in batches]  # each round's output, made on its stream
    for _ in range(4):
        for s, b, outs in zip(streams, batches, gots, strict=True):
            with torch.cuda.stream(s):
                outs.append(torch.full_like(b.query, 3.0))
                gluon_prefill(b.query, b.key_cache, b.value_cache, b.meta, params, outs[-1], 0,
                              counters)  # fmt: skip
    torch.cuda.synchronize()
    for s, outs, want in zip(streams, gots, wants, strict=True):
        for got in outs:
            torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.bfloat16))
        with torch.cuda.stream(s):
            assert counters.for_current_stream().tolist() == [0]
    slots = set()
    for s in streams:
        with torch.cuda.stream(s):
            slots.add(counters.for_current_stream().data_ptr())
    assert len(slots) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (capability 9.0)")
def test_gpu_prefill_captured_in_a_cuda_graph_replays_with_its_streams_counter():
    """A capture takes its stream's slot, already zero and never allocated under the
    capture; each replay takes every item and leaves the counter at zero, and eager
    launches on the current stream, between replays, keep their own."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl

    reqs = [(3000, 3000), (700, 2500), (40, 40)]
    b, params, want = _gpu_case(reqs)
    counters = gpl.work_counters(b.query.device)
    got = torch.full_like(b.query, 3.0)
    args = (b.query, b.key_cache, b.value_cache, b.meta, params, got, 0, counters)
    call = functools.partial(gluon_prefill, *args)
    call()  # compiled before the capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        call()
    for _ in range(3):
        got.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.bfloat16))
        with torch.cuda.stream(stream):
            assert counters.for_current_stream().tolist() == [0]
        call()  # eager, on the current stream's slot
        assert counters.for_current_stream().tolist() == [0]


def test_work_counters_are_a_slot_a_stream_and_refuse_a_graph_capture(monkeypatch):
    """Each stream keeps one slot of the buffer (a view, nothing allocated at a launch);
    more streams than slots, or counters made while a graph captures, are errors."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl

    stream = SimpleNamespace(cuda_stream=0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(gpl, "STREAM_SLOTS", 3)
    counters = gpl.WorkCounters(torch.device("cpu"))
    views = []
    for handle in (11, 22, 11, 33):
        stream.cuda_stream = handle
        views.append(counters.for_current_stream())
    assert [v.data_ptr() for v in views].count(views[0].data_ptr()) == 2  # 11 twice
    assert len({v.data_ptr() for v in views}) == 3
    assert all(v.shape == (1,) and v.dtype == torch.int32 for v in views)
    assert all(v.data_ptr() % 32 == 0 for v in views)  # a sector each, aligned alike
    stream.cuda_stream = 44
    with pytest.raises(RuntimeError, match="more than 3 CUDA streams"):
        counters.for_current_stream()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="during a CUDA graph capture"):
        gpl.WorkCounters(torch.device("cuda"))


def test_a_layers_cache_descriptors_are_made_once_and_the_oldest_let_go(monkeypatch):
    """Each call hands new views of a layer's caches (as vLLM's backend splits its
    tensor): the descriptors made at the first launch over that memory serve them; with
    more caches than are kept, the oldest is dropped and made again when it comes back."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from atom_plugin.attention import gluon_common
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl

    made = []
    real = gluon_common.tma_descriptor
    monkeypatch.setattr(gluon_common, "tma_descriptor", lambda *a: made.append(a) or real(*a))
    monkeypatch.setattr(gpl, "_KEPT", KeptPerCache(limit=2))
    raws = [torch.zeros(4, 2, 16, 2 * 64, dtype=torch.bfloat16) for _ in range(3)]

    def views(raw):  # the plugin's layout, split afresh as at every call
        return raw.transpose(1, 2).split(64, dim=-1)

    first = gpl.cache_descriptors(*views(raws[0]), 16)
    assert gpl.cache_descriptors(*views(raws[0]), 16) is first
    assert len(made) == 2  # K and V, once
    assert first.key.base.data_ptr() == raws[0].data_ptr()
    assert first.value.base.data_ptr() == raws[0].data_ptr() + 64 * 2
    assert gpl.cache_descriptors(*views(raws[0]), 8) is not first  # another box
    assert gpl.cache_descriptors(*views(raws[1]), 16) is not first
    assert len(made) == 6 and len(gpl._KEPT) == 2
    again = gpl.cache_descriptors(*views(raws[0]), 16)  # dropped for raws[1]: made again
    assert again is not first and len(made) == 8
    key, _ = views(raws[2])
    with pytest.raises(ValueError, match="laid out differently"):
        gpl.cache_descriptors(key, torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), 16)


def test_work_counters_name_the_current_device_one_way(monkeypatch):
    """The current device named plainly ("cuda") or with its index gets one set of
    counters (a second set, made lazily, could come under a graph capture)."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(gpl, "_work_counters", functools.cache(lambda device: object()))
    plain, indexed = (
        gpl.work_counters(torch.device("cuda")),
        gpl.work_counters(torch.device("cuda:0")),
    )
    assert plain is indexed
    assert gpl.work_counters(torch.device("cuda:1")) is not plain


def test_the_builder_makes_the_counters_before_a_capture_and_the_plans_reuse_them(monkeypatch):
    """`prepare_mha_plans` (the metadata builder's start) makes the device's counters;
    every later plan with prefills carries those, so a plan made while a graph captures
    allocates nothing."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl
    from atom_plugin.attention.mha.planner import plan_for_caches, prepare_mha_plans

    made = []
    monkeypatch.setattr(gpl, "device_takes_gluon_prefill", lambda device: True)
    monkeypatch.setattr(gpl, "work_counters", functools.cache(lambda d: made.append(d) or d))
    cpu = torch.device("cpu")
    prepare_mha_plans(cpu, "torch")
    assert made == []
    prepare_mha_plans(cpu, "triton")
    assert made == [cpu]
    mixed = make_batch([(1, 50), (40, 40)], hq=4, hkv=2, d=64, block_size=16)
    assert plan_for_caches(mixed.meta, mixed.key_cache, "triton").gluon_counters == cpu
    assert made == [cpu]


def test_the_plan_takes_the_gluon_prefill_where_the_device_does_and_prefills_run(monkeypatch):
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl
    from atom_plugin.attention.mha.planner import plan_for_caches

    mixed = make_batch([(1, 50), (40, 40)], hq=4, hkv=2, d=64, block_size=16)
    decodes = make_batch([(1, 50), (1, 9)], hq=4, hkv=2, d=64, block_size=16)
    assert plan_for_caches(mixed.meta, mixed.key_cache, "triton").gluon_counters is None  # CPU
    monkeypatch.setattr(gpl, "device_takes_gluon_prefill", lambda device: True)
    counters = plan_for_caches(mixed.meta, mixed.key_cache, "triton").gluon_counters
    assert counters is gpl.work_counters(mixed.key_cache.device)
    assert plan_for_caches(decodes.meta, decodes.key_cache, "triton").gluon_counters is None


@settings(max_examples=200, deadline=None)
@given(
    max_query_len=st.integers(1, 40_000),
    hkv=st.sampled_from([1, 2, 4, 8, 16]),
    num_reqs=st.integers(1, 64),
    d=st.sampled_from([64, 128]),
    group=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
    sm_count=st.sampled_from([78, 114, 132]),
)
def test_prefill_grid_covers_every_query_block_in_the_order_its_size_asks(
    max_query_len, hkv, num_reqs, d, group, sm_count
):
    """Three warpgroups (192 rows) at head size 64, two (128) at 128; the work items cover
    the longest request's rows for every kv head and request, at most one program an SM
    takes them, kv-head-major exactly when they are at most KV_MAJOR_WAVES rounds."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl

    grid = gpl.prefill_grid(max_query_len, hkv, num_reqs, d, group, sm_count)
    assert grid.warpgroups == (3 if d == 64 else 2)
    tokens_per_item = 64 * grid.warpgroups // group
    qblocks = grid.qblocks
    assert (qblocks - 1) * tokens_per_item < max_query_len <= qblocks * tokens_per_item
    assert grid.items == qblocks * hkv * num_reqs
    assert grid.programs == min(grid.items, sm_count)
    assert grid.kv_major == (grid.items <= gpl.KV_MAJOR_WAVES * sm_count)


def test_a_layer_the_gluon_kernel_does_not_take_runs_the_triton_prefill_logged_once(
    monkeypatch, caplog
):
    """A plan that takes the Gluon prefill, a layer that does not fit it (head size 16, on
    any device): the ops run the Triton prefill, and the reason is logged once per layer
    shape."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl
    from atom_plugin.attention.mha import ops
    from atom_plugin.attention.mha.plan import TritonPlan

    monkeypatch.setattr(gpl, "_LAYER_FITS", {})
    params = AttentionParams(scale=0.3)
    shapes = [dict(hq=4, hkv=2, d=16), dict(hq=4, hkv=2, d=16), dict(hq=4, hkv=1, d=16)]
    with caplog.at_level("INFO", logger=gpl.__name__):
        for shape in shapes:
            b = make_batch([(1, 20), (9, 30)], block_size=16, device=DEV, **shape)
            counters = gpl.work_counters(b.query.device)
            b.meta.plan = TritonPlan(num_splits=2, gluon_counters=counters)
            want = torch.zeros_like(b.query)
            reference.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, params, want)
            got = torch.zeros_like(b.query)
            ops.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, params, got)
            torch.testing.assert_close(got, want, **tolerance(torch.float32))
    lines = [r.getMessage() for r in caplog.records if r.name == gpl.__name__]
    assert len(lines) == 2, lines  # the second call's layer shape was logged by the first
    for line, kv_heads in zip(lines, (2, 1), strict=True):
        assert line.startswith(f"MHA prefill: the Triton kernel (4 q / {kv_heads} kv heads")
        assert "head size 16 (takes (64, 128))" in line


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (capability 9.0)")
@pytest.mark.parametrize("window", [None, 256])
def test_gpu_ops_route_the_prefill_by_the_plan_and_the_layer(window, monkeypatch, caplog):
    """ops.paged_attention on a Hopper GPU: the plan takes the Gluon prefill, a layer it
    fits runs it and a windowed layer runs the Triton kernel, each logged once."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl
    from atom_plugin.attention.mha import ops
    from atom_plugin.attention.mha.planner import plan_for_caches

    monkeypatch.setattr(gpl, "_LAYER_FITS", {})
    reqs = [(1, 900), (700, 700), (300, 2100)]
    b = make_batch(reqs, hq=32, hkv=8, d=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    b.meta.plan = plan_for_caches(b.meta, b.key_cache)
    assert b.meta.plan.gluon_counters is gpl.work_counters(b.query.device)
    params = AttentionParams(scale=0.3, sliding_window=window)
    want = torch.zeros_like(b.query)
    reference.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, params, want)
    with caplog.at_level("INFO", logger=gpl.__name__):
        for _ in range(2):
            got = torch.zeros_like(b.query)
            ops.paged_attention(b.query, b.key_cache, b.value_cache, b.meta, params, got)
            torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.bfloat16))
    lines = [r.getMessage() for r in caplog.records if r.name == gpl.__name__]
    assert len(lines) == 1, lines
    if window is None:
        assert lines[0].startswith("MHA prefill: the Gluon Hopper kernel")
    else:
        assert (
            lines[0].startswith("MHA prefill: the Triton kernel") and "sliding window" in lines[0]
        )
