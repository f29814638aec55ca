"""What the TBO workers (`parallel_config.worker_cls`) share.

Each worker is vLLM's own worker for the platform and model runner with one change:
its model runner is the plugin's (`worker_cpu` and `worker_gpu`: vLLM's V1 runner with
`TboModelRunnerMixin` in front; `worker_mrv2`: Model Runner V2 with
`AtomTboMRV2ModelRunner`), and the workspace holds a slot per micro-batch (vLLM's
scratch is keyed by `dbo_current_ubatch_id()`). The CPU and GPU workers live in
modules of their own because importing vLLM's CPU worker replaces
`torch.cuda.Event`, `torch.cuda.current_stream` and friends with CPU placeholders for
the whole process (`vllm.v1.worker.cpu.shm`): a GPU process must never import it.
"""

from __future__ import annotations


class TboStatsMixin:
    """Answers `collective_rpc("atom_tbo_stats")` with the steps run per kind."""

    def atom_tbo_stats(self) -> dict[str, int]:
        """Steps this worker ran: {"decode": split, "prefill": split, "unsplit": ...}."""
        return self.model_runner.tbo_stats()
