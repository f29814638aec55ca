"""The MLA builder's per-step decode work (`MLADecodePlanner`) reads nothing back from the
device: every metadata tensor it is handed refuses host reads (on a GPU each read is a
sync, which under async scheduling stalls the host until the GPU has finished the step
before), across a uniform decode step, prefill rows on the decode kernel, decode context
parallelism and a CUDA-graph capture, on the torch and Triton plans. Plus the once-only
line that says prefill rows took the decode kernel."""

from __future__ import annotations

import pytest
import torch

from atom_plugin.attention.mla.gluon.probe import MLAStepLayout
from atom_plugin.attention.mla.plan import TritonMLAPlan
from atom_plugin.vllm.attention import mla as vllm_mla

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
}


class DeviceOnly(torch.Tensor):
    """A tensor whose values the host must not read; whatever is computed from it is one
    too (torch's default subclass propagation)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise AssertionError(f"a device tensor was read on the host: {func.__name__}")
        if func is torch.Tensor.to and any(
            isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu"
            for a in (*args[1:], *(kwargs or {}).values())
        ):
            raise AssertionError("a device tensor was copied to the host")
        return super().__torch_function__(func, types, args, kwargs or {})


def device_only(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(DeviceOnly)


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.item(),
        lambda t: t.tolist(),
        lambda t: int(t[0]),
        lambda t: bool(t[0] > 0),
        lambda t: t.cpu(),
        lambda t: t.max().item(),
        lambda t: (t + 1).numpy(),
        lambda t: t.to("cpu"),
    ],
)
def test_the_guard_catches_host_reads(read):
    """The test below can fail: each way of reading a value back raises."""
    with pytest.raises(AssertionError, match="host"):
        read(device_only(torch.tensor([3, 4], dtype=torch.int32)))


def _planner(kernel_impl, **kw):
    return vllm_mla.MLADecodePlanner(
        kernel_impl=kernel_impl,
        num_heads=16,
        kv_dtype=torch.bfloat16,
        layout=MLAStepLayout(torch.bfloat16, 64),
        max_tokens=256,
        device="cpu",
        **kw,
    )


def _step(rows: list[tuple[int, int]], pad_tokens: int = 0) -> dict:
    """vLLM's arguments for the decode rows (query tokens, seq_len) of a step."""
    qsl = [0]
    for q, _ in rows:
        qsl.append(qsl[-1] + q)
    n = qsl[-1] + pad_tokens
    return dict(
        block_table=torch.arange(len(rows) * 4, dtype=torch.int32).view(len(rows), 4),
        seq_lens=torch.tensor([s for _, s in rows], dtype=torch.int32),
        max_seq_len=max(s for _, s in rows),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        slot_mapping=torch.arange(n + 3, dtype=torch.int64),
        num_tokens=n,
        max_query_len=max(q for q, _ in rows),
    )


def _guarded(step: dict) -> dict:
    return {k: device_only(v) if isinstance(v, torch.Tensor) else v for k, v in step.items()}


def _plan_rows(planner, name: str) -> torch.Tensor:
    """The persistent tensor a step's request rows are read from: the identity rows for a
    uniform decode (no device op), else the planner's buffer."""
    return planner.identity if name == "uniform decode" else planner.buffers[0]


STEPS = {
    "uniform decode": ([(1, 40), (1, 0), (1, 7)], {}),
    "prefill rows on the decode kernel": ([(1, 40), (16, 80), (100, 100)], {}),
    "speculative rows and padding tokens": ([(3, 9), (1, 5)], {"pad_tokens": 2}),
}


@pytest.mark.parametrize("kernel_impl", ["torch", "triton"])
@pytest.mark.parametrize("name", list(STEPS))
def test_decode_metadata_reads_nothing_back(kernel_impl, name):
    rows, kw = STEPS[name]
    step = _step(rows, **kw)
    want = _planner(kernel_impl).decode_metadata(**step)
    planner = _planner(kernel_impl)
    got = planner.decode_metadata(**_guarded(step))
    assert type(got.plan) is type(want.plan)
    assert plain(got.plan.token_req).data_ptr() == _plan_rows(planner, name).data_ptr()
    assert torch.equal(plain(got.plan.token_req), plain(want.plan.token_req))
    assert torch.equal(plain(got.plan.token_kv_len), plain(want.plan.token_kv_len))
    if isinstance(want.plan, TritonMLAPlan):
        assert got.plan.launch == want.plan.launch


