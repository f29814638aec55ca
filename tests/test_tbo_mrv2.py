"""Two-batch overlap on Model Runner V2: the decisions its route makes, on the CPU build.

MRV2 runs only on a GPU (the CPU build's config refuses it without Triton; the engine
tests are tests/test_gpu_tbo_mrv2.py). Here: which steps split, where, and which graph
bucket a step replays (`TboStepPlanner`), the descriptor vLLM's graph manager answers
with, the prefix-cache veto fed from vLLM's scheduler outputs, each micro-batch's
`InputBatch` cut by vLLM's own slicing, and, in a fresh process with vLLM's
distributed state set up, vLLM 0.32's `dispatch_cg_and_sync_dp` and `CudaGraphManager`
with the plugin's manager adopted.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_plugin.tbo.graphs import BucketGraphs
from atom_plugin.tbo.mode import (
    BatchShape,
    ForwardMode,
    GraphKey,
    TboConfig,
    plan_request_graphs,
)
from atom_plugin.tbo.slices import maybe_create_ubatch_slices
from atom_plugin.tbo.split import decode_ubatch_request_ranges, prefill_ubatch_ranges
from tests.engine import engine_env

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = [1, 2, 4, 8, 16]


def solo(shape, config, keys):
    return ForwardMode.decide([shape], 0, config, keys)


def planner_with_graphs(config, dp_size=1, live=True):
    from atom_plugin.vllm.tbo.mrv2_plan import TboStepPlanner

    planner = TboStepPlanner(config, dp_size, solo if dp_size > 1 else None)
    planner.graphs = BucketGraphs(object(), plan_request_graphs(BUCKETS, 1, config))
    planner.graphs_live = live
    return planner


# -- which steps split, where, and which bucket replays --------------------------------
@settings(max_examples=120, deadline=None)
@given(st.integers(1, 40), st.integers(3, 20), st.booleans())
def test_decode_steps_split_at_the_bucket_on_replay_and_at_their_requests_eagerly(
    n, threshold, live
):
    from vllm.config import CUDAGraphMode

    FULL = CUDAGraphMode.FULL  # noqa: N806
    config = TboConfig(decode_min_requests=threshold, prefill=False)
    planner = planner_with_graphs(config, live=live)
    split = planner.plan([1] * n, 1, lambda: pytest.fail("decodes are never searched"))
    bucket = next((b for b in BUCKETS if b >= n), None) if live else None
    desc = planner.descriptor()
    if bucket is not None:
        # vLLM pads the step to the bucket; it splits exactly when the bucket does
        if bucket < threshold or bucket <= 2:
            assert split is None and desc is None
            return
        assert split.mode.replay and split.mode.bucket == bucket
        assert [(s.request_slice.start, s.request_slice.stop) for s in split.slices] == list(
            decode_ubatch_request_ranges(bucket)
        )
        assert (desc.cg_mode, desc.num_tokens, desc.num_reqs) == (FULL, bucket, bucket)
        assert desc.num_ubatches == 2 and desc.uniform_token_count == 1
    elif n >= threshold:
        assert not split.mode.replay
        assert [(s.request_slice.start, s.request_slice.stop) for s in split.slices] == list(
            decode_ubatch_request_ranges(n)
        )
        assert (desc.cg_mode, desc.num_tokens, desc.num_reqs, desc.num_ubatches) == (
            CUDAGraphMode.NONE,
            n,
            n,
            2,
        )
    else:
        assert split is None and desc is None
        assert planner.stats()["unsplit"] == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=12), st.integers(2, 80))
def test_prefill_steps_split_at_the_token_midpoint_from_the_threshold(lens, threshold):
    config = TboConfig(prefill_min_tokens=threshold, decode=False)
    planner = planner_with_graphs(config)
    uniform = 1 if all(q == 1 for q in lens) else None  # vLLM's call for a decode
    split = planner.plan(lens, uniform, lambda: False)
    if uniform is not None or sum(lens) < threshold:
        assert split is None
        return
    ranges = prefill_ubatch_ranges(lens)
    assert [(s.token_slice.start, s.token_slice.stop) for s in split.slices] == list(ranges.tokens)
    assert [(s.request_slice.start, s.request_slice.stop) for s in split.slices] == list(
        ranges.requests
    )
    assert split.straddles == ranges.straddles


def test_a_step_vllm_does_not_call_a_uniform_decode_is_not_one():
    from atom_plugin.tbo.planner import step_shape

    assert step_shape([1, 1, 1], 1) == BatchShape(3, 3, 1)
    # one-token prompts with no context: vLLM keeps them out of its decode graphs
    assert step_shape([1, 1, 1], None).kind == "prefill"
    # speculative verification rows: a decode of 3-token queries, which never splits
    assert step_shape([3, 3], 3) == BatchShape(2, 6, 3)
    planner = planner_with_graphs(TboConfig(decode_min_requests=3))
    assert planner.plan([3] * 6, 3, lambda: False) is None


def test_split_decode_steps_run_eagerly_until_vllm_has_recorded_its_graphs():
    planner = planner_with_graphs(TboConfig(decode_min_requests=4), live=False)
    assert not planner.plan([1] * 5, 1, lambda: False).mode.replay
    planner.graphs_live = True
    assert planner.plan([1] * 5, 1, lambda: False).mode.bucket == 8


def test_with_dp_an_eager_split_votes_full_then_answers_none():
    """vLLM takes the ranks' smallest graph mode from the first dispatch; NONE there would
    drop the micro-batches, so only the second dispatch (the agreed one) says NONE."""
    from vllm.config import CUDAGraphMode

    planner = planner_with_graphs(TboConfig(prefill_min_tokens=4), dp_size=2)
    planner.plan([5, 9], None, lambda: False)
    first, second = planner.descriptor(), planner.descriptor()
    assert first.cg_mode == CUDAGraphMode.FULL and second.cg_mode == CUDAGraphMode.NONE
    assert first.num_ubatches == second.num_ubatches == 2
    solo_planner = planner_with_graphs(TboConfig(prefill_min_tokens=4))
    solo_planner.plan([5, 9], None, lambda: False)
    assert solo_planner.descriptor().cg_mode == CUDAGraphMode.NONE


def test_a_dummy_run_never_splits_and_joins_the_dp_agreement_as_an_idle_rank():
    seen = []

    def agree(shape, config, keys):
        seen.append(shape)
        return solo(shape, config, keys)

    from atom_plugin.vllm.tbo.mrv2_plan import TboStepPlanner

    TboStepPlanner(TboConfig(), 1).plan_idle()  # DP = 1: nothing to agree on
    planner = TboStepPlanner(TboConfig(), 2, agree)
    planner.plan_idle()
    assert seen == [BatchShape(0, 0, splittable=False)] and planner.split is None
    assert planner.descriptor() is None
    with pytest.raises(ValueError, match="data parallelism 2 needs an agreement"):
        TboStepPlanner(TboConfig(), 2)


def test_a_recorded_bucket_replays_with_no_step_to_record():
    """MRV2's replays build the recording step's inputs only for a bucket's first step."""
    from collections import Counter

    from tbo_harness.rerun_graphs import RerunGraphs

    graphs = BucketGraphs(RerunGraphs(), plan_request_graphs([4], 1, TboConfig()))
    key, steps = GraphKey(4, 1), Counter()
    with pytest.raises(ValueError, match="not recorded yet and no step was given"):
        graphs.run(key, None, steps)
    assert graphs.run(key, lambda: "out", steps) == "out"
    assert graphs.run(key, None, steps) == "out"
    assert steps == {"captured": 1, "replayed": 2}


