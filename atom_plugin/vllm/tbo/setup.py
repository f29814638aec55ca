"""Turning two-batch overlap on in a vLLM config (from the platform's `check_and_update_config`).

With `--additional-config '{"atom_plugin": {"tbo": "..."}}'` other than "off",
the plugin's worker (`atom_plugin.vllm.tbo.worker_cpu` or `_gpu`) takes the place of the one
vLLM would pick. A setting TBO cannot serve is refused here, at start.
"""

from __future__ import annotations

from vllm.logger import init_logger

from atom_plugin import manager
from atom_plugin.tbo.judgement import EngineLimits, tbo_judgement
from atom_plugin.vllm.compat.runners import MRV2_RELEASE, has_v1_runner, model_runner
from atom_plugin.vllm.guard import PluginRefusal, running_vllm
from atom_plugin.vllm.settings import PluginSettings

logger = init_logger("vllm.atom_plugin")

TBO_WORKERS = {
    "cpu": "atom_plugin.vllm.tbo.worker_cpu.AtomTboCPUWorker",
    "cuda": "atom_plugin.vllm.tbo.worker_gpu.AtomTboGPUWorker",
    "rocm": "atom_plugin.vllm.tbo.worker_gpu.AtomTboGPUWorker",
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
    if model_runner(vllm_config) == "mrv2":
        # docs/tbo.md ("Model Runner V2") says what its micro-batching would need.
        if not has_v1_runner():
            return (
                f"TBO runs inside vLLM's V1 model runner, which vLLM {running_vllm()} no longer "
                f"has (removed in vLLM {MRV2_RELEASE}: Model Runner V2 is its only runner); set "
                "atom_plugin tbo to off"
            )
        return (
            "TBO runs inside vLLM's V1 model runner and this engine selected Model Runner V2 "
            "(vLLM's GPU default), whose own micro-batching cannot carry the plugin's split: "
            "it splits only with --enable-dbo and data parallelism > 1, at vLLM's cut and "
            "thresholds, decided inside its execute_model. On this vLLM the V1 runner is "
            "selected by setting VLLM_USE_V2_MODEL_RUNNER to 0 "
            '(and, with --tool-call-parser atom_kimi_k3, add "v1_logits_processors": true '
            "to the atom_plugin settings to keep the K3 channel on the V1 runner)"
        )
    if model.is_encoder_decoder or model.is_multimodal_model:
        return "TBO splits text-only decoder models (this one is encoder-decoder or multimodal)"
    if model.runner_type == "pooling":
        return "TBO is for generation; pooling models are not split"
    return None


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
    """Put the TBO worker in place when `settings.tbo` asks for it; log what runs."""
    config = settings.tbo_config()
    if config is None:
        return
    refusal = tbo_refusal(device_type, vllm_config, chosen_worker)
    if refusal:
        raise PluginRefusal(f"atom_plugin tbo={settings.tbo!r} cannot run: {refusal}")
    runner = manager.microbatch_runner()
    if runner is None:
        raise PluginRefusal(
            f"atom_plugin tbo={settings.tbo!r}: no micro-batch runner is registered"
        )
    vllm_config.parallel_config.worker_cls = TBO_WORKERS[device_type]
    logger.info(
        "atom-plugin: two-batch overlap %s (%s split), micro-batch runner %s, worker %s",
        settings.tbo,
        splitting(config),
        runner.name,
        TBO_WORKERS[device_type],
    )
    for line in tbo_judgement(config, engine_limits(vllm_config)):
        logger.warning("atom-plugin: two-batch overlap %s: %s", settings.tbo, line)