@pytest.mark.parametrize("kernel_impl", ["torch", "triton"])
@pytest.mark.parametrize("name", list(STEPS))
def test_the_hosts_offsets_plan_every_step_but_a_uniform_decode(kernel_impl, name, monkeypatch):
    """vLLM hands the builder the offsets on the host as well: a step with prefill or
    speculative rows takes its token plan from them (the rows counted), to the same plan,
    still reading no device tensor back."""
    from atom_plugin.attention.mla import plan as mla_plan

    rows, kw = STEPS[name]
    step = _step(rows, **kw)
    want = _planner(kernel_impl).decode_metadata(**step)
    calls = []
    real = mla_plan.host_token_rows
    monkeypatch.setattr(mla_plan, "host_token_rows", lambda *a: calls.append(a) or real(*a))
    planner = _planner(kernel_impl)
    got = planner.decode_metadata(
        **_guarded(step), query_start_loc_cpu=step["query_start_loc"].clone()
    )
    assert len(calls) == (0 if name == "uniform decode" else 1)
    assert plain(got.plan.token_req).data_ptr() == _plan_rows(planner, name).data_ptr()
    assert torch.equal(plain(got.plan.token_req), plain(want.plan.token_req))
    assert torch.equal(plain(got.plan.token_kv_len), plain(want.plan.token_kv_len))


def test_seq_lens_of_another_dtype_go_to_the_buffers():
    """vLLM's seq_lens in another dtype than int32 becomes a fresh tensor each step, at a
    new address a captured graph would not read: such a uniform decode step writes the
    planner's buffers instead of taking views."""
    step = _step([(1, 40), (1, 7)])
    step["seq_lens"] = step["seq_lens"].to(torch.int64)
    planner = _planner("triton")
    plan = planner.decode_metadata(**step).plan
    assert plan.token_req.data_ptr() == planner.buffers[0].data_ptr()
    assert plan.token_kv_len.data_ptr() == planner.buffers[1].data_ptr()
    assert (plan.token_req.tolist(), plan.token_kv_len.tolist()) == ([0, 1], [40, 7])


def test_capture_and_dcp_read_nothing_back():
    """A capture plans its splits for the longest context; under decode context
    parallelism multi-token rows count their visible local rows on the device."""
    step = _step([(1, 300), (4, 70)])
    glob = torch.tensor([600, 140], dtype=torch.int32)
    dcp = dict(dcp_world_size=2, dcp_interleave=1)
    want = _planner("triton", **dcp).decode_metadata(**step, dcp_tot_seq_lens=glob, context=32768)
    got = _planner("triton", **dcp).decode_metadata(
        **_guarded(step), dcp_tot_seq_lens=device_only(glob), context=32768
    )
    assert got.plan.launch == want.plan.launch
    # the single-token row sees its 300 local rows; the 4-token row's tokens (global
    # positions 136-139) see the even positions (rank 0) up to their own
    assert plain(got.plan.token_kv_len).tolist() == [300, 69, 69, 70, 70]


def test_prefill_rows_on_the_decode_kernel_are_announced_once(monkeypatch):
    lines = []
    monkeypatch.setattr(vllm_mla.logger, "info", lambda msg, *args: lines.append(msg % args))
    planner = _planner("torch", decode_query_len=4)  # 3 speculative tokens
    planner.decode_metadata(**_step([(4, 9), (1, 5)]))  # verification rows only
    assert lines == []
    planner.decode_metadata(**_step([(1, 40), (16, 80)]))
    planner.decode_metadata(**_step([(9, 40)]))
    assert lines == [
        "ATOM_AITER_MLA: prefill rows of up to 128 new tokens run on the decode kernel "
        "(this step: up to 16)"
    ]


LAYOUT = MLAStepLayout(torch.bfloat16, 64)


def test_prefill_rows_go_to_the_decode_only_where_its_kernel_takes_them(monkeypatch):
    rows = vllm_mla.PREFILL_ROWS_ON_DECODE
    assert vllm_mla.prefill_rows_on_decode("torch", "cpu", LAYOUT) == rows
    assert vllm_mla.prefill_rows_on_decode("aiter", "cuda", LAYOUT) == 1
    # Triton without the Gluon kernel: its own tiles for long rows do not fit at 16 heads.
    assert vllm_mla.prefill_rows_on_decode("triton", "cpu", LAYOUT) == 1
    monkeypatch.setattr(
        "atom_plugin.attention.mla.plan.gluon_mla_problems", lambda device, layout: []
    )
    assert vllm_mla.prefill_rows_on_decode("triton", "cuda", LAYOUT) == rows


def test_the_builder_hands_the_planner_vllms_host_offsets():
    """vLLM's `build` passes `_build_decode` the host copy of the decode rows' offsets;
    the builder passes it on, so steps with prefill or speculative rows plan from it."""
    from argparse import Namespace

    builder = object.__new__(vllm_mla.AtomAiterMLAMetadataBuilder)
    seen = {}
    builder.planner = Namespace(decode_metadata=lambda **kw: seen.update(kw))
    builder._slot_mapping, builder._capture_context = torch.arange(3), None
    qsl_cpu = torch.tensor([0, 1, 3], dtype=torch.int32)
    builder._build_decode(
        block_table_tensor=torch.zeros(2, 4, dtype=torch.int32),
        seq_lens_device=torch.tensor([9, 12], dtype=torch.int32),
        max_seq_len=12,
        query_start_loc_cpu=qsl_cpu,
        query_start_loc_device=qsl_cpu.clone(),
        num_decode_tokens=3,
        max_query_len=2,
        dcp_tot_seq_lens_device=None,
    )
    assert seen["query_start_loc_cpu"] is qsl_cpu and seen["num_tokens"] == 3
