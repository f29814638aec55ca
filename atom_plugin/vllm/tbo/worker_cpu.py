"""The TBO worker on vLLM's CPU platform (see `atom_plugin.vllm.tbo.worker`).

Importing vLLM's CPU worker patches `torch.cuda` with CPU placeholders for the
whole process, so only a CPU engine imports this module.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.workspace import init_workspace_manager

from atom_plugin.tbo.runner import NUM_UBATCHES
from atom_plugin.vllm.tbo.model_runner import TboModelRunnerMixin
from atom_plugin.vllm.tbo.worker import TboStatsMixin

# Imported only where vLLM has its V1 model runner (0.32, 0.33); compat checks it there.
ONLY_WITH_RUNNER = "v1"


class AtomTboCPUModelRunner(TboModelRunnerMixin, CPUModelRunner):
    pass


class AtomTboCPUWorker(TboStatsMixin, CPUWorker):
    def init_device(self) -> None:
        # vLLM's CPU worker builds its runner inside init_device; this replaces it
        # with the TBO runner before anything has used it.
        super().init_device()
        del self.model_runner
        init_workspace_manager(self.device, NUM_UBATCHES)
        self.model_runner = AtomTboCPUModelRunner(self.vllm_config, self.device)
