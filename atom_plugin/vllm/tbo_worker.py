"""The workers that TBO puts in place of vLLM's (`parallel_config.worker_cls`).

Each is vLLM's own worker for the platform with one change: its model runner is
vLLM's V1 runner with `TboModelRunnerMixin` in front, and the workspace holds a
slot per micro-batch (vLLM's scratch is keyed by `dbo_current_ubatch_id()`).
Both answer `collective_rpc("atom_tbo_stats")` with the steps run per kind.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.workspace import init_workspace_manager

from atom_plugin.tbo.runner import NUM_UBATCHES
from atom_plugin.vllm.tbo_model_runner import TboModelRunnerMixin


class AtomTboCPUModelRunner(TboModelRunnerMixin, CPUModelRunner):
    pass


class AtomTboGPUModelRunner(TboModelRunnerMixin, GPUModelRunner):
    pass


class _TboStats:
    def atom_tbo_stats(self) -> dict[str, int]:
        """Steps this worker ran: {"decode": split, "prefill": split, "unsplit": ...}."""
        return self.model_runner.tbo_stats()


class AtomTboCPUWorker(_TboStats, CPUWorker):
    def init_device(self) -> None:
        # vLLM's CPU worker builds its runner inside init_device; this replaces it
        # with the TBO runner before anything has used it.
        super().init_device()
        del self.model_runner
        init_workspace_manager(self.device, NUM_UBATCHES)
        self.model_runner = AtomTboCPUModelRunner(self.vllm_config, self.device)


class AtomTboGPUWorker(_TboStats, Worker):
    def _make_model_runner(self) -> GPUModelRunner:
        from vllm.v1.worker.gpu_worker import _num_workspace_lanes

        init_workspace_manager(
            self.device,
            NUM_UBATCHES,
            _num_workspace_lanes(self.vllm_config, self.use_v2_model_runner),
            alloc_context=lambda: self._maybe_get_memory_pool_context("workspace"),
        )
        return AtomTboGPUModelRunner(self.vllm_config, self.device)
