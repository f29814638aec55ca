"""Which model runner a vLLM engine uses, and what each release's runners accept.

vLLM 0.32 and 0.33 have two GPU runners: Model Runner V2 (MRV2, the GPU default) and the
V1 runner (chosen by setting `VLLM_USE_V2_MODEL_RUNNER` to 0; the CPU build's only runner).
vLLM 0.34 removed V1 together with `VllmConfig.use_v2_model_runner`: MRV2 is the only runner there,
on x86 CPUs too, and other CPUs without Triton run a standalone MRV2 runner that refuses
custom logits processors. The adapter asks these functions instead of reading the
release's attributes itself, so a release that moves them breaks one module.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

from atom_plugin.vllm.compat import release_tuple

Runner = Literal["v1", "mrv2"]
_MRV2_ONLY = (0, 34)  # the first release where Model Runner V2 is the only runner


@functools.cache
def has_v1_runner() -> bool:
    """True when the installed vLLM still ships the V1 model runner (0.32, 0.33)."""
    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def release_has_v1_runner(version: str) -> bool:
    """Whether the vLLM release `version` ships the V1 runner (the static checks ask this
    of a source tree they cannot import); an unreadable version counts as the newest."""
    release = release_tuple(version)
    return release is not None and release < _MRV2_ONLY


def model_runner(vllm_config) -> Runner:
    """'mrv2' or 'v1': the runner this engine config selects (its logits-processor
    interface, its micro-batching). Without the V1 runner every engine runs MRV2."""
    if not has_v1_runner():
        return "mrv2"
    # 0.32/0.33: a property of the config (the environment, the platform, the features).
    use_v2 = getattr(vllm_config, "use_v2_model_runner", None)
    if use_v2 is None:
        raise AttributeError(
            "this vLLM has the V1 model runner but its config does not say which runner the "
            "engine takes (no VllmConfig.use_v2_model_runner)"
        )
    return "mrv2" if use_v2 else "v1"


def standalone_cpu_runner(platform) -> bool:
    """True when `platform` runs vLLM's standalone CPU runner (0.34 on CPUs without
    Triton), which refuses custom logits processors. Releases before 0.34 lack the
    question and the runner."""
    asks = getattr(platform, "uses_standalone_cpu_model_runner", None)
    return bool(asks()) if asks is not None else False


def sampling_replay(vllm_config) -> bool:
    """True when the engine returns sampling masks for distribution replay, which vLLM
    checks against custom logits processors before the platform adds any."""
    return bool(getattr(vllm_config.model_config, "return_sampling_mask", False))
