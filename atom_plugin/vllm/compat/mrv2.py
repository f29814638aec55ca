"""What two-batch overlap on Model Runner V2 reads of vLLM that is private or differs by release.

The route (docs/tbo.md, "Model Runner V2") subclasses vLLM's `GPUModelRunner`,
`UBatchRunner` and `ModelCudaGraphManager`; `python -m atom_plugin.vllm.compat`
checks those overrides, vLLM's calls of them and the names imported from vLLM. The
reads below are neither: private attributes of vLLM objects and functions whose
arguments changed between releases. Each lives here, once, so a release that
moves one breaks this module and nothing else.

`PRIVATE_READS` names them for the tests, which look each one up in the installed
vLLM's sources (tests/test_tbo_mrv2.py).
"""

from __future__ import annotations

import inspect

# (module, class or None, name): private names the route reads or calls, in vLLM
# 0.32, 0.33 and 0.34 alike.
PRIVATE_READS: tuple[tuple[str, str | None, str], ...] = (
    # the decode descriptors vLLM records as FULL graphs: the split decode buckets
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", "_capture_descs"),
    # cuts a step's InputBatch into one micro-batch's, into persistent buffers
    ("vllm.v1.worker.gpu.ubatch_utils", None, "_slice_input_batch"),
    # the workspace's lanes per micro-batch slot (its arguments differ by release)
    ("vllm.v1.worker.gpu_worker", None, "_num_workspace_lanes"),
)


def num_workspace_lanes(vllm_config) -> int:
    """vLLM's workspace lanes for a Model Runner V2 worker.

    vLLM 0.32 and 0.33 ask which runner the worker builds
    (`_num_workspace_lanes(vllm_config, use_v2_model_runner)`); 0.34 has only
    Model Runner V2 and takes the config alone.
    """
    from vllm.v1.worker.gpu_worker import _num_workspace_lanes

    # The arguments depend on the release, hence the splat (its arity is read here).
    two = len(inspect.signature(_num_workspace_lanes).parameters) == 2
    args = (vllm_config, True) if two else (vllm_config,)
    return _num_workspace_lanes(*args)


def decode_graph_sizes(manager) -> list[int]:
    """The request counts of the one-token decode batches `manager` records as FULL graphs
    (its own, unsplit ones; LoRA variants left out), smallest first."""
    from vllm.config import CUDAGraphMode

    descs = manager._capture_descs.get(CUDAGraphMode.FULL, [])
    return sorted(
        {
            d.num_reqs
            for d in descs
            if d.uniform_token_count == 1
            and d.num_reqs is not None
            and d.num_active_loras == 0
            and d.num_ubatches == 1
        }
    )
