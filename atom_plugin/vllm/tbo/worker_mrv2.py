"""The TBO worker for Model Runner V2 on vLLM's CUDA and ROCm platforms (see
`atom_plugin.vllm.tbo.worker` and `atom_plugin.vllm.tbo.mrv2_runner`)."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.workspace import init_workspace_manager

from atom_plugin.tbo.runner import NUM_UBATCHES
from atom_plugin.vllm.compat.mrv2 import num_workspace_lanes
from atom_plugin.vllm.tbo.mrv2_runner import AtomTboMRV2ModelRunner
from atom_plugin.vllm.tbo.worker import TboStatsMixin


class AtomTboMRV2Worker(TboStatsMixin, Worker):
    def _make_model_runner(self) -> AtomTboMRV2ModelRunner:
        init_workspace_manager(
            self.device,
            NUM_UBATCHES,
            num_workspace_lanes(self.vllm_config),
            alloc_context=lambda: self._maybe_get_memory_pool_context("workspace"),
        )
        return AtomTboMRV2ModelRunner(self.vllm_config, self.device)
