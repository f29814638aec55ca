"""The MLA decode's per-step plan: the token plan (`mla_token_plan`: which request each
query token belongs to and how many cached keys it sees) against the definition token by
token, the typed plan per kernel path (`plan_mla_decode`), and the per-layer decode
running on a plan without choosing the path again."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mla_cases import make_mla_batch, tolerance
from torch.profiler import ProfilerActivity, profile

from atom_plugin.attention import select
from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mla import ops as mla_ops
from atom_plugin.attention.mla.plan import (
    TorchMLAPlan,
    TritonMLAPlan,
    host_token_rows,
    mla_token_plan,
    plan_mla_decode,
)
from atom_plugin.attention.mla.reference import mla_decode_reference


def _meta(rows: list[tuple[int, int]]) -> PagedAttentionMetadata:
    """rows: (query tokens, seq_len) per request; seq_len 0 is an inert padding row."""
    q_lens = [q for q, _ in rows]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = len(rows)
    return PagedAttentionMetadata(
        num_reqs=n,
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(q_lens),
        max_seq_len=max(s for _, s in rows),
        num_decodes=n if max(q_lens) <= 1 else 0,
        num_decode_tokens=int(qsl[-1]) if max(q_lens) <= 1 else 0,
        query_start_loc=qsl,
        seq_lens=torch.tensor([s for _, s in rows], dtype=torch.int32),
        block_table=torch.zeros(n, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
    )


def _definition(rows, num_tokens):
    """Token j of a request with q query tokens and s cached keys sees s - q + j + 1 of
    them (causal); tokens past the requests and inert rows see none."""
    req, kv = [], []
    for r, (q, s) in enumerate(rows):
        for j in range(q):
            req.append(r)
            kv.append(max(0, s - q + j + 1) if s > 0 else 0)
    pad = num_tokens - len(req)
    return req + [-1] * pad, kv + [0] * pad


_row = st.integers(1, 4).flatmap(
    lambda q: st.tuples(st.just(q), st.one_of(st.just(0), st.integers(q, 300)))
)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(_row, min_size=1, max_size=9), pad_tokens=st.integers(0, 3))
def test_token_plan_matches_the_definition(rows, pad_tokens):
    num_tokens = sum(q for q, _ in rows) + pad_tokens
    req, kv_len = mla_token_plan(_meta(rows), num_tokens)
    assert (req.dtype, kv_len.dtype) == (torch.int32, torch.int32)
    assert (req.tolist(), kv_len.tolist()) == _definition(rows, num_tokens)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(_row, min_size=1, max_size=9), pad_tokens=st.integers(0, 3), into=st.booleans()
)
def test_token_plan_from_the_hosts_offsets_matches_the_definition(rows, pad_tokens, into):
    num_tokens = sum(q for q, _ in rows) + pad_tokens
    meta = _meta(rows)
    bufs = tuple(torch.full((num_tokens + 2,), 99, dtype=torch.int32) for _ in range(2))
    req, kv_len = mla_token_plan(
        meta, num_tokens, out=bufs if into else None, query_start_loc_cpu=meta.query_start_loc
    )
    assert (req.dtype, kv_len.dtype) == (torch.int32, torch.int32)
    assert (req.tolist(), kv_len.tolist()) == _definition(rows, num_tokens)
    if into:
        assert req.data_ptr() == bufs[0].data_ptr() and kv_len.data_ptr() == bufs[1].data_ptr()
        assert bufs[0][num_tokens:].tolist() == [99, 99]


def test_host_token_rows_cover_only_the_requests_tokens():
    """Offsets that start past 0 and tokens past the last request: those tokens belong
    to no request and see no keys whatever row they read."""
    rows = host_token_rows(np.array([2, 3, 5, 5, 9]), 11)
    assert rows[0].tolist() == [-1, -1, 0, 1, 1, 3, 3, 3, 3, -1, -1]
    assert rows[1].tolist() == [0, 0, 0, 1, 1, 3, 3, 3, 3, 0, 0]
    assert rows[2].tolist()[2:9] == [0, 1, 0, 3, 2, 1, 0]
    assert min(rows[2][[0, 1, 9, 10]]) > 1 << 29


def test_a_step_with_prefill_rows_plans_from_the_host_in_a_few_device_ops():
    """Prefill and speculative rows: the request rows and unseen-key counts come from
    the host's offsets, so the device runs a copy, a gather, a subtraction and a clamp
    instead of the search and its thirty-odd small ops (each a kernel launch on a GPU)."""
    mixed = _meta([(1, 40), (16, 80), (2, 9)])
    bufs = tuple(torch.zeros(32, dtype=torch.int32) for _ in range(2))
    host = _ops(
        lambda: mla_token_plan(mixed, 19, out=bufs, query_start_loc_cpu=mixed.query_start_loc)
    )
    device = _ops(lambda: mla_token_plan(mixed, 19, out=bufs))
    assert "aten::searchsorted" in device and "aten::searchsorted" not in host
    assert "aten::index_select" in host
    # views and the host-side wrapping of numpy's rows launch nothing on a device
    views = {"slice", "select", "to", "detach", "resolve_conj", "resolve_neg", "lift_fresh"}
    kernels = [op for op in host if op.removeprefix("aten::") not in views]
    assert kernels == ["aten::index_select", "aten::copy_", "aten::sub", "aten::clamp_"], host
    assert len([op for op in device if op.removeprefix("aten::") not in views]) > 20


@pytest.mark.gpu
def test_steps_planned_from_the_host_back_to_back_on_the_gpu_keep_their_own_rows():
    """Each step's host rows travel in a pinned tensor copied without waiting: steps
    queued back to back, the host running ahead, each keeps its own rows (no step's copy
    reads the next step's rows)."""
    import random

    rng = random.Random(0)
    bufs = tuple(torch.zeros(4096, dtype=torch.int32, device="cuda") for _ in range(2))
    steps, got = [], []
    torch.cuda._sleep(200_000_000)  # the GPU busy, so the copies below wait in line
    for _ in range(40):
        rows = [(rng.randint(1, 24), rng.randint(30, 4000)) for _ in range(rng.randint(1, 12))]
        meta = _meta(rows)
        cuda = dataclasses.replace(
            meta,
            query_start_loc=meta.query_start_loc.cuda(),
            seq_lens=meta.seq_lens.cuda(),
            block_table=meta.block_table.cuda(),
            slot_mapping=meta.slot_mapping.cuda(),
        )
        n = meta.num_actual_tokens
        req, kv = mla_token_plan(cuda, n, out=bufs, query_start_loc_cpu=meta.query_start_loc)
        got.append((req.clone(), kv.clone()))  # before the next step rewrites the buffers
        steps.append((rows, n))
    torch.cuda.synchronize()
    for (rows, n), (req, kv) in zip(steps, got, strict=True):
        assert (req.tolist(), kv.tolist()) == _definition(rows, n)


@settings(max_examples=100, deadline=None)
@given(seq_lens=st.lists(st.one_of(st.just(0), st.integers(1, 5000)), min_size=1, max_size=64))
def test_uniform_decode_step_matches_the_definition(seq_lens):
    rows = [(1, s) for s in seq_lens]
    req, kv_len = mla_token_plan(_meta(rows), len(rows))
    assert (req.tolist(), kv_len.tolist()) == _definition(rows, len(rows))


def _ops(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.cpu_parent is None]


def test_uniform_decode_step_takes_the_short_path():
    """A decode step of single-token requests (every step of a decode-only batch) plans
    with an arange and the step's seq_lens, not the general search: each op is a kernel
    launch with its host cost, on every step."""
    uniform = _meta([(1, 40), (1, 0), (1, 7)])
    mixed = _meta([(1, 40), (2, 9)])
    short = _ops(lambda: mla_token_plan(uniform, 3))
    general = _ops(lambda: mla_token_plan(mixed, 3))
    assert "aten::searchsorted" in general and "aten::searchsorted" not in short
    assert len(short) <= 4 < len(general), (short, general)


def test_uniform_decode_step_writes_its_buffers_in_place():
    """With the builder's persistent buffers a decode step's token plan is one arange
    and one copy into them: no temporaries, no copies of copies."""
    uniform = _meta([(1, 40), (1, 0), (1, 7)])
    bufs = (torch.full((8,), 99, dtype=torch.int32), torch.full((8,), 99, dtype=torch.int32))
    ops = _ops(lambda: plan_mla_decode(uniform, 3, 16, kernel_impl="torch", out=bufs))
    assert [op for op in ops if op != "aten::slice"] == ["aten::arange", "aten::copy_"], ops
    assert bufs[0].tolist() == [0, 1, 2, *[99] * 5] and bufs[1].tolist()[:4] == [40, 0, 7, 99]


def test_uniform_decode_step_with_identity_rows_runs_no_op():
    """With the planner's identity rows a decode step's token plan is two views: the
    rows, and vLLM's seq_lens itself (persistent, as a captured graph needs)."""
    uniform = _meta([(1, 40), (1, 0), (1, 7)])
    identity = torch.arange(8, dtype=torch.int32)
    bufs = (torch.full((8,), 99, dtype=torch.int32), torch.full((8,), 99, dtype=torch.int32))
    plans = []
    ops = _ops(
        lambda: plans.append(
            plan_mla_decode(uniform, 3, 16, kernel_impl="torch", out=bufs, identity=identity)
        )
    )
    assert [op for op in ops if op != "aten::slice"] == [], ops
    plan = plans[0]
    assert plan.token_req.data_ptr() == identity.data_ptr()
    assert plan.token_kv_len.data_ptr() == uniform.seq_lens.data_ptr()
    assert (plan.token_req.tolist(), plan.token_kv_len.tolist()) == _definition(
        [(1, 40), (1, 0), (1, 7)], 3
    )
    assert bufs[0].tolist() == [99] * 8  # the buffers are left to the other steps


def test_token_plan_causal_rows_and_padding():
    b = make_mla_batch([(1, 5), (3, 10)], heads=1, lora=16, rope=16, pad_rows=2, pad_tokens=1)
    req, kv_len = mla_token_plan(b.meta, 5)
    assert req.tolist() == [0, 1, 1, 1, -1]
    assert kv_len.tolist() == [5, 8, 9, 10, 0]


def test_plan_copies_into_persistent_buffers():
    """A CUDA graph reads the token plan at fixed addresses: the builder's buffers."""
    b = make_mla_batch([(1, 5), (3, 10)], heads=4, lora=16, rope=16, pad_rows=1)
    bufs = (torch.full((8,), 99, dtype=torch.int32), torch.full((8,), 99, dtype=torch.int32))
    plan = plan_mla_decode(b.meta, 4, 4, kernel_impl="torch", out=bufs)
    assert plan.token_req.data_ptr() == bufs[0].data_ptr()
    assert bufs[0].tolist()[:4] == [0, 1, 1, 1] and bufs[1].tolist()[:4] == [5, 8, 9, 10]
    assert isinstance(plan, TorchMLAPlan)
    with pytest.raises(ValueError, match="plan buffers hold 2 tokens, the step has 4"):
        plan_mla_decode(b.meta, 4, 4, kernel_impl="torch", out=(bufs[0][:2], bufs[1][:2]))


def test_a_plan_per_kernel_path():
    b = make_mla_batch([(1, 5), (3, 10)], heads=4, lora=16, rope=16)
    torch_plan = plan_mla_decode(b.meta, 4, 4, kernel_impl="torch")
    assert type(torch_plan) is TorchMLAPlan
    triton_plan = plan_mla_decode(b.meta, 4, 4, kernel_impl="triton")
    assert type(triton_plan) is TritonMLAPlan and triton_plan.launch.kernel == "per_token"
    assert torch.equal(triton_plan.token_kv_len, torch_plan.token_kv_len)
    with pytest.raises(dataclasses.FrozenInstanceError):
        triton_plan.launch = None
    with pytest.raises(ValueError, match="kernel_impl must be one of"):
        plan_mla_decode(b.meta, 4, 4, kernel_impl="cuda")


def test_the_launch_is_planned_at_its_first_read_once(monkeypatch):
    """A step that a FULL CUDA graph replays never reads its plan's launch: the builder's
    plan leaves it unplanned until a layer reads it, then plans it once for every layer."""
    from atom_plugin.attention.mla import launch_plan

    calls = []
    real = launch_plan.plan_launch

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(launch_plan, "plan_launch", counted)
    b = make_mla_batch([(1, 5), (1, 9)], heads=4, lora=16, rope=16)
    plan = plan_mla_decode(b.meta, 2, 4, kernel_impl="triton")
    assert calls == [] and plan.planned_launch is None
    first = plan.launch
    assert plan.launch is first and plan.planned_launch is first and len(calls) == 1
    assert first == real(2, 2, 1, 4, b.meta.max_seq_len, b.meta.query_start_loc.device)
    # a caller's own split count or config is checked (so planned) at once
    chosen = plan_mla_decode(b.meta, 2, 4, kernel_impl="triton", num_splits=3)
    assert len(calls) == 2 and chosen.planned_launch.num_splits == 3


def test_each_planned_launch_is_counted_once_by_its_kernels_name(monkeypatch):
    """PLANNED_LAUNCHES (what the engine tests read to see which kernel a decode ran)."""
    from collections import Counter

    from atom_plugin.attention.mla import plan as mla_plan

    monkeypatch.setattr(mla_plan, "PLANNED_LAUNCHES", Counter())
    b = make_mla_batch([(1, 5), (1, 9)], heads=4, lora=16, rope=16)
    unread = plan_mla_decode(b.meta, 2, 4, kernel_impl="triton")
    assert mla_plan.PLANNED_LAUNCHES == Counter()  # a graph's replayed step plans nothing
    plan = plan_mla_decode(b.meta, 2, 4, kernel_impl="triton")
    plan.launch, plan.launch  # noqa: B018 - read by every layer, planned once
    assert dict(mla_plan.PLANNED_LAUNCHES) == {"per_token": 1} and unread.planned_launch is None
    gluon = dataclasses.replace(plan.launch, kernel="gluon", schedule="rows16")
    assert gluon.name == "gluon/rows16"  # the Gluon kernel is named with its schedule


def _forbid_selection(monkeypatch):
    """Make every way to the kernel-path choice raise."""

    def chosen_again(*_args, **_kwargs):
        raise AssertionError("the kernel path was chosen again after planning")

    monkeypatch.setattr(select, "forced_kernel_impl", chosen_again)
    for name, module in list(sys.modules.items()):
        if name.startswith("atom_plugin") and hasattr(module, "select_kernel_impl"):
            monkeypatch.setattr(module, "select_kernel_impl", chosen_again)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_layers_run_the_plan_without_choosing_again(monkeypatch, path):
    """The step is planned once (the path chosen there); every layer's decode and cache
    write then run on that choice, however often, with the choice itself forbidden."""
    device = "cuda" if path == "triton" and torch.cuda.is_available() else "cpu"
    b = make_mla_batch([(1, 20), (2, 9)], heads=16, lora=32, rope=16, device=device)
    T, H, _ = b.q.shape
    monkeypatch.setenv("ATOM_PLUGIN_KERNELS", path)
    plan = plan_mla_decode(b.meta, T, H, kv_dtype=b.kv_cache.dtype)
    assert type(plan) is {"torch": TorchMLAPlan, "triton": TritonMLAPlan}[path]
    want = torch.zeros(T, H, 32, device=device)
    mla_decode_reference(b.q, b.kv_cache, b.meta, scale=0.3, output=want, kv_lora_rank=32)
    _forbid_selection(monkeypatch)
    for _layer in range(2):
        out = torch.zeros_like(want)
        mla_ops.mla_decode(b.q, b.kv_cache, b.meta, plan, scale=0.3, output=out, kv_lora_rank=32)
        torch.testing.assert_close(out, want, **tolerance(torch.float32))
        rows = b.q[:, 0]  # any rows: the write's path is what this is about
        scratch = torch.zeros_like(b.kv_cache)
        mla_ops.write_mla_kv(
            rows[:, :32], rows[:, 32:], scratch, b.meta.slot_mapping, kernel_impl=path
        )
    with pytest.raises(AssertionError, match="chosen again"):
        mla_ops.mla_decode(b.q, b.kv_cache, b.meta, scale=0.3, output=out, kv_lora_rank=32)
