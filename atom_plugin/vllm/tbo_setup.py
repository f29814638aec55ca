"""Turning two-batch overlap on in a vLLM config (from the platform's `check_and_update_config`).

With `--additional-config '{"atom_plugin": {"tbo": "..."}}'` other than "off",
the plugin's worker (`atom_plugin.vllm.tbo_worker`) takes the place of the one
vLLM would pick. A setting TBO cannot serve is refused here, at start.
"""

from __future__ import annotations

from vllm.logger import init_logger

from atom_plugin import manager
from atom_plugin.vllm.settings import PluginSettings

logger = init_logger("vllm.atom_plugin")

TBO_WORKERS = {
    "cpu": "atom_plugin.vllm.tbo_worker.AtomTboCPUWorker",
    "cuda": "atom_plugin.vllm.tbo_worker.AtomTboGPUWorker",
    "rocm": "atom_plugin.vllm.tbo_worker.AtomTboGPUWorker",
}


def tbo_refusal(device_type: str, vllm_config, chosen_worker: str) -> str | None:
    """Why TBO cannot run with this config, or None."""
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    if device_type not in TBO_WORKERS:
        return f"platform {device_type!r} has no TBO worker (only {', '.join(TBO_WORKERS)})"
    if chosen_worker not in ("auto", TBO_WORKERS[device_type]):
        return (
            f"--worker-cls {chosen_worker} was chosen, but TBO runs on the plugin's worker "
            f"{TBO_WORKERS[device_type]}; drop --worker-cls or set atom_plugin tbo to off"
        )
    if parallel.pipeline_parallel_size > 1:
        return (
            f"pipeline parallelism (--pipeline-parallel-size {parallel.pipeline_parallel_size}) "
            "is not supported with TBO"
        )
    if parallel.enable_dbo:
        return "vLLM's own micro-batching (--enable-dbo) is on; use one of the two, not both"
    if vllm_config.use_v2_model_runner:
        return (
            "TBO runs inside vLLM's V1 model runner and Model Runner V2 is selected; "
            "set VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if model.is_encoder_decoder or model.is_multimodal_model:
        return "TBO splits text-only decoder models (this one is encoder-decoder or multimodal)"
    if model.runner_type == "pooling":
        return "TBO is for generation; pooling models are not split"
    return None


def install_tbo(device_type: str, vllm_config, settings: PluginSettings, chosen_worker: str):
    """Put the TBO worker in place when `settings.tbo` asks for it; log what runs."""
    config = settings.tbo_config()
    if config is None:
        return
    refusal = tbo_refusal(device_type, vllm_config, chosen_worker)
    if refusal:
        raise ValueError(f"atom_plugin tbo={settings.tbo!r} cannot run: {refusal}")
    runner = manager.microbatch_runner()
    if runner is None:
        raise ValueError(f"atom_plugin tbo={settings.tbo!r}: no micro-batch runner is registered")
    vllm_config.parallel_config.worker_cls = TBO_WORKERS[device_type]
    splits = []
    if config.decode:
        splits.append(f"decode steps of >= {config.decode_min_requests} requests")
    if config.prefill:
        splits.append(f"prefill steps of >= {config.prefill_min_tokens} tokens")
    logger.info(
        "atom-plugin: two-batch overlap %s (%s split), micro-batch runner %s, worker %s",
        settings.tbo,
        " and ".join(splits),
        runner.name,
        TBO_WORKERS[device_type],
    )
