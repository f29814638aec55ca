"""Turning two-batch overlap on in a vLLM config (from the platform's `check_and_update_config`).

With `--additional-config '{"atom_plugin": {"tbo": "..."}}'` other than "off",
the plugin's worker for the platform and the engine's model runner takes the place
of the one vLLM would pick: `worker_mrv2` for Model Runner V2 on a GPU, `worker_gpu`
or `worker_cpu` for the V1 runner (vLLM 0.32 and 0.33; the CPU build runs it). A
setting TBO cannot serve is refused here, at start.
"""

from __future__ import annotations

from vllm.logger import init_logger

from atom_plugin import manager
from atom_plugin.tbo.judgement import EngineLimits, tbo_judgement
from atom_plugin.vllm.compat.runners import has_v1_runner, model_runner
from atom_plugin.vllm.guard import PluginRefusal
from atom_plugin.vllm.settings import PluginSettings

logger = init_logger("vllm.atom_plugin")

# (platform, model runner) -> the TBO worker
TBO_WORKERS = {
    ("cpu", "v1"): "atom_plugin.vllm.tbo.worker_cpu.AtomTboCPUWorker",
    ("cuda", "v1"): "atom_plugin.vllm.tbo.worker_gpu.AtomTboGPUWorker",
    ("rocm", "v1"): "atom_plugin.vllm.tbo.worker_gpu.AtomTboGPUWorker",
    ("cuda", "mrv2"): "atom_plugin.vllm.tbo.worker_mrv2.AtomTboMRV2Worker",
    ("rocm", "mrv2"): "atom_plugin.vllm.tbo.worker_mrv2.AtomTboMRV2Worker",
}


def tbo_refusal(device_type: str, vllm_config, chosen_worker: str) -> str | None:
    """Why TBO cannot run with this config, or None."""
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    runner = model_runner(vllm_config)
    if device_type not in {d for d, _ in TBO_WORKERS}:
        platforms = sorted({d for d, _ in TBO_WORKERS})
        return f"platform {device_type!r} has no TBO worker (only {', '.join(platforms)})"
    worker = TBO_WORKERS.get((device_type, runner))
    if worker is None:
        unset = " (leave VLLM_USE_V2_MODEL_RUNNER unset)" if has_v1_runner() else ""
        return (
            f"TBO on vLLM's {device_type} platform runs inside the V1 model runner{unset}; "
            "this engine uses Model Runner V2 there"
        )
    if chosen_worker not in ("auto", worker):
        return (
            f"--worker-cls {chosen_worker} was chosen, but TBO runs on the plugin's worker "
            f"{worker}; drop --worker-cls or set atom_plugin tbo to off"
        )
    if parallel.pipeline_parallel_size > 1:
        return (
            f"pipeline parallelism (--pipeline-parallel-size {parallel.pipeline_parallel_size}) "
            "is not supported with TBO"
        )
    if parallel.use_ubatching:
        return (
            "vLLM's own micro-batching (--enable-dbo or --ubatch-size) is on: it and the "
            "plugin's TBO would both split the step; turn it off or set atom_plugin tbo to off"
        )
    if runner == "mrv2":
        refusal = mrv2_refusal(vllm_config)
        if refusal:
            return refusal
    if model.is_encoder_decoder or model.is_multimodal_model:
        return "TBO splits text-only decoder models (this one is encoder-decoder or multimodal)"
    if model.runner_type == "pooling":
        return "TBO is for generation; pooling models are not split"
    return None


def mrv2_refusal(vllm_config) -> str | None:
    """What TBO on Model Runner V2 does not split, or None."""
    parallel = vllm_config.parallel_config
    contexts = {
        "--decode-context-parallel-size": parallel.decode_context_parallel_size,
        "--prefill-context-parallel-size": parallel.prefill_context_parallel_size,
    }
    for flag, size in contexts.items():
        if size > 1:
            return f"context parallelism ({flag} {size}) is not split by TBO"
    if vllm_config.lora_config is not None:
        return "LoRA adapters (--enable-lora) are not split by TBO on Model Runner V2"
    if vllm_config.speculative_config is not None:
        # The drafter reads the step's attention metadata, which a split step builds per
        # micro-batch only.
        return "speculative decoding (--speculative-config) is not split by TBO on Model Runner V2"
    return None


def tbo_worker(device_type: str, vllm_config) -> str:
    """The TBO worker for this platform and the engine's model runner (after `tbo_refusal`)."""
    return TBO_WORKERS[(device_type, model_runner(vllm_config))]


def splitting(config) -> str:
    """Which steps the config splits, in words."""
    splits = []
    if config.decode:
        splits.append(f"decode steps of >= {config.decode_min_requests} requests")
    if config.prefill:
        splits.append(f"prefill steps of >= {config.prefill_min_tokens} tokens")
    return " and ".join(splits)


def judgement_for_engine_args(argv: list[str]) -> list[str]:
    """What TBO will do in a `vllm serve` engine with these engine arguments (`atom-plugin
    info --engine-args`): vLLM builds the engine's config from them, the platform's check
    included, so the defaults and the refusals are those of a start."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="--engine-args"))
    engine_args = EngineArgs.from_cli_args(parser.parse_args(argv))
    try:
        vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    except ValueError as err:
        return [f"refused at start: {err}"]
    settings = PluginSettings.from_vllm_config(vllm_config)
    config = settings.tbo_config()
    if config is None:
        return ["off"]
    head = f"{settings.tbo} ({splitting(config)} split)"
    return [head, *tbo_judgement(config, engine_limits(vllm_config))]


def engine_limits(vllm_config) -> EngineLimits:
    """What bounds this engine's steps, as `tbo_judgement` reads it."""
    scheduler, parallel = vllm_config.scheduler_config, vllm_config.parallel_config
    return EngineLimits(
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs,
        expert_parallel=parallel.enable_expert_parallel,
        all2all_backend=parallel.all2all_backend,
    )


def install_tbo(device_type: str, vllm_config, settings: PluginSettings, chosen_worker: str):
    """Put the TBO worker in place (`settings.tbo` is not off); log what runs."""
    config = settings.tbo_config()
    refusal = tbo_refusal(device_type, vllm_config, chosen_worker)
    if refusal:
        raise PluginRefusal(f"atom_plugin tbo={settings.tbo!r} cannot run: {refusal}")
    runner = manager.microbatch_runner()
    if runner is None:
        raise PluginRefusal(
            f"atom_plugin tbo={settings.tbo!r}: no micro-batch runner is registered"
        )
    worker = tbo_worker(device_type, vllm_config)
    vllm_config.parallel_config.worker_cls = worker
    logger.info(
        "atom-plugin: two-batch overlap %s (%s split), micro-batch runner %s, worker %s",
        settings.tbo,
        splitting(config),
        runner.name,
        worker,
    )
    for line in tbo_judgement(config, engine_limits(vllm_config)):
        logger.warning("atom-plugin: two-batch overlap %s: %s", settings.tbo, line)
