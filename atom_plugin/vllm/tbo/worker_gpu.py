"""The TBO worker on vLLM's CUDA and ROCm platforms (see `atom_plugin.vllm.tbo.worker`)."""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.workspace import init_workspace_manager

from atom_plugin.tbo.runner import NUM_UBATCHES
from atom_plugin.vllm.tbo.model_runner import TboModelRunnerMixin
from atom_plugin.vllm.tbo.worker import TboStatsMixin

# Imported only where vLLM has its V1 model runner (0.32, 0.33); compat checks it there.
ONLY_WITH_RUNNER = "v1"


class AtomTboGPUModelRunner(TboModelRunnerMixin, GPUModelRunner):
    pass


class AtomTboGPUWorker(TboStatsMixin, Worker):
    def _make_model_runner(self) -> GPUModelRunner:
        from vllm.v1.worker.gpu_worker import _num_workspace_lanes

        init_workspace_manager(
            self.device,
            NUM_UBATCHES,
            _num_workspace_lanes(self.vllm_config, self.use_v2_model_runner),
            alloc_context=lambda: self._maybe_get_memory_pool_context("workspace"),
        )
        return AtomTboGPUModelRunner(self.vllm_config, self.device)
