"""Which model runner an engine uses: vLLM's V1 runner or Model Runner V2 (MRV2).

vLLM 0.32 and 0.33 carry both (MRV2 is the GPU default, the CPU build runs V1);
0.34 removed the V1 runner and `VllmConfig.use_v2_model_runner` with it.
"""

from __future__ import annotations

import importlib.util

V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def has_v1_runner() -> bool:
    """Whether the installed vLLM still has Model Runner V1."""
    return importlib.util.find_spec(V1_RUNNER_MODULE) is not None


def model_runner(vllm_config) -> str:
    """'v1' or 'mrv2': the runner this engine's workers build (always 'mrv2' without V1)."""
    if not has_v1_runner():
        return "mrv2"
    return "mrv2" if vllm_config.use_v2_model_runner else "v1"