# -- the prefix-cache veto, from vLLM's scheduler outputs --------------------------------
def scheduler_output(new=(), cached=(), finished=(), preempted=None):
    """A real vLLM SchedulerOutput: `new` (req_id, block ids, computed tokens), `cached`
    (req_id, new block ids or None)."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [
        NewRequestData(
            req_id=r,
            prompt_token_ids=[0],
            mm_features=[],
            sampling_params=None,
            pooling_params=None,
            block_ids=(list(ids),),
            num_computed_tokens=computed,
            lora_request=None,
        )
        for r, ids, computed in new
    ]
    data = CachedRequestData.make_empty()
    data.req_ids = [r for r, _ in cached]
    data.new_block_ids = [None if ids is None else (list(ids),) for _, ids in cached]
    out.scheduled_cached_reqs = data
    out.finished_req_ids = set(finished)
    out.preempted_req_ids = preempted
    return out


def test_block_ids_follow_requests_through_vllms_scheduler_outputs():
    from atom_plugin.vllm.tbo.mrv2_plan import RequestBlockIds

    blocks = RequestBlockIds()
    blocks.update(scheduler_output(new=[("a", [4, 5], 0), ("b", [4, 5, 9], 32)]))
    blocks.update(scheduler_output(cached=[("a", [6]), ("b", None)]))
    [(table, size)] = blocks.tables(["b", "a", "unknown"], [16])
    assert size == 16 and table.tolist() == [[4, 5, 9], [4, 5, 6], [-1, -1, -1]]
    blocks.update(scheduler_output(finished={"a"}, preempted={"b"}))
    assert len(blocks) == 0
    blocks.update(scheduler_output(new=[("b", [7], 0)]))  # resumed: admitted whole again
    assert blocks.tables(["b"], [16])[0][0].tolist() == [[7]]


def test_a_reader_of_blocks_written_in_the_same_step_keeps_the_step_whole():
    from atom_plugin.tbo.hazards import reads_blocks_written_now
    from atom_plugin.vllm.tbo.mrv2_plan import RequestBlockIds

    blocks = RequestBlockIds()
    # "b" was admitted on a 32-token prefix hit on blocks 4 and 5, which "a" computes now
    blocks.update(scheduler_output(new=[("a", [4, 5, 6], 0), ("b", [4, 5, 9], 32)]))
    lens, computed = [40, 8], np.array([0, 32])

    def hazard(req_ids):
        return reads_blocks_written_now(computed, lens, blocks.tables(req_ids, [16]))

    planner = planner_with_graphs(TboConfig(prefill_min_tokens=16))
    assert planner.plan(lens, None, lambda: hazard(["a", "b"])) is None
    assert planner.stats()["vetoed"] == 1 and planner.stats()["unsplit"] == 1
    blocks.update(scheduler_output(new=[("b", [7, 8, 9], 32)]))  # its own blocks: no hazard
    assert planner.plan(lens, None, lambda: hazard(["a", "b"])) is not None
    # a step that could not split anyway is not searched
    small = planner_with_graphs(TboConfig(prefill_min_tokens=100))
    assert small.plan(lens, None, lambda: pytest.fail("searched")) is None


# -- each micro-batch's InputBatch, cut by vLLM's `_slice_input_batch` -------------------
def step_input_batch(buffers, lens, contexts, bucket=None):
    """vLLM's InputBatch for a step of `lens` new tokens over `contexts`, padded to
    `bucket` requests of one token as vLLM pads a FULL decode step."""
    from dataclasses import replace

    from vllm.v1.worker.gpu.input_batch import InputBatch

    n, total = len(lens), sum(lens)
    rows, tokens = bucket or n, bucket or total
    batch = InputBatch.make_dummy(n, total, buffers)
    qsl = np.full(rows + 1, total, dtype=np.int32)
    qsl[0] = 0
    qsl[1 : n + 1] = np.cumsum(lens)
    buffers.query_start_loc[: rows + 1] = torch.from_numpy(qsl)
    seq_lens = np.zeros(rows, dtype=np.int32)  # vLLM zeroes the padding rows'
    seq_lens[:n] = np.array(contexts) + np.array(lens)
    buffers.seq_lens.zero_()
    buffers.seq_lens[:rows] = torch.from_numpy(seq_lens)
    return replace(
        batch,
        num_reqs_after_padding=rows,
        num_tokens_after_padding=tokens,
        query_start_loc=buffers.query_start_loc[: rows + 1],
        query_start_loc_np=qsl,
        seq_lens=buffers.seq_lens[:rows],
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens.copy()),
        num_scheduled_tokens=np.array(lens, dtype=np.int32),
        num_computed_tokens_np=np.array(contexts),
        input_ids=buffers.input_ids[:tokens],
        positions=buffers.positions[:tokens],
        is_padding=buffers.is_padding[:tokens],
    )


@pytest.fixture
def slicing():
    from vllm.v1.worker.gpu.input_batch import InputBuffers

    buffers = InputBuffers(max_num_reqs=16, max_num_tokens=64, device=torch.device("cpu"))
    qsl = [torch.zeros(17, dtype=torch.int32) for _ in range(2)]
    seq = [torch.zeros(16, dtype=torch.int32) for _ in range(2)]
    return buffers, qsl, seq


def vllm_slices(slices):
    from atom_plugin.vllm.tbo.ubatches import vllm_slices

    return vllm_slices(slices)


def planned(mode, lens):
    from atom_plugin.tbo.planner import PlannedSplit

    return PlannedSplit(mode, maybe_create_ubatch_slices(mode, lens), len(lens))


def test_a_replayed_bucket_is_cut_at_its_halves_with_inert_one_token_padding_rows(slicing):
    from atom_plugin.vllm.tbo.mrv2_ubatch import ubatch_input_batches

    buffers, qsl_bufs, seq_bufs = slicing
    config = TboConfig(decode_min_requests=4)
    mode = ForwardMode.decide([BatchShape(5, 5, 1)], 0, config, [GraphKey(8, 1)])
    batch = step_input_batch(buffers, [1] * 5, [7, 3, 9, 1, 4], bucket=8)
    slices = vllm_slices(planned(mode, [1] * 5).slices)
    first, second = ubatch_input_batches(batch, mode, slices, qsl_bufs, seq_bufs)
    for ub, rows, seq_lens in ((first, 4, [8, 4, 10, 2]), (second, 4, [5, 0, 0, 0])):
        assert ub.num_reqs_after_padding == ub.num_tokens_after_padding == rows
        assert ub.query_start_loc.tolist() == list(range(rows + 1))  # the recorded layout
        assert ub.seq_lens.tolist() == seq_lens  # padding rows: no context, nothing read
        assert ub.max_query_len == 1
    # the offsets live in this runner's buffers, whose addresses a replay reads
    assert first.query_start_loc.data_ptr() == qsl_bufs[0].data_ptr()
    assert second.seq_lens.data_ptr() == seq_bufs[1].data_ptr()
    # the step's own offsets: padding rows own one token each now
    assert batch.query_start_loc.tolist() == list(range(9))


def test_a_straddling_prefill_request_sees_its_first_part_as_context(slicing):
    from atom_plugin.vllm.tbo.mrv2_ubatch import ubatch_input_batches

    buffers, qsl_bufs, seq_bufs = slicing
    lens, contexts = [5, 9, 3], [0, 2, 6]
    mode = ForwardMode.decide([BatchShape.from_query_lens(lens)], 0, TboConfig())
    split = planned(mode, lens)
    assert split.straddles
    batch = step_input_batch(buffers, lens, contexts)
    first, second = ubatch_input_batches(batch, mode, vllm_slices(split.slices), qsl_bufs, seq_bufs)
    # micro-batch 0: tokens [0, 8): request 0 whole, request 1's first 3 tokens
    assert first.query_start_loc.tolist() == [0, 5, 8]
    assert first.seq_lens.tolist() == [5, 2 + 3]
    # micro-batch 1: tokens [8, 17): request 1's other 6 over 5 of context, request 2
    assert second.query_start_loc.tolist() == [0, 6, 9]
    assert second.seq_lens.tolist() == [2 + 9, 6 + 3]
    assert [ub.num_tokens for ub in (first, second)] == [8, 9]


def test_a_decode_step_that_is_not_one_token_per_request_is_refused(slicing):
    from atom_plugin.vllm.tbo.decode_graphs import pad_rows_one_token_each

    buffers, _, _ = slicing
    batch = step_input_batch(buffers, [2, 1], [0, 0], bucket=4)
    with pytest.raises(ValueError, match="2 one-token decode requests cannot end at token 3"):
        pad_rows_one_token_each(batch.query_start_loc_np, batch.query_start_loc, 2, 4)


# -- vLLM 0.32's MRV2 classes with the plugin's manager adopted (fresh process) ----------
PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment, initialize_model_parallel)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.dp_utils import skip_dp_coordination
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
    from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp
    from atom_plugin.tbo.graphs import BucketGraphs
    from atom_plugin.tbo.mode import ForwardMode, TboConfig, plan_request_graphs
    from atom_plugin.vllm.compat.mrv2 import decode_graph_sizes, num_workspace_lanes
    from atom_plugin.vllm.tbo.mrv2_graphs import TboCudaGraphManager
    from atom_plugin.vllm.tbo.mrv2_plan import TboStepPlanner
    from atom_plugin.vllm.tbo.setup import mrv2_refusal, tbo_refusal
    from scripts.serve import free_port

    def manager(cfg, mode):
        made = ModelCudaGraphManager(cfg, torch.device("cpu"), CUDAGraphMode.NONE, 1)
        # The CPU platform has no graph pool: the descriptors are vLLM's own for `mode`.
        made.cudagraph_mode = mode
        made._init_candidates()
        return made

    if __name__ == "__main__":
        model = sys.argv[1]
        args = dict(model=model, dtype="float32", max_model_len=256, max_num_seqs=16)
        cfg = EngineArgs(**args).create_engine_config()
        out = {"lanes": num_workspace_lanes(cfg), "refusals": {
            "plain": mrv2_refusal(cfg),
            "lora": mrv2_refusal(EngineArgs(**args, enable_lora=True).create_engine_config()),
            "spec": mrv2_refusal(EngineArgs(**args, speculative_config={
                "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                "prompt_lookup_min": 2}).create_engine_config()),
        }}
        # The CPU platform turns vLLM's micro-batching off; a GPU platform keeps it on.
        for name, setting in (("dbo", {"enable_dbo": True}), ("ubatch_size", {"ubatch_size": 2})):
            dbo = EngineArgs(**args).create_engine_config()
            for key, value in setting.items():
                setattr(dbo.parallel_config, key, value)
            out["refusals"][name] = tbo_refusal("cuda", dbo, "auto")
        cfg.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 16]
        cfg.compilation_config.max_cudagraph_capture_size = 16
        with set_current_vllm_config(cfg):
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, "gloo")
            initialize_model_parallel(1, 1)
            sizes = decode_graph_sizes(manager(cfg, CUDAGraphMode.FULL_AND_PIECEWISE))
            out["sizes"] = {"full_and_piecewise": sizes,
                            "piecewise": decode_graph_sizes(manager(cfg, CUDAGraphMode.PIECEWISE))}
            config = TboConfig(decode_min_requests=4, prefill_min_tokens=32)
            steps = {"decode-5": [1] * 5, "decode-3": [1] * 3, "decode-20": [1] * 20,
                     "prefill": [5, 9, 3, 20], "prefill-small": [5, 9]}
            out["dispatch"] = {}
            for dp in (1, 2):
                agree = lambda s, c, k: ForwardMode.decide([s], 0, c, k)
                planner = TboStepPlanner(config, dp, agree if dp > 1 else None)
                planner.graphs = BucketGraphs(object(), plan_request_graphs(sizes, 1, config))
                ubatch_runner = type("Stand", (), {"planner": planner})()
                graph_manager = TboCudaGraphManager.adopt(
                    manager(cfg, CUDAGraphMode.NONE), ubatch_runner)
                planner.graphs_live = True
                for name, lens in steps.items():
                    uniform = 1 if all(q == 1 for q in lens) else None
                    planner.plan(lens, uniform, lambda: False)
                    with skip_dp_coordination():
                        desc, _ = dispatch_cg_and_sync_dp(
                            graph_manager, len(lens), sum(lens), uniform, dp, 0,
                            max_query_len=max(lens), parallel_config=cfg.parallel_config,
                            allow_ubatching=True, uniform_decode=uniform == 1)
                    planner.end_step()
                    out["dispatch"][f"dp{dp}-{name}"] = [
                        desc.cg_mode.name, desc.num_tokens, desc.num_reqs, desc.num_ubatches]
        print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.fixture(scope="module")
def probe(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(tiny_llama)],
        capture_output=True,
        text=True,
        env=engine_env(),
        cwd=ROOT,
        timeout=300,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(lines[0][len("RESULT ") :])


def test_split_decode_buckets_are_vllms_full_one_token_decode_graphs(probe):
    assert probe["sizes"]["full_and_piecewise"] == BUCKETS
    assert probe["sizes"]["piecewise"] == []  # no FULL decode graph: split decodes run eagerly


def test_vllms_dispatch_runs_the_planned_split_at_dp_1_and_2(probe):
    """vLLM 0.32's own `dispatch_cg_and_sync_dp` (DP 2 with its coordination skipped:
    every rank's vote is this one's) against the adopted graph manager."""
    for dp in (1, 2):
        got = {k.split("-", 1)[1]: v for k, v in probe["dispatch"].items() if k[2] == str(dp)}
        assert got == {
            "decode-5": ["FULL", 8, 8, 2],  # replayed split at bucket 8
            "decode-3": ["FULL", 4, 4, 2],  # bucket 4 reaches the threshold
            "decode-20": ["NONE", 20, 20, 2],  # above every bucket: eager split
            "prefill": ["NONE", 37, 4, 2],
            "prefill-small": ["NONE", 14, 2, 1],  # below the threshold: vLLM's own answer
        }, (dp, got)


def test_the_release_dependent_reads_answer_on_032(probe):
    assert probe["lanes"] == 1
    assert probe["refusals"]["plain"] is None
    assert "LoRA adapters (--enable-lora) are not split by TBO" in probe["refusals"]["lora"]
    assert "speculative decoding (--speculative-config) is not split" in probe["refusals"]["spec"]
    for name in ("dbo", "ubatch_size"):  # never both splits on one step
        assert (
            "vLLM's own micro-batching (--enable-dbo or --ubatch-size) is on"
            in (probe["refusals"][name])
        )


# -- what the host-API check covers ------------------------------------------------------
def test_the_private_names_the_route_reads_exist_in_the_installed_vllm():
    import importlib

    from atom_plugin.vllm.compat.mrv2 import PRIVATE_READS

    for module, cls, name in PRIVATE_READS:
        mod = importlib.import_module(module)
        if cls is None:
            assert callable(getattr(mod, name)), (module, name)
        else:  # an attribute vLLM's constructor sets
            assert f"self.{name}" in inspect.getsource(getattr(mod, cls).__init__), (cls, name)


def test_the_check_names_a_micro_batch_runner_that_vllm_could_not_call(tmp_path):
    """vLLM calls the micro-batch runner through `self.ubatch_runner` (the role's
    attribute): those calls are checked against an override too. The adapter's own
    MRV2 overrides are listed in tests/test_vllm_host_api.py (EXPECTED_OVERRIDES)."""
    from atom_plugin.vllm.compat.check import check
    from atom_plugin.vllm.compat.hosts import InstalledHost
    from tests.test_vllm_host_api import throwaway

    adapter, _ = throwaway(
        tmp_path,
        "ubatch_adapter",
        "from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner\n\n\n"
        "class NarrowRunner(UBatchRunner):\n"
        "    def prepare(self, input_batch, block_tables, slot_mappings, cg_mode):\n"
        "        return None\n",
        module="runner",
    )
    problems = check(InstalledHost(), adapter)
    calls = [p for p in problems if p.kind == "call"]
    # vLLM's execute_model passes for_capture= through `self.ubatch_runner`
    assert any("gpu/model_runner.py" in p.detail and "for_capture" in p.detail for p in calls), (
        problems
    )


def test_the_mrv2_worker_and_runner_are_vllms_with_the_plugins_parts():
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner
    from vllm.v1.worker.gpu_worker import Worker

    from atom_plugin.vllm.tbo.mrv2_graphs import TboCudaGraphManager
    from atom_plugin.vllm.tbo.mrv2_runner import AtomTboMRV2ModelRunner
    from atom_plugin.vllm.tbo.mrv2_ubatch import TboUBatchRunner
    from atom_plugin.vllm.tbo.worker_mrv2 import AtomTboMRV2Worker

    assert issubclass(AtomTboMRV2Worker, Worker)
    assert issubclass(AtomTboMRV2ModelRunner, GPUModelRunner)
    assert issubclass(TboUBatchRunner, UBatchRunner)
    assert issubclass(TboCudaGraphManager, ModelCudaGraphManager)
    with pytest.raises(TypeError, match="adopts vLLM's ModelCudaGraphManager"):
        TboCudaGraphManager.adopt(types.SimpleNamespace(), None)
